"""The leaves and parameterless ops of calibration's GPT (calibration/core/model.py): a
module with direct parameters is a `_Leaf` whose `run(weights, linear, *inputs)` is its work,
so the nn.Module path and the training core's segment path run the same code.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

NORM_EPS = 1e-5


class _Linear(torch.autograd.Function):
    """y = x W^T + b that saves the weight *itself* (not a transposed view), as DeepSpeed's
    zero3_linear_wrap does: ZeRO-3 releases a weight by swapping its storage out (p.data = empty),
    which frees the memory only if autograd holds no separate view of the old storage; the
    re-gather before backward swaps the data back in."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g @ w
        g2 = g.reshape(-1, g.shape[-1])
        gw = g2.t() @ x.reshape(-1, x.shape[-1])
        gb = g2.sum(0) if ctx.has_bias else None
        return gx, gw, gb


def swappable_linear(x, w, b=None):
    """The segment path's linear: the core swaps weights as ZeRO-3 does (see _Linear). The module
    path calls F.linear, looked up at each call: under DeepSpeed ZeRO-3 that is zero3_linear_wrap,
    which deepspeed.initialize installs (see [Note: ZeRO-3 linear saves its input])."""
    return _Linear.apply(x, w, b)


# ----------------------------------------------------------------------------- leaves
class _Leaf(nn.Module):
    """A workload module with direct parameters: `run(weights, linear, *inputs)` is its work."""

    def forward(self, *inputs):
        return self.run(own_params(self), F.linear, *inputs)


def own_params(leaf: nn.Module) -> tuple:
    """A leaf's direct parameters in registration order (nn.Linear registers a missing bias as None)."""
    return tuple(p for p in leaf._parameters.values() if p is not None)


class Embedding(_Leaf):
    """Token embedding (wte): rows of the table."""

    def __init__(self, rows: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))

    def run(self, ws, linear, ids):
        return F.embedding(ids, ws[0])


class PositionEmbedding(_Leaf):
    """Learned positions (wpe), added to the token embedding; OPT's table starts `offset` rows in
    (OPTLearnedPositionalEmbedding)."""

    def __init__(self, rows: int, hidden: int, offset: int = 0):
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(rows + offset, hidden))

    def run(self, ws, linear, x):
        return x + ws[0][self.offset: self.offset + x.shape[1]]


class Norm(_Leaf):
    """A norm over the first `hidden` features of x (MLA's kv_a_layernorm normalizes the latent
    part of kv_a_proj_with_mqa's output); with a residual, added to it (Gemma-2's post norms)."""

    def __init__(self, kind: str, hidden: int):
        super().__init__()
        self.kind, self.hidden = kind, hidden
        self.weight = nn.Parameter(torch.empty(hidden))
        if kind == "layernorm":
            self.bias = nn.Parameter(torch.empty(hidden))

    def run(self, ws, linear, x, residual=None):
        x = x[..., : self.hidden]
        if self.kind == "layernorm":
            y = F.layer_norm(x, (self.hidden,), ws[0], ws[1], NORM_EPS)
        else:
            y = F.rms_norm(x, (self.hidden,), ws[0], NORM_EPS)
        return y if residual is None else residual + y


class HeadNorm(Norm):
    """Qwen3's q_norm/k_norm: a norm of head_dim weights over every head of a projection."""

    def run(self, ws, linear, x, residual=None):
        shape = x.shape
        return super().run(ws, linear, x.reshape(*shape[:-1], -1, self.hidden)).reshape(shape)


class Linear(_Leaf, nn.Linear):
    """y = x W^T (+ b), plus the residual stream when given one: zsim's workload charges the
    residual add of o_proj and fc_out to those modules (transformer.py fwd_mem). An nn.Linear,
    so PEFT's get_peft_model can wrap it (peft tuners/lora/layer.py dispatch_default)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, weight: nn.Parameter | None = None):
        nn.Module.__init__(self)   # nn.Linear's own __init__ would allocate and initialise a weight
        self.in_features, self.out_features = n_in, n_out
        self.weight = weight if weight is not None else nn.Parameter(torch.empty(n_out, n_in))
        self.bias = nn.Parameter(torch.empty(n_out)) if bias else None

    def run(self, ws, linear, x, residual=None):
        y = linear(x, ws[0], ws[1] if len(ws) > 1 else None)
        return y if residual is None else residual + y


# ----------------------------------------------------------------------------- parameterless ops
def attend(heads: int, kv_heads: int, head_dim: int, q, k, v, window: int | None = None, v_dim: int | None = None):
    """Causal SDPA over (B, S, heads * head_dim) projections; GQA when kv_heads < heads; with a
    sliding window each query sees the last `window` positions; values of v_dim per head (MLA)."""
    B, S, _ = q.shape
    v_dim = v_dim or head_dim
    q = q.reshape(B, S, heads, head_dim).transpose(1, 2)
    k = k.reshape(B, S, kv_heads, head_dim).transpose(1, 2)
    v = v.reshape(B, S, kv_heads, v_dim).transpose(1, 2)
    if window is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    else:
        i = torch.arange(S, device=q.device)
        band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=kv_heads != heads)
    return o.transpose(1, 2).reshape(B, S, heads * v_dim)


def mla_core(m, q, kv, kv_a):
    """DeepseekV2Attention's core: per-head keys are k_nope (from kv_b_proj) with the one RoPE key
    (kv_a_proj_with_mqa's last qk_rope_head_dim features) broadcast to every head."""
    mla, H = m.mla, m.heads
    B, S, _ = q.shape
    kv = kv.reshape(B, S, H, mla.qk_nope_head_dim + mla.v_head_dim)
    k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
    k_pe = kv_a[..., mla.kv_lora_rank:].reshape(B, S, 1, mla.qk_rope_head_dim).expand(B, S, H, mla.qk_rope_head_dim)
    k = torch.cat([k_nope, k_pe], dim=-1)
    return attend(H, H, mla.qk_head_dim, q, k.reshape(B, S, -1), v.reshape(B, S, -1), v_dim=mla.v_head_dim)


def cross_entropy(logits, labels):
    """HF-style loss: logits upcast to fp32, mean cross-entropy over the micro-batch's tokens."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
