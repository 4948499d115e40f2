"""Host-side benchmarks: fresh allocations, memory copies (host, device, PCIe), CPU Adam and
file I/O."""
from __future__ import annotations

import mmap
import os
import socket
import time

import torch
import torch.distributed as dist

from calibration.harness.context import Ctx, timed_everywhere
from calibration.harness.ds_ops import READY_ENV
from calibration.harness.plan import stats


FRESH_ALLOC_MiB = (1, 2, 4, 8, 16, 24, 31, 33, 48, 64)
# A GPU node's host streams (CPU Adam, the offloaded step's passes: see [Note: CPU step traffic])
# run over GBs, far beyond any last-level cache (up to ~0.4 GB on current server CPUs), so
# its host copy and its large CPU Adam are measured at this size.
HOST_STREAM_BYTES = 1 << 30


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
        st_f, inner_f = timed_everywhere(ctx, lambda n=n: torch.empty(n, device=ctx.device).fill_(1.0),
                                          reps=max(5, ctx.plan.reps // 2))
        st_k, _ = timed_everywhere(ctx, lambda kept=kept: kept.fill_(1.0), reps=max(5, ctx.plan.reps // 2))
        out.append({"kind": "fresh_alloc", "size_bytes": n * 4, "inner": inner_f, **st_f,
                    "kept_time_s": st_k["time_s"], "kept_time_s_min": st_k["time_s_min"]})
    return out


def bench_memcpy(ctx: Ctx) -> list[dict]:
    out = []
    n = ctx.plan.memcpy_bytes // 4
    if ctx.cuda:   # past the L2 (50-60 MB on an H100/H200): a 16 MiB copy read 3.7-4.9 TB/s on an H200
        n = HOST_STREAM_BYTES // 4
    src = torch.ones(n, device=ctx.device)
    dst = torch.empty_like(src)
    st, inner = timed_everywhere(ctx, lambda: dst.copy_(src), reps=max(5, ctx.plan.reps // 2))
    # STREAM "copy" convention: read + write = 2x the buffer
    out.append({"kind": "memcpy", "where": "device" if ctx.cuda else "host", "size_bytes": n * 4,
                "bytes_moved": 2 * n * 4, "GBps": 2 * n * 4 / st["time_s"] / 1e9, "inner": inner, **st})
    if ctx.cuda:
        # the host's own bandwidth (cpu.memory_bw_GBps), out of cache, with the rank's threads
        hn = HOST_STREAM_BYTES // 4
        hsrc = torch.ones(hn)
        hdst = torch.empty_like(hsrc)
        st, inner = timed_everywhere(ctx, lambda: hdst.copy_(hsrc), reps=max(5, ctx.plan.reps // 2))
        out.append({"kind": "memcpy", "where": "host", "size_bytes": hn * 4, "bytes_moved": 2 * hn * 4,
                    "threads": torch.get_num_threads(), "GBps": 2 * hn * 4 / st["time_s"] / 1e9, "inner": inner, **st})
        del hsrc, hdst
        n = ctx.plan.memcpy_bytes // 4   # the PCIe copies keep the plan's size
        src = src[:n]
        for pinned in (True, False):
            h = torch.ones(n, pin_memory=pinned)
            for direction, fn in (("h2d", lambda: src.copy_(h, non_blocking=pinned)),
                                  ("d2h", lambda: h.copy_(src, non_blocking=pinned))):
                st, inner = timed_everywhere(ctx, fn, reps=max(5, ctx.plan.reps // 2))
                out.append({"kind": "pcie", "direction": direction, "pinned": pinned, "size_bytes": n * 4,
                            "GBps": n * 4 / st["time_s"] / 1e9, "inner": inner, **st})
    return out


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
            st, inner = timed_everywhere(ctx, opt.step, reps=max(5, ctx.plan.reps // 2))
            out.append({"kind": "adam", "impl": name, "device": device.type, "params": sum(chunks),
                        "threads": torch.get_num_threads(), "params_per_s": sum(chunks) / st["time_s"],
                        "inner": inner, **st})
    ready = os.environ.get(READY_ENV)
    if ready is not None and ready != "built":   # the launcher built it, or found why it cannot
        out.append({"kind": "adam", "impl": "DeepSpeedCPUAdam", "device": "cpu", "error": ready})
        return out
    try:   # DeepSpeedCPUAdam: `zsim calibrate` built its extension before the benchmarks (ds_ops.py)
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        sizes = [(chunks, None, max(5, ctx.plan.reps // 2))]
        if ctx.cuda:   # out of cache, as an offloaded shard is (see [Note: CPU step traffic]): fp32
            # params whose four streams span HOST_STREAM_BYTES
            sizes.append(([HOST_STREAM_BYTES // 16 // 8] * 8, "out of cache", 5))
        for chunk_sizes, regime, reps in sizes:
            ps = [torch.nn.Parameter(torch.randn(c)) for c in chunk_sizes]
            for p in ps:
                p.grad = torch.randn_like(p)
            opt = DeepSpeedCPUAdam(ps, lr=1e-3)
            st, inner = timed_everywhere(ctx, opt.step, reps=reps)
            out.append({"kind": "adam", "impl": "DeepSpeedCPUAdam", "device": "cpu", "params": sum(chunk_sizes),
                        **({"regime": regime} if regime else {}), "threads": torch.get_num_threads(),
                        "params_per_s": sum(chunk_sizes) / st["time_s"], "inner": inner, **st})
            del ps, opt
    except Exception as exc:   # optional: absent or failing to build is not a calibration failure
        out.append({"kind": "adam", "impl": "DeepSpeedCPUAdam", "device": "cpu",
                    "error": f"unavailable: {type(exc).__name__}: {str(exc)[:150]}"})
    return out


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
