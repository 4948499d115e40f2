"""LLaMA-Factory v1's recipe (examples/v1/, src/llamafactory/v1/config/): ModelArguments (model,
model_class, flash_attn, peft_config, kernel_config, quant_config), TrainingArguments
(micro_batch_size, global_batch_size, cutoff_len, bf16, enable_activation_checkpointing,
max_grad_norm, dist_config, cp_size, optim_config) and its plugin blocks, each a mapping with a
`name` (arg_utils.py PluginConfig).

- dist_config deepspeed: its config_file through accelerate's DeepSpeedPlugin (plugins/
  trainer_plugins/distributed/deepspeed.py: "auto" filled as the HF integration fills it, the
  accumulation steps from the batching); fsdp2 / fsdpturbo: FSDP, answered in one line; none: DDP.
- the batch (core/utils/batching.py): num_micro_batch = global_batch_size / (dp x
  micro_batch_size), 1 when global_batch_size is not given.
- the trainer is the command's (`llamafactory-cli sft|dpo|rm`, v1/launcher.py), not the file's: a
  file alone is read as sft, said in a note.
"""
from __future__ import annotations

from pathlib import Path

from zsim.config.quantization import bnb_training
from zsim.config.recipes import _find, _liger, _llama_factory_freeze
from zsim.config.trainer_args import Recipe, as_bool, as_float, as_int, as_names
from zsim.errors import ZsimInputError

# TrainingArguments / ModelArguments defaults (v1/config/training_args.py, model_args.py)
DEFAULTS = {"micro_batch_size": 1, "cutoff_len": 2048, "bf16": True, "enable_activation_checkpointing": True,
            "flash_attn": "sdpa"}


def _plugin(data: dict, key: str, where: str) -> dict | None:
    block = data.get(key)
    if block is None:
        return None
    if not isinstance(block, dict) or "name" not in block:
        raise ZsimInputError(f"{where}{key}", block, "a plugin block is a mapping with a name (LLaMA-Factory v1 "
                             "PluginConfig)")
    return block


def read_llama_factory_v1(data: dict, path: Path, bases: list[Path], recipe: Recipe) -> Recipe:
    where = f"{path.name}: "
    t = recipe.training
    recipe.model = data["model"]
    if data.get("model_class", "llm") != "llm":
        raise ZsimInputError(f"{where}model_class", data["model_class"], "zsim simulates causal language models "
                             "(model_class: llm)")
    t["micro_batch_size"] = as_int(where + "micro_batch_size", data.get("micro_batch_size", DEFAULTS["micro_batch_size"]))
    if data.get("global_batch_size") is not None:
        recipe.global_batch_size = as_int(where + "global_batch_size", data["global_batch_size"])
    t["seq_len"] = as_int(where + "cutoff_len", data.get("cutoff_len", DEFAULTS["cutoff_len"]))
    t["precision"] = "bf16" if as_bool(where + "bf16", data.get("bf16", DEFAULTS["bf16"])) else "fp32"
    checkpointing = as_bool(where + "enable_activation_checkpointing",
                            data.get("enable_activation_checkpointing", DEFAULTS["enable_activation_checkpointing"]))
    t["activation_checkpointing"] = "full" if checkpointing else "none"
    if data.get("max_grad_norm") is not None:
        t["max_grad_norm"] = as_float(where + "max_grad_norm", data["max_grad_norm"])
    attn = str(data.get("flash_attn", DEFAULTS["flash_attn"]))
    if attn not in ("eager", "sdpa", "flash_attention_2"):
        raise ZsimInputError(f"{where}flash_attn", attn, "LLaMA-Factory v1 takes eager, sdpa or flash_attention_2")
    t["attn_implementation"] = attn
    missing = [k for k in ("micro_batch_size", "cutoff_len", "bf16") if k not in data]
    if missing:
        recipe.notes.append(f"{where}LLaMA-Factory v1 defaults: "
                            + ", ".join(f"{k} {DEFAULTS[k]}" for k in missing))
    _peft(_plugin(data, "peft_config", where), recipe, where)
    _kernels(_plugin(data, "kernel_config", where), recipe, where)
    _quantization(_plugin(data, "quant_config", where), recipe, where)
    if isinstance(data.get("cp_size"), int) and data["cp_size"] > 1:
        recipe.ignored.append(f"cp_size {data['cp_size']} (context parallelism is not modelled: every GPU is "
                              "simulated holding the whole cutoff_len)")
    optim = _plugin(data, "optim_config", where)
    if optim is not None and optim["name"] not in ("adamw", "adam"):
        recipe.ignored.append(f"optim_config {optim['name']} (zsim prices AdamW's states)")
    recipe.notes.append(COMMAND_NOTE.format(where=where))
    if data.get("pref_loss") is not None:
        recipe.pref_loss = str(data["pref_loss"])
    dist = _plugin(data, "dist_config", where)
    if dist is not None:
        if dist["name"] == "deepspeed":
            if not dist.get("config_file"):
                raise ZsimInputError(f"{where}dist_config.config_file", None, "LLaMA-Factory v1 requires it for "
                                     "deepspeed (\"DeepSpeed config_file is required in dist_config\")")
            recipe.ds_config = _find(str(dist["config_file"]), bases, where + "dist_config.config_file")
        elif dist["name"] in ("fsdp2", "fsdpturbo"):
            raise ZsimInputError(f"{where}dist_config.name", dist["name"], "FSDP is not modelled (zsim simulates "
                                 "DeepSpeed); the nearest DeepSpeed run is ZeRO-3 (FSDP's full sharding): "
                                 "dist_config: {name: deepspeed, config_file: examples/deepspeed/ds_z3_config.json}")
        else:
            raise ZsimInputError(f"{where}dist_config.name", dist["name"], "LLaMA-Factory v1 takes deepspeed, fsdp2 "
                                 "or fsdpturbo")
    return recipe


COMMAND_NOTE = ("{where}LLaMA-Factory v1 takes the trainer from its command (llamafactory-cli sft, dpo, rm): "
                "simulated as sft (--set training.preference.method=dpo for dpo, reward for rm)")


def apply_command(recipe: Recipe, command: str, launch: str):
    """`llamafactory-cli sft|dpo|rm recipe.yaml` on a v1 recipe: the trainer the command names
    (dpo: TRL-style DPO, the reference the adapters disabled under lora, else a frozen copy)."""
    if not any(n.endswith(COMMAND_NOTE.format(where="")) for n in recipe.notes):
        raise ZsimInputError("launch command", launch, "sft, dpo and rm are LLaMA-Factory v1's commands (USE_V1=1) "
                             "and take a v1 recipe; a v0 recipe runs with `llamafactory-cli train`")
    recipe.notes = [n for n in recipe.notes if not n.endswith(COMMAND_NOTE.format(where=""))]
    if command == "dpo":
        # trainers/dpo_trainer.py: the pair in one row (token_type_ids 1 chosen, 2 rejected); a
        # reference for pref_loss sigmoid only (_init_ref_model): the adapters disabled under
        # PEFT, else a frozen deep copy
        loss = recipe.pref_loss or "sigmoid"
        method = {"sigmoid": "dpo", "orpo": "orpo", "simpo": "simpo"}.get(loss)
        if method is None:
            raise ZsimInputError("pref_loss", loss, "LLaMA-Factory v1 takes sigmoid, orpo or simpo")
        recipe.training["preference"] = {"method": method, "pair": "sequence"}
        ref = ("no reference model" if method != "dpo" else "the reference forward is the model with its adapters "
               "disabled" if "lora" in recipe.training else "the reference is a frozen copy of the model")
        recipe.notes.append(f"{launch}: pref_loss {loss}: each example's chosen and rejected completions in one row "
                            f"of cutoff_len; {ref}")
    elif command == "rm":
        # trainers/rm_trainer.py: the model's `score` head (_init_score_head), the pair in one row
        # told apart by token_type_ids (see [Note: reward model heads])
        recipe.training["preference"] = {"method": "reward", "reward_head": "score", "pair": "sequence"}
        recipe.notes.append(f"{launch}: a reward model with a score head; each example's chosen and rejected "
                            "completions in one row of cutoff_len")


def _peft(peft: dict | None, recipe: Recipe, where: str):
    """peft_config lora (r, lora_alpha, lora_dropout, target_modules) or freeze
    (freeze_trainable_layers, freeze_trainable_modules, freeze_extra_modules)."""
    if peft is None:
        return
    if peft["name"] == "lora":
        # plugins/model_plugins/peft.py LoraConfigDict: r 8, lora_alpha 16, lora_dropout 0.05, all
        lora: dict = {"rank": as_int(where + "peft_config.r", peft.get("r", 8)),
                      "alpha": as_float(where + "peft_config.lora_alpha", peft.get("lora_alpha", 16)),
                      "dropout": as_float(where + "peft_config.lora_dropout", peft.get("lora_dropout", 0.05))}
        targets = as_names(peft.get("target_modules", "all"))
        lora["target_modules"] = "all-linear" if targets == ["all"] else targets
        recipe.training["lora"] = lora
    elif peft["name"] == "freeze":     # FreezeConfigDict: LLaMA-Factory v0's keys and defaults
        recipe.training["freeze"] = _llama_factory_freeze(peft, where + "peft_config.")
    else:
        raise ZsimInputError(f"{where}peft_config.name", peft["name"], "zsim models lora and freeze")


def _kernels(kernels: dict | None, recipe: Recipe, where: str):
    if kernels is None:
        return
    if kernels["name"] == "liger_kernel":
        _liger(recipe, {"liger_rms_norm": True, "liger_glu_activation": True, "liger_rope": True,
                        "liger_fused_linear_cross_entropy": True}, where)
    else:
        recipe.notes.append(f"{where}kernel_config {kernels['name']}: priced as transformers' own kernels (op by op)")


def _quantization(quant: dict | None, recipe: Recipe, where: str):
    """quant_config bnb (or auto) with quantization_bit 4 or 8, under lora only."""
    if quant is None:
        return
    if quant["name"] not in ("bnb", "auto"):
        raise ZsimInputError(f"{where}quant_config.name", quant["name"], "zsim models bitsandbytes (bnb)")
    if "lora" not in recipe.training:
        raise ZsimInputError(f"{where}quant_config", quant["name"], "quantized base weights train only under "
                             "peft_config lora")
    bits = as_int(where + "quant_config.quantization_bit", quant.get("quantization_bit"))
    if bits not in (4, 8):
        raise ZsimInputError(f"{where}quant_config.quantization_bit", bits, "bitsandbytes takes 4 or 8")
    # plugins/model_plugins/quantization.py BnbParams: quantization_type nf4, double_quantization true
    quant_type = str(quant.get("quantization_type", "nf4"))
    double = as_bool(where + "quant_config.double_quantization", quant.get("double_quantization", True))
    recipe.training.update(bnb_training(where + "quant_config.", bits == 4, bits == 8, quant_type, double))
