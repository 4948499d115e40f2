"""A ds_config's "auto" values, resolved as the HF Trainer's run resolves them.

[Note: HF Trainer auto values] Three readers act on "auto", in this order, and zsim follows each:
1. transformers' HfTrainerDeepSpeedConfig (integrations/deepspeed.py, transformers 5.25)
   fills exact key paths from the TrainingArguments: train_micro_batch_size_per_gpu
   (per_device_train_batch_size), gradient_accumulation_steps, train_batch_size (world x micro x
   GAS), gradient_clipping (max_grad_norm), fp16.enabled / bf16.enabled (--fp16 / --bf16), the
   optimizer's and scheduler's params (no effect on time or memory: dropped here);
   trainer_config_finalize then fills zero_optimization.reduce_bucket_size with hidden^2 and, at
   ZeRO-3 only, stage3_prefetch_bucket_size with int(0.9 hidden^2) and
   stage3_param_persistence_threshold with 10 hidden, under those spellings only.
2. accelerate's DeepSpeedPlugin, which the Trainer builds over the same dict
   (accelerate/utils/dataclasses.py __post_init__), fills zero_optimization.stage with its
   zero_stage (default 2) and the offload devices with "none".
3. DeepSpeed builds its pydantic blocks with every remaining "auto" removed
   (runtime/config_utils.py DeepSpeedConfigModel.__init__, strict=False), so such a key takes
   DeepSpeed's default: "auto" under an alias the Trainer does not fill
   (prefetch_bucket_size, param_persistence_threshold) or under a stage-3 key at stage 1/2.
An "auto" elsewhere in a block zsim reads (activation_checkpointing, aio, data_types,
communication_data_type, ...) is read by DeepSpeed as the string itself and refused.
The TrainingArguments are the scenario's training keys, else the ds_config's own number (the
Trainer refuses a mismatch), else the Trainer's default, which a note names with its key.
"""
from __future__ import annotations

import copy
import dataclasses
import typing

from zsim.errors import ZsimInputError
from zsim.schema import _number, accepted_keys
from zsim.specs.deepspeed import Bf16Config, DeepSpeedConfig, Fp16Config, ZeroConfig
from zsim.specs.scenario import TrainingSpec

# transformers 5.25 training_args.py TrainingArguments defaults, with the scenario key that sets each
TRAINER_DEFAULTS = {"micro_batch_size": (8, "per_device_train_batch_size"),
                    "gradient_accumulation_steps": (1, "gradient_accumulation_steps"),
                    "max_grad_norm": (1.0, "max_grad_norm")}
# accelerate DeepSpeedPlugin defaults (ACCELERATE_DEEPSPEED_ZERO_STAGE 2, offload devices none)
ACCELERATE_FILLS = {("zero_optimization", "stage"): 2,
                    ("zero_optimization", "offload_optimizer", "device"): "none",
                    ("zero_optimization", "offload_param", "device"): "none",
                    ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"): False}
# the blocks DeepSpeed builds as pydantic models that zsim reads, by their schema
PYDANTIC_BLOCKS = {"zero_optimization": ZeroConfig, "fp16": Fp16Config, "bf16": Bf16Config, "tensor_parallel": None}
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
# the training key (the HF Trainer argument) each Trainer-filled "auto" follows
AUTO_FOLLOWS = {
    ("train_micro_batch_size_per_gpu",): ("micro_batch_size",),
    ("gradient_accumulation_steps",): ("gradient_accumulation_steps",),
    ("train_batch_size",): ("micro_batch_size", "gradient_accumulation_steps"),
    ("gradient_clipping",): ("max_grad_norm",),
    ("fp16", "enabled"): ("precision",),
    ("bf16", "enabled"): ("precision",),
}
# read by zsim but neither filled by the Trainer nor built by a pydantic model: DeepSpeed reads "auto" as is
_IGNORED_BLOCKS = ("optimizer", "scheduler")


def _autos(node, path=()) -> list[tuple[str, ...]]:
    """Every "auto" under the keys zsim reads (the blocks it ignores may hold any value)."""
    if isinstance(node, dict):
        return [p for k, v in node.items() if path or k in _read_keys()
                for p in _autos(v, path + (str(k),))]
    return [path] if node == "auto" else []


def has_autos(ds: dict) -> bool:
    """Whether the ds_config holds an "auto" that only the HF Trainer / accelerate fill (DeepSpeed's
    own config models refuse the string): the run is theirs."""
    return bool(_autos(ds))


def _read_keys() -> set:
    return set(accepted_keys(DeepSpeedConfig)) | {"tensor_parallel"}


def _get(ds: dict, path):
    node: object = ds
    for k in path:
        if not isinstance(node, dict):
            return None
        node = node.get(k)
    return node


def _set(ds: dict, path, value):
    node = ds
    for k in path[:-1]:
        node = node[k]
    if value is dataclasses.MISSING:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def _default(cls, path) -> object:
    """DeepSpeed's default for a key of a pydantic block (zsim's schema mirrors its defaults)."""
    for i, key in enumerate(path):
        if cls is None:
            return None
        name = accepted_keys(cls).get(key)
        if name is None:
            return None
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        if i == len(path) - 1:
            return None if field.default is dataclasses.MISSING else field.default
        hint = typing.get_type_hints(cls)[name]
        cls = next((a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)), hint)
        cls = cls if dataclasses.is_dataclass(cls) else None
    return None


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def fill_framework_autos(ds: dict) -> tuple[dict, tuple[str, ...]]:
    """Steps 2 and 3 (see [Note: HF Trainer auto values]) for what does not depend on the model
    or the layout: accelerate's stage and offload devices, and the pydantic blocks' other "auto"
    keys (DeepSpeed's defaults), except those the Trainer fills later (resolve_trainer_autos)."""
    autos = _autos(ds)
    if not autos:
        return ds, ()
    ds = copy.deepcopy(ds)
    notes = []
    for path in autos:
        if path in ACCELERATE_FILLS:
            value = ACCELERATE_FILLS[path]
            _set(ds, path, value)
            if path[-1] != "stage3_gather_16bit_weights_on_model_save":   # checkpoint saving only
                notes.append(f"deepspeed.{'.'.join(path)}: \"auto\" -> {value} (accelerate's DeepSpeedPlugin "
                             f"default, which the HF Trainer builds; --set deepspeed.{'.'.join(path)}=VALUE to change it)")
    stage = _get(ds, ("zero_optimization", "stage"))
    dropped = []
    for path in autos:
        if path in ACCELERATE_FILLS or path in AUTO_FOLLOWS or path[0] not in PYDANTIC_BLOCKS:
            continue
        if path == ("zero_optimization", "reduce_bucket_size") or (
                stage == 3 and path in (("zero_optimization", "stage3_prefetch_bucket_size"),
                                        ("zero_optimization", "stage3_param_persistence_threshold"))):
            continue   # the Trainer fills these from the model's hidden size
        default = _default(PYDANTIC_BLOCKS[path[0]], path[1:])
        _set(ds, path, dataclasses.MISSING)
        if not (path[0] == "zero_optimization" and len(path) == 2 and path[1].startswith("stage3_")
                and stage != 3):   # a stage-3 key at stage 1/2 changes nothing
            dropped.append(f"{'.'.join(path)}={_shown(default)}" if default is not None else ".".join(path))
    if dropped:
        notes.append(f"deepspeed: \"auto\" the HF Trainer does not fill (it fills stage3_prefetch_bucket_size and "
                     f"stage3_param_persistence_threshold at ZeRO-3, not their aliases) takes DeepSpeed's default: "
                     f"{', '.join(dropped)}")
    return ds, tuple(notes)


def _trainer_arg(training: TrainingSpec, ds: dict, key: str, ds_key: str, notes: list):
    """A TrainingArguments value: the scenario's, else the ds_config's number, else the default."""
    value = getattr(training, key)
    if value is not None:
        return value
    own = ds.get(ds_key)
    if own not in (None, "auto"):
        return _number(own, f"deepspeed.{ds_key}", want_int=True)
    default, arg = TRAINER_DEFAULTS[key]
    notes.append(f"{arg} {default} (--set training.{key}=N)")
    return default


def resolve_trainer_autos(ds: dict, hidden: int, training: TrainingSpec, given: set,
                          data_parallel: int) -> tuple[dict, tuple[str, ...]]:
    """Step 1 (see [Note: HF Trainer auto values]): the Trainer's fills. `given` holds the training keys
    the scenario states (a default it does not state is named in the returned note)."""
    autos = _autos(ds)
    if not autos:
        return ds, ()
    ds = copy.deepcopy(ds)
    defaults: list[str] = []
    fills: dict[tuple[str, ...], object] = {
        ("zero_optimization", "reduce_bucket_size"): hidden * hidden,
        ("zero_optimization", "stage3_prefetch_bucket_size"): int(0.9 * hidden * hidden),
        ("zero_optimization", "stage3_param_persistence_threshold"): 10 * hidden,
    }
    if any(p in AUTO_FOLLOWS and p[0] in BATCH_KEYS for p in autos):
        mb = _trainer_arg(training, ds, "micro_batch_size", "train_micro_batch_size_per_gpu", defaults)
        gas = _trainer_arg(training, ds, "gradient_accumulation_steps", "gradient_accumulation_steps", defaults)
        fills.update({("train_micro_batch_size_per_gpu",): mb, ("gradient_accumulation_steps",): gas,
                      ("train_batch_size",): mb * gas * data_parallel})
    if ("gradient_clipping",) in autos:
        fills[("gradient_clipping",)] = training.max_grad_norm
        if "max_grad_norm" not in given:
            defaults.append(f"max_grad_norm {training.max_grad_norm:g} (--set training.max_grad_norm=X)")
    precision_autos = [p for p in autos if p in (("fp16", "enabled"), ("bf16", "enabled"))]
    if precision_autos:
        prec = training.precision
        for block in ("fp16", "bf16"):
            fills[(block, "enabled")] = prec == block
        if prec is None and not any(_get(ds, (b, "enabled")) is True for b in ("fp16", "bf16")):
            defaults.append("precision fp32 (neither --bf16 nor --fp16; --set training.precision=bf16)")
    unresolved = []
    for path in autos:
        if path[0] in _IGNORED_BLOCKS:
            _set(ds, path, dataclasses.MISSING)      # lr, betas, warmup: no effect on time or memory
        elif path in fills:
            _set(ds, path, fills[path])
        else:
            unresolved.append(path)
    if unresolved:
        autos_text = ", ".join("deepspeed." + ".".join(p) for p in unresolved)
        raise ZsimInputError(autos_text, "auto", f"DeepSpeed reads {'these' if len(unresolved) > 1 else 'this'} "
                             "'auto' as the value itself (neither the HF Trainer nor DeepSpeed's pydantic configs "
                             "fill it); set a value")
    notes = (f"\"auto\" filled with the HF Trainer's defaults: {', '.join(defaults)}",) if defaults else ()
    return ds, notes
