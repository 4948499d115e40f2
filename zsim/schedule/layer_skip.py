"""ZeRO-3 layers the builder does not build, exactly (zsim/engine/layer_repeat.py checks them in time).

[Note: layers the builder skips]
A transformer's blocks are alike, and ZeRO-3's hooks act on state (ParamCoordinator, the
gradient bucket) that, some layers into a pass, is the same at each block's first module up to
a one-layer shift. The builder is deterministic, so once its state before layer l+1 is its
state before layer l one layer on, and every input it reads in between is too (the blocks'
modules and parameters, the recorded visit trace as far as the prefetcher reads it, which
params the reuse distance keeps), layer l+1 adds layer l's ops one layer on, and so does
every layer after it. Then the pass need not build layers [a, b): the state is shifted by
b - a layers (parameter ids, visit and trace positions, the bucket counter) and the pass goes
on at layer b. Op ids in the state are not shifted: a dropped op stands for its copy as many
layers earlier, the one built, and a gathered param's tag names
the copy's (ParamCoordinator.tag_pid). The state is compared in a relative form
(`_fingerprint`): ids within REACH layers of the boundary as offsets, older ones as they are;
an older op or param that changes from layer to layer leaves the pass whole. A micro-step's
backward drops the layers its forward dropped (their activations are never allocated); if its
own state does not repeat over them, the step is built whole (`Abort`; so is a step whose first
forward does not repeat); its gradient bucket may
fill alike only every few layers, so the forward drops a multiple of that period (read from
the bucket's fill at each block: grad_buckets.bucket_fill) and the backward drops whole
periods. The post-step gathers of the persistent params repeat layer by layer and drop the
middle layers likewise.
The blocks built before each gap (SETTLE periodic ones and the window) are what the engine
compares (zsim/engine/layer_repeat.py); the schedule carries the gaps (Schedule.skipped).
tests/schedule/test_layer_skip.py compares the schedule with building every layer, and the step
with simulating every op.
"""
from __future__ import annotations

from dataclasses import fields
from operator import attrgetter

from zsim.schedule.grad_buckets import bucket_fill
from zsim.schedule.ir import Phase, SkippedLayers
from zsim.schedule.param_fetch import AVAILABLE, NOT_AVAILABLE
from zsim.workload.module import Module, Param

# periodic blocks built before a window at least: the three periods the engine compares
# (layer_repeat._window) end with it, and one more that may still be settling from the blocks
# before; more when a block waits on (or frees a buffer of) a block further back (its reach)
SETTLE = 3
# the longest period, in layers, tried (a gradient bucket that spans a few layers fills alike
# every few layers); also how far back (and ahead) an id of the state is compared as an offset
# from the boundary's (ZeRO-3 prefetches several layers ahead when a rank's share of a layer is small)
REACH = 8
# backward blocks built before its state repeats, at most (more: the step is built whole)
BACKWARD_START = 3


def least_copies(reach: int, p: int) -> int:
    """Chunks of `p` layers a gap must drop so that what a kept block after it refers to in the
    gap stands in for a kept op no kept block after the gap refers to itself (fewer, and two
    references would name one op: its buffer freed twice)."""
    return max(1, -(-reach // p))


def settle_chunks(reach: int, p: int) -> int:
    """Periodic chunks of `p` layers built before a window: SETTLE, or enough that a block
    `reach` layers on refers back to built ones only (the window is one more)."""
    return max(SETTLE, least_copies(reach, p) - 1)


class Abort(Exception):
    """A backward could not drop the layers its forward dropped: build every layer."""


# what a module and a param are but for their names, layer and ids
_MODULE_FACTS = attrgetter(*(f.name for f in fields(Module) if f.name not in ("name", "layer", "params", "containers")))
_PARAM_FACTS = attrgetter(*(f.name for f in fields(Param) if f.name != "name"))


class _Geometry:
    """The run of identical blocks: params per layer, and per direction visits and trace entries
    per layer, each layer's first visit and trace position."""

    def __init__(self, ctx, fetch, ready):
        wl = ctx.wl
        self.layers = n = wl.layers
        mods = [wl.layer_modules(x) for x in range(n)]
        pids = [sorted({p for m in ms for p in m.params}) for ms in mods]
        self.ok = n >= 2 * SETTLE + 8 and all(pids)
        if not self.ok:
            return
        self.base0, self.ppl = pids[0][0], len(pids[0])
        self.first_module = {}
        for i, m in enumerate(wl.modules):
            if m.layer >= 0:
                self.first_module.setdefault(m.layer, i)
        self.last_module = {m.layer: i for i, m in enumerate(wl.modules) if m.layer >= 0}
        region = range(self.base0, self.base0 + n * self.ppl)
        self.ok = (all(ps == list(range(self.base0 + x * self.ppl, self.base0 + (x + 1) * self.ppl))
                       for x, ps in enumerate(pids))
                   and not any(p in region for m in wl.modules if m.layer < 0 for p in m.params)
                   and self._alike(wl, mods))
        if self.ok:
            self.ok = self._visits(fetch)
        if self.ok:
            self._fills(ctx, ready)

    def _fills(self, ctx, ready):
        """The gradient bucket's elements at each backward block's boundary (layers descending),
        its hooks adding each module's `ready` gradients (grad_buckets.bucket_fill)."""
        numels, size = [q.numel for q in ctx.wl.params], ctx.sc.zero.reduce_bucket_size
        self.fills = [0] * self.layers
        fill = 0
        for i in range(len(ctx.wl.modules) - 1, -1, -1):
            m = ctx.wl.modules[i]
            if m.layer >= 0 and self.last_module[m.layer] == i:
                self.fills[m.layer] = fill
            fill = bucket_fill(fill, [numels[q] for q in ready[m.name]], size)

    def _alike(self, wl, mods) -> bool:
        first = self._key(wl, mods, 0)
        return all(self._key(wl, mods, x) == first for x in range(1, self.layers))

    def _key(self, wl, mods, x):
        """Layer x's modules and params but for names, layer and ids (made relative to the layer)."""
        base, containers, out = self.base0 + x * self.ppl, {}, []
        for m in mods[x]:
            out.append((_MODULE_FACTS(m), tuple(p - base for p in m.params),
                        tuple(containers.setdefault(c, len(containers)) for c in m.containers)))
        return tuple(out), tuple(_PARAM_FACTS(wl.params[p]) for p in range(base, base + self.ppl))

    def layer_of_pid(self, p: int) -> int:
        return (p - self.base0) // self.ppl if self.base0 <= p < self.base0 + self.layers * self.ppl else -1

    def _visits(self, fetch) -> bool:
        """Each direction's visits and trace entries per layer, contiguous and alike layer to layer:
        the forward's from its first layer up to `alike["f"]` (its last layers' params may be kept
        for their backward, close enough under max_reuse_distance; no gap reaches them), the
        backward's all."""
        layer_of = {}
        for m in fetch.ctx.wl.modules:
            layer_of[m.name] = m.layer
            for c in m.containers:
                layer_of[c] = m.layer if layer_of.get(c, m.layer) == m.layer else -1
        self.trace_start = [0]
        for v in fetch.visits:
            self.trace_start.append(self.trace_start[-1] + len(v.params))
        self.visit_base, self.vpl, self.tpl, self.trace_end, self.alike = {}, {}, {}, {}, {}
        for d, phases in (("f", (Phase.FORWARD,)), ("b", (Phase.RECOMPUTE, Phase.BACKWARD))):
            per: dict[int, list[int]] = {}
            for k, v in enumerate(fetch.visits):
                if v.phase in phases and layer_of.get(v.module, -1) >= 0:
                    per.setdefault(layer_of[v.module], []).append(k)
            if sorted(per) != list(range(self.layers)):
                return False
            vpl = len(per[0])
            order = range(self.layers) if d == "f" else range(self.layers - 1, -1, -1)
            first = per[order[0]][0]
            key = self._visit_key(fetch, per[order[0]], order[0])
            alike = len(order)
            for i, x in enumerate(order):
                if per[x] != list(range(first + i * vpl, first + (i + 1) * vpl)):
                    return False
                if alike == len(order) and self._visit_key(fetch, per[x], x) != key:
                    alike = i
            if d == "b" and alike < len(order):
                return False
            self.alike[d] = alike
            self.visit_base[d] = {x: per[x][0] for x in order}
            self.vpl[d] = vpl
            self.tpl[d] = self.trace_start[per[0][-1] + 1] - self.trace_start[per[0][0]]
            last = order[alike - 1]   # the prefetcher is not shifted past the alike layers (_skip)
            self.trace_end[d] = self.trace_start[per[last][-1] + 1]
        return True

    def _visit_key(self, fetch, ks, x):
        """Layer x's visits: phase, module position, params relative to the layer, the params the
        reuse distance keeps, and which params are persistent."""
        base = self.base0 + x * self.ppl
        reuse = fetch.ctx.sc.zero.max_reuse_distance > 0
        return tuple((fetch.visits[k].phase, tuple(p - base for p in fetch.visits[k].params),
                      tuple(sorted(p - base for p in fetch.reused_within(k))) if reuse else (),
                      tuple(p - base for p in fetch.visits[k].params if p in fetch.persistent)) for k in ks)


class LayerSkip:
    """Decides, at each layer boundary of a ZeRO-3 pass, whether to skip layers, and shifts the
    hooks' state over them (see [Note: layers the builder skips])."""

    def __init__(self, ctx, hooks):
        self.ctx, self.hooks = ctx, hooks
        self.geo = _Geometry(ctx, hooks.fetch, hooks.ready)
        self.skipped: list[SkippedLayers] = []
        self.gaps: dict[int, tuple[int, int, int]] = {}   # micro-step -> layers [a, b) its passes drop, period
        self._history: list = []        # this pass: (layer, fingerprint, op id, flushes, reach) per boundary
        self._pass_start = 0
        self.whole = False              # the first micro-step's forward did not repeat: build every layer
        self._post_step = (0, 0)        # post_step's choice: layers skipped, gathers per layer

    @property
    def active(self) -> bool:
        return self.geo.ok

    def start_pass(self):
        self._history = []
        self._pass_start = self.ctx.b.next_id    # ops before the pass are compared as they are

    # -- the boundaries --------------------------------------------------------------------

    def forward(self, micro: int, layer: int) -> int:
        """Before layer `layer`'s first module in a forward: the first layer to build next."""
        if self.whole or micro in self.gaps or not self._record(layer, "f") or not self._periodic(1):
            return layer
        p = self._backward_period(layer)
        if p is None:
            return layer
        # the backward needs its own settle + 2 alike boundaries above the gap (p layers apart),
        # after the blocks its start settles over (lm_head's and the last layers' gathers, and
        # the forward's last layers whose visits are not alike: their params were kept for this
        # backward); it drops the same layers, whole periods of its gradient bucket
        b = self.geo.alike["f"] - 1 - (self._settle(p) + 2) * p - BACKWARD_START
        count = (b - layer) // p * p
        # at least `reach` layers dropped, so that no two kept references name one stand-in
        # (least_copies)
        if count < max(1, self._history[-1][4]) or not self._skip(micro, "f", layer, count, +1, 1):
            return layer
        self.gaps[micro] = (layer, layer + count, p)
        return layer + count

    def backward(self, micro: int, layer: int) -> int:
        """Before layer `layer` of a backward (layers descending): the next layer to build."""
        gap = self.gaps.get(micro)
        if gap is None and not self.whole:
            # a first micro-step built whole: so is every other (one that drops layers after
            # a whole one would not stand on alike micro-steps)
            if micro:
                raise Abort(f"micro-step {micro}: the forward does not repeat")
            self.whole = True
        if gap is None or layer < gap[1] - 1:
            return layer
        if layer > gap[1] - 1:
            self._record(layer, "b")
            return layer
        a, b, p = gap
        if not (self._record(layer, "b") and (b - a) // p >= least_copies(self._history[-1][4], p)
                and self._periodic(p) and self._skip(micro, "b", layer, b - a, -1, p)):
            raise Abort(f"micro-step {micro}: the backward does not repeat over layers {a}-{b - 1}")
        return a - 1

    def _backward_period(self, layer: int) -> int | None:
        """The layers after which the backward's gradient bucket fills alike again (its fill at
        each block's boundary, from the hooks' add rule), over the layers from `layer` - 1 up to
        where the backward settles; None past REACH layers."""
        fills, top = self.geo.fills, self.geo.layers - 1 - BACKWARD_START
        for p in range(1, REACH + 1):
            if all(fills[x] == fills[x + p] for x in range(layer - 1, top - p + 1)):
                return p
        return None

    def post_step(self, persistent: tuple[int, ...]) -> tuple[int, int] | None:
        """The persistent params' post-step gathers: the (first, end) positions in `persistent`
        of the layers to skip, or None; layers [0, SETTLE] are built (the window: SETTLE)."""
        geo = self.geo
        if self.whole:
            return None
        per_layer: dict[int, list[int]] = {}
        for i, p in enumerate(persistent):
            per_layer.setdefault(geo.layer_of_pid(p), []).append(i)
        counts = {len(per_layer.get(x, ())) for x in range(geo.layers)}
        if len(counts) != 1 or not counts.pop():
            return None
        first, end = per_layer[SETTLE + 1][0], per_layer[geo.layers - 1][0]
        self._post_step = (geo.layers - SETTLE - 2, len(per_layer[0]))    # layers skipped, gathers per layer
        if end - first != self._post_step[0] * self._post_step[1]:
            return None
        return first, end

    def note_post_step(self, micro: int, at: int):
        """The gathers `post_step` chose were skipped; op `at` comes after them."""
        count, length = self._post_step
        self.skipped.append(SkippedLayers(f"post-step gathers of layer {SETTLE}", (micro, "s"), at, count, length,
                                          SETTLE))

    # -- state ----------------------------------------------------------------------------

    def _record(self, layer: int, d: str) -> bool:
        f = self.hooks.fetch
        if f.step_id != self.geo.visit_base[d][layer] or self.hooks.leaf is not None:
            self._history.append((layer, None, self.ctx.b.next_id, self.hooks.buckets.flushes, 0))
            return False
        floor = self._history[-REACH][2] if len(self._history) >= REACH else self._pass_start
        fp, oldest = self._fingerprint(layer, d, floor)
        # layers back the oldest op the state refers to was added (its reach)
        reach = 1 + sum(1 for x in self._history if x[2] > oldest) if oldest is not None else 0
        self._history.append((layer, fp, self.ctx.b.next_id, self.hooks.buckets.flushes, reach))
        return True

    def _settle(self, p: int) -> int:
        """Periodic chunks of `p` layers built before the window (settle_chunks)."""
        return settle_chunks(self._history[-1][4], p)

    def _periodic(self, p: int) -> bool:
        """The last settle + 2 boundaries `p` layers apart alike: settle + 1 chunks each the one
        before `p` layers on, and the next too. Every such chunk adds as many ops and bucket flushes."""
        n = self._settle(p) + 2
        if len(self._history) < 1 + (n - 1) * p:
            return False
        h = self._history[len(self._history) - 1 - (n - 1) * p::p]
        if h[0][1] is None or any(x[1] != h[0][1] for x in h):
            return False
        steps = {(y[2] - x[2], y[3] - x[3]) for x, y in zip(h, h[1:])}
        return len(steps) == 1

    def _fingerprint(self, layer: int, d: str, op_floor: int):
        geo, h = self.geo, self.hooks
        f, bk = h.fetch, h.buckets
        base, ppl = geo.base0 + layer * geo.ppl, geo.ppl
        lo, hi = base - REACH * ppl, base + (REACH + 1) * ppl
        nid, step = self.ctx.b.next_id, f.step_id
        near = (REACH + 1) * max(geo.vpl.values())

        def rp(p):
            return (0, p - base) if lo <= p < hi else (1, p)

        oldest = [None]

        def ro(x):
            if x is None or x < op_floor:
                return None if x is None else (1, x)
            if oldest[0] is None or x < oldest[0]:
                oldest[0] = x
            return 0, x - nid

        def rk(k):
            return None if k is None else (0, k - step) if abs(k - step) <= near else (1, k)
        head = len(f.trace) - len(f.queue)
        here = geo.trace_start[step]
        return (d, f.pending_visits, rk(h.current_visit),
                tuple(sorted(map(rp, f.gathered))),
                tuple(sorted((rp(p), ro(x)) for p, x in f.gather_op.items())),
                tuple(sorted((rp(p), ro(x)) for p, x in f.inflight.items())),
                tuple(sorted((ro(x), tuple(sorted(map(rp, ps)))) for x, ps in f.unwaited.items())),
                tuple(ro(t.key) for t in f.waited),
                tuple(sorted((ro(x), v) for x, v in f.wait_views.items())), f.pending_views,
                head - here, tuple((rp(p), rk(f.most_recent[p])) for p, _ in f.trace[here:head]),
                f.n_available, ro(f.last_compute),
                tuple(sorted((rp(p), rp(q)) for p, q in f.tag_pid.items())),
                tuple(map(rp, bk.bucket)), bk.bucket_numel, tuple((t.buffer, rp(t.key)) for t in bk.pending),
                ro(bk.last_reduce), ro(bk.last_d2h)), oldest[0]

    def _skip(self, micro: int, d: str, layer: int, count: int, sign: int, period: int) -> bool:
        """Shift the hooks' state `count` layers on (`sign` -1: layers descending), chunks of
        `period` layers, and note the gap; False (nothing changed) when the prefetcher would read past the
        alike layers in them, or has marked a use outside the ids the fingerprint compares as offsets."""
        geo, h = self.geo, self.hooks
        f, bk = h.fetch, h.buckets
        (_, _, at_prev, fl_prev, _), (_, _, at, fl, _) = self._history[-1 - period], self._history[-1]
        settle = self._settle(period)
        length, flushes = at - at_prev, fl - fl_prev
        base = geo.base0 + layer * geo.ppl
        lo, hi = base - REACH * geo.ppl, base + (REACH + 1) * geo.ppl
        dp, dk, dt = sign * count * geo.ppl, count * geo.vpl[d], count * geo.tpl[d]
        head = len(f.trace) - len(f.queue)
        ahead = {p: f.most_recent[p] for p, _ in f.trace[geo.trace_start[f.step_id]:head]}
        if head + dt > geo.trace_end[d] or any(not lo <= p < hi for p in ahead):
            return False

        def sp(p):
            return p + dp if lo <= p < hi else p
        allocates = f.allocates
        tags = {}
        for p in f.gathered:
            q = f.tag_pid.get(p, p)
            if sp(p) != q and allocates:
                tags[sp(p)] = q
        f.tag_pid = tags
        for p in f.gathered:
            f.status[p] = NOT_AVAILABLE
        f.gathered = {sp(p) for p in f.gathered}
        for p in f.gathered:
            f.status[p] = AVAILABLE
        f.gather_op = {sp(p): x for p, x in f.gather_op.items()}
        f.inflight = {sp(p): x for p, x in f.inflight.items()}
        f.unwaited = {x: {sp(p) for p in ps} for x, ps in f.unwaited.items()}
        for p, k in ahead.items():
            f.most_recent[sp(p)] = k + dk
        for _ in range(dt):
            f.queue.popleft()
        f.step_id += dk
        if h.current_visit is not None:
            h.current_visit += dk
        bk.bucket = [sp(q) for q in bk.bucket]
        bk.flushes += count // period * flushes
        # a gap is named after its window: the last chunk built before it
        first, last = (layer - period, layer - 1) if sign > 0 else (layer + period, layer + 1)
        what = "forward" if d == "f" else "backward"
        self.skipped.append(SkippedLayers(f"{what} of layers {first}-{last}, micro-step {micro}", (micro, d),
                                          self.ctx.b.next_id, count // period, length, settle, period))
        self._history = []
        return True
