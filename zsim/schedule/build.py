"""scenario -> (workload, schedule): picks the stage builder."""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from zsim.specs.scenario import Scenario
from zsim.schedule import interleaved, offload, pipeline, stage3, stage012
from zsim.schedule.builder import Builder
from zsim.schedule.context import StepContext
from zsim.schedule.ir import Schedule
from zsim.schedule.layer_skip import Abort
from zsim.schedule.passes import exchanges
from zsim.workload.lora import apply_training
from zsim.workload.module import DTYPE_BYTES, Workload
from zsim.workload.fp8 import with_fp8
from zsim.workload.tiling import with_tiled_mlp
from zsim.workload.preference import reward_head_of, sequences_per_example, with_reference
from zsim.workload.transformer import build_workload


def workload_for(sc: Scenario) -> Workload:
    """The scenario's workload: the model, then its frozen parameters and LoRA adapters."""
    z = sc.zero   # see [Note: ZeRO-3 linear saves its input]
    inputs = (sc.model, sc.micro_batch_size, sc.seq_len, sc.precision, sc.training, sc.expert_parallel_size,
              sc.tensor_parallel_size, sc.parallelism.sequence_parallel, z.stage == 3 and z.memory_efficient_linear,
              sc.sequence_parallel_size)
    try:
        hash(inputs)
    except TypeError:   # a spec holding an unhashable value: built, not memoised
        return _workload.__wrapped__(*inputs)
    return _workload(*inputs)


def training_workload(model, micro_batch_size: int, seq_len: int, precision: str, training, expert_parallel_size: int,
                      tensor: int, sequence_parallel: bool, zero3_linear: bool,
                      sequence_parallel_size: int = 1) -> Workload:
    """The per-rank workload of these inputs (every input it depends on): the model's modules,
    a preference run's reference forward, then the training spec's frozen parameters and LoRA
    adapters."""
    # preference training puts the chosen and the rejected sequence of each example through
    # every forward (see [Note: preference training])
    wl = build_workload(model, micro_batch_size=micro_batch_size * sequences_per_example(training), seq_len=seq_len,
                        precision=precision, flash_attention=training.flash_attention,
                        dropout=training.dropout,
                        fused_cross_entropy=training.fused_cross_entropy,
                        fused_linear_cross_entropy=training.fused_linear_cross_entropy,
                        kernels=training.kernels_used, attn_implementation=training.attn_implementation_used,
                        padding_mask=training.padding_mask, experts_implementation=training.experts_implementation,
                        head=reward_head_of(training),
                        expert_parallel_size=expert_parallel_size, tensor=tensor,
                        sequence_parallel=sequence_parallel, sequence_parallel_size=sequence_parallel_size)
    wl = apply_training(with_reference(wl, training), training, zero3_linear=zero3_linear)
    wl = with_fp8(wl) if training.fp8 else wl
    return with_tiled_mlp(wl, model.hidden, training.tiled_mlp_shards) if training.tiled_mlp else wl


# the variants of a search (and the attempts of the steady-state engine) that share the inputs
# share one (frozen) workload
_workload = lru_cache(maxsize=16)(training_workload)


def with_micro_steps(sc: Scenario, micro_steps: int) -> Scenario:
    """`sc` accumulating `micro_steps` micro-steps (the batch triple kept consistent)."""
    ds = replace(sc.deepspeed, gradient_accumulation_steps=micro_steps,
                 train_batch_size=sc.micro_batch_size * micro_steps * sc.data_parallel_size)
    return replace(sc, deepspeed=ds)


def build_schedule(sc: Scenario, wl: Workload | None = None, micro_steps: int | None = None,
                   templates: bool = True, skip_layers: bool = False) -> tuple[Workload, Schedule]:
    """The step's schedule; `micro_steps` builds it with that many micro-steps instead of
    the scenario's gradient accumulation steps (the steady-state engine's shortened step);
    `templates=False` builds every pass instead of copying stationary ones (see [Note: pass
    templates]; the same ops either way). `skip_layers`: ZeRO-3's passes leave out the layers
    that repeat exactly, listed in Schedule.skipped (see [Note: layers the builder skips]); a
    backward that cannot leave out its forward's layers gets the step built whole."""
    if skip_layers:
        try:
            return _build(sc, wl, micro_steps, templates, True)
        except Abort:
            pass
    return _build(sc, wl, micro_steps, templates, False)


def _build(sc: Scenario, wl: Workload | None, micro_steps: int | None, templates: bool,
           skip_layers: bool) -> tuple[Workload, Schedule]:
    wl = wl or workload_for(sc)
    if micro_steps is not None:
        sc = with_micro_steps(sc, micro_steps)
    # a pass is copied from the third micro-step on (the first forward runs after nothing, the
    # first backward allocates; see [Note: pass templates]): fewer would only pay for recording it
    templates = templates and sc.gradient_accumulation_steps >= 3
    # every ZeRO collective of a stage runs over its data-parallel group (of its tensor-parallel rank)
    ctx = StepContext(sc=sc, wl=wl, b=Builder(), param_bytes=DTYPE_BYTES[sc.precision], dp_size=sc.seq_data_parallel_size,
                      reduce_bytes=DTYPE_BYTES[sc.deepspeed.reduction_dtype], pass_templates={} if templates else None,
                      skip_layers=skip_layers)
    ctx.exchanges = exchanges(ctx)
    tp = sc.tensor_parallel_size
    if sc.pipeline_stages > 1:
        chunks = sc.parallelism.virtual_stages
        layers, host = (interleaved if chunks > 1 else pipeline).build(ctx)
        schedule = ctx.b.build(sc.zero.stage, sc.cluster.world_size, host, layers, tp, chunks)
    else:
        if sc.zero.stage == 3:
            stage3.build(ctx)
        else:
            stage012.build(ctx)
        schedule = ctx.b.build(sc.zero.stage, sc.cluster.world_size, offload.host_settings(ctx), tensor=tp)
        if ctx.layer_skip is not None and ctx.layer_skip.skipped:
            schedule = replace(schedule, skipped=tuple(sorted(ctx.layer_skip.skipped, key=lambda k: k.at)))
    return wl, replace(schedule, tf32=True) if sc.matmul_dtype == "tf32" else schedule
