"""The simpy engine: runs a Schedule on one representative data-parallel rank.

Data-parallel ranks are symmetric, so one rank is simulated and its collectives are
costed for the whole group; 1024 GPUs cost what 8 do. Streams are FIFO processes. Time
that competes for a resource is "work" served by a fluid (processor-sharing) model. A job
crosses one or more links (NVLink tier, IB rails, the GPU's PCIe link per direction, the
PCIe switch uplink per direction, NVMe); while jobs overlap, each progresses at the
smallest share it gets on any link it crosses (1/jobs on that link), and the compute stream
slows by the profile's interference factor while an NCCL transfer is active.
Fixed latencies (alpha, launch overheads) are not shared. Memory effects of every op go to
the ledger in simulated time.
"""
from __future__ import annotations

from dataclasses import dataclass

import simpy

from zsim.engine.ledger import Ledger
from zsim.hardware.cost_model import COMM_LINKS, COMPUTE, CostModel
from zsim.schedule.ir import STREAMS, Op, Schedule, Stream, Tag

_EPS_S = 1e-15


@dataclass(frozen=True)
class OpTiming:
    op_id: int
    start_s: float
    end_s: float
    exposed_s: float = 0.0


@dataclass(frozen=True)
class Trace:
    schedule: Schedule
    timings: tuple[OpTiming, ...]
    ledger_events: tuple[tuple[float, float, str, Tag], ...]   # (time_s, delta_bytes, category, tag)
    step_time_s: float
    events_processed: int


class _Job:
    __slots__ = ("remaining_s", "rate", "event", "links")

    def __init__(self, remaining_s: float, event: simpy.Event, links: tuple[str, ...]):
        self.remaining_s, self.rate, self.event, self.links = remaining_s, 1.0, event, links


class _Fluid:
    """Processor sharing over all resource-bound work in flight. Driven by timer callbacks
    rather than a process: each change of the job set reschedules one timer for the next
    completion, and timers made stale by a later change are ignored (cheaper than waiting on
    a condition of two events)."""

    def __init__(self, env: simpy.Environment, compute_slowdown: float):
        self.env = env
        self.slowdown = compute_slowdown
        self.jobs: dict[int, _Job] = {}
        self.next_id = 0
        self.last_s = 0.0
        self.version = 0

    def submit(self, links: tuple[str, ...], work_s: float) -> simpy.Event:
        ev = self.env.event()
        if work_s <= 0:
            ev.succeed()
            return ev
        self._advance()
        self.jobs[self.next_id] = _Job(work_s, ev, links)
        self.next_id += 1
        self._rerate()
        self._reschedule()
        return ev

    def _advance(self):
        dt = self.env.now - self.last_s
        if dt > 0:
            for job in self.jobs.values():
                job.remaining_s -= dt * job.rate
        self.last_s = self.env.now

    def _rerate(self):
        count: dict[str, int] = {}
        for job in self.jobs.values():
            for link in job.links:
                count[link] = count.get(link, 0) + 1
        # NCCL kernels occupy SMs; copy engines (PCIe), NVMe and the host do not slow the GPU
        comm_active = any(count.get(link) for link in COMM_LINKS)
        for job in self.jobs.values():
            if job.links == COMPUTE:
                job.rate = 1.0 / (1.0 + self.slowdown) if comm_active else 1.0
            else:
                job.rate = 1.0 / max(count[link] for link in job.links)

    def _reschedule(self):
        self.version += 1
        if not self.jobs:
            return
        dt = min(j.remaining_s / j.rate for j in self.jobs.values())
        version = self.version
        timer = self.env.timeout(max(dt, 0.0))
        timer.callbacks.append(lambda _ev: self._fire(version))

    def _fire(self, version: int):
        if version != self.version:
            return
        self._advance()
        limit = _EPS_S * max(1.0, self.env.now)
        done = [k for k, j in self.jobs.items() if j.remaining_s <= limit]
        for k in done:
            self.jobs.pop(k).event.succeed()
        self._rerate()
        self._reschedule()


def simulate(schedule: Schedule, cluster, precision: str) -> Trace:
    cost = CostModel(cluster, precision, schedule.stage, schedule.host)
    env = simpy.Environment()
    fluid = _Fluid(env, cost.compute_slowdown)
    ledger = Ledger()
    for a in schedule.static:
        ledger.alloc(0.0, a)
    done = [env.event() for _ in schedule.ops]
    timings: list[OpTiming | None] = [None] * len(schedule.ops)
    by_stream: dict[Stream, list[Op]] = {s: [] for s in STREAMS}
    # a device without concurrent streams (a CPU rank) runs every op in program order
    serial = not cluster.profile.gpu.concurrent_streams
    for op in schedule.ops:
        by_stream[Stream.COMPUTE if serial else op.stream].append(op)

    def run_stream(ops: list[Op]):
        for op in ops:
            for d in op.deps:
                if not done[d].processed:
                    yield done[d]
            start = env.now
            for a in op.alloc:
                ledger.alloc(start, a)
            c = cost.op_cost(op)
            if c.fixed_s > 0:
                yield env.timeout(c.fixed_s)
            if c.work_s > 0 or c.links != COMPUTE:
                yield fluid.submit(c.links, c.work_s)
            for tag in op.free:
                ledger.free(env.now, tag)
            timings[op.id] = OpTiming(op.id, start, env.now)
            done[op.id].succeed()

    for stream in STREAMS:
        if by_stream[stream]:
            env.process(run_stream(by_stream[stream]))
    env.run()
    missing = [op.name for op, t in zip(schedule.ops, timings) if t is None]
    if missing:
        raise RuntimeError(f"schedule deadlock: {len(missing)} ops never ran, first {missing[0]!r}")
    ledger.close(schedule.static)
    step = max((t.end_s for t in timings), default=0.0)
    return Trace(schedule, tuple(timings), ledger.events(), step, len(schedule.ops))
