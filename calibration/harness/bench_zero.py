"""DeepSpeed ZeRO benchmarks: the ZeRO-1/2 optimizer step pass by pass, and the per-module and
per-parameter host cost of DeepSpeed's hooks."""
from __future__ import annotations

import gc
import os
import statistics
import time

import torch
import torch.distributed as dist

from calibration.core.model import DTYPES
from calibration.harness.context import Ctx, timed_everywhere


# parameters of the optimizer-step benchmark on a GPU: ~1.5 GB of state and gradients moved per
# step, milliseconds against the step's ~100 kernel launches (a quick CPU plan's 350k
# parameters measured launches, not bandwidth, on an H200: optimizer_efficiency 0.019)
CUDA_STEP_PARAMS = 48 << 20


def bench_optimizer_step(ctx: Ctx) -> list[dict]:
    """The optimizer step (below) in each dtype whose compute the profile fits: an fp32 run's step
    has no 16-bit copies and no overflow check, and on a CPU without bf16 units a bf16 one's
    conversions are emulated."""
    return [r for dtype_name in ctx.plan.fitted_dtypes for r in _optimizer_step(ctx, dtype_name)]


def _optimizer_step(ctx: Ctx, dtype_name: str) -> list[dict]:
    """DeepSpeed 0.19.8's ZeRO-1/2 optimizer step on the device over one shard, pass by pass as
    zsim charges it (zsim.schedule.optimizer grad_norm_ops and optimizer_step): per gradient piece
    the overflow check (amax/amin) and the fp64 norm, then the pieces flattened and converted to
    fp32, clipped, fused AdamW on the fp32 master, the master copied back into the 16-bit
    params, the gradients zeroed. The shard is larger than the caches, as a real shard is, and
    its fp32 gradient copy (4 B per param, a third of adam_params) stays under glibc's 32 MiB
    mmap ceiling: zsim charges the first touch of a fresh copy on its own (fresh_alloc), so the
    rate measured here must not include it."""
    from calibration.core.ds_passes import overflow_count, squared_norm
    from zsim.schedule.optimizer import (NORM_KERNELS_PER_TENSOR, NORM_SCALAR_KERNELS, OVERFLOW_KERNELS_PER_TENSOR,
                                         STEP_KERNELS, norm_bytes_per_param, overflow_bytes_per_param,
                                         step_bytes_per_param)

    dt = DTYPES[dtype_name]
    n = ctx.plan.adam_params // 3
    if ctx.cuda:   # a GPU's ~50 MB L2 and ~8 us launches: a shard of GBs, as a real one is
        n = max(n, CUDA_STEP_PARAMS)
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

    st, inner = timed_everywhere(ctx, step, reps=max(5, ctx.plan.reps // 2))
    width = torch.tensor([], dtype=dt).element_size()
    per_param = (step_bytes_per_param(width, True) + norm_bytes_per_param(width)
                 + (overflow_bytes_per_param(width) if check else 0.0))
    kernels = (STEP_KERNELS + NORM_SCALAR_KERNELS
               + len(pieces) * (NORM_KERNELS_PER_TENSOR + (OVERFLOW_KERNELS_PER_TENSOR if check else 0)))
    return [{"kind": "optimizer_step", "dtype": dtype_name, "impl": impl, "params": n, "pieces": len(pieces),
             "kernels": kernels,
             "bytes": per_param * n, "GBps": per_param * n / st["time_s"] / 1e9, "inner": inner, **st}]


# the gradients an AccumulateGrad add streams on a CPU rank: a small model's (tens of MB), past
# the caches, as a real step's are
ACCUMULATE_PARAMS = 16 << 20
ACCUMULATE_PIECE = 1 << 20


def bench_grad_accumulate(ctx: Ctx) -> list[dict]:
    """Autograd's add of a new gradient into an existing .grad (see [Note: gradient accumulation
    add] in zsim/schedule/stage012.py), one add_ per parameter-sized piece, in each dtype the
    profile fits: bytes as zsim charges them (read both, write one)."""
    out = []
    n = max(ACCUMULATE_PARAMS, CUDA_STEP_PARAMS if ctx.cuda else 0)
    for dtype_name in ctx.plan.fitted_dtypes:
        dt = DTYPES[dtype_name]
        pairs = list(zip(torch.randn(n, dtype=dt, device=ctx.device).split(ACCUMULATE_PIECE),
                         torch.randn(n, dtype=dt, device=ctx.device).split(ACCUMULATE_PIECE)))

        def accumulate(pairs=pairs):
            for grad, new in pairs:
                grad.add_(new)

        st, inner = timed_everywhere(ctx, accumulate, reps=max(5, ctx.plan.reps // 2))
        nbytes = 3.0 * n * torch.tensor([], dtype=dt).element_size()
        out.append({"kind": "grad_accumulate", "dtype": dtype_name, "params": n, "kernels": len(pairs),
                    "bytes": nbytes, "GBps": nbytes / st["time_s"] / 1e9, "inner": inner, **st})
    return out


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


RANK_VIEW_WORLDS = (64, 256, 1024)


def _scatter_prep(tensors: list, world: int):
    """reduce_scatter_coalesced (runtime/comm/coalesced_collectives.py) up to its collective:
    the per-rank slice lists, the rank x tensor interleave and its torch.cat, the pre-divide and
    torch.chunk."""
    parts = []
    for t in tensors:
        flat = t.view(-1)
        chunk = -(-t.numel() // world)
        parts.append([flat[r * chunk:r * chunk + chunk] for r in range(world)])
    padded = tuple(-(-t.numel() // world) for t in tensors)
    if len(tensors) == 1 and tensors[0].numel() % world == 0:
        buf = tensors[0].view(-1)
    else:
        lst = []
        for r in range(world):
            for i in range(len(tensors)):
                piece = parts[i][r]
                lst.append(piece)
                pad = padded[i] - piece.numel()
                if pad > 0:
                    lst.append(torch.empty(pad, dtype=piece.dtype, device=piece.device))
        buf = torch.cat(lst)
    buf.div_(world)
    return torch.chunk(buf, world)


def _gather_launch_and_wait(params: list, world: int, cuda: bool):
    """A coalesced all-gather of `params` without its collective: _all_gather_dtype's flat buffer
    and per-rank `partitions` (partition_parameters.py), then AllGatherCoalescedHandle.wait's split
    of every param out of it (narrow per rank, torch.cat, record_stream on a GPU)."""
    shard = [-(-p.numel() // world) for p in params]
    flat = torch.empty(sum(shard) * world, dtype=params[0].dtype, device=params[0].device)
    partitions = [flat.narrow(0, sum(shard) * r, sum(shard)) for r in range(world)]
    offset = 0
    for p, s in zip(params, shard):
        pieces = []
        for r in range(world):
            if r * s < p.numel():
                pieces.append(partitions[r].narrow(0, offset, min(p.numel() - r * s, s)))
        p.data = torch.cat(pieces).view(p.shape)
        if cuda:
            for piece in pieces:
                piece.record_stream(torch.cuda.current_stream())
        offset += s


def bench_rank_views(ctx: Ctx) -> list[dict]:
    """Host time of ZeRO-3's per-rank Python loops (see [Note: per-rank host loops] in
    zsim/schedule/partition.py) at a few pretend world sizes: a one-tensor divisible bucket, a
    three-tensor bucket and a coalesced gather of three params, on tiny tensors of this rank's
    device (the loops' cost does not depend on the bytes). Each record gives the views zsim counts
    for the call and its time; the fit takes the slope over world sizes."""
    from zsim.schedule.partition import coalesced_gather_views, scatter_views
    dt = DTYPES[ctx.plan.profile_dtype]
    out = []
    for world in RANK_VIEW_WORLDS:
        one = [torch.zeros(world * 4, dtype=dt, device=ctx.device)]
        three = [torch.zeros(world * 4 + 1, dtype=dt, device=ctx.device) for _ in range(3)]
        params = [torch.nn.Parameter(torch.zeros(world * 4 + 1, dtype=dt, device=ctx.device)) for _ in range(3)]
        cases = (("scatter_1", lambda: _scatter_prep(one, world), scatter_views(world, 1, False)),
                 ("scatter_3", lambda: _scatter_prep(three, world), scatter_views(world, 3, True)),
                 ("gather_3", lambda: _gather_launch_and_wait(params, world, ctx.cuda),
                  sum(coalesced_gather_views(world, 3))))
        for name, fn, views in cases:
            st, inner = timed_everywhere(ctx, fn, reps=max(5, ctx.plan.reps // 2))
            out.append({"kind": "rank_views", "case": name, "world": world, "views": views, "inner": inner, **st})
    return out
