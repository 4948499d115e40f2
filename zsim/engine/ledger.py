"""Memory ledger: every allocation and free in simulated time. Peak, breakdown at the peak and
the timeline all come from these events (never from a second formula).

The ledger is strict: a tag is allocated once, freed once, and only after it was allocated;
`close` checks that only the step's static buffers outlive it. Empty buffers are tracked like
any other (so their frees are checked) but produce no events."""
from __future__ import annotations

from itertools import accumulate, islice

from zsim.schedule.ir import Alloc, Tag


class LedgerError(RuntimeError):
    """The schedule's memory effects are inconsistent (a builder bug)."""


class Ledger:
    """Live buffers are keyed by their tag's fields (a tuple hashes and compares in C; a tag's
    own hash and equality are Python calls, and every op allocates or frees a few)."""

    def __init__(self):
        self._live: dict[tuple, tuple[str, float, Tag]] = {}
        self._freed: set[tuple] = set()
        self._events: list[tuple[float, float, str, Tag]] = []

    def alloc(self, time_s: float, a: Alloc):
        tag = a.tag
        k = (id(tag.buffer), tag.micro, tag.key, tag.phase)   # an Enum hashes in Python
        if k in self._live:
            raise LedgerError(f"ledger: {tag} allocated twice")
        self._freed.discard(k)
        self._live[k] = (a.category, a.size_bytes, tag)
        if a.size_bytes > 0:
            self._events.append((time_s, a.size_bytes, a.category, tag))

    def free(self, time_s: float, tag: Tag):
        k = (id(tag.buffer), tag.micro, tag.key, tag.phase)   # an Enum hashes in Python
        entry = self._live.pop(k, None)
        if entry is None:
            state = "already freed" if k in self._freed else "never allocated"
            raise LedgerError(f"ledger: free of {tag}, {state}")
        self._freed.add(k)
        category, size, _ = entry
        if size > 0:
            self._events.append((time_s, -size, category, tag))

    def close(self, static: tuple[Alloc, ...]):
        """The end of the step: everything but the static buffers must have been freed."""
        kept = {a.tag for a in static}
        leaked = [entry[2] for entry in self._live.values() if entry[2] not in kept]
        if leaked:
            raise LedgerError(f"ledger: {len(leaked)} buffers alive at the end of the step, first {leaked[0]}")

    def events(self) -> tuple[tuple[float, float, str, Tag], ...]:
        return tuple(self._events)


def peak_and_breakdown(events) -> tuple[float, float, dict[str, float]]:
    """(peak_bytes, time_s of the first peak, bytes per category at that instant). A new peak
    is one more than 1e-6 bytes above the last; the breakdown is summed once, up to that event."""
    peak, at = 0.0, -1
    for i, current in enumerate(accumulate(event[1] for event in events)):
        if current > peak + 1e-6:
            peak, at = current, i
    if at < 0:
        return 0.0, 0.0, {}
    per_cat: dict[str, float] = {}
    for _, delta, category, _ in islice(events, at + 1):
        per_cat[category] = per_cat.get(category, 0.0) + delta
    return peak, events[at][0], {str(k): v for k, v in sorted(per_cat.items()) if v > 0.5}


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
