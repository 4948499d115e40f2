"""Steady state reused, exactly: a step of GAS micro-steps simulated as five (or six).

Micro-steps between the first and the last of an accumulation window are the same ops
(DeepSpeed runs the same hooks, gathers and reductions every micro-step; only the first
and the boundary micro-step differ). The step is built with five micro-steps (six when the
middle ones take longer to settle): the first, the middle ones, the boundary one. When the
last middle micro-step runs exactly as the one before did, one period later (every op
starts and ends one period later, nothing of the earlier micro-steps is still running, and
the window leaves every memory category as it found it), the time window it opens repeats
for every middle micro-step of the full step: the engine is deterministic and
shift-invariant, so the same state at the start of a window gives the same window. The
trace then stands for the full step through a `Repeat`; anything else falls back to
simulating every micro-step.
tests/test_steady.py checks both paths agree for every stage, offload and checkpointing
variant.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager

from zsim.engine.sim import Repeat, Trace, run_ops, simulate
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Schedule
from zsim.specs.scenario import Scenario
from zsim.workload.module import Workload

# the first, three middle micro-steps (the first middle one may still be settling from the first
# micro-step: a reduction of its shape runs into it), the boundary one; one more when that is not enough
SIMULATED_MICRO_STEPS = (5, 6)
# two periods agree when every op's start and end agree to this fraction of the step
_REL_TOL = 1e-12


@contextmanager
def _collector_paused():
    """Building and simulating a step allocates some 100k small objects and frees them as it
    goes; the cyclic collector's passes over them cost 10-20% of the step. The few cycles
    (simpy processes and their events) are collected after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate_scenario(sc: Scenario, steady: bool = True) -> tuple[Workload, Trace]:
    """Build and simulate the step of `sc`; `steady=False` simulates every micro-step."""
    with _collector_paused():
        return _simulate(sc, steady)


def _simulate(sc: Scenario, steady: bool) -> tuple[Workload, Trace]:
    gas = sc.gradient_accumulation_steps
    # a pipeline's micro-steps are not alike (warm-up, steady 1F1B, cool-down): simulated in full
    steady = steady and sc.pipeline_stages == 1
    wl = None
    spent = 0   # micro-steps simulated in attempts: never more than the full step's
    for micro_steps in SIMULATED_MICRO_STEPS if steady else ():
        spent += micro_steps
        if gas <= micro_steps or spent > gas:
            break
        wl, reduced = build_schedule(sc, wl, micro_steps=micro_steps)
        timings, ledgers = run_ops(reduced, sc.cluster, sc.precision)
        events = ledgers[0].events()
        repeat = find_repeat(reduced, timings, events, micro_steps, copies=gas - micro_steps + 1)
        if repeat is not None:
            end = max(t.end_s for t in timings)
            ops = len(reduced.ops) + (repeat.copies - 1) * repeat.ops_per_micro
            return wl, Trace(reduced, tuple(timings), events, repeat.shift_s(end), ops, repeat)
    wl, schedule = build_schedule(sc, wl)
    return wl, simulate(schedule, sc.cluster, sc.precision)


def find_repeat(schedule: Schedule, timings, events, micro_steps: int, copies: int) -> Repeat | None:
    """The Repeat of a simulation of `micro_steps` micro-steps (its last middle one repeated),
    or None when its last two middle micro-steps differ."""
    by_micro: list[list] = [[] for _ in range(micro_steps)]
    for op in schedule.ops:
        by_micro[op.micro_step].append(op)
    micro = micro_steps - 2
    settling = [op for ops in by_micro[:micro - 1] for op in ops]
    before, repeated = by_micro[micro - 1], by_micro[micro]
    if len(before) != len(repeated) or not by_micro[micro + 1] or not all(by_micro):
        return None
    starts = [min(timings[op.id].start_s for op in ops) for ops in by_micro]
    lo, hi = starts[micro], starts[micro + 1]
    period = lo - starts[micro - 1]
    end = max(t.end_s for t in timings)
    tol = _REL_TOL * max(end, 1.0)
    if period <= 0 or hi <= lo:
        return None
    for a, b in zip(before, repeated):
        ta, tb = timings[a.id], timings[b.id]
        if (a.kind != b.kind or a.stream != b.stream or abs(tb.start_s - ta.start_s - period) > tol
                or abs(tb.end_s - ta.end_s - period) > tol):
            return None
    # the micro-steps before must be over when the window opens, or the window would differ
    if any(timings[op.id].end_s > lo for op in settling):
        return None
    net: dict[str, float] = {}
    for time_s, delta, category, _ in events:
        if lo <= time_s < hi:
            net[category] = net.get(category, 0.0) + delta
    if any(v != 0.0 for v in net.values()):
        return None
    return Repeat(micro, copies, period, lo, hi, len(repeated))
