"""Gradient reduction through IPG buckets, as DeepSpeed 0.19.8 runs it
(runtime/zero/stage_1_and_2.py, runtime/zero/stage3.py; recorded in tests/fixtures/deepspeed).

Gradients enter a bucket of reduce_bucket_size elements in the order their hooks fire; the
bucket is reduced when the next gradient would overflow it (reduce_independent_p_g_buckets_and_
remove_grads) and at the end of the backward.

The rules' named notes sit beside the code they explain.
"""
from __future__ import annotations

from zsim.schedule import offload
from zsim.schedule.context import StepContext
from zsim.schedule.ir import Alloc, Buffer, Category, Collective, Group, OpKind, Phase, ProcessGroup, Stream, Tag
from zsim.schedule.payloads import Comm, GradReduce
from zsim.schedule.zeropp import FP32_BYTES as FP32, qgz_nodes, qgz_work_bytes
from zsim.schedule.moe import flat_group_process_group, moe_param_groups
from zsim.schedule.partition import (bucket_slices, call_sizes, grads_in_partition_numel, in_rank_partition, padded,
                                     scatter_views)


def overflows(bucket_numel: int, numel: int, bucket_size: float) -> bool:
    """reduce_independent_p_g_buckets_and_remove_grads: adding `numel` elements to a bucket of
    `bucket_numel` reduces the bucket first when they would exceed reduce_bucket_size (an empty
    bucket is not reduced: one param larger than the bucket fills it alone)."""
    return bucket_numel + numel > bucket_size


def bucket_fill(fill: int, numels, bucket_size: float) -> int:
    """The bucket's elements after its gradient hooks add `numels` in order (see `overflows`)."""
    for n in numels:
        fill = (0 if fill and overflows(fill, n, bucket_size) else fill) + n
    return fill


class _Buckets:
    """Bucket filling shared by the stages; `_flush` turns a bucket into calls."""

    def __init__(self, ctx: StepContext):
        self.ctx = ctx
        self.numels = [p.numel for p in ctx.wl.params]
        self.bucket: list[int] = []
        self.bucket_numel = 0
        self.flushes = 0
        self.last_reduce: int | None = None
        self.last_d2h: int | None = None
        self.pending: list[Tag] = []   # .grads held until the current bucket's reduction
        self.holds_triggering_tensors = False

    def _hold_until_reduced(self, pid: int, micro: int, after: int):
        """Without contiguous_gradients autograd's .grad is memory of its own until its bucket
        is reduced (the stages' _flush frees `pending`)."""
        tag = Tag(Buffer.GRAD_PENDING, micro, pid)
        self.ctx.b.add_alloc(after, Alloc(tag, Category.BUCKETS, self.numels[pid] * self.ctx.param_bytes))
        self.pending.append(tag)

    # [Note: gradient hook order] DeepSpeed's hooks bucket a module's gradients in a fixed order,
    # recorded in tests/fixtures/deepspeed: stage 2's fire bias before weight, stage 3's weight
    # before bias, and stage 1 without overlap_comm walks every parameter in registration order at
    # the accumulation boundary (reduce_gradients). A tied weight's gradient is final at its first
    # module in forward order (partition.grads_ready_at).
    def add(self, pid: int, micro: int, after: int):
        """A gradient hook after op `after` puts `pid` into the bucket."""
        numel = self.numels[pid]
        if overflows(self.bucket_numel, numel, self.ctx.sc.zero.reduce_bucket_size):
            first = self.ctx.b.next_id
            self.flush(micro, after)
            if self.holds_triggering_tensors and self.ctx.b.next_id > first:
                # [Note: a reduction inside the hook] A bucket is reduced inside the gradient hook of the param
                # that overflows it (reduce_independent_p_g_buckets_and_remove_grads -> reduce_ipg_grads), while
                # the module whose backward made that gradient still holds its input gradient and its fresh
                # .grads: what the reduction allocates (a new grads_in_partition, a flat copy) comes on top of
                # them. When the host waits for the reduction (reductions on the compute stream, or a device with
                # one stream, as a CPU rank) they are freed when its first call ends; with a GPU's reduction stream
                # the hook returns once the call is queued, and they go when the module's backward ends, as before.
                # The 23 ZeRO-2 cases of zero2_cg_peaks.json: the four with 5e5-element buckets -1.1..-1.8% ->
                # -0.4..+1.0%; 21 of 23 within 0.4%.
                self.ctx.b.move_frees(after, first, (Buffer.WORKSPACE, Buffer.GRAD_FRESH))
        self._on_add(pid, micro, after)
        self.ctx.b.add_bucketed(after, pid)
        self.bucket.append(pid)
        self.bucket_numel += numel

    def _on_add(self, pid: int, micro: int, after: int):
        pass

    def flush(self, micro: int, after: int):
        if not self.bucket:
            return
        self._flush(micro, after)
        self.flushes += 1
        self.bucket, self.bucket_numel = [], 0

    def _reduce_op(self, micro: int, after: int, call: int, comm: Comm, dst: int = -1, alloc=(),
                   flat_group: int = 0) -> int:
        payload = GradReduce(comm, bucket=self.flushes, call=call, pids=tuple(self.bucket), dst=dst,
                             flat_group=flat_group)
        return self.ctx.b.add(OpKind.BUCKET_REDUCE, self.ctx.grad_stream, Phase.BACKWARD, micro, payload, [after],
                              alloc)

    # [Note: bucket reduction calls] How one bucket becomes calls:
    # - ZeRO-1/2 (`Zero12Buckets`): one all-reduce of the whole bucket without reduce_scatter; with it
    #   (the default) one all-reduce per reduce_bucket_size of the rank slices
    #   (use_multi_rank_bucket_allreduce, average_tensor), else one `reduce` per destination rank.
    #   This moves 2x the bytes of the ZeRO paper's reduce-scatter (2(N-1)/N vs (N-1)/N).
    # - ZeRO-3 (`Zero3Buckets`): one coalesced reduce-scatter of the padded bucket (all-reduce with
    #   reduce_scatter false, contiguous gradients and at most reduce_bucket_size elements), with
    #   reduce_scatter_coalesced's buffer passes (see [Note: reduce-scatter
    #   buffer passes]).
    # With the optimizer offloaded, this rank's reduced slice goes to the host after each bucket.
    def _flush(self, micro: int, after: int):
        raise NotImplementedError


class Zero12Buckets(_Buckets):
    """ZeRO-1/2 buckets over the flat 16-bit group. [Note: ZeRO-1/2 gradient lifetime]: gradients
    exist only while DeepSpeed holds them. Autograd allocates each 16-bit .grad in backward
    (zero_grad set them to None after the last step); a reduced bucket's gradients move into this
    rank's 16-bit partition (copy_grads_in_partition, grads_in_partition), which the step
    flattens and frees (averaged_gradients = None). Offloaded gradients go to the host instead."""

    def __init__(self, ctx: StepContext, lazy_grads: bool, walk_at_boundary: bool):
        super().__init__(ctx)
        self.groups = moe_param_groups(ctx.sc, ctx.wl, ctx.dp_size)   # see [Note: MoE parameter groups]
        # trainable params only: a frozen one is in no group (see [Note: frozen parameters under ZeRO])
        self.group_of = {pid: g for g, group in enumerate(self.groups) for pid in group.pids}
        self.trainable = sorted(self.group_of)   # registration order
        self.partition = sum(g.partition for g in self.groups)   # this rank's share of every group
        self.trainable_numel = sum(self.numels[p] for p in self.trainable)
        self.lazy_grads = lazy_grads
        self.walk_at_boundary = walk_at_boundary     # ZeRO-1 without overlap_comm: reduce_gradients
        self.partition_live = False
        # a reduction the host waits for: on the compute stream, or a device with one stream
        self.holds_triggering_tensors = (ctx.grad_stream == Stream.COMPUTE
                                         or not ctx.sc.cluster.profile.gpu.concurrent_streams)
        self.partition_tag = Tag(Buffer.GRAD_PARTITION)   # the live grads_in_partition
        self.partition_bytes = 0.0                         # its size
        # [Note: a grads_in_partition per backward] copy_grads_in_partition allocates grads_in_partition
        # as the sum of `numel()` of the params with elements in the rank's partition, each whole
        # (stage_1_and_2.py:2184-2194): a param straddling the partition's edge counts on both ranks, so
        # ranks differ, by up to two params. The backward's epilogue (_release_ipg_buffers, :924-931)
        # forgets it, at stage 2 after every backward (see [Note: IPG buffer lifetime]), while the
        # params' .grads still view it: the next backward's first copy allocates a new one, and the old
        # one is freed once the last of the rank's gradients has been copied out of it. zsim models the
        # last rank, whose gradients come first in backward (its new buffer appears at the first
        # reduction, with the activations all alive), and sizes the buffer by the largest rank. Traced on
        # DeepSpeed 0.19.8 (small GPT fp32, 2 ranks, GAS 2 and 4, 5e5-element buckets): rank 1 peaks at
        # its first copy of the second micro-step with two 8,418,304-byte buffers (2,104,576 elements;
        # the partition is 1,858,304); rank 0's are 1,874,176 elements. The 23 ZeRO-2 cases with
        # contiguous gradients DeepSpeed ran in the eight random seeds
        # (tests/fixtures/measured/zero2_cg_peaks.json): -0.1% to -12.7% before both notes, -1.8% to
        # +2.2% after (see [Note: a reduction inside the hook] for the next step).
        # the last rank's partition, whose gradients come first
        self.last_rank_pids = frozenset(p for g in self.groups for p in g.pids
                                        if in_rank_partition(g, self.numels, p, g.ranks - 1))
        self.moved = 0   # the last rank's gradients copied since the held one was replaced
        self.held_partition: Tag | None = None   # the previous one, until the last rank's gradients have moved
        self.partition_micro = -1
        z = ctx.sc.zero
        # stage_1_and_2.py:300: `contiguous_gradients or self.cpu_offload`
        self.contiguous = z.contiguous_gradients or ctx.optimizer_offloaded
        # [Note: ZeRO-1 gradients without contiguous_gradients] Stage 1 (no partition_gradients) never
        # clears a .grad in reduce_ipg_grads (stage_1_and_2.py:2272-2274 copies into the partition only
        # with contiguous_gradients), so every .grad lives from its first backward to the step, which
        # frees the flat group's .grads outside this rank's partition before flattening its partition
        # and the rest once flattened (step, :3103 and :3128). Each reduction flattens its bucket as
        # stage 2's does (buffered_reduce_fallback -> allreduce_and_copy). Measured (DeepSpeed 0.19.8
        # and the own core, CPU/gloo, random seed 636046235 case 10: small GPT, world 4, fp32, GAS 1,
        # default 5e8 bucket): 55.75 MB at the boundary's reduction, params + Adam partition + every
        # .grad + the flat copy; zsim freed the .grads at the reduction and held no flat copy (46.48 MB,
        # -16.6%).
        # every .grad kept to the step
        self.keeps_all_grads = self.nocg and z.stage == 1 and lazy_grads
        self.kept: set[int] = set()    # in-partition .grads held to the step (ZeRO-2 nocg)
        self.accumulated: list[Tag] = []   # their fresh .grads of this backward, from the second micro-step on
        self.overlap_held: list[Tag] = []   # out-of-partition .grads cleared at the next reduction or the epilogue
        self.micro_flush: tuple[int, int] | None = None   # (micro-step, its last reduction op)
        self.fills: dict[int, list[int]] = {}   # micro-step -> elements each flush copied into the IPG buffer

    @property
    def nocg(self) -> bool:
        return not self.contiguous

    def ipg_touched_numel(self, micro: int, buffers: int) -> int:
        """[Note: IPG buffer first touch] Elements of the IPG buffers that micro-step `micro`
        writes: each bucket's gradients are copied to the start of buffer `bucket.index`
        (reduce_independent_p_g_buckets_and_remove_grads, stage_1_and_2.py:1455), which
        overlap_comm flips after every reduction (:1428) and setup_buckets resets to 0 at each
        backward; a gradient over reduce_bucket_size bypasses the buffer. So each of the
        `buffers` buffers is written up to its fullest bucket, however large it is: the rest of a
        default 5e8-element buffer is never faulted in."""
        fills = self.fills.get(micro, [])
        return sum(max(fills[i::buffers], default=0) for i in range(buffers))

    def _on_add(self, pid: int, micro: int, after: int):
        z = self.ctx.sc.zero
        if self.nocg and z.stage == 2:
            # [Note: ZeRO-2 gradients without contiguous_gradients] Without contiguous_gradients a
            # reduced bucket is not copied into a partition buffer (copy_grads_in_partition is the
            # contiguous path): reduce_ipg_grads (stage_1_and_2.py) all-reduces a flat copy of the bucket's
            # grads (allreduce_bucket's flatten, freed once copied back) and clears the .grad of every param
            # outside this rank's partition (with overlap_comm later, as previous_reduced_grads: at the next
            # reduction's start, or at the backward's epilogue after its last reduction, whichever comes
            # first; _clear_previous_reduced_grads, stage_1_and_2.py:1030 and :2415; so none is held from one
            # backward into the next: a small GPT, world 4, bf16, GAS 2, one 5e8 bucket, overlap_comm,
            # peaked at 35.95 MB on DeepSpeed and the own core, where zsim held them to the next micro-step's
            # reduction, 40.88 MB, random seed 1999630423 case 17).
            # The .grads of the params touching it stay until the backward's epilogue, which takes them as
            # its accumulator (all_grad_tensors) and leaves their .grad None: from the second micro-step on,
            # each backward makes fresh .grads of them beside the accumulator, which the epilogue adds in and
            # drops. The accumulator lives to the step, which flattens and frees it (free_grad_in_param_list).
            # Traced on DeepSpeed 0.19.8 (CPU/gloo, fp32, world 2, GAS 3): at every epilogue's end all 25
            # in-partition .grads are None and all_grad_tensors holds 25 other tensors; with one 5e8 bucket
            # the fresh grads are alive at the epilogue's reduction (the peak: the in-partition grads twice),
            # with small buckets they appear only as the backward reaches the first layers (rank 0's
            # partition). Measured peaks (DeepSpeed, seeds 975049619, 1014857976, 636046235): small ZeRO-2
            # bf16 world 4 with overlap_comm, 9.1% under before the flat copy, now exact; small fp32 GAS 3
            # one bucket, 13.6% under before the second copy, now -1.2%; medium fp32 GAS 4 rb 1e7 and small
            # fp32 GAS 4 rb auto, +11.7% and +7.1% over while the second copy was held for the whole window,
            # now within 1.3%. The own core keeps the .grads the same way (calibration/core/grads.py grads_kept;
            # it copied them into a grads_in_partition allocated at the first reduction, on top of the held
            # gradients and the flat copy: +7.5% and +12.6% over DeepSpeed at GAS 1, s975049619-09 and
            # s636046235-01, now exact).
            if self._in_partition(pid):   # (an offloaded optimizer makes gradients contiguous)
                size = self.numels[pid] * self.ctx.param_bytes
                if pid not in self.kept:
                    self.kept.add(pid)
                    self.ctx.b.add_alloc(after, Alloc(Tag(Buffer.GRAD_KEPT, key=pid), Category.GRADIENTS, size))
                else:
                    # the epilogue left the .grad None and keeps the accumulator: a fresh .grad
                    # until this backward's epilogue
                    tag = Tag(Buffer.GRAD_ACCUM_COPY, micro, pid)
                    self.ctx.b.add_alloc(after, Alloc(tag, Category.GRADIENTS, size))
                    self.accumulated.append(tag)
            else:
                self._hold_until_reduced(pid, micro, after)
        if self.contiguous and z.stage == 2 and self.numels[pid] > z.reduce_bucket_size:
            # [Note: autograd's gradient before the hook] With contiguous_gradients, ZeRO-2's hook copies
            # each gradient into the IPG buffer and points the .grad at the copy
            # (reduce_independent_p_g_buckets_and_remove_grads, stage_1_and_2.py:1440-1455): the tensor
            # autograd made is memory of its own from the module's backward to that hook, beside the
            # module's input gradient. A gradient larger than reduce_bucket_size bypasses the buffer and
            # waits for the next reduction (extra_large_param_to_reduce). Traced on DeepSpeed 0.19.8
            # (CPU/gloo, small GPT fp32, 2 ranks): at the peak, inside the last layer's fc_out backward, its
            # 1 MiB weight gradient is alive with its 1 MiB input gradient.
            # it bypasses the IPG buffer
            self._hold_until_reduced(pid, micro, after)
        if self.lazy_grads and z.stage == 1 and not self.walk_at_boundary and not self.nocg:
            # the boundary micro-step's hook copies the accumulated gradient into the IPG buffer
            self.ctx.b.add_free(after, Tag(Buffer.GRAD16, key=pid))

    def fresh_grads(self, module: str, pids, micro: int, op: int):
        """See [Note: autograd's gradient before the hook]: the .grads of `pids` that op `op`
        (`module`'s backward) makes, alive for the op, one allocation (those over
        reduce_bucket_size wait for their reduction instead, _on_add)."""
        rbs = self.ctx.sc.zero.reduce_bucket_size
        numel = sum(self.numels[p] for p in pids if self.numels[p] <= rbs)
        if numel:
            tag = Tag(Buffer.GRAD_FRESH, micro, module)
            self.ctx.b.add_alloc(op, Alloc(tag, Category.GRADIENTS, numel * self.ctx.param_bytes))
            self.ctx.b.add_free(op, tag)

    def _calls(self) -> list[tuple[Collective, int, int, int]]:
        """(collective, destination rank in the group or -1, elements, flat group) of the current
        bucket's calls; each group's slices are reduced over its own process group."""
        z = self.ctx.sc.zero
        if not z.reduce_scatter:
            # gradient_reduction_w_predivide: the whole bucket in one all-reduce over the dp group
            return [(Collective.ALL_REDUCE, -1, self.bucket_numel, 0)]
        if not self.contiguous:
            # reduce_ipg_grads without contiguous_gradients (stage_1_and_2.py:2230-2237):
            # buffered_reduce_fallback -> allreduce_no_retain(numel_per_bucket=bucket.elements), i.e.
            # the bucket's grads flattened into one all-reduce whatever partitions they straddle
            # (average_tensor's per-rank slices are the contiguous path only). One call per flat
            # group here; MoE expert groups without contiguous_gradients were not recorded.
            numel_of: dict[int, int] = {}
            for pid in self.bucket:
                numel_of[self.group_of[pid]] = numel_of.get(self.group_of[pid], 0) + self.numels[pid]
            return [(Collective.ALL_REDUCE, -1, n, g) for g, n in numel_of.items()]
        slices = bucket_slices(self.bucket, self.groups, self.group_of, self.numels)
        keyed: dict[tuple[int, int], list[int]] = {}   # (group, dst or -1) in order of first appearance
        for g, rank, n in slices:
            keyed.setdefault((g, -1 if z.use_multi_rank_bucket_allreduce else rank), []).append(n)
        collective = Collective.ALL_REDUCE if z.use_multi_rank_bucket_allreduce else Collective.REDUCE
        return [(collective, dst, n, g) for (g, dst), sizes in keyed.items() for n in call_sizes(sizes, z.reduce_bucket_size)]

    def _flush(self, micro: int, after: int):
        ctx, width = self.ctx, self.ctx.param_bytes
        rbs = ctx.sc.zero.reduce_bucket_size
        last_rank = sum(1 for p in self.bucket if p in self.last_rank_pids)   # its gradients in this bucket
        self.fills.setdefault(micro, []).append(sum(n for n in map(self.numels.__getitem__, self.bucket) if n <= rbs))
        # the boundary walk's previous reduction (or the op the walk starts after): the bucket's
        # gradients were copied into the IPG buffer before this one starts
        before = self.micro_flush[1] if self.micro_flush and self.micro_flush[0] == micro else after
        last = after
        for call, (collective, dst, numel, g) in enumerate(self._calls()):
            alloc: tuple[Alloc, ...] = ()
            if self.nocg:
                # allreduce_bucket flattens the bucket's grads into one new tensor
                # (stage_1_and_2.py allreduce_and_copy), freed once copied back
                flat = Tag(Buffer.ALLREDUCE_FLAT, micro, f"{self.flushes}/{call}")
                alloc = (Alloc(flat, Category.BUCKETS, numel * width),)
            elif self.lazy_grads and not ctx.optimizer_offloaded and call == 0 and self._new_partition(micro, last_rank):
                # (offloaded, copy_grads_in_partition sends the slice to the host's fp32 gradients)
                held = grads_in_partition_numel(self.groups, self.numels)   # whole params, largest rank
                self.partition_bytes = held * width
                alloc = (Alloc(self.partition_tag, Category.GRADIENTS, self.partition_bytes),)
            # allreduce_bucket casts the flat bucket to communication_data_type (stage_1_and_2.py:2376)
            comm = Comm(collective, numel, numel * ctx.reduce_bytes, group=flat_group_process_group(ctx, self.groups[g]),
                        dtype=ctx.reduce_dtype)
            last = self._reduce_op(micro, after, call, comm, dst, alloc, g)
            if self.nocg:
                ctx.b.add_free(last, *(a.tag for a in alloc))
        if self.lazy_grads and ctx.sc.zero.stage == 1 and self.walk_at_boundary and not self.nocg:
            ctx.b.add_free(before, *[Tag(Buffer.GRAD16, key=pid) for pid in self.bucket])
        self.micro_flush = (micro, last)
        if self.held_partition is not None:
            self.moved += last_rank
            if self.moved == len(self.last_rank_pids):
                ctx.b.add_free(last, self.held_partition)   # its last gradient has moved
                self.held_partition = None
        if ctx.optimizer_offloaded:
            mine = [n for _, r, n in bucket_slices(self.bucket, self.groups, self.group_of, self.numels)
                    if r == 0]   # rank 0's slices (ranks are symmetric)
            if sum(mine):
                self.last_d2h = offload.grads_to_host(ctx, sum(mine), micro, last, f"bucket {self.flushes}", len(mine))
        if self.pending and self.nocg and ctx.sc.zero.overlap:
            # reduce_ipg_grads with overlap_comm and no contiguous_gradients clears the other
            # partitions' grads at the next reduction (previous_reduced_grads)
            ctx.b.add_free(last, *self.overlap_held)
            self.overlap_held, self.pending = self.pending, []
        elif self.pending:
            ctx.b.add_free(last, *self.pending)
            self.pending = []
        self.last_reduce = last

    def _new_partition(self, micro: int, last_rank: int) -> bool:
        """Whether this flush's copies allocate a grads_in_partition: the step's first, or at
        stage 2 a later micro-step's first flush holding the last rank's gradients, which then
        holds the previous one until they have all moved (see [Note: a grads_in_partition per
        backward])."""
        if not self.partition_live:
            self.partition_live, self.partition_micro = True, micro
            return True
        if self.ctx.sc.zero.stage != 2 or micro == self.partition_micro or not last_rank:
            return False
        self.held_partition, self.moved = self.partition_tag, 0
        self.partition_tag, self.partition_micro = Tag(Buffer.GRAD_PARTITION, micro), micro
        return True

    def _in_partition(self, pid: int) -> bool:
        """is_param_in_current_partition for rank 0 (ranks are symmetric): any slice is its."""
        return any(r == 0 for _, r, _ in bucket_slices((pid,), self.groups, self.group_of, self.numels))

    def release_stage1_grads(self, group: int, before_step: int, after_step: int):
        """See [Note: ZeRO-1 gradients without contiguous_gradients]: step() frees a flat group's .grads
        outside this rank's partition before flattening its partition, the others once flattened."""
        mine = {p: self._in_partition(p) for p in self.groups[group].pids}
        self.ctx.b.add_free(before_step, *(Tag(Buffer.GRAD16, key=p) for p, m in mine.items() if not m))
        self.ctx.b.add_free(after_step, *(Tag(Buffer.GRAD16, key=p) for p, m in mine.items() if m))

    def epilogue(self, op: int):
        """The backward's epilogue (ZeRO-2 without contiguous gradients, see [Note: ZeRO-2
        gradients without contiguous_gradients]): it adds the fresh .grads into all_grad_tensors
        and drops them, and clears the out-of-partition .grads overlap_comm held since the last
        reduction (_clear_previous_reduced_grads). Both lists fill at stage 2 only."""
        if self.accumulated or self.overlap_held:
            self.ctx.b.add_free(op, *self.accumulated, *self.overlap_held)
            self.accumulated, self.overlap_held = [], []

    def release_kept(self, op: int):
        """The step's free_grad_in_param_list (the overlap-held grads went at the epilogue)."""
        self.ctx.b.add_free(op, *(Tag(Buffer.GRAD_KEPT, key=pid) for pid in sorted(self.kept)))
        self.kept = set()

    def optimized_numel(self, stage: int) -> int:
        """What this rank's optimizer steps: its partition of the flat groups under ZeRO-1/2,
        every trained param at stage 0."""
        return self.partition if stage >= 1 else self.trainable_numel

    def flushed_in(self, micro: int) -> int | None:
        """The last reduction op of `micro`, if it had one."""
        return self.micro_flush[1] if self.micro_flush and self.micro_flush[0] == micro else None


class Zero3Buckets(_Buckets):
    def _on_add(self, pid: int, micro: int, after: int):
        if not self.ctx.sc.zero.contiguous_gradients:
            # stage3.py reduce_independent_p_g_buckets_and_remove_grads copies a .grad into the
            # IPG buffer only with contiguous_gradients (:1626); otherwise autograd's own .grad
            # waits for its bucket, and partition_grads drops it after the reduce-scatter
            self._hold_until_reduced(pid, micro, after)

    def _scatter_traffic_bytes(self, numel: int, micro: int, interleaved: bool) -> float:
        """[Note: reduce-scatter buffer passes] Around one bucket's reduce-scatter, DeepSpeed 0.19.8's stage3.py
        __avg_scatter_grads -> coalesced_collectives.py reduce_scatter_coalesced interleaves the
        bucket's per-rank chunks into a new buffer (torch.cat: read + write, skipped for a single
        tensor that divides evenly) and pre-divides it in place (div_: read + write); then
        partition_grads copies each rank's partition into its grad buffer (copy_ at the first
        micro-step, add_ after: read + write, or 2 reads + write). The bucket is in
        communication_data_type, the grad partitions in the model dtype."""
        # the gradients are in communication_data_type from the IPG buffer on (stage3.py:780-784,
        # 1919); the partitions the reduced slice lands in hold the model dtype
        b, r = self.ctx.param_bytes, self.ctx.reduce_bytes
        interleave = 2.0 * numel * r if interleaved else 0.0
        predivide = 2.0 * numel * r
        partition = (r + b + (b if micro else 0)) * numel / self.ctx.dp_size
        return interleave + predivide + partition

    def _flush(self, micro: int, after: int):
        ctx = self.ctx
        if qgz_nodes(ctx) > 1:
            self._qgz_flush(micro, after)
            return
        numel = sum(padded(self.numels[p], ctx.dp_size) for p in self.bucket)
        size_bytes = numel * ctx.reduce_bytes
        z = ctx.sc.zero
        # stage3.py __reduce_and_partition_ipg_grads: the all-reduce path needs contiguous
        # gradients and a bucket within reduce_bucket_size (one param larger than it fills a
        # bucket alone); anything else goes through __avg_scatter_grads' reduce_scatter_coalesced
        elements = sum(self.numels[p] for p in self.bucket)
        allocs: tuple[Alloc, ...] = ()
        if not z.reduce_scatter and z.contiguous_gradients and elements <= z.reduce_bucket_size:
            comm = Comm(Collective.ALL_REDUCE, numel, size_bytes, dtype=ctx.reduce_dtype)
        else:
            interleaved = not (len(self.bucket) == 1 and self.numels[self.bucket[0]] % ctx.dp_size == 0)
            ctx.b.add_host_views(after, scatter_views(ctx.dp_size, len(self.bucket), interleaved))
            comm = Comm(Collective.REDUCE_SCATTER, numel, size_bytes,
                        buffer_bytes=self._scatter_traffic_bytes(numel, micro, interleaved), dtype=ctx.reduce_dtype)
            # [Note: gloo reduce-scatter copy] gloo has no native reduce-scatter: ProcessGroupGloo's
            # reduce_scatter_tensor works on a copy of its whole input, alive for the call (measured on torch
            # 2.13 CPU/gloo by calibration/harness/bench_comm.py bench_collective_memory: one input's bytes in
            # fp32 and bf16, whether the output aliases the input or not; all_gather_into_tensor and
            # all_reduce allocate nothing); NCCL's allocates nothing through the CUDA allocator. A profile
            # carries it as gpu.reduce_scatter_temp_fraction (zsim calibrate measures it) and ZeRO-3's
            # gradient reduce-scatter holds it beside its bucket. Traced on DeepSpeed (seed 422533424 case 01,
            # small ZeRO-3 fp32 without contiguous_gradients on 2 ranks): its peak is inside the call with the
            # interleaved bucket and gloo's copy, 7.37 MB each. The 28 ZeRO-3 peaks DeepSpeed measured in
            # the random validations: MAPE 2.1% -> 0.4% (the 2-rank non-contiguous cases -6.2..-13.9% ->
            # -1.0..-3.4%; every other case unchanged).
            # reduce_scatter_coalesced's interleaved copy lives for the call, and so does the
            # backend's own copy of the input where it makes one (see [Note: gloo reduce-scatter copy])
            allocs = ((Alloc(Tag(Buffer.SCATTER_COPY, micro, self.flushes), Category.BUCKETS, size_bytes),)
                      if interleaved else ())
            backend_copy = ctx.sc.cluster.profile.gpu.reduce_scatter_temp_fraction * size_bytes
            if backend_copy > 0:
                allocs += (Alloc(Tag(Buffer.COLLECTIVE_TEMP, micro, self.flushes), Category.BUCKETS, backend_copy),)
        self.last_reduce = self._reduce_op(micro, after, 0, comm, alloc=allocs)
        ctx.b.add_free(self.last_reduce, *(a.tag for a in allocs), *self.pending)
        self.pending = []
        if ctx.optimizer_offloaded:
            self.last_d2h = offload.grads_to_host(ctx, numel / ctx.dp_size, micro, self.last_reduce,
                                                  f"bucket {self.flushes}")

    def _qgz_flush(self, micro: int, after: int):
        """The bucket's gradients through all_to_all_quant_reduce, one tensor at a time (see
        [Note: qgZ quantized gradient reduction])."""
        ctx = self.ctx
        world, gpn = ctx.dp_size, ctx.sc.cluster.gpus_per_node
        nodes = world // gpn
        local, across = ProcessGroup(Group.QGZ_LOCAL, gpn), ProcessGroup(Group.QGZ_GLOBAL, nodes, gpn)
        params = ctx.wl.params
        last = after
        for i, pid in enumerate(self.bucket):
            n, shape = self.numels[pid], params[pid].shape
            # the rank's slice into its gradient partition (partition_grads)
            partition = (ctx.reduce_bytes + ctx.param_bytes + (ctx.param_bytes if micro else 0)) * n / world
            comms: list[tuple[Comm, tuple[Alloc, ...]]]
            if len(shape) < 2 or n % (2 * world):
                # a 1-D tensor, or one the two-hop all-to-all cannot split: reduce_scatter_coalesced
                # of it alone over the whole world, in the communication dtype
                m = padded(n, world)
                # reduce_scatter_coalesced pre-divides it in place (read + write)
                comms = [(Comm(Collective.REDUCE_SCATTER, m, m * ctx.reduce_bytes,
                               buffer_bytes=2.0 * m * ctx.reduce_bytes + partition, dtype=ctx.reduce_dtype), ())]
            else:
                q = max(shape[0], shape[1], world)          # intra_quant_group
                work = qgz_work_bytes(n, q, gpn, world)
                scratch = Tag(Buffer.SCATTER_COPY, micro, f"qgz {self.flushes}.{i}")
                comms = [(Comm(Collective.ALL_TO_ALL, n // 2, n / 2, buffer_bytes=work[0], group=local, dtype="int4"),
                          (Alloc(scratch, Category.BUCKETS, n + 8.0 * q),)),
                         (Comm(Collective.ALL_TO_ALL, q, FP32 * q, group=local, dtype="fp32"), ()),
                         (Comm(Collective.ALL_TO_ALL, n // (2 * gpn), n / (2 * gpn), buffer_bytes=work[1],
                               group=across, dtype="int4"), ()),
                         (Comm(Collective.ALL_TO_ALL, q // gpn, FP32 * q / gpn, buffer_bytes=work[2] + partition,
                               group=across, dtype="fp32"), ())]
            for call, (comm, alloc) in enumerate(comms):
                last = self._reduce_op(micro, last, call + 4 * i, comm, alloc=alloc)
            if len(comms) > 1:
                ctx.b.add_free(last, Tag(Buffer.SCATTER_COPY, micro, f"qgz {self.flushes}.{i}"))
        self.last_reduce = last
        ctx.b.add_free(self.last_reduce, *self.pending)
        self.pending = []
        if ctx.optimizer_offloaded:
            numel = sum(padded(self.numels[p], ctx.dp_size) for p in self.bucket)
            self.last_d2h = offload.grads_to_host(ctx, numel / ctx.dp_size, micro, self.last_reduce,
                                                  f"bucket {self.flushes}")
