"""Recipe files -> a Recipe (zsim.config.trainer_args): an accelerate config YAML, an axolotl YAML,
a LLaMA-Factory YAML, or the HF Trainer's arguments as an HfArgumentParser YAML/JSON file.

What a file is, is read from the keys only its tool writes: accelerate's `accelerate config`
writes compute_environment and distributed_type; axolotl's configs name base_model; LLaMA-Factory's
name stage or finetuning_type. A file of none of them is refused with what zsim accepts. Each
tool's defaults where it differs from the HF Trainer's are applied and said (LLaMA-Factory turns
gradient checkpointing on and cuts at cutoff_len 2048). Relative paths inside a recipe (its
`deepspeed:` file) resolve against the working directory the tool runs in, as the tool resolves
them; a path found only beside the recipe is taken from there.
"""
from __future__ import annotations

from pathlib import Path

from zsim.errors import ZsimInputError
from zsim.config.quantization import bnb_training
from zsim.config.trainer_args import Recipe, as_bool, as_float, as_int, as_names, read_trainer_args

ACCEPTED = ("a scenario YAML, a ds_config.json, an accelerate config YAML, an axolotl YAML, a LLaMA-Factory YAML, "
            "a launch script (.sh) or a launch command after --")


def recipe_kind(data) -> str | None:
    """accelerate | axolotl | llama_factory, or None."""
    if not isinstance(data, dict):
        return None
    if "compute_environment" in data or "distributed_type" in data:
        return "accelerate"
    if "base_model" in data:
        return "axolotl"
    if "stage" in data or "finetuning_type" in data:
        return "llama_factory"
    # LLaMA-Factory v1 (src/llamafactory/v1/config/): `model` a name, plugin blocks beside it
    if isinstance(data.get("model"), str) and any(k in data for k in LF_V1_MARKS):
        return "llama_factory_v1"
    return None


LF_V1_MARKS = ("model_class", "dist_config", "peft_config", "kernel_config", "quant_config", "train_dataset")


def _read(path: Path, field: str) -> dict:
    from zsim.inputs import parse_json, parse_yaml, read_text
    text = read_text(path, field, "a recipe file")
    data = parse_json(text, field, str(path)) if path.suffix == ".json" else parse_yaml(text, field, str(path))
    if not isinstance(data, dict):
        raise ZsimInputError(field, str(path), f"expected a mapping; zsim reads {ACCEPTED}")
    return data


def read_recipe_file(path: Path, cwd: Path, recipe: Recipe, overrides: dict | None = None) -> Recipe:
    """A recipe a launch names (or the user gives as the scenario): read as what it is."""
    data = _read(path, "recipe")
    data.update(overrides or {})
    kind = recipe_kind(data)
    recipe.origin = str(path)
    base = [cwd, path.parent]
    if kind == "accelerate":
        return read_accelerate(data, path, base, recipe)
    if kind == "axolotl":
        return read_axolotl(data, path, base, recipe)
    if kind == "llama_factory":
        return read_llama_factory(data, path, base, recipe)
    if kind == "llama_factory_v1":
        from zsim.config.llama_factory_v1 import read_llama_factory_v1
        return read_llama_factory_v1(data, path, base, recipe)
    # HfArgumentParser.parse_yaml_file / parse_json_file: the Trainer's arguments by name
    read_trainer_args(data, recipe, where=f"{path.name}: ")
    if recipe.ds_config is not None:
        recipe.ds_config = _find(str(recipe.ds_config), base, f"{path.name}: deepspeed")
    return recipe


def _find(ref: str, bases: list[Path], field: str) -> Path:
    """A recipe's file reference: against the tool's working directory, else beside the recipe."""
    p = Path(ref).expanduser()
    if p.is_absolute():
        return p
    for base in bases:
        if (base / p).is_file():
            return base / p
    raise ZsimInputError(field, ref, f"file not found (looked in {', '.join(str(b) for b in dict.fromkeys(bases))}); "
                         "give its path")


# accelerate's DistributedType values that run the model whole on each GPU (data parallel)
DATA_PARALLEL = {"NO", "MULTI_GPU"}
# FSDP's sharding strategies (torch.distributed.fsdp.ShardingStrategy, by name or accelerate's
# 1-based number) and the ZeRO stage that shards the same states
FSDP_NEAREST = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0, "HYBRID_SHARD": 3, "_HYBRID_SHARD_ZERO2": 2,
                "1": 3, "2": 2, "3": 0, "4": 3, "5": 2}


def read_accelerate(data: dict, path: Path, bases: list[Path], recipe: Recipe) -> Recipe:
    """accelerate's config YAML (accelerate/commands/config/config_args.py ClusterConfig):
    num_processes is the total over num_machines; the DeepSpeed plugin inline under
    deepspeed_config or in deepspeed_config.deepspeed_config_file."""
    where = f"{path.name}: "
    dist = str(data.get("distributed_type", "NO")).upper()
    if dist == "FSDP":
        raise fsdp_refusal(data.get("fsdp_config") or {}, where)
    if dist not in DATA_PARALLEL | {"DEEPSPEED"}:
        raise ZsimInputError(f"{where}distributed_type", data.get("distributed_type"), "zsim simulates DeepSpeed "
                             "(DEEPSPEED) and data-parallel GPU runs (MULTI_GPU, NO)")
    processes, machines = data.get("num_processes"), data.get("num_machines", 1)
    _world(recipe, processes, machines, where)
    _mixed_precision(recipe, data.get("mixed_precision"), f"{where}mixed_precision", data.get("fp8_config"))
    if dist == "DEEPSPEED":
        plugin = data.get("deepspeed_config") or {}
        if not isinstance(plugin, dict):
            raise ZsimInputError(f"{where}deepspeed_config", plugin, "expected a mapping of the DeepSpeed plugin's keys")
        _plugin(plugin, bases, recipe, where + "deepspeed_config.")
        _parallelism_config(data.get("parallelism_config"), recipe, where + "parallelism_config.")
    else:
        recipe.notes.append(f"{path.name}: distributed_type {dist} runs PyTorch DDP; simulated as DeepSpeed ZeRO "
                            "stage 0 (data parallel, gradients all-reduced)")
    return recipe


def _parallelism_config(pc, recipe: Recipe, where: str):
    """accelerate's parallelism_config block (accelerate launch turns it into the
    PARALLELISM_CONFIG_* variables ParallelismConfig reads): sp_size with sp_backend deepspeed is
    DeepSpeed-Ulysses (ALST: accelerator.py hands UlyssesSPAttentionHF's mpu to
    deepspeed.initialize, whichever ds_config the run passes): parallelism.sequence;
    sp_attn_implementation is the core attention it wraps (DeepSpeedSequenceParallelConfig refuses
    eager and flex_attention)."""
    if pc in (None, {}):
        return
    if not isinstance(pc, dict):
        raise ZsimInputError(where.rstrip("."), pc, "expected a mapping of parallelism_config_* keys")
    sp = as_int(where + "parallelism_config_sp_size", pc.get("parallelism_config_sp_size", 1))
    if sp > 1:
        backend = pc.get("parallelism_config_sp_backend", "deepspeed")
        if backend != "deepspeed":
            raise ZsimInputError(where + "parallelism_config_sp_backend", backend, "accelerate's only sequence-"
                                 "parallel backend is deepspeed (ALST/Ulysses)")
        recipe.parallelism["sequence"] = sp
        attn = pc.get("parallelism_config_sp_attn_implementation")
        if attn not in (None, "None"):
            if attn not in ("sdpa", "flash_attention_2", "flash_attention_3"):
                raise ZsimInputError(where + "parallelism_config_sp_attn_implementation", attn,
                                     "choose sdpa, flash_attention_2 or flash_attention_3 (accelerate refuses eager "
                                     "and flex_attention under sequence parallelism)")
            recipe.training.setdefault("attn_implementation", attn)
    for key in ("parallelism_config_cp_size", "parallelism_config_tp_size", "parallelism_config_dp_replicate_size"):
        value = pc.get(key)
        if value is not None and as_int(where + key, value) > 1:
            recipe.ignored.append(f"{where}{key} {value} (FSDP2's; not read under DeepSpeed by zsim)")


def fsdp_refusal(fsdp: dict, where: str) -> ZsimInputError:
    strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
    stage = FSDP_NEAREST.get(strategy, 3)
    offload = " with offload_param.device=cpu" if str(fsdp.get("fsdp_offload_params", "")).lower() == "true" else ""
    return ZsimInputError(f"{where}distributed_type", "FSDP", f"FSDP is not modelled (zsim simulates DeepSpeed); the "
                          f"nearest DeepSpeed run is ZeRO-{stage}{offload} ({strategy} ~ ZeRO-{stage}): launch with "
                          f"`accelerate launch --use_deepspeed --zero_stage {stage}` instead of this config, or run a "
                          f"ds_config.json with --set deepspeed.zero_optimization.stage={stage}")


def _world(recipe: Recipe, processes, machines, where: str):
    if processes is None:
        return
    total, nodes = as_int(f"{where}num_processes", processes), as_int(f"{where}num_machines", machines or 1)
    if total < 1 or nodes < 1 or total % nodes:
        raise ZsimInputError(f"{where}num_processes", total, f"must be a positive multiple of num_machines ({nodes}): "
                             "accelerate's num_processes counts every process on every machine")
    recipe.gpus_per_node, recipe.nodes = total // nodes, nodes


def _mixed_precision(recipe: Recipe, value, field: str, fp8_config=None):
    if value in (None, "no", "No", "NO"):
        return
    value = str(value).lower()
    if value == "fp8":
        # accelerate's fp8: its backend's FP8 linears, the rest under bf16 autocast (see [Note: FP8 linears])
        backend = str((fp8_config or {}).get("backend", "TE")).upper() if isinstance(fp8_config, dict) else "TE"
        if backend not in ("TE", "AO"):
            raise ZsimInputError(field.replace("mixed_precision", "fp8_config.backend"), backend,
                                 "zsim models FP8 linears as Transformer Engine (TE) runs them, and torchao's (AO) "
                                 "priced alike; MS-AMP is not modelled")
        recipe.training.setdefault("precision", "bf16")
        recipe.training["fp8"] = True
        if backend == "AO":
            recipe.notes.append(f"{field} fp8 with backend AO (torchao Float8Linear): priced as Transformer Engine's "
                                "FP8 linears")
        return
    if value not in ("fp16", "bf16"):
        raise ZsimInputError(field, value, "choose no, fp16 or bf16 (accelerate's values)")
    recipe.training.setdefault("precision", value)


def _plugin(plugin: dict, bases: list[Path], recipe: Recipe, where: str):
    """accelerate's DeepSpeedPlugin (accelerate/utils/dataclasses.py): a deepspeed_config_file, or
    the ds_config it builds from zero_stage (default 2), the offload devices, GAS and clipping."""
    ref = plugin.get("deepspeed_config_file")
    if ref not in (None, "", "none"):
        recipe.ds_config = _find(str(ref), bases, where + "deepspeed_config_file")
        return
    zero: dict = {"stage": as_int(where + "zero_stage", plugin.get("zero_stage", 2))}
    for key in ("offload_optimizer", "offload_param"):
        device = str(plugin.get(f"{key}_device", "none")).lower()
        if device not in ("none", "cpu", "nvme"):
            raise ZsimInputError(f"{where}{key}_device", device, "choose none, cpu or nvme")
        if device != "none":
            zero[key] = {"device": device}
            nvme = plugin.get(f"{key}_nvme_path")
            if device == "nvme" and nvme not in (None, "none"):
                zero[key]["nvme_path"] = str(nvme)
    # the plugin's batch keys are "auto" (the Trainer fills them); its GAS too when not given
    ds: dict = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                "zero_optimization": zero}
    if plugin.get("gradient_accumulation_steps") not in (None, "auto"):
        ds["gradient_accumulation_steps"] = as_int(where + "gradient_accumulation_steps",
                                                   plugin["gradient_accumulation_steps"])
    if plugin.get("gradient_clipping") not in (None, "none"):
        ds["gradient_clipping"] = as_float(where + "gradient_clipping", plugin["gradient_clipping"])
    recipe.ds_inline = ds


def accelerate_launch(opts: dict, cwd: Path, recipe: Recipe):
    """`accelerate launch` options: its config file (--config_file, or the default one it would
    read), then the flags, which override the file's values as accelerate's launch does."""
    from zsim.config.launch import bool_flag
    ref = opts.get("--config_file")
    if ref is not None:
        path = Path(ref).expanduser()
        path = path if path.is_absolute() else cwd / path
        data = _read(path, "--config_file")
        if recipe_kind(data) != "accelerate":
            raise ZsimInputError("--config_file", str(path), "is not an accelerate config (no compute_environment or "
                                 "distributed_type)")
        read_accelerate(data, path, [cwd, path.parent], recipe)
    if bool_flag(opts, "--use_fsdp"):
        raise fsdp_refusal({}, "accelerate launch --use_fsdp: ")
    for flag in ("--cpu", "--tpu", "--use_megatron_lm"):
        if bool_flag(opts, flag):
            raise ZsimInputError(f"accelerate launch {flag}", True, "zsim simulates DeepSpeed on GPUs")
    if "--num_processes" in opts:
        _world(recipe, opts["--num_processes"], opts.get("--num_machines", recipe.nodes or 1), "accelerate launch --")
    elif "--num_machines" in opts and recipe.gpus_per_node:
        _world(recipe, recipe.gpus_per_node * (recipe.nodes or 1), opts["--num_machines"], "accelerate launch --")
    if "--mixed_precision" in opts:
        recipe.training.pop("precision", None)
        _mixed_precision(recipe, opts["--mixed_precision"], "accelerate launch --mixed_precision")
    plugin_flags = {k[2:]: v for k, v in opts.items()
                    if k in ("--zero_stage", "--offload_optimizer_device", "--offload_param_device",
                             "--gradient_accumulation_steps", "--gradient_clipping", "--deepspeed_config_file")}
    if bool_flag(opts, "--use_deepspeed") or plugin_flags:
        _plugin(plugin_flags, [cwd], recipe, "accelerate launch --")
    elif ref is None and recipe.gpus_per_node is None:
        recipe.notes.append("accelerate launch without --config_file reads accelerate's default config, which "
                            "zsim does not; give --config_file or --num_processes")
    # accelerate launch's --parallelism_config_* flags (launch.py: the PARALLELISM_CONFIG_* variables)
    _parallelism_config({k[2:]: v for k, v in opts.items() if k.startswith("--parallelism_config_")}, recipe,
                        "accelerate launch --")


def _preference_refusal(field: str, value, simulated: str) -> ZsimInputError:
    """The preference and RL trainers zsim does not model: KTO (unpaired completions beside a KL
    batch the policy scores without grad), PPO and GRPO (they generate)."""
    return ZsimInputError(field, value, f"is not modelled (KTO's KL batch, PPO's and GRPO's generation); zsim "
                          f"simulates {simulated}")


def _reward(recipe: Recipe, head: str, where: str, how: str):
    """training.preference for a reward model (see [Note: reward model heads]), said."""
    recipe.training["preference"] = {"method": "reward", "reward_head": head}
    what = ("the causal LM with a value head (lm_head's logits computed and dropped)" if head == "value_head"
            else "a sequence-classification score head in place of lm_head")
    recipe.notes.append(f"{where}{how}: a reward model, {what}; each example's chosen and rejected sequences in "
                        "one forward (2 x micro-batch sequences, counted in tokens/s)")


def _preference(recipe: Recipe, method: str, where: str, how: str):
    """training.preference for a paired method (see [Note: preference training]), with the note
    that says what the step runs."""
    recipe.training["preference"] = {"method": method}
    ref = "no reference model" if method in ("orpo", "simpo") else (
        "the reference forward is the model with its adapters disabled" if "lora" in recipe.training
        else "the reference is a frozen copy of the model (ZeRO-3 partitions it at stage 3, else a whole 16-bit "
             "copy on every GPU)")
    recipe.notes.append(f"{where}{how}: each example's chosen and rejected sequences in one forward (2 x micro-batch "
                        f"sequences, counted in tokens/s); {ref}")


def read_axolotl(data: dict, path: Path, bases: list[Path], recipe: Recipe) -> Recipe:
    """axolotl's config (axolotl/utils/schemas/config.py AxolotlInputConfig)."""
    where = f"{path.name}: "
    rl = data.get("rl")
    if rl not in (None, False, "") and rl not in AXOLOTL_PAIRED:
        # AxolotlInputConfig.rl (schemas/enums.py RLType: dpo, ipo, kto, orpo, simpo, grpo, ...)
        raise _preference_refusal(f"{where}rl", rl, "rl: " + ", ".join(AXOLOTL_PAIRED) + " and supervised "
                                  "fine-tuning (no rl:)")
    t = recipe.training
    if data.get("process_reward_model") not in (None, False):
        raise ZsimInputError(f"{where}process_reward_model", data["process_reward_model"], "a process reward model "
                             "(token classification under TRL's PRMTrainer) is not modelled; zsim simulates "
                             "reward_model (sequence classification) and supervised fine-tuning")
    adapter = data.get("adapter")
    if adapter not in (None, "", "lora", "qlora"):
        raise ZsimInputError(f"{where}adapter", adapter, "zsim models adapter: lora or qlora (or none: full "
                             "fine-tuning)")
    _axolotl_bnb(data, adapter, recipe, where)
    recipe.model = str(data["base_model"])
    if data.get("sequence_len") is not None:
        t["seq_len"] = as_int(where + "sequence_len", data["sequence_len"])
    for key, name in (("micro_batch_size", "micro_batch_size"), ("gradient_accumulation_steps",
                                                                 "gradient_accumulation_steps")):
        if data.get(key) is not None:
            t[name] = as_int(where + key, data[key])
    bf16, fp16 = data.get("bf16"), data.get("fp16")
    if bf16 == "auto":
        # axolotl: bf16 when the GPU supports it (A100, H100 do; V100 does not: set fp16 there)
        t["precision"] = "bf16"
        recipe.notes.append(f"{where}bf16: auto -> bf16 (axolotl's choice on a GPU with bf16)")
    elif bf16 is not None and as_bool(where + "bf16", bf16):
        t["precision"] = "bf16"
    elif fp16 is not None and as_bool(where + "fp16", fp16):
        t["precision"] = "fp16"
    if data.get("tf32") is not None:
        t["tf32"] = as_bool(where + "tf32", data["tf32"])
    gc = data.get("gradient_checkpointing")
    if gc in ("offload", "offload_disk", "unsloth"):
        # checkpointing whose saved block inputs go to host memory (or disk): priced as full
        # checkpointing that keeps them on the GPU, said
        t["activation_checkpointing"] = "full"
        recipe.ignored.append(f"gradient_checkpointing {gc} (the checkpoints' offload is not modelled: they are "
                              "priced in GPU memory)")
    elif gc is not None:
        t["activation_checkpointing"] = "full" if as_bool(where + "gradient_checkpointing", gc) else "none"
    # axolotl's attention switches (HF's sdpa when none is set); xformers' and flex attention's
    # causal kernels are priced as FlashAttention-2's
    for key, attn in (("eager_attention", "eager"), ("flash_attention", "flash_attention_2"),
                      ("sdp_attention", "sdpa"), ("xformers_attention", "flash_attention_2"),
                      ("flex_attention", "flash_attention_2")):
        if data.get(key) is True:
            t["attn_implementation"] = attn
            if key in ("xformers_attention", "flex_attention"):
                recipe.notes.append(f"{where}{key}: priced as flash_attention_2 (an IO-aware causal kernel)")
            break
    if data.get("attn_implementation") is not None:
        _axolotl_attn_implementation(recipe, str(data["attn_implementation"]), where)
    _liger(recipe, {k: data.get(k) for k in ("liger_rms_norm", "liger_glu_activation", "liger_rope",
                                             "liger_fused_linear_cross_entropy")}, where)
    if data.get("experts_implementation") is not None:
        _axolotl_experts(recipe, str(data["experts_implementation"]), where)
    if data.get("quantize_moe_experts") not in (None, False):
        recipe.ignored.append("quantize_moe_experts (the experts' 4/8-bit storage is not modelled: they are priced "
                              "16-bit, as bitsandbytes leaves transformers 5's 3D experts)")
    if data.get("max_grad_norm") is not None:
        t["max_grad_norm"] = as_float(where + "max_grad_norm", data["max_grad_norm"])
    if adapter in ("lora", "qlora"):
        lora: dict = {}
        if data.get("lora_r") is not None:
            lora["rank"] = as_int(where + "lora_r", data["lora_r"])
        if data.get("lora_alpha") is not None:
            lora["alpha"] = as_float(where + "lora_alpha", data["lora_alpha"])
        if data.get("lora_dropout") is not None:
            lora["dropout"] = as_float(where + "lora_dropout", data["lora_dropout"])
        if data.get("lora_target_linear") is True:
            lora["target_modules"] = "all-linear"
        elif data.get("lora_target_modules"):
            lora["target_modules"] = as_names(data["lora_target_modules"])
        if data.get("lora_modules_to_save"):
            lora["modules_to_save"] = as_names(data["lora_modules_to_save"])
        t["lora"] = lora
    optimizer = data.get("optimizer")
    if optimizer in ("adamw_torch", "adamw_torch_fused"):
        t["optim"] = optimizer   # axolotl passes it to the HF Trainer's optim
    if optimizer not in (None, "adamw_torch", "adamw_torch_fused", "adamw_hf"):
        recipe.ignored.append(f"optimizer {optimizer} (zsim prices AdamW's states)")
    # axolotl features that change the step but that zsim does not model yet: said, never dropped
    # silently (its sequence/context parallelism is ring-flash-attn's, not DeepSpeed-Ulysses)
    for key in ("context_parallel_size", "sequence_parallel_degree"):
        if isinstance(data.get(key), int) and data[key] > 1:
            recipe.ignored.append(f"{key} {data[key]} (not modelled: every GPU is simulated holding the whole "
                                  f"sequence_len, so memory and time are those of no sequence parallelism)")
    if data.get("tiled_mlp") not in (None, False):
        # axolotl's tiled_mlp: DeepSpeed's TiledMLP (ALST) on each dense MLP
        t["tiled_mlp"] = True
        if data.get("tiled_mlp_num_shards") is not None:
            t["tiled_mlp_shards"] = as_int(where + "tiled_mlp_num_shards", data["tiled_mlp_num_shards"])
    for key in ("activation_offloading", "sample_packing"):
        if data.get(key) not in (None, False):
            recipe.ignored.append(f"{key} {data[key]} (not modelled)")
    if any(str(x).endswith("CutCrossEntropyPlugin") for x in data.get("plugins") or ()):
        # Cut Cross-Entropy (Wijmans et al. 2024): the loss from hidden states and lm_head's weight
        # without materialising the logits, as Liger's fused linear cross-entropy
        t["fused_cross_entropy"] = True
        recipe.notes.append(f"{where}CutCrossEntropyPlugin: the loss priced as a fused linear cross-entropy "
                            "(training.fused_cross_entropy)")
    others = [str(x) for x in data.get("plugins") or ()
              if "liger" not in str(x).lower() and not str(x).endswith("CutCrossEntropyPlugin")]
    if others:
        recipe.ignored.append(f"plugins {', '.join(others)} (their fused kernels are not modelled)")
    if data.get("reward_model") not in (None, False) and as_bool(where + "reward_model", data["reward_model"]):
        # axolotl core/builders/causal.py: TRL's RewardTrainer on AutoModelForSequenceClassification
        # (model_type, num_labels 1), chosen and rejected concatenated in one batch
        _reward(recipe, "score", where, "reward_model")
    if rl:
        # axolotl's rl trainers (core/trainers/dpo, builders/rl.py): TRL's DPOTrainer for dpo and
        # ipo (loss_type ipo), ORPOTrainer, CPOTrainer with loss_type simpo
        _preference(recipe, AXOLOTL_PAIRED[rl], where, f"rl {rl}")
    if data.get("deepspeed"):
        recipe.ds_config = _find(str(data["deepspeed"]), bases, where + "deepspeed")
    elif data.get("fsdp") or data.get("fsdp_config"):
        raise fsdp_refusal(data.get("fsdp_config") or {}, where)
    return recipe


# axolotl's attn_implementation (schemas/enums.py CANONICAL_ATTN_IMPLS; a hub-kernel path with a
# "/" passes through to from_pretrained): HF's own names as they are, the other IO-aware kernels
# priced as FlashAttention's
AXOLOTL_ATTN = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash_attention_2",
                "flash_attention_3": "flash_attention_3", "flex_attention": "flash_attention_2",
                "xformers": "flash_attention_2", "sage": "flash_attention_2", "fp8": "flash_attention_2"}
# SHORT_FORM_ALIAS_TO_CANONICAL: refused by axolotl's validator
AXOLOTL_ATTN_SHORT = {"flash": "flash_attention_2", "flex": "flex_attention", "sdp": "sdpa"}


def _axolotl_attn_implementation(recipe: Recipe, value: str, where: str):
    if value in AXOLOTL_ATTN_SHORT:
        raise ZsimInputError(f"{where}attn_implementation", value, f"axolotl does not accept it: use the canonical "
                             f"name {AXOLOTL_ATTN_SHORT[value]}")
    if "/" in value:      # a Hub kernel: FlashAttention-3 by name, else priced as FlashAttention-2
        attn = "flash_attention_3" if "attn3" in value else "flash_attention_2"
    elif value in AXOLOTL_ATTN:
        attn = AXOLOTL_ATTN[value]
    else:
        raise ZsimInputError(f"{where}attn_implementation", value, "axolotl takes " + ", ".join(AXOLOTL_ATTN)
                             + " or a hub-kernel path (org/name)")
    recipe.training["attn_implementation"] = attn
    if attn != value:
        recipe.notes.append(f"{where}attn_implementation {value}: priced as {attn} (an IO-aware causal kernel)")


def _axolotl_experts(recipe: Recipe, value: str, where: str):
    """axolotl's experts_implementation (loaders/model.py _configure_experts_implementation:
    model.set_experts_implementation): transformers 5's grouped_mm and eager as they are
    (see [Note: transformers 5 MoE experts]); ScatterMoE's kernels (its plugin), one kernel per
    projection over every expert, priced as grouped_mm; batched_mm (a bmm over weights gathered
    per routed row) is not modelled."""
    if value in ("grouped_mm", "eager"):
        recipe.training["experts_implementation"] = value
    elif value == "scattermoe":
        recipe.training["experts_implementation"] = "grouped_mm"
        recipe.notes.append(f"{where}experts_implementation scattermoe: priced as grouped_mm (one kernel per "
                            "projection over every expert)")
    else:
        raise ZsimInputError(f"{where}experts_implementation", value, "zsim models grouped_mm (transformers 5's "
                             "default), eager and scattermoe; drop the key for grouped_mm")


# axolotl's rl values zsim models -> training.preference.method
AXOLOTL_PAIRED = {"dpo": "dpo", "ipo": "ipo", "orpo": "orpo", "simpo": "simpo"}


def _axolotl_bnb(data: dict, adapter, recipe: Recipe, where: str):
    """axolotl's bitsandbytes settings (loaders/model.py _set_quantization_config; schemas/peft.py
    validate_adapter, validate_qlora): adapter qlora with load_in_4bit is NF4 with double
    quantization and bf16 quant_storage, bnb_config_kwargs overriding; adapter lora with
    load_in_8bit is LLM.int8; lora with load_in_4bit builds no quantization config."""
    four, eight = (as_bool(where + k, data.get(k) or False) for k in ("load_in_4bit", "load_in_8bit"))
    if (four or eight) and not adapter:
        raise ZsimInputError(f"{where}load_in_{'4' if four else '8'}bit", True, "axolotl quantizes only under an "
                             "adapter (its validate_adapter refuses it for full fine-tuning): set adapter: qlora")
    if adapter == "qlora" and eight:
        raise ZsimInputError(f"{where}load_in_8bit", True, "axolotl refuses qlora in 8-bit (\"Can't load qlora in "
                             "8bit\"): use adapter: lora with load_in_8bit, or load_in_4bit")
    if adapter == "qlora" and not four:
        raise ZsimInputError(f"{where}adapter", adapter, "axolotl requires load_in_4bit: true for qlora "
                             "(validate_qlora)")
    if adapter == "lora" and four:
        recipe.notes.append(f"{where}load_in_4bit with adapter: lora: axolotl builds its 4-bit config for adapter "
                            "qlora only, so the base weights stay 16-bit")
        return
    if adapter == "qlora":
        kwargs = data.get("bnb_config_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ZsimInputError(f"{where}bnb_config_kwargs", kwargs, "expected a mapping of BitsAndBytesConfig keys")
        quant_type = kwargs.get("bnb_4bit_quant_type", "nf4")
        double = as_bool(where + "bnb_config_kwargs.bnb_4bit_use_double_quant",
                         kwargs.get("bnb_4bit_use_double_quant", True))
        recipe.training.update(bnb_training(where + "bnb_config_kwargs.", True, False, quant_type, double))
        recipe.notes.append(f"{where}adapter qlora: base linears {quant_type}{' with' if double else ' without'} "
                            "double quantization (axolotl's bnb_4bit_* defaults unless bnb_config_kwargs sets them)")
    elif eight:
        recipe.training.update(bnb_training(where, False, True))


def _llama_factory_bnb(data: dict, recipe: Recipe, bases: list[Path], where: str):
    """LLaMA-Factory's on-the-fly quantization (model/model_utils/quantization.py
    configure_quantization; hparams/model_args.py QuantizationArguments: quantization_method bnb,
    quantization_type nf4, double_quantization true; hparams/parser.py _verify_model_args)."""
    bits = data.get("quantization_bit")
    if bits in (None, "", "none"):
        return
    bits = as_int(where + "quantization_bit", bits)
    method = str(data.get("quantization_method", "bnb"))
    if method not in ("bnb", "bitsandbytes"):
        raise ZsimInputError(f"{where}quantization_method", method, "zsim models bitsandbytes (quantization_method: "
                             "bnb, 4 or 8 bits); drop quantization_bit to simulate 16-bit base weights")
    if bits not in (4, 8):
        raise ZsimInputError(f"{where}quantization_bit", bits, "bitsandbytes takes 4 or 8 (LLaMA-Factory's check)")
    if data.get("finetuning_type", "lora") != "lora":
        raise ZsimInputError(f"{where}quantization_bit", bits, "LLaMA-Factory quantizes only for finetuning_type "
                             "lora (or oft)")
    if bits == 8:
        if recipe.ds_config is not None and _zero_stage(recipe.ds_config, bases) == 3:
            raise ZsimInputError(f"{where}quantization_bit", 8, "LLaMA-Factory refuses 8-bit under DeepSpeed ZeRO-3 "
                                 "(\"Only 4-bit quantized model can use fsdp+qlora\"): use 4, or a ZeRO-2 config")
        recipe.training.update(bnb_training(where, False, True))
        return
    quant_type = str(data.get("quantization_type", "nf4"))
    if quant_type not in ("nf4", "fp4"):
        raise ZsimInputError(f"{where}quantization_type", quant_type, "choose nf4 or fp4 (LLaMA-Factory's values)")
    double = as_bool(where + "double_quantization", data.get("double_quantization", True))
    recipe.training.update(bnb_training(where, True, False, quant_type, double))
    if "quantization_type" not in data or "double_quantization" not in data:
        recipe.notes.append(f"{where}quantization_bit 4: {quant_type}{' with' if double else ' without'} double "
                            "quantization (LLaMA-Factory's quantization_type / double_quantization defaults)")


def _zero_stage(ref, bases: list[Path]) -> int | None:
    """The ZeRO stage of the ds_config a recipe names (None when it cannot be read here; the
    scenario reads the file properly later)."""
    import json
    try:
        ds = json.loads(_find(str(ref), bases, "deepspeed").read_text())
        return int(ds.get("zero_optimization", {}).get("stage", 0))
    except (ZsimInputError, OSError, ValueError, TypeError, AttributeError):
        return None


def read_llama_factory(data: dict, path: Path, bases: list[Path], recipe: Recipe) -> Recipe:
    """LLaMA-Factory's recipe: HfArgumentParser over ModelArguments, DataArguments,
    Seq2SeqTrainingArguments and FinetuningArguments (src/llamafactory/hparams/)."""
    where = f"{path.name}: "
    stage = data.get("stage", "sft")
    if stage in ("kto", "ppo"):
        raise _preference_refusal(f"{where}stage", stage, "stage sft, pt, rm and dpo")
    kind = data.get("finetuning_type", "lora")      # FinetuningArguments' default
    if kind not in ("full", "lora", "freeze"):
        raise ZsimInputError(f"{where}finetuning_type", kind, "choose full, lora or freeze (LLaMA-Factory's values)")
    args = {k: v for k, v in data.items() if k not in LF_OWN and k not in LF_NOT_MODELLED and k != "pure_bf16"}
    read_trainer_args(args, recipe, where=where)
    t = recipe.training
    for key, (switch, what) in LF_NOT_MODELLED.items():
        if key == switch and data.get(key) not in (None, False):
            recipe.ignored.append(f"{key} {data[key]} ({what})")
    if as_bool(where + "pure_bf16", data.get("pure_bf16", False)):
        # FinetuningArguments.pure_bf16: the model is loaded and trained in bf16 without AMP
        # (hparams/parser.py sets compute_dtype bf16; model/loader casts the weights)
        t["precision"] = "bf16"
        recipe.notes.append(f"{where}pure_bf16: bf16 weights; zsim keeps fp32 master weights and AdamW states "
                            "beside them (DeepSpeed's bf16 mode), which pure bf16 training does not: an upper bound "
                            "on memory")
    if "cutoff_len" not in data:
        t["seq_len"] = 2048
        recipe.notes.append(f"{where}cutoff_len not given: LLaMA-Factory's default 2048")
    # ModelArguments.disable_gradient_checkpointing (default false): LLaMA-Factory turns it on
    if not as_bool(where + "disable_gradient_checkpointing", data.get("disable_gradient_checkpointing", False)):
        t["activation_checkpointing"] = "full"
    else:
        t["activation_checkpointing"] = "none"
    # ModelArguments.flash_attn (AttentionFunction): auto leaves HF's choice (sdpa)
    flash = str(data.get("flash_attn", "auto"))
    attn = {"auto": "sdpa", "disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2",
            "fa3": "flash_attention_3"}.get(flash)
    if attn is None:
        raise ZsimInputError(f"{where}flash_attn", flash, "LLaMA-Factory takes auto, disabled, sdpa, fa2 or fa3")
    t["attn_implementation"] = attn
    if as_bool(where + "enable_liger_kernel", data.get("enable_liger_kernel", False)):
        # LLaMA-Factory's apply_liger_kernel: RMSNorm, RoPE, SwiGLU and, for training without
        # logits (require_logits: stage not pt or sft), the fused linear cross-entropy
        _liger(recipe, {"liger_rms_norm": True, "liger_glu_activation": True, "liger_rope": True,
                        "liger_fused_linear_cross_entropy": stage in ("pt", "sft")}, where)
    t.pop("lora", None)
    if kind == "lora":
        rank = as_int(where + "lora_rank", data.get("lora_rank", 8))
        lora: dict = {"rank": rank, "alpha": as_float(where + "lora_alpha", data.get("lora_alpha") or rank * 2)}
        if data.get("lora_dropout") is not None:
            lora["dropout"] = as_float(where + "lora_dropout", data["lora_dropout"])
        targets = as_names(data.get("lora_target", "all"))
        lora["target_modules"] = "all-linear" if targets == ["all"] else targets
        if data.get("additional_target"):
            lora["modules_to_save"] = as_names(data["additional_target"])
        t["lora"] = lora
    if kind == "freeze":
        t["freeze"] = _llama_factory_freeze(data, where)
    if stage == "rm":
        # train/rm/workflow.py: load_model(add_valuehead=True) (TRL's AutoModelForCausalLMWithValueHead)
        # and PairwiseDataCollatorWithPadding (chosen and rejected in one batch)
        _reward(recipe, "value_head", where, "stage rm")
    if stage == "dpo":
        # FinetuningArguments.pref_loss (sigmoid, hinge, ipo, kto_pair, orpo, simpo): use_ref_model
        # unless orpo or simpo; create_ref_model gives None under lora (the adapters disabled)
        loss = str(data.get("pref_loss", "sigmoid"))
        method = LF_PREF_LOSS.get(loss)
        if method is None:
            raise ZsimInputError(f"{where}pref_loss", loss, "choose " + ", ".join(LF_PREF_LOSS)
                                 + " (LLaMA-Factory's values)")
        _preference(recipe, method, where, f"stage dpo, pref_loss {loss}")
    if recipe.ds_config is not None:
        recipe.ds_config = _find(str(recipe.ds_config), bases, where + "deepspeed")
    _llama_factory_bnb(data, recipe, bases, where)
    return recipe


# LLaMA-Factory's pref_loss -> training.preference.method (the losses differ in a few scalar ops;
# the step is the same: hinge and kto_pair run DPO's reference forward too)
LF_PREF_LOSS = {"sigmoid": "dpo", "hinge": "dpo", "ipo": "ipo", "kto_pair": "dpo", "orpo": "orpo", "simpo": "simpo"}


def _llama_factory_freeze(data: dict, where: str) -> dict:
    """FreezeArguments (hparams/finetuning_args.py): freeze_trainable_layers (2),
    freeze_trainable_modules (all), freeze_extra_modules (none), use_llama_pro."""
    freeze: dict = {"trainable_layers": as_int(where + "freeze_trainable_layers",
                                               data.get("freeze_trainable_layers", 2))}
    if data.get("freeze_trainable_modules") is not None:
        freeze["trainable_modules"] = as_names(data["freeze_trainable_modules"])
    if data.get("freeze_extra_modules"):
        freeze["extra_modules"] = as_names(data["freeze_extra_modules"])
    if data.get("use_llama_pro") is not None:
        freeze["llama_pro"] = as_bool(where + "use_llama_pro", data["use_llama_pro"])
    return freeze


# LLaMA-Factory's own keys (read above, or changing nothing zsim prices)
LF_OWN = frozenset({"stage", "finetuning_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_target",
                    "additional_target", "disable_gradient_checkpointing", "flash_attn", "dataset",
                    "eval_dataset", "template", "max_samples", "val_size", "dataset_dir", "plot_loss",
                    "enable_liger_kernel", "use_unsloth", "tokenized_path", "mix_strategy", "interleave_probs",
                    "media_dir", "image_max_pixels", "video_max_pixels", "trust_remote_code", "freeze_vision_tower",
                    "freeze_multi_modal_projector", "train_mm_proj_only", "pref_beta", "pref_loss", "pref_ftx", "freeze_trainable_layers", "freeze_trainable_modules",
                    "freeze_extra_modules", "use_llama_pro", "packing",
                    "neat_packing", "buffer_size", "default_system", "enable_thinking", "resize_vocab",
                    "split_special_tokens", "new_special_tokens", "rope_scaling", "shift_attn", "use_dora",
                    "pissa_init", "create_new_adapter", "adapter_name_or_path", "export_dir", "infer_backend",
                    "quantization_bit", "quantization_method", "quantization_type", "double_quantization",
                    "upcast_layernorm"})


# LLaMA-Factory's FinetuningArguments switches that change the step zsim does not model: key ->
# (the switch that turns the group on, what the prediction leaves out); the group's other keys are
# read by the switch's line and not listed again
LF_NOT_MODELLED = {
    "use_galore": ("use_galore", "GaLore's low-rank optimizer states are not modelled: AdamW's full states priced"),
    "use_apollo": ("use_apollo", "APOLLO's low-rank optimizer states are not modelled: AdamW's full states priced"),
    "use_badam": ("use_badam", "BAdam's block-wise updates are not modelled: every block priced as trained"),
    "use_muon": ("use_muon", "Muon's optimizer (one momentum buffer, Newton-Schulz steps) is not modelled: AdamW "
                             "priced"),
    "use_adam_mini": ("use_adam_mini", "Adam-mini's reduced second moments are not modelled: AdamW priced"),
    "fp8": ("fp8", "FP8 GEMMs are not modelled: the step is priced in the run's 16-bit precision"),
    **{k: ("", "") for k in ("galore_layerwise", "galore_target", "galore_rank", "galore_scale",
                             "galore_update_interval", "galore_proj_type", "apollo_layerwise", "apollo_target",
                             "apollo_rank", "apollo_scale", "apollo_update_interval", "apollo_proj",
                             "apollo_proj_type", "apollo_scale_type", "badam_mode", "badam_start_block",
                             "badam_switch_mode", "badam_switch_interval", "badam_update_ratio", "badam_mask_mode",
                             "badam_verbose", "fp8_backend", "fp8_enable_fsdp_float8_all_gather")},
}


def _liger(recipe: Recipe, keys: dict, where: str):
    """Liger's kernels (axolotl's liger_* keys, LLaMA-Factory's enable_liger_kernel): its RMSNorm
    and SwiGLU make the elementwise kernels fused (training.kernels), its fused linear
    cross-entropy lm_head and the loss (training.fused_linear_cross_entropy); a partial set is said
    in a note."""
    on = [k for k, v in keys.items() if v is True]
    if not on:
        return
    t = recipe.training
    if keys.get("liger_rms_norm") is True and keys.get("liger_glu_activation") is True:
        t["kernels"] = "fused"
        if keys.get("liger_rope") is not True:
            recipe.notes.append(f"{where}liger_rope not set: HF's RoPE priced as fused with the rest")
    else:
        recipe.notes.append(f"{where}{', '.join(on)}: without both liger_rms_norm and liger_glu_activation the "
                            "elementwise kernels are priced as HF's (training.kernels hf)")
    if keys.get("liger_fused_linear_cross_entropy") is True:
        t["fused_linear_cross_entropy"] = True

