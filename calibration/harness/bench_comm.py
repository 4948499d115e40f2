"""Collective benchmarks: each collective timed as a training step meets it, and its
interference with a concurrent GEMM."""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from calibration.core.memory import TensorMemoryTracker
from calibration.core.model import DTYPES
from calibration.harness.context import Ctx, local_times
from calibration.harness.plan import stats, tier_of_group


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
    g_alone, _ = local_times(ctx, gemm, reps=reps)
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


def bench_collective_memory(ctx: Ctx) -> list[dict]:
    """The tensor memory a collective allocates while it runs, beyond its input and output, as
    the peak trackers of a training run see it: on a CPU the core's TensorMemoryTracker (storages
    allocated through torch ops), on a GPU the CUDA caching allocator's max_memory_allocated.
    See [Note: gloo reduce-scatter copy] (zsim/schedule/grad_buckets.py)."""
    n = ctx.world
    out = []
    for op in ("reduce_scatter", "all_gather", "all_reduce"):
        # 16 MiB of fp32 (far above any allocator granularity), built as the timed benchmark builds it
        fn, full_bytes = _collective_fn(op, 16 << 20, torch.float32, n, None, ctx.device)
        input_bytes = full_bytes // n if op == "all_gather" else full_bytes
        fn()   # warm-up: the backend's lazily made buffers are not per-call memory
        ctx.sync()
        dist.barrier()
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
            before = torch.cuda.memory_allocated(ctx.device)
            fn()
            ctx.sync()
            temp = torch.cuda.max_memory_allocated(ctx.device) - before
        else:
            tracker = TensorMemoryTracker().start()
            before = tracker.current
            with tracker:
                fn()
            temp = tracker.peak - before
        temp = ctx.gather_max([float(temp)])[0]
        out.append({"kind": "collective_memory", "op": op, "ranks": n, "input_bytes": input_bytes,
                    "temp_bytes": temp, "backend": dist.get_backend()})
    return out
