"""ZeRO stages 0, 1 and 2 as DeepSpeed 0.19.8 runs them (runtime/zero/stage_1_and_2.py,
runtime/engine.py), checked against recorded runs in tests/fixtures/deepspeed/.

- Gradients go into IPG buckets of reduce_bucket_size elements; a bucket is reduced when
  the next gradient would overflow it (reduce_independent_p_g_buckets_and_remove_grads).
- Stage 2 (partition_gradients) reduces from the backward hooks in grad-ready order, every
  micro-step, on the reduction stream when overlap_comm. Stage 1 without overlap_comm
  reduces at the accumulation boundary only, walking parameters in registration order
  (reduce_gradients).
- Each bucket is one all-reduce (use_multi_rank_bucket_allreduce=True, the default:
  average_tensor), else one reduce per destination partition. This moves 2x the bytes of
  the ZeRO paper's reduce-scatter (2(N-1)/N vs (N-1)/N of the gradient).
- After the step the updated 16-bit partitions are all-gathered in one call per parameter
  group (allgather_bucket_size does not split it in 0.19.8; see the recorded fixtures).
- Stage 0 all-reduces every gradient after backward at the boundary (engine.allreduce_gradients).
- Stage 1 with bf16 weights and data_types.grad_accum_dtype fp32 runs BF16_Optimizer: fp32
  gradient accumulation buffers, the engine's boundary all-reduce, no overflow/norm collectives.
"""
from __future__ import annotations

import math

from zsim.schedule.common import (FP32_BYTES, StageHooks, StepContext, backward, forward, grad_norm_ops,
                                  grads_ready_at, model_state_bytes, optimizer_step)
from zsim.schedule import offload
from zsim.schedule.ops import Alloc
from zsim.workload.transformer import Module

# DeepSpeed pads the flat 16-bit group so each rank's partition is aligned
# (stage_1_and_2.py: nccl_start_alignment_factor = 2).
ALIGNMENT = 2


def flat_partition(numels: list[int], world: int) -> tuple[int, int]:
    """(padded flat size, partition size) of one parameter group."""
    total = sum(numels)
    unit = ALIGNMENT * world
    padded = int(math.ceil(total / unit) * unit)
    return padded, padded // world


class Zero012Hooks(StageHooks):
    def __init__(self, ctx: StepContext):
        self.ctx = ctx
        z = ctx.sc.zero
        self.stage = z.stage
        self.bucket_size = z.reduce_bucket_size
        self.numels = [p.numel for p in ctx.wl.params]
        offsets, acc = [], 0
        for n in self.numels:
            offsets.append(acc)
            acc += n
        self.offsets = offsets
        self.padded, self.partition = flat_partition(self.numels, ctx.world)
        self.ready = grads_ready_at(ctx.wl)
        self.bucket: list[int] = []
        self.bucket_numel = 0
        self.pending_tags: list[str] = []
        self.flushes = 0
        self.last_d2h = None
        self.bf16_optimizer = ctx.sc.deepspeed.uses_bf16_optimizer
        self.boundary_allreduce = self.stage == 0 or self.bf16_optimizer
        self.reduce_in_hooks = not self.boundary_allreduce and (self.stage == 2 or (self.stage == 1 and z.overlap))
        self.stream = ctx.grad_stream if self.stage == 2 or z.overlap else "compute"
        # setup_buckets (stage_1_and_2.py:3256-3279) allocates the IPG buffer at the first
        # gradient hook of each backward (one of the full reduce_bucket_size elements in the
        # parameter dtype, two with overlap_comm, however small the model) and
        # _release_ipg_buffers drops it in the backward epilogue
        self.ipg_bytes = ((2 if z.overlap else 1) * z.reduce_bucket_size * ctx.param_bytes
                          if self.stage >= 1 and z.contiguous_gradients and not self.bf16_optimizer else 0.0)
        self.ipg_micro = -1
        self.micro_flush: tuple[int, int] | None = None   # (micro-step, its last reduction op)
        # Gradients exist only while DeepSpeed holds them: autograd allocates each 16-bit .grad
        # in backward (zero_grad set them to None after the last step); a reduced bucket's
        # gradients move into this rank's 16-bit partition (copy_grads_in_partition,
        # grads_in_partition), which the step flattens and frees (averaged_gradients = None).
        # Offloaded gradients go to the host instead (offload.place_states).
        self.lazy_grads = (self.stage in (1, 2) and not self.bf16_optimizer
                           and offload.optimizer_device(ctx) == "none")
        self.partition_live = False

    def pieces_in_partition(self, rank: int) -> int:
        """Parameters with elements in `rank`'s partition of the flat group (its
        averaged_gradients pieces)."""
        lo, hi = rank * self.partition, (rank + 1) * self.partition
        return sum(1 for o, n in zip(self.offsets, self.numels) if o < hi and o + n > lo)

    # -- gradient buckets -------------------------------------------------------------
    def _slices(self) -> list[tuple[int, int]]:
        """(destination rank, elements) slices of the bucket in bucket order; consecutive
        pieces for the same rank merge (average_tensor's rank_and_offsets)."""
        out: list[list[int]] = []
        for pid in self.bucket:
            start, end = self.offsets[pid], self.offsets[pid] + self.numels[pid]
            while start < end:
                rank = start // self.partition
                stop = min(end, (rank + 1) * self.partition)
                if out and out[-1][0] == rank:
                    out[-1][1] += stop - start
                else:
                    out.append([rank, stop - start])
                start = stop
        return [(r, n) for r, n in out]

    def _chunks(self, sizes: list[int]) -> list[int]:
        """allreduce_and_scatter / allreduce_no_retain: issue a call once the accumulated
        slices exceed reduce_bucket_size elements."""
        calls, acc = [], 0
        for n in sizes:
            acc += n
            if acc > self.bucket_size:
                calls.append(acc)
                acc = 0
        if acc:
            calls.append(acc)
        return calls

    def _flush(self, micro: int, after: int, phase: str = "backward"):
        if not self.bucket_numel:
            return after
        ctx, z = self.ctx, self.ctx.sc.zero
        width = ctx.param_bytes
        last = after
        # the boundary walk's previous reduction (or the op the walk starts after): the bucket's
        # gradients were copied into the IPG buffer before this one starts
        before = self.micro_flush[1] if self.micro_flush and self.micro_flush[0] == micro else after
        name = f"reduce bucket {self.flushes}"
        if not z.reduce_scatter:
            # gradient_reduction_w_predivide: the whole bucket in one all-reduce
            calls = [("all_reduce", name, self.bucket_numel)]
        elif z.use_multi_rank_bucket_allreduce:
            calls = [("all_reduce", name, n) for n in self._chunks([n for _, n in self._slices()])]
        else:
            per_rank: dict[int, list[int]] = {}
            for rank, n in self._slices():
                per_rank.setdefault(rank, []).append(n)
            calls = [("reduce", f"{name} -> rank {r}", n) for r, sizes in per_rank.items() for n in self._chunks(sizes)]
        for kind, label, numel in calls:
            last = ctx.b.add(label, self.stream, phase, micro, [after], collective=kind,
                             size_bytes=numel * width, numel=numel)
            if self.lazy_grads and not self.partition_live:
                ctx.b.add_alloc(last, Alloc("grads/partition", "gradients", self.partition * width))
                self.partition_live = True
        if self.lazy_grads and self.stage == 1 and not self.reduce_in_hooks:
            ctx.b.add_free(before, *[f"grad16/{pid}" for pid in self.bucket])
        self.micro_flush = (micro, last)
        if offload.optimizer_device(ctx) != "none":
            owned = sum(n for r, n in self._slices() if r == 0)   # rank 0's slice (ranks are symmetric)
            if owned:
                self.last_d2h = offload.grads_to_host(ctx, owned, micro, last, name)
        if self.pending_tags:
            ctx.b.add_free(last, *self.pending_tags)
            self.pending_tags = []
        self.flushes += 1
        self.bucket, self.bucket_numel = [], 0
        self.last_reduce = last
        return last

    def _add_grad(self, pid: int, micro: int, after: int):
        numel = self.numels[pid]
        if self.bucket_numel + numel > self.bucket_size:
            self._flush(micro, after)
        if self.stage == 2 and not self.ctx.sc.zero.contiguous_gradients:
            # without contiguous_gradients each .grad stays allocated until its bucket is reduced
            tag = f"grad/{micro}/{pid}"
            self.ctx.b.add_alloc(after, Alloc(tag, "gradient buckets", numel * self.ctx.param_bytes))
            self.pending_tags.append(tag)
        if self.lazy_grads and self.stage == 1 and self.reduce_in_hooks:
            # the boundary micro-step's hook copies the accumulated gradient into the IPG buffer
            self.ctx.b.add_free(after, f"grad16/{pid}")
        self.bucket.append(pid)
        self.bucket_numel += numel

    def post_module(self, ctx, module: Module, micro, phase, op):
        if phase == "backward" and self.ready[module.name]:
            if self.ipg_bytes and self.ipg_micro != micro:
                ctx.b.add_alloc(op, Alloc(f"ipg/{micro}", "gradient buckets", self.ipg_bytes))
                self.ipg_micro = micro
            if self.lazy_grads and self.stage == 1 and micro == 0:
                ctx.b.add_alloc(op, *[Alloc(f"grad16/{pid}", "gradients", self.numels[pid] * ctx.param_bytes)
                                      for pid in self.ready[module.name]])
        if phase == "backward" and (self.stage == 2 or micro == ctx.gas - 1) and self.ready[module.name]:
            # DeepSpeed's per-parameter gradient handling on the host: stage 2's hooks every
            # micro-step, stage 0/1's boundary walk over the gradients (charged where each is ready)
            ctx.b.add_grad_hooks(op, len(self.ready[module.name]))
        if phase != "backward" or not self.reduce_in_hooks:
            return
        if self.stage == 1 and micro != ctx.gas - 1:
            return
        # stage 2 hooks fire bias before weight (recorded, tests/fixtures/deepspeed)
        for pid in reversed(self.ready[module.name]):
            self._add_grad(pid, micro, op)

    def end_backward(self, ctx, micro, last_op):
        self.last_reduce = last_op
        if self.boundary_allreduce:
            if micro == ctx.gas - 1:
                self._boundary_allreduce(micro, last_op)
            return
        if self.stage == 1 and not self.reduce_in_hooks:
            if micro == ctx.gas - 1:
                for pid in range(len(self.numels)):
                    self._add_grad(pid, micro, last_op)
        if self.stage == 2 or micro == ctx.gas - 1:
            self._flush(micro, last_op)
        if self.ipg_micro == micro:
            # the epilogue after this micro-step's last reduction
            flushed = self.micro_flush and self.micro_flush[0] == micro
            ctx.b.add_free(self.micro_flush[1] if flushed else last_op, f"ipg/{micro}")

    def _boundary_allreduce(self, micro, after):
        """engine.allreduce_gradients -> buffered_allreduce_fallback: all grads, in
        MEMORY_OPT_ALLREDUCE_SIZE (5e8) element buffers."""
        ctx = self.ctx
        remaining = sum(self.numels)
        last = after
        chunk = int(5e8)
        i = 0
        while remaining > 0:
            n = min(chunk, remaining)
            last = ctx.b.add(f"allreduce gradients {i}", "compute", "backward", micro, [last],
                             collective="all_reduce", size_bytes=n * ctx.param_bytes, numel=n)
            remaining -= n
            i += 1
        self.last_reduce = last


def build(ctx: StepContext):
    z = ctx.sc.zero
    hooks = Zero012Hooks(ctx)
    n_params = ctx.wl.n_params
    shard = hooks.partition if z.stage >= 1 else n_params
    states = model_state_bytes(n_params, shard, z.stage, ctx.param_bytes)
    if hooks.bf16_optimizer:
        states["gradients"] = FP32_BYTES * n_params   # fp32 accumulation buffers for every param
    if hooks.lazy_grads:
        states["gradients"] = 0.0
    states = offload.place_states(ctx, states, shard)
    for cat, size in states.items():
        ctx.b.static_alloc(cat, size)
    last = None
    for micro in range(ctx.gas):
        last = forward(ctx, hooks, micro, last)
        last = backward(ctx, hooks, micro, last)
    # the step waits for every reduction (reduction stream synchronised before the step)
    step_deps = [last, hooks.last_reduce]
    if z.stage == 0:
        last = optimizer_step(ctx, n_params, step_deps, flatten=False)
        return
    offloaded = offload.optimizer_device(ctx) != "none"
    if not hooks.bf16_optimizer:
        step_deps = [grad_norm_ops(ctx, shard, hooks.pieces_in_partition(0), step_deps, device_passes=not offloaded)]
    if offloaded:
        last = offload.offloaded_step(ctx, shard, step_deps + [hooks.last_d2h], None)
    else:
        last = optimizer_step(ctx, shard, step_deps)
        if hooks.partition_live:
            ctx.b.add_free(last, "grads/partition")
    # all_gather_dp_groups: one all-gather of the whole flat 16-bit group
    ctx.b.add("all-gather updated params", "compute", "step", ctx.gas - 1, [last],
              collective="all_gather", size_bytes=hooks.padded * ctx.param_bytes, numel=hooks.padded)
