"""The attention block: q/k/v projections (fused, separate, or DeepSeek's Multi-head Latent
Attention), the parameterless core, the output projection.

Sources:
 - Model FLOPs count full (non-causal) attention, QK^T and AV at 2*b*s*s*dims each (Megatron-LM,
   llm-foundry MFU convention); a sliding window of W counts s*W pairs instead of s*s.
 - Executed: causal FlashAttention skips the upper triangle (half the work); its backward runs
   5 matmuls for the forward's 2 (Dao 2023, FlashAttention-2, sec. 3). With a sliding window
   FlashAttention's local attention (window_size, flash-attn >= 2.3, what Mistral and Gemma-2
   run through HF's flash_attention_2) computes only the band: sum_i min(i+1, W) pairs. The
   eager/SDPA path masks the window out of full s*s scores, so the window saves it nothing.
 - MLA shapes: DeepSeek-AI 2024, arXiv:2405.04434 sec. 2.1, and HF modeling_deepseek_v2.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from zsim.workload import hf_kernels
from zsim.workload.builder import Builder, Split
from zsim.workload.module import ModuleKind


@dataclass(frozen=True)
class CoreShape:
    """What the core reads: total q, k and v widths per token and the RoPE'd parts of q and k."""
    q: int
    k: int
    v_heads: int      # heads x per-head value width (the output width)
    v: int
    rope_q: int
    rope_k: int


def ulysses_kv_heads(kv_heads: int, sp: int) -> int:
    """The key-value heads the `sp` ranks of a Ulysses group hold between them after the exchange:
    all of them, or one a rank when fewer than sp, repeated before it (ulysses_sp.py
    kv_replication_factor)."""
    return max(kv_heads, sp)


def _pairs(s: int, window: int | None) -> tuple[float, float | None]:
    """(model pairs per sequence, executed causal pairs with a window or None without one)."""
    if window is None or window >= s:
        return float(s * s), None
    return float(s * window), float(s * window - window * (window - 1) / 2)


# [Note: SDPA with a padding mask]
# HF passes scaled_dot_product_attention is_causal=True only when the batch has no padding
# (integrations/sdpa_attention.py: is_causal = q_length > 1 and attention_mask is None; the mask
# is dropped when it is all ones, masking_utils / _ignore_causal_mask_sdpa). With padding it
# passes the 4D mask, which torch's flash backend cannot take (sdp_utils.cpp
# check_for_attn_mask): the memory-efficient backend runs instead, and with an arbitrary mask it
# computes every block of the square (its causal skip needs its own causal flag), and K/V are
# repeated to every head first (use_gqa_in_sdpa is false with a mask). Priced at the profile's
# IO-aware attention efficiency over the full square: the profile holds no separate figure for
# that kernel.
def attention_core(bld: Builder, name: str, layer: int, b: int, s: int, shape: CoreShape, flash: bool,
                   window: int | None) -> None:
    m, a, t = bld.m, bld.a, bld.t
    heads = m.heads // bld.tp          # the rank's heads (Megatron: num_attention_heads_per_partition)
    # DeepSpeed-Ulysses: after the all-to-alls the core holds the whole sequence (s x u) of 1/u of
    # the heads, so the square's terms take the full length and the rank's heads and widths; the
    # per-token terms (t x widths) are the same elements either way (see [Note: DeepSpeed-Ulysses])
    u = bld.ulysses
    s, heads, qv = s * u, heads // u, (shape.q + shape.v_heads) // u
    model_pairs, band_pairs = _pairs(s, window)
    model_flops = 2.0 * b * model_pairs * qv
    rope = hf_kernels.rope(a) if bld.hf else hf_kernels.OpByOp(fwd=4 * a, bwd=4 * a, kernels_fwd=0, kernels_bwd=0)
    rope_elems = t * (shape.rope_q + shape.rope_k) if m.position == "rope" else 0.0
    rope_mem_f, rope_mem_b = rope.fwd * rope_elems, rope.bwd * rope_elems
    extra_kf = rope.kernels_fwd * 2 if rope_elems else 0
    extra_kb = rope.kernels_bwd * 2 if rope_elems else 0
    kv_heads = m.n_kv_heads if m.mla is None else m.heads
    # each rank's core holds ulysses_kv_heads / kv_heads times its K and V share
    kv_rep = ulysses_kv_heads(kv_heads, u) // kv_heads
    qkv = shape.q + (shape.k + shape.v) * kv_rep
    qkv_saved: float = t * qkv * a
    # HF's repeat_kv (see [Note: SDPA with a padding mask]): eager always, sdpa under a padding mask
    masked_sdpa = bld.attn == "sdpa" and bld.padding_mask
    if bld.hf and (masked_sdpa or not flash) and kv_heads < m.heads:
        rep = hf_kernels.repeat_kv(a, m.heads, kv_heads)
        kv_elems = t * (shape.k + shape.v)
        rope_mem_f, rope_mem_b = rope_mem_f + rep.fwd * kv_elems, rope_mem_b + rep.bwd * kv_elems
        qkv_saved += rep.act * kv_elems
        qkv = shape.q + 2 * shape.v_heads           # the core reads the repeated K and V
        extra_kf, extra_kb = extra_kf + 2 * rep.kernels_fwd, extra_kb + 2 * rep.kernels_bwd
    if flash:
        # causal: lower triangle only; with a window only the band; the memory-efficient backend
        # under a padding mask: the full square
        fwd = model_flops / 2 if band_pairs is None else 2.0 * b * band_pairs * qv
        if masked_sdpa:
            fwd = 2.0 * b * s * s * qv
        bwd = fwd * 2.5                # 5 matmuls vs 2 (FlashAttention-2)
        act, act_s2 = qkv_saved + 4 * b * heads * s, 0.0  # Q,K,V + logsumexp (fp32)
        if u > 1:
            # the kernel saves its output O too, which without Ulysses is the storage o_proj keeps
            # (the transposed view reshapes in place); Ulysses' exchange gives o_proj a new tensor, so
            # O is kept apart. Measured with saved_tensors_hooks on the recorder's GPT (micro-batch 16,
            # seq 128): a layer saves 32.0 MiB of activations without Ulysses and 17.0 MiB with sp 2,
            # half plus O's 1.0 MiB
            act += t * shape.v_heads * a
        mem_f, mem_b = rope_mem_f + 2 * t * qkv * a, rope_mem_b + 4 * t * qkv * a
        kf, kb = 1 + extra_kf, 2 + extra_kb
    else:
        full = 2.0 * b * s * s * qv
        fwd, bwd = full, 2 * full
        s2 = b * heads * s * s
        # softmax output (a bytes per score); with dropout also its mask (1 B) and output (a B)
        act_s2 = s2 * (2 * a + 1) if bld.drop else s2 * a
        act = qkv_saved + act_s2
        # Megatron's CoreAttention (megatron/model/transformer.py): baddbmm writes the scores once
        # (scaled by its alpha), FusedScaleMaskSoftmax reads and writes them (scale, causal mask and
        # softmax in one kernel), the dropout reads and writes them. Backward: bmm's dprobs write, the
        # dropout's read and write, the softmax's reads of y and dy and write. Not charged: the dropout
        # mask's byte per score and the context's permute copy (docs/validation.md, "Megatron's fused
        # kernels against zsim's per-layer charges")
        mem_f = rope_mem_f + s2 * a * (3 + 2 * bld.drop)
        mem_b = rope_mem_b + s2 * a * (4 + 2 * bld.drop)
        kf, kb = 4 + extra_kf, 6 + extra_kb
    bld.add(name=name, kind=ModuleKind.ATTENTION, layer=layer, params=(), gemm=None, fwd_flops=fwd, bwd_flops=bwd,
            model_fwd_flops=model_flops, fwd_mem_bytes=mem_f, bwd_mem_bytes=mem_b, act_bytes=act,
            act_bytes_s2=act_s2, kernels_fwd=kf, kernels_bwd=kb)


def attention(bld: Builder, pfx: str, layer: int, b: int, s: int, flash: bool) -> None:
    """`pfx`.qkv or q/k/v_proj (or MLA's projections), `pfx`.core, `pfx`.o_proj (+ residual add).
    Under tensor parallelism (Megatron's ParallelAttention) the q/k/v projections are column-
    parallel (the rank's heads and query groups), the output projection row-parallel."""
    m, h, t, a = bld.m, bld.m.hidden, bld.t, bld.a
    col, tp = Split.COLUMN, bld.tp
    if m.mla is not None:
        shape = _mla_projections(bld, pfx, layer)
    else:
        hd = m.head_size
        qd, kvd = m.heads * hd, m.n_kv_heads * hd
        if m.fused_qkv:
            bld.linear(f"{pfx}.qkv", layer, h, qd + 2 * kvd, m.qkv_proj_bias, split=col)
        elif m.qk_norm:
            # Qwen3Attention calls q_proj, q_norm, k_proj, k_norm, v_proj in this order
            bld.linear(f"{pfx}.q_proj", layer, h, qd, m.qkv_proj_bias, split=col)
            bld.norm(f"{pfx}.q_norm", layer, size=hd, width=qd // tp, residual=False)
            bld.linear(f"{pfx}.k_proj", layer, h, kvd, m.qkv_proj_bias, saves_input=False, split=col)
            bld.norm(f"{pfx}.k_norm", layer, size=hd, width=kvd // tp, residual=False)
            bld.linear(f"{pfx}.v_proj", layer, h, kvd, m.qkv_proj_bias, saves_input=False, split=col)
        else:
            bld.linear(f"{pfx}.q_proj", layer, h, qd, m.qkv_proj_bias, split=col)
            # k and v share q_proj's input
            bld.linear(f"{pfx}.k_proj", layer, h, kvd, m.qkv_proj_bias, saves_input=False, split=col)
            bld.linear(f"{pfx}.v_proj", layer, h, kvd, m.qkv_proj_bias, saves_input=False, split=col)
        qd, kvd = qd // tp, kvd // tp
        shape = CoreShape(q=qd, k=kvd, v_heads=qd, v=kvd, rope_q=qd, rope_k=kvd)
    window = m.sliding_window if m.has_window(layer) else None
    attention_core(bld, f"{pfx}.core", layer, b, s, shape, flash, window)
    # output projection, then bias + dropout + residual add in one pass (Megatron's
    # bias_dropout_add_fused_train): read 2, write 1
    bld.linear(f"{pfx}.o_proj", layer, shape.v_heads * tp, h, m.attn_bias, extra_act=bld.drop * t * h,
               fwd_mem=3 * t * h * a, bwd_mem=2 * t * h * a, split=None if m.mla is not None else Split.ROW)


def _mla_projections(bld: Builder, pfx: str, layer: int) -> CoreShape:
    """DeepseekV2Attention: q_proj (or q_a_proj, q_a_layernorm, q_b_proj), kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj. The core sees per-head keys of qk_nope + qk_rope (the RoPE part
    broadcast to every head) and values of v_head_dim."""
    m, h = bld.m, bld.m.hidden
    mla, heads = m.mla, m.heads
    assert mla is not None
    qk = mla.qk_head_dim
    if mla.q_lora_rank is not None:
        bld.linear(f"{pfx}.q_a_proj", layer, h, mla.q_lora_rank, m.attn_bias)
        bld.norm(f"{pfx}.q_a_layernorm", layer, size=mla.q_lora_rank)
        bld.linear(f"{pfx}.q_b_proj", layer, mla.q_lora_rank, heads * qk, False)
    else:
        bld.linear(f"{pfx}.q_proj", layer, h, heads * qk, False)
    # reads the block input again: q's first projection keeps it
    bld.linear(f"{pfx}.kv_a_proj_with_mqa", layer, h, mla.kv_lora_rank + mla.qk_rope_head_dim, m.attn_bias,
               saves_input=False)
    bld.norm(f"{pfx}.kv_a_layernorm", layer, size=mla.kv_lora_rank)
    bld.linear(f"{pfx}.kv_b_proj", layer, mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), False)
    return CoreShape(q=heads * qk, k=heads * qk, v_heads=heads * mla.v_head_dim, v=heads * mla.v_head_dim,
                     rope_q=heads * mla.qk_rope_head_dim, rope_k=mla.qk_rope_head_dim)
