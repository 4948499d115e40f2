"""Identical layers reused, exactly: a step's transformer blocks simulated as a few, not all of them.

Within a micro-step's forward, its backward (recompute included) and the step's post-step
gathers, block k's ops are block k-1's: the same kinds, shapes (what the cost model prices and
summarize counts: the call, the work, the copy, the hooks before it, the sizes it allocates), on
the same streams, depending on ops the same distance back and freeing buffers allocated the same
distance back. Where the built schedule shows this for a run of blocks (`_periodic`, checked op by
op on the whole schedule), the blocks in the middle of the run are dropped (`compress`): the kept
ops that waited on, or freed a buffer of, a dropped block wait on (free) the same op of the
block as many blocks earlier, which a dropped copy would have been. The forward and the backward
of a micro-step drop the same layers, so every activation kept for backward is still allocated and
freed once. The shortened step is simulated; when its window block (the last kept before the gap)
runs exactly as the block before it did, one period later (every op that starts in the period
has its twin one period earlier, starting and ending exactly one period earlier, nothing older is
still running, and the memory ledger sees the same events), the engine, deterministic and
shift-invariant, would run every dropped copy the same way: the trace stands for the full step
through a `LayerRepeat`, one `LayerWindow` per gap. A window need not leave memory as it found it
(each forward block keeps its activations): every copy adds the same bytes per category, so the
full step's peak is found from the simulated events (`peak_and_breakdown`). Byte counts must be
whole numbers, so sums of them are exact in any order. Anything else simulates every op.
tests/test_layer_repeat.py compares this with simulating every op.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from zsim.engine.ledger import LedgerError
from zsim.engine.sim import Trace, run_ops, simulate
from zsim.schedule.ir import Op, Phase, Schedule
from zsim.schedule.payloads import Copy, ModulePass
from zsim.workload.module import Workload

# periodic blocks simulated before a window: the two whose periods are compared, and one that
# may still be settling from the blocks before the run
SETTLING_BLOCKS = 3
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

    @property
    def skipped_s(self) -> float:
        return (self.copies - 1) * self.period_s


@dataclass(frozen=True)
class LayerRepeat:
    """A step whose identical layers were simulated once per window (windows in time order)."""
    windows: tuple[LayerWindow, ...]

    def weight(self, op: Op) -> int:
        for w in self.windows:
            if op.id in w.ops:
                return w.copies
        return 1

    def shift_s(self, time_s: float) -> float:
        return time_s + sum(w.skipped_s for w in self.windows if time_s >= w.end_s)

    def segments(self) -> tuple[tuple[float, float, int], ...]:
        """(start_s, end_s, copies): the simulated time split so that each piece stands for
        `copies` pieces of the full step."""
        out, lo = [], float("-inf")
        for w in self.windows:
            out += [(lo, w.start_s, 1), (w.start_s, w.end_s, w.copies)]
            lo = w.end_s
        return tuple(out) + ((lo, float("inf"), 1),)

    def _expanded(self, events):
        """Yield (time_s on the full step's clock, bytes in use, bytes per category, is-a-copy's-peak)
        at each event of the full step that can hold its peak: every simulated event with the
        copies' memory added, and a growing window's maximum in its last copy."""
        current, per_cat = 0.0, {}
        i, n = 0, len(events)
        for w in self.windows:
            while i < n and events[i][0] < w.start_s:
                current, per_cat = _apply(current, per_cat, events[i])
                yield self.shift_s(events[i][0]), current, per_cat
                i += 1
            top = None
            while i < n and events[i][0] < w.end_s:
                current, per_cat = _apply(current, per_cat, events[i])
                if top is None or current > top[1]:
                    top = (events[i][0], current, dict(per_cat))
                yield self.shift_s(events[i][0]), current, per_cat
                i += 1
            growth = sum(d for _, d in w.delta_bytes) * (w.copies - 1)
            if top is not None and growth > 0:
                extra = dict(top[2])
                for cat, d in w.delta_bytes:
                    extra[cat] = extra.get(cat, 0.0) + d * (w.copies - 1)
                yield self.shift_s(top[0]) + w.skipped_s, top[1] + growth, extra
            current += growth
            for cat, d in w.delta_bytes:
                per_cat[cat] = per_cat.get(cat, 0.0) + d * (w.copies - 1)
        while i < n:
            current, per_cat = _apply(current, per_cat, events[i])
            yield self.shift_s(events[i][0]), current, per_cat
            i += 1

    def peak_and_breakdown(self, events) -> tuple[float, float, dict[str, float]]:
        """ledger.peak_and_breakdown of the full step's events, from the simulated ones: the
        first instant of the highest use (byte counts are whole, so the highest is exact)."""
        peak, peak_t, peak_cat = 0.0, 0.0, {}
        for time_s, current, per_cat in self._expanded(events):
            if current > peak + 1e-6:
                peak, peak_t, peak_cat = current, time_s, dict(per_cat)
        return peak, peak_t, {str(k): v for k, v in sorted(peak_cat.items()) if v > 0.5}

    def marks(self, op: Op) -> dict:
        n = self.weight(op)
        return {"repeated_layers": n} if n > 1 else {}

    def spans(self) -> tuple[tuple[str, float, float, float, int], ...]:
        return tuple((w.name, self.shift_s(w.start_s) + w.end_s - w.start_s, w.skipped_s, w.period_s, w.copies)
                     for w in self.windows)

    def timeline(self, events) -> list[tuple[float, float]]:
        """(time_s on the full step's clock, bytes in use) after each simulated event."""
        out: list[tuple[float, float]] = []
        for time_s, current, _ in self._expanded(events):
            if out and out[-1][0] == time_s:
                out[-1] = (time_s, current)
            else:
                out.append((time_s, current))
        return out


def _apply(current, per_cat, event):
    _, delta, category, _ = event
    per_cat[category] = per_cat.get(category, 0.0) + delta
    return current + delta, per_cat


# -- the schedule's blocks --------------------------------------------------------------------

def _shape(op: Op):
    """What the engine prices and summarize counts of an op's payload (CostModel.op_cost's key)."""
    p = op.payload
    shape = getattr(p, "comm", None) or getattr(p, "work", None)
    if shape is None:
        shape = (p.transfer, p.size_bytes, p.pinned) if isinstance(p, Copy) else p
    return shape


def _blocks(schedule: Schedule, wl: Workload) -> list[tuple[tuple, int, int]]:
    """((micro, direction, layer), first op id, end op id) in program order. A module's compute op
    anchors the block of its layer ("f" forward, "b" recompute and backward), a post-step gather
    the block of its param's layer ("s"); the ops between anchors (gathers, reductions, copies)
    belong to the next anchor's block."""
    module_layer = {m.name: m.layer for m in wl.modules}
    param_layer: dict[int, int] = {}
    for m in wl.modules:
        for p in m.params:
            param_layer.setdefault(p, m.layer)
    blocks: list[tuple[tuple, int, int]] = []
    key, start, end = None, 0, 0
    for op in schedule.ops:
        p = op.payload
        if isinstance(p, ModulePass):
            k = (op.micro_step, "f" if op.phase == Phase.FORWARD else "b", module_layer.get(p.module, -3))
        elif op.phase == Phase.STEP and getattr(p, "pids", ()):
            k = (op.micro_step, "s", param_layer.get(p.pids[0], -3))
        else:
            continue
        if k != key:
            if key is not None:
                blocks.append((key, start, end))
                start = end
            key = k
        end = op.id + 1
    if key is not None:
        blocks.append((key, start, len(schedule.ops)))
    return blocks


def _alloc_sites(ops) -> tuple[list, list] | None:
    """For every op, the (op id, alloc index) each tag of its `free_before` and `free` releases
    (the latest allocation of the tag in program order); None when a free names no live buffer."""
    live: dict = {}
    before: list = [()] * len(ops)
    after: list = [()] * len(ops)
    for op in ops:
        if op.free_before:
            if any(t not in live for t in op.free_before):
                return None
            before[op.id] = tuple(live.pop(t) for t in op.free_before)
        for i, a in enumerate(op.alloc):
            if a.tag in live:
                return None
            live[a.tag] = (op.id, i)
        if op.free:
            if any(t not in live for t in op.free):
                return None
            after[op.id] = tuple(live.pop(t) for t in op.free)
    return before, after


class _Places:
    """Where each op sits: its block's (micro-step, direction, layer) and its offset in the block."""

    def __init__(self, n_ops: int, blocks):
        self.key: list = [None] * n_ops
        self.offset = [0] * n_ops
        for key, a, end in blocks:
            for x in range(a, end):
                self.key[x], self.offset[x] = key, x - a


def _canon(ops, sites, places: _Places) -> list:
    """Per op of a layer block, what must be equal for it to be the same op one layer on: its
    shape, and each op it waits on or frees an allocation of, as the same op of a block as many
    layers away in the same pass (or the very same op outside the layers). None elsewhere."""
    before, after = sites
    key, offset = places.key, places.offset
    out: list = [None] * len(ops)

    def ref(r, layer):
        k = key[r]
        return (k[0], k[1], k[2] - layer, offset[r]) if k is not None and k[2] >= 0 else r
    for op in ops:
        k = key[op.id]
        if k is None or k[2] < 0:
            continue
        layer = k[2]
        out[op.id] = (op.kind, op.stream, op.phase, op.micro_step, op.stage, op.hook_visits, op.grad_hooks,
                      _shape(op), tuple((a.category, a.size_bytes) for a in op.alloc),
                      tuple(ref(d, layer) for d in op.deps),
                      tuple((ref(r, layer), i) for r, i in before[op.id]),
                      tuple((ref(r, layer), i) for r, i in after[op.id]))
    return out


@dataclass(frozen=True)
class _Gap:
    """Blocks [first, first + count * length) of the full schedule dropped, each a copy of the
    block `length` ops before it; `window` is the (first, end) of the last block kept before."""
    name: str
    region: tuple[int, str]     # (micro-step, direction) of its blocks
    first: int
    count: int
    length: int
    window: tuple[int, int]


def _runs(schedule: Schedule, wl: Workload, sites) -> tuple[dict[tuple[int, str], list[tuple[int, int, int]]], _Places]:
    """Per (micro-step, direction), its blocks (layer, first, end) inside the longest run of
    consecutive layer blocks each a copy of the one before; and where every op sits."""
    blocks = _blocks(schedule, wl)
    ops = schedule.ops
    places = _Places(len(ops), blocks)
    canon = _canon(ops, sites, places)
    runs: dict[tuple[int, str], list] = {}
    current: list = []
    for i, ((micro, direction, layer), a, end) in enumerate(blocks):
        current.append((layer, a, end))
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        step = -1 if direction == "b" else 1
        if (nxt is not None and layer >= 0 and nxt[0] == (micro, direction, layer + step)
                and nxt[2] - nxt[1] == end - a and canon[a:end] == canon[nxt[1]:nxt[2]]):
            continue
        if len(current) > len(runs.get((micro, direction), ())):
            runs[(micro, direction)] = current
        current = []
    return runs, places


def _gaps(schedule: Schedule, wl: Workload, sites) -> tuple[list[_Gap], _Places]:
    """The blocks to drop: layers [g0, g1) of every micro-step's forward and backward (the
    same layers, so activations stay paired), and of the post-step gathers."""
    runs, places = _runs(schedule, wl, sites)
    micros = sorted({m for m, d in runs if d in "fb"})
    if not micros or any((m, d) not in runs for m in micros for d in "fb"):
        return [], places
    s = SETTLING_BLOCKS
    # forward: the window is layer g0 - 1, after `s` periodic blocks; the block after the gap periodic too
    # backward (layers descending): the window is layer g1, after `s` periodic blocks; the block after, g0 - 1
    g0 = max(max(runs[(m, "f")][0][0] + s + 1, runs[(m, "b")][-1][0] + 1) for m in micros)
    g1 = min(min(runs[(m, "f")][-1][0], runs[(m, "b")][0][0] - s) for m in micros)
    gaps = []
    if g1 - g0 >= 1:
        for m in micros:
            for d in "fb":
                by_layer = {layer: (a, end) for layer, a, end in runs[(m, d)]}
                window = by_layer[g0 - 1] if d == "f" else by_layer[g1]
                first = by_layer[g0][0] if d == "f" else by_layer[g1 - 1][0]
                name = f"{'forward' if d == 'f' else 'backward'} of layer {g0 - 1 if d == 'f' else g1}, micro-step {m}"
                gaps.append(_Gap(name, (m, d), first, g1 - g0, window[1] - window[0], window))
    for (m, d), run in runs.items():
        if d == "s" and len(run) > s + 2:
            window = run[s]
            gaps.append(_Gap(f"post-step gathers of layer {window[0]}", (m, d), window[2], len(run) - s - 2,
                             window[2] - window[1], (window[1], window[2])))
    return sorted(gaps, key=lambda g: g.first), places


def compress(schedule: Schedule, wl: Workload) -> tuple[Schedule, list[_Gap], list[int]] | None:
    """The schedule without its gaps' blocks, each kept op renumbered, or None when nothing
    repeats. Also the gaps and, per kept op, its id in the full schedule."""
    if schedule.pipeline is not None:
        return None
    sites = _alloc_sites(schedule.ops)
    if sites is None:
        return None
    gaps, places = _gaps(schedule, wl, sites)
    if not gaps:
        return None
    ops = schedule.ops
    target = list(range(len(ops)))      # a dropped op stands for its copy in the last kept blocks
    gap_of = [-1] * len(ops)
    for i, g in enumerate(gaps):
        span = g.count * g.length
        for x in range(g.first, g.first + span):
            target[x] = x - span
            gap_of[x] = i
    kept = [x for x in range(len(ops)) if target[x] == x]
    new_id = [-1] * len(ops)
    for i, x in enumerate(kept):
        new_id[x] = i
    before, after = sites
    out = []
    for i, x in enumerate(kept):
        op = ops[x]
        # a dropped op stands for its copy only within its own pass: a kept op of another pass
        # that refers to it (the backward below the gap to a forward block in it) would not fit
        refs = list(op.deps) + [s[0] for s in before[x]] + [s[0] for s in after[x]]
        if any(gap_of[r] >= 0 and not _stands_in(gaps[gap_of[r]], r, places.key[x][:2]) for r in refs):
            return None
        deps = tuple(sorted({new_id[target[d]] for d in op.deps}))
        if any(d < 0 for d in deps):
            return None
        free = tuple(ops[target[s[0]]].alloc[s[1]].tag for s in after[x])
        free_before = tuple(ops[target[s[0]]].alloc[s[1]].tag for s in before[x])
        out.append(Op(i, op.kind, op.stream, op.phase, op.micro_step, op.payload, deps, op.alloc, free,
                      op.hook_visits, op.grad_hooks, op.stage, free_before))
    return replace(schedule, ops=tuple(out)), gaps, kept


def _stands_in(gap: _Gap, r: int, region: tuple[int, str]) -> bool:
    """A kept op of `region` may refer to dropped op r: r's copy is in the blocks kept before
    the gap, the window and the settling blocks checked with it, and the referring op is of the
    gap's own pass (a kept op of another pass, e.g. the backward below the gap referring to a
    forward block in it, would have to name a different copy)."""
    end = gap.first + gap.count * gap.length
    return gap.region == region and r >= end - (SETTLING_BLOCKS + 1) * gap.length


# -- the shortened step simulated ---------------------------------------------------------------

def _window(gap: _Gap, schedule: Schedule, new_id: dict[int, int], timings, events, tol: float) -> LayerWindow | None:
    """The gap's window when the simulated window block and the two before it ran one period apart."""
    a, end = gap.window
    length = gap.length

    def opens(first):
        return min(timings[new_id[x]].start_s for x in range(first, first + length))
    try:
        lo, prev, prev2 = opens(a), opens(a - length), opens(a - 2 * length)
        after = new_id[end - 1] + 1
        hi = min(timings[i].start_s for i in range(after, after + length))
    except (KeyError, ValueError, IndexError):
        return None
    period = lo - prev
    if period <= 0 or abs(prev - prev2 - period) > tol or abs(hi - lo - period) > tol:
        return None
    earlier, window = [], []
    for op in schedule.ops:
        _, start, stop = timings[op.id]
        if lo - period <= start < lo:
            earlier.append(op)
        elif lo <= start < hi:
            window.append(op)
        elif start < lo - period and stop > lo:
            return None     # still running from before: the window's state would differ
    if len(window) != length or len(earlier) != length:
        return None

    def order(op):
        return op.stream, timings[op.id].start_s, op.id
    earlier.sort(key=order)
    window.sort(key=order)
    for x, y in zip(earlier, window):
        tx, ty = timings[x.id], timings[y.id]
        if (x.kind is not y.kind or x.stream != y.stream or _shape(x) != _shape(y)
                or abs(ty.start_s - tx.start_s - period) > tol or abs(ty.end_s - tx.end_s - period) > tol):
            return None
    ev_earlier = [e for e in events if lo - period <= e[0] < lo]
    ev_window = [e for e in events if lo <= e[0] < hi]
    if len(ev_earlier) != len(ev_window) or any(
            x[1] != y[1] or x[2] != y[2] or abs(y[0] - x[0] - period) > tol for x, y in zip(ev_earlier, ev_window)):
        return None
    delta: dict[str, float] = {}
    for _, d, cat, _ in ev_window:
        delta[cat] = delta.get(cat, 0.0) + d
    return LayerWindow(gap.name, gap.count + 1, period, lo, hi, frozenset(op.id for op in window),
                       tuple(sorted(delta.items())))


def simulate_layers(schedule: Schedule, wl: Workload, cluster, precision: str) -> Trace:
    """`simulate(schedule)`, with its identical layers simulated once per window when they repeat
    exactly; otherwise every op."""
    compressed = compress(schedule, wl)
    if compressed is None:
        return simulate(schedule, cluster, precision)
    short, gaps, kept = compressed
    try:
        timings, ledgers = run_ops(short, cluster, precision)
    except LedgerError:
        return simulate(schedule, cluster, precision)
    events = ledgers[0].events()
    if any(not float(d).is_integer() for _, d, _, _ in events):
        return simulate(schedule, cluster, precision)
    new_id = {x: i for i, x in enumerate(kept)}
    tol = _REL_TOL * max(max(t.end_s for t in timings), 1.0)
    windows = []
    for gap in gaps:
        w = _window(gap, short, new_id, timings, events, tol)
        if w is None:
            return simulate(schedule, cluster, precision)
        windows.append(w)
    windows.sort(key=lambda w: w.start_s)
    if any(a.end_s > b.start_s for a, b in zip(windows, windows[1:])):
        return simulate(schedule, cluster, precision)
    repeat = LayerRepeat(tuple(windows))
    ops = len(short.ops) + sum((w.copies - 1) * len(w.ops) for w in windows)
    if ops != len(schedule.ops):
        return simulate(schedule, cluster, precision)
    end = repeat.shift_s(max(t.end_s for t in timings))
    return Trace(short, tuple(timings), events, end, ops, repeat)
