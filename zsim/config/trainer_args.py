"""The Hugging Face Trainer's arguments (TrainingArguments and the model/data arguments example
scripts add) as zsim reads them: a mapping of name -> value, from a launch command's script flags
(zsim.config.launch), an HfArgumentParser YAML/JSON file or a LLaMA-Factory recipe
(zsim.config.recipes), turned into the `training.*` assignments the HF Trainer would fill a
ds_config's "auto" from (transformers/integrations/deepspeed.py HfTrainerDeepSpeedConfig).

Only what the user wrote becomes an assignment: a value left out keeps zsim's (and the "auto"
rules') default. `Recipe` is what every reader hands on: the ds_config file, the model, the
cluster when the source names one, the assignments, and what was ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import get_args
from pathlib import Path

from zsim.errors import ZsimInputError
from zsim.specs.scenario import AttnImplementation


# HF's attn_implementation values zsim prices as they are (TrainingSpec.attn_implementation)
ATTN_IMPLEMENTATIONS = get_args(AttnImplementation)


def attn_implementation(key: str, value: str, notes: list[str]) -> str:
    """An HF attn_implementation as zsim prices it: the four it models as given; another kernel
    HF accepts (flex_attention, a hub kernel, paged attention) at FlashAttention-2's price, said
    in a note."""
    if value in ATTN_IMPLEMENTATIONS:
        return value
    if not value:
        raise ZsimInputError(key, value, f"expected one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    notes.append(f"{key} {value}: priced as flash_attention_2 (an IO-aware causal kernel); zsim models "
                 f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    return "flash_attention_2"


@dataclass
class Recipe:
    """What a launch command or recipe file says, in zsim's terms."""
    origin: str                                   # what the user gave: a file or "the launch command"
    ds_config: Path | None = None                 # the DeepSpeed config file the run reads
    ds_inline: dict = field(default_factory=dict)  # DeepSpeed settings given inline (accelerate's plugin)
    # parallelism.* the launcher sets whatever ds_config the Trainer passes (accelerate's parallelism_config)
    parallelism: dict = field(default_factory=dict)
    model: str | None = None                      # preset, config.json path or Hub id
    gpus_per_node: int | None = None
    nodes: int | None = None
    training: dict = field(default_factory=dict)  # training.* key -> value
    framework: str | None = None
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    script_index: int | None = None               # a launch command's words[i]: the training script
    # LLaMA-Factory v1's global_batch_size: the accumulation steps follow from it once the GPU count is
    # known (num_micro_batch = global / (dp x micro), core/utils/batching.py)
    global_batch_size: int | None = None
    pref_loss: str | None = None                  # LLaMA-Factory v1's pref_loss, for its dpo command
    # rlhf.* (DeepSpeed-Chat's step 3, zsim/config/dschat.py); critic_model the name main.py was given
    rlhf: dict = field(default_factory=dict)


# HfArgumentParser's string_to_bool (transformers/hf_argparser.py)
TRUE_WORDS = {"yes", "true", "t", "y", "1"}
FALSE_WORDS = {"no", "false", "f", "n", "0"}


def as_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if value is None or value == []:          # a bare --flag
        return True
    text = str(value[0] if isinstance(value, list) and len(value) == 1 else value).lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise ZsimInputError(name, value, "expected a boolean (true/false, as HfArgumentParser reads it)")


def as_int(name: str, value) -> int:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    try:
        if isinstance(value, bool):
            raise ValueError
        number = int(value) if not isinstance(value, float) or value.is_integer() else None
        if number is None:
            raise ValueError
        return number
    except (TypeError, ValueError):
        raise ZsimInputError(name, value, "expected a whole number") from None


def as_float(name: str, value) -> float:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise ZsimInputError(name, value, "expected a number") from None


def as_names(value) -> list[str]:
    """A module list as scripts take it: space-separated values, one comma-separated string, or a list."""
    items = value if isinstance(value, list) else [value]
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


# the sequence length under the names the common scripts give it: run_clm.py --block_size,
# TRL SFTConfig --max_seq_length (--max_length from TRL 0.20), FastChat/Alpaca --model_max_length,
# LLaMA-Factory cutoff_len, axolotl sequence_len
SEQ_LEN_NAMES = ("max_seq_length", "model_max_length", "block_size", "max_length", "max_seq_len", "seq_length",
                 "cutoff_len", "sequence_len")
MODEL_NAMES = ("model_name_or_path", "base_model")
LORA_SWITCHES = ("use_peft", "use_lora", "lora_enable")
LORA_FIELDS = {"lora_r": "rank", "lora_rank": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout",
               "lora_target_modules": "target_modules", "lora_target": "target_modules",
               "lora_modules_to_save": "modules_to_save"}
# bitsandbytes flags: TRL's ModelConfig (trl/trainer/model_config.py, get_quantization_config) and
# PEFT's example scripts (examples/sft/train.py: use_4bit_quantization, use_nested_quant, ...)
BNB_FLAGS = {"load_in_4bit": "4bit", "use_4bit_quantization": "4bit", "load_in_8bit": "8bit",
             "use_8bit_quantization": "8bit", "bnb_4bit_quant_type": "type", "use_bnb_nested_quant": "nested",
             "use_nested_quant": "nested", "bnb_4bit_use_double_quant": "nested", "bnb_4bit_quant_storage": None,
             "bnb_4bit_quant_storage_dtype": None, "bnb_4bit_compute_dtype": None}
# arguments that change nothing zsim prices (schedules, logging, data, saving, evaluation)
NO_EFFECT = frozenset({
    "output_dir", "overwrite_output_dir", "do_train", "do_eval", "do_predict", "learning_rate", "num_train_epochs",
    "max_steps", "warmup_steps", "warmup_ratio", "lr_scheduler_type", "lr_scheduler_kwargs", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "logging_steps", "logging_dir", "logging_strategy",
    "logging_first_step", "save_steps", "save_strategy", "save_total_limit", "save_only_model", "save_safetensors",
    "eval_steps", "evaluation_strategy", "eval_strategy", "per_device_eval_batch_size", "eval_accumulation_steps",
    "report_to", "run_name", "seed", "data_seed", "dataset_name", "dataset_config_name", "dataset_text_field",
    "train_file", "validation_file", "data_path", "eval_data_path", "dataloader_num_workers",
    "dataloader_pin_memory", "dataloader_drop_last", "remove_unused_columns", "push_to_hub", "hub_model_id",
    "hub_strategy", "hub_token", "torch_dtype", "trust_remote_code", "cache_dir", "preprocessing_num_workers",
    "overwrite_cache", "ddp_timeout", "ddp_find_unused_parameters", "ddp_backend", "local_rank",
    "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "gradient_checkpointing_kwargs",
    "use_fast_tokenizer", "low_cpu_mem_usage", "packing", "group_by_length", "disable_tqdm", "bf16_full_eval",
    "fp16_full_eval", "include_num_input_tokens_seen", "max_train_samples", "max_eval_samples",
    "validation_split_percentage", "streaming", "model_revision", "revision", "tokenizer_name",
    "tokenizer_name_or_path", "config_name", "use_auth_token", "token", "resume_from_checkpoint",
    "ignore_data_skip", "log_level", "log_level_replica", "log_on_each_node", "label_names",
    "prediction_loss_only", "max_grad_norm_clip", "dataset_num_proc", "chat_template", "system_prompt",
    "lazy_preprocess", "conv_template", "eval_dataset", "train_dataset", "max_prompt_length", "beta",
    "completion_only_loss", "assistant_only_loss", "neftune_noise_alpha", "torch_compile", "optim_args",
})
# optimizers whose states zsim prices (AdamW's two fp32 moments); others are named in the note
ADAMW = {"adamw_torch", "adamw_hf", "adamw_torch_fused", "adamw_apex_fused", "adamw_torch_xla", "adamw_torch_npu_fused"}


def read_trainer_args(args: dict, recipe: Recipe, where: str = "") -> Recipe:
    """Fold the Trainer's arguments into `recipe` (what the source already set stays unless an
    argument names it again)."""
    t = recipe.training
    lora: dict = {}
    lora_switch: bool | None = None
    unknown = []
    bnb: dict = {}
    precision = {k: as_bool(where + k, args[k]) for k in ("bf16", "fp16") if k in args}
    if precision.get("bf16") and precision.get("fp16"):
        # TrainingArguments.__post_init__ refuses both
        raise ZsimInputError(f"{where}bf16", True, "and fp16 are both set; the HF Trainer takes one of them")
    for name, value in args.items():
        key = where + name
        if name in ("bf16", "fp16"):
            if precision[name]:
                t["precision"] = name
        elif name in ("per_device_train_batch_size", "per_gpu_train_batch_size", "micro_batch_size"):
            t["micro_batch_size"] = as_int(key, value)
        elif name == "gradient_accumulation_steps":
            t["gradient_accumulation_steps"] = as_int(key, value)
        elif name in SEQ_LEN_NAMES:
            t["seq_len"] = as_int(key, value)
        elif name == "gradient_checkpointing":
            t["activation_checkpointing"] = "full" if as_bool(key, value) else "none"
        elif name == "tf32":
            t["tf32"] = as_bool(key, value)
        elif name == "max_grad_norm":
            t["max_grad_norm"] = as_float(key, value)
        elif name in MODEL_NAMES:
            recipe.model = _one(key, value)
        elif name == "deepspeed":
            if value not in (None, "", []):
                recipe.ds_config = Path(_one(key, value))
        elif name == "deepspeed_config":
            # deepspeed.add_config_arguments: the user's own training loop on the DeepSpeed engine
            recipe.ds_config, recipe.framework = Path(_one(key, value)), "deepspeed"
        elif name == "attn_implementation":
            t["attn_implementation"] = attn_implementation(key, _one(key, value), recipe.notes)
        elif name in ("use_flash_attn", "use_flash_attention_2", "flash_attention"):
            if as_bool(key, value):
                t["attn_implementation"] = "flash_attention_2"
        elif name in LORA_SWITCHES:
            lora_switch = as_bool(key, value)
        elif name in LORA_FIELDS:
            field_name = LORA_FIELDS[name]
            if field_name == "rank":
                lora[field_name] = as_int(key, value)
            elif field_name in ("alpha", "dropout"):
                lora[field_name] = as_float(key, value)
            else:
                names = as_names(value)
                lora[field_name] = "all-linear" if names in (["all"], ["all-linear"]) else names
        elif name in BNB_FLAGS:
            if BNB_FLAGS[name] is not None:   # storage and compute dtypes change no byte zsim counts
                bnb[BNB_FLAGS[name]] = _one(key, value) if BNB_FLAGS[name] == "type" else as_bool(key, value)
        elif name == "optim":
            optim = _one(key, value)
            if optim in ("adamw_torch", "adamw_torch_fused"):
                t["optim"] = optim       # used when the ds_config has no optimizer block
            elif optim not in ADAMW:
                unknown.append(f"{name} {optim} (zsim prices AdamW's states)")
        elif name not in NO_EFFECT:
            unknown.append(name)
    if lora_switch or (lora_switch is None and lora):
        t["lora"] = {**t.get("lora", {}), **lora}
        if lora_switch is None:
            recipe.notes.append(f"LoRA from {', '.join(k for k in args if k in LORA_FIELDS)} (no --use_peft given)")
    elif lora:
        recipe.ignored.append(", ".join(k for k in args if k in LORA_FIELDS) + " (LoRA is off)")
    recipe.ignored += unknown
    if bnb:
        from zsim.config.quantization import bnb_training
        t.update(bnb_training(where, bnb.get("4bit", False), bnb.get("8bit", False), bnb.get("type", "nf4"),
                              bnb.get("nested", False)))
    return recipe


def _one(key: str, value) -> str:
    if isinstance(value, list):
        if len(value) != 1:
            raise ZsimInputError(key, value, "expected one value")
        value = value[0]
    if value is None or isinstance(value, (dict, list)):
        raise ZsimInputError(key, value, "expected a value")
    return str(value)


def assignments(recipe: Recipe) -> list[str]:
    """`--set` assignments for the recipe's training block, its inline DeepSpeed settings, its
    parallelism and framework."""
    out = [f"training.{k}={json.dumps(v)}" for k, v in recipe.training.items()]
    out += [f"deepspeed.{k}={json.dumps(v)}" for k, v in _flat(recipe.ds_inline)]
    out += [f"parallelism.{k}={json.dumps(v)}" for k, v in recipe.parallelism.items()]
    # the critic's model is resolved where the actor's is (zsim.commands.common)
    out += [f"rlhf.{k}={json.dumps(v)}" for k, v in recipe.rlhf.items() if k != "critic_model"]
    if recipe.framework:
        out.append(f"training.framework={recipe.framework}")
    return out


def _flat(node: dict, prefix: str = ""):
    for k, v in node.items():
        if isinstance(v, dict) and v:
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v
