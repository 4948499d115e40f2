"""What a measured run (the own core under calibration/core/run.py, or DeepSpeed / FSDP2 / DDP
under calibration/core/peers.py) reports, and how its ranks leave."""
from __future__ import annotations

import json
import os
import statistics
import sys


def summarize_times(step_times, phase_times) -> dict:
    med = statistics.median(step_times)
    return {
        "step_time_s": med,
        "step_times_s": step_times,
        "step_time_min_s": min(step_times),
        "step_time_max_s": max(step_times),
        "step_time_spread": (max(step_times) - min(step_times)) / med if med else 0.0,
        "phases_s": {k: statistics.median(v) for k, v in phase_times.items()},
    }


def write_measurement(path: str, engine: str, sc, args, step_times, phase_times, peak_bytes: int,
                      collectives, losses: list[float], model_states: dict[str, int] | None = None) -> None:
    """Gather every rank's peak memory and losses; rank 0 writes the JSON `zsim validate` reads
    (all ranks call)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    peaks = [None] * world
    dist.all_gather_object(peaks, peak_bytes)
    all_losses = [None] * world
    dist.all_gather_object(all_losses, losses)
    # a pipeline's ranks issue different calls (their stage's): every rank's list is kept
    per_rank = [None] * world
    dist.all_gather_object(per_rank, [list(c) for c in collectives] if sc.pipeline_stages > 1 else None)
    if dist.get_rank() == 0:
        out = {"engine": engine, "scenario": sc.name, "world_size": world, "steps": args.steps,
               "warmup": args.warmup, **summarize_times(step_times, phase_times),
               "peak_bytes": max(peaks), "peak_bytes_per_rank": peaks,
               "collectives": [list(c) for c in collectives],
               "losses": [sum(v) / world for v in zip(*all_losses)]}
        if sc.pipeline_stages > 1:
            out["collectives_per_rank"] = per_rank
        if model_states is not None:   # rank 0's (the ranks hold equal shares, up to padding)
            out["model_state_bytes"] = model_states
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def measure_steps(args, sc, engine: str, train_step, record: dict, write=None, device=None) -> None:
    """The peers' measurement (calibration/core/peers.py, ds_pipe.py): `args.warmup` steps, then
    `args.steps` timed ones (the last one's calls logged into record["log"]), then one step under
    the tensor memory tracker; rank 0 writes the JSON and every rank leaves.
    `train_step(step, phases)` returns the step's losses and adds its phases' times to `phases`
    (a dict, or None when not timed). `write` replaces write_measurement (same arguments).
    On a CUDA `device` the peak is the caching allocator's max_memory_allocated over that step
    (tensor bytes on the GPU, as the tracker counts them on a CPU; host tensors, e.g. an
    offloaded optimizer's, are not GPU memory)."""
    import time

    import torch.distributed as dist

    from calibration.core.memory import TensorMemoryTracker

    losses, step_times, phase_times = [], [], {}
    s = 0
    for _ in range(args.warmup):
        losses += train_step(s, None)
        s += 1
    for i in range(args.steps):
        if i == args.steps - 1:
            record["log"] = []
        dist.barrier()
        ph = {}
        t0 = time.perf_counter()
        losses += train_step(s, ph)
        step_times.append(time.perf_counter() - t0)
        for k, v in ph.items():
            phase_times.setdefault(k, []).append(v)
        s += 1
    collectives = record["log"] or []
    record["log"] = None
    if getattr(args, "profile_step", None):
        s = profile_step(args.profile_step, train_step, s, device)
    peak = 0
    if not args.no_memory and device is not None and device.type == "cuda":
        import torch

        dist.barrier()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        losses += train_step(s, None)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    elif not args.no_memory:
        dist.barrier()
        tr = TensorMemoryTracker().start()
        with tr:
            losses += train_step(s, None)
        peak = tr.peak
    (write or write_measurement)(args.out, engine, sc, args, step_times, phase_times, peak, collectives, losses)
    dist.barrier()
    exit_without_teardown()


def profile_step(path: str, train_step, s: int, device) -> int:
    """Where the optimizer-step phase's time goes: one step's step phase under torch.profiler
    (aten ops and, on a GPU, kernels: what ran), the next one's under cProfile (DeepSpeed's Python
    functions: who ran it, and where the host waited); rank 0 writes both tables to `path`.
    Returns the next step number. `train_step` takes `around_step`, a context manager factory
    wrapped around its step phase (peers.py)."""
    import cProfile
    import io
    import pstats

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    cuda = device is not None and device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    holder = {}

    def torch_prof():
        holder["prof"] = profile(activities=acts)
        return holder["prof"]

    phases_t, phases_c = {}, {}
    dist.barrier()
    train_step(s, phases_t, around_step=torch_prof)
    cprof = cProfile.Profile()
    dist.barrier()
    train_step(s + 1, phases_c, around_step=lambda: cprof)
    if dist.get_rank() == 0:
        out = io.StringIO()
        out.write(f"step phase: {phases_t.get('step', 0) * 1e3:.1f} ms under torch.profiler, "
                  f"{phases_c.get('step', 0) * 1e3:.1f} ms under cProfile (phases {phases_c})\n\n")
        ka = holder["prof"].key_averages()
        for key in (("self_device_time_total",) if cuda else ()) + ("self_cpu_time_total",):
            out.write(f"torch.profiler, by {key}\n{ka.table(sort_by=key, row_limit=35, max_name_column_width=60)}\n")
        for key, n in (("cumulative", 60), ("tottime", 30)):
            out.write(f"cProfile, by {key}\n")
            pstats.Stats(cprof, stream=out).sort_stats(key).print_stats(n)
        with open(path, "w") as f:
            f.write(out.getvalue())
    return s + 2


def exit_without_teardown():
    """Leave without tearing gloo down: its destructor can abort a rank whose peer already left
    ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
