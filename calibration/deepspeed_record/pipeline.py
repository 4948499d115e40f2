"""Record DeepSpeed's PipelineEngine on CPU/gloo: the calibration GPT as a PipelineModule (the
embedding, the blocks, the final norm and the head as its layers, the loss as loss_fn), one
train_batch per step, every send/recv and collective logged per rank (recorder.py).

    torchrun --standalone --nproc-per-node 4 -m calibration.deepspeed_record.pipeline \
        --stages 2 --out tests/fixtures/pipeline

writes pp<stages>_world<world>.json (rank -> its calls), which tests/schedule/test_pipeline.py compares
with zsim's schedule of the same run. `--tied`: the head shares the embedding's weight through
TiedLayerSpec (the model without learned positions, so the tied copy is the word embedding
alone), which adds ReduceTiedGrads (pp<stages>_world<world>_tied.json). `--tensor T`: a model-parallel
grid (PipeModelDataParallelTopology, T model-parallel ranks per stage), on which the
PipelineEngine partitions the tensors it sends between stages over the slice (model-parallel)
group (pipe_partitioned / grad_partitioned; pp<stages>_tp<T>_world<world>.json; `--whole-grads`:
grad_partitioned false, pp<stages>_tp<T>_world<world>_whole_grads.json). The layers
are the same plain GPT's, replicated on the T ranks (no Megatron layers: DeepSpeed partitions
on any model-parallel grid, and the replicas hold the same values, so the gathered tensors are
whole).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from calibration.core.measured import exit_without_teardown
from calibration.core.model import GPT, Block, Embedding, Norm, cross_entropy, pipeline_layers
from calibration.deepspeed_record.recorder import RECORDS, STATE, install_recorder
from zsim.specs.model import ModelSpec

MODEL = ModelSpec(layers=4, hidden=128, heads=4, vocab=256, seq_len=32, ffn_hidden=512, tied_embeddings=False,
                  position="learned", norm="layernorm", bias=True, glu=False, fused_qkv=True)
MICRO_BATCH = 2
GAS = 4
OPT_STEPS = 2


def config(stages: int, world: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": GAS,
            "train_batch_size": MICRO_BATCH * GAS * (world // stages),
            "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
            "steps_per_print": 1000000, "wall_clock_breakdown": False}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tied", action="store_true")
    ap.add_argument("--tensor", type=int, default=1, help="model-parallel ranks per stage")
    ap.add_argument("--whole-grads", action="store_true", help="ds_config pipeline.grad_partitioned false")
    args = ap.parse_args()
    install_recorder()

    import torch
    import torch.distributed as td

    td.init_process_group("gloo")
    import deepspeed  # noqa: E402  (after the wrappers are installed)
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = td.get_rank(), td.get_world_size()
    model = dataclasses.replace(MODEL, tied_embeddings=True, position="rope") if args.tied else MODEL
    if args.tied:
        from deepspeed.pipe import LayerSpec, TiedLayerSpec

        def head(embedding, x):
            return torch.nn.functional.linear(x, embedding.weight)

        layers = [TiedLayerSpec("embed", Embedding, model.vocab, model.hidden),
                  *[LayerSpec(Block, model) for _ in range(model.layers)], LayerSpec(Norm, model.norm, model.hidden),
                  TiedLayerSpec("embed", Embedding, model.vocab, model.hidden, forward_fn=head)]
    else:
        layers = pipeline_layers(GPT(model).initialized(seed=1234))
    if args.tensor > 1:
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        topo = PipeModelDataParallelTopology(num_pp=args.stages, num_mp=args.tensor,
                                             num_dp=world // (args.stages * args.tensor))
        module = PipelineModule(layers=layers, loss_fn=cross_entropy, topology=topo, partition_method="parameters")
    else:
        module = PipelineModule(layers=layers, loss_fn=cross_entropy, num_stages=args.stages,
                                partition_method="parameters")
    if args.tied:
        # LayerSpec builds the modules with torch.empty: give them values (uninitialised memory
        # overflows, and the step is then skipped); the tied copies start equal
        torch.manual_seed(1234)
        for name, p in sorted(module.named_parameters()):
            torch.nn.init.normal_(p.data, std=0.02)
        module._synchronize_tied_weights()
    cfg = config(args.stages, world // args.tensor)
    if args.whole_grads:
        cfg["pipeline"] = {"grad_partitioned": False}
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=cfg)
    if args.whole_grads:
        # _exec_recv_grads caches the output's meta as outputs[0].to('cpu') and then overwrites
        # outputs[0].data with the whole output: on a CPU device .to('cpu') is the same tensor, so
        # the cache turns bf16 and the next from_meta asserts (on a GPU it is a copy). The cache
        # set beforehand to the same meta, as a copy
        from deepspeed.runtime.utils import PartitionedTensor

        shape = (MICRO_BATCH, model.seq_len, model.hidden)
        engine.pipe_partition_grad_meta_cache = PartitionedTensor(
            torch.zeros(shape), group=engine.grid.get_slice_parallel_group()).to_meta().clone()
    g = torch.Generator().manual_seed(4321 + engine.grid.get_data_parallel_rank())
    batches = [(torch.randint(0, MODEL.vocab, (MICRO_BATCH, MODEL.seq_len), generator=g),
                torch.randint(0, MODEL.vocab, (MICRO_BATCH, MODEL.seq_len), generator=g))
               for _ in range(GAS * OPT_STEPS)]
    data = iter(batches)
    losses = []
    for step in range(OPT_STEPS):
        STATE.update(opt_step=step, phase="train_batch")
        losses.append(float(engine.train_batch(data_iter=data)))
    STATE["phase"] = "post"
    keys = ("op", "fn", "numel", "dtype", "group_size", "opt_step") + (("caller",) if args.tensor > 1 else ())
    mine = [{k: r.get(k) for k in keys} for r in RECORDS]
    gathered = [None] * world
    td.all_gather_object(gathered, {"stage": engine.stage_id, "calls": mine, "loss": losses,
                                    "model_parallel_rank": engine.grid.get_slice_parallel_rank()})
    if rank == 0:
        doc = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "stages": args.stages,
               "world_size": world, "tensor": args.tensor, "ds_config": cfg, "gradient_accumulation_steps": GAS,
               "optimizer_steps": OPT_STEPS,
               "model": {k: v for k, v in dataclasses.asdict(model).items() if v is not None},
               "ranks": gathered}
        os.makedirs(args.out, exist_ok=True)
        tp = f"_tp{args.tensor}" if args.tensor > 1 else ""
        tail = ("_tied" if args.tied else "") + ("_whole_grads" if args.whole_grads else "")
        path = os.path.join(args.out, f"pp{args.stages}{tp}_world{world}{tail}.json")
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=0, sort_keys=True)
            fh.write("\n")
        print(f"[record] {path}: {[len(x['calls']) for x in gathered]} calls per rank", flush=True)
    td.barrier()
    td.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
