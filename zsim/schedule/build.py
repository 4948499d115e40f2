"""scenario -> (workload, schedule): picks the stage builder."""
from __future__ import annotations

from dataclasses import replace

from zsim.specs.scenario import Scenario
from zsim.schedule import interleaved, offload, pipeline, stage3, stage012
from zsim.schedule.builder import Builder
from zsim.schedule.context import StepContext
from zsim.schedule.ir import Schedule
from zsim.schedule.moe import TokenExchanges
from zsim.schedule.tensor import TensorCollectives
from zsim.workload.lora import apply_training
from zsim.workload.module import DTYPE_BYTES, Workload
from zsim.workload.transformer import build_workload


def workload_for(sc: Scenario) -> Workload:
    """The scenario's workload: the model, then its frozen parameters and LoRA adapters."""
    wl = build_workload(sc.model, micro_batch_size=sc.micro_batch_size, seq_len=sc.seq_len,
                        precision=sc.precision, flash_attention=sc.training.flash_attention,
                        dropout=sc.training.dropout,
                        fused_cross_entropy=sc.training.fused_cross_entropy,
                        expert_parallel_size=sc.expert_parallel_size, tensor=sc.tensor_parallel_size,
                        sequence_parallel=sc.parallelism.sequence_parallel)
    z = sc.zero   # see [Note: ZeRO-3 linear saves its input]
    return apply_training(wl, sc.training, zero3_linear=z.stage == 3 and z.memory_efficient_linear)


def with_micro_steps(sc: Scenario, micro_steps: int) -> Scenario:
    """`sc` accumulating `micro_steps` micro-steps (the batch triple kept consistent)."""
    ds = sc.deepspeed
    ds = replace(ds, gradient_accumulation_steps=micro_steps,
                 train_batch_size=ds.train_micro_batch_size_per_gpu * micro_steps * sc.data_parallel_size)
    return replace(sc, deepspeed=ds)


def build_schedule(sc: Scenario, wl: Workload | None = None,
                   micro_steps: int | None = None) -> tuple[Workload, Schedule]:
    """The step's schedule; `micro_steps` builds it with that many micro-steps instead of
    the scenario's gradient accumulation steps (the steady-state engine's shortened step)."""
    wl = wl or workload_for(sc)
    if micro_steps is not None:
        sc = with_micro_steps(sc, micro_steps)
    # every ZeRO collective of a stage runs over its data-parallel group (of its tensor-parallel rank)
    ctx = StepContext(sc=sc, wl=wl, b=Builder(), param_bytes=DTYPE_BYTES[sc.precision], world=sc.data_parallel_size,
                      reduce_bytes=DTYPE_BYTES[sc.deepspeed.reduction_dtype])
    ctx.exchanges = (TokenExchanges(ctx), TensorCollectives(ctx))
    tp = sc.tensor_parallel_size
    if sc.pipeline_stages > 1:
        chunks = sc.parallelism.virtual_stages
        layers, host = (interleaved if chunks > 1 else pipeline).build(ctx)
        return wl, ctx.b.build(sc.zero.stage, sc.cluster.world_size, host, layers, tp, chunks)
    if sc.zero.stage == 3:
        stage3.build(ctx)
    else:
        stage012.build(ctx)
    return wl, ctx.b.build(sc.zero.stage, sc.cluster.world_size, offload.host_settings(ctx), tensor=tp)
