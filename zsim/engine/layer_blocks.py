"""The schedule's transformer blocks, for layer_repeat.py: which ops are the same ops one layer on,
and the schedule without the blocks in the middle of each run of identical blocks.

A module's compute op anchors the block of its layer; the ops between anchors (gathers,
reductions, copies) belong to the next anchor's block. Block k+1 is block k one layer on when
every op has the same shape (what CostModel.op_cost prices and summarize counts: the call, the
work, the copy, the hooks before it, the sizes it allocates), on the same stream, and waits on
and frees allocations of the same ops of blocks as many layers away (`_canon`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from zsim.schedule.ir import Op, Phase, Schedule
from zsim.schedule.payloads import Copy, ModulePass
from zsim.workload.module import Workload

# periodic blocks simulated before a window: the two whose periods are compared, and one that
# may still be settling from the blocks before the run
SETTLING_BLOCKS = 3


def op_shape(op: Op):
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


def _tag_key(t):
    # a Tag's own hash goes through the Enum's Python-level __hash__; its fields hash in C
    return id(t.buffer), t.micro, t.key, t.phase


def _alloc_sites(ops) -> tuple[list, list] | None:
    """For every op, the (op id, alloc index) each tag of its `free_before` and `free` releases
    (the latest allocation of the tag in program order); None when a free names no live buffer."""
    live: dict = {}
    before: list = [()] * len(ops)
    after: list = [()] * len(ops)
    pop = live.pop
    for op in ops:
        if op.free_before:
            keys = [_tag_key(t) for t in op.free_before]
            if any(k not in live for k in keys):
                return None
            before[op.id] = tuple(pop(k) for k in keys)
        for i, a in enumerate(op.alloc):
            k = _tag_key(a.tag)
            if k in live:
                return None
            live[k] = (op.id, i)
        if op.free:
            keys = [_tag_key(t) for t in op.free]
            if any(k not in live for k in keys):
                return None
            after[op.id] = tuple(pop(k) for k in keys)
    return before, after


class _Places:
    """Where each op sits: its block's (micro-step, direction, layer) and its offset in the block,
    and a number per op (`pos`) from which `_canon` reads both in one subtraction: block k's op
    at offset j of a pass's layer L is (pass * _SPAN + L) * _SPAN + j."""

    def __init__(self, n_ops: int, blocks):
        self.key: list = [None] * n_ops
        self.pos: list = [None] * n_ops
        passes: dict = {}
        for key, a, end in blocks:
            if key[2] < 0:
                for x in range(a, end):
                    self.key[x] = key
                continue
            base = (passes.setdefault(key[:2], len(passes)) * _SPAN + key[2]) * _SPAN
            for x in range(a, end):
                self.key[x], self.pos[x] = key, base + x - a


# more than any layer count and any block's ops
_SPAN = 1 << 20


def _canon(ops, sites, places: _Places) -> list:
    """Per op of a layer block, what must be equal for it to be the same op one layer on: its
    shape, and each op it waits on or frees an allocation of, as the same op of a block as many
    layers away in the same pass (pos minus the layer's), or the very same op outside the
    layers (its id). None elsewhere."""
    before, after = sites
    key, pos = places.key, places.pos
    out: list = [None] * len(ops)
    for op in ops:
        k = key[op.id]
        if k is None or k[2] < 0:
            continue
        shift = k[2] * _SPAN
        refs = [(pos[d] - shift) if pos[d] is not None else (d,) for d in op.deps]
        for r, i in before[op.id]:
            refs += ((pos[r] - shift) if pos[r] is not None else (r,), i)
        refs.append(-1 << 62)     # frees after: apart from frees before
        for r, i in after[op.id]:
            refs += ((pos[r] - shift) if pos[r] is not None else (r,), i)
        out[op.id] = (op.kind, op.stream, op.phase, op.micro_step, op.stage, op.hook_visits, op.grad_hooks,
                      op_shape(op), [(a.category, a.size_bytes) for a in op.alloc] if op.alloc else None,
                      len(op.deps), refs)
    return out


@dataclass(frozen=True)
class Gap:
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


def _gaps(schedule: Schedule, wl: Workload, sites) -> tuple[list[Gap], _Places]:
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
                gaps.append(Gap(name, (m, d), first, g1 - g0, window[1] - window[0], window))
    for (m, d), run in runs.items():
        if d == "s" and len(run) > s + 2:
            window = run[s]
            gaps.append(Gap(f"post-step gathers of layer {window[0]}", (m, d), window[2], len(run) - s - 2,
                             window[2] - window[1], (window[1], window[2])))
    return sorted(gaps, key=lambda g: g.first), places


def compress(schedule: Schedule, wl: Workload) -> tuple[Schedule, list[Gap], list[int]] | None:
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


def _stands_in(gap: Gap, r: int, region: tuple[int, str]) -> bool:
    """A kept op of `region` may refer to dropped op r: r's copy is in the blocks kept before
    the gap, the window and the settling blocks checked with it, and the referring op is of the
    gap's own pass (a kept op of another pass, e.g. the backward below the gap referring to a
    forward block in it, would have to name a different copy)."""
    end = gap.first + gap.count * gap.length
    return gap.region == region and r >= end - (SETTLING_BLOCKS + 1) * gap.length


