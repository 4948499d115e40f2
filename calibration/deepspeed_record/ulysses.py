"""Record DeepSpeed 0.19.8's Ulysses sequence parallelism (ALST's UlyssesSPAttentionHF, issue 49)
on CPU/gloo: the collectives (op, size, dtype, process group, order) and each rank's peak tensor
memory over a further optimizer step.

Calibration tooling (imports torch and deepspeed; never imported by zsim or its tests). The model is
calibration/deepspeed_record's GPT (cases.MODEL); each layer's attention core runs through
deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF over sdpa, as
register_with_transformers installs it in a Hugging Face model: the q, k and v all-to-alls, the
position_ids all-gather, the context's all-to-all. The groups are DeepSpeed's
(parallel_state_sp.initialize_sequence_parallel, passed to deepspeed.initialize as the mpu, as
accelerate does); each rank feeds its 1/sp slice of every sample's tokens and position_ids
(UlyssesSPDataLoaderAdapter's split), and the loss is the HF Trainer's
(transformers integrations/deepspeed.py deepspeed_sp_compute_loss: the shard's loss sum and token
count all-reduced over the sequence group): calibration/core/ulysses.py, which `zsim validate
--engine deepspeed` uses too. The learned position table is read at rows 0..S/sp-1 on every rank
(values differ from a real run's, not shapes).

One case (from the repository root):

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 /tmp/dsvenv/bin/torchrun --standalone --nproc-per-node 2 \\
      -m calibration.deepspeed_record.ulysses --case stage3_sp2_w2 --out tests/fixtures/deepspeed_ulysses

Every case: /tmp/dsvenv/bin/python -m calibration.deepspeed_record.ulysses --all
"""
from __future__ import annotations

import copy
import os

from calibration.deepspeed_record.launch import (PEAK_STEP, case_main, end_recording, gather_traces, index_model,
                                                 run_facts, start_recording, torchrun_each, write_fixture)
from calibration.deepspeed_record.cases import MODEL, OPT_STEPS, _base, _with

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "deepspeed_ulysses")
PREFETCH = {"stage3_prefetch_bucket_size": 50000000}   # as cases.py's stage3_default


def _case(cfg, world_size, sp, why="", tiled_mlp=0):
    """sp 1: the same run without Ulysses (no mpu, the GPT's own core), a baseline. `tiled_mlp`:
    each block's MLP through DeepSpeed's TiledMLP over that many shards (0: not)."""
    return {"ds_config": _with(cfg, sequence_parallel_size=sp) if sp > 1 else cfg, "world_size": world_size,
            "sp": sp, "why": why, "tiled_mlp": tiled_mlp}


def build_cases():
    c = {}
    c["stage3_sp2_w2"] = _case(_base(3, **PREFETCH), 2, 2, why="ZeRO-3, one sequence group of 2")
    # the default reduce_bucket_size makes stage 3's IPG buffer (fp32 under SP) most of the peak:
    # with 1e6 the activations and the exchanges weigh
    bucket = {"reduce_bucket_size": 1000000}
    c["stage3_sp2_w2_bucket_1e6"] = _case(_base(3, **PREFETCH, **bucket), 2, 2,
                                          why="ZeRO-3, one sequence group of 2, activations at the peak")
    c["stage3_sp2_w4_bucket_1e6"] = _case(_base(3, **PREFETCH, **bucket), 4, 2,
                                          why="ZeRO-3 over 4 ranks, two sequence groups of 2 (data parallel 2)")
    c["stage3_sp4_w4_bucket_1e6"] = _case(_base(3, **PREFETCH, **bucket), 4, 4,
                                          why="ZeRO-3, one sequence group of 4")
    c["stage2_sp2_w2_bucket_1e6"] = _case(_base(2, **bucket), 2, 2, why="ZeRO-2, one sequence group of 2")
    # baselines without Ulysses: ZeRO-2 reducing in fp32 (what SP makes it) and in bf16
    c["stage2_sp1_w2_comm_fp32_bucket_1e6"] = _case(_with(_base(2, **bucket), communication_data_type="fp32"), 2, 1,
                                                    why="ZeRO-2 without Ulysses, reducing in fp32 as SP does")
    c["stage2_sp1_w2_bucket_1e6"] = _case(_base(2, **bucket), 2, 1, why="ZeRO-2 without Ulysses")
    # micro-batch 16: the activations and the exchanges at the peak, with and without Ulysses
    mb16 = {"train_micro_batch_size_per_gpu": 16}
    c["stage3_sp2_w2_mb16_bucket_1e6"] = _case(_with(_base(3, **PREFETCH, **bucket), **mb16), 2, 2,
                                               why="ZeRO-3, activations at the peak")
    c["stage3_sp1_w2_mb16_bucket_1e6"] = _case(_with(_base(3, **PREFETCH, **bucket), communication_data_type="fp32",
                                                     **mb16), 2, 1, why="its baseline without Ulysses")
    c["stage2_sp2_w2_mb16_bucket_1e6"] = _case(_with(_base(2, **bucket), **mb16), 2, 2,
                                               why="ZeRO-2, activations at the peak")
    c["stage2_sp1_w2_mb16_bucket_1e6"] = _case(_with(_base(2, **bucket), communication_data_type="fp32", **mb16), 2, 1,
                                               why="its baseline without Ulysses")
    # ALST's TiledMLP over 4 shards, with and without Ulysses, against the mb16 runs above
    c["stage3_sp1_w2_mb16_bucket_1e6_tiled4"] = _case(
        _with(_base(3, **PREFETCH, **bucket), communication_data_type="fp32", **mb16), 2, 1,
        why="TiledMLP without Ulysses", tiled_mlp=4)
    c["stage3_sp2_w2_mb16_bucket_1e6_tiled4"] = _case(_with(_base(3, **PREFETCH, **bucket), **mb16), 2, 2,
                                                      why="TiledMLP with Ulysses", tiled_mlp=4)
    c["stage3_sp1_w2_bucket_1e6"] = _case(_with(_base(3, **PREFETCH, **bucket), communication_data_type="fp32"), 2, 1,
                                          why="ZeRO-3 without Ulysses, reducing in fp32 as SP does")
    c["stage1_sp2_w4_gas2_bucket_1e6"] = _case(_with(_base(1, **bucket), gradient_accumulation_steps=2), 4, 2,
                                               why="ZeRO-1 with gradient accumulation, data parallel 2")
    c["stage3_sp2_w2_comm_bf16_bucket_1e6"] = _case(
        _with(_base(3, **PREFETCH, **bucket), seq_parallel_communication_data_type="bf16"), 2, 2,
        why="the gradient reduction in bf16, not the SP default fp32")
    return c


CASES = build_cases()


def _tiled_mlps(model, shards: int):
    """Each block's MLP through TiledMLP (the residual added outside it, as a Hugging Face block
    adds it), its weights the compute_params whose gradients ZeRO takes at the last shard."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def fn(mlp, x):
        return mlp.fc_out(mlp.ops["act"](mlp.fc_in(x)))

    def tiled(mlp):
        params = [p for p in mlp.parameters()]

        def forward(b, x1):
            return x1 + TiledMLP.apply(fn, mlp, b, shards, params)
        return forward

    for layer in model.layers:
        layer.mlp.forward = tiled(layer.mlp)


def run_case(name, out_dir):
    rank = start_recording()
    import deepspeed
    import torch
    import torch.distributed as td

    from calibration.core.memory import TensorMemoryTracker
    from calibration.core.model import GPT
    from calibration.core.ulysses import Ulysses
    from calibration.deepspeed_record.recorder import RECORDS, STATE

    case = CASES[name]
    sp = case["sp"]
    cfg = copy.deepcopy(case["ds_config"])
    gas, mb = cfg["gradient_accumulation_steps"], cfg["train_micro_batch_size_per_gpu"]
    STATE["phase"] = "init"
    dp_rank = rank // sp
    model = GPT(MODEL).initialized(seed=1234)
    ulysses = None
    if sp > 1:
        ulysses = Ulysses(MODEL, sp, mb, MODEL.seq_len)
        ulysses.install(model)
    if case["tiled_mlp"]:
        _tiled_mlps(model, case["tiled_mlp"])
    param_list = index_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(4321 + dp_rank)     # the sequence group's ranks share their samples
    losses = []
    peak = None

    def opt_step(s):
        for m in range(gas):
            idx = torch.randint(0, MODEL.vocab, (mb, MODEL.seq_len), generator=g)
            tgt = torch.randint(0, MODEL.vocab, (mb, MODEL.seq_len), generator=g)
            if ulysses is not None:
                idx, tgt = ulysses.shard(idx, tgt)
            STATE.update(opt_step=s, micro_step=m, phase="forward")
            loss = engine(idx, tgt)
            if ulysses is not None:
                loss = ulysses.loss(loss, tgt.numel())
            STATE["phase"] = "backward"
            engine.backward(loss)
            STATE["phase"] = "step"
            engine.step()
            STATE.update(phase="post", micro_step=None, opt_step=None)
            losses.append(float(loss.detach().float()))

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg,
                                           mpu=None if ulysses is None else ulysses.mpu)
    engine.train()
    for s in range(OPT_STEPS):
        opt_step(s)
    n_kept = len(RECORDS)
    td.barrier()
    tr = TensorMemoryTracker().start()
    with tr:
        opt_step(OPT_STEPS)
    peak = tr.peak
    del RECORDS[n_kept:]

    gathered, identical = gather_traces(peak=peak)
    if rank == 0:
        doc = {
            "case": name, "why": case["why"], "world_size": td.get_world_size(), "sequence_parallel_size": sp,
            "tiled_mlp_shards": case["tiled_mlp"],
            **run_facts(MODEL, param_list),
            "command": (f"DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node "
                        f"{case['world_size']} -m calibration.deepspeed_record.ulysses --case {name}"),
            "ds_config": cfg,
            "params": param_list,
            "optimizer": {"class": type(engine.optimizer).__name__, "client": "torch.optim.AdamW(lr=1e-3)"},
            "engine": {"communication_data_type": str(engine.communication_data_type),
                       "seq_dp_world_size": engine.seq_dp_world_size,
                       "train_batch_size": engine.train_batch_size()},
            "gradient_accumulation_steps": gas,
            "optimizer_steps": OPT_STEPS,
            "losses": losses[:OPT_STEPS * gas],
            "peak_bytes_per_rank": [x["peak"] for x in gathered],
            "peak_step": PEAK_STEP,
            "ranks_identical_trace": identical,
            "collectives": RECORDS,
        }
        path = write_fixture(doc, out_dir, name)
        print(f"[ulysses] {name}: {len(RECORDS)} collectives, peaks={doc['peak_bytes_per_rank']}, "
              f"identical={identical} -> {path}", flush=True)
    end_recording()


def run_all(names, out_dir):
    torchrun_each("calibration.deepspeed_record.ulysses", [(n, CASES[n]["world_size"], {}) for n in names], out_dir,
                  "/tmp/ds49ext")


def main():
    case_main(CASES, DEFAULT_OUT, run_case, run_all)


if __name__ == "__main__":
    main()
