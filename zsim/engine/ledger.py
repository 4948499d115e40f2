"""Memory ledger: every allocation and free in simulated time. Peak, breakdown at the peak and
the timeline all come from these events (never from a second formula)."""
from __future__ import annotations

from zsim.schedule.ops import Alloc


class Ledger:
    def __init__(self):
        self._live: dict[str, tuple[str, float]] = {}
        self._events: list[tuple[float, float, str, str]] = []

    def alloc(self, time_s: float, a: Alloc):
        if a.size_bytes <= 0:
            return
        if a.tag in self._live:
            raise RuntimeError(f"ledger: tag {a.tag!r} allocated twice")
        self._live[a.tag] = (a.category, a.size_bytes)
        self._events.append((time_s, a.size_bytes, a.category, a.tag))

    def free(self, time_s: float, tag: str):
        entry = self._live.pop(tag, None)
        if entry is None:
            return  # zero-sized allocations are never recorded
        category, size = entry
        self._events.append((time_s, -size, category, tag))

    def events(self) -> tuple[tuple[float, float, str, str], ...]:
        return tuple(self._events)


def peak_and_breakdown(events) -> tuple[float, float, dict[str, float]]:
    """(peak_bytes, time_s of the first peak, bytes per category at that instant)."""
    current = 0.0
    per_cat: dict[str, float] = {}
    peak, peak_t, peak_cat = 0.0, 0.0, {}
    for time_s, delta, category, _ in events:
        current += delta
        per_cat[category] = per_cat.get(category, 0.0) + delta
        if current > peak + 1e-6:
            peak, peak_t, peak_cat = current, time_s, dict(per_cat)
    return peak, peak_t, {k: v for k, v in sorted(peak_cat.items()) if v > 0.5}


def timeline(events) -> list[tuple[float, float]]:
    """(time_s, bytes in use) after each event, one point per distinct time."""
    out: list[tuple[float, float]] = []
    current = 0.0
    for time_s, delta, _, _ in events:
        current += delta
        if out and out[-1][0] == time_s:
            out[-1] = (time_s, current)
        else:
            out.append((time_s, current))
    return out
