"""Generation's workloads: the prefill (the prompt through the model once) and a decode step (one
new token per sequence against the KV cache), built from the training workload's modules and run
under torch.no_grad. See [Note: generation] (zsim/schedule/generate.py) for how they are scheduled.

Sources: transformers 5's generate (GenerationMixin._sample: the prefill computes logits for the
last position only, logits_to_keep=1; each later forward feeds one token per sequence), its
DynamicCache (cache_utils.py DynamicLayer.update: torch.cat of the cache and the new key/value,
so each step copies the whole cache), and DeepSpeed-Inference's injected kernels
(deepspeed/ops/transformer/inference: the KV cache is a workspace preallocated for max_out_tokens,
written in place).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from zsim.specs.model import ModelSpec
from zsim.workload.module import Module, ModuleKind, TensorRole, Workload
from zsim.workload.transformer import build_workload


@dataclass(frozen=True)
class KvShape:
    """One attention layer's cache per token per sequence on one rank: key and value widths, and
    the window a sliding-window layer keeps (None: every token)."""
    key: int
    value: int
    query: int         # the query width the core reads (the rank's heads x head dim)
    output: int        # the core's output width
    window: int | None

    def tokens(self, context: int) -> int:
        """Tokens the cache holds at `context` tokens of sequence."""
        return context if self.window is None else min(context, self.window)


def kv_shapes(m: ModelSpec, tensor: int) -> dict[int, KvShape]:
    """Each attention layer's cache shape (a Mamba layer keeps none). GQA caches its KV heads only;
    MLA as HF's DeepseekV3Attention caches it: every head's key (nope + rope) and value after
    kv_b_proj; tensor parallelism splits the heads."""
    out = {}
    for layer in range(m.layers):
        if not m.is_attention_layer(layer):
            continue
        if m.mla is not None:
            q = k = m.heads * m.mla.qk_head_dim
            v = o = m.heads * m.mla.v_head_dim
        else:
            q = o = m.heads * m.head_size // tensor
            k = v = m.n_kv_heads * m.head_size // tensor
        out[layer] = KvShape(key=k, value=v, query=q, output=o,
                             window=m.sliding_window if m.has_window(layer) else None)
    return out


def injected_workspace_bytes(m: ModelSpec, batch: int, max_out_tokens: int, tensor: int,
                             dtype_bytes: int) -> tuple[float, float]:
    """(KV cache, the rest) of DeepSpeed-Inference's kernel workspace (csrc/transformer/inference/
    includes/inference_context.h GenWorkSpace), allocated once for `batch` sequences of
    max_out_tokens: per token the activations (10 x heads x the head size padded to 32/64/128,
    unsplit), the scores (batch x heads/tp) and every layer's keys and values over all heads (not the
    KV heads), heads/tp of them. Assumes the free memory holds max_out_tokens (else DeepSpeed
    shortens it)."""
    head = m.head_size
    padded = head if head > 128 else (32 if head <= 32 else 64 if head <= 64 else 128)
    width = m.heads * padded
    activation = 10 * width * batch
    scores = batch * (m.heads // tensor) * max_out_tokens
    cache = m.layers * batch * (width // tensor) * 2
    return float(cache * max_out_tokens * dtype_bytes), float((activation + scores) * max_out_tokens * dtype_bytes)


def kv_cache_bytes(shape: KvShape, batch: int, context: int, dtype_bytes: int) -> float:
    """One layer's cache (keys and values) for `batch` sequences of `context` tokens."""
    return float(batch * shape.tokens(context) * (shape.key + shape.value) * dtype_bytes)


def _inference(wl: Workload, batch: int, vocab_rows: int, all_logits: bool) -> Workload:
    """A workload run under no_grad: no loss; lm_head over the last position of each sequence only
    (generate's logits_to_keep=1), which keeps its fp32 logits for sampling, or with `all_logits`
    over every position (a PPO experience's forward: ppo_trainer.py gather_log_probs takes the
    log-softmax of every position's logits, another tensor of their size)."""
    mods = []
    a = wl.act_dtype_bytes
    for m in wl.modules:
        if m.kind == ModuleKind.LOSS:
            continue
        if m.name == "lm_head" and all_logits:
            assert m.gemm is not None
            # the log-softmax beside the logits (the linear's output, counted by the schedule)
            m = replace(m, fwd_workspace_bytes=float(m.gemm[0] * vocab_rows * a))
        elif m.name == "lm_head":
            assert m.gemm is not None
            _, n, k = m.gemm
            flops = 2.0 * batch * n * k
            # the logits, then generate's .float() copy for the logits processors and sampling
            m = replace(m, gemm=(batch, n, k), fwd_flops=flops, model_fwd_flops=flops,
                        fwd_workspace_bytes=float(batch * vocab_rows * (a + 4)))
        mods.append(replace(m, no_grad=True, act_bytes=0.0, act_bytes_s2=0.0))
    return replace(wl, modules=tuple(mods))


def prefill_workload(m: ModelSpec, batch: int, prompt_len: int, precision: str, attn_implementation: str,
                     kernels: str, tensor: int, head: str = "lm", all_logits: bool = False) -> Workload:
    """The prompt's forward: every module over batch x prompt_len tokens, the causal attention of
    training's forward; `head` lm or a value model's score head (see [Note: reward model heads]),
    `all_logits` every position's logits kept (_inference)."""
    wl = build_workload(m, micro_batch_size=batch, seq_len=prompt_len, precision=precision,
                        flash_attention=attn_implementation != "eager", dropout=False, kernels=kernels,
                        attn_implementation=attn_implementation, tensor=tensor, head=head)
    return _inference(wl, batch, -(-m.vocab // tensor), all_logits)


def deepspeed_tensor_parallel(wl: Workload, m: ModelSpec, tensor: int, injected: bool) -> Workload:
    """`wl` (built with Megatron's split over `tensor` ranks) as DeepSpeed's inference splits it:
    the token embedding whole on every rank (AutoTP and the injection policies leave it: auto_tp.py,
    the hybrid engine's skip_partition); lm_head whole under the injected kernels, else AutoTP's
    LmHeadLinearAllreduce, split over its input features with the logits all-reduced
    (auto_tp.py _replace_last_linear_module, replace_module.py)."""
    if tensor == 1:
        return wl
    params = list(wl.params)
    mods = []
    for mod in wl.modules:
        if mod.name == "wte":
            pid = mod.params[0]
            p = params[pid]
            rows = m.vocab
            params[pid] = replace(p, numel=rows * (p.numel // p.shape[0]), shape=(rows, *p.shape[1:]))
            mod = replace(mod, tensor_role=None, tensor_width=0)
        elif mod.name == "lm_head" and mod.gemm is not None:
            t, _, k = mod.gemm
            tied = m.tied_embeddings
            if injected or tied:
                mod = replace(mod, gemm=(t, m.vocab, k), tensor_role=None, tensor_width=0,
                              fwd_flops=2.0 * t * m.vocab * k, model_fwd_flops=2.0 * t * m.vocab * k)
                if not tied:
                    pid = mod.params[0]
                    params[pid] = replace(params[pid], numel=m.vocab * k, shape=(m.vocab, k))
            else:
                kr = k // tensor
                mod = replace(mod, gemm=(t, m.vocab, kr), tensor_role=TensorRole.EXIT, tensor_width=m.vocab,
                              fwd_flops=2.0 * t * m.vocab * kr, model_fwd_flops=2.0 * t * m.vocab * kr)
                pid = mod.params[0]
                params[pid] = replace(params[pid], numel=m.vocab * kr, shape=(m.vocab, kr))
        mods.append(mod)
    return replace(wl, params=tuple(params), modules=tuple(mods))


def decode_workload(m: ModelSpec, batch: int, precision: str, attn_implementation: str, kernels: str,
                    tensor: int) -> Workload:
    """One decode step's modules over one token per sequence; the attention cores are priced per
    step by `decode_core`, for the context they attend to."""
    wl = build_workload(m, micro_batch_size=batch, seq_len=1, precision=precision,
                        flash_attention=attn_implementation != "eager", dropout=False, kernels=kernels,
                        attn_implementation=attn_implementation, tensor=tensor)
    return _inference(wl, batch, -(-m.vocab // tensor), False)


def prefill_core(core: Module, shape: KvShape, batch: int, prompt_len: int, dtype_bytes: int,
                 copies_cache: bool) -> Module:
    """The prefill's attention core, which also fills the cache with the prompt's keys and values:
    DynamicCache's first update concatenates them onto an empty cache (a copy: read and write);
    DeepSpeed's kernels write them into the workspace (a write)."""
    cache = kv_cache_bytes(shape, batch, prompt_len, dtype_bytes)
    return replace(core, fwd_copy_bytes=(2.0 if copies_cache else 1.0) * cache, kernels_fwd=core.kernels_fwd + 2)


def decode_core(core: Module, shape: KvShape, batch: int, context: int, dtype_bytes: int, copies_cache: bool,
                repeat_kv: int = 1) -> Module:
    """The attention core of a decode step whose KV cache holds `context` tokens (the new one
    included): one query per sequence against every cached key (no causal skip: the query is the
    last position), Q.K^T and P.V at 2 FLOPs per multiply-add. It reads the whole cache; HF's
    DynamicCache first concatenates the new key and value onto it, reading the old cache and
    writing the new one (`copies_cache`: a copy, priced at the device's copy rate), where
    DeepSpeed's kernels write the new token in place.
    The per-token terms (RoPE, the q/k/v reads) are the one-token core's. Eager attention under GQA
    first repeats the cached keys and values to every head (HF's repeat_kv: `repeat_kv` copies
    written, read by the core in place of the cache)."""
    tokens = shape.tokens(context)
    cache = float(batch * tokens * (shape.key + shape.value) * dtype_bytes)
    flops = 2.0 * batch * tokens * (shape.query + shape.output)
    copy = 2.0 * cache if copies_cache else 0.0
    if repeat_kv > 1:
        copy += (1 + repeat_kv) * cache      # read the cache, write the repeated keys and values
        cache *= repeat_kv                   # the core reads the repeated ones
    return replace(core, fwd_flops=flops, model_fwd_flops=flops, fwd_mem_bytes=core.fwd_mem_bytes + cache,
                   fwd_copy_bytes=copy, kernels_fwd=core.kernels_fwd + (2 if copies_cache else 0)
                   + (2 if repeat_kv > 1 else 0))


# [Note: ZeRO-Inference quantized weights]
# DeepSpeed 0.19.8's weight_quantization.quantized_initialization (runtime/zero/partition_parameters.py
# Init: _quantize_param on every nn.Linear and nn.Embedding weight as zero.Init partitions it;
# inference/quantization/utils.py Quantizer, DeQuantizer, concat_to_compat_param,
# wrap_quantized_functional): each weight becomes one tensor of its dtype holding the uint8 codes
# (num_bits 4: two a byte) and, per group of group_size weights, the group's scale and minimum in
# the weight's dtype; ZeRO-3 partitions, offloads and gathers that tensor. F.linear and F.embedding
# are wrapped: every use dequantizes the whole weight first (read the codes and the statistics,
# write a 16-bit copy, alive while the op runs), the embedding's whole table included. The
# dequantization is one CUDA kernel for fp16 (dequantize_int4/int8_to_half_experimental); other
# dtypes run it in torch ops (unpack for 4 bits, subtract, multiply, cast: 4 kernels here).
def quantized_bytes(numel: int, bits: int, group_size: int, dtype_bytes: int) -> float:
    """Bytes of one quantized weight: its codes and each group's scale and minimum."""
    return float(-(-numel * bits // 8) + 2 * -(-numel // group_size) * dtype_bytes)


def with_quantized_weights(wl: Workload, bits: int, group_size: int, fp16: bool) -> Workload:
    """`wl` with every nn.Linear and nn.Embedding weight quantized (see [Note: ZeRO-Inference
    quantized weights])."""
    a = wl.act_dtype_bytes
    quantized: set[int] = set()
    mods = []
    for m in wl.modules:
        if (m.kind == ModuleKind.LINEAR and m.nn_linear) or m.kind == ModuleKind.EMBEDDING:
            pid = m.params[0]
            numel = wl.params[pid].numel
            quantized.add(pid)
            m = replace(m, fwd_mem_bytes=m.fwd_mem_bytes + quantized_bytes(numel, bits, group_size, a) + numel * a,
                        kernels_fwd=m.kernels_fwd + (1 if fp16 else 4),
                        fwd_workspace_bytes=m.fwd_workspace_bytes + numel * a)
        mods.append(m)
    params = tuple(replace(p, packed_bytes=quantized_bytes(p.numel, bits, group_size, a)) if i in quantized else p
                   for i, p in enumerate(wl.params))
    return replace(wl, params=params, modules=tuple(mods))
