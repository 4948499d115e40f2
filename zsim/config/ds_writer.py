"""The ds_config `zsim tune --out` writes: the user's own ds_config with only the keys the search
changed rewritten, so HF-Trainer "auto" values, the optimizer and scheduler blocks, the fp16 loss
scaling and every block zsim ignores stay exactly as written (an optimizer block is added only
where the tuned config newly offloads the optimizer, which a trainer's own optimizer cannot do).

A searched key is rewritten only when the winner's resolved value differs from the base
scenario's; it is written under the spelling the user used (stage3_prefetch_bucket_size or
prefetch_bucket_size). An "auto" value is kept (the HF Trainer fills it from its own arguments)
and a note says which value to give there instead. What a complete ds_config needs and the
user's lacks (batch keys, the 16-bit block) is added.
"""
from __future__ import annotations

import copy

from zsim.inputs import mapping_or_empty
from zsim.schema import SCIENTIFIC, accepted_keys
from zsim.specs.deepspeed import ZeroConfig
from zsim.specs.scenario import Scenario

_BATCH = (("train_micro_batch_size_per_gpu", "micro_batch_size", "per_device_train_batch_size"),
          ("gradient_accumulation_steps", "gradient_accumulation_steps", "gradient_accumulation_steps"),
          ("train_batch_size", "global_batch_size", None))


def _zero_value(sc: Scenario, field: str):
    return sc.zero.overlap if field == "overlap_comm" else getattr(sc.zero, field)


def _offload(block, device: str) -> dict:
    out = dict(block) if isinstance(block, dict) else {"pin_memory": True}
    out["device"] = device
    if device == "nvme":
        out.setdefault("nvme_path", "/local_nvme")
    return out


def _numbers(node):
    """YAML 1.1 reads 5e8 and 1e-8 as strings (zsim.schema accepts them so); JSON must carry them
    as numbers, or DeepSpeed's int fields and torch's optimizer arguments refuse them."""
    if isinstance(node, dict):
        return {k: _numbers(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_numbers(v) for v in node]
    if isinstance(node, str) and SCIENTIFIC.match(node.strip()):
        value = float(node)
        return int(value) if value.is_integer() and abs(value) < 2**63 else value
    return node


def tuned_ds_config(user_ds: dict | None, base: Scenario, tuned: Scenario, knobs,
                    resolve_auto: bool = False) -> tuple[dict, list[str]]:
    """(ds_config, notes): `user_ds` as written (None/absent: {}), changed where `tuned` differs
    from `base` in the batch, the stage, the offload devices or the ZeRO `knobs` searched.
    `resolve_auto` writes the tuned value over an "auto" too (the scenario zsim runs, which has
    no trainer to fill it)."""
    cfg = _numbers(copy.deepcopy(user_ds)) if isinstance(user_ds, dict) else {}
    notes: list[str] = []

    def put(node: dict, key: str, value, label: str, hf_arg: str | None = None):
        if node.get(key) == "auto" and not resolve_auto:
            if hf_arg:
                notes.append(f"{label} stays \"auto\" as written; the tuned value is {value}: set the trainer's "
                             f"{hf_arg} to it")
            else:   # the HF Trainer fills these from the model (hidden_size), not from an argument
                notes.append(f"{label} stays \"auto\" as written; the tuned value is {value}: write it in place "
                             "of \"auto\" to use it (the HF Trainer fills this one from the model's hidden size)")
        else:
            node[key] = value

    has_batch = any(cfg.get(k) is not None for k, _, _ in _BATCH)
    for key, attr, hf_arg in _BATCH:
        value = getattr(tuned, attr)
        if not has_batch or value != getattr(base, attr):
            put(cfg, key, value, key, hf_arg)
    if tuned.pipeline_stages != base.pipeline_stages:
        # DeepSpeed's "pipeline" block (runtime/config.py get_pipeline_config); the
        # PipelineModule's num_stages in the model code must match it
        pipe = mapping_or_empty(cfg.get("pipeline"))
        cfg["pipeline"] = {**pipe, "stages": tuned.pipeline_stages}
        notes.append(f"build the model as a PipelineModule with num_stages={tuned.pipeline_stages}")
    if tuned.expert_parallel_size != base.expert_parallel_size:
        # ep_size is an argument of the model's MoE layers (deepspeed.moe.layer.MoE), not a ds_config key
        notes.append(f"build the MoE layers with ep_size={tuned.expert_parallel_size} "
                     "(deepspeed.moe.layer.MoE(..., ep_size=...))")
    if tuned.tensor_parallel_size != base.tensor_parallel_size:
        # DeepSpeed's AutoTP training key (runtime/tensor_parallel/config.py TPTrainingConfig);
        # the seeds' tensor_parallel.size, if written, is replaced by it
        tp = mapping_or_empty(cfg.get("tensor_parallel"))
        tp = {k: v for k, v in tp.items() if k != "size"}
        cfg["tensor_parallel"] = {**tp, "autotp_size": tuned.tensor_parallel_size}
        sp = " with sequence parallelism (Megatron-LM's --sequence-parallel)" if tuned.parallelism.sequence_parallel else ""
        notes.append(f"shard the model over {tuned.tensor_parallel_size} tensor-parallel ranks{sp} "
                     "(deepspeed.tp_model_init or Megatron-DeepSpeed --tensor-model-parallel-size)")
    zero = cfg.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        zero = cfg["zero_optimization"] = {}
    if tuned.zero.stage != base.zero.stage or "stage" not in zero:
        put(zero, "stage", tuned.zero.stage, "zero_optimization.stage")
    for block, attr in (("offload_optimizer", "optimizer_offload_device"), ("offload_param", "param_offload_device")):
        device = getattr(tuned.zero, attr)
        if device != getattr(base.zero, attr):
            if device == "none" and not isinstance(zero.get(block), dict):
                zero.pop(block, None)
                zero.pop("cpu_offload" if block == "offload_optimizer" else "cpu_offload_param", None)
            else:
                zero[block] = _offload(zero.get(block), device)
    spellings = accepted_keys(ZeroConfig)
    for knob in knobs:
        field = spellings[knob]
        value = _zero_value(tuned, field)
        if value == _zero_value(base, field):
            continue
        written = next((k for k in zero if spellings.get(k) == field), knob)
        put(zero, written, value, f"zero_optimization.{written}")
    if tuned.precision in ("bf16", "fp16") and not any(k in cfg for k in ("bf16", "bfloat16", "fp16")):
        cfg[tuned.precision] = {"enabled": True}
    if "gradient_clipping" not in cfg and tuned.deepspeed.gradient_clipping:
        cfg["gradient_clipping"] = tuned.deepspeed.gradient_clipping
    if "optimizer" not in cfg and tuned.zero.optimizer_offload_device != "none":
        # without an optimizer block the trainer passes its own, which ZeRO-Offload refuses
        # (engine.py _configure_optimizer, zero_force_ds_cpu_optimizer): DeepSpeed must build its
        # CPU optimizer, so the block is added; otherwise the user's choice (none) stands
        opt = tuned.deepspeed.optimizer
        cfg["optimizer"] = {"type": opt.type, "params": dict(opt.params)}
        notes.append(f"an optimizer block ({opt.type}, DeepSpeed's default parameters) was added: ZeRO-Offload needs "
                     "DeepSpeed's own CPU optimizer; set its lr and weight_decay (or \"auto\" for the HF Trainer)")
    return cfg, notes
