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

A pipeline (schedule.pipeline) runs one representative rank per stage in the same simulation:
each stage has its own streams, its own copy of every link (placement.stage_links) and its own
memory ledger; stages meet only in the point-to-point transfers and the tied-weight
all-reduce, so warm-up, the steady 1F1B phase, cool-down and the bubble come out of the run.

A step whose micro-steps repeat is simulated once per distinct micro-step (steady.py), a
pipeline's a few 1F1B periods past its warm-up: the trace then carries a `Repeat` saying which
time window stands for how many copies of itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import simpy
from simpy.events import Event

from zsim.engine.ledger import Ledger, peak_and_breakdown, timeline
from zsim.hardware.cost_model import COMM_LINKS, COMPUTE, CostModel
from zsim.hardware.placement import base_link, link_rank
from zsim.schedule.ir import Op, Schedule, Stream, STREAMS, Tag

if TYPE_CHECKING:   # layer_repeat.py builds on this module
    from zsim.engine.layer_repeat import LayeredRepeat, LayerRepeat

_EPS_S = 1e-15


class OpTiming(NamedTuple):
    op_id: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Repeat:
    """The simulated steady state: the ops that start in the time window [start_s, end_s) (a
    data-parallel run: the ops of micro-step `micro`; a pipeline: one 1F1B period of every
    stage, opened by stage 0's forward of micro-step `micro`, of a group of `micro_steps`
    micro-steps under the interleaved schedule) stand for `copies` identical
    windows, one `period_s` apart. Times in the trace are those simulated; `shift_s` maps them
    to the full step's clock."""
    micro: int
    copies: int
    period_s: float
    start_s: float
    end_s: float
    ops: frozenset[int]          # ids of the simulated ops that stand for `copies` ops each
    pipeline: bool = False
    micro_steps: int = 1         # micro-steps per window (Megatron's interleaved schedule: a group of `pipeline`)

    @property
    def skipped_s(self) -> float:
        """Simulated time the copies not simulated take."""
        return (self.copies - 1) * self.period_s

    @property
    def name(self) -> str:
        if self.micro_steps > 1:
            return f"interleaved 1F1B period ({self.micro_steps} micro-steps) from micro-step {self.micro}"
        return f"1F1B period from micro-step {self.micro}" if self.pipeline else f"micro-step {self.micro}"

    def shift_s(self, time_s: float) -> float:
        """A simulated instant on the full step's clock: after the window, later by the skipped copies."""
        return time_s + self.skipped_s if time_s >= self.end_s else time_s

    def weight(self, op: Op) -> int:
        """How many ops of the full step this simulated op stands for."""
        return self.copies if op.id in self.ops else 1

    # what summarize and the trace writer ask of a repeat (layer_repeat.LayerRepeat answers the same)
    def segments(self) -> tuple[tuple[float, float, int], ...]:
        """(start_s, end_s, copies): the simulated time split so that each piece stands for
        `copies` pieces of the full step (a measure over the step is their weighted sum)."""
        return ((float("-inf"), self.start_s, 1), (self.start_s, self.end_s, self.copies), (self.end_s, float("inf"), 1))

    def peak_and_breakdown(self, events) -> tuple[float, float, dict[str, float]]:
        """The full step's peak: the window leaves every category as it found it, so its copies
        peak where it does."""
        peak, peak_t, breakdown = peak_and_breakdown(events)
        return peak, self.shift_s(peak_t), breakdown

    def timeline(self, events) -> list[tuple[float, float]]:
        return [(self.shift_s(t), used) for t, used in timeline(events)]

    def marks(self, op: Op) -> dict:
        return {"repeated_micro_steps": self.copies} if op.id in self.ops else {}

    def spans(self) -> tuple[tuple[str, float, float, float, int], ...]:
        """(what, start_s and length_s on the full step's clock, period_s, copies) of the copies not simulated."""
        return ((self.name, self.end_s, self.skipped_s, self.period_s, self.copies),)

    def step_ops(self, simulated_ops: int) -> int:
        """Ops of the full step, from those of the shortened step."""
        return simulated_ops + (self.copies - 1) * len(self.ops)


@dataclass(frozen=True)
class Trace:
    schedule: Schedule
    timings: tuple[OpTiming, ...]
    ledger_events: tuple[tuple[float, float, str, Tag], ...]   # (time_s, delta_bytes, category, tag)
    step_time_s: float
    events_processed: int              # ops of the full step
    repeat: Repeat | LayerRepeat | LayeredRepeat | None = None    # None: every op of the step was simulated
    # a pipeline: each stage's ledger events; ledger_events is the stage with the highest peak
    stage_ledger_events: tuple[tuple[tuple[float, float, str, Tag], ...], ...] = ()
    worst_stage: int = 0


def _link_facts(links: tuple[str, ...]) -> tuple[bool, int, tuple[int, ...]]:
    """(compute job?, its rank, the ranks whose SMs an NCCL kernel of it occupies)."""
    compute = len(links) == 1 and base_link(links[0]) == "compute"
    return compute, link_rank(links[0]), tuple(sorted({link_rank(x) for x in links if base_link(x) in COMM_LINKS}))


class _Job:
    __slots__ = ("remaining_s", "rate", "event", "links", "compute", "nccl", "rank")

    def __init__(self, remaining_s: float, event: Event, links: tuple[str, ...], facts):
        self.remaining_s, self.rate, self.event, self.links = remaining_s, 1.0, event, links
        self.compute, self.rank, self.nccl = facts


class _Fluid:
    """Processor sharing over all resource-bound work in flight. Driven by timer callbacks
    rather than a process: each change of the job set reschedules one timer for the next
    completion, and timers made stale by a later change are ignored (cheaper than waiting on
    a condition of two events). Jobs per link are counted as jobs come and go."""

    def __init__(self, env: simpy.Environment, compute_slowdown: float):
        self.env = env
        self.compute_rate = 1.0 / (1.0 + compute_slowdown)
        self.jobs: list[_Job] = []
        self.count: dict[str, int] = {}
        self.nccl_jobs: dict[int, int] = {}     # per rank (pipeline stage)
        self.last_s = 0.0
        self.version = 0
        self.facts: dict[tuple[str, ...], tuple] = {}

    def submit(self, links: tuple[str, ...], work_s: float) -> Event:
        ev = Event(self.env)
        if work_s <= 0:
            ev.succeed()
            return ev
        self._advance()
        facts = self.facts.get(links)
        if facts is None:
            facts = self.facts[links] = _link_facts(links)
        job = _Job(work_s, ev, links, facts)
        self.jobs.append(job)
        for rank in job.nccl:
            self.nccl_jobs[rank] = self.nccl_jobs.get(rank, 0) + 1
        count = self.count
        for link in links:
            count[link] = count.get(link, 0) + 1
        self._rerate()
        return ev

    def _advance(self):
        now = self.env.now
        dt = now - self.last_s
        if dt > 0:
            for job in self.jobs:
                job.remaining_s -= dt * job.rate
        self.last_s = now

    def _rerate(self):
        """New shares for the current job set, then one timer for the next completion."""
        count = self.count
        # NCCL kernels occupy SMs; copy engines (PCIe), NVMe and the host do not slow the GPU
        nccl = self.nccl_jobs
        dt = float("inf")
        for job in self.jobs:
            if job.compute:
                job.rate = self.compute_rate if nccl.get(job.rank) else 1.0
            else:
                links = job.links
                sharers = count[links[0]] if len(links) == 1 else max(count[link] for link in links)
                job.rate = 1.0 / sharers
            t = job.remaining_s / job.rate
            if t < dt:
                dt = t
        self.version += 1
        if self.jobs:
            version = self.version
            timer = self.env.timeout(dt if dt > 0 else 0.0)
            timer.callbacks.append(lambda _ev: self._fire(version))

    def _fire(self, version: int):
        if version != self.version:
            return
        self._advance()
        limit = _EPS_S * max(1.0, self.env.now)
        keep = []
        for job in self.jobs:
            if job.remaining_s <= limit:
                for link in job.links:
                    self.count[link] -= 1
                for rank in job.nccl:
                    self.nccl_jobs[rank] -= 1
                job.event.succeed()
            else:
                keep.append(job)
        self.jobs = keep
        self._rerate()


def run_ops(schedule: Schedule, cluster, precision: str) -> tuple[list[OpTiming], list[Ledger]]:
    """Simulate every op of `schedule`: their timings and, per pipeline stage, the ledger of
    their memory effects."""
    cost = CostModel(cluster, precision, schedule.stage, schedule.host, schedule.pipeline, schedule.tensor)
    env = simpy.Environment()
    fluid = _Fluid(env, cost.compute_slowdown)
    ledgers = [Ledger() for _ in range(schedule.stages)]
    for stage, ledger in enumerate(ledgers):
        for a in schedule.static_of(stage):
            ledger.alloc(0.0, a)
    timings: list[OpTiming | None] = [None] * len(schedule.ops)
    by_stream: dict[tuple[int, Stream], list[Op]] = {}
    # a device without concurrent streams (a CPU rank) runs every op in program order
    serial = not cluster.profile.gpu.concurrent_streams
    for op in schedule.ops:
        by_stream.setdefault((op.stage, Stream.COMPUTE if serial else op.stream), []).append(op)
    # only an op that another op waits for needs an event to signal its end (an event nobody
    # waits for would only be another pass of simpy's loop)
    awaited = {d for op in schedule.ops for d in op.deps}
    done = [Event(env) if i in awaited else None for i in range(len(schedule.ops))]
    op_cost, timeout, submit = cost.op_cost, env.timeout, fluid.submit

    def run_stream(ops: list[Op], ledger: Ledger):
        alloc, free = ledger.alloc, ledger.free
        for op in ops:
            for d in op.deps:
                if not done[d].processed:
                    yield done[d]
            start = env.now
            for tag in op.free_before:
                free(start, tag)
            for a in op.alloc:
                alloc(start, a)
            c = op_cost(op)
            if c.fixed_s > 0:
                yield timeout(c.fixed_s)
            if c.work_s > 0 or c.links != COMPUTE:
                yield submit(c.links, c.work_s)
            end = env.now
            for tag in op.free:
                free(end, tag)
            timings[op.id] = OpTiming(op.id, start, end)
            if done[op.id] is not None:
                done[op.id].succeed()

    for stage in range(schedule.stages):
        for stream in STREAMS:
            if by_stream.get((stage, stream)):
                env.process(run_stream(by_stream[(stage, stream)], ledgers[stage]))
    env.run()
    missing = [op.name for op, t in zip(schedule.ops, timings) if t is None]
    if missing:
        raise RuntimeError(f"schedule deadlock: {len(missing)} ops never ran, first {missing[0]!r}")
    for stage, ledger in enumerate(ledgers):
        ledger.close(schedule.static_of(stage))
    return timings, ledgers


def worst_stage(per_stage) -> int:
    """The pipeline stage with the highest peak: it decides whether the run fits."""
    return max(range(len(per_stage)), key=lambda s: peak_and_breakdown(per_stage[s])[0])


def simulate(schedule: Schedule, cluster, precision: str) -> Trace:
    timings, ledgers = run_ops(schedule, cluster, precision)
    step = max((t.end_s for t in timings), default=0.0)
    if schedule.pipeline is None:
        return Trace(schedule, tuple(timings), ledgers[0].events(), step, len(schedule.ops))
    per_stage = tuple(ledger.events() for ledger in ledgers)
    worst = worst_stage(per_stage)
    return Trace(schedule, tuple(timings), per_stage[worst], step, len(schedule.ops),
                 stage_ledger_events=per_stage, worst_stage=worst)
