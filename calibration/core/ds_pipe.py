"""A pipelined scenario on DeepSpeed 0.19.8's own PipelineEngine (`zsim validate --engine
deepspeed` with parallelism.pipeline > 1), measured as calibration/core/run.py measures the own
core: one `train_batch` per optimizer step (its 1F1B TrainSchedule over the scenario's GAS
micro-batches), the sends, recvs and collectives of the last timed step per rank, peak tensor
memory per rank.

The model is calibration/core/model.py's GPT with the own core's initial values and data,
handed to PipelineModule as its layers as calibration/deepspeed_record/pipeline.py does (the
embedding with the positions, the blocks, the final norm, the head; the loss as loss_fn), cut
by the scenario's partition_method. Each rank keeps only its stage's parameters (the other
layers' storage is dropped after the build, as LayerSpec would never have built them).
"""
from __future__ import annotations

import time


def main(args, sc) -> int:
    from calibration.core.peers import RECORD, _optimizer, ds_config, install_recorder

    install_recorder()
    import torch
    import torch.distributed as dist
    from torch import nn

    import deepspeed
    from deepspeed.pipe import PipelineModule

    from calibration.core.measured import exit_without_teardown, write_measurement
    from calibration.core.memory import TensorMemoryTracker
    from calibration.core.model import GPT, batch, cross_entropy

    if sc.model.tied_embeddings or sc.model.position != "learned" or sc.model.embed_proj_dim or \
            sc.model.post_layernorm or sc.model.moe is not None or sc.training.lora is not None:
        raise SystemExit("--engine deepspeed with a pipeline runs an untied GPT with learned positions, "
                         "pre-LN, no MoE or LoRA (set model.tied_embeddings false)")
    deepspeed.init_distributed(dist_backend="gloo")
    gpt = GPT(sc.model).initialized(args.seed)

    class EmbeddingPipe(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = gpt.wte, gpt.wpe

        def forward(self, ids):
            return self.wpe(self.wte(ids))

    layers = [EmbeddingPipe(), *gpt.layers, gpt.ln_f, gpt.lm_head]
    module = PipelineModule(layers=layers, loss_fn=cross_entropy, num_stages=sc.pipeline_stages,
                            partition_method=sc.parallelism.partition_method)
    mine = {id(p) for p in module.parameters()}
    with torch.no_grad():
        for p in gpt.parameters():
            if id(p) not in mine:
                p.data = torch.empty(0)
    cfg = ds_config(sc)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=_optimizer(sc, list(module.parameters())),
                                           config=cfg)
    _log_instruction_phases(engine, RECORD)
    dp_rank = engine.grid.get_data_parallel_rank()
    gas = sc.gradient_accumulation_steps

    def train_step(step: int) -> list[float]:
        data = iter([batch(sc, step, micro, dp_rank, args.seed) for micro in range(gas)])
        return [float(engine.train_batch(data_iter=data))]

    losses, step_times = [], []
    s = 0
    for _ in range(args.warmup):
        losses += train_step(s)
        s += 1
    for i in range(args.steps):
        if i == args.steps - 1:
            RECORD["log"] = []
        dist.barrier()
        t0 = time.perf_counter()
        losses += train_step(s)
        step_times.append(time.perf_counter() - t0)
        s += 1
    collectives = RECORD["log"] or []
    RECORD["log"] = None
    peak = 0
    if not args.no_memory:
        dist.barrier()
        tr = TensorMemoryTracker().start()
        with tr:
            losses += train_step(s)
        peak = tr.peak
    write_measurement(args.out, args.engine, sc, args, step_times, {}, peak, collectives, losses)
    dist.barrier()
    exit_without_teardown()


# the pass each TrainSchedule instruction counts in, as zsim's ops of it (ir.MEASURED_PASS):
# ReduceTiedGrads and ReduceGrads are the backward's, OptimizerStep (with the gradient norm's
# all-reduces) and the loss aggregation after it the step's
_PHASE = {"LoadMicroBatch": "forward", "ForwardPass": "forward", "SendActivation": "forward",
          "RecvActivation": "forward", "BackwardPass": "backward", "SendGrad": "backward", "RecvGrad": "backward",
          "ReduceTiedGrads": "backward", "ReduceGrads": "backward", "OptimizerStep": "step"}


def _log_instruction_phases(engine, record):
    """Tag each logged call with the pass of the instruction that issues it: the engine looks its
    instructions up in self._INSTRUCTION_MAP (pipe/engine.py _exec_schedule), so an instance
    attribute of wrapped functions sets the phase first."""
    def tagged(fn, phase):
        def run(self, *args, **kwargs):
            record["phase"] = phase
            return fn(self, *args, **kwargs)
        return run

    engine._INSTRUCTION_MAP = {cls: tagged(fn, _PHASE[cls.__name__]) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}
