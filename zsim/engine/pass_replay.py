"""A pipeline stage's passes, simulated once per shape and replayed (sim.py uses it).

[Note: pipeline pass replay]
Under DeepSpeed's 1F1B TrainSchedule a stage's forward (or recompute + backward) of one
micro-batch meets the rest of the pipeline only at its ends: it starts after its recv, its
sends wait for it, and no other stage's transfer touches its rank while it runs (a send is a
rendezvous that waits for both ranks to reach it). Each stage has its own copy of every link
(placement.stage_links), so what happens inside a pass depends on its ops alone. A stage runs
some 2 x (stages + 4) passes of the shortened step, nearly all of a few shapes: the first pass
of each shape is simulated and recorded (every op's start and end, every memory effect, in the
order they happened, relative to the pass's start, and every op's cost); a later pass of the
same shape, on a stage where its ops cost what they did (its own, or one placed alike), is one
timer of the recorded length, after which its ops get the recorded times and its
memory effects (its own tags, in the recorded order) go to the ledger.

That holds only while the pass is isolated, so it is checked, not assumed: a pass is
recorded or replayed only when every op of its stage before it has ended, none of its stage's
other streams is inside an op, no job in flight crosses its rank, and every op it waits on
outside itself has ended; an op from outside that touches the stage's rank while a pass is
recorded (when it starts, or when its work starts after its fixed time) spoils the recording,
and while one is replayed raises `ReplayConflict`, and run_ops simulates the whole step again
without replay. Ops outside a pass that wait on one of its ops must wait on one that ends last
(they are signalled at the replay's end): which ops those are is part of a pass's shape, and a
recording where one ended earlier is not kept. A stage's ledger gets the same events in the same
order; times are the recorded offsets added to the replayed pass's start, so they match a full
simulation to float rounding (about 1e-14 of the step), not to the bit.
"""
from __future__ import annotations

from functools import partial

from zsim.hardware.placement import base_link
from zsim.schedule.ir import Op, OpKind, Phase, Schedule, Stream
from zsim.schedule.payloads import payload_shape

# fewer ops than this are simulated as they are (the key and the bookkeeping cost more)
MIN_OPS = 8

_NOT_IN_PASS = frozenset({OpKind.SEND_ACTIVATION, OpKind.RECV_ACTIVATION, OpKind.SEND_GRAD, OpKind.RECV_GRAD})


class ReplayConflict(Exception):
    """An op from outside touched a stage while one of its passes was being replayed."""


class Block:
    """One pass of one stage: ops contiguous in the stage's program order."""
    __slots__ = ("index", "pipe_stage", "ops", "first_id", "external", "outside_awaited", "key", "pos", "awaited_ids")

    def __init__(self, index: int, pipe_stage: int, ops: list[Op]):
        self.index, self.pipe_stage, self.ops = index, pipe_stage, ops
        self.first_id = ops[0].id
        self.pos = {op.id: j for j, op in enumerate(ops)}
        self.external: tuple[int, ...] = ()        # ops outside it that its ops wait on
        self.outside_awaited: tuple[int, ...] = ()  # its ops (positions) that ops outside it wait on
        self.awaited_ids: frozenset[int] = frozenset()   # the same, as op ids
        self.key: tuple | None = None


class Template:
    """A recorded pass: its length, each op's start and end after the pass's start, every op's
    start and end in the order they happened, (is_end, op position, offset), whose memory
    effects replay in that order, the order its ops ended in (`signals`), and each op's cost
    as (fixed_s, work_s, its links' base names): a pass of the same shape on another stage
    replays it when its ops cost the same there."""
    __slots__ = ("duration_s", "starts", "ends", "effects", "signals", "costs")

    def __init__(self, duration_s, starts, ends, effects, signals, costs):
        self.duration_s, self.starts, self.ends, self.effects, self.signals = duration_s, starts, ends, effects, signals
        self.costs = costs


class Recording:
    """A pass on its stage, being simulated and recorded, or replayed from `template`."""
    __slots__ = ("block", "t0", "spoiled", "starts", "ends", "effects", "ended", "template", "costs")

    def __init__(self, block: Block, t0: float, template: Template | None = None):
        self.block, self.t0, self.template = block, t0, template
        self.spoiled = False
        self.ended = 0
        if template is None:    # what a replay has in its template
            n = len(block.ops)
            self.starts: list = [None] * n
            self.ends: list = [None] * n
            self.costs: list = [None] * n
            self.effects: list = []

    @property
    def replay(self) -> bool:
        return self.template is not None


def find_blocks(schedule: Schedule, serial: bool, sized: bool) -> tuple[list[Block], list[int]]:
    """The passes of every stage worth replaying, and per op the index of its block (-1: none).
    A pass is a run of a stage's ops (in its program order) of one micro-step's forward, or of
    its recompute and backward, without the point-to-point ops. A block's first op runs on the
    compute stream and every op of it on another stream waits on one of it, so the block
    starts with its first op."""
    ops = schedule.ops
    forward, step, compute = Phase.FORWARD, Phase.STEP, Stream.COMPUTE
    runs: dict[int, tuple] = {}      # stage -> (pass, ops) of the run being grown
    found: list[list[Op]] = []
    outside = {id(k) for k in _NOT_IN_PASS}   # an Enum hashes in Python: members by identity
    for op in ops:
        phase = op.phase
        p = None if id(op.kind) in outside or phase is step else (op.micro_step, phase is forward)
        cur = runs.get(op.pipe_stage)
        if cur is not None and cur[0] == p:
            cur[1].append(op)
            continue
        if cur is not None and cur[0] is not None:
            found.append(cur[1])
        runs[op.pipe_stage] = (p, [op])
    found += [run for p, run in runs.values() if p is not None]
    found.sort(key=lambda run: run[0].id)
    block_of = [-1] * len(ops)
    blocks: list[Block] = []
    for run in found:
        if len(run) < MIN_OPS or (not serial and run[0].stream is not compute):
            continue
        b = len(blocks)
        if not serial and any(op.stream is not compute for op in run):
            ids = {op.id for op in run}
            if any(op.stream is not compute and ids.isdisjoint(op.deps) for op in run):
                continue
        for op in run:
            block_of[op.id] = b
        blocks.append(Block(b, run[0].pipe_stage, run))
    external: list[set] = [set() for _ in blocks]
    awaited: list[set] = [set() for _ in blocks]
    for op in ops:
        if not op.deps:
            continue
        bi = block_of[op.id]
        for d in op.deps:
            bd = block_of[d]
            if bd != bi:
                if bi >= 0:
                    external[bi].add(d)
                if bd >= 0:
                    awaited[bd].add(d)
    shapes: dict = {}
    for block in blocks:
        block.external = tuple(sorted(external[block.index]))
        ds = awaited[block.index]
        block.outside_awaited = tuple(sorted(block.pos[d] for d in ds))
        block.awaited_ids = frozenset(ds)
        # which of its ops others wait on is part of its shape: they must end last (finish)
        block.key = (block.outside_awaited, _key(block, shapes, sized))
    return blocks, block_of


def _key(b: Block, shapes: dict, sized: bool) -> tuple:
    """What decides a pass's evolution, but for its stage (whose costs Template.costs says):
    per op what CostModel.op_cost keys its cost on (the payload's work or call, the hooks, and
    when `sized` (the profile prices fresh allocations) the sizes it allocates), its kind,
    stream and phase, where its waits inside the pass point (None: outside), and how many
    allocations and frees it makes (its memory effects replay from its own lists). Enum
    members by identity (an Enum hashes in Python); a payload by a number per distinct shape
    (`shapes`: payload id -> number, filled by `_shape`), each shape hashed once per payload."""
    where = b.pos.get
    out: list = []
    add = out.append
    for op in b.ops:
        p = op.payload
        shape = shapes.get(id(p))
        if shape is None:
            shape = _shape(shapes, p)
        allocs = op.alloc
        add((id(op.kind), id(op.stream), id(op.phase), shape, op.hook_visits, op.grad_hooks, op.host_views,
             tuple([(a.size_bytes, a.touched_bytes) for a in allocs]) if sized and allocs else len(allocs),
             len(op.free_before), len(op.free), tuple(map(where, op.deps))))
    return tuple(out)


def _shape(shapes: dict, payload) -> int:
    """The number of `payload`'s shape (payloads.payload_shape, CostModel.op_cost's key: its call,
    its work, a copy's transfer, size and pinning, or itself)."""
    value = payload_shape(payload)
    number = shapes[id(payload)] = shapes.setdefault(("shape", type(value), value), len(shapes))
    return number


def finish(rec: Recording, end_s: float) -> Template | None:
    """The template of a recording whose last op has ended at `end_s`, or None when it cannot
    stand for later passes (spoiled, or an op awaited from outside ended before the last)."""
    if rec.spoiled:
        return None
    t0 = rec.t0
    if any(rec.ends[j] != end_s for j in rec.block.outside_awaited):
        return None
    ops = rec.block.ops   # the effects of ops that allocate or free (a later pass's ops do alike: its key)
    effects = tuple((is_end, j, t - t0) for is_end, j, t in rec.effects
                    if (ops[j].free if is_end else ops[j].free_before or ops[j].alloc))
    return Template(end_s - t0, tuple(s - t0 for s in rec.starts), tuple(e - t0 for e in rec.ends), effects,
                    tuple(j for is_end, j, _ in rec.effects if is_end), tuple(rec.costs))


def cost_shape(cost) -> tuple:
    """An op's cost with its links by their base names: the same on every stage that places it alike."""
    return cost.fixed_s, cost.work_s, tuple(map(base_link, cost.links))


class PassReplay:
    """The engine's observer of op starts and ends that records passes and replays them (see
    [Note: pipeline pass replay]). `eng` is the engine whose clock, fluid model, cost model,
    timings, op ends and stream runs it reads; its streams call `begin` at a pass's first op and
    `watch_start` / `watch_work` / `watch_end` while a pass is active (`active` is not empty)."""

    def __init__(self, eng, schedule: Schedule, cluster, timing_type):
        self.eng, self.timing_type = eng, timing_type   # sim.OpTiming
        self.active: dict[int, Recording] = {}          # stage -> its pass being recorded or replayed
        self.templates: dict[tuple, list[Template]] = {}   # a pass's shape -> its recordings
        self.placed: dict[tuple, Template] = {}            # (shape, stage) -> the recording it replays
        self.touched: dict[tuple, tuple[int, ...]] = {}
        gpu = cluster.profile.gpu
        blocks, self.block_of = find_blocks(schedule, not gpu.concurrent_streams, bool(gpu.fresh_alloc_GBps))
        self.firsts: dict[int, Block] = {b.first_id: b for b in blocks}

    def begin(self, block: Block, run) -> bool:
        """At the first op of `block`: replay it (True) when a pass of its shape was recorded,
        else record it; neither unless it starts isolated (see [Note: pipeline pass replay])."""
        s = block.pipe_stage
        if s in self.active or self.eng.fluid.touching.get(s):
            return False
        for other in self.eng.stage_runs[s]:
            if other is not run and other.i < len(other.ops) and (other.waited or other.ops[other.i].id < block.first_id):
                return False
        timings = self.eng.timings
        if any(timings[d] is None for d in block.external):
            return False
        now = self.eng.clock.env.now
        tpl = self.placed.get((block.key, s))
        if tpl is None:
            tpl = self._recorded_alike(block)
        if tpl is None:
            self.active[s] = Recording(block, now)
            return False
        self.active[s] = Recording(block, now, tpl)
        replayed = self.eng.replayed
        for op in block.ops:
            replayed[op.id] = True
        self.eng.clock.after(tpl.duration_s, partial(self.replayed, run))
        return True

    def _recorded_alike(self, block: Block) -> Template | None:
        """A recording of `block`'s shape whose ops cost what `block`'s cost on its stage."""
        assert block.key is not None      # find_blocks keys every block
        for tpl in self.templates.get(block.key, ()):
            if all(cost_shape(self.eng.op_cost(op)) == cost for op, cost in zip(block.ops, tpl.costs)):
                self.placed[(block.key, block.pipe_stage)] = tpl
                return tpl
        return None

    def _ranks(self, links: tuple[str, ...], stage: int) -> tuple[int, ...]:
        """The ranks an op of `stage` over `links` touches: its own and those its links cross."""
        key = (links, stage)
        ranks = self.touched.get(key)
        if ranks is None:
            ranks = self.touched[key] = tuple(sorted({stage, *self.eng.fluid.ranks(links)}))
        return ranks

    def watch_start(self, op: Op, cost, start_s: float):
        """An op starts while passes are recorded or replayed: one from outside a pass that
        touches its stage spoils the recording or ends the replay (ReplayConflict)."""
        bi = self.block_of[op.id]
        active = self.active
        ranks = self._ranks(cost.links, op.pipe_stage)
        self._guard(op, ranks, bi)
        rec = active.get(op.pipe_stage)
        if rec is not None and rec.block.index == bi:
            if ranks != (op.pipe_stage,):
                rec.spoiled = True      # the pass itself reaches another stage's rank
            j = rec.block.pos[op.id]
            rec.starts[j] = start_s
            rec.costs[j] = cost_shape(cost)
            rec.effects.append((False, j, start_s))

    def _guard(self, op: Op, ranks: tuple[int, ...], bi: int):
        active = self.active
        for r in ranks:
            rec = active.get(r)
            if rec is not None and rec.block.index != bi:
                if rec.replay:
                    raise ReplayConflict(f"stage {r}: op {op.id} touched it during a replayed pass")
                rec.spoiled = True

    def watch_work(self, op: Op, links: tuple[str, ...]):
        """An op's work starts after its fixed time while passes are recorded or replayed: the
        same check as at its start (it may have started before the pass did)."""
        self._guard(op, self._ranks(links, op.pipe_stage), self.block_of[op.id])

    def watch_end(self, op: Op, end_s: float):
        rec = self.active.get(op.pipe_stage)
        if rec is None or rec.replay or rec.block.index != self.block_of[op.id]:
            return
        j = rec.block.pos[op.id]
        rec.ends[j] = end_s
        rec.effects.append((True, j, end_s))
        rec.ended += 1
        if rec.ended == len(rec.block.ops):
            del self.active[op.pipe_stage]
            tpl = finish(rec, end_s)
            if tpl is not None:
                assert rec.block.key is not None
                self.templates.setdefault(rec.block.key, []).append(tpl)
                self.placed[(rec.block.key, rec.block.pipe_stage)] = tpl

    def replayed(self, run, _event):
        """The end of a replayed pass: its ops' times and memory effects as recorded, from its
        start; the stage's streams past its ops; its ends signalled in the recorded order."""
        eng, ledger = self.eng, run.ledger
        rec = self.active.pop(run.ops[run.i].pipe_stage)    # this stream waits at the pass's first op
        block, tpl, t0 = rec.block, rec.template, rec.t0
        ops = block.ops
        alloc, free = ledger.alloc, ledger.free
        for is_end, j, off in tpl.effects:
            op = ops[j]
            if is_end:
                for tag in op.free:
                    free(t0 + off, tag)
            else:
                for tag in op.free_before:
                    free(t0 + off, tag)
                for a in op.alloc:
                    alloc(t0 + off, a)
        timings, new, timing = eng.timings, tuple.__new__, self.timing_type   # OpTiming's own __new__ is a Python call
        for op, s, e in zip(ops, tpl.starts, tpl.ends):
            x = op.id
            timings[x] = new(timing, (x, t0 + s, t0 + e))
        replayed = eng.replayed
        for other in eng.stage_runs[block.pipe_stage]:
            while other.i < len(other.ops) and replayed[other.ops[other.i].id]:
                other.i += 1
        done, soon, outside = eng.done, eng.clock.soon, block.awaited_ids
        for j in tpl.signals:
            x = ops[j].id
            d = done[x]
            if d is not None:
                if d.waiters or x in outside:
                    soon(d.signal)
                else:       # awaited only inside the pass, by nobody now: no callback needed
                    d.waiters = None
        run.waited = 0
        run.run()
