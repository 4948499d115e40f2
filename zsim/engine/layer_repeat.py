"""Identical layers reused, exactly: a step's transformer blocks simulated as a few, not all of them.

ZeRO-3's builder leaves out the middle layers of each pass where its state repeats (see [Note:
layers the builder skips]); the schedule lists each gap (Schedule.skipped): `count` copies of the
window, the block of ops just before it. The kept ops that would have waited on, or freed a
buffer of, a dropped block wait on (free) the same op of the block as many layers earlier. The
shortened step is simulated; when its window runs exactly as the two blocks before it did, one
period apart (every op that starts in a period has its twin one period earlier, starting and
ending exactly one period earlier, nothing older is still running, and the memory ledger sees
the same events), the engine, deterministic and shift-invariant, would run every dropped copy
the same way: the trace stands for the full step through a `Repeat` (zsim/engine/repeat.py), one
layer `Window` per gap. A window need not leave memory as it found it (each forward block keeps its
activations): every copy adds the same bytes per category, and the full step's peak is found
from the simulated events. Byte counts must be whole numbers, so their sums are exact in any
order. A window that does not run alike gets the step built whole and every op simulated
(zsim/simulate.py). Under steady.py's micro-step repeat the two nest (repeat.nest).
tests/engine/test_layer_repeat.py compares both with simulating every op.
"""
from __future__ import annotations

from bisect import bisect_left

from zsim.engine.ledger import LedgerError
from zsim.engine.repeat import Repeat, Window
from zsim.engine.sim import Trace, run_ops
from zsim.engine.steady import tolerance_s
from zsim.schedule.ir import Schedule, SkippedLayers
from zsim.schedule.payloads import payload_shape


# -- the shortened step simulated ---------------------------------------------------------------


class _Clock:
    """The simulated step's ops in order of their start (and the latest end of the ops before
    each), and its ledger's event times (in time order already), for the windows' look-ups."""

    def __init__(self, timings, events):
        self.by_start = sorted(range(len(timings)), key=lambda i: timings[i].start_s)
        self.starts = [timings[i].start_s for i in self.by_start]
        self.latest_end = [float("-inf")]
        for i in self.by_start:
            self.latest_end.append(max(self.latest_end[-1], timings[i].end_s))
        self.event_times = [e[0] for e in events]


def _window(gap: SkippedLayers, schedule: Schedule, timings, events, tol: float, clock: _Clock) -> Window | None:
    """The gap's window [lo, hi) (its `length` ops before op `at`) when the simulated step ran its
    last three periods alike: the ops that start in each period are the ops of the period
    before, each starting and ending exactly one period later, nothing older is still running
    when a period opens, the ledger sees the same events; and the window is as long as a period
    (the block after the gap opens on time)."""
    length, at = gap.length, gap.at

    def opens(first):
        return min(timings[x].start_s for x in range(first, first + length))
    if at - 3 * length < 0 or at + length > len(timings) or any(at - 3 * length < g.at < at for g in schedule.skipped):
        return None     # the blocks compared, or the one after the gap, are not all built
    lo, prev, prev2, hi = opens(at - length), opens(at - 2 * length), opens(at - 3 * length), opens(at)
    period = lo - prev
    if period <= 0 or abs(prev - prev2 - period) > tol or abs(hi - lo - period) > tol:
        return None
    # the periods open `tol` early: an op of the block that opens one starts there up to rounding
    lo, hi = lo - tol, hi - tol
    i0, i1 = bisect_left(clock.starts, lo - 2 * period), bisect_left(clock.starts, hi)
    if clock.latest_end[i0] > lo - period + 2 * tol:
        return None     # still running from before: the periods' states would differ
    periods: list[list] = [[], [], []]      # the ops that start in each of the last three periods
    ops = schedule.ops
    for x in clock.by_start[i0:i1]:
        _, start, stop = timings[x]
        if start < lo - period:
            if stop > lo + 2 * tol:
                return None
            periods[0].append(ops[x])
        else:
            periods[1 if start < lo else 2].append(ops[x])

    def order(op):
        return op.stream, timings[op.id].start_s, op.id
    for started in periods:
        if len(started) != length:
            return None
        started.sort(key=order)
    for earlier, later in zip(periods, periods[1:]):
        for x, y in zip(earlier, later):
            tx, ty = timings[x.id], timings[y.id]
            if (x.kind is not y.kind or x.stream != y.stream or payload_shape(x.payload) != payload_shape(y.payload)
                    or abs(ty.start_s - tx.start_s - period) > tol or abs(ty.end_s - tx.end_s - period) > tol):
                return None
    j0, j1, j2 = (bisect_left(clock.event_times, t) for t in (lo - period, lo, hi))
    ev_earlier, ev_window = events[j0:j1], events[j1:j2]
    if len(ev_earlier) != len(ev_window) or any(
            x[1] != y[1] or x[2] != y[2] or abs(y[0] - x[0] - period) > tol for x, y in zip(ev_earlier, ev_window)):
        return None
    delta: dict[str, float] = {}
    for _, d, cat, _ in ev_window:
        delta[cat] = delta.get(cat, 0.0) + d
    return Window(gap.name, gap.count + 1, period, lo, hi, frozenset(op.id for op in periods[2]),
                  tuple(sorted(delta.items())), gap.layers)


def _layer_windows(short: Schedule, timings, events) -> tuple[Window, ...] | None:
    """The layer windows of a schedule whose builder left layers out (Schedule.skipped), in time
    order, or None when a window did not run alike."""
    if any(not float(d).is_integer() for _, d, _, _ in events):
        return None
    tol = tolerance_s(timings, 0)   # steady.py's: a fraction of the step
    clock = _Clock(timings, events)
    windows = [_window(gap, short, timings, events, tol, clock) for gap in short.skipped]
    settled = sorted((w for w in windows if w is not None), key=lambda w: w.start_s)
    if len(settled) < len(windows) or any(a.end_s > b.start_s for a, b in zip(settled, settled[1:])):
        return None
    if len(short.ops) + sum((w.copies - 1) * len(w.ops) for w in settled) != short.full_ops:
        return None
    return tuple(settled)


def run_layers(schedule: Schedule, cluster, precision: str):
    """run_ops(schedule), with the layers its builder left out (see [Note: layers the builder
    skips]) standing on the windows simulated: (its timings and ledgers, the layer windows; None
    where the builder left nothing out), or None when a window did not run alike (the caller
    builds every layer)."""
    try:
        timings, ledgers = run_ops(schedule, cluster, precision)
    except LedgerError:
        if not schedule.skipped:
            raise
        return None
    if not schedule.skipped:
        return timings, ledgers, None
    layers = _layer_windows(schedule, timings, ledgers[0].events())
    return None if layers is None else (timings, ledgers, layers)


def simulate_layers(schedule: Schedule, cluster, precision: str) -> Trace | None:
    """sim.simulate of a one-stage schedule whose left-out layers stand on the windows simulated;
    None where they did not run alike (run_layers)."""
    out = run_layers(schedule, cluster, precision)
    if out is None:
        return None
    timings, ledgers, layers = out
    repeat = None if layers is None else Repeat(layers)
    end = max((t.end_s for t in timings), default=0.0)
    if repeat is not None:
        end = repeat.shift_s(end)
    return Trace(schedule, tuple(timings), ledgers[0].events(), end, schedule.full_ops, repeat)
