"""Builds a Schedule in program order. Ops stay mutable drafts until `build` freezes them, so
hooks can attach frees, allocations and host-side effects to an op added earlier without
copying it. A pass whose hooks are stationary is added once and copied for the other
micro-steps (see [Note: pass templates])."""
from __future__ import annotations

import dataclasses
from typing import cast

from zsim.schedule.ir import Alloc, Buffer, HostSettings, Op, OpKind, Phase, PipelineLayout, Schedule, Stream, Tag
from zsim.schedule.payloads import ModulePass


class _Draft:
    """One op before `build`. The lists a hook may extend start as the shared empty tuple and
    become lists on the first addition (most ops never get one)."""
    __slots__ = ("kind", "stream", "phase", "micro", "payload", "deps", "alloc", "free", "free_before",
                 "hook_visits", "grad_hooks", "host_views", "bucketed", "pipe_stage")

    def __init__(self, kind, stream, phase, micro, payload, deps, alloc, pipe_stage):
        self.kind, self.stream, self.phase, self.micro, self.payload = kind, stream, phase, micro, payload
        self.pipe_stage = pipe_stage
        self.deps, self.alloc, self.free, self.free_before = deps, alloc, (), ()
        self.hook_visits = self.grad_hooks = self.host_views = 0
        self.bucketed = ()

    @classmethod
    def of(cls, op: Op) -> _Draft:
        """The draft of a frozen op (without bucketed params: a copied op has none)."""
        d = cls(op.kind, op.stream, op.phase, op.micro_step, op.payload, op.deps, op.alloc, op.pipe_stage)
        d.free, d.free_before = list(op.free), list(op.free_before)
        d.hook_visits, d.grad_hooks, d.host_views = op.hook_visits, op.grad_hooks, op.host_views
        return d


class PassTemplate:
    """The ops one pass added, relative to its first op and micro-step: per op its fields, its
    deps as positions in the pass (-1: the op the pass ran after) and its tags as indices into
    `tags`, each (buffer, key, phase) of the pass's micro-step or a tag of no micro-step."""
    __slots__ = ("ops", "last", "tags")

    def __init__(self, ops: list[tuple], last: int, tags: list):
        self.ops, self.last, self.tags = ops, last, tags


class Builder:
    def __init__(self):
        self._ops: list[_Draft] = []
        self.pipe_stage = 0      # the pipeline stage that ops and static buffers go to (pipeline.py sets it)
        self._static: dict[int, list[Alloc]] = {}
        self._host_static: dict[int, list[Alloc]] = {}

    def add(self, kind: OpKind, stream: Stream, phase: Phase, micro: int, payload, deps=(),
            alloc: tuple[Alloc, ...] = ()) -> int:
        if isinstance(deps, (list, tuple)) and len(deps) == 1:
            deps = () if deps[0] is None else (deps[0],)
        else:
            deps = tuple(sorted({d for d in deps if d is not None}))
        self._ops.append(_Draft(kind, stream, phase, micro, payload, deps, tuple(alloc), self.pipe_stage))
        return len(self._ops) - 1

    @property
    def next_id(self) -> int:
        return len(self._ops)

    def _draft(self, op_id: int) -> _Draft:
        """Op `op_id`'s draft, to change it: an op copied from a pass template is kept frozen
        (replay_pass) until something changes it."""
        d = self._ops[op_id]
        if type(d) is Op:
            d = self._ops[op_id] = _Draft.of(d)
        return d

    def add_deps(self, op_id: int, *deps: int):
        """`op_id` also waits for `deps` (added before it)."""
        d = self._draft(op_id)
        d.deps = tuple(sorted(set(d.deps) | {x for x in deps if x is not None and x < op_id}))

    def add_free(self, op_id: int, *tags: Tag):
        d = self._draft(op_id)
        if not d.free:
            d.free = []
        d.free.extend(tags)

    def move_frees(self, src: int, dst: int, buffers):
        """The frees of op `src` whose tag is one of `buffers` happen when op `dst` ends instead."""
        d = self._draft(src)
        moved = [t for t in d.free if t.buffer in buffers]
        if moved:
            d.free = [t for t in d.free if t.buffer not in buffers]
            self.add_free(dst, *moved)

    def add_free_before(self, op_id: int, *tags: Tag):
        """`tags` are freed when the op starts, before it allocates (a pre-forward hook's wait)."""
        d = self._draft(op_id)
        if not d.free_before:
            d.free_before = []
        d.free_before.extend(tags)

    def add_alloc(self, op_id: int, *allocs: Alloc):
        d = self._draft(op_id)
        if isinstance(d.alloc, tuple):
            d.alloc = list(d.alloc)
        d.alloc.extend(allocs)

    def set_touched(self, op_id: int, tag: Tag, touched_bytes: float):
        """The buffer `tag` that op `op_id` allocates has `touched_bytes` written while it lives."""
        d = self._draft(op_id)
        d.alloc = [dataclasses.replace(a, touched_bytes=float(touched_bytes)) if a.tag == tag else a for a in d.alloc]

    def add_hook_visits(self, op_id: int, visits: int):
        self._draft(op_id).hook_visits += visits

    def add_grad_hooks(self, op_id: int, params: int):
        self._draft(op_id).grad_hooks += params

    def add_host_views(self, op_id: int, views: int):
        """The host makes `views` per-rank tensor views before the op (see [Note: per-rank host loops])."""
        self._draft(op_id).host_views += views

    def add_bucketed(self, op_id: int, pid: int):
        """A gradient hook after this (backward) op puts `pid` into the IPG bucket."""
        d = self._draft(op_id)
        if not d.bucketed:
            d.bucketed = []
        d.bucketed.append(pid)

    def static_alloc(self, category: str, size_bytes: float):
        if size_bytes > 0:
            self._static.setdefault(self.pipe_stage, []).append(Alloc(Tag(Buffer.STATE, key=category), category, float(size_bytes)))

    def host_alloc(self, category: str, size_bytes: float):
        if size_bytes > 0:
            self._host_static.setdefault(self.pipe_stage, []).append(Alloc(Tag(Buffer.STATE, key=category), category, float(size_bytes)))

    def pass_template(self, first: int, micro: int, after: int | None, last: int) -> PassTemplate | None:
        """The ops added since `first` by a pass at `micro` that ran after op `after` and ended
        with op `last`, as a template; None when they cannot be copied to another micro-step (an
        op of another stage, a wait on an op before the pass other than `after`, a tag of
        another micro-step)."""
        drafts = self._ops[first:]
        if not drafts or not first <= last < len(self._ops) or any(type(d) is Op for d in drafts):
            return None
        index: dict = {}
        tags: list = []

        def ref(tag: Tag) -> int | None:
            k: object
            spec: object
            if tag.micro == micro:
                k = (id(tag.buffer), tag.key, tag.phase)   # an Enum hashes in Python
                spec = (tag.buffer, tag.key, tag.phase)
            elif tag.micro == -1:
                k = spec = tag
            else:
                return None
            i = index.get(k)
            if i is None:
                i = index[k] = len(tags)
                tags.append(spec)
            return i

        ops = []
        for d in drafts:
            if d.pipe_stage != self.pipe_stage or d.micro != micro or any(x < first and x != after for x in d.deps):
                return None
            refs = [tuple(ref(t) for t in tags_) for tags_ in ([a.tag for a in d.alloc], d.free, d.free_before)]
            if any(None in r for r in refs):
                return None
            alloc = tuple((i, a.category, a.size_bytes, a.touched_bytes) for i, a in zip(refs[0], d.alloc))
            ops.append((d.kind, d.stream, d.phase, d.payload, tuple(x - first if x >= first else -1 for x in d.deps),
                        alloc, refs[1], refs[2], d.hook_visits, d.grad_hooks, d.host_views, tuple(d.bucketed)))
        return PassTemplate(ops, last - first, tags)

    def replay_pass(self, tpl: PassTemplate, micro: int, after: int | None) -> int:
        """Add `tpl`'s ops at `micro`, after op `after`, frozen (a later change makes one a
        draft again); returns its last op's id."""
        # the drafts' list also holds the frozen ops a replay adds (build() and drafts_since tell them apart)
        base, pipe_stage, out = len(self._ops), self.pipe_stage, cast("list[_Draft | Op]", self._ops)
        tags = [spec if type(spec) is Tag else Tag(spec[0], micro, spec[1], spec[2]) for spec in tpl.tags]
        for kind, stream, phase, payload, rel, alloc, free, free_before, visits, hooks, views, bucketed in tpl.ops:
            # a template's ops wait on `after` (x < 0) only where a replay has one
            deps = cast("tuple[int, ...]", tuple([after if x < 0 else base + x for x in rel]) if rel else ())
            allocs = tuple([Alloc(tags[i], category, size, touched) for i, category, size, touched in alloc]) if alloc else ()
            if bucketed:    # build() makes its payload: a draft
                d = _Draft(kind, stream, phase, micro, payload, deps, allocs, pipe_stage)
                d.free, d.free_before = [tags[i] for i in free], [tags[i] for i in free_before]
                d.hook_visits, d.grad_hooks, d.host_views, d.bucketed = visits, hooks, views, list(bucketed)
                out.append(d)
                continue
            out.append(Op(len(out), kind, stream, phase, micro, payload, deps, allocs,
                          tuple([tags[i] for i in free]) if free else (), visits, hooks, pipe_stage,
                          tuple([tags[i] for i in free_before]) if free_before else (), views))
        return base + tpl.last

    def build(self, zero_stage: int, world_size: int, host: HostSettings,
              stage_layers: tuple[tuple[int, int], ...] = (), tensor: int = 1, virtual_stages: int = 1) -> Schedule:
        """Freeze the drafts; `stage_layers` (one [first, end) layer range per pipeline stage,
        per virtual stage when each stage holds `virtual_stages` model chunks) makes it a
        pipeline's schedule."""
        ops = []
        for i, d in enumerate(self._ops):
            if type(d) is Op:       # copied and never changed: frozen already
                ops.append(d)
                continue
            payload = d.payload
            if d.bucketed:
                assert isinstance(payload, ModulePass)
                payload = ModulePass(payload.module, payload.work, tuple(d.bucketed), payload.part)
            ops.append(Op(i, d.kind, d.stream, d.phase, d.micro, payload, d.deps, tuple(d.alloc), tuple(d.free),
                          d.hook_visits, d.grad_hooks, d.pipe_stage, tuple(d.free_before), d.host_views))
        if not stage_layers:
            return Schedule(zero_stage=zero_stage, world_size=world_size, ops=tuple(ops), static=tuple(self._static.get(0, ())),
                            host=host, host_static=tuple(self._host_static.get(0, ())), tensor=tensor)
        n = len(stage_layers) // virtual_stages
        layout = PipelineLayout(stages=n, data_parallel=world_size // (n * tensor), layers=tuple(stage_layers),
                                static=tuple(tuple(self._static.get(s, ())) for s in range(n)),
                                host_static=tuple(tuple(self._host_static.get(s, ())) for s in range(n)),
                                virtual_stages=virtual_stages)
        return Schedule(zero_stage=zero_stage, world_size=world_size, ops=tuple(ops), static=(), host=host, pipeline=layout,
                        tensor=tensor)

