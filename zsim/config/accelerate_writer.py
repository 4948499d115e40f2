"""`zsim tune --write` on an accelerate config YAML: the user's file with only the DeepSpeed
plugin keys the tuned configuration changes, edited line by line under `deepspeed_config:`
(zsim.config.recipe_writer.set_nested), written beside it as NAME.tuned.yaml.

accelerate's DeepSpeedPlugin (accelerate/utils/dataclasses.py, DeepSpeedPlugin.__post_init__)
builds the ds_config from a few keys: zero_stage, offload_optimizer_device / offload_param_device
(with their nvme paths), gradient_accumulation_steps and gradient_clipping; train_batch_size and
the micro-batch stay "auto" (the training script's own arguments fill them). A tuned ds_config
that needs any other key (a bucket size, a stage-3 prefetch or persistence knob, AutoTP, an
optimizer block for a newly offloaded optimizer) is written as a ds_config file and the plugin
switched to deepspeed_config_file.
"""
from __future__ import annotations

from zsim.config.recipe_writer import drop_nested, set_nested, set_top_level
from zsim.inputs import mapping_or_empty

PLUGIN = "deepspeed_config"
# ds_config path -> the plugin key that sets it (DeepSpeedPlugin's plugin_to_config_mapping)
PLUGIN_PATHS = {
    "zero_optimization.stage": "zero_stage",
    "zero_optimization.offload_optimizer.device": "offload_optimizer_device",
    "zero_optimization.offload_optimizer.nvme_path": "offload_optimizer_nvme_path",
    "zero_optimization.offload_param.device": "offload_param_device",
    "zero_optimization.offload_param.nvme_path": "offload_param_nvme_path",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
}
# [Note: accelerate's plugin keys beside a deepspeed_config_file] DeepSpeedPlugin.
# _deepspeed_config_checks raises "When using `deepspeed_config_file`, the following accelerate
# config variables will be ignored" when the YAML's deepspeed_config holds any of these, or the
# YAML sets mixed_precision (accelerate/commands/launch.py: mp_from_config_flag); accelerate
# config writes mixed_precision: null beside a file (commands/config/cluster.py)
FILE_EXCLUDES = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                 "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                 "zero3_save_16bit_model")


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict) and node:
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def plugin_changes(base_ds: dict, tuned_ds: dict, offloaded_before: bool) -> tuple[dict, list[str]]:
    """(plugin key -> value for what the inline plugin can say, the ds_config paths it cannot).
    An offload block's pin_memory true is DeepSpeed's default (runtime/zero/offload_config.py),
    which the plugin's block gets; the optimizer block ds_writer adds for ZeRO-Offload is needed
    only where the run did not offload its optimizer before (its script already copes)."""
    before, after = _flat(base_ds), _flat(tuned_ds)
    keys, other = {}, []
    for path in sorted(set(before) | set(after)):
        if before.get(path) == after.get(path):
            continue
        value = after.get(path)
        if path in PLUGIN_PATHS and value is not None and value != "auto":
            keys[PLUGIN_PATHS[path]] = value
        elif path.endswith(".pin_memory") and value is True:
            continue
        elif path.startswith("optimizer.") and offloaded_before:
            continue
        else:
            other.append(path)
    return keys, other


def inline_plugin(text: str, keys: dict) -> tuple[str, list[str]]:
    """The YAML with the plugin keys set under deepspeed_config (the `key: value` written)."""
    for key, value in keys.items():
        text = set_nested(text, PLUGIN, key, value)
    return text, [f"{PLUGIN}.{k}: {v}" for k, v in keys.items()]


def file_plugin(text: str, data: dict, ref: str) -> tuple[str, list[str], list[str]]:
    """The YAML with its plugin pointed at the ds_config file `ref` (see [Note: accelerate's
    plugin keys beside a deepspeed_config_file]): (text, what was written, the keys moved)."""
    plugin = mapping_or_empty(data.get(PLUGIN))
    moved = [k for k in FILE_EXCLUDES if k in plugin]
    for key in moved:
        text = drop_nested(text, PLUGIN, key)
    text = set_nested(text, PLUGIN, "deepspeed_config_file", ref)
    written = [f"{PLUGIN}.deepspeed_config_file: {ref}"]
    if data.get("mixed_precision") is not None:
        text = set_top_level(text, "mixed_precision", None)
        written.append("mixed_precision: null")
    if str(data.get("distributed_type", "")).upper() != "DEEPSPEED":
        text = set_top_level(text, "distributed_type", "DEEPSPEED")
        written.insert(0, "distributed_type: DEEPSPEED")
    return text, written, moved


def file_config(cfg: dict, data: dict) -> dict:
    """The ds_config that stands for the plugin and the YAML's precision once they leave it: the
    mixed_precision as the 16-bit block's enabled (accelerate fills an "auto" from its own
    mixed_precision, which the YAML no longer gives), zero3_save_16bit_model as
    stage3_gather_16bit_weights_on_model_save (DeepSpeedPlugin's mapping)."""
    import copy
    out = copy.deepcopy(cfg)
    precision = str(data.get("mixed_precision") or "no").lower()
    if precision in ("fp16", "bf16"):
        for name in ("fp16", "bf16"):
            block = mapping_or_empty(out.get(name))
            if block.get("enabled", "auto") == "auto":
                out[name] = {**block, "enabled": name == precision}
    plugin = mapping_or_empty(data.get(PLUGIN))
    if "zero3_save_16bit_model" in plugin:
        zero = out.setdefault("zero_optimization", {})
        zero.setdefault("stage3_gather_16bit_weights_on_model_save",
                        str(plugin["zero3_save_16bit_model"]).lower() == "true")
    return out
