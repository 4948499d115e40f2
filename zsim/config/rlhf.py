"""The scenario's `rlhf:` block (zsim/specs/rlhf.py): read, its batch and length given to the
actor's training block, and refused where DeepSpeed-Chat would not run it or zsim does not model
it, one line each."""
from __future__ import annotations

from dataclasses import replace

from zsim.config.generation import check_positions
from zsim.errors import ZsimInputError
from zsim.schema import build
from zsim.specs.rlhf import RlhfSpec
from zsim.specs.scenario import TrainingSpec


# the actor ds_config's hybrid_engine block (runtime/config.py HybridEngineConfig, as DeepSpeed-Chat's
# get_train_ds_config writes it) -> the rlhf keys it sets; pin_parameters is unpin_actor_parameters negated
HYBRID_KEYS = {"enabled": "enable_hybrid_engine", "inference_tp_size": "inference_tp_size",
               "tp_gather_partition_size": "tp_gather_partition_size",
               "release_inference_cache": "release_inference_cache", "pin_parameters": "unpin_actor_parameters",
               "max_out_tokens": "max_out_tokens"}


def _hybrid_engine(raw: dict, ds_raw: dict) -> dict:
    """The rlhf block's keys with the ds_config's hybrid_engine block folded in (a key both give must agree)."""
    block = ds_raw.get("hybrid_engine")
    if not isinstance(block, dict):
        return raw
    out = dict(raw)
    for key, name in HYBRID_KEYS.items():
        if key not in block:
            continue
        value = (not block[key]) if key == "pin_parameters" and isinstance(block[key], bool) else block[key]
        if name in raw and raw[name] != value:
            raise ZsimInputError(f"rlhf.{name}", raw[name], f"disagrees with the ds_config's hybrid_engine.{key} = "
                                 f"{block[key]!r}; drop one")
        out[name] = value
    return out


def read_rlhf(raw, training: TrainingSpec, notes: list, ds_raw: dict) -> tuple[RlhfSpec | None, TrainingSpec]:
    """The block (its critic_model still the raw mapping; the ds_config's hybrid_engine block read into
    it), and the actor's training block with the PPO micro-batch and the experience's length (prompt +
    answer) where it leaves them open."""
    if raw is None:
        return None, training
    if not isinstance(raw, dict):
        raise ZsimInputError("rlhf", raw, "expected a mapping (per_device_generation_batch_size, max_prompt_seq_len, ...)")
    raw = _hybrid_engine(raw, ds_raw)
    spec = build(RlhfSpec, {k: v for k, v in raw.items() if k != "critic_model"}, "rlhf")
    if spec.enable_hybrid_engine and spec.max_out_tokens is not None and spec.max_out_tokens < spec.seq_len:
        raise ZsimInputError("deepspeed.hybrid_engine.max_out_tokens", spec.max_out_tokens, f"is below "
                             f"max_prompt_seq_len + max_answer_seq_len = {spec.seq_len}: the inference workspace "
                             "holds max_out_tokens tokens (DeepSpeed-Chat sets it to their sum)")
    critic = raw.get("critic_model")
    if critic is not None and not isinstance(critic, dict):
        raise ZsimInputError("rlhf.critic_model", critic, "expected a model mapping (preset: NAME, or hf_config: PATH)")
    spec = replace(spec, critic_model=critic)
    for field, value, name in (("micro_batch_size", spec.per_device_training_batch_size, "per_device_training_batch_size"),
                               ("seq_len", spec.seq_len, "max_prompt_seq_len + max_answer_seq_len")):
        given = getattr(training, field)
        if given is None:
            training = replace(training, **{field: value})
        elif given != value:
            raise ZsimInputError(f"training.{field}", given, f"disagrees with rlhf's {name} = {value}: the actor "
                                 "trains on the generated experience; drop training." + field)
    if training.gradient_accumulation_steps is None:
        training = replace(training, gradient_accumulation_steps=1)
    return spec, training


def check_rlhf(spec: RlhfSpec, model, critic, training, par, zero, world_size: int) -> None:
    """What DeepSpeed-Chat's step 3 runs and zsim models (see [Note: DeepSpeed-Chat's PPO iteration])."""
    for field, value in (("pipeline", par.pipeline), ("tensor", par.tensor), ("sequence", par.sequence),
                         ("expert", par.expert)):
        if value > 1:
            raise ZsimInputError(f"parallelism.{field}", value, "DeepSpeed-Chat trains data-parallel under ZeRO; "
                                 "drop it (the hybrid engine's generation takes rlhf.inference_tp_size)")
    for m, who in ((model, "model"), (critic, "rlhf.critic_model")):
        if m.moe is not None or m.mamba is not None:
            raise ZsimInputError(who, "moe" if m.moe is not None else "mamba", "DeepSpeed-Chat's PPO over a "
                                 "mixture-of-experts or recurrent model is not modelled")
    if training.preference is not None or training.quantization != "none":
        field = "preference" if training.preference is not None else "quantization"
        raise ZsimInputError(f"training.{field}", getattr(training, field), "is not part of DeepSpeed-Chat's "
                             "PPO step; drop it")
    tp = spec.inference_tp_size
    if tp > 1 and not spec.enable_hybrid_engine:
        raise ZsimInputError("rlhf.inference_tp_size", tp, "applies to the hybrid engine's generation; set "
                             "rlhf.enable_hybrid_engine: true, or 1")
    if tp > 1 and zero.stage != 3:
        # main.py parse_args: "Zero stage 3 must be used to do Tensor sharding in the hybrid engine"
        raise ZsimInputError("rlhf.inference_tp_size", tp, "needs the actor at ZeRO stage 3 (DeepSpeed-Chat asserts "
                             "it); set zero_optimization.stage: 3 or 1")
    if world_size % tp or model.heads % tp or model.n_kv_heads % tp:
        raise ZsimInputError("rlhf.inference_tp_size", tp, f"must divide the {world_size} GPUs and the model's "
                             f"{model.heads} heads and {model.n_kv_heads} KV heads")
    if spec.enable_hybrid_engine and model.mla is not None:
        raise ZsimInputError("rlhf.enable_hybrid_engine", True, "DeepSpeed's inference containers have no policy "
                             "for Multi-head Latent Attention")
    gen, train = spec.per_device_generation_batch_size, spec.per_device_training_batch_size
    if gen % train:
        raise ZsimInputError("rlhf.per_device_training_batch_size", train, f"must divide "
                             f"per_device_generation_batch_size ({gen}): each experience batch is cut into "
                             "training micro-batches")
    check_positions(model, spec.seq_len, "rlhf.max_answer_seq_len", spec.max_answer_seq_len,
                    "max_prompt_seq_len + max_answer_seq_len")
    if zero.stage == 3 and zero.param_offload_device == "nvme":
        raise ZsimInputError("deepspeed.zero_optimization.offload_param.device", "nvme", "DeepSpeed-Chat offloads "
                             "to the CPU (--offload); NVMe for its engines is not modelled")
