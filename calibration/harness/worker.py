"""One calibration rank, run under torchrun (or srun): measures and reports, never fits.

    torchrun --standalone --nproc-per-node 2 -m calibration.harness.worker --run-dir DIR

Every rank runs every benchmark at the same time as the others (training runs all ranks at
once: they share memory bandwidth, caches and NICs). A repetition starts after a barrier;
a benchmark's time per repetition is the maximum over ranks (the slowest rank sets the
step), and the median and spread over repetitions are kept (nccl-tests and OSU report the
same statistics). Rank 0 appends one JSON line per finished benchmark to
records.partial.jsonl, so a failure keeps what was measured. Each rank writes
status/rank<R>.json (its pid and the benchmark it is in) for the launcher's fault report.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import mmap
import os
import platform
import signal
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from calibration.harness.plan import (Plan, LayerShape, default_plan, estimated_cost, items, stats,
                                      layer_gemms, tier_of_group)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------- plumbing
class Ctx:
    def __init__(self, plan: Plan, run_dir: str):
        self.plan = plan
        self.run_dir = run_dir
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.nodes = max(1, self.world // self.local_world)
        self.node = self.rank // self.local_world
        self.cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
        self.device = torch.device(f"cuda:{self.local_rank}") if self.cuda else torch.device("cpu")
        self.groups = {"world": None}
        # Every rank must create every group, in the same order (torch.distributed rule).
        node_groups = [dist.new_group(list(range(n * self.local_world, (n + 1) * self.local_world)))
                       for n in range(self.nodes)] if self.nodes > 1 else []
        rail_groups = [dist.new_group(list(range(lr, self.world, self.local_world)))
                       for lr in range(self.local_world)] if self.nodes > 1 else []
        if node_groups:
            self.groups["intra_node"] = node_groups[self.node]
        if rail_groups:
            self.groups["inter_node"] = rail_groups[0] if self.local_rank == 0 else "skip"
        self.item_index = 0
        self.item = ""
        self.synced = -1
        self.records_path = os.path.join(run_dir, "records.partial.jsonl")
        os.makedirs(os.path.join(run_dir, "status"), exist_ok=True)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def status(self, item: str, state: str = "running", error: str = "", phase: str = "run"):
        self.item = item
        path = os.path.join(self.run_dir, "status", f"rank{self.rank}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "item": item,
                       "index": self.item_index, "state": state, "error": error, "phase": phase,
                       "time": time.time()}, f)
        os.replace(tmp, path)

    def at_sync(self):
        """Mark that this rank reached the item's first synchronisation: if the job then
        hangs, the rank that never got here is the one to blame."""
        if self.synced != self.item_index:
            self.synced = self.item_index
            self.status(self.item, phase="sync")

    def record(self, rec: dict):
        if self.rank == 0:
            with open(self.records_path, "a") as f:
                f.write(json.dumps(rec, sort_keys=True) + "\n")

    def _over_ranks(self, values: list[float], participant: bool, op, absent: float) -> list[float]:
        """Element-wise `op` over participating ranks of a per-rank vector (all ranks call);
        a non-participant contributes `absent`, the identity of `op`."""
        t = torch.tensor([v if participant else absent for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.cpu().tolist()

    def gather_min(self, values: list[float], participant: bool = True) -> list[float]:
        return [0.0 if math.isinf(v) else v
                for v in self._over_ranks(values, participant, dist.ReduceOp.MIN, float("inf"))]

    def gather_max(self, values: list[float], participant: bool = True) -> list[float]:
        return self._over_ranks(values, participant, dist.ReduceOp.MAX, -1.0)


def _local_times(ctx: Ctx, fn, reps: int | None = None, warmup: int | None = None) -> tuple[list[float], int]:
    """Time fn on this rank only: warm-up, then reps repetitions of `inner` calls each."""
    plan = ctx.plan
    for _ in range(warmup if warmup is not None else plan.warmup):
        fn()
    ctx.sync()
    t0 = time.perf_counter()
    fn()
    ctx.sync()
    one = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, min(10000, math.ceil(plan.min_rep_time_s / one)))
    out = []
    for _ in range(reps or plan.reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        ctx.sync()
        out.append((time.perf_counter() - t0) / inner)
    return out, inner


def _timed_everywhere(ctx: Ctx, fn, reps: int | None = None) -> tuple[dict, int]:
    """All ranks time fn concurrently; per repetition the max over ranks."""
    ctx.at_sync()
    dist.barrier()
    times, inner = _local_times(ctx, fn, reps)
    return stats(ctx.gather_max(times)), inner


# ----------------------------------------------------------------------------- collectives
def _collective_fn(op: str, size_bytes: int, dtype, n: int, group, device, calls: int = 1):
    esize = torch.tensor([], dtype=dtype).element_size()
    numel = max(n, (size_bytes // esize) // n * n)   # the full buffer, divisible by the group size
    full = torch.ones(numel, dtype=dtype, device=device)
    part = torch.ones(numel // n, dtype=dtype, device=device)
    if op == "all_gather":
        f = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: f(full, part, group=group)), numel * esize
    if op == "all_gather_coalesced":
        # partition_parameters.py _allgather_params_coalesced: one async call per buffer, then
        # every handle waited; `calls` buffers per batch
        f = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        outs = [torch.empty_like(full) for _ in range(calls)]

        def batch():
            for h in [f(o, part, group=group, async_op=True) for o in outs]:
                h.wait()
        return batch, numel * esize
    if op == "reduce_scatter":
        f = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: f(part, full, group=group)), numel * esize
    if op == "all_reduce":
        return (lambda: dist.all_reduce(full, group=group)), numel * esize
    if op == "broadcast":
        src = dist.get_global_rank(group, 0) if group is not None else 0
        return (lambda: dist.broadcast(full, src=src, group=group)), numel * esize
    if op == "reduce":
        dst = dist.get_global_rank(group, 0) if group is not None else 0
        return (lambda: dist.reduce(full, dst=dst, group=group)), numel * esize
    if op == "all_to_all":
        out = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(out, full, group=group)), numel * esize
    raise ValueError(op)


def _step_compute(ctx: Ctx):
    """A module-sized GEMM (the first layer's MLP input projection): what a step runs between
    collectives."""
    L = ctx.plan.layers[0]
    dt = DTYPES[ctx.plan.profile_dtype]
    a = torch.randn(L.tokens, L.hidden, dtype=dt, device=ctx.device)
    w = torch.randn(4 * L.hidden, L.hidden, dtype=dt, device=ctx.device)

    def run():
        F.linear(a, w)
        ctx.sync()
    return run


SMALL_MESSAGE_BYTES = 1 << 20
SMALL_MESSAGE_REPS = 3


def bench_collective(ctx: Ctx, op: str, grp: str, dtype_name: str, size_bytes: int) -> dict:
    """A collective timed as a training step meets it: `inner` calls, each after a compute phase
    and with no barrier in between, against the same compute phases alone. A call costs the step
    what the loop with calls takes beyond the loop without (slowest rank of each): the transfer,
    gloo's wake-up stalls on a loaded CPU (a GPU's cold launch), and the wait for the rank that
    left the previous call last, which a per-call duration on the last-arriving rank misses
    (0.5 MB gloo all-reduce in a ZeRO-2 step: 1.6 ms on that rank, 3 ms to the step). A call can
    never cost less than its duration on the last-arriving rank, which bounds a noisy difference.
    A repetition is the mean over `inner` calls, as a step sums many calls. A "_coalesced" op
    launches its `inner` calls async after one compute phase and then waits them all."""
    coalesced = op.endswith("_coalesced")
    group = ctx.groups[grp]
    member = group != "skip"
    g = None if group in (None, "skip") else group
    n = dist.get_world_size(g) if member else 0
    # a small call is 0.2 ms typically and several ms when gloo stalls: its mean needs more
    # calls than a large one's (cheap: each costs about a compute phase)
    reps = ctx.plan.reps * (SMALL_MESSAGE_REPS if size_bytes <= SMALL_MESSAGE_BYTES else 1)
    reps = max(2, math.ceil(reps / ctx.plan.coll_passes))   # the fit pools the passes
    inner = max(1, min(ctx.plan.coll_calls_per_rep, 2000))
    calls = [0.0] * (reps * inner)
    with_s, alone_s = [0.0] * reps, [0.0] * reps
    real_size = size_bytes
    err = ""
    ctx.at_sync()
    if member:
        try:
            batch = inner if coalesced else 1
            fn, real_size = _collective_fn(op, size_bytes, DTYPES[dtype_name], n, g, ctx.device, batch)
            compute = _step_compute(ctx)
            for _ in range(ctx.plan.warmup):
                fn()
            ctx.sync()
            for r in range(reps):
                dist.barrier(group=g)
                t0 = time.perf_counter()
                for _ in range(inner // batch):
                    compute()
                alone_s[r] = time.perf_counter() - t0
                dist.barrier(group=g)
                t_loop = time.perf_counter()
                for i in range(r * inner, (r + 1) * inner, batch):
                    compute()
                    t0 = time.perf_counter()
                    fn()
                    ctx.sync()
                    calls[i:i + batch] = [(time.perf_counter() - t0) / batch] * batch
                with_s[r] = time.perf_counter() - t_loop
        except RuntimeError as exc:   # e.g. a dtype or op the backend lacks: keep going, say so
            if "unsupported" not in str(exc).lower() and "not supported" not in str(exc).lower():
                raise
            err = str(exc).splitlines()[0][:200]
            calls = [0.0] * (reps * inner)
    dist.barrier()
    per_call = ctx.gather_min(calls, member)
    loops = ctx.gather_max(with_s + alone_s, member)
    last_arriver = [sum(per_call[r * inner:(r + 1) * inner]) / inner for r in range(reps)]
    cost = [max(last_arriver[r], (loops[r] - loops[reps + r]) / inner) for r in range(reps)]
    rec = {"kind": "collective", "op": op, "group": grp, "tier": tier_of_group(grp, ctx.nodes),
           "ranks": ctx.world if grp == "world" else (ctx.local_world if grp == "intra_node" else ctx.nodes),
           "dtype": dtype_name, "size_bytes": real_size, "inner": inner, "timing": "in-step loop"}
    if err or max(cost) <= 0:
        rec["error"] = err or "not measured"
        return rec
    rec.update(stats(cost))
    rec["last_arriver_s"] = statistics.mean(last_arriver)
    return rec


# ----------------------------------------------------------------------------- compute
def bench_overhead(ctx: Ctx) -> dict:
    """Per-kernel framework + launch overhead: the time of a 1-element op."""
    x = torch.ones(1, device=ctx.device)
    st, inner = _timed_everywhere(ctx, lambda: torch.add(x, 1.0))
    # each autograd.grad call pays the engine's start-up once; the sub-op backward benchmarks
    # subtract it (a layer's backward pays it once for all its ops)
    xg = torch.ones(1, device=ctx.device, requires_grad=True)
    y = xg * 2.0
    g = torch.ones_like(y)
    st_a, inner_a = _timed_everywhere(ctx, lambda: torch.autograd.grad(y, (xg,), g, retain_graph=True))
    return [{"kind": "kernel_overhead", "inner": inner, **st},
            {"kind": "autograd_overhead", "inner": inner_a, **st_a}]


FRESH_ALLOC_MiB = (1, 2, 4, 8, 16, 24, 31, 33, 48, 64)


def bench_fresh_alloc(ctx: Ctx) -> list[dict]:
    """Allocate-and-fill against fill of a kept buffer, per size: on a CPU device, tensors above
    malloc's mmap threshold are mapped fresh at every allocation and page-fault in (a CUDA
    caching allocator reuses its blocks: not measured there)."""
    if ctx.cuda:
        return [{"kind": "fresh_alloc", "error": "not measured: the CUDA caching allocator reuses blocks"}]
    out = []
    for mib in FRESH_ALLOC_MiB:
        n = (mib << 20) // 4
        kept = torch.empty(n, device=ctx.device)
        st_f, inner_f = _timed_everywhere(ctx, lambda n=n: torch.empty(n, device=ctx.device).fill_(1.0),
                                          reps=max(5, ctx.plan.reps // 2))
        st_k, _ = _timed_everywhere(ctx, lambda kept=kept: kept.fill_(1.0), reps=max(5, ctx.plan.reps // 2))
        out.append({"kind": "fresh_alloc", "size_bytes": n * 4, "inner": inner_f, **st_f,
                    "kept_time_s": st_k["time_s"], "kept_time_s_min": st_k["time_s_min"]})
    return out


def bench_memcpy(ctx: Ctx) -> list[dict]:
    out = []
    n = ctx.plan.memcpy_bytes // 4
    src = torch.ones(n, device=ctx.device)
    dst = torch.empty_like(src)
    st, inner = _timed_everywhere(ctx, lambda: dst.copy_(src), reps=max(5, ctx.plan.reps // 2))
    # STREAM "copy" convention: read + write = 2x the buffer
    out.append({"kind": "memcpy", "where": "device" if ctx.cuda else "host", "size_bytes": n * 4,
                "bytes_moved": 2 * n * 4, "GBps": 2 * n * 4 / st["time_s"] / 1e9, "inner": inner, **st})
    if ctx.cuda:
        for pinned in (True, False):
            h = torch.ones(n, pin_memory=pinned)
            for direction, fn in (("h2d", lambda: src.copy_(h, non_blocking=pinned)),
                                  ("d2h", lambda: h.copy_(src, non_blocking=pinned))):
                st, inner = _timed_everywhere(ctx, fn, reps=max(5, ctx.plan.reps // 2))
                out.append({"kind": "pcie", "direction": direction, "pinned": pinned, "size_bytes": n * 4,
                            "GBps": n * 4 / st["time_s"] / 1e9, "inner": inner, **st})
    return out


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
        st, inner = _timed_everywhere(ctx, fn)
        out.append({"kind": "gemm", "dtype": dtype_name, "layer": L.label, "module": module, "pass": pas,
                    "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k,
                    "TFLOPs": 2.0 * m * n * k / st["time_s"] / 1e12, "inner": inner, **st})
    return out


def bench_attention(ctx: Ctx, dtype_name: str, L: LayerShape) -> list[dict]:
    dt = DTYPES[dtype_name]
    hd = L.hidden // L.heads
    # the layout the layer feeds it: strided views of the fused QKV projection's output
    qkv = torch.randn(L.micro_batch, L.seq_len, 3 * L.hidden, dtype=dt, device=ctx.device, requires_grad=True)
    q, k, v = qkv.view(L.micro_batch, L.seq_len, 3, L.heads, hd).permute(2, 0, 3, 1, 4)
    st_f, inner_f = _timed_everywhere(ctx, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    g = torch.randn_like(o)
    st_b, inner_b = _timed_everywhere(ctx, lambda: torch.autograd.grad(o, (qkv,), g, retain_graph=True))
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
        st, inner = _timed_everywhere(ctx, fn)
        out.append({"kind": "membound", "dtype": dtype_name, "layer": L.label, "op": op, "pass": pas,
                    "bytes": float(nbytes), "inner": inner, **st})
    return out


class Layer(torch.nn.Module):
    """A GPT block as zsim's workload models it (zsim/workload/transformer.py): LN, fused QKV,
    causal SDPA, out projection + residual, LN, fc_in, GELU, fc_out + residual."""

    def __init__(self, L: LayerShape):
        super().__init__()
        h = L.hidden
        self.heads = L.heads
        self.ln_1 = torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.o_proj = torch.nn.Linear(h, h)
        self.ln_2 = torch.nn.LayerNorm(h)
        self.fc_in = torch.nn.Linear(h, 4 * h)
        self.fc_out = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.o_proj(a)
        # tanh GELU, as GPT-2's gelu_new and the training core (calibration/core/model.py) use
        return x + self.fc_out(F.gelu(self.fc_in(self.ln_2(x)), approximate="tanh"))


def bench_layer(ctx: Ctx, dtype_name: str, L: LayerShape) -> list[dict]:
    dt = DTYPES[dtype_name]
    torch.manual_seed(0)
    layer = Layer(L).to(device=ctx.device, dtype=dt)
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
    _, inner = _local_times(ctx, iteration)
    n = ctx.plan.reps * inner                          # the timed iterations: the last ones
    per_rep = lambda xs: [sum(xs[-n:][i * inner:(i + 1) * inner]) / inner for i in range(ctx.plan.reps)]
    st_f = stats(ctx.gather_max(per_rep(fwd_s)))
    st_b = stats(ctx.gather_max(per_rep(bwd_s)))
    base = {"kind": "layer", "dtype": dtype_name, "layer": L.label, "hidden": L.hidden, "heads": L.heads,
            "seq_len": L.seq_len, "micro_batch": L.micro_batch, "timing": "fwd+bwd alternating"}
    return [{**base, "pass": "fwd", "inner": inner, **st_f}, {**base, "pass": "bwd", "inner": inner, **st_b}]


# ----------------------------------------------------------------------------- host side
def bench_adam(ctx: Ctx) -> list[dict]:
    out = []
    n = ctx.plan.adam_params
    chunks = [n // 8] * 8
    impls = [("torch.optim.Adam(foreach)", {"foreach": True}), ("torch.optim.Adam(fused)", {"fused": True})]
    devices = [torch.device("cpu")] + ([ctx.device] if ctx.cuda else [])
    for device in devices:
        for name, kw in impls:
            ps = [torch.nn.Parameter(torch.randn(c, device=device)) for c in chunks]
            for p in ps:
                p.grad = torch.randn_like(p)
            try:
                opt = torch.optim.Adam(ps, lr=1e-3, **kw)
            except (RuntimeError, TypeError) as exc:
                out.append({"kind": "adam", "impl": name, "device": device.type, "error": str(exc)[:200]})
                continue
            st, inner = _timed_everywhere(ctx, opt.step, reps=max(5, ctx.plan.reps // 2))
            out.append({"kind": "adam", "impl": name, "device": device.type, "params": sum(chunks),
                        "threads": torch.get_num_threads(), "params_per_s": sum(chunks) / st["time_s"],
                        "inner": inner, **st})
    try:   # DeepSpeedCPUAdam when deepspeed is installed (first use compiles its extension)
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        ps = [torch.nn.Parameter(torch.randn(c)) for c in chunks]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = DeepSpeedCPUAdam(ps, lr=1e-3)
        st, inner = _timed_everywhere(ctx, opt.step, reps=max(5, ctx.plan.reps // 2))
        out.append({"kind": "adam", "impl": "DeepSpeedCPUAdam", "device": "cpu", "params": sum(chunks),
                    "threads": torch.get_num_threads(), "params_per_s": sum(chunks) / st["time_s"],
                    "inner": inner, **st})
    except Exception as exc:   # optional: absent or failing to build is not a calibration failure
        out.append({"kind": "adam", "impl": "DeepSpeedCPUAdam", "device": "cpu",
                    "error": f"unavailable: {type(exc).__name__}: {str(exc)[:150]}"})
    return out


def bench_optimizer_step(ctx: Ctx) -> list[dict]:
    """DeepSpeed 0.19.8's ZeRO-1/2 optimizer step on the device over one shard, pass by pass as
    zsim charges it (zsim.schedule.optimizer grad_norm_ops and optimizer_step): per gradient piece
    the overflow check (amax/amin) and the fp64 norm, then the pieces flattened and converted to
    fp32, clipped, fused AdamW on the fp32 master, the master copied back into the 16-bit
    params, the gradients zeroed. The shard is larger than the caches, as a real shard is, and
    its fp32 gradient copy (4 B per param, a third of adam_params) stays under glibc's 32 MiB
    mmap ceiling: zsim charges the first touch of a fresh copy on its own (fresh_alloc), so the
    rate measured here must not include it."""
    from calibration.core.ds_passes import overflow_count, squared_norm
    from zsim.schedule.optimizer import (NORM_KERNELS_PER_TENSOR, OVERFLOW_KERNELS_PER_TENSOR, norm_bytes_per_param,
                                         overflow_bytes_per_param, step_bytes_per_param)

    dtype_name = ctx.plan.profile_dtype
    dt = DTYPES[dtype_name]
    n = ctx.plan.adam_params // 3
    p16 = torch.randn(n, dtype=dt, device=ctx.device)
    g16 = torch.randn(n, dtype=dt, device=ctx.device) * 1e-3
    pieces = g16.split(1 << 20)    # a partition's gradient pieces (averaged_gradients)
    master = torch.nn.Parameter(p16.float(), requires_grad=False)
    try:
        opt = torch.optim.AdamW([master], lr=1e-6, fused=True)
        impl = "torch.optim.AdamW(fused)"
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW([master], lr=1e-6, foreach=True)
        impl = "torch.optim.AdamW(foreach)"
    check = dt != torch.float32

    def step():
        if check:
            overflow_count(pieces)
        norm = squared_norm(pieces).sqrt()
        g = torch.cat(pieces).to(torch.float32)
        g.mul_(0.5 if float(norm) >= 0 else 1.0)     # unscale / clip coefficient
        master.grad = g
        opt.step()
        master.grad = None
        p16.copy_(master)
        g16.zero_()

    st, inner = _timed_everywhere(ctx, step, reps=max(5, ctx.plan.reps // 2))
    width = torch.tensor([], dtype=dt).element_size()
    per_param = (step_bytes_per_param(width, True) + norm_bytes_per_param(width)
                 + (overflow_bytes_per_param(width) if check else 0.0))
    kernels = 6 + 3 + len(pieces) * (NORM_KERNELS_PER_TENSOR + (OVERFLOW_KERNELS_PER_TENSOR if check else 0))
    return [{"kind": "optimizer_step", "dtype": dtype_name, "impl": impl, "params": n, "pieces": len(pieces),
             "kernels": kernels,
             "bytes": per_param * n, "GBps": per_param * n / st["time_s"] / 1e9, "inner": inner, **st}]


ZERO3_HOOK_MODULES = (8, 64)


def bench_zero3_hooks(ctx: Ctx) -> list[dict]:
    """DeepSpeed's host time per module and per parameter over plain torch: ZeRO-3's module hooks
    (pre/post forward and backward: fetch and release bookkeeping, trace, prefetch coordinator)
    per module visit and pass, and ZeRO-0/1/2's gradient handling per parameter in backward
    (stage 2's hooks, stage 1's boundary bucketing, stage 0's fallback all-reduce with its
    per-tensor flatten and copy-back). A stack of tiny Linear modules (2 params each), all below
    the persistence threshold (no gathers in the passes), runs in plain torch and under each
    stage at two depths; the difference of the per-module slopes is DeepSpeed's cost. Needs
    deepspeed (optional, like DeepSpeedCPUAdam)."""
    try:
        if not ctx.cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
    except Exception as exc:   # optional: absent is not a calibration failure
        return [{"kind": "zero3_hooks", "error": f"not measured: deepspeed unavailable ({type(exc).__name__}); "
                                                 "pip install deepspeed to measure it"}]
    deepspeed.init_distributed(dist_backend="nccl" if ctx.cuda else "gloo")
    width = 64
    bf16 = ctx.plan.profile_dtype == "bf16"
    dt = torch.bfloat16 if bf16 else torch.float32
    reps = max(20, ctx.plan.reps)

    def run(stage: int | None, n: int) -> tuple[list[float], list[float]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n)])
        if stage is None:
            model = model.to(device=ctx.device, dtype=dt)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            fwd, bwd = model, lambda y: y.backward()

            def step():
                opt.step()
                opt.zero_grad(set_to_none=True)
            eng = None
        else:
            cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
                   "bf16": {"enabled": bf16}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
            opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
            eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
            fwd, bwd, step = eng, eng.backward, eng.step
        x = torch.randn(4, width, device=ctx.device, dtype=dt)
        fw, bw = [], []
        for i in range(ctx.plan.warmup + reps):
            dist.barrier()
            t0 = time.perf_counter()
            y = fwd(x).float().sum()
            ctx.sync()
            t1 = time.perf_counter()
            bwd(y)
            ctx.sync()
            t2 = time.perf_counter()
            step()
            if i >= ctx.plan.warmup:
                fw.append(t1 - t0)
                bw.append(t2 - t1)
        if eng is not None:
            eng.destroy()
        return ctx.gather_max(fw), ctx.gather_max(bw)

    ctx.at_sync()
    # ZeRO-3 first, against a plain run before it: an engine built after others in the same
    # process ran its hooks up to 2x slower than in a fresh one (as zsim validate runs it), and
    # ZeRO-3 leaves the process slower after it, so ZeRO-0/1/2 get a plain baseline of their own
    med = {}
    for key, stage in (("plain", None), ("stage3", 3), ("plain_after3", None), ("stage0", 0), ("stage1", 1),
                       ("stage2", 2)):
        for n in ZERO3_HOOK_MODULES:
            fw, bw = run(stage, n)
            gc.collect()   # the engine just destroyed is a cycle of hooks and buffers
            med[(key, n)] = (statistics.median(fw), statistics.median(bw))
    lo, hi = ZERO3_HOOK_MODULES
    slope = lambda key, k: (med[(key, hi)][k] - med[(key, lo)][k]) / (hi - lo)
    return [{"kind": "zero3_hooks", "deepspeed": deepspeed.__version__, "modules": list(ZERO3_HOOK_MODULES),
             "width": width, "baseline": "plain torch",
             "times_s": {f"{key}/{n}": list(v) for (key, n), v in med.items()},
             "fwd_s_per_visit": slope("stage3", 0) - slope("plain", 0),
             "bwd_s_per_visit": slope("stage3", 1) - slope("plain", 1),
             "grad_hook_s_per_param": {str(s): (slope(f"stage{s}", 1) - slope("plain_after3", 1)) / 2
                                       for s in (0, 1, 2)},
             "time_s": med[("stage3", hi)][0] + med[("stage3", hi)][1]}]


def _aligned(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes)   # page-aligned, as O_DIRECT requires


def bench_io(ctx: Ctx) -> list[dict]:
    """Sequential write then read of one file per rank, all ranks at once, 1 MiB blocks."""
    base = ctx.plan.io_path or ctx.run_dir
    os.makedirs(base, exist_ok=True)
    path = os.path.join(base, f".zsim-io-{socket.gethostname()}-{ctx.rank}.bin")
    block = 1 << 20
    nblocks = max(1, ctx.plan.io_bytes // block)
    buf = _aligned(block)
    buf.write(os.urandom(4096) * (block // 4096))
    direct = hasattr(os, "O_DIRECT")
    out = []

    def open_(flags):
        nonlocal direct
        if direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError:
                direct = False
        return os.open(path, flags, 0o600)

    def write():
        fd = open_(os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for _ in range(nblocks):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read():
        fd = open_(os.O_RDONLY)
        try:
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)   # read the device, not the page cache
            for _ in range(nblocks):
                os.readv(fd, [buf])
        finally:
            os.close(fd)

    ctx.at_sync()
    try:
        for op, fn in (("write", write), ("read", read)):
            dist.barrier()
            times = []
            for _ in range(max(2, ctx.plan.reps // 5)):
                if op == "read" and not direct:
                    fd = os.open(path, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            st = stats(ctx.gather_max(times))
            # ranks of a node share its drives: the node's rate is all its ranks' bytes over the slowest
            out.append({"kind": "file_io", "op": op, "path": base, "o_direct": direct, "block_bytes": block,
                        "size_bytes_per_rank": nblocks * block, "ranks_per_node": ctx.local_world,
                        "node_GBps": ctx.local_world * nblocks * block / st["time_s"] / 1e9, **st})
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return out


def bench_interference(ctx: Ctx) -> dict:
    """Slowdown of a GEMM while a collective runs concurrently, and of the collective."""
    L = ctx.plan.layers[0]
    dt = DTYPES[ctx.plan.profile_dtype]
    a = torch.randn(L.tokens, L.hidden, dtype=dt, device=ctx.device)
    w = torch.randn(4 * L.hidden, L.hidden, dtype=dt, device=ctx.device)
    gemm = lambda: F.linear(a, w)
    buf = torch.ones(min(ctx.plan.max_size_bytes, 16 << 20) // 4, device=ctx.device)
    reps = max(3, ctx.plan.reps // 3)
    ctx.at_sync()
    dist.barrier()
    g_alone, _ = _local_times(ctx, gemm, reps=reps)
    c_alone = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        ctx.sync()
        c_alone.append(time.perf_counter() - t0)
    g_during, c_during = [], []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_reduce(buf, async_op=True)
        n, tg0 = 0, time.perf_counter()
        while not work.is_completed():
            gemm()
            ctx.sync()
            n += 1
        work.wait()
        ctx.sync()
        t1 = time.perf_counter()
        c_during.append(t1 - t0)
        if n:
            g_during.append((t1 - tg0) / n)
    g_during = g_during or [0.0]
    vals = ctx.gather_max([stats(g_alone)["time_s"], stats(g_during)["time_s"],
                           stats(c_alone)["time_s"], stats(c_during)["time_s"]])
    return {"kind": "interference", "gemm": [L.tokens, 4 * L.hidden, L.hidden], "dtype": ctx.plan.profile_dtype,
            "collective": "all_reduce", "size_bytes": buf.numel() * 4,
            "gemm_alone_s": vals[0], "gemm_during_comm_s": vals[1],
            "comm_alone_s": vals[2], "comm_during_gemm_s": vals[3]}


# ----------------------------------------------------------------------------- driver
def provenance(ctx: Ctx) -> dict:
    hosts = [None] * ctx.world
    dist.all_gather_object(hosts, socket.gethostname())
    cpu_model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu_model)
    except OSError:
        pass
    prov = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "hosts": ",".join(sorted(set(hosts))), "world_size": str(ctx.world), "nodes": str(ctx.nodes),
            "ranks_per_node": str(ctx.local_world), "backend": dist.get_backend(),
            "torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_model,
            "cpu_cores": str(os.cpu_count()), "threads_per_rank": str(torch.get_num_threads()),
            "mode": ctx.plan.mode}
    if ctx.cuda:
        prov["gpu"] = torch.cuda.get_device_name(ctx.device)
        prov["cuda"] = str(torch.version.cuda)
        prov["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        try:
            import subprocess
            prov["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=10).stdout.splitlines()[0]
        except Exception:
            prov["driver"] = "unknown"
    else:
        prov["gpu"] = f"none (one CPU rank = {torch.get_num_threads()} thread(s) of {cpu_model})"
        prov["driver"] = "n/a"
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(ln.split()[1] for ln in f if ln.startswith("MemTotal")))
        prov["host_memory_GiB"] = f"{kb / 2**20:.1f}"
    except (OSError, StopIteration):
        pass
    return prov


class Progress:
    """Rank 0's progress bar with an ETA weighted by each item's expected cost."""

    def __init__(self, names: list[str]):
        self.weights = [estimated_cost(n) for n in names]
        self.total = sum(self.weights)
        self.done = 0.0
        self.t0 = time.time()
        self.tty = sys.stderr.isatty() or os.environ.get("ZSIM_CALIB_TTY") == "1"
        self.last_print = 0.0
        self.n = len(names)

    def show(self, i: int, name: str):
        frac = self.done / self.total
        el = time.time() - self.t0
        eta = el / frac * (1 - frac) if frac > 0.02 else float("nan")
        eta_s = "--:--" if math.isnan(eta) else f"{int(eta) // 60}:{int(eta) % 60:02d}"
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        line = f"[{bar}] {i + 1}/{self.n} {100 * frac:3.0f}% ETA {eta_s}  {name[:60]}"
        if self.tty:
            sys.stderr.write("\r" + line.ljust(110))
            sys.stderr.flush()
        elif time.time() - self.last_print > 5 or i == 0:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            self.last_print = time.time()

    def advance(self, i: int):
        self.done += self.weights[i]

    def close(self):
        if self.tty:
            sys.stderr.write("\n")
        sys.stderr.write(f"measured {self.n} benchmarks in {time.time() - self.t0:.1f} s\n")
        sys.stderr.flush()


_CTX: list = []


def _on_sigterm(signum, frame):
    """torchrun stops the surviving ranks with SIGTERM when one fails: say so, so the
    launcher blames the rank that failed first rather than one it stopped."""
    if _CTX:
        try:
            _CTX[0].status(_CTX[0].item, state="terminated")
        except Exception:
            pass
    os._exit(128 + signum)


def run(plan: Plan, run_dir: str):
    ctx = Ctx(plan, run_dir)
    _CTX.append(ctx)
    names = items(plan, ctx.world, ctx.nodes)
    prov = provenance(ctx)
    if ctx.rank == 0:
        with open(os.path.join(run_dir, "provenance.json"), "w") as f:
            json.dump(prov, f, indent=1, sort_keys=True)
    prog = Progress(names) if ctx.rank == 0 and not os.environ.get("ZSIM_CALIB_NO_PROGRESS") else None
    fault = os.environ.get("ZSIM_CALIB_FAULT", "")   # tests: "RANK:ITEM_PREFIX:kill|hang"
    for i, name in enumerate(names):
        ctx.item_index = i
        ctx.status(name)
        if prog:
            prog.show(i, name)
        if fault:
            f_rank, f_prefix, f_action = fault.split(":")
            if int(f_rank) == ctx.rank and name.startswith(f_prefix):
                if f_action == "kill":
                    os.kill(os.getpid(), 9)
                time.sleep(10**6)
        try:
            recs = dispatch(ctx, name)
        except Exception as exc:   # tell the launcher which rank failed where, then fail
            ctx.status(name, state="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            raise
        for r in recs if isinstance(recs, list) else [recs]:
            r["item"] = name
            ctx.record(r)
        if prog:
            prog.advance(i)
    dist.barrier()
    if prog:
        prog.close()
    ctx.status("", state="done")


_CTX_BENCHES = {"overhead": bench_overhead, "memcpy": bench_memcpy, "fresh_alloc": bench_fresh_alloc,
                "adam": bench_adam, "optimizer_step": bench_optimizer_step, "zero3_hooks": bench_zero3_hooks,
                "io": bench_io, "interference": bench_interference}
_LAYER_BENCHES = {"gemm": bench_gemms, "attention": bench_attention, "membound": bench_membound,
                  "layer": bench_layer}


def dispatch(ctx: Ctx, name: str):
    """Run the benchmark an item name (plan.items) stands for."""
    p = name.split("/")
    if p[0] in _CTX_BENCHES:
        return _CTX_BENCHES[p[0]](ctx)
    if p[0] in _LAYER_BENCHES:
        return _LAYER_BENCHES[p[0]](ctx, p[1], {L.label: L for L in ctx.plan.layers}[p[2]])
    if p[0] == "collective":
        return bench_collective(ctx, p[1], p[2], p[3], int(p[4]))
    raise ValueError(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--mode", choices=("quick", "full"), default="full",
                    help="used when RUN_DIR/plan.json does not exist (multi-node launches)")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default=None)
    args = ap.parse_args(argv)
    os.makedirs(args.run_dir, exist_ok=True)
    plan_path = os.path.join(args.run_dir, "plan.json")
    if os.path.exists(plan_path):
        with open(plan_path) as f:
            plan = Plan.from_json(f.read())
    else:
        plan = default_plan(args.mode)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(plan_path + f".{os.getpid()}", "w") as f:
                f.write(plan.to_json())
            os.replace(plan_path + f".{os.getpid()}", plan_path)
    backend = args.backend or os.environ.get("ZSIM_CALIB_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    signal.signal(signal.SIGTERM, _on_sigterm)
    # longer than the launcher's no-progress timeout, so the launcher (which can name the hung
    # rank) stops the job before gloo/NCCL time out on the waiting ranks
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=2 * plan.timeout_s + 30))
    try:
        run(plan, args.run_dir)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
