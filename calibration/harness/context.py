"""A calibration rank's context (ranks, groups, device, status file, records) and the timing
loops every benchmark shares (calibration/harness/worker.py runs them)."""
from __future__ import annotations

import json
import math
import os
import socket
import time

import torch
import torch.distributed as dist

from calibration.harness.plan import Plan, stats


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


def local_times(ctx: Ctx, fn, reps: int | None = None, warmup: int | None = None) -> tuple[list[float], int]:
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


def timed_everywhere(ctx: Ctx, fn, reps: int | None = None) -> tuple[dict, int]:
    """All ranks time fn concurrently; per repetition the max over ranks."""
    ctx.at_sync()
    dist.barrier()
    times, inner = local_times(ctx, fn, reps)
    return stats(ctx.gather_max(times)), inner
