"""DeepSpeed-Chat's step-3 launch (`deepspeed main.py --actor_model_name_or_path ... --critic_model_name_or_path
...`, DeepSpeedExamples applications/DeepSpeed-Chat/training/step3_rlhf_finetuning/main.py) -> a Recipe
with an rlhf block: its arguments as main.py's argparse reads them (defaults included), the actor's
ds_config as dschat/utils/ds_utils.py get_train_ds_config builds it. See [Note: DeepSpeed-Chat's PPO
iteration] for the engines and the iteration."""
from __future__ import annotations

from zsim.config.trainer_args import Recipe, as_bool, as_int
from zsim.errors import ZsimInputError

# main.py's integer arguments that the rlhf block takes as they are
# main.py's string arguments the rlhf block takes
RLHF_STRINGS = ("data_split",)
RLHF_INTS = ("per_device_generation_batch_size", "per_device_training_batch_size", "generation_batches", "ppo_epochs",
             "max_prompt_seq_len", "max_answer_seq_len", "inference_tp_size", "tp_gather_partition_size")
# its store_true flags the rlhf block takes
RLHF_FLAGS = ("enable_hybrid_engine", "unpin_actor_parameters", "release_inference_cache", "offload_reference_model",
              "offload_reward_model", "critic_gradient_checkpointing")
# arguments that change nothing zsim prices (data, learning rates and schedules, logging, saving, testing)
NO_EFFECT = frozenset({
    "data_path", "data_output_path", "unsup_coef", "num_padding_at_beginning", "actor_learning_rate",
    "critic_learning_rate", "actor_weight_decay", "critic_weight_decay", "num_train_epochs", "lr_scheduler_type",
    "num_warmup_steps", "output_dir", "seed", "preprocessing_num_workers", "local_rank", "actor_dropout",
    "critic_dropout", "actor_lora_module_name", "critic_lora_module_name", "actor_lora_learning_rate",
    "critic_lora_learning_rate", "enable_tensorboard", "tensorboard_path", "add_eot_token", "print_answers",
    "print_answers_interval", "enable_test_mode", "test_stop_step", "deepspeed", "end_of_conversation_token",
})
# what main.py runs that zsim does not model
NOT_MODELLED = {"enable_ema": "the EMA copy of the actor", "enable_mixed_precision_lora": "ZeRO++'s mixed-precision LoRA",
                "compute_fp32_loss": "the fp32 loss", "align_overflow": "the overflow alignment",
                "unsupervised_dataset_name": "the unsupervised (pretraining) loss", "critic_lora_dim": "the critic's LoRA"}


def is_dschat_step3(script: str, flags: dict) -> bool:
    """Whether a training script and its flags are DeepSpeed-Chat's step 3 (main.py requires both models)."""
    return "actor_model_name_or_path" in flags and "critic_model_name_or_path" in flags


def _flag(flags: dict, name: str) -> bool:
    return name in flags and as_bool(f"--{name}", flags[name])


def read_dschat(flags: dict, recipe: Recipe) -> Recipe:
    """Fold main.py's arguments into `recipe`: the actor's model and training block, the critic and
    the PPO settings as its rlhf block, and get_train_ds_config's ds_config inline."""
    recipe.framework = "deepspeed"
    recipe.model = _one("--actor_model_name_or_path", flags["actor_model_name_or_path"])
    recipe.rlhf["critic_model"] = _one("--critic_model_name_or_path", flags["critic_model_name_or_path"])
    for name in RLHF_INTS:
        if name in flags:
            recipe.rlhf[name] = as_int(f"--{name}", flags[name])
    for name in RLHF_STRINGS:
        if name in flags:
            recipe.rlhf[name] = _one(f"--{name}", flags[name])
    for name in RLHF_FLAGS:
        if _flag(flags, name):
            recipe.rlhf[name] = True
    stage = as_int("--actor_zero_stage", flags.get("actor_zero_stage", 0))
    critic_stage = as_int("--critic_zero_stage", flags.get("critic_zero_stage", 0))
    recipe.rlhf["critic_zero_stage"] = critic_stage
    if recipe.rlhf.get("inference_tp_size", 1) > 1 and stage != 3:
        # main.py parse_args: "Zero stage 3 must be used to do Tensor sharding in the hybrid engine"
        raise ZsimInputError("--inference_tp_size", recipe.rlhf["inference_tp_size"], "needs --actor_zero_stage 3 "
                             "(DeepSpeed-Chat asserts it)")
    dtype = str(_one("--dtype", flags.get("dtype", "fp16")))
    if dtype not in ("fp16", "bf16"):
        raise ZsimInputError("--dtype", dtype, "DeepSpeed-Chat takes fp16 or bf16")
    t = recipe.training
    t["precision"] = dtype
    t["gradient_accumulation_steps"] = as_int("--gradient_accumulation_steps", flags.get("gradient_accumulation_steps", 1))
    t["activation_checkpointing"] = "full" if _flag(flags, "actor_gradient_checkpointing") else "none"
    lora = as_int("--actor_lora_dim", flags.get("actor_lora_dim", 0))
    if lora > 0 and _flag(flags, "only_optimize_lora"):
        # convert_linear_layer_to_lora over actor_lora_module_name ("decoder.layers.": every linear of the blocks)
        t["lora"] = {"r": lora, "lora_alpha": float(lora), "target_modules": "all-linear"}
    elif lora > 0:
        recipe.notes.append(f"--actor_lora_dim {lora} without --only_optimize_lora: the base weights train too, "
                            "priced as full fine-tuning (the adapters' own cost left out)")
    offload = _flag(flags, "offload")
    # get_train_ds_config: offload_param and offload_optimizer on the CPU with --offload (offload_param
    # applies at stage 3 only: DeepSpeed reads it there, and zsim refuses it below)
    device = "cpu" if offload else "none"
    zero = {"stage": stage, "overlap_comm": True, "offload_optimizer": {"device": device},
            "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False}
    if stage == 3:
        zero["offload_param"] = {"device": device}
    if offload and stage == 0:
        raise ZsimInputError("--offload", True, "needs --actor_zero_stage >= 1 (DeepSpeed's CPU optimizer runs on "
                             "ZeRO's partitions)")
    recipe.ds_inline.update({"zero_optimization": zero, dtype: {"enabled": True}, "gradient_clipping": 1.0,
                             "prescale_gradients": False})
    unmodelled = [k for k in NOT_MODELLED if k in flags and str(flags[k]) != "0"]
    if unmodelled:
        recipe.notes.append("not modelled: " + ", ".join(f"--{k} ({NOT_MODELLED[k]})" for k in unmodelled))
    known = set(RLHF_INTS) | set(RLHF_FLAGS) | set(RLHF_STRINGS) | NO_EFFECT | set(NOT_MODELLED) | {
        "actor_model_name_or_path", "critic_model_name_or_path", "actor_zero_stage", "critic_zero_stage", "dtype",
        "gradient_accumulation_steps", "actor_gradient_checkpointing", "actor_lora_dim", "only_optimize_lora",
        "offload"}
    recipe.ignored += [f"--{k}" for k in flags if k not in known]
    return recipe


def _one(name: str, value) -> str:
    if isinstance(value, list) or value is None:
        raise ZsimInputError(name, value, "expected one value")
    return str(value)
