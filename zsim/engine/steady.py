"""Steady state reused, exactly: a step of GAS micro-steps simulated as three to six; a pipeline's
as a few periods past its warm-up.

Micro-steps between the first and the last of an accumulation window are the same ops
(DeepSpeed runs the same hooks, gathers and reductions every micro-step; only the first
and the boundary micro-step differ). The step is built with four micro-steps (three first for
ZeRO-2 with its optimizer on the GPU; five or six when the middle ones take longer to settle):
the first, the middle ones, the boundary one. When the
last middle micro-step runs exactly as the one before did, one period later (every op
starts and ends one period later, nothing of the earlier micro-steps is still running, and
the window leaves every memory category as it found it), the time window it opens repeats
for every middle micro-step of the full step: the engine is deterministic and
shift-invariant, so the same state at the start of a window gives the same window. Where
the middle micro-steps' windows opened by their forwards do not agree (the first micro-step's
reductions still run into the second's forward, under ZeRO-3), windows opened by their
backwards are compared the same way (find_backward_repeat): one holds a middle micro-step's
backward and the next one's forward. The trace then stands for the full step through a
`Repeat`; anything else falls back to simulating every micro-step.
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

from zsim.engine.layer_repeat import LayeredRepeat, nest, run_layers, simulate_layers
from zsim.engine.sim import Repeat, Trace, collector_paused, run_ops, simulate, stage_peaks
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import OpKind, Schedule
from zsim.specs.scenario import Scenario
from zsim.workload.module import Workload

# the first, two middle micro-steps (the second repeating the first), the boundary one; one or two
# more when the first middle one is still settling from the first micro-step (a reduction of its
# shape runs into it). Under ZeRO-3 with parameters on the GPU it always is for a window opened
# by a forward (find_repeat: on every test variant four never sufficed), but a window opened by
# the backward (find_backward_repeat) has settled by then: four sufficed on every test variant.
# ZeRO-2 with its optimizer on the GPU (and the BF16_Optimizer) keeps no 16-bit .grad from one
# micro-step to the next, and its first micro-step settles before the second one's backward:
# three micro-steps (the first, one middle, the boundary) sufficed for 18 of 19 random ZeRO-2
# configurations and every such test variant, none at ZeRO-1 or with an offloaded optimizer.
# Only speed depends on this: a repeat is used only when checked exact.
SIMULATED_MICRO_STEPS = (4, 5, 6)
SHORT_SIMULATED_MICRO_STEPS = (3, 4, 5, 6)
# two periods agree when every op's start and end agree to this fraction of the step
_REL_TOL = 1e-12


def _tolerance(timings, window_ops: int) -> float:
    """How far an op's start or end may be from its twin's one period on (`_shifted`): _REL_TOL
    of the step, or the rounding of a chain of `window_ops` additions (each op's time is a sum
    along the ops before it), if larger. A many-expert step's micro-step holds ~50,000 ops, whose
    rounding reaches ~1e-11 of the step (Qwen3-30B-A3B, ZeRO-3, 8 GPUs: its middle micro-steps
    agree to 1.1e-11 s on an 11 s step); below ~4,500 ops a window has the plain _REL_TOL."""
    return max(_REL_TOL, window_ops * sys.float_info.epsilon) * max(max(t.end_s for t in timings), 1.0)


def simulate_scenario(sc: Scenario, steady: bool = True) -> tuple[Workload, Trace]:
    """Build and simulate the step of `sc`; `steady=False` simulates every micro-step."""
    with collector_paused():
        return _simulate(sc, steady)


def _simulate(sc: Scenario, steady: bool) -> tuple[Workload, Trace]:
    gas = sc.gradient_accumulation_steps
    pipeline = sc.pipeline_stages > 1
    wl = None
    spent = 0   # micro-steps simulated in attempts: never more than the full step's
    # Megatron's interleaved schedule runs micro-batches in groups of `pipeline` through every
    # chunk: its period is a group of micro-steps, 1F1B's one micro-step
    stride = sc.pipeline_stages if sc.parallelism.virtual_stages > 1 else 1
    settles_early = ((sc.zero.stage == 2 or sc.deepspeed.uses_bf16_optimizer)
                     and sc.zero.optimizer_offload_device == "none")
    attempts = (_pipeline_micro_steps(sc.pipeline_stages, stride) if pipeline
                else SHORT_SIMULATED_MICRO_STEPS if settles_early else SIMULATED_MICRO_STEPS)
    for micro_steps in attempts if steady else ():
        spent += micro_steps
        if gas <= micro_steps or spent > gas:
            break
        wl, reduced = build_schedule(sc, wl, micro_steps=micro_steps, skip_layers=not pipeline)
        # each micro-step's identical layers simulated once (layer_repeat.py)
        out = (run_layers(reduced, wl, sc.cluster, sc.precision) if not pipeline
               else (reduced, *run_ops(reduced, sc.cluster, sc.precision), None))
        if out is None:     # layers the builder left out did not run alike: every layer built
            wl, reduced = build_schedule(sc, wl, micro_steps=micro_steps)
            out = run_layers(reduced, wl, sc.cluster, sc.precision)
        simulated, timings, ledgers, layers = out
        events = tuple(ledger.events() for ledger in ledgers)
        repeat: Repeat | LayeredRepeat | None
        if pipeline:
            repeat = find_pipeline_repeat(simulated, timings, events, micro_steps, gas, stride)
        else:
            repeat = (find_repeat(simulated, timings, events, micro_steps, gas)
                      or find_backward_repeat(simulated, timings, events, micro_steps, gas))
        if repeat is not None and layers is not None:
            repeat = nest(repeat, layers)
        if repeat is not None:
            end = repeat.shift_s(max(t.end_s for t in timings))
            ops = repeat.step_ops(reduced.full_ops)
            if not pipeline:
                return wl, Trace(simulated, tuple(timings), events[0], end, ops, repeat)
            peaks, worst = stage_peaks(events)
            return wl, Trace(reduced, tuple(timings), events[worst], end, ops, repeat,
                             stage_ledger_events=events, worst_stage=worst, stage_peaks_bytes=peaks)
    wl, schedule = build_schedule(sc, wl, skip_layers=steady and not pipeline)
    if steady and not pipeline:   # the step's identical layers, simulated once (layer_repeat.py)
        trace = simulate_layers(schedule, wl, sc.cluster, sc.precision)
        if trace is None:   # layers the builder left out did not run alike: every layer built
            wl, schedule = build_schedule(sc, wl)
            trace = simulate_layers(schedule, wl, sc.cluster, sc.precision)
        assert trace is not None    # every layer built: nothing left out to disagree
        return wl, trace
    return wl, simulate(schedule, sc.cluster, sc.precision)


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


def find_repeat(schedule: Schedule, timings, stage_events, micro_steps: int, gas: int) -> Repeat | None:
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
    tol = _tolerance(timings, len(repeated))
    if period <= 0 or hi <= lo or not _shifted(zip(before, repeated), timings, period, tol):
        return None
    # the micro-steps before must be over when the window opens, or the window would differ
    if any(timings[op.id].end_s > lo for op in settling) or not _balanced(stage_events[0], lo, hi):
        return None
    return Repeat(micro, gas - micro_steps + 1, period, lo, hi, frozenset(op.id for op in repeated))


def _pipeline_micro_steps(stages: int, stride: int) -> tuple[int, ...]:
    """A pipeline of `stages` stages settles into its 1F1B period a micro-step after the last
    stage's first backward (stage 0 then runs one forward and one backward per period), one
    later where the first micro-step's backwards are shorter than the others (ZeRO-0/1 create
    the .grads there that later micro-steps add into: see [Note: gradient accumulation add]):
    the shortened step runs stages + 4 micro-steps, so that the window (stage 0's forward of
    micro-step stages + 2 to that of stages + 3) and the period before it are both steady
    (stages + 3 held on every 1F1B variant tried before the add, PP 2-8, checkpointing,
    ZeRO-0/1, TP, fp16/bf16, 144 cases; with it PP 2 and 4 need stages + 4), and a step that
    has not settled falls back to 2 x stages + 4. The interleaved schedule's
    period is a group of `stride` (= stages) micro-steps: rank 0 warms up for
    2 (p - 1) + (v - 1) p of its p v forwards per group (get_pp_rank_microbatches) and runs its
    first backward of chunk 0 (the last chunk's to start its gradients) (v - 1) p backwards
    later, in its second group of forwards; the period before the window starts in the third
    group, the window ends at the fifth's first forward (five groups), or two groups later."""
    if stride > 1:
        return (5 * stride, 7 * stride)
    return (stages + 4, 2 * stages + 4)


def find_pipeline_repeat(schedule: Schedule, timings, stage_events, micro_steps: int, gas: int,
                         stride: int = 1) -> Repeat | None:
    """The Repeat of a pipeline's shortened step: the period opened by stage 0's first forward
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


def find_backward_repeat(schedule: Schedule, timings, stage_events, micro_steps: int, gas: int) -> Repeat | None:
    """A data-parallel step's Repeat with the window opened by the backward of micro-step
    j = micro_steps - 2 (its first backward op) and closed by the boundary micro-step's: it
    holds j's backward and the boundary's forward, which every middle micro-step repeats. Where
    the first micro-step's reductions run into the second's forward, that window has settled a
    micro-step earlier than one opened by a forward (find_repeat), so the step is shortened to
    one micro-step fewer."""
    return _window_repeat(schedule, timings, stage_events, _opens(schedule, timings, OpKind.BACKWARD),
                          micro_steps, gas, 1, pipeline=False, from_backward=True)


def _opens(schedule: Schedule, timings, kind: OpKind) -> dict[int, float]:
    """Per micro-step, the start of stage 0's first op of `kind` (in program order)."""
    opens: dict[int, float] = {}
    for op in schedule.ops:
        if op.pipe_stage == 0 and op.kind == kind and op.micro_step not in opens:
            opens[op.micro_step] = timings[op.id].start_s
    return opens


def _window_repeat(schedule: Schedule, timings, stage_events, opens: dict[int, float], micro_steps: int, gas: int,
                   stride: int, pipeline: bool, from_backward: bool = False) -> Repeat | None:
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
    # (a data-parallel step's payloads differ in their bucket and call numbers, as with find_repeat:
    # its ops are compared by kind, stream, stage and times alone)
    if any(b.micro_step != a.micro_step + stride or (pipeline and b.payload != a.payload)
           or [x.size_bytes for x in a.alloc] != [x.size_bytes for x in b.alloc] for a, b in zip(before, window)):
        return None
    if not _shifted(zip(before, window), timings, period, _tolerance(timings, len(window))):
        return None
    if not all(_balanced(events, lo, hi) for events in stage_events):
        return None
    return Repeat(j, (gas - micro_steps) // stride + 1, period, lo, hi, frozenset(op.id for op in window),
                  pipeline=pipeline, micro_steps=stride, from_backward=from_backward)
