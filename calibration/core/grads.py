"""Gradient buckets in the training core, as DeepSpeed 0.19.8 fills and reduces them
(zsim/schedule/grad_buckets.py has the schedule; this moves the tensors). See [Note: gradient
hook order], see [Note: bucket reduction calls], see [Note: ZeRO-1/2 gradient lifetime].

- ZeRO-1: at the boundary each accumulated .grad is copied into the IPG buffer and dropped
  (reduce_independent_p_g_buckets_and_remove_grads); the bucket is reduced from there.
- ZeRO-2/3: the hooks move each ready gradient into the open bucket's buffer; without
  contiguous_gradients (ZeRO-2) the .grad is kept until its bucket is reduced.
- ZeRO-3 with reduce_scatter fills the IPG buffer in gradient order and interleaves it per rank
  at the reduction, pre-divided by the world size (reduce_scatter_coalesced); with
  reduce_scatter false it is filled rank-major and all-reduced.
- ZeRO-1/2 keep only this rank's 16-bit partition of the reduced gradients (grads_in_partition,
  allocated by the step's first reduction, freed after the step; ZeRO-2 allocates a new one in
  every backward, see [Note: a grads_in_partition per backward]).
- ZeRO-2 without contiguous_gradients has no grads_in_partition: the reduced values are copied
  back into the .grads, the ones of params outside this rank's partition dropped (overlap_comm:
  at the next reduction or the epilogue), the others kept; each backward's epilogue takes them as
  the accumulator (all_grad_tensors) or adds them into it, and the step flattens each group's
  partition from it and drops it before AdamW (see [Note: ZeRO-2 gradients without
  contiguous_gradients]).
"""
from __future__ import annotations

import torch

from zsim.schedule.ir import Collective
from zsim.schedule.partition import in_rank_partition, params_in_partition_numel
from zsim.schedule.payloads import GradReduce


class GradBuckets:
    def __init__(self, core):
        self.core = core
        plan, z = core.plan, core.sc.zero
        self.world, self.rank = core.world, core.rank
        self.dtype, self.numels = core.dtype, core.numels
        # the mechanisms, named once: how each stage's buckets behave
        self.sharded = plan.stage == 3               # params partitioned: the gradient partition is the shard
        self.hooks_fill = plan.stage >= 2            # hooks move ready gradients into the bucket buffer
        self.boundary_copy = plan.stage == 1         # the boundary walk copies accumulated .grads in
        self.scatter_coalesced = self.sharded and z.reduce_scatter
        self.rank_major = self.sharded and not self.scatter_coalesced
        self.bucket_of: dict[tuple[int, int], tuple[int, int]] = {}   # (micro, pid) -> (bucket, offset)
        for b in plan.buckets.values():
            o = 0
            for pid in b.pids:
                self.bucket_of[(b.micro, pid)] = (b.id, o)
                o += core.c[pid] if self.rank_major else self.numels[pid]
        self.contiguous = z.contiguous_gradients
        self.ipg, self.ipg_numel = None, 0
        if self.contiguous and plan.buckets:
            # DeepSpeed allocates the full reduce_bucket_size however small the model (torch.empty:
            # at the default 5e8 a 3.7M-param model's buffer is mostly never written, but it is
            # allocated, and counted by the CUDA allocator as by the tracker)
            size = z.reduce_bucket_size
            if self.sharded:   # one static IPG buffer (stage3.py:780-784)
                need = max(min(b.numel, min(size, core.total) + self.world * len(b.pids)) for b in plan.buckets.values())
                self.ipg = torch.empty(int(max(size, need)), dtype=self.dtype)
            else:
                # see [Note: IPG buffer lifetime]: allocated at the first gradient hook when none is
                # ready and dropped by the epilogue (setup_buckets, _release_ipg_buffers), which runs
                # after every backward at stage 2 and at the accumulation boundary alone at stage 1
                self.ipg_numel = int(size)
        # overlap_comm's second buffer (stage_1_and_2.py:3271-3277, "double buffers"): allocated
        # with the first; the core reduces synchronously and never writes it
        self.ipg_spare = None
        self.double_ipg = bool(self.ipg_numel) and z.overlap
        self.gpart = torch.zeros(core.goff[-1], dtype=self.dtype) if self.sharded else None
        if not self.sharded:
            # DeepSpeed's grads_in_partition holds this rank's params whole (see [Note: a
            # grads_in_partition per backward]); the core indexes it by the partition's layout
            whole = sum(params_in_partition_numel(g, self.numels, [self._group_rank(i)])[0]
                        for i, g in enumerate(plan.groups))
            self.gpart_numel = max(plan.partition, whole)
            self.mine = {pid for i, g in enumerate(plan.groups) for pid in g.pids
                         if in_rank_partition(g, self.numels, pid, self._group_rank(i))}
        self.per_backward = plan.stage == 2 and self.contiguous
        # see [Note: ZeRO-2 gradients without contiguous_gradients]: the .grads are the partition
        self.grads_kept = plan.stage == 2 and not self.contiguous
        self.overlap_clears = self.grads_kept and z.overlap
        self.gpart_micro, self.to_move, self.held_gpart = -1, set(), None
        self.begin_step()

    def begin_step(self):
        self.pending: list[int] = []
        self.open_bucket = 0   # bucket ids count up from the step's first
        self.filled: dict[int, torch.Tensor] = {}
        self.held: dict[int, torch.Tensor] = {}
        self.kept: dict[int, torch.Tensor] = {}         # reduced in-partition .grads of this backward
        self.accumulated: dict[int, torch.Tensor] = {}  # all_grad_tensors, to the step
        self.previous_reduced: list[torch.Tensor] = []  # out-of-partition .grads overlap_comm holds
        self.buf = None
        self.cur = 0
        self.micro = 0

    # -- hooks -------------------------------------------------------------------------------
    def grads_ready(self, micro: int, pids: tuple[int, ...]):
        """The hooks after a backward op: the IPG buffer exists from the first one; ZeRO-2/3 move
        the gradients into their bucket."""
        self.micro = micro
        if self.ipg_numel and self.ipg is None:
            self.ipg = torch.empty(self.ipg_numel, dtype=self.dtype)
            self.ipg_spare = torch.empty(self.ipg_numel, dtype=self.dtype) if self.double_ipg else None
        if self.hooks_fill:
            self.pending.extend(pids)
            self._fill()

    def end_backward(self, boundary: bool):
        """After a backward, before the next forward or the step (`boundary`)."""
        if self.ipg is not None and self.ipg_numel and (boundary or not self.boundary_copy):
            self.ipg = self.ipg_spare = None   # the epilogue
        if self.grads_kept:
            self.previous_reduced = []
            for pid, g in self.kept.items():
                acc = self.accumulated.get(pid)
                if acc is None:
                    self.accumulated[pid] = g
                else:
                    acc.add_(g)
            self.kept = {}

    def accumulated_piece(self, pid: int, start: int, stop: int):
        """Elements [start, stop) of `pid`'s accumulated gradient (grads_kept); zeros for a param
        no backward gave a gradient (get_all_grad_tensors' zeros_like)."""
        acc = self.accumulated.get(pid)
        return acc[start:stop] if acc is not None else torch.zeros(stop - start, dtype=self.dtype)

    def drop_accumulated(self, pids):
        """The step's free_grad_in_param_list of a flat group, once its partition is flattened."""
        for pid in pids:
            self.accumulated.pop(pid, None)

    def _uses_ipg(self, b) -> bool:
        return self.ipg is not None and b.numel <= self.ipg.numel()

    def _fill(self):
        """Move ready gradients that belong to the open bucket into its buffer."""
        core = self.core
        while self.pending:
            pid = self.pending[0]
            bid, off = self.bucket_of[(self.micro, pid)]
            if bid != self.open_bucket:
                return
            self.pending.pop(0)
            p = core.params[pid]
            g = p.grad.reshape(-1)
            p.grad = None
            b = core.plan.buckets[bid]
            if self._uses_ipg(b):
                buf = self.ipg
            elif self.sharded or self.contiguous:
                buf = self.filled.get(bid)
                if buf is None:
                    buf = self.filled[bid] = torch.zeros(b.numel, dtype=self.dtype)
            else:
                self.held[pid] = g        # contiguous_gradients false: the grad waits for its bucket
                continue
            if self.rank_major:
                self._fill_rank_major(buf, b, pid, off, g)
            else:
                buf[off: off + self.numels[pid]].copy_(g)

    def _fill_rank_major(self, buf, b, pid: int, off: int, g):
        c, W, n = self.core.c[pid], self.world, self.numels[pid]
        seg = b.numel // W
        for r in range(W):
            lo, hi = r * c, min((r + 1) * c, n)
            dst = buf[r * seg + off: r * seg + off + c]
            if hi > lo:
                dst[: hi - lo].copy_(g[lo:hi])
            if hi - lo < c:
                dst[max(hi - lo, 0):].zero_()

    # -- reductions --------------------------------------------------------------------------
    def _bucket_buffer(self, b):
        core = self.core
        if self.boundary_copy:
            buf = self.ipg[: b.numel] if self._uses_ipg(b) else torch.empty(b.numel, dtype=self.dtype)
            o = 0
            for p in b.pids:
                buf[o: o + self.numels[p]].copy_(core.params[p].grad.reshape(-1))
                core.params[p].grad = None
                o += self.numels[p]
            return buf
        if self._uses_ipg(b):
            return self.ipg[: b.numel]
        if not self.sharded and self.filled.get(b.id) is None:   # contiguous_gradients false
            return torch.cat([self.held[p].reshape(-1) for p in b.pids])
        return self.filled[b.id]

    def reduce(self, p: GradReduce):
        """One call of a bucket's reduction (zsim's BUCKET_REDUCE op)."""
        b = self.core.plan.buckets[p.bucket]
        call = p.call
        if call == 0:
            self.previous_reduced = []   # _clear_previous_reduced_grads at the reduction's start
            self.buf, self.cur = self._bucket_buffer(b), 0
        comm, W = self.core.comm, self.world
        kind = p.comm.collective
        group = self.core.layout[p.flat_group][3] if not self.sharded else None
        if kind == Collective.REDUCE:
            pos = self._positions(b)
            pieces = b.pieces[call]
            t = torch.cat([self.buf[pos[pid] + st: pos[pid] + st + ln] for _, pid, st, ln in pieces])
            comm.reduce(t, p.dst, group=group)
            if p.dst == self._group_rank(p.flat_group):
                o = 0
                for _, pid, st, ln in pieces:
                    self._own_write(pid, st, t[o:o + ln])
                    o += ln
        elif kind == Collective.REDUCE_SCATTER:
            flat = self._interleave(b, self.buf)
            flat.div_(W)   # pre-divide (reduce_scatter_coalesced): the step does not divide again
            out = torch.empty(b.numel // W, dtype=self.dtype)
            comm.reduce_scatter(out, flat)
            self._shard_take(b, out)
        elif b.pieces:   # one flat group's slices of a bucket over several (allreduce_and_scatter)
            pos = self._positions(b)
            views = [self.buf[pos[pid] + st: pos[pid] + st + ln] for _, pid, st, ln in b.pieces[call]]
            t = torch.cat(views)
            comm.all_reduce(t, group=group)
            o = 0
            for v in views:   # allreduce_no_retain copies the result back
                v.copy_(t[o:o + v.numel()])
                o += v.numel()
            # the reduction's temporaries are gone before the copy into the gradient partition
            # (stage_1_and_2.py reduce_ipg_grads: the reduction returns at 2229-2237, then
            # copy_grads_in_partition at 2269-2271 allocates grads_in_partition, 2192)
            del t, views
            if call == len(b.calls) - 1:
                self._take_allreduced(b)
        else:   # all_reduce of a chunk (or the whole bucket)
            comm.all_reduce(self.buf[self.cur: self.cur + p.comm.numel])
            self.cur += p.comm.numel
            if call == len(b.calls) - 1:
                self._take_allreduced(b)
        if call == len(b.calls) - 1:
            self.buf = None
            self.filled.pop(b.id, None)
            for q in b.pids:
                self.held.pop(q, None)
            self.open_bucket = b.id + 1
            self._fill()

    def _take_allreduced(self, b):
        if self.sharded:
            seg = b.numel // self.world
            self._shard_take(b, self.buf[self.rank * seg:(self.rank + 1) * seg])
            return
        core = self.core
        pos = self._positions(b)
        if self.grads_kept:   # allreduce_no_retain copies back; the flat copy goes with self.buf
            for pid in b.pids:
                g = self.held.pop(pid)
                if pid in self.mine:
                    self.kept[pid] = g.copy_(self.buf[pos[pid]: pos[pid] + self.numels[pid]])
                elif self.overlap_clears:
                    self.previous_reduced.append(g)
            return
        for pid in b.pids:
            own = core.layout[core.group_of[pid]][1]
            lo = max(core.offsets[pid], own.start)
            hi = min(core.offsets[pid] + self.numels[pid], own.stop)
            if hi > lo:
                st = lo - core.offsets[pid]
                self._own_write(pid, st, self.buf[pos[pid] + st: pos[pid] + st + hi - lo])

    def _positions(self, b) -> dict[int, int]:
        pos, o = {}, 0
        for pid in b.pids:
            pos[pid] = o
            o += self.numels[pid]
        return pos

    def partition_grads(self):
        if self.gpart is None:
            self.gpart = torch.zeros(self.gpart_numel, dtype=self.dtype)
            self.gpart_micro = self.micro
        elif self.per_backward and self.micro != self.gpart_micro:
            # see [Note: a grads_in_partition per backward]: a new buffer takes the gradients as
            # they are copied in; the previous one lives until the last of them has moved
            self.held_gpart, self.gpart = self.gpart, self.gpart.clone()
            self.gpart_micro, self.to_move = self.micro, set(self.mine)
        return self.gpart

    def _group_rank(self, g: int) -> int:
        """This rank's index in flat group g's process group (the expert-data-parallel group
        holds ranks i, i+ep, ...: groups.py)."""
        return self.rank // self.core.ep if self.core.plan.groups[g].expert else self.rank

    def _own_write(self, pid: int, start: int, values):
        """Reduced values of `pid` from element `start` into this rank's gradient partition."""
        core = self.core
        _, own, local, _ = core.layout[core.group_of[pid]]
        i = core.offsets[pid] + start - own.start + local
        dst = self.partition_grads()[i: i + values.numel()]
        if self.held_gpart is not None:
            self.to_move.discard(pid)
            if not self.to_move:
                self.held_gpart = None
        if self.boundary_copy:   # reduced once per step, at the boundary
            dst.copy_(values)
        else:
            dst.add_(values)

    def _interleave(self, b, buf):
        """See [Note: reduce-scatter buffer passes]. coalesced_collectives.py reduce_scatter_coalesced: each rank's chunk of every gradient
        in the bucket (gradient order), padded to ceil(n/world), concatenated rank by rank into
        a new buffer (padding zeroed here, where DeepSpeed leaves it uninitialised)."""
        parts, o = [[] for _ in range(self.world)], 0
        for pid in b.pids:
            c, n = self.core.c[pid], self.numels[pid]
            g = buf[o: o + n]
            o += n
            for r in range(self.world):
                lo, hi = min(r * c, n), min((r + 1) * c, n)
                parts[r].append(g[lo:hi])
                if hi - lo < c:
                    parts[r].append(torch.zeros(c - (hi - lo), dtype=self.dtype))
        return torch.cat([t for ts in parts for t in ts])

    def _shard_take(self, b, out):
        o = 0
        goff = self.core.goff   # the trainable params' shards
        for pid in b.pids:
            self.gpart[goff[pid]:goff[pid + 1]].add_(out[o: o + self.core.c[pid]])
            o += self.core.c[pid]
