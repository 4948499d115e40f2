"""Steady state reused, exactly: a step of GAS micro-steps simulated as three to six; a pipeline's
as a few periods past its warm-up.

Micro-steps between the first and the last of an accumulation window are the same ops
(DeepSpeed runs the same hooks, gathers and reductions every micro-step; only the first and the
boundary micro-step differ). The step is built (zsim/simulate.py) with four micro-steps (three
first for ZeRO-2 with its optimizer on the GPU; five or six when the middle ones take longer to
settle): the first, the middle ones, the boundary one. The time window from the last middle
micro-step's first forward op to the boundary's repeats for every middle micro-step of the full
step when the period before it ran the same ops one period earlier (every op starts and ends
one period later, nothing older is still running, and the window leaves every memory category
as it found it): the engine is deterministic and shift-invariant, so the same state at the
start of a window gives the same window. Where the forwards' windows do not agree (the first
micro-step's reductions still run into the second's forward, under ZeRO-3), the windows opened
by the backwards are compared the same way: one holds a middle micro-step's backward and the
next one's forward (find_repeat). The trace then stands for the full step through a `Repeat` (zsim/engine/repeat.py);
anything else falls back to simulating every micro-step.
A pipeline's micro-steps are not alike (warm-up, steady 1F1B, cool-down), but its steady
phase is periodic in time: every stage runs one forward and one backward per period. Its step
is built with stages + 4 micro-steps (then 2 x stages + 4), and the period opened by stage 0's
forward of the second-to-last micro-step stands for all the steady periods of the full step
when the period before it ran the same ops one period earlier (find_pipeline_repeat).
Megatron's interleaved schedule repeats a group of `pipeline` micro-steps (each through every
chunk): its step is built with 5 (then 7) groups, and the period of one group, opened the same
way, stands for the full step's middle groups.
tests/engine/test_steady.py checks both paths agree for every stage, offload and checkpointing
variant, and for pipelines, interleaved ones included.
"""
from __future__ import annotations

import sys

from zsim.engine.repeat import Window
from zsim.schedule.ir import OpKind, Schedule

# two periods agree when every op's start and end agree to this fraction of the step
_REL_TOL = 1e-12


def tolerance_s(timings, window_ops: int) -> float:
    """How far an op's start or end may be from its twin's one period on (`_shifted`): _REL_TOL
    of the step, or the rounding of a chain of `window_ops` additions (each op's time is a sum
    along the ops before it), if larger. A many-expert step's micro-step holds ~50,000 ops, whose
    rounding reaches ~1e-11 of the step (Qwen3-30B-A3B, ZeRO-3, 8 GPUs: its middle micro-steps
    agree to 1.1e-11 s on an 11 s step); below ~4,500 ops a window has the plain _REL_TOL."""
    return max(_REL_TOL, window_ops * sys.float_info.epsilon) * max(max(t.end_s for t in timings), 1.0)


def _shifted(pairs, timings, period: float, tol: float) -> bool:
    """Every (earlier, later) pair of ops is the same op one period later."""
    for a, b in pairs:
        ta, tb = timings[a.id], timings[b.id]
        if (a.kind != b.kind or a.stream != b.stream or a.pipe_stage != b.pipe_stage
                or abs(tb.start_s - ta.start_s - period) > tol or abs(tb.end_s - ta.end_s - period) > tol):
            return False
    return True


def _balanced(events, lo: float, hi: float) -> bool:
    """The window [lo, hi) leaves every memory category as it found it."""
    net: dict[str, float] = {}
    for time_s, delta, category, _ in events:
        if lo <= time_s < hi:
            net[category] = net.get(category, 0.0) + delta
    return all(v == 0.0 for v in net.values())


def find_repeat(schedule: Schedule, timings, stage_events, micro_steps: int, gas: int) -> Window | None:
    """The period window of a data-parallel simulation of `micro_steps` micro-steps: the window opened
    by the forward of micro-step j = micro_steps - 2 (its first forward op) and closed by the
    boundary micro-step's, when the period before it holds the same ops (as
    find_pipeline_repeat); else the window opened by j's backward and closed by the boundary's,
    which holds j's backward and the boundary's forward. Where the first micro-step's
    reductions run into the second's forward, the window opened by the backward has settled a
    micro-step earlier than the one opened by the forward, so the step is shortened to one
    micro-step fewer."""
    for kind in (OpKind.FORWARD, OpKind.BACKWARD):
        repeat = _window_repeat(schedule, timings, stage_events, _opens(schedule, timings, kind), micro_steps, gas, 1,
                                pipeline=False, from_backward=kind is OpKind.BACKWARD)
        if repeat is not None:
            return repeat
    return None


def find_pipeline_repeat(schedule: Schedule, timings, stage_events, micro_steps: int, gas: int,
                         stride: int = 1) -> Window | None:
    """The period window of a pipeline's shortened step: the period opened by stage 0's first forward
    of micro-step j = micro_steps - 1 - stride (its forward of chunk 0, interleaved) and closed
    by that of micro-step j + stride repeats when the period before it holds the same ops on
    every stage and stream (each `stride` micro-steps earlier), each starting and ending
    exactly one period earlier, nothing that started before that period is still running when
    the window opens, and no stage's memory changes over the window. A full step of `gas`
    micro-steps is then this one with (gas - micro_steps) / stride more copies of the window:
    1F1B adds one forward and one backward per stage per extra micro-step, the interleaved
    schedule a forward and a backward of every chunk per extra micro-step, all in the steady
    phase (a group of `stride` micro-steps per period)."""
    if (gas - micro_steps) % stride:
        return None
    return _window_repeat(schedule, timings, stage_events, _opens(schedule, timings, OpKind.FORWARD),
                          micro_steps, gas, stride, pipeline=True)


def _opens(schedule: Schedule, timings, kind: OpKind) -> dict[int, float]:
    """Per micro-step, the start of stage 0's first op of `kind` (in program order)."""
    opens: dict[int, float] = {}
    for op in schedule.ops:
        if op.pipe_stage == 0 and op.kind == kind and op.micro_step not in opens:
            opens[op.micro_step] = timings[op.id].start_s
    return opens


def _window_repeat(schedule: Schedule, timings, stage_events, opens: dict[int, float], micro_steps: int, gas: int,
                   stride: int, pipeline: bool, from_backward: bool = False) -> Window | None:
    """The window [opens[j], opens[j + stride]), j = micro_steps - 1 - stride, when the period
    before it holds the same ops (see find_pipeline_repeat)."""
    j = micro_steps - 1 - stride
    if any(m not in opens for m in (j - stride, j, j + stride)):
        return None
    lo, hi = opens[j], opens[j + stride]
    period = lo - opens[j - stride]
    if period <= 0 or hi <= lo:
        return None
    before, window = [], []
    for op in schedule.ops:
        _, start, end = timings[op.id]
        if lo - period <= start < lo:
            before.append(op)
        elif lo <= start < hi:
            window.append(op)
        elif start < lo - period and end > lo:
            return None     # still running from before: the window's state would differ
    def order(op):
        return op.pipe_stage, op.stream, timings[op.id].start_s, op.id
    before.sort(key=order)
    window.sort(key=order)
    if len(before) != len(window) or not window:
        return None
    # (a data-parallel step's payloads differ in their bucket and call numbers: its ops are
    # compared by kind, stream, stage and times alone)
    if any(b.micro_step != a.micro_step + stride or (pipeline and b.payload != a.payload)
           or [x.size_bytes for x in a.alloc] != [x.size_bytes for x in b.alloc] for a, b in zip(before, window)):
        return None
    if not _shifted(zip(before, window), timings, period, tolerance_s(timings, len(window))):
        return None
    if not all(_balanced(events, lo, hi) for events in stage_events):
        return None
    if stride > 1:
        name = f"interleaved 1F1B period ({stride} micro-steps) from micro-step {j}"
    elif from_backward:
        name = f"micro-step {j}'s backward and micro-step {j + 1}'s forward"
    else:
        name = f"1F1B period from micro-step {j}" if pipeline else f"micro-step {j}"
    return Window(name, (gas - micro_steps) // stride + 1, period, lo, hi, frozenset(op.id for op in window), micro=j)
