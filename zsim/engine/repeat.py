"""What a shortened step's trace says of the full step: one type, `Repeat`, for every level.

A `Window` is a stretch [start_s, end_s) of the simulated step whose ops stand for `copies`
windows one `period_s` apart: a repeated micro-step or 1F1B period (zsim/engine/steady.py), or a
run of identical layers (zsim/engine/layer_repeat.py). A `Repeat` holds the step's layer windows
(in time order) and at most one period window; each layer window lies inside the period window
(its copies repeat with each period) or apart from it. summarize and the writers ask only the
Repeat's methods; the doctor also reads its layer windows, to name the op at a peak that falls
in a growing window's last copy (see [Note: peak of a shortened step]).
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property

from zsim.engine.ledger import peak_and_breakdown, timeline
from zsim.schedule.ir import Op


@dataclass(frozen=True)
class Window:
    """The simulated ops that start in [start_s, end_s) stand for `copies` windows, one `period_s`
    apart on the simulated clock; each copy changes the memory of every category by
    `delta_bytes` (a period window leaves it as it found it)."""
    name: str
    copies: int
    period_s: float
    start_s: float
    end_s: float
    ops: frozenset[int]
    delta_bytes: tuple[tuple[str, float], ...] = ()
    layers: int = 1             # a layer window: layers per copy
    micro: int = -1             # a period window: the micro-step that opens it

    @property
    def skipped_s(self) -> float:
        """Simulated time the copies not simulated take (a period window: without the layer
        copies inside it, see Repeat.period_s)."""
        return (self.copies - 1) * self.period_s


@dataclass(frozen=True)
class Repeat:
    """The step's layer windows, in time order, and its period window (None: layers alone)."""
    layers: tuple[Window, ...] = ()
    period: Window | None = None

    def _inside(self, w: Window) -> bool:
        p = self.period
        return p is not None and p.start_s <= w.start_s and w.end_s <= p.end_s

    @cached_property
    def period_s(self) -> float:
        """One period on the full step's clock: the simulated one and its layer copies'."""
        assert self.period is not None
        return self.period.period_s + sum(w.skipped_s for w in self.layers if self._inside(w))

    @cached_property
    def _skips(self) -> tuple[list[float], list]:
        """The layer windows' ends and the time skipped before each, summed in order."""
        ends: list[float] = []
        skipped: list[float] = [0]
        for w in self.layers:
            ends.append(w.end_s)
            skipped.append(skipped[-1] + w.skipped_s)
        return ends, skipped

    def _layer_shift_s(self, time_s: float) -> float:
        ends, skipped = self._skips
        return time_s + skipped[bisect_right(ends, time_s)]

    def shift_s(self, time_s: float) -> float:
        """A simulated instant on the full step's clock."""
        shifted = self._layer_shift_s(time_s)
        p = self.period
        return shifted + (p.copies - 1) * self.period_s if p is not None and time_s >= p.end_s else shifted

    def weight(self, op: Op) -> int:
        """How many ops of the full step this simulated op stands for."""
        n = self.period.copies if self.period is not None and op.id in self.period.ops else 1
        for w in self.layers:
            if op.id in w.ops:
                return n * w.copies
        return n

    def segments(self) -> tuple[tuple[float, float, int], ...]:
        """(start_s, end_s, copies): the simulated time split so that each piece stands for
        `copies` pieces of the full step (a measure over the step is their weighted sum)."""
        out, lo = [], float("-inf")
        for w in self.layers:
            out += [(lo, w.start_s, 1), (w.start_s, w.end_s, w.copies)]
            lo = w.end_s
        out.append((lo, float("inf"), 1))
        p = self.period
        if p is None:
            return tuple(out)
        cut = []
        for lo, hi, n in out:
            points = [lo] + [c for c in (p.start_s, p.end_s) if lo < c < hi] + [hi]
            cut += [(a, b, n * (p.copies if p.start_s <= a and b <= p.end_s else 1)) for a, b in zip(points, points[1:])]
        return tuple(cut)

    def _expanded(self, events):
        """Yield (time_s on the full step's clock, bytes in use, bytes per category) at each event
        of the full step that can hold its peak: every simulated event with the memory of the
        copies before it added, and a growing window's first maximum in its last copy (each copy
        is the one before plus the same bytes, so the last copy's maximum is the highest). The
        period window leaves every category as it found it (`nest`), so its copies peak where
        it does."""
        shift = self.shift_s
        current, per_cat = 0.0, {}
        i, n = 0, len(events)
        for w in self.layers:
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

    def peak_and_breakdown(self, events) -> tuple[float, float, dict[str, float]]:
        """ledger.peak_and_breakdown of the full step's events, from the simulated ones: the
        peak bytes, its first instant on the full step's clock, and its breakdown (byte counts
        are whole, so the highest is exact)."""
        if not self.layers:
            peak, peak_t, breakdown = peak_and_breakdown(events)
            return peak, self.shift_s(peak_t), breakdown
        peak, peak_t, peak_cat = 0.0, 0.0, {}
        for time_s, current, per_cat in self._expanded(events):
            if current > peak + 1e-6:
                peak, peak_t, peak_cat = current, time_s, dict(per_cat)
        return peak, peak_t, {str(k): v for k, v in sorted(peak_cat.items()) if v > 0.5}

    def timeline(self, events) -> list[tuple[float, float]]:
        """(time_s on the full step's clock, bytes in use) after each simulated event."""
        if not self.layers:
            return [(self.shift_s(t), used) for t, used in timeline(events)]
        out: list[tuple[float, float]] = []
        for time_s, current, _ in self._expanded(events):
            if out and out[-1][0] == time_s:
                out[-1] = (time_s, current)
            else:
                out.append((time_s, current))
        return out

    def marks(self, op: Op) -> dict:
        """What the trace writer notes on a simulated op that stands for several."""
        p = self.period
        out = {"repeated_micro_steps": p.copies} if p is not None and op.id in p.ops else {}
        for w in self.layers:
            if op.id in w.ops:
                out["repeated_layers"] = w.copies
                if w.layers > 1:
                    out["layers_per_copy"] = w.layers
        return out

    def spans(self) -> tuple[tuple[str, float, float, float, int], ...]:
        """(what, start_s and length_s on the full step's clock, period_s, copies) of the copies
        not simulated."""
        out = []
        p = self.period
        if p is not None:
            out.append((p.name, self._layer_shift_s(p.end_s), (p.copies - 1) * self.period_s, self.period_s, p.copies))
        out += [(w.name, self.shift_s(w.start_s) + w.end_s - w.start_s, w.skipped_s, w.period_s, w.copies)
                for w in self.layers]
        return tuple(out)

    def step_ops(self, built_ops: int) -> int:
        """Ops of the full step, from those of the shortened step with its layer copies
        (Schedule.full_ops)."""
        p = self.period
        if p is None:
            return built_ops
        return built_ops + (p.copies - 1) * (len(p.ops) + sum((w.copies - 1) * len(w.ops)
                                                               for w in self.layers if self._inside(w)))


def _apply(current, per_cat, event):
    _, delta, category, _ = event
    per_cat[category] = per_cat.get(category, 0.0) + delta
    return current + delta, per_cat


def nest(period: Window, layers: tuple[Window, ...]) -> Repeat | None:
    """The two levels of one simulation together, or None when a layer window straddles the
    period window or the layer copies inside it change memory (the period window must leave
    every category as it found it on the full step's clock too)."""
    growth: dict[str, float] = {}
    for w in layers:
        inside = period.start_s <= w.start_s and w.end_s <= period.end_s
        if not inside and w.end_s > period.start_s and w.start_s < period.end_s:
            return None
        if inside:
            for cat, d in w.delta_bytes:
                growth[cat] = growth.get(cat, 0.0) + d * (w.copies - 1)
    if any(v != 0.0 for v in growth.values()):
        return None
    return Repeat(layers, period)
