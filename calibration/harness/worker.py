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
import json
import math
import os
import platform
import signal
import socket
import sys
import time

import torch
import torch.distributed as dist

from calibration.harness.bench_comm import bench_collective, bench_collective_memory, bench_interference
from calibration.harness.bench_compute import (bench_attention, bench_decode_gemms, bench_gemms, bench_layer, bench_membound,
                                               bench_overhead)
from calibration.harness.bench_host import bench_adam, bench_fresh_alloc, bench_io, bench_memcpy
from calibration.harness.bench_zero import (bench_grad_accumulate, bench_optimizer_step, bench_rank_views,
                                            bench_zero3_hooks)
from calibration.harness.context import Ctx
from calibration.harness.plan import Plan, default_plan, estimated_cost, items


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
        # the profile's hbm_capacity_GiB (fit.py): what the device has, not a share of host RAM
        prov["gpu_memory_GiB"] = f"{torch.cuda.get_device_properties(ctx.device).total_memory / 2**30:.1f}"
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
                "adam": bench_adam, "optimizer_step": bench_optimizer_step, "grad_accumulate": bench_grad_accumulate,
                "zero3_hooks": bench_zero3_hooks,
                "rank_views": bench_rank_views, "collective_memory": bench_collective_memory,
                "io": bench_io, "interference": bench_interference}
_LAYER_BENCHES = {"gemm": bench_gemms, "gemm_decode": bench_decode_gemms, "attention": bench_attention, "membound": bench_membound,
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
