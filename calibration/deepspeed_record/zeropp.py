"""Record DeepSpeed 0.19.8's ZeRO++ keys (issue 48) on CPU/gloo: the collectives (op, size, dtype,
process group, order) and each rank's peak tensor memory, or the exact error where the feature
does not run on a CPU.

Calibration tooling (imports torch and deepspeed; never imported by zsim or its tests). The same
model and recorder as calibration/deepspeed_record (cases.MODEL, recorder.py, annotations.py), plus
per case: the world size, the environment DeepSpeed reads its node size from (LOCAL_SIZE, through
CPU_Accelerator.device_count), the members of each collective's process group, and a third
optimizer step run under calibration/core/memory.py's TensorMemoryTracker (as
calibration/core/measured.py measures a peer's peak), its collectives not kept.

One case (from the repository root):

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=/tmp/ds48ext \\
      /tmp/ds48venv/bin/torchrun --standalone --nproc-per-node 4 \\
      -m calibration.deepspeed_record.zeropp --case stage3_hpz2_w4 --out tests/fixtures/deepspeed_zeropp

Every case, one torchrun each (LOCAL_SIZE set as the case says):

    /tmp/ds48venv/bin/python -m calibration.deepspeed_record.zeropp --all --out tests/fixtures/deepspeed_zeropp

A case that DeepSpeed refuses or cannot run here writes `<case>.json` with `error` (type, message,
the DeepSpeed frame that raised) and the collectives issued before it, instead of a trace.
"""
from __future__ import annotations

import copy
import os
import traceback

from calibration.deepspeed_record.launch import (PEAK_STEP, case_main, end_recording, gather_traces, index_model,
                                                 run_facts, start_recording, torchrun_each, write_fixture)
from calibration.deepspeed_record.cases import MICRO_BATCH, MODEL, OPT_STEPS, _base, _with

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_OUT = os.path.join(REPO_ROOT, "tests", "fixtures", "deepspeed_zeropp")
PREFETCH = {"stage3_prefetch_bucket_size": 50000000}   # as cases.py's stage3_default


def _case(cfg, world_size, local_size=None, expect="runs", why=""):
    return {"ds_config": cfg, "world_size": world_size, "local_size": local_size, "expect": expect, "why": why}


def build_cases():
    c = {}
    # ---- baselines at the ZeRO++ cases' world sizes (cases.py's stage3_default)
    c["stage3_default_w4"] = _case(_base(3, **PREFETCH), 4, why="ZeRO-3 at 4 ranks, the hpZ/qgZ baseline")
    # ---- hpZ: groups._create_zero_param_parallel_group takes consecutive global ranks, no node notion
    c["stage3_hpz2_w4"] = _case(_base(3, zero_hpz_partition_size=2, **PREFETCH), 4,
                                why="hpZ secondary group of 2 inside a DP group of 4")
    # the default reduce_bucket_size (5e8 elements) makes stage 3's IPG buffer ~1 GB of torch.empty on a
    # CPU, most of the tracked peak: the same pair with a 1e6 bucket shows the secondary partition
    c["stage3_reduce_bucket_1e6_w4"] = _case(_base(3, reduce_bucket_size=1000000, **PREFETCH), 4,
                                             why="ZeRO-3 baseline whose peak is not the IPG buffer")
    c["stage3_hpz2_reduce_bucket_1e6_w4"] = _case(
        _base(3, zero_hpz_partition_size=2, reduce_bucket_size=1000000, **PREFETCH), 4,
        why="hpZ's extra memory against stage3_reduce_bucket_1e6_w4")
    c["stage3_prefetch_0_reuse_0_w4"] = _case(_base(3, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0), 4,
                                              why="the baseline of stage3_hpz2_w4_prefetch_0_reuse_0")
    c["stage3_prefetch_0_reuse_0_reduce_bucket_1e6_w4"] = _case(
        _base(3, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0, reduce_bucket_size=1000000), 4,
        why="released after forward, peak not the IPG buffer: the baseline of the hpZ case below")
    c["stage3_hpz2_prefetch_0_reuse_0_reduce_bucket_1e6_w4"] = _case(
        _base(3, zero_hpz_partition_size=2, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0,
              reduce_bucket_size=1000000), 4,
        why="the secondary partitions alive through the backward: hpZ's extra memory at the peak")
    c["stage3_hpz2_w2"] = _case(_base(3, zero_hpz_partition_size=2, **PREFETCH), 2,
                                why="hpZ group == DP group: the secondary path with nothing saved")
    c["stage3_hpz2_w4_gas2"] = _case(_with(_base(3, zero_hpz_partition_size=2, **PREFETCH),
                                           gradient_accumulation_steps=2), 4,
                                     why="secondary tensors live across micro-steps, dropped at the step")
    c["stage3_hpz2_w4_prefetch_0_reuse_0"] = _case(
        _base(3, zero_hpz_partition_size=2, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0), 4,
        why="every backward gather a fetch after a release: each from the secondary partition")
    c["stage2_hpz2_w2"] = _case(_base(2, zero_hpz_partition_size=2), 2,
                                why="stages 1/2 never read zero_hpz_partition_size (engine.py:2651-2698)")
    # ---- qgZ: engine.py:2159 builds the all-to-all groups; stage3.py:1928 uses them only when
    # world_size // device_count() > 1 (device_count: LOCAL_SIZE on the CPU accelerator)
    c["stage3_qgz_w4_1node"] = _case(_base(3, zero_quantized_gradients=True, **PREFETCH), 4, local_size=4,
                                     why="one node: falls back to reduce_scatter_coalesced")
    c["stage3_qgz_w4_2nodes"] = _case(_base(3, zero_quantized_gradients=True, **PREFETCH), 4, local_size=2,
                                      expect="error", why="two nodes: all_to_all_quant_reduce needs QuantizerBuilder")
    # ---- qwZ and quantized non-trainable weights: CUDAQuantizer() in Init.__init__
    c["stage3_qwz_w2"] = _case(_base(3, zero_quantized_weights=True, **PREFETCH), 2, expect="error",
                               why="CUDAQuantizer loads QuantizerBuilder at init")
    c["stage3_qnontrainable_w2"] = _case(_base(3, zero_quantized_nontrainable_weights=True, **PREFETCH), 2,
                                         expect="error", why="CUDAQuantizer loads QuantizerBuilder at init")
    c["stage3_hpz2_qwz_qgz_w4_2nodes"] = _case(
        _base(3, zero_hpz_partition_size=2, zero_quantized_weights=True, zero_quantized_gradients=True, **PREFETCH),
        4, local_size=2, expect="error", why="the full ZeRO++ config of the tutorial")
    # ---- MiCS: removed from 0.19.8 (runtime/config.py _REMOVED_ZERO_CONFIG_KEYS)
    c["stage3_mics2_w4"] = _case(_base(3, mics_shard_size=2, **PREFETCH), 4, expect="error",
                                 why="runtime/config.py:120 rejects the key")
    c["stage3_mics2_hier_w4"] = _case(_base(3, mics_shard_size=2, mics_hierarchical_params_gather=True,
                                            **PREFETCH), 4, expect="error", why="runtime/config.py:120")
    return c


CASES = build_cases()


def _ds_error_frames(exc, depth=3):
    """The innermost DeepSpeed frames of the traceback, outermost first (file:line:function)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/deepspeed/" in f.filename]
    return [f"deepspeed/{f.filename.split('/deepspeed/', 1)[1]}:{f.lineno}:{f.name}" for f in frames[-depth:]]


def run_case(name, out_dir):
    rank = start_recording()
    import deepspeed
    import torch
    import torch.distributed as td

    from calibration.core.memory import TensorMemoryTracker
    from calibration.core.model import GPT
    from calibration.deepspeed_record.recorder import RECORDS, STATE

    case = CASES[name]
    cfg = copy.deepcopy(case["ds_config"])
    gas = cfg["gradient_accumulation_steps"]
    model = GPT(MODEL).initialized(seed=1234)
    param_list = index_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(4321 + rank)
    losses, error, engine = [], None, None
    secondary_bytes = []
    peak = None

    def micro_batch():
        idx = torch.randint(0, MODEL.vocab, (MICRO_BATCH, MODEL.seq_len), generator=g)
        tgt = torch.randint(0, MODEL.vocab, (MICRO_BATCH, MODEL.seq_len), generator=g)
        return idx, tgt

    def opt_step(s, record_secondary):
        for m in range(gas):
            idx, tgt = micro_batch()
            STATE.update(opt_step=s, micro_step=m, phase="forward")
            loss = engine(idx, tgt)
            STATE["phase"] = "backward"
            engine.backward(loss)
            if record_secondary:
                # hpZ: the secondary partitions alive once the backward is done (stage3.py
                # invalidate_secondary_tensor drops them in _post_step)
                secondary_bytes.append(sum(p.ds_secondary_tensor.numel() * p.ds_secondary_tensor.element_size()
                                           for p in model.parameters()
                                           if getattr(p, "ds_secondary_tensor", None) is not None))
            STATE["phase"] = "step"
            engine.step()
            STATE.update(phase="post", micro_step=None, opt_step=None)
            losses.append(float(loss.detach().float()))

    try:
        STATE["phase"] = "init"
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        engine.train()
        for s in range(OPT_STEPS):
            opt_step(s, record_secondary=s == OPT_STEPS - 1)
        # peak tensor memory of one more optimizer step (calibration/core/measured.py's way);
        # its collectives are dropped
        n_kept = len(RECORDS)
        td.barrier()
        tr = TensorMemoryTracker().start()
        with tr:
            opt_step(OPT_STEPS, record_secondary=False)
        peak = tr.peak
        del RECORDS[n_kept:]
    except Exception as exc:  # noqa: BLE001 (recorded: the point of an "error" case)
        error = {"type": type(exc).__name__, "message": str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                 "raised_at": _ds_error_frames(exc), "phase": STATE["phase"]}
        print(f"[zeropp] rank {rank}: {error}", flush=True)

    gathered, identical = gather_traces(peak=peak, error=error)
    if rank == 0:
        doc = {
            "case": name,
            "why": case["why"],
            "expect": case["expect"],
            "world_size": td.get_world_size(),
            "local_size": case["local_size"],
            "device_count": deepspeed.get_accelerator().device_count(),
            **run_facts(MODEL, param_list),
            "command": ("DS_ACCELERATOR=cpu OMP_NUM_THREADS=1"
                        + (f" LOCAL_SIZE={case['local_size']}" if case["local_size"] else "")
                        + f" torchrun --standalone --nproc-per-node {case['world_size']}"
                        f" -m calibration.deepspeed_record.zeropp --case {name}"),
            "ds_config": cfg,
            "params": param_list,
            "optimizer": {"class": type(engine.optimizer).__name__ if engine is not None else None,
                          "client": "torch.optim.AdamW(lr=1e-3)"},
            "gradient_accumulation_steps": gas,
            "optimizer_steps": OPT_STEPS,
            "losses": losses[:OPT_STEPS * gas],
            "error": error,
            "errors_per_rank": [x["error"] for x in gathered],
            "peak_bytes_per_rank": [x["peak"] for x in gathered],
            "peak_step": PEAK_STEP,
            "secondary_tensor_bytes_after_backward": secondary_bytes,
            "ranks_identical_trace": identical,
            "collectives": RECORDS,
        }
        path = write_fixture(doc, out_dir, name)
        print(f"[zeropp] {name}: {len(RECORDS)} collectives, error={error and error['type']}, "
              f"peaks={doc['peak_bytes_per_rank']}, identical={identical} -> {path}", flush=True)
    end_recording()


def run_all(names, out_dir):
    # LOCAL_SIZE: the ranks per node DeepSpeed's CPU accelerator reports (device_count)
    local = {n: {"LOCAL_SIZE": str(CASES[n]["local_size"])} if CASES[n]["local_size"] else {} for n in names}
    torchrun_each("calibration.deepspeed_record.zeropp", [(n, CASES[n]["world_size"], local[n]) for n in names], out_dir,
                  "/tmp/ds48ext")


def main():
    case_main(CASES, DEFAULT_OUT, run_case, run_all)


if __name__ == "__main__":
    main()
