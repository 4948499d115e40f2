"""The GPT the training core runs, built from a scenario's model section.

It mirrors zsim/workload/transformer.py module for module (same names, same parameters in
the same registration order), so the simulator's op names ("forward layers.0.attn.qkv") map
onto code here. The model is functional: each workload module is a *segment*
(inputs -> output) that can be run and back-propagated on its own, which lets the core run
the schedule op by op (gathers before a module, releases and gradient buckets after it).
Parameters are leaf tensors owned by the core; their storage is swapped in and out
(p.data = ...) the way DeepSpeed ZeRO-3 does, so autograd's saved weights see the re-gathered
data in backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Segment:
    name: str
    inputs: tuple[str, ...]
    output: str
    fn: Callable


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


def linear(x, w, b=None):
    return _Linear.apply(x, w, b)


def param_shapes(wl) -> list[tuple[int, ...]]:
    """Shape of every workload param, from the module that owns it."""
    shapes: dict[int, tuple[int, ...]] = {}
    for m in wl.modules:
        for pid in m.params:
            if pid in shapes:
                continue
            name = wl.params[pid].name
            n = wl.params[pid].numel
            if m.kind == "linear":
                _, n_out, n_in = m.gemm
                shapes[pid] = (n_out, n_in) if name.endswith(".weight") else (n_out,)
            elif m.kind == "embedding":
                shapes[pid] = (n // _hidden(wl, m), _hidden(wl, m))
            else:
                shapes[pid] = (n,)
    return [shapes[i] for i in range(len(wl.params))]


def _hidden(wl, module) -> int:
    # every embedding is (rows, hidden); hidden = a norm's numel
    for m in wl.modules:
        if m.kind == "norm":
            return wl.params[m.params[0]].numel
    raise ValueError("model without a norm")


def init_params(wl, shapes, seed: int) -> list[torch.Tensor]:
    """fp32 initial values (GPT-2 style), identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, shape in zip(wl.params, shapes):
        if p.name.endswith(".bias"):
            t = torch.zeros(shape)
        elif len(shape) == 1:          # norm weights
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=g) * 0.02
        out.append(t)
    return out


def build_segments(sc, wl) -> dict[str, Segment]:
    """One segment per workload module; `P(pid)` returns the parameter tensor at call time."""
    m = sc.model
    h, heads = m.hidden, m.heads
    kv_heads = m.kv_heads or heads
    hd = h // heads
    kvd = kv_heads * hd
    pid = {p.name: i for i, p in enumerate(wl.params)}
    segs: dict[str, Segment] = {}

    def norm_fn(wname, bname):
        def f(P, x):
            if m.norm == "layernorm":
                return F.layer_norm(x, (h,), P(pid[wname]), P(pid[bname]) if bname else None, 1e-5)
            return F.rms_norm(x, (h,), P(pid[wname]), 1e-5)
        return f

    def lin(mod):
        w = mod.params[0]
        b = mod.params[1] if len(mod.params) > 1 else None
        return w, b

    cur = "ids"
    mods = {mm.name: mm for mm in wl.modules}

    def add(name, inputs, output, fn):
        segs[name] = Segment(name, tuple(inputs), output, fn)

    add("wte", ["ids"], "x.emb", lambda P, ids: F.embedding(ids, P(mods["wte"].params[0])))
    cur = "x.emb"
    if "wpe" in mods:
        w = mods["wpe"].params[0]
        add("wpe", [cur], "x.pos", lambda P, x, w=w: x + P(w)[: x.shape[1]])
        cur = "x.pos"
    if "emb_ln" in mods:
        add("emb_ln", [cur], "x.embln", norm_fn("emb_ln.weight", "emb_ln.bias" if m.norm == "layernorm" else None))
        cur = "x.embln"
    for i in range(m.layers):
        p = f"layers.{i}"
        x0 = cur
        add(f"{p}.ln_1", [x0], f"{p}.a", norm_fn(f"{p}.ln_1.weight", f"{p}.ln_1.bias" if m.norm == "layernorm" else None))
        if m.fused_qkv:
            w, b = lin(mods[f"{p}.attn.qkv"])
            add(f"{p}.attn.qkv", [f"{p}.a"], f"{p}.qkv", lambda P, x, w=w, b=b: linear(x, P(w), P(b) if b is not None else None))
            core_in = [f"{p}.qkv"]

            def core(P, qkv):
                B, S, _ = qkv.shape
                q, k, v = qkv.split([h, kvd, kvd], dim=-1)
                return _attend(q, k, v, B, S, heads, kv_heads, hd)
        else:
            for nm in ("q_proj", "k_proj", "v_proj"):
                w, b = lin(mods[f"{p}.attn.{nm}"])
                add(f"{p}.attn.{nm}", [f"{p}.a"], f"{p}.{nm[0]}",
                    lambda P, x, w=w, b=b: linear(x, P(w), P(b) if b is not None else None))
            core_in = [f"{p}.q", f"{p}.k", f"{p}.v"]

            def core(P, q, k, v):
                B, S, _ = q.shape
                return _attend(q, k, v, B, S, heads, kv_heads, hd)
        add(f"{p}.attn.core", core_in, f"{p}.c", core)
        w, b = lin(mods[f"{p}.attn.o_proj"])
        add(f"{p}.attn.o_proj", [f"{p}.c", x0], f"{p}.x1",
            lambda P, c, x, w=w, b=b: x + linear(c, P(w), P(b) if b is not None else None))
        add(f"{p}.ln_2", [f"{p}.x1"], f"{p}.b",
            norm_fn(f"{p}.ln_2.weight", f"{p}.ln_2.bias" if m.norm == "layernorm" else None))
        if m.glu:
            for nm in ("gate_proj", "up_proj"):
                w, b = lin(mods[f"{p}.mlp.{nm}"])
                add(f"{p}.mlp.{nm}", [f"{p}.b"], f"{p}.{nm}",
                    lambda P, x, w=w, b=b: linear(x, P(w), P(b) if b is not None else None))
            add(f"{p}.mlp.act", [f"{p}.gate_proj", f"{p}.up_proj"], f"{p}.g", lambda P, g, u: F.silu(g) * u)
        else:
            w, b = lin(mods[f"{p}.mlp.fc_in"])
            add(f"{p}.mlp.fc_in", [f"{p}.b"], f"{p}.f",
                lambda P, x, w=w, b=b: linear(x, P(w), P(b) if b is not None else None))
            add(f"{p}.mlp.act", [f"{p}.f"], f"{p}.g", lambda P, x: F.gelu(x, approximate="tanh"))
        w, b = lin(mods[f"{p}.mlp.fc_out"])
        add(f"{p}.mlp.fc_out", [f"{p}.g", f"{p}.x1"], f"{p}.x2",
            lambda P, g, x, w=w, b=b: x + linear(g, P(w), P(b) if b is not None else None))
        cur = f"{p}.x2"
    add("ln_f", [cur], "x.f", norm_fn("ln_f.weight", "ln_f.bias" if m.norm == "layernorm" else None))
    w, _ = lin(mods["lm_head"])
    add("lm_head", ["x.f"], "logits", lambda P, x, w=w: linear(x, P(w)))
    # HF-style loss: logits upcast to fp32, mean cross-entropy over the micro-batch's tokens
    add("loss", ["logits", "labels"], "loss",
        lambda P, lg, y: F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), y.reshape(-1)))
    missing = [mm.name for mm in wl.modules if mm.name not in segs]
    if missing:
        raise ValueError(f"modules without a segment: {missing}")
    return segs


def _attend(q, k, v, B, S, heads, kv_heads, hd):
    q = q.reshape(B, S, heads, hd).transpose(1, 2)
    k = k.reshape(B, S, kv_heads, hd).transpose(1, 2)
    v = v.reshape(B, S, kv_heads, hd).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    return o.transpose(1, 2).reshape(B, S, heads * hd)


def batch(sc, step: int, micro: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic token ids and labels of one rank's micro-batch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + micro * 101 + rank)
    x = torch.randint(0, sc.model.vocab, (sc.micro_batch_size, sc.seq_len + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def run_forward_backward(segs, order, P, ids, labels, scale: float = 1.0) -> float:
    """Plain (unsharded) forward + backward through the segments in one autograd graph."""
    env = {"ids": ids, "labels": labels}
    for name in order:
        s = segs[name]
        env[s.output] = s.fn(P, *[env[k] for k in s.inputs])
    loss = env["loss"]
    (loss * scale).backward()
    return float(loss.detach())
