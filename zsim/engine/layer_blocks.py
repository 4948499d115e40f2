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
from zsim.schedule.gap_rules import MAX_PERIOD_LAYERS, SETTLING_BLOCKS, least_copies, settle_chunks
from zsim.schedule.payloads import Copy, ModulePass
from zsim.workload.module import Workload



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
        for pid in m.params:
            param_layer.setdefault(pid, m.layer)
    blocks: list[tuple[tuple, int, int]] = []
    key, start, end = None, 0, 0
    for op in schedule.ops:
        p = op.payload
        if isinstance(p, ModulePass):
            k = (op.micro_step, "f" if op.phase == Phase.FORWARD else "b", module_layer.get(p.module, -3))
        elif op.phase == Phase.STEP and (pids := getattr(p, "pids", None)):
            k = (op.micro_step, "s", param_layer.get(pids[0], -3))
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
    (the latest allocation of the tag in program order); None when a free names no live buffer.
    A tag is keyed by its fields: its own hash goes through the Enum's Python-level __hash__."""
    live: dict = {}
    before: list = [()] * len(ops)
    after: list = [()] * len(ops)
    pop = live.pop
    for op in ops:
        if op.free_before:
            keys = [(id(t.buffer), t.micro, t.key, t.phase) for t in op.free_before]
            if any(k not in live for k in keys):
                return None
            before[op.id] = tuple(pop(k) for k in keys)
        if op.alloc:
            x = op.id
            for i, a in enumerate(op.alloc):
                t = a.tag
                k = (id(t.buffer), t.micro, t.key, t.phase)
                if k in live:
                    return None
                live[k] = (x, i)
        if op.free:
            keys = [(id(t.buffer), t.micro, t.key, t.phase) for t in op.free]
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


def _canon(ops, sites, places: _Places, n_ops: int | None = None) -> list:
    """Per op of a layer block, a number standing for what must be equal for it to be the same op
    one layer on: its shape, and each op it waits on or frees an allocation of, as the same op of
    a block as many layers away in the same pass (pos minus the layer's), or the very same op
    outside the layers (its id). None elsewhere. Equal numbers, equal ops: each distinct
    description is numbered once (so blocks compare as lists of ints, not of payloads)."""
    before, after = sites
    key, pos = places.key, places.pos
    out: list = [None] * (len(ops) if n_ops is None else n_ops)
    numbers: dict = {}
    shapes: dict = {}
    for op in ops:
        x = op.id
        k = key[x]
        if k is None or k[2] < 0:
            continue
        shift = k[2] * _SPAN
        refs = [(pos[d] - shift) if pos[d] is not None else (d,) for d in op.deps]
        refs.append(len(refs))
        for r, i in before[x]:
            refs.append((pos[r] - shift) if pos[r] is not None else (r,))
            refs.append(i)
        refs.append(-1)     # frees after: apart from frees before
        for r, i in after[x]:
            refs.append((pos[r] - shift) if pos[r] is not None else (r,))
            refs.append(i)
        p = op.payload
        shape = getattr(p, "comm", None) or getattr(p, "work", None) or op_shape(op)
        shape_no = shapes.setdefault(shape, len(shapes))
        c = (op.kind, op.stream, op.phase, op.micro_step, op.pipe_stage, op.hook_visits, op.grad_hooks, op.host_views,
             shape_no, tuple([(a.category, a.size_bytes, a.touched_bytes) for a in op.alloc]) if op.alloc else None,
             tuple(refs))
        out[x] = numbers.setdefault(c, len(numbers))
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
    layers: int = 1             # layers per copy (the period of their IPG buckets)
    settle: int = SETTLING_BLOCKS   # kept periodic blocks before the window (see `_reach`)
    dropped: tuple[int, int] | None = None   # a forward's or backward's layers [g0, g1) (`_layer_gaps`)

    def narrowed(self, low: int, high: int) -> "Gap":
        """The gap of a forward or backward without its `low` lowest and `high` highest chunks
        (layers [g0 + low p, g1 - high p)): a forward, layers ascending, starts its gap `low`
        chunks later (its window with it), a backward, descending, `high` chunks later."""
        m, d = self.region
        assert self.dropped is not None     # a forward's or backward's gap (_layer_gaps)
        g0, g1 = self.dropped[0] + low * self.layers, self.dropped[1] - high * self.layers
        shift = (low if d == "f" else high) * self.length
        return replace(self, name=_gap_name(m, d, g0, g1, self.layers), first=self.first + shift,
                       count=self.count - low - high, window=(self.window[0] + shift, self.window[1] + shift),
                       dropped=(g0, g1))


def _chunks(blocks, p: int, phase: int, descending: bool) -> list[tuple[int, int, int]]:
    """A pass's layer blocks, `p` layers at a time: (lowest layer, first op, end op) of each chunk
    of layers [s, s + p) with s = phase mod p, in the pass's order (its blocks are consecutive)."""
    by_layer = {layer: (a, end) for layer, a, end in blocks}
    out = []
    for s in sorted({layer - (layer - phase) % p for layer in by_layer}, reverse=descending):
        layers = range(s, s + p)
        if all(x in by_layer for x in layers):
            spans = [by_layer[x] for x in layers]
            out.append((s, min(a for a, _ in spans), max(end for _, end in spans)))
    return out


def _run(chunks, canon, p: int, descending: bool) -> tuple[int, int] | None:
    """[lowest, highest] layer of the longest run of consecutive chunks each the one before, p layers on."""
    best, start = None, 0
    for i in range(len(chunks) + 1):
        same = (0 < i < len(chunks) and chunks[i][0] == chunks[i - 1][0] + (-p if descending else p)
                and chunks[i][2] - chunks[i][1] == chunks[i - 1][2] - chunks[i - 1][1]
                and canon[chunks[i][1]:chunks[i][2]] == canon[chunks[i - 1][1]:chunks[i - 1][2]])
        if not same and i > 0:
            if i - start > 1 and (best is None or i - start > best[0]):
                layers = [chunks[j][0] for j in range(start, i)]
                best = (i - start, min(layers), max(layers) + p - 1)
            start = i
    return None if best is None else best[1:]


def _passes(schedule: Schedule, wl: Workload, sites, blocks=None, layers: bool = True):
    """Each pass's (micro-step, direction) layer blocks in order, the canonical ops, where every op
    sits; `layers=False`: only the post-step gathers' ops are numbered (the others left None)."""
    blocks = _blocks(schedule, wl) if blocks is None else blocks
    places = _Places(len(schedule.ops), blocks)
    ops: tuple[Op, ...] | list[Op] = schedule.ops
    if not layers:
        ops = [ops[x] for key, a, end in blocks if key[1] == "s" and key[2] >= 0 for x in range(a, end)]
    canon = _canon(ops, sites, places, len(schedule.ops))
    return _layer_passes(blocks), canon, places


def _layer_passes(blocks) -> dict[tuple[int, str], list]:
    passes: dict[tuple[int, str], list] = {}
    for (micro, direction, layer), a, end in blocks:
        if layer >= 0:
            passes.setdefault((micro, direction), []).append((layer, a, end))
    return passes


def _runs(chunks, keys, p: int, descending: bool):
    """Every maximal run of two or more consecutive chunks each the one before, p layers on,
    by `keys` per op: (lowest, highest) layer, like `_run`'s longest."""
    start = 0
    for i in range(len(chunks) + 1):
        same = (0 < i < len(chunks) and chunks[i][0] == chunks[i - 1][0] + (-p if descending else p)
                and chunks[i][2] - chunks[i][1] == chunks[i - 1][2] - chunks[i - 1][1]
                and keys[chunks[i][1]:chunks[i][2]] == keys[chunks[i - 1][1]:chunks[i - 1][2]])
        if not same and i > 0:
            if i - start > 1:
                layers = [chunks[j][0] for j in range(start, i)]
                yield min(layers), max(layers) + p - 1
            start = i


def _may_repeat(ops, blocks) -> bool:
    """False when no micro-step's forward and backward can drop a layer (`_layer_gaps` would
    find nothing), decided without `_canon`: two blocks `_canon` finds equal have the same
    length and, op for op, the same kind, stream and collective size (the coarse key here), so
    each run `_layer_gaps` could use lies in a run of coarse keys at least as long, whose range
    of droppable layers holds its own; the fewest settling chunks and copies are assumed (more
    only narrow the range). Schedules with post-step gather blocks are left to `_gaps`.
    ZeRO-1/2 at scale is the case: each layer's reductions split at the partition boundaries,
    which fall elsewhere in every layer (175B on 1,024 GPUs: no two backward blocks alike)."""
    passes = _layer_passes(blocks)
    return any(d == "s" for _, d in passes) or _layers_may_repeat(ops, passes)


def _layers_may_repeat(ops, passes) -> bool:
    """`_may_repeat` for the forward and backward passes alone: False when `_layer_gaps` would
    find nothing. A many-expert model under ZeRO-3 is the case: its gradient bucket flushes a few
    experts further into every layer's backward, so no two backward blocks are alike, while its
    post-step gathers still repeat (`_gaps` then numbers only their ops)."""
    micros = sorted({m for m, _ in passes})
    if not micros or any((m, d) not in passes for m in micros for d in "fb"):
        return False
    numbers: dict = {}
    keys = []
    for op in ops:      # each distinct key numbered once: chunks compare as lists of ints
        comm = getattr(op.payload, "comm", None)
        keys.append(numbers.setdefault((op.kind, op.stream, None if comm is None else comm.numel), len(numbers)))
    s = SETTLING_BLOCKS
    for p in range(1, MAX_PERIOD_LAYERS + 1):
        for phase in range(p):
            for m in micros:
                forward = list(_runs(_chunks(passes[(m, "f")], p, phase, False), keys, p, False))
                backward = list(_runs(_chunks(passes[(m, "b")], p, phase, True), keys, p, True)) if forward else []
                for f0, f1 in forward:
                    for b0, b1 in backward:
                        lo, hi = max(f0 + (s + 1) * p, b0 + p), min(f1 - p + 1, b1 - (s + 1) * p + 1)
                        if _span(lo, hi, phase, p) >= p:
                            return True
    return False


def _reach(ops, sites, places: _Places, passes) -> dict[tuple[int, str], int]:
    """Per pass, the most layers between an op of its middle layer block and an op of the same
    pass it waits on or frees an allocation of (ZeRO-3 prefetches several layers ahead when each
    rank's share of a layer is small, e.g. under tensor parallelism). A kept block after a gap
    refers that far back into the dropped blocks, so that many periodic blocks must be kept
    before the gap for each reference to stand in for (`_stands_in`). Every block of a run of
    identical blocks refers as far (`_canon` compares the references); one outside the runs
    that refers further into a gap is caught by `_stands_in` (every op is then simulated)."""
    key = places.key
    out: dict[tuple[int, str], int] = {}
    for region, blocks in passes.items():
        layer, a, end = blocks[len(blocks) // 2]
        reach = 0
        for x in range(a, end):
            for r in _refs(ops[x], sites):
                k = key[r]
                if k is not None and k[2] >= 0 and k[0] == region[0] and k[1] == region[1]:
                    reach = max(reach, abs(layer - k[2]))
        out[region] = reach
    return out


def _refs(op: Op, sites) -> list[int]:
    """The ops `op` waits on or frees an allocation of (before it runs or after)."""
    before, after = sites
    return [*op.deps, *(r for r, _ in before[op.id]), *(r for r, _ in after[op.id])]



def _layer_gaps(passes, canon, reach) -> list[Gap]:
    """Layers [g0, g1) dropped from a micro-step's forward and backward (the same layers, so
    activations stay paired), `p` at a time, for the shortest period p that drops any, in every
    micro-step whose forward and backward both repeat over them (a boundary backward whose
    reductions have no short period keeps its micro-step whole). Forward: the window is the
    chunk before g0 after `settle_chunks` periodic chunks, and the chunk after the gap is periodic
    too; backward (layers descending): the window is the chunk from g1, likewise."""
    micros = sorted({m for m, d in passes if d in "fb"})
    if not micros or any((m, d) not in passes for m in micros for d in "fb"):
        return []
    far = max(reach[(m, d)] for m in micros for d in "fb")
    for p in range(1, MAX_PERIOD_LAYERS + 1):
        s = settle_chunks(far, p)
        least = p * least_copies(far, p)
        for phase in range(p):
            lo, hi = -1 << 30, 1 << 30
            chunks, joined = {}, []
            for m in micros:
                m_lo, m_hi = lo, hi
                for d in "fb":
                    chunks[(m, d)] = _chunks(passes[(m, d)], p, phase, d == "b")
                    run = _run(chunks[(m, d)], canon, p, d == "b")
                    if run is None:
                        break
                    if d == "f":
                        m_lo, m_hi = max(m_lo, run[0] + (s + 1) * p), min(m_hi, run[1] - p + 1)
                    else:
                        m_lo, m_hi = max(m_lo, run[0] + p), min(m_hi, run[1] - (s + 1) * p + 1)
                else:
                    if _span(m_lo, m_hi, phase, p) >= least:
                        lo, hi = m_lo, m_hi
                        joined.append(m)
            if joined:
                g0, g1 = lo + (phase - lo) % p, hi - (hi - phase) % p
                return [_gap(chunks[(m, d)], m, d, g0, g1, p, s) for m in joined for d in "fb"]
    return []


def _span(lo: int, hi: int, phase: int, p: int) -> int:
    """Layers of [lo, hi] in whole chunks of `p` starting at `phase` mod p."""
    return (hi - (hi - phase) % p) - (lo + (phase - lo) % p)


def _gap(chunks, m: int, d: str, g0: int, g1: int, p: int, settle: int) -> Gap:
    at = {low: (a, end) for low, a, end in chunks}
    window, first = (at[g0 - p], at[g0][0]) if d == "f" else (at[g1], at[g1 - p][0])
    return Gap(_gap_name(m, d, g0, g1, p), (m, d), first, (g1 - g0) // p, window[1] - window[0], window, p, settle,
               (g0, g1))


def _gap_name(m: int, d: str, g0: int, g1: int, p: int) -> str:
    """A gap is named after its window: the last chunk of layers the pass runs before it."""
    name = f"forward of layers {g0 - p}-{g0 - 1}" if d == "f" else f"backward of layers {g1 + p - 1}-{g1}"
    return f"{name}, micro-step {m}"


def _gaps(schedule: Schedule, wl: Workload, sites, blocks=None, layers: bool = True) -> tuple[list[Gap], _Places]:
    """The blocks to drop: the layers of every micro-step's forward and backward (unless
    `layers` is False: `_layers_may_repeat` found none can drop), and of the post-step gathers
    (one layer at a time)."""
    passes, canon, places = _passes(schedule, wl, sites, blocks, layers)
    reach = _reach(schedule.ops, sites, places, passes)
    gaps = _layer_gaps(passes, canon, reach) if layers else []
    for (m, d), blocks in passes.items():
        s = settle_chunks(reach[(m, d)], 1)
        run = _run(blocks, canon, 1, False) if d == "s" else None
        if run is not None and run[1] - run[0] - s - 1 >= least_copies(reach[(m, d)], 1):
            at = {layer: (a, end) for layer, a, end in blocks}
            window = at[run[0] + s]
            gaps.append(Gap(f"post-step gathers of layer {run[0] + s}", (m, d), window[1], run[1] - run[0] - s - 1,
                            window[1] - window[0], window, settle=s))
    return sorted(gaps, key=lambda g: g.first), places


class Refused(Exception):
    """Some gaps cannot be dropped: kept ops of their micro-steps refer into them in a way no
    kept copy stands in for. `regions` are the passes ((micro-step, direction)) to keep whole."""

    def __init__(self, regions: frozenset):
        super().__init__(regions)
        self.regions = regions


def whole_regions(gap: Gap) -> frozenset:
    """The passes kept whole when `gap` cannot be dropped: its micro-step's forward and backward
    (they drop the same layers, so activations stay paired), or its post-step gathers."""
    m, d = gap.region
    return frozenset({(m, "f"), (m, "b")}) if d in "fb" else frozenset({gap.region})


@dataclass(frozen=True)
class GapPlan:
    """The blocks a schedule can drop (`gaps`), with what `compress` needs to drop them."""
    gaps: tuple[Gap, ...]
    sites: tuple
    places: _Places

    def narrowed(self, forward: float, backward: float) -> "GapPlan | None":
        """[Note: a window moved past a settling pass] The plan with every micro-step's forward
        gap starting `forward` of the way into what it could spare, and its backward gap
        `backward` of the way (its window with it), or None when that moves nothing. A window at
        the start of a pass can fall in what the previous pass left running (a micro-step's
        forward beside the previous backward's offloaded gradient copies) while its later layers
        run alike. Every micro-step moves alike, so their shortened passes stay alike for
        steady.py; a gap keeps at least the chunks kept before its window (settle + 1 >=
        gap_rules.least_copies)."""
        out, moved = [], False
        for g in self.gaps:
            if g.dropped is None:      # post-step gathers
                out.append(g)
                continue
            spare = max(0, g.count - (g.settle + 1))   # _layer_gaps leaves least_copies, maybe fewer
            low, high = int(spare * forward), int(spare * backward)
            moved |= low + high > 0
            out.append(g.narrowed(low, high))
        return replace(self, gaps=tuple(out)) if moved else None


def plan_gaps(schedule: Schedule, wl: Workload) -> GapPlan | None:
    """The schedule's gaps, or None when nothing repeats."""
    if schedule.pipeline is not None:
        return None
    blocks = _blocks(schedule, wl)
    # _may_repeat, its two parts kept apart
    passes = _layer_passes(blocks)
    layers = _layers_may_repeat(schedule.ops, passes)
    if not layers and not any(d == "s" for _, d in passes):
        return None
    sites = _alloc_sites(schedule.ops)
    if sites is None:
        return None
    gaps, places = _gaps(schedule, wl, sites, blocks, layers)
    return GapPlan(tuple(gaps), sites, places) if gaps else None


def compress(schedule: Schedule, plan: GapPlan,
             whole: frozenset = frozenset()) -> tuple[Schedule, list[Gap], list[int]] | None:
    """The schedule without the blocks of `plan`'s gaps, each kept op renumbered, or None when
    no gap is left; the passes in `whole` ((micro-step, direction)) drop nothing. Also the gaps
    and, per kept op, its id in the full schedule. Raises Refused naming the passes to keep
    whole when a kept op refers into a gap where no kept copy stands in for the dropped op."""
    gaps = [g for g in plan.gaps if g.region not in whole]
    if not gaps:
        return None
    sites, places = plan.sites, plan.places
    ops = schedule.ops
    n = len(ops)
    target = list(range(n))      # a dropped op stands for its copy in the last kept blocks
    gap_of = [-1] * n
    kept: list[int] = []
    start = 0
    for i, g in enumerate(gaps):
        span = g.count * g.length
        target[g.first:g.first + span] = range(g.first - span, g.first)
        gap_of[g.first:g.first + span] = [i] * span
        kept += range(start, g.first)
        start = g.first + span
    kept += range(start, n)
    new_id = [-1] * n
    for i, x in enumerate(kept):
        new_id[x] = i
    before, after = sites
    out = []
    refused: set = set()
    # an op before the first gap keeps its id, and what it waits on and frees keep theirs: it
    # refers into no gap, and is rebuilt only where its deps are not in the sorted, distinct
    # form every rebuilt op gets
    unmoved = min(g.first for g in gaps)
    for i, x in enumerate(kept):
        op = ops[x]
        if x < unmoved:
            deps = op.deps
            if all(a < b for a, b in zip(deps, deps[1:])):
                out.append(op)
                continue
        # a dropped op stands for its copy only within its own pass: a kept op of another pass
        # that refers to it (the backward below the gap to a forward block in it) would not fit
        for r in _refs(op, sites):
            if gap_of[r] >= 0 and not _stands_in(gaps[gap_of[r]], r, places.key[x][:2]):
                refused |= whole_regions(gaps[gap_of[r]])
        for d in op.deps:
            if new_id[target[d]] < 0:   # its stand-in was dropped by another gap
                refused.update(*(whole_regions(gaps[gap_of[y]]) for y in (d, target[d]) if gap_of[y] >= 0))
        if refused:
            continue
        deps = tuple(sorted({new_id[target[d]] for d in op.deps}))
        free = tuple(ops[target[s[0]]].alloc[s[1]].tag for s in after[x])
        free_before = tuple(ops[target[s[0]]].alloc[s[1]].tag for s in before[x])
        out.append(Op(i, op.kind, op.stream, op.phase, op.micro_step, op.payload, deps, op.alloc, free,
                      op.hook_visits, op.grad_hooks, op.pipe_stage, free_before, op.host_views))
    if refused:
        raise Refused(frozenset(refused))
    return replace(schedule, ops=tuple(out)), gaps, kept


def _stands_in(gap: Gap, r: int, region: tuple[int, str]) -> bool:
    """A kept op of `region` may refer to dropped op r: r's copy is in the blocks kept before
    the gap, the window and the settling blocks checked with it, and the referring op is of the
    gap's own pass (a kept op of another pass, e.g. the backward below the gap referring to a
    forward block in it, would have to name a different copy)."""
    end = gap.first + gap.count * gap.length
    return gap.region == region and r >= end - (gap.settle + 1) * gap.length


