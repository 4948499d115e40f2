"""Run a scenario on the real sharded core (or DeepSpeed / FSDP2) under torchrun and write
the measurements as JSON (rank 0). Launched by `zsim validate`; usable directly:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 -m calibration.core.run \
        --scenario S.yaml --engine own --steps 8 --warmup 2 --out measured.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", required=True)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--engine", default="own", choices=["own", "deepspeed", "fsdp"])
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps after warm-up")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", required=True)
    p.add_argument("--trace", default=None, help="Chrome trace of the last timed step (rank 0)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory-tracked step")
    p.add_argument("--profile-step", default=None, metavar="PATH",
                   help="DeepSpeed / FSDP peers: profile the optimizer-step phase of two more steps "
                        "(torch.profiler, then cProfile) and write the tables to PATH (rank 0)")
    return p.parse_args(argv)


def chrome_trace(times, name: str, rank: int) -> dict:
    """Same shape as zsim/report/writers.py chrome_trace: one thread per stream, op names as
    the simulator's, times in microseconds."""
    from zsim.schedule.ir import STREAMS

    tids = {s: i + 1 for i, s in enumerate(STREAMS)}
    ev = [{"ph": "M", "pid": 2, "tid": 0, "name": "process_name", "args": {"name": f"measured: {name} (rank {rank})"}}]
    for s in sorted({t[1] for t in times}, key=lambda s: tids[s]):
        ev.append({"ph": "M", "pid": 2, "tid": tids[s], "name": "thread_name", "args": {"name": f"{s} stream"}})
    for name_, stream, phase, micro, start, dur in times:
        ev.append({"ph": "X", "pid": 2, "tid": tids[stream], "name": name_, "cat": phase,
                   "ts": round(start * 1e6, 3), "dur": round(dur * 1e6, 3),
                   "args": {"phase": phase, "micro_step": micro}})
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def rank_threads(engine: str, cuda: bool, env) -> int | None:
    """The intra-op threads a rank sets, or None to keep what its launcher gave it. CPU ranks share
    the machine's cores: one thread each unless OMP_NUM_THREADS says otherwise. A DeepSpeed/FSDP
    rank on a GPU keeps its launcher's (torchrun: OMP_NUM_THREADS unset for one process per node,
    1 for several; DeepSpeed's launcher: unset unless --bind_cores_to_rank), as a user's run does:
    DeepSpeedCPUAdam's OpenMP loop and an offloaded step's host passes run on them. Forcing one
    thread there made a one-GPU ZeRO-2 offload step 4.2 s instead of 0.90 s (docs/validation.md,
    "One GPU")."""
    if engine != "own" and cuda:
        return None
    return int(env.get("OMP_NUM_THREADS", "1"))


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    import torch.distributed as dist

    from calibration.core.peers import on_cuda

    threads = rank_threads(args.engine, on_cuda(), os.environ)
    if threads is not None:
        torch.set_num_threads(threads)
    from zsim.config.scenario import load_scenario

    sc = load_scenario(args.scenario, tuple(args.set))
    if args.profile_step and (args.engine == "own" or sc.pipeline_stages > 1):
        raise SystemExit("--profile-step: profiles a DeepSpeed or FSDP run without pipeline stages "
                         "(give --engine deepspeed or fsdp)")
    if args.engine == "deepspeed" and sc.pipeline_stages > 1:
        from calibration.core import ds_pipe
        return ds_pipe.main(args, sc)
    if args.engine != "own":
        from calibration.core import peers
        return peers.main(args, sc)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from calibration.core.comm import Comm
    from calibration.core.engine import ZeroCore
    from calibration.core.measured import exit_without_teardown, write_measurement
    from calibration.core.memory import TensorMemoryTracker, model_state_bytes
    from calibration.core.plan import build_plan

    if world != sc.cluster.world_size:
        raise SystemExit(f"scenario world size {sc.cluster.world_size} != torchrun world {world}")
    if sc.pipeline_stages > 1:
        from calibration.core.pipe import PipeCore
        core = PipeCore(sc, rank, world, seed=args.seed)
        comm = core.comm
    else:
        comm = Comm()
        core = ZeroCore(sc, build_plan(sc), rank, world, comm, seed=args.seed)
    losses, step_times, phase_times = [], [], {}
    step = 0
    for _ in range(args.warmup):
        losses += core.train_step(step)
        step += 1
    for i in range(args.steps):
        last = i == args.steps - 1
        if last:
            comm.log = []
        dist.barrier()
        t0 = time.perf_counter()
        losses += core.train_step(step, record=True)
        step_times.append(time.perf_counter() - t0)
        per = {}
        for name, stream, phase, micro, start, dur in core.times:
            per[phase] = per.get(phase, 0.0) + dur
        for k, v in per.items():
            phase_times.setdefault(k, []).append(v)
        step += 1
    collectives = comm.log or []
    comm.log = None
    trace_times = core.times
    peak = 0
    if not args.no_memory:
        dist.barrier()
        tr = TensorMemoryTracker().start()
        with tr:
            losses += core.train_step(step)
        peak = tr.peak
        step += 1
    write_measurement(args.out, "own", sc, args, step_times, phase_times, peak, collectives, losses,
                      model_state_bytes(core))
    if rank == 0 and args.trace:
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(trace_times, sc.name, rank), f)
    dist.barrier()
    exit_without_teardown()


if __name__ == "__main__":
    sys.exit(main())
