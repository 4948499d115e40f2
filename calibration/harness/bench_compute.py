"""Compute benchmarks: per-kernel and autograd overhead, the layer's GEMMs, attention and
memory-bound kernels as zsim's workload costs them, and a whole transformer block."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from calibration.core.model import DTYPES, GPT
from calibration.harness.context import Ctx, local_times, timed_everywhere
from calibration.harness.plan import LayerShape, layer_gemms, stats


def bench_overhead(ctx: Ctx) -> dict:
    """Per-kernel framework + launch overhead: the time of a 1-element op."""
    x = torch.ones(1, device=ctx.device)
    st, inner = timed_everywhere(ctx, lambda: torch.add(x, 1.0))
    # each autograd.grad call pays the engine's start-up once; the sub-op backward benchmarks
    # subtract it (a layer's backward pays it once for all its ops)
    xg = torch.ones(1, device=ctx.device, requires_grad=True)
    y = xg * 2.0
    g = torch.ones_like(y)
    st_a, inner_a = timed_everywhere(ctx, lambda: torch.autograd.grad(y, (xg,), g, retain_graph=True))
    return [{"kind": "kernel_overhead", "inner": inner, **st},
            {"kind": "autograd_overhead", "inner": inner_a, **st_a}]


def bench_gemms(ctx: Ctx, dtype_name: str, L: LayerShape) -> list[dict]:
    dt = DTYPES[dtype_name]
    out = []
    big = 2048 if ctx.plan.mode == "full" else 1024
    shapes = [("square", "fwd", big, big, big)] + layer_gemms(L)
    for module, pas, m, n, k in shapes:
        if pas == "fwd":            # y = x W^T, x (m,k), W (n,k)
            a, b = torch.randn(m, k, dtype=dt, device=ctx.device), torch.randn(n, k, dtype=dt, device=ctx.device)
            fn = lambda a=a, b=b: F.linear(a, b)
        elif pas == "dgrad":        # dx = dy W, dy (m,k), W (k,n)
            a, b = torch.randn(m, k, dtype=dt, device=ctx.device), torch.randn(k, n, dtype=dt, device=ctx.device)
            fn = lambda a=a, b=b: torch.mm(a, b)
        else:                       # dW = dy^T x, dy (k,m), x (k,n)
            a, b = torch.randn(k, m, dtype=dt, device=ctx.device), torch.randn(k, n, dtype=dt, device=ctx.device)
            fn = lambda a=a, b=b: torch.mm(a.t(), b)
        st, inner = timed_everywhere(ctx, fn)
        out.append({"kind": "gemm", "dtype": dtype_name, "layer": L.label, "module": module, "pass": pas,
                    "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k,
                    "TFLOPs": 2.0 * m * n * k / st["time_s"] / 1e12, "inner": inner, **st})
    return out


# the rows of the decode GEMMs benchmarked: a decode step's linears run over one token per sequence,
# a few rows a step (see [Note: few-row GEMMs])
DECODE_ROWS = (1, 2, 4, 8, 16, 32)
# the weights, (out, in): a 7B-class layer's (Llama-2-7B: hidden 4096, MLP 11008), whatever the
# calibration's layers, whose small matrices would time the calls, not the reads
DECODE_SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008))
# the weights one timed pass streams through: a decode step reads every layer's weights once, so
# none stay in a cache between uses; a pool past any GPU's L2 and the VMs' reported L3 keeps the
# benchmark there too
DECODE_POOL_BYTES = 1 << 30


def bench_decode_gemms(ctx: Ctx, dtype_name: str, L: LayerShape) -> list[dict]:
    """DECODE_SHAPES' GEMMs over DECODE_ROWS rows, each weight a distinct matrix of a pool of
    DECODE_POOL_BYTES, in one timed pass over the pool; the bytes are what zsim charges (every
    operand read or written once). `L` names the record only. See [Note: few-row GEMMs]."""
    dt = DTYPES[dtype_name]
    a = torch.tensor([], dtype=dt).element_size()
    per_set = sum(n * k for n, k in DECODE_SHAPES) * a
    copies = max(1, DECODE_POOL_BYTES // per_set)
    pool = [torch.randn(n, k, dtype=dt, device=ctx.device) for _ in range(copies) for n, k in DECODE_SHAPES]
    out = []
    for m in DECODE_ROWS:
        xs = {k: torch.randn(m, k, dtype=dt, device=ctx.device) for _, k in DECODE_SHAPES}

        def sweep(xs=xs):
            for w in pool:
                F.linear(xs[w.shape[1]], w)
        st, inner = timed_everywhere(ctx, sweep)
        nbytes = sum((m * w.shape[1] + w.shape[0] * w.shape[1] + m * w.shape[0]) * a for w in pool)
        out.append({"kind": "gemm_decode", "dtype": dtype_name, "layer": L.label, "m": m, "gemms": len(pool),
                    "bytes": float(nbytes), "inner": inner, **st})
    return out


def bench_attention(ctx: Ctx, dtype_name: str, L: LayerShape) -> list[dict]:
    dt = DTYPES[dtype_name]
    hd = L.hidden // L.heads
    # the layout the layer feeds it: strided views of the fused QKV projection's output
    qkv = torch.randn(L.micro_batch, L.seq_len, 3 * L.hidden, dtype=dt, device=ctx.device, requires_grad=True)
    q, k, v = qkv.view(L.micro_batch, L.seq_len, 3, L.heads, hd).permute(2, 0, 3, 1, 4)
    st_f, inner_f = timed_everywhere(ctx, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    g = torch.randn_like(o)
    st_b, inner_b = timed_everywhere(ctx, lambda: torch.autograd.grad(o, (qkv,), g, retain_graph=True))
    # zsim's executed FLOPs: causal halves 4*b*s^2*h; backward is 2.5x forward (FlashAttention-2)
    fwd_flops = 2.0 * L.micro_batch * L.seq_len ** 2 * L.hidden
    return [{"kind": "attention", "dtype": dtype_name, "layer": L.label, "pass": "fwd", "flops": fwd_flops,
             "inner": inner_f, **st_f},
            {"kind": "attention", "dtype": dtype_name, "layer": L.label, "pass": "bwd", "flops": 2.5 * fwd_flops,
             "inner": inner_b, **st_b}]


def bench_membound(ctx: Ctx, dtype_name: str, L: LayerShape) -> list[dict]:
    """Norm, activation and residual kernels, with the bytes zsim's workload charges them."""
    dt = DTYPES[dtype_name]
    a = torch.tensor([], dtype=dt).element_size()
    t, h, f = L.tokens, L.hidden, 4 * L.hidden
    out = []
    x = torch.randn(t, h, dtype=dt, device=ctx.device, requires_grad=True)
    w = torch.ones(h, dtype=dt, device=ctx.device, requires_grad=True)
    bias = torch.zeros(h, dtype=dt, device=ctx.device, requires_grad=True)
    y = F.layer_norm(x, (h,), w, bias)
    gy = torch.randn_like(y)
    u = torch.randn(t, f, dtype=dt, device=ctx.device, requires_grad=True)
    gu_out = F.gelu(u, approximate="tanh")
    gu = torch.randn_like(gu_out)
    r = torch.randn(t, h, dtype=dt, device=ctx.device)
    cases = [("layernorm", "fwd", 2 * t * h * a, lambda: F.layer_norm(x, (h,), w, bias)),
             ("layernorm", "bwd", 3 * t * h * a, lambda: torch.autograd.grad(y, (x, w, bias), gy, retain_graph=True)),
             ("gelu", "fwd", 2 * t * f * a, lambda: F.gelu(u, approximate="tanh")),
             ("gelu", "bwd", 3 * t * f * a, lambda: torch.autograd.grad(gu_out, (u,), gu, retain_graph=True)),
             ("residual", "fwd", 3 * t * h * a, lambda: torch.add(r, r))]
    for op, pas, nbytes, fn in cases:
        st, inner = timed_everywhere(ctx, fn)
        out.append({"kind": "membound", "dtype": dtype_name, "layer": L.label, "op": op, "pass": pas,
                    "bytes": float(nbytes), "inner": inner, **st})
    return out


def bench_layer(ctx: Ctx, dtype_name: str, L: LayerShape) -> list[dict]:
    dt = DTYPES[dtype_name]
    # block 0 of calibration's GPT for the shape zsim's fit predicts (LayerShape.model_spec)
    layer = GPT(L.model_spec()).initialized(seed=0).layers[0].to(device=ctx.device, dtype=dt)
    torch.manual_seed(0)
    x = torch.randn(L.micro_batch, L.seq_len, L.hidden, dtype=dt, device=ctx.device, requires_grad=True)
    params = [x] + list(layer.parameters())
    g = torch.randn_like(layer(x))
    # forward and backward alternate, as in a step, and each is timed: a forward looped on its
    # own keeps its working set in cache and ran 40% faster than in a step at h256/s128
    fwd_s, bwd_s = [], []

    def iteration():
        t0 = time.perf_counter()
        y = layer(x)
        ctx.sync()
        t1 = time.perf_counter()
        torch.autograd.grad(y, params, g)
        ctx.sync()
        fwd_s.append(t1 - t0)
        bwd_s.append(time.perf_counter() - t1)

    ctx.at_sync()
    dist.barrier()
    _, inner = local_times(ctx, iteration)
    n = ctx.plan.reps * inner                          # the timed iterations: the last ones
    per_rep = lambda xs: [sum(xs[-n:][i * inner:(i + 1) * inner]) / inner for i in range(ctx.plan.reps)]
    st_f = stats(ctx.gather_max(per_rep(fwd_s)))
    st_b = stats(ctx.gather_max(per_rep(bwd_s)))
    base = {"kind": "layer", "dtype": dtype_name, "layer": L.label, "hidden": L.hidden, "heads": L.heads,
            "seq_len": L.seq_len, "micro_batch": L.micro_batch, "timing": "fwd+bwd alternating"}
    return [{**base, "pass": "fwd", "inner": inner, **st_f}, {**base, "pass": "bwd", "inner": inner, **st_b}]
