"""Identical layers reused, exactly: a step's transformer blocks simulated as a few, not all of them.

ZeRO-3's builder leaves out the middle layers of each pass where its state repeats (see [Note:
layers the builder skips]); the schedule lists each gap (Schedule.skipped): `count` copies of the
window, the block of ops just before it. The kept ops that would have waited on, or freed a
buffer of, a dropped block wait on (free) the same op of the block as many layers earlier. The
shortened step is simulated; when its window runs exactly as the two blocks before it did, one
period apart (every op that starts in a period has its twin one period earlier, starting and
ending exactly one period earlier, nothing older is still running, and the memory ledger sees
the same events), the engine, deterministic and shift-invariant, would run every dropped copy
the same way: the trace stands for the full step through a `LayerRepeat`, one `LayerWindow` per
gap. A window need not leave memory as it found it (each forward block keeps its
activations): every copy adds the same bytes per category, and the full step's peak is found
from the simulated events. Byte counts must be whole numbers, so their sums are exact in any
order. A window that does not run alike gets the step built whole and every op simulated
(zsim/simulate.py). Under steady.py's micro-step repeat the two nest (`LayeredRepeat`).
tests/engine/test_layer_repeat.py compares both with simulating every op.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import cached_property

from zsim.engine.ledger import LedgerError
from zsim.engine.sim import Repeat, Trace, run_ops
from zsim.schedule.ir import Op, Schedule, SkippedLayers
from zsim.schedule.payloads import payload_shape

# two periods agree when every op's start and end agree to this fraction of the step (steady.py's)
_REL_TOL = 1e-12


@dataclass(frozen=True)
class LayerWindow:
    """The ops that start in [start_s, end_s) of the simulated step stand for `copies` windows,
    one `period_s` apart; each copy changes the memory of every category by `delta_bytes`."""
    name: str
    copies: int
    period_s: float
    start_s: float
    end_s: float
    ops: frozenset[int]
    delta_bytes: tuple[tuple[str, float], ...]
    layers: int = 1             # layers per copy
    region: tuple[int, str] | None = None   # the (micro-step, direction) of its gap's pass

    @property
    def skipped_s(self) -> float:
        return (self.copies - 1) * self.period_s


@dataclass(frozen=True)
class LayerRepeat:
    """A step whose identical layers were simulated once per window (windows in time order):
    a sim.StepRepeat."""
    windows: tuple[LayerWindow, ...]

    def layer_windows(self) -> tuple[LayerWindow, ...]:
        return self.windows

    def step_ops(self, simulated_ops: int) -> int:
        """Ops of the full step, from those of the shortened step."""
        return simulated_ops + sum((w.copies - 1) * len(w.ops) for w in self.windows)

    def weight(self, op: Op) -> int:
        for w in self.windows:
            if op.id in w.ops:
                return w.copies
        return 1

    @cached_property
    def _skips(self) -> tuple[list[float], list]:
        """The windows' ends (ascending: they are in time order and do not overlap) and the
        time skipped before each, summed in order: shift_s in a bisection, the same sums."""
        ends: list[float] = []
        skipped: list[float] = [0]
        for w in self.windows:
            ends.append(w.end_s)
            skipped.append(skipped[-1] + w.skipped_s)
        return ends, skipped

    def shift_s(self, time_s: float) -> float:
        ends, skipped = self._skips
        return time_s + skipped[bisect_right(ends, time_s)]

    def segments(self) -> tuple[tuple[float, float, int], ...]:
        """(start_s, end_s, copies): the simulated time split so that each piece stands for
        `copies` pieces of the full step."""
        out, lo = [], float("-inf")
        for w in self.windows:
            out += [(lo, w.start_s, 1), (w.start_s, w.end_s, w.copies)]
            lo = w.end_s
        return tuple(out) + ((lo, float("inf"), 1),)

    def _expanded(self, events, shift=None):
        """Yield (time_s on the full step's clock, bytes in use, bytes per category) at each event
        of the full step that can hold its peak: every simulated event with the memory of the
        copies before it added, and a growing window's first maximum in its last copy (each copy
        is the one before plus the same bytes, so the last copy's maximum is the highest)."""
        shift = shift or self.shift_s
        current, per_cat = 0.0, {}
        i, n = 0, len(events)
        for w in self.windows:
            while i < n and events[i][0] < w.start_s:
                current, per_cat = _apply(current, per_cat, events[i])
                yield shift(events[i][0]), current, per_cat
                i += 1
            top = None
            while i < n and events[i][0] < w.end_s:
                current, per_cat = _apply(current, per_cat, events[i])
                if top is None or current > top[1]:
                    top = (events[i][0], current, dict(per_cat))
                yield shift(events[i][0]), current, per_cat
                i += 1
            growth = sum(d for _, d in w.delta_bytes) * (w.copies - 1)
            if top is not None and growth > 0:
                extra = dict(top[2])
                for cat, d in w.delta_bytes:
                    extra[cat] = extra.get(cat, 0.0) + d * (w.copies - 1)
                yield shift(top[0]) + w.skipped_s, top[1] + growth, extra
            current += growth
            for cat, d in w.delta_bytes:
                per_cat[cat] = per_cat.get(cat, 0.0) + d * (w.copies - 1)
        while i < n:
            current, per_cat = _apply(current, per_cat, events[i])
            yield shift(events[i][0]), current, per_cat
            i += 1

    def peak_and_breakdown(self, events, shift=None) -> tuple[float, float, dict[str, float]]:
        """ledger.peak_and_breakdown of the full step's events, from the simulated ones: the
        first instant of the highest use (byte counts are whole, so the highest is exact)."""
        peak, peak_t, peak_cat = 0.0, 0.0, {}
        for time_s, current, per_cat in self._expanded(events, shift):
            if current > peak + 1e-6:
                peak, peak_t, peak_cat = current, time_s, dict(per_cat)
        return peak, peak_t, {str(k): v for k, v in sorted(peak_cat.items()) if v > 0.5}

    def marks(self, op: Op) -> dict:
        for w in self.windows:
            if op.id in w.ops:
                return {"repeated_layers": w.copies, **({"layers_per_copy": w.layers} if w.layers > 1 else {})}
        return {}

    def spans(self) -> tuple[tuple[str, float, float, float, int], ...]:
        return tuple((w.name, self.shift_s(w.start_s) + w.end_s - w.start_s, w.skipped_s, w.period_s, w.copies)
                     for w in self.windows)

    def timeline(self, events, shift=None) -> list[tuple[float, float]]:
        """(time_s on the full step's clock, bytes in use) after each simulated event."""
        out: list[tuple[float, float]] = []
        for time_s, current, _ in self._expanded(events, shift):
            if out and out[-1][0] == time_s:
                out[-1] = (time_s, current)
            else:
                out.append((time_s, current))
        return out


def _apply(current, per_cat, event):
    _, delta, category, _ = event
    per_cat[category] = per_cat.get(category, 0.0) + delta
    return current + delta, per_cat


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


def _window(gap: SkippedLayers, schedule: Schedule, timings, events, tol: float, clock: _Clock) -> LayerWindow | None:
    """The gap's window [lo, hi) (its `length` ops before op `at`) when the simulated step ran its
    last three periods alike: the ops that start in each period are the ops of the period
    before, each starting and ending exactly one period later, nothing older is still running
    when a period opens, the ledger sees the same events; and the window is as long as a period
    (the block after the gap opens on time)."""
    length, at = gap.length, gap.at

    def opens(first):
        return min(timings[x].start_s for x in range(first, first + length))
    if at - 3 * length < 0 or at + length > len(timings):
        return None
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
    return LayerWindow(gap.name, gap.count + 1, period, lo, hi, frozenset(op.id for op in periods[2]),
                       tuple(sorted(delta.items())), gap.layers, gap.region)


def _layer_repeat(short: Schedule, timings, events) -> LayerRepeat | None:
    """The LayerRepeat of a schedule whose builder left layers out (Schedule.skipped), or None
    when a window did not run alike."""
    if any(not float(d).is_integer() for _, d, _, _ in events):
        return None
    tol = _REL_TOL * max(max(t.end_s for t in timings), 1.0)
    clock = _Clock(timings, events)
    windows = [_window(gap, short, timings, events, tol, clock) for gap in short.skipped]
    settled = sorted((w for w in windows if w is not None), key=lambda w: w.start_s)
    if len(settled) < len(windows) or any(a.end_s > b.start_s for a, b in zip(settled, settled[1:])):
        return None
    if len(short.ops) + sum((w.copies - 1) * len(w.ops) for w in settled) != short.full_ops:
        return None
    return LayerRepeat(tuple(settled))


def run_layers(schedule: Schedule, cluster, precision: str):
    """run_ops(schedule), with the layers its builder left out (see [Note: layers the builder
    skips]) standing on the windows simulated: (its timings and ledgers, the LayerRepeat; None
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
    repeat = _layer_repeat(schedule, timings, ledgers[0].events())
    return None if repeat is None else (timings, ledgers, repeat)


def simulate_layers(schedule: Schedule, cluster, precision: str) -> Trace | None:
    """sim.simulate of a one-stage schedule whose left-out layers stand on the windows simulated;
    None where they did not run alike (run_layers)."""
    out = run_layers(schedule, cluster, precision)
    if out is None:
        return None
    timings, ledgers, repeat = out
    end = max((t.end_s for t in timings), default=0.0)
    if repeat is not None:
        end = repeat.shift_s(end)
    return Trace(schedule, tuple(timings), ledgers[0].events(), end, schedule.full_ops, repeat)


@dataclass(frozen=True)
class LayeredRepeat:
    """steady.py's repeated micro-step over a step whose layers are reused too: each layer window
    lies inside the micro-step window or outside it, and the micro-step's copies repeat its
    layer windows."""
    micro: Repeat
    layers: LayerRepeat

    def layer_windows(self) -> tuple[LayerWindow, ...]:
        return self.layers.windows

    def _inside(self, w: LayerWindow) -> bool:
        return self.micro.start_s <= w.start_s and w.end_s <= self.micro.end_s

    @cached_property
    def micro_period_s(self) -> float:
        """One micro-step on the full step's clock."""
        return self.micro.period_s + sum(w.skipped_s for w in self.layers.windows if self._inside(w))

    def weight(self, op: Op) -> int:
        return self.micro.weight(op) * self.layers.weight(op)

    def shift_s(self, time_s: float) -> float:
        shifted = self.layers.shift_s(time_s)
        return shifted + (self.micro.copies - 1) * self.micro_period_s if time_s >= self.micro.end_s else shifted

    def segments(self) -> tuple[tuple[float, float, int], ...]:
        r = self.micro
        return tuple((lo, hi, n * (r.copies if r.start_s <= lo and hi <= r.end_s else 1))
                     for lo, hi, n in _split(self.layers.segments(), (r.start_s, r.end_s)))

    def peak_and_breakdown(self, events) -> tuple[float, float, dict[str, float]]:
        # the micro-step window leaves every category as it found it (nest checks it), so its
        # copies peak where it does
        return self.layers.peak_and_breakdown(events, self.shift_s)

    def timeline(self, events) -> list[tuple[float, float]]:
        return self.layers.timeline(events, self.shift_s)

    def marks(self, op: Op) -> dict:
        return {**self.micro.marks(op), **self.layers.marks(op)}

    def spans(self) -> tuple[tuple[str, float, float, float, int], ...]:
        r = self.micro
        first_end = self.layers.shift_s(r.start_s) + self.micro_period_s
        layers = tuple((w.name, self.shift_s(w.start_s) + w.end_s - w.start_s, w.skipped_s, w.period_s, w.copies)
                       for w in self.layers.windows)
        return ((r.name, first_end, (r.copies - 1) * self.micro_period_s, self.micro_period_s, r.copies),) + layers

    def step_ops(self, simulated_ops: int) -> int:
        """Ops of the full step, from those of the shortened step before its layers were dropped."""
        inside = [w for w in self.layers.windows if self._inside(w)]
        micro_ops = len(self.micro.ops) + sum((w.copies - 1) * len(w.ops) for w in inside)
        return simulated_ops + (self.micro.copies - 1) * micro_ops


def _split(segments, cut: tuple[float, float]):
    """`segments` cut at both ends of `cut`."""
    for lo, hi, n in segments:
        points = [lo] + [c for c in cut if lo < c < hi] + [hi]
        yield from ((a, b, n) for a, b in zip(points, points[1:]))


def nest(micro: Repeat, layers: LayerRepeat) -> LayeredRepeat | None:
    """The two repeats of one simulation together, or None when a layer window straddles the
    micro-step window or the layer copies inside it change memory (the micro-step window must
    leave every category as it found it on the full step's clock too)."""
    growth: dict[str, float] = {}
    for w in layers.windows:
        inside = micro.start_s <= w.start_s and w.end_s <= micro.end_s
        if not inside and w.end_s > micro.start_s and w.start_s < micro.end_s:
            return None
        if inside:
            for cat, d in w.delta_bytes:
                growth[cat] = growth.get(cat, 0.0) + d * (w.copies - 1)
    if any(v != 0.0 for v in growth.values()):
        return None
    return LayeredRepeat(micro, layers)
