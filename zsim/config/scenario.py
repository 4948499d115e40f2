"""The scenario loader: one YAML file (public contract, see docs/scenario.md) -> a frozen
Scenario (zsim.specs.scenario).

Resolution order: read YAML -> inline the ds_config.json if `deepspeed:` is a path ->
apply `--set` overrides -> model preset + explicit keys -> HF-Trainer-style "auto" ->
strict construction -> batch-size and precision consistency (DeepSpeed's rules).
"""
from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Literal

import yaml

from zsim.config.generation import check_inference, read_inference
from zsim.config.rlhf import check_rlhf, read_rlhf
from zsim.config.hf_auto import fill_framework_autos, has_autos, resolve_trainer_autos
from zsim.config.hf_config import FINE_TUNE_SEQ_LEN, model_files, preset_model, preset_names, read_hf_config
from zsim.config.parallel import check_parallelism, resolve_parallelism
from zsim.config.profile import load_profile
from zsim.config.quantization import quantization_notes
from zsim.config.source import SCENARIO_KEYS, as_scenario, is_ds_config
from zsim.errors import UnknownKeyError, ZsimInputError, did_you_mean, unknown_key
from zsim.inputs import TrailingCommaJSON, check_nesting, parse_json, parse_yaml, read_text, too_deep
from zsim.schema import _number, accepted_keys, build
from zsim.specs.deepspeed import (COMM_DATA_TYPES, IGNORED_TOP_LEVEL, NOT_MODELLED_REFUSED, REMOVED_TOP_LEVEL,
                                  REMOVED_ZERO, STRICT_IGNORED_BLOCKS, DeepSpeedConfig, OptimizerConfig)
from zsim.specs.hardware import Cluster
from zsim.specs.model import PRESETS, ModelSpec
from zsim.specs.scenario import MAX_WORLD_SIZE, HardwareSpec, Scenario, TrainingSpec


def parse_value(text: str):
    """A --set value: YAML scalar rules (so 5e8, true, [1, 2] and {a: 1} work)."""
    shown = text if len(text) <= 40 else text[:40] + "..."
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    except RecursionError:
        raise too_deep("--set", shown) from None
    check_nesting(value, "--set", shown)
    return value


def apply_set(raw: dict, assignment: str) -> dict:
    if "=" not in assignment:
        raise ZsimInputError("--set", assignment, "use --set a.b.c=value (e.g. --set deepspeed.zero_optimization.stage=2)")
    path, text = assignment.split("=", 1)
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise ZsimInputError("--set", assignment, "the key path is empty; use --set a.b.c=value")
    if keys[0] not in SCENARIO_KEYS:
        raise unknown_key("", keys[0], SCENARIO_KEYS)
    out = copy.deepcopy(raw)
    node = out
    for i, k in enumerate(keys[:-1]):
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ZsimInputError(".".join(keys[: i + 1]), nxt, "is not a mapping, so it has no sub-keys")
        node = nxt
    node[keys[-1]] = parse_value(text)
    if keys in (["model", "preset"], ["model", "hf_config"]):
        # each names the whole model: setting one replaces the other (keys beside them stay)
        node.pop("hf_config" if keys[1] == "preset" else "preset", None)
    return anchor_hf_config(out, Path.cwd())   # a path typed on the command line is the shell's


def anchor_hf_config(raw: dict, base_dir: Path) -> dict:
    """model.hf_config made absolute against `base_dir` (the scenario file's folder for a path
    in the file, the working directory for one given by --set or --model); absolute paths stay."""
    model = raw.get("model")
    ref = model.get("hf_config") if isinstance(model, dict) else None
    if isinstance(model, dict) and isinstance(ref, str) and ref and not Path(ref).is_absolute():
        model["hf_config"] = str(base_dir / ref)
    return raw


def _read_yaml(path: Path) -> dict:
    """A scenario YAML, or a .json file read as JSON (as the HF Trainer, accelerate and zsim's
    `deepspeed: path` read a ds_config): YAML would take a trailing comma JSON refuses."""
    text = read_text(path, "scenario", "a scenario YAML or a ds_config.json")
    if path.suffix.lower() == ".json":
        # a ds_config may hold trailing commas DeepSpeed's reader accepts (see [Note: trailing commas in a ds_config])
        data = parse_json(text, "scenario", str(path), trailing_commas=True)
    else:
        data = parse_yaml(text, "scenario", str(path))
    if not isinstance(data, dict):
        raise ZsimInputError("scenario", str(path), "expected a mapping with keys model, hardware, training, "
                             "deepspeed (or a ds_config.json)")
    return data


def _read_ds_config(ref: str, base_dir: Path) -> dict:
    p = Path(ref)
    if not p.is_absolute():
        p = base_dir / p
    data = parse_json(read_text(p, "deepspeed", "a ds_config.json (or give an inline mapping)"), "deepspeed", ref,
                      trailing_commas=True)
    if not isinstance(data, dict):
        raise ZsimInputError("deepspeed", ref, "a ds_config must be a JSON object")
    return data


def _preset(preset, field: str = "model") -> dict:
    if isinstance(preset, str) and preset in PRESETS:
        return PRESETS[preset]
    if isinstance(preset, str) and preset in model_files():
        return preset_model(preset)
    names = preset_names()
    raise ZsimInputError(f"{field}.preset", preset, f"unknown preset{did_you_mean(str(preset), names)}; "
                         f"available: {', '.join(names)}")


def _resolve_model(raw: dict, base_dir: Path, notes: list, field: str = "model") -> tuple[ModelSpec, bool]:
    """A preset or a Hugging Face config.json (model.hf_config), then the keys given beside it;
    and whether the training length is still the config.json's context (no seq_len beside it).
    `field`: the block's name in errors (rlhf.critic_model is a model block too)."""
    if not isinstance(raw, dict):
        raise ZsimInputError(field, raw, "expected a mapping: a preset, an hf_config and/or an explicit shape")
    raw = dict(raw)
    preset, hf_config = raw.get("preset"), raw.pop("hf_config", None)
    merged: dict = {}
    if preset is not None and hf_config is not None:
        raise ZsimInputError(f"{field}.hf_config", hf_config,
                             f"and {field}.preset={preset!r} both name a model; keep one")
    if preset is not None:
        merged.update(_preset(preset, field))
    if hf_config is not None:
        if not isinstance(hf_config, str) or not hf_config:
            raise ZsimInputError(f"{field}.hf_config", hf_config, "expected the path of a Hugging Face config.json")
        merged.update(read_hf_config(base_dir / hf_config, notes=notes))
    merged.update(raw)
    return build(ModelSpec, merged, field), hf_config is not None and "seq_len" not in raw


def _typo(key: str, known) -> str:
    """A hint for a key that looks like a misspelt DeepSpeed key (a `_comment` is not one)."""
    import difflib
    close = [] if key.startswith("_") else difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _short(value) -> object:
    return "{...}" if isinstance(value, (dict, list)) else value


def _check_top_level_ds(ds: dict) -> tuple[str, ...]:
    """DeepSpeed's rules for the top level (see [Note: DeepSpeed's top-level keys]): a removed key
    or a known one whose effect zsim cannot leave out is refused; a key DeepSpeed does not read is
    ignored, and the returned note names it."""
    for key, what in REMOVED_TOP_LEVEL.items():
        if key in ds:
            raise ZsimInputError(f"deepspeed.{key}", _short(ds[key]), f"DeepSpeed 0.19.8 removed {what} and refuses "
                                 "a config holding this key (runtime/config.py _reject_removed_config_keys); remove it")
    zero = ds.get("zero_optimization")
    for key, what in REMOVED_ZERO.items():
        if isinstance(zero, dict) and key in zero:
            raise ZsimInputError(f"deepspeed.zero_optimization.{key}", _short(zero[key]), f"DeepSpeed 0.19.8 removed "
                                 f"{what} and refuses a config holding this key; remove it")
    for block, keys in STRICT_IGNORED_BLOCKS.items():
        value = ds.get(block)
        if value is not None and not isinstance(value, dict):
            raise ZsimInputError(f"deepspeed.{block}", _short(value), "expected a mapping (DeepSpeed builds it as a "
                                 "config model)")
        for key in value or ():
            if key not in keys:
                raise UnknownKeyError(f"deepspeed.{block}.{key}", key, f"unknown key{did_you_mean(str(key), keys)}; "
                                      f"DeepSpeed refuses it (its {block} config forbids other keys); remove it")
    # each predicate reads the value and the whole ds_config (see [Note: torch_autocast over 16-bit weights])
    for key, (on, why) in NOT_MODELLED_REFUSED.items():
        if key in ds and on(ds[key], ds):
            raise ZsimInputError(f"deepspeed.{key}", _short(ds[key]), why)
    known = set(accepted_keys(DeepSpeedConfig)) | IGNORED_TOP_LEVEL | {"sequence_parallel_size"}
    unread = [f"{k}{_typo(str(k), known)}" for k in ds if k not in known]
    # DeepSpeed refuses a bad value at start-up (runtime/config.py get_communication_data_type:
    # fp16, bf16 or fp32, any case); the sequence-parallel one is accepted and ignored
    for key in ("communication_data_type", "seq_parallel_communication_data_type"):
        value = ds.get(key)
        if value is not None and (not isinstance(value, str) or value.lower() not in COMM_DATA_TYPES):
            raise ZsimInputError(f"deepspeed.{key}", value, f"choose one of {', '.join(COMM_DATA_TYPES)}"
                                 f"{did_you_mean(str(value).lower(), COMM_DATA_TYPES)} (DeepSpeed rejects others)")
    notes: tuple[str, ...] = ()
    comp = ds.get("compression")
    if isinstance(comp, dict) and str(comp.get("type", "")).lower() == "powersgd":
        # PowerSGD (Vogels et al. 2019) is PyTorch DDP's communication hook
        # (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook), not a DeepSpeed feature:
        # DeepSpeed reads no `compression` key (its compression library is compression_training)
        unread = [k for k in unread if k != "compression"]
        notes = ("deepspeed.compression: type powerSGD is PyTorch DDP's communication hook, not a DeepSpeed "
                 "feature, and DeepSpeed ignores the key; the nearest DeepSpeed option is ZeRO++'s quantized "
                 "gradients (zero_optimization.zero_quantized_gradients at stage 3: int4 reduction across nodes)",)
    if not unread:
        return notes
    return notes + (f"deepspeed: ignored {'keys' if len(unread) > 1 else 'key'} DeepSpeed does not read: "
                    f"{', '.join(unread)}",)


def _deprecated_zero_flag(ds: dict) -> dict:
    """`zero_optimization: true|false`, DeepSpeed's first format (zero/config.py
    read_zero_config_deprecated): stage 1 or 0, allgather_bucket_size from the top-level
    allgather_size (default 5e8)."""
    flag = ds.get("zero_optimization")
    if not isinstance(flag, bool):
        return ds
    ds = dict(ds)
    ds["zero_optimization"] = {"stage": 1 if flag else 0}
    if flag:
        ds["zero_optimization"]["allgather_bucket_size"] = ds.pop("allgather_size", 5e8)
    return ds


def _resolve_batch(ds: dict, training: TrainingSpec, world_size: int) -> dict:
    """DeepSpeed's runtime/config.py _set_batch_related_parameters + _batch_assertion, with the
    scenario's training.* values as a second source that must agree."""
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if ds.get(key) is not None:
            ds[key] = _number(ds[key], f"deepspeed.{key}", want_int=True)
            if ds[key] <= 0:
                raise ZsimInputError(f"deepspeed.{key}", ds[key], "must be greater than 0")
    pairs = (("train_micro_batch_size_per_gpu", training.micro_batch_size, "training.micro_batch_size"),
             ("gradient_accumulation_steps", training.gradient_accumulation_steps, "training.gradient_accumulation_steps"))
    for ds_key, tr_value, tr_name in pairs:
        if tr_value is None:
            continue
        if ds.get(ds_key) is None:
            ds[ds_key] = tr_value
        elif ds[ds_key] != tr_value:
            raise ZsimInputError(f"deepspeed.{ds_key}", ds[ds_key],
                                 f"disagrees with {tr_name}={tr_value}; make them equal or drop one")
    tb, mb, gas = ds.get("train_batch_size"), ds.get("train_micro_batch_size_per_gpu"), ds.get("gradient_accumulation_steps")
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // mb // world_size
    elif tb is not None and gas is not None:
        mb = tb // world_size // gas
    elif mb is not None:
        gas = gas or 1
        tb = mb * gas * world_size
    elif tb is not None:
        gas, mb = 1, tb // world_size
    else:
        raise ZsimInputError("training.micro_batch_size", None,
                             "set training.micro_batch_size or deepspeed.train_micro_batch_size_per_gpu / train_batch_size")
    if not mb or not gas:
        # DeepSpeed derives the free key by floor division and asserts it is > 0 (runtime/config.py
        # _set_batch_related_parameters, _batch_assertion): the global batch is below one sample per
        # data-parallel rank with the pinned keys (e.g. a sweep over hardware.nodes past it)
        least = (mb or 1) * (gas or 1) * world_size
        pinned = "".join(f"{k} ({v}) x " for k, v in (("train_micro_batch_size_per_gpu", mb),
                                                      ("gradient_accumulation_steps", gas)) if v)
        raise ZsimInputError("deepspeed.train_batch_size", tb,
                             f"it is below {pinned}data-parallel size ({world_size}) = {least}, so DeepSpeed derives "
                             f"{'gradient_accumulation_steps' if mb else 'train_micro_batch_size_per_gpu'} = 0; "
                             f"give a multiple of {least}, or fewer data-parallel ranks")
    if tb != mb * gas * world_size:
        raise ZsimInputError("deepspeed.train_batch_size", tb,
                             f"must equal train_micro_batch_size_per_gpu ({mb}) x gradient_accumulation_steps ({gas}) "
                             f"x data-parallel size ({world_size}) = {(mb or 0) * (gas or 0) * world_size}")
    ds.update(train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas)
    return ds


def _trainer_optimizer(ds: DeepSpeedConfig, ds_raw: dict, training: TrainingSpec, notes: list) -> DeepSpeedConfig:
    """The HF Trainer's optim (training.optim) builds the optimizer when the ds_config has no
    optimizer block (transformers integrations/deepspeed.py deepspeed_optim_sched: the Trainer's
    create_optimizer otherwise); with a block DeepSpeed builds that one and optim is not used.
    adamw_torch is torch.optim.AdamW with the Trainer's weight_decay (0.0 by default), foreach
    on a GPU: the block DeepSpeed turns into that optimizer (see [Note: torch Adam step
    temporaries]); adamw_torch_fused is priced as the fused AdamW it is."""
    if training.optim is None:
        return ds
    if "optimizer" in ds_raw:
        notes.append(f"training.optim {training.optim}: not used, the ds_config's optimizer block builds the "
                     "optimizer (as the HF Trainer does)")
        return ds
    if training.optim == "adamw_torch":
        block = OptimizerConfig(type="AdamW", params={"torch_adam": True, "weight_decay": 0.0})
        notes.append("deepspeed.optimizer: the HF Trainer's optim adamw_torch (torch.optim.AdamW, foreach, "
                     "weight_decay 0.0), as its ds_config has no optimizer block")
        return replace(ds, optimizer=block)
    return ds


def _resolve_precision(ds: DeepSpeedConfig, training: TrainingSpec) -> tuple[DeepSpeedConfig, TrainingSpec]:
    ds_prec: Literal["fp16", "bf16"] | None = "fp16" if ds.fp16.enabled else "bf16" if ds.bf16.enabled else None
    if training.precision is None:
        return ds, replace(training, precision=ds_prec or "fp32")
    if ds_prec is not None and ds_prec != training.precision:
        raise ZsimInputError("training.precision", training.precision,
                             f"the ds_config enables {ds_prec}; make them agree")
    if ds_prec is None and training.precision in ("fp16", "bf16"):
        block = replace(getattr(ds, training.precision), enabled=True)
        ds = replace(ds, **{training.precision: block})
    return ds, training


def scenario_from_mapping(raw: dict, base_dir: Path, name_default: str = "scenario") -> Scenario:
    for key in raw:
        if key not in SCENARIO_KEYS:
            raise unknown_key("", str(key), SCENARIO_KEYS)
    if raw.get("inference") is not None and raw.get("rlhf") is not None:
        raise ZsimInputError("rlhf", "given", "and inference both say what to simulate (a PPO iteration, a generate() "
                             "call); keep one")
    for key, flag in (("model", "--model NAME"), ("hardware", "--gpus N")):
        if key not in raw:
            raise ZsimInputError(key, None, f"the scenario needs a '{key}:' block (or add {flag})")
    notes: list[str] = []
    model, context_only = _resolve_model(raw["model"], base_dir, notes)
    hw = build(HardwareSpec, raw["hardware"], "hardware")
    profile = load_profile(hw.profile, hw.override or None, base_dir)
    cluster = Cluster(profile=profile, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node or profile.gpus_per_node)
    if cluster.world_size > MAX_WORLD_SIZE:
        raise ZsimInputError("hardware.nodes", hw.nodes, f"gives {cluster.world_size:,} GPUs "
                             f"({cluster.gpus_per_node} per node); zsim simulates up to {MAX_WORLD_SIZE:,} "
                             "(2**18, above the largest clusters built)")
    training = build(TrainingSpec, raw.get("training") or {}, "training")
    ds_raw = raw.get("deepspeed") or {}
    if isinstance(ds_raw, TrailingCommaJSON):
        # see [Note: trailing commas in a ds_config]: the run's reader decides
        if training.framework == "hf_trainer":
            raise ds_raw.refusal("the HF Trainer and accelerate, the run's readers, load the ds_config with it")
        line, column = ds_raw.first
        notes.append(f"deepspeed: {ds_raw.value} has a trailing comma (line {line}, column {column}): DeepSpeed's "
                     "own reader (hjson) accepts it, as read here; the HF Trainer and accelerate (json.load) would "
                     "refuse the file")
    if not isinstance(ds_raw, dict):
        raise ZsimInputError("deepspeed", ds_raw, "expected an inline mapping or a path to ds_config.json")
    ds_raw = copy.deepcopy(ds_raw)
    if "bfloat16" in ds_raw:  # DeepSpeed's older spelling of the bf16 block
        old = ds_raw.pop("bfloat16")
        # runtime/config.py get_bfloat16_config reads "bf16" and ignores "bfloat16" when both are
        # given: a differing second block would silently not apply, so refuse it
        if "bf16" in ds_raw and ds_raw["bf16"] != old:
            raise ZsimInputError("deepspeed.bfloat16", old, f"conflicts with deepspeed.bf16={ds_raw['bf16']!r} "
                                 "(DeepSpeed reads bf16 and ignores bfloat16); keep one block")
        ds_raw.setdefault("bf16", old)
    ds_raw = _deprecated_zero_flag(ds_raw)
    notes += _check_top_level_ds(ds_raw)
    # the PPO micro-batch and length are the actor's before the HF Trainer's autos fill anything
    rlhf, training = read_rlhf(raw.get("rlhf"), training, notes, ds_raw)
    if training.framework is None and has_autos(ds_raw):
        # "auto" is the HF Trainer's and accelerate's (they fill it; DeepSpeed's own models refuse
        # the string): their run, their model code and their search space
        training = replace(training, framework="hf_trainer")
        notes.append("training.framework: hf_trainer, as the ds_config's \"auto\" values say (the HF Trainer or "
                     "accelerate fills them): HF's kernels and sdpa attention, tune's HF search space; "
                     "--set training.framework=deepspeed to change it")
    if training.framework == "hf_trainer" and ds_raw and "zero_optimization" not in ds_raw:
        # the HF Trainer hands its ds_config to accelerate's DeepSpeedPlugin, which raises "Please
        # specify the ZeRO optimization config in the DeepSpeed config." without this block
        # (accelerate/utils/dataclasses.py DeepSpeedPlugin.__post_init__); DeepSpeed's own
        # launcher would run stage 0
        raise ZsimInputError("deepspeed.zero_optimization", None, "the HF Trainer and accelerate refuse a ds_config "
                             "without it (accelerate's DeepSpeedPlugin: \"Please specify the ZeRO optimization "
                             "config\"); add \"zero_optimization\": {\"stage\": 0} (or 1-3)")
    ds_raw, filled = fill_framework_autos(ds_raw)
    notes += filled
    par = resolve_parallelism(raw.get("parallelism"), ds_raw.get("pipeline"), cluster.world_size, model.layers,
                              ds_raw.get("tensor_parallel"), cluster.gpus_per_node, ds_raw.get("sequence_parallel_size"))
    if isinstance(ds_raw.get("pipeline"), dict):
        # DeepSpeed's "auto" stages / partition: the PipelineModule's arguments decide (resolve_parallelism read them)
        ds_raw["pipeline"] = {k: v for k, v in ds_raw["pipeline"].items()
                              if not (k in ("stages", "partition") and v == "auto")}
    # batch sizes divide by the data-parallel size only (pipe/engine.py:104; Megatron's
    # get_data_parallel_world_size excludes the tensor- and pipeline-parallel ranks; DeepSpeedConfig
    # divides the world by sequence_parallel_size)
    data_parallel = cluster.world_size // (par.pipeline * par.tensor * par.sequence)
    # "auto" as the HF Trainer fills it: see [Note: HF Trainer auto values]
    given = set(raw["training"]) if isinstance(raw.get("training"), dict) else set()
    ds_raw, filled = resolve_trainer_autos(ds_raw, model.hidden, training, given, data_parallel)
    notes += filled
    inference = read_inference(raw.get("inference"), ds_raw, raw.get("training"), notes)
    ds_raw = _resolve_batch(ds_raw, training, data_parallel)
    prefixed = {k: v for k, v in ds_raw.items() if k in accepted_keys(DeepSpeedConfig)}
    ds = build(DeepSpeedConfig, prefixed, "deepspeed")
    ds, training = _resolve_precision(ds, training)
    if par.sequence > 1:
        # engine.py _configure_distributed_model: under sequence parallelism the engine's
        # communication_data_type becomes seq_parallel_communication_data_type, whose default is
        # fp32 (runtime/constants.py SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT)
        dtype = str(ds_raw.get("seq_parallel_communication_data_type") or "fp32").lower()
        if dtype != ds.communication_data_type:
            notes.append(f"deepspeed.communication_data_type: {dtype}, as DeepSpeed sets it under sequence "
                         "parallelism (seq_parallel_communication_data_type, default fp32): gradients are reduced "
                         "in it")
        ds = replace(ds, communication_data_type=dtype)
    ds = _trainer_optimizer(ds, ds_raw, training, notes)
    if context_only and training.seq_len is None and model.seq_len > FINE_TUNE_SEQ_LEN:
        training = replace(training, seq_len=FINE_TUNE_SEQ_LEN)
        notes.append(f"seq_len {FINE_TUNE_SEQ_LEN}, not the config.json's context of {model.seq_len:,} "
                     "(TRL SFTConfig's max_length default; --set training.seq_len=N)")
    if training.fused_linear_cross_entropy and training.preference is not None:
        # a preference or reward loss needs the logits (LLaMA-Factory's apply_liger_kernel: require_logits)
        training = replace(training, fused_linear_cross_entropy=False)
        notes.append("training.fused_linear_cross_entropy: not applied, the preference loss needs the logits (as "
                     "LLaMA-Factory's apply_liger_kernel leaves it off there)")
    _check_fp8(training, profile, par)
    _check_tiled_mlp(training, model, par, notes)
    training = check_parallelism(par, ds, training, model, cluster.world_size)
    training = _attention_for_model(model, training, notes)
    notes += quantization_notes(training.quantization, ds.zero_optimization.stage, par.tensor, par.pipeline)
    if training.seq_len and model.position == "learned" and training.seq_len > model.seq_len:
        raise ZsimInputError("training.seq_len", training.seq_len,
                             f"exceeds the model's learned position table (model.seq_len={model.seq_len}); raise model.seq_len")
    if inference is not None:
        check_inference(inference, model, training, par, ds.zero_optimization, cluster.world_size)
    if rlhf is not None:
        critic = model if rlhf.critic_model is None else _resolve_model(rlhf.critic_model, base_dir, notes,
                                                                         "rlhf.critic_model")[0]
        rlhf = replace(rlhf, critic_model=critic)
        check_rlhf(rlhf, model, critic, training, par, ds.zero_optimization, cluster.world_size)
    name = raw.get("name", name_default)
    if not isinstance(name, str):
        raise ZsimInputError("name", name, "expected a string")
    return Scenario(name=name, model=model, cluster=cluster, training=training, deepspeed=ds, parallelism=par,
                    inference=inference, rlhf=rlhf, description=str(raw.get("description", "")),
                    notes=tuple(notes),
                    # an rlhf block simulates what the hybrid_engine block switches on
                    warnings=(tuple(w for w in ds.not_modelled(ds_raw)
                                    if rlhf is None or not w.startswith("deepspeed.hybrid_engine"))
                              + ds.checkpointing_warnings(training.activation_checkpointing)
                              + ds.zero_optimization.zero_plus_plus_warnings(
                                  training.lora is not None or bool(training.frozen)
                                  or training.quantization != "none")
                              + _hardware_warnings(hw, profile)))


def _check_fp8(training: TrainingSpec, profile, par) -> None:
    """What FP8 linears need and what zsim models of them (see [Note: FP8 linears])."""
    if not training.fp8:
        return
    if profile.gpu.peak_tflops_fp8 is None:
        raise ZsimInputError("training.fp8", True, f"profile {profile.name} gives no FP8 peak (gpu.peak_tflops_fp8: "
                             "FP8 GEMMs need Hopper, Ada, Blackwell or MI300; A100 and V100 have none); use such a "
                             "profile, set hardware.override.gpu.peak_tflops_fp8, or drop it")
    if training.precision != "bf16":
        raise ZsimInputError("training.precision", training.precision, "FP8 linears are modelled under bf16 (what "
                             "accelerate's fp8 runs the rest in); use bf16")
    _plain_linears_only("training.fp8", "FP8 linears", training, par)


def _plain_linears_only(field: str, what: str, training: TrainingSpec, par) -> None:
    """`what` is modelled over the model's own linears, without LoRA adapters or quantized base
    weights, tensor or pipeline parallelism."""
    if training.lora is not None or training.quantization != "none":
        raise ZsimInputError(field, True, f"{what} beside LoRA adapters or quantized base weights is not modelled; "
                             "drop one")
    if par.tensor > 1 or par.pipeline > 1:
        raise ZsimInputError(field, True, f"{what} under tensor or pipeline parallelism is not modelled; use tensor 1 "
                             "and pipeline 1")


def _check_tiled_mlp(training: TrainingSpec, model, par, notes: list) -> None:
    """What zsim models of ALST's TiledMLP (see [Note: tiled MLP])."""
    if not training.tiled_mlp:
        if training.tiled_mlp_shards is not None:
            notes.append("training.tiled_mlp_shards: not read, training.tiled_mlp is off")
        return
    _plain_linears_only("training.tiled_mlp", "a tiled MLP", training, par)
    if not model.has_dense_mlp:
        notes.append("training.tiled_mlp: every layer's MLP is an MoE block, which zsim does not tile: no change")


def _attention_for_model(model, training, notes: list) -> TrainingSpec:
    """The attention transformers runs for this model: a model with attention sinks (GPT-OSS) has
    no sdpa path (GptOssPreTrainedModel._supports_sdpa = False, modular_gpt_oss.py), so
    from_pretrained's default falls back to eager, and asking for sdpa is refused as transformers
    refuses it."""
    if not model.attention_sinks:
        return training
    if training.attn_implementation == "sdpa":
        raise ZsimInputError("training.attn_implementation", "sdpa", "a model with attention sinks (GPT-OSS) has no "
                             "sdpa path in transformers; use eager, flash_attention_2 (flash-attn >= 2.8.3) or "
                             "flash_attention_3 (the kernels-community/vllm-flash-attn3 Hub kernel)")
    if training.attn_implementation is None and training.attn_implementation_used == "sdpa":
        notes.append("attention: eager, transformers' default for a model with attention sinks (GPT-OSS has no sdpa "
                     "path): the scores are materialised; --set training.attn_implementation=flash_attention_3 for "
                     "the kernels-community/vllm-flash-attn3 kernel")
        return replace(training, attn_implementation="eager")
    return training


def _hardware_warnings(hw: HardwareSpec, profile) -> tuple[str, ...]:
    """What the hardware block sets that the simulation will not read as the user may expect: a
    tier's latency or efficiency table under a profile priced by NCCL's cost model, and a node
    larger than the profile's."""
    out = []
    override = hw.override or {}
    for tier in ("intra_node", "inter_node"):
        block = override.get(tier)
        spec = getattr(profile, tier)
        if isinstance(block, dict) and profile.nccl is not None and not spec.efficiency_by_collective:
            for key in ("latency_us", "efficiency_by_size"):
                if key in block:
                    out.append(f"hardware.override.{tier}.{key} is not read: the profile's nccl: section prices "
                               f"collectives with NCCL's cost model (docs/model.md); add "
                               f"hardware.override.nccl=null to use the tier tables")
    if hw.gpus_per_node and hw.gpus_per_node > profile.gpus_per_node:
        out.append(f"hardware.gpus_per_node {hw.gpus_per_node} exceeds the {profile.gpus_per_node} GPUs of a "
                   f"{profile.name} node: simulated as one node of {hw.gpus_per_node} on its intra-node fabric")
    return tuple(out)


def load_raw(path: Path) -> dict:
    """A scenario file's mapping; a ds_config.json given instead becomes {name, deepspeed}
    (zsim.config.source), to which --model/--gpus add the model and the cluster."""
    raw = _read_yaml(path)
    if is_ds_config(raw):
        return as_scenario(raw, path)
    if isinstance(raw, TrailingCommaJSON):     # a scenario in JSON: zsim reads it with json.load
        raise raw.refusal("zsim reads a scenario with it")
    if isinstance(raw.get("deepspeed"), str):
        raw["deepspeed"] = _read_ds_config(raw["deepspeed"], path.parent)
    return anchor_hf_config(raw, path.parent.resolve())   # absolute: later joins keep it


def source_is_ds_config(path: str | Path) -> bool:
    """Whether the file given where a scenario belongs is a ds_config.json (read errors are the loader's)."""
    return is_ds_config(_read_yaml(Path(path)))


def load_scenario(path: str | Path, overrides: tuple[str, ...] = ()) -> Scenario:
    path = Path(path)
    raw = load_raw(path)
    for assignment in overrides:
        raw = apply_set(raw, assignment)
    return scenario_from_mapping(raw, path.parent, name_default=path.stem)
