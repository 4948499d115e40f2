"""The simpy engine: runs a Schedule on one representative data-parallel rank.

Data-parallel ranks are symmetric, so one rank is simulated and its collectives are
costed for the whole group; 1024 GPUs cost what 8 do. Streams are FIFO: each is a state machine
driven by the clock's callbacks (fluid.py Clock: simpy's environment plus a FIFO of what is due
now). Time that competes for a resource is "work" served by a fluid (processor-sharing) model
(fluid.py Fluid); fixed latencies (alpha, launch overheads) are not shared. Memory effects of
every op go to the ledger in simulated time.

A pipeline (schedule.pipeline) runs one representative rank per stage in the same simulation:
each stage has its own streams, its own copy of every link (placement.stage_links) and its own
memory ledger; stages meet only in the point-to-point transfers and the tied-weight
all-reduce, so warm-up, the steady 1F1B phase, cool-down and the bubble come out of the run.

A step whose micro-steps repeat is simulated once per distinct micro-step (steady.py), a
pipeline's a few 1F1B periods past its warm-up: the trace then carries a `Repeat` saying which
time window stands for how many copies of itself.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, cast

from zsim.engine.fluid import Clock, Fluid
from zsim.engine.ledger import Ledger, peak_and_breakdown
from zsim.engine.pass_replay import Block, PassReplay, Recording, ReplayConflict
from zsim.engine.repeat import Repeat
from zsim.hardware.cost_model import COMPUTE, CostModel
from zsim.schedule.ir import Group, Op, Schedule, Stream, STREAMS, Tag


class OpTiming(NamedTuple):
    op_id: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Trace:
    schedule: Schedule
    timings: tuple[OpTiming, ...]
    ledger_events: tuple[tuple[float, float, str, Tag], ...]   # (time_s, delta_bytes, category, tag)
    step_time_s: float
    events_processed: int              # ops of the full step
    repeat: Repeat | None = None    # None: every op of the step was simulated (see zsim/engine/repeat.py)
    # a pipeline: each stage's ledger events; ledger_events is the stage with the highest peak
    stage_ledger_events: tuple[tuple[tuple[float, float, str, Tag], ...], ...] = ()
    worst_stage: int = 0
    stage_peaks_bytes: tuple[float, ...] = ()     # a pipeline: each stage's peak (of its ledger_events)


@contextmanager
def collector_paused():
    """Building and simulating a step allocates some 100k small objects and frees them as it
    goes, and the result is summarized from a trace that holds most of them: the cyclic
    collector's passes over them cost 10-20% of the step, and its first pass once re-enabled
    (over everything allocated meanwhile) as much again. The few cycles are collected after,
    when a caller that drops the trace has let most of the objects go: the objects still alive
    on the way out are frozen (gc.freeze) so that re-enabling the collector does not walk them,
    and unfrozen into the oldest generation on the next entry, where a full collection still
    finds any cycle among them (nothing is exempt from collection for longer than one step)."""
    enabled = gc.isenabled()
    gc.disable()
    gc.unfreeze()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.enable()


class _Done:
    """The end of an op that others wait for: the streams waiting, or None once it is signalled."""
    __slots__ = ("waiters",)

    def __init__(self):
        self.waiters: list | None = []

    def signal(self, _event=None):
        waiters, self.waiters = self.waiters, None
        for resume in waiters:
            resume(None)


class _StreamRun:
    """One stream of one stage: its ops in FIFO order, each waiting for its deps, then its
    fixed time, then its work. A state machine driven by callbacks (rather than a simpy process:
    the same instants in the same order, without a generator and its events)."""
    __slots__ = ("ops", "i", "waited", "start_s", "cost", "ledger", "engine")

    def __init__(self, ops: list[Op], ledger: Ledger, engine: "_Engine"):
        self.ops, self.ledger, self.engine = ops, ledger, engine
        self.i, self.waited, self.start_s, self.cost = 0, 0, 0.0, None

    def run(self, _event=None):
        """Run ops until one has to wait; `waited` says how far the current op got (0: its deps,
        1: its fixed time, 2: its work)."""
        eng = self.engine
        ops, done, clock = self.ops, eng.done, eng.clock
        env = clock.env
        ledger = self.ledger
        replayed, firsts = eng.replayed, eng.firsts
        while self.i < len(ops):
            op = ops[self.i]
            if self.waited == 0:
                if replayed[op.id]:     # its pass was replayed (see [Note: pipeline pass replay])
                    self.i += 1
                    continue
                for d in op.deps:
                    waiters = done[d].waiters
                    if waiters is not None:     # not signalled yet
                        waiters.append(self.run)
                        return
                if firsts and op.id in firsts and eng.passes.begin(firsts[op.id], self):
                    return                      # a timer stands for the pass
                self.start_s = start = env.now
                for tag in op.free_before:
                    ledger.free(start, tag)
                for a in op.alloc:
                    ledger.alloc(start, a)
                self.cost = c = eng.op_cost(op)
                if eng.active:
                    eng.passes.watch_start(op, c, start)
                self.waited = 1
                if c.fixed_s > 0:
                    if c.work_s > 0 and eng.fluid.is_compute(c.links):
                        # its fixed time, then its work, as one job (Fluid.submit's delay_s)
                        self.waited = 2
                        eng.fluid.submit(c.links, c.work_s, self.run, c.fixed_s)
                        return
                    clock.after(c.fixed_s, self.run)
                    return
            if self.waited == 1:
                c = self.cost
                if c.work_s > 0 or c.links != COMPUTE:
                    if eng.active:
                        eng.passes.watch_work(op, c.links)
                    self.waited = 2
                    eng.fluid.submit(c.links, c.work_s, self.run)
                    return
            end = env.now
            for tag in op.free:
                ledger.free(end, tag)
            eng.timings[op.id] = OpTiming(op.id, self.start_s, end)
            if eng.active:
                eng.passes.watch_end(op, end)
            d = done[op.id]
            if d is not None:
                clock.soon(d.signal)
            self.waited = 0
            self.i += 1


class _Engine:
    """What the streams share: the clock, the processor-sharing model, the cost model, the
    ends of the ops others wait for and every op's timing; and, for a 1F1B pipeline, the
    observer that records and replays its passes (pass_replay.PassReplay)."""

    def __init__(self, schedule: Schedule, cluster, precision: str, replay: bool):
        cost = CostModel(cluster, precision, schedule.zero_stage, schedule.host, schedule.pipeline, schedule.tensor,
                         schedule.tf32)
        self.clock = Clock()
        self.fluid = Fluid(self.clock, cost.compute_slowdown)
        self.op_cost = cost.op_cost
        n = len(schedule.ops)
        self.timings: list[OpTiming | None] = [None] * n
        # only an op that another op waits for signals its end (a signal nobody waits for would
        # only be another pass of the loop)
        awaited = {d for op in schedule.ops for d in op.deps}
        self.done = [_Done() if i in awaited else None for i in range(n)]
        self.replayed = [False] * n      # ops whose pass was replayed: their streams skip them
        self.stage_runs: dict[int, list[_StreamRun]] = {}
        self.passes = PassReplay(self, schedule, cluster, OpTiming) if replay else None
        # the streams' quick checks: a pass's first op, and a pass being recorded or replayed
        self.firsts: dict[int, Block] = self.passes.firsts if self.passes else {}
        self.active: dict[int, Recording] = self.passes.active if self.passes else {}


def run_ops(schedule: Schedule, cluster, precision: str) -> tuple[list[OpTiming], list[Ledger]]:
    """Simulate every op of `schedule`: their timings and, per pipeline stage, the ledger of
    their memory effects. A 1F1B pipeline's passes are replayed once recorded (see [Note:
    pipeline pass replay]); should a replayed pass turn out not to be isolated, the step is
    simulated again without replay."""
    replay = schedule.pipeline is not None and schedule.pipeline.virtual_stages == 1
    if replay:
        try:
            return _run_ops(schedule, cluster, precision, True)
        except ReplayConflict:
            pass
    return _run_ops(schedule, cluster, precision, False)


# [Note: one NCCL stream per process group]
# torch's ProcessGroupNCCL runs every collective of a process group on that group's one
# internal NCCL stream per device (ProcessGroupNCCL.cpp: getNCCLComm creates ncclStreams_[key]
# once; collective() makes it wait for the caller's current stream and enqueues there), so
# calls over one group run one after the other in the order the host issued them, whatever
# CUDA stream the framework launched them from. DeepSpeed ZeRO-3 issues its parameter
# all-gathers from the allgather stream (partitioned_param_coordinator.py __allgather_stream)
# and its gradient reduce-scatters from reduce_and_partition_stream (stage3.py), both over the
# data-parallel group (ds_process_group / dp_process_group: the same group object), and FSDP
# its all-gathers and reduce-scatters over its one process group: a prefetch issued while a
# gradient bucket is being reduced waits for it, and their bandwidths never add. The engine
# runs the data-parallel group's calls from both streams in one queue, in program order (the
# ops' ids: the order the hooks issue them); the trace keeps each op's own stream. Calls over
# other groups (expert-data, tensor, pipe) have their own communicators and queues. Measured
# against the dev set (benchmarks/deepcompile_dev.py: Llama-3-70B ZeRO-3 on 32 H100): the
# predictions with the two streams concurrent were 9-42% optimistic, worst with few tokens
# per GPU, where the backward's prefetches sat beside the reduce-scatters.
def nccl_queue(op: Op) -> Stream:
    """The stream an op waits its turn on: a data-parallel collective from the reduce stream
    queues with the all-gathers (see [Note: one NCCL stream per process group])."""
    if op.stream is Stream.REDUCE:
        comm = getattr(op.payload, "comm", None)
        if comm is not None and (comm.group is None or comm.group.kind is Group.DATA):
            return Stream.ALLGATHER
    return op.stream


def _run_ops(schedule: Schedule, cluster, precision: str, replay: bool) -> tuple[list[OpTiming], list[Ledger]]:
    eng = _Engine(schedule, cluster, precision, replay)
    ledgers = [Ledger() for _ in range(schedule.stages)]
    for stage, ledger in enumerate(ledgers):
        for a in schedule.static_of(stage):
            ledger.alloc(0.0, a)
    by_stream: dict[tuple[int, Stream], list[Op]] = {}
    # a device without concurrent streams (a CPU rank) runs every op in program order
    serial = not cluster.profile.gpu.concurrent_streams
    for op in schedule.ops:
        by_stream.setdefault((op.pipe_stage, Stream.COMPUTE if serial else nccl_queue(op)), []).append(op)
    # every stream starts at time 0, in this order, before any other event is processed
    for stage in range(schedule.stages):
        for stream in STREAMS:
            if by_stream.get((stage, stream)):
                eng.stage_runs.setdefault(stage, []).append(_StreamRun(by_stream[(stage, stream)], ledgers[stage], eng))
    for stage in range(schedule.stages):
        for run in eng.stage_runs.get(stage, ()):
            run.run()
    eng.clock.run()
    timings = eng.timings
    missing = [op.name for op, t in zip(schedule.ops, timings) if t is None]
    if missing:
        raise RuntimeError(f"schedule deadlock: {len(missing)} ops never ran, first {missing[0]!r}")
    for stage, ledger in enumerate(ledgers):
        ledger.close(schedule.static_of(stage))
    return cast("list[OpTiming]", timings), ledgers    # every op ran (checked above)


def stage_peaks(per_stage) -> tuple[tuple[float, ...], int]:
    """Each pipeline stage's peak and the stage with the highest: it decides whether the run fits."""
    peaks = tuple(peak_and_breakdown(events)[0] for events in per_stage)
    return peaks, max(range(len(peaks)), key=peaks.__getitem__)


def simulate(schedule: Schedule, cluster, precision: str) -> Trace:
    timings, ledgers = run_ops(schedule, cluster, precision)
    step = max((t.end_s for t in timings), default=0.0)
    if schedule.pipeline is None:
        return Trace(schedule, tuple(timings), ledgers[0].events(), step, len(schedule.ops))
    per_stage = tuple(ledger.events() for ledger in ledgers)
    peaks, worst = stage_peaks(per_stage)
    return Trace(schedule, tuple(timings), per_stage[worst], step, len(schedule.ops),
                 stage_ledger_events=per_stage, worst_stage=worst, stage_peaks_bytes=peaks)
