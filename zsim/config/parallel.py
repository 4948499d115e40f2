"""The `parallelism:` block and the ds_config's "pipeline" block, resolved into one
ParallelismSpec, with DeepSpeed's own refusals (runtime/pipe/engine.py, module.py).

DeepSpeed takes the stage count and the partition from PipelineModule(num_stages=,
partition_method=), Python-side; a scenario gives them as `parallelism.pipeline` and
`parallelism.partition_method`, or as the ds_config's pipeline.stages / pipeline.partition
(the keys the seeds write). When both are given they must agree.
"""
from __future__ import annotations

from dataclasses import replace

from zsim.errors import ZsimInputError
from zsim.schema import _number, build
from zsim.specs.deepspeed import DeepSpeedConfig
from zsim.specs.parallelism import ParallelismSpec
from zsim.specs.scenario import TrainingSpec


def resolve_parallelism(raw, ds_pipeline, world_size: int, layers: int) -> ParallelismSpec:
    """`raw`: the scenario's parallelism mapping (or None); `ds_pipeline`: the ds_config's
    pipeline mapping (or None). Checks what can be checked before the workload exists."""
    if raw is not None and not isinstance(raw, dict):
        raise ZsimInputError("parallelism", raw, "expected a mapping, e.g. {pipeline: 4}")
    raw = dict(raw or {})
    ds_pipeline = ds_pipeline if isinstance(ds_pipeline, dict) else {}
    for ds_key, key in (("stages", "pipeline"), ("partition", "partition_method")):
        value = ds_pipeline.get(ds_key)
        if value in (None, "auto") or (ds_key == "partition" and value == "best"):
            continue   # DeepSpeed's defaults: the PipelineModule's arguments decide
        if ds_key == "stages":
            value = _number(value, "deepspeed.pipeline.stages", want_int=True)
        elif not isinstance(value, str):
            raise ZsimInputError("deepspeed.pipeline.partition", value, "expected a string such as uniform or parameters")
        if key in raw and raw[key] != value:
            raise ZsimInputError(f"deepspeed.pipeline.{ds_key}", value,
                                 f"disagrees with parallelism.{key}={raw[key]!r}; make them equal or drop one")
        raw[key] = value
    par = build(ParallelismSpec, raw, "parallelism")
    pp = par.pipeline
    if world_size % pp:
        raise ZsimInputError("parallelism.pipeline", pp, f"must divide the world size ({world_size} GPUs): "
                             "PipeDataParallelTopology splits it into pipeline x data-parallel ranks")
    if pp > layers:
        raise ZsimInputError("parallelism.pipeline", pp, f"exceeds the model's {layers} transformer layers; "
                             f"use at most {layers} stages")
    return par


def check_pipeline_engine(par: ParallelismSpec, ds: DeepSpeedConfig, training: TrainingSpec) -> TrainingSpec:
    """DeepSpeed's PipelineEngine rules on the resolved config; returns the training spec with
    the pipeline's activation checkpointing applied."""
    if par.pipeline > 1 and ds.zero_optimization.stage >= 2:
        # pipe/engine.py:76: assert zero_optimization_stage() < ZeroStageEnum.gradients
        raise ZsimInputError("deepspeed.zero_optimization.stage", ds.zero_optimization.stage,
                             "DeepSpeed's PipelineEngine refuses it (ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                             "parallelism, runtime/pipe/engine.py:76); use ZeRO-1 or drop pipeline")
    interval = ds.pipeline.activation_checkpoint_interval
    if par.pipeline == 1 or interval == 0:
        return training
    if interval > 1:
        raise ZsimInputError("deepspeed.pipeline.activation_checkpoint_interval", interval,
                             "zsim checkpoints one transformer layer at a time; use 0 or 1")
    # pipe/engine.py:217 sets PipelineModule.activation_checkpoint_interval: every layer's
    # forward runs under checkpoint (module.py forward), i.e. full checkpointing per block
    if training.activation_checkpointing == "selective":
        raise ZsimInputError("training.activation_checkpointing", "selective",
                             "deepspeed.pipeline.activation_checkpoint_interval 1 checkpoints every layer (full); "
                             "set one of them to agree")
    return replace(training, activation_checkpointing="full")
