"""The scenario's `inference:` block (zsim/specs/generation.py): read, and refused where DeepSpeed
would not run it or zsim does not model it, one line each."""
from __future__ import annotations

from zsim.errors import ZsimInputError
from zsim.schema import build
from zsim.specs.generation import GenerationSpec

# the ds_config's batch keys: DeepSpeed's initialize needs one even for an inference engine
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu")


def read_inference(raw, ds_raw: dict, training_raw, notes: list) -> GenerationSpec | None:
    """The block, or None; a ds_config without a batch gets train_micro_batch_size_per_gpu 1 (what
    DeepSpeed's ZeRO-Inference examples set: initialize asserts a batch, generation never reads it)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ZsimInputError("inference", raw, "expected a mapping (batch_size, prompt_len, new_tokens, ...)")
    raw = _weight_quantization(raw, ds_raw, notes)
    gen = build(GenerationSpec, raw, "inference")
    given = isinstance(training_raw, dict) and training_raw.get("micro_batch_size") is not None
    if not given and not any(ds_raw.get(k) is not None for k in _BATCH_KEYS):
        ds_raw["train_micro_batch_size_per_gpu"] = 1
        notes.append("deepspeed.train_micro_batch_size_per_gpu: 1 (DeepSpeed's initialize needs a batch; generation "
                     "uses inference.batch_size)")
    return gen


def _weight_quantization(raw: dict, ds_raw: dict, notes: list) -> dict:
    """The inference block with the ds_config's weight_quantization read into it (see [Note:
    ZeRO-Inference quantized weights]): quantized_initialization's num_bits and group_size, which
    zero.Init applies, so under ZeRO-3 only (another stage: DeepSpeed leaves the weights as they
    are, and a note says so)."""
    wq = ds_raw.get("weight_quantization")
    if not isinstance(wq, dict):
        return raw
    if wq.get("post_init_quant"):
        notes.append("deepspeed.weight_quantization.post_init_quant: not modelled (init_inference's quantization "
                     "after loading); the weights are priced unquantized")
    qi = wq.get("quantized_initialization")
    if not isinstance(qi, dict) or not qi:
        return raw
    zero = ds_raw.get("zero_optimization")
    if not (isinstance(zero, dict) and zero.get("stage") == 3):
        notes.append("deepspeed.weight_quantization.quantized_initialization: zero.Init applies it, i.e. under ZeRO "
                     "stage 3; at this stage DeepSpeed leaves the weights unquantized")
        return raw
    if qi.get("symmetric", False) is not False:
        raise ZsimInputError("deepspeed.weight_quantization.quantized_initialization.symmetric", qi["symmetric"],
                             "DeepSpeed's Quantizer asserts asymmetric quantization; set it false")
    out = dict(raw)
    for key, name in (("num_bits", "weight_bits"), ("group_size", "weight_group_size")):
        if key in qi:
            if name in raw and raw[name] != qi[key]:
                raise ZsimInputError(f"inference.{name}", raw[name], f"disagrees with the ds_config's "
                                     f"weight_quantization.quantized_initialization.{key} = {qi[key]!r}; drop one")
            out[name] = qi[key]
    return out


def check_inference(gen: GenerationSpec, model, training, par, zero, world_size: int) -> None:
    """What generate() under DeepSpeed can run and zsim models (see [Note: generation])."""
    tp = gen.tensor_parallel
    if model.moe is not None:
        raise ZsimInputError("inference", "moe", "generation of a mixture-of-experts model is not modelled yet; "
                             "simulate its training step (drop the inference block)")
    if model.mamba is not None:
        raise ZsimInputError("inference", "mamba", "generation with recurrent (Mamba) layers is not modelled (their "
                             "state is not a KV cache); drop the inference block")
    for field, on in (("lora", training.lora is not None), ("quantization", training.quantization != "none"),
                      ("preference", training.preference is not None), ("fp8", training.fp8),
                      ("tiled_mlp", training.tiled_mlp), ("fused_linear_cross_entropy", training.fused_linear_cross_entropy),
                      ("frozen", bool(training.frozen)), ("freeze", training.freeze is not None)):
        if on:
            raise ZsimInputError(f"training.{field}", getattr(training, field), "is a training setting, not modelled "
                                 "for generation; drop it from an inference scenario")
    for field, value in (("pipeline", par.pipeline), ("tensor", par.tensor), ("sequence", par.sequence),
                         ("expert", par.expert)):
        if value > 1:
            raise ZsimInputError(f"parallelism.{field}", value, "is a training layout; generation splits a replica "
                                 "with inference.tensor_parallel")
    if world_size % tp:
        raise ZsimInputError("inference.tensor_parallel", tp, f"must divide the {world_size} GPUs (each replica "
                             "takes tensor_parallel of them)")
    if tp > 1 and (model.heads % tp or model.n_kv_heads % tp):
        raise ZsimInputError("inference.tensor_parallel", tp, f"must divide the {model.heads} attention heads and "
                             f"{model.n_kv_heads} KV heads (each GPU holds whole heads); choose a divisor")
    if tp > 1 and model.mla is not None:
        raise ZsimInputError("inference.tensor_parallel", tp, "tensor parallelism over Multi-head Latent Attention "
                             "is not modelled; use 1")
    if zero.stage == 3 and (tp > 1 or gen.kernel_inject):
        field, value = ("inference.tensor_parallel", tp) if tp > 1 else ("inference.kernel_inject", True)
        raise ZsimInputError(field, value, "ZeRO-Inference (zero_optimization.stage 3) runs the model's own code "
                             "under deepspeed.initialize, with no inference tensor parallelism or kernel injection; "
                             "drop it, or use stage 0 for DeepSpeed-Inference")
    if gen.weight_bits not in (4, 8, 16):
        raise ZsimInputError("inference.weight_bits", gen.weight_bits, "DeepSpeed quantizes to 4 or 8 bits (16: "
                             "not quantized)")
    if gen.weight_bits < 16 and zero.stage != 3:
        raise ZsimInputError("inference.weight_bits", gen.weight_bits, "ZeRO-Inference's weight quantization is "
                             "applied by zero.Init, under zero_optimization.stage 3; set it, or 16")
    if gen.weight_bits < 16:
        # Quantizer.quantize asserts the group size divides the grouped (input-feature) dimension of
        # every weight, and 4 bits pack two codes a byte (inference/quantization/utils.py)
        dims = {model.hidden, model.heads * model.head_size, model.ffn, model.embed_proj_dim or model.hidden}
        if model.mla is not None:
            dims |= {model.mla.kv_lora_rank, *((model.mla.q_lora_rank,) if model.mla.q_lora_rank else ())}
        bad = sorted(d for d in dims if d % gen.weight_group_size)
        if bad or (gen.weight_bits == 4 and gen.weight_group_size % 2):
            raise ZsimInputError("inference.weight_group_size", gen.weight_group_size,
                                 f"must divide every weight's input features ({', '.join(map(str, bad))} do not)"
                                 if bad else "must be even for 4 bits (two codes a byte)")
    if gen.cuda_graph and not gen.kernel_inject:
        raise ZsimInputError("inference.cuda_graph", True, "needs kernel_inject: the HF code's DynamicCache changes "
                             "shape every step, so no graph replays; set inference.kernel_inject: true")
    if gen.kernel_inject and gen.total_tokens > gen.max_out_tokens:
        raise ZsimInputError("inference.max_out_tokens", gen.max_out_tokens,
                             f"is below prompt_len + new_tokens = {gen.total_tokens}: the injected kernels' KV "
                             "workspace holds max_out_tokens tokens; raise it")
    check_positions(model, gen.total_tokens, "inference.new_tokens", gen.new_tokens, "prompt_len + new_tokens")


def check_positions(model, tokens: int, field: str, value, what: str) -> None:
    """A sequence of `tokens` (`what`) fits a learned position table."""
    if model.position == "learned" and tokens > model.seq_len:
        raise ZsimInputError(field, value, f"{what} = {tokens} exceeds the model's learned position table "
                             f"(model.seq_len={model.seq_len}); shorten them")
