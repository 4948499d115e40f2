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


def exit_without_teardown():
    """Leave without tearing gloo down: its destructor can abort a rank whose peer already left
    ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
