"""ZeRO stages 0, 1 and 2 as DeepSpeed 0.19.8 runs them (runtime/zero/stage_1_and_2.py,
runtime/engine.py), checked against recorded runs in tests/fixtures/deepspeed.

- Stage 2 (partition_gradients) reduces from the backward hooks in grad-ready order, every
  micro-step, on the reduction stream when overlap_comm. Stage 1 without overlap_comm
  reduces at the accumulation boundary only, walking parameters in registration order
  (reduce_gradients). Buckets and their calls: grad_buckets.py.
- After the step the updated 16-bit partitions are all-gathered in one call per parameter
  group (allgather_bucket_size does not split it in 0.19.8; see the recorded fixtures).
- Stage 0 all-reduces every gradient after backward at the boundary (engine.allreduce_gradients).
- [Note: pipeline gradient reduction] DeepSpeed's PipelineEngine turns the engine's backward
  all-reduce off (pipe/engine.py:80) and reports a gradient-accumulation boundary only while it
  runs ReduceGrads (is_gradient_accumulation_boundary -> _force_grad_boundary), so ZeRO-1's
  hooks reduce nothing during the backward passes: ReduceGrads (_exec_reduce_grads ->
  allreduce_gradients) reduces everything, ZeRO-1 by its reduce_gradients walk, ZeRO-0 and the
  BF16_Optimizer by buffered_allreduce_fallback. (With overlap_comm, 0.19.8's reduce_gradients
  skips its walk; zsim models the walk a correct run needs.)
- [Note: BF16_Optimizer] Stage 1 with bf16 weights and data_types.grad_accum_dtype fp32 runs
  DeepSpeed's BF16_Optimizer (engine.py _configure_bf16_optimizer): fp32 gradient accumulation
  buffers for every parameter, the engine's boundary all-reduce, no overflow/norm collectives.
"""
from __future__ import annotations

from zsim.schedule import offload
from zsim.schedule.context import StageHooks, StepContext
from zsim.schedule.grad_buckets import Zero12Buckets
from zsim.schedule.ir import Alloc, Buffer, Category, Collective, OpKind, Phase, Stream, Tag
from zsim.schedule.payloads import Comm, GradReduce, ParamGather
from zsim.schedule.moe import expert_data_parallel_group, flat_group_process_group, gathered_groups
from zsim.schedule.optimizer import (FP32_BYTES, clip_fp32_norm_ops, grad_norm_ops, model_state_bytes,
                                     optimizer_state_bytes, optimizer_step, stage0_16bit_check_ops)
from zsim.schedule.partition import grads_ready_at, pieces_in_partition
from zsim.schedule.passes import backward, forward
from zsim.schedule.tensor import sequence_parallel_grads
from zsim.workload.module import Module

# engine.py allreduce_gradients -> buffered_allreduce_fallback: MEMORY_OPT_ALLREDUCE_SIZE elements per call
MEMORY_OPT_ALLREDUCE_SIZE = int(5e8)


class Zero012Hooks(StageHooks):
    def __init__(self, ctx: StepContext, pipelined: bool = False, ipg_per_backward: bool = False):
        self.ctx = ctx
        z = ctx.sc.zero
        self.stage = z.stage
        self.ready = grads_ready_at(ctx.wl)
        self.bf16_optimizer = ctx.sc.deepspeed.uses_bf16_optimizer
        self.boundary_allreduce = self.stage == 0 or self.bf16_optimizer
        # see [Note: pipeline gradient reduction]: a pipeline reduces at ReduceGrads only
        self.reduce_in_hooks = not pipelined and not self.boundary_allreduce and (
            self.stage == 2 or (self.stage == 1 and z.overlap))
        # see [Note: ZeRO-1/2 gradient lifetime]; see [Note: ZeRO-0 gradient lifetime]. ZeRO-1 with
        # an offloaded optimizer reduces at the boundary as without it (the hooks that
        # contiguous_gradients forces on only set up the IPG buffer before then: process_gradients,
        # stage_1_and_2.py:2284-2291), so its .grads are autograd's until that walk; stage 2's
        # hooks send each reduced slice to the host (GRADIENTS 0, offload.place_states)
        lazy_grads = (self.stage in (0, 1, 2) and not self.bf16_optimizer
                      and (not ctx.optimizer_offloaded or self.stage == 1))
        self.buckets = Zero12Buckets(ctx, lazy_grads, walk_at_boundary=self.stage == 1 and not self.reduce_in_hooks)
        # [Note: IPG buffer lifetime] setup_buckets (stage_1_and_2.py:3256-3279), called by every
        # gradient hook (process_gradients, :2285), allocates the IPG buffer when none is ready
        # (one of the full reduce_bucket_size elements in the parameter dtype, two with
        # overlap_comm, however small the model), and _release_ipg_buffers drops it in the
        # epilogue. The engine runs the epilogue after every backward at stage 2 only: stage 1
        # reduces at the accumulation boundary alone (engine.py allreduce_gradients), so its
        # buffer, allocated at the first hook of the step's first micro-step, lives through every
        # micro-step (their forwards included) to the boundary's epilogue (ReduceGrads in a
        # pipeline). Measured on DeepSpeed 0.19.8: medium GPT, ZeRO-1 bf16, GAS 2, overlap_comm,
        # 1e7-element buckets, 2 ranks: 40 MB more at the second micro-step's loss backward
        # than a per-backward buffer gives (349.1 MB measured).
        self.ipg_buffers = 2 if z.overlap else 1
        self.ipg_bytes = (self.ipg_buffers * z.reduce_bucket_size * ctx.param_bytes
                          if self.stage >= 1 and self.buckets.contiguous and not self.bf16_optimizer else 0.0)
        self.ipg_per_backward = self.stage == 2 or ipg_per_backward
        self.ipg_micro = self.ipg_op = -1
        self.last_reduce: int | None = None

    def stationary(self, ctx, phase, micro) -> bool:
        """No pre-module hook, and post_module acts in backward only: every forward and
        recompute. A backward between the first micro-step (its allocations) and the boundary
        (its gradient walk), once the IPG buffer lives for the window, at stages 0 and 1 (whose
        hooks reduce nothing before the boundary); see [Note: pass templates]."""
        if phase != Phase.BACKWARD:
            return True
        # (below stage 2, the hooks reduce only at stage 1, and then only at the boundary)
        return (0 < micro < ctx.last_micro and self.stage != 2 and (not self.ipg_bytes or self.ipg_micro >= 0)
                and not self.ipg_per_backward)

    def accumulated_grads(self, ctx, module: Module, micro):
        """[Note: gradient accumulation add] Where DeepSpeed leaves a parameter's .grad alive from
        one micro-step to the next, autograd's AccumulateGrad adds each later micro-step's new
        gradient into it in place (torch/csrc/autograd/functions/accumulate_grad.h: `variable_grad
        += new_grad` once a .grad exists; the new gradient is stolen only while it is None): one
        add_ per parameter, reading both and writing one, in the parameter's dtype (the model's
        16-bit or fp32 width: data_types.grad_accum_dtype defaults to it, engine.py
        get_data_types). DeepSpeed 0.19.8 keeps the .grads through the window at stage 0 (the
        engine all-reduces them at the boundary: allreduce_gradients) and at stage 1 (reduced at
        the boundary, by the hooks or the reduce_gradients walk; the hooks are post-accumulate
        hooks, so the boundary micro-step adds first), the gradients this schedule allocates at
        the first micro-step (Buffer.GRAD16, lazy_grads). Stage 2 moves each reduced gradient out
        of its .grad in the hooks, stage 3 has no persistent .grad, and the BF16_Optimizer
        accumulates into its own fp32 buffers: no add here. The add runs where the gradient is
        final (grads_ready_at: a tied weight's two uses are summed before its one AccumulateGrad)
        and is priced at the profile's grad_accumulate_efficiency (zsim.hardware.compute
        grad_accumulate_time_s; `zsim calibrate` measures it: calibration/harness/bench_zero.py
        bench_grad_accumulate). Measured on DeepSpeed 0.19.8 (CPU/gloo, medium GPT, 2 ranks,
        GAS 2): the second micro-step's backward ran 31 ms of add_ at ZeRO-1 bf16 and 13 ms at
        ZeRO-0 fp32 (23.2 M parameters), the first none. Megatron-LM's gradient_accumulation_fusion
        (training.gradient_accumulation_fusion) accumulates in the weight-gradient GEMM instead
        (fused_weight_gradient_mlp_cuda, wgrad_gemm_accum_fp32 into main_grad): no add."""
        if (micro == 0 or not self.buckets.lazy_grads or self.stage not in (0, 1)
                or ctx.sc.training.gradient_accumulation_fusion):
            return ()
        return self.ready[module.name]

    def post_module(self, ctx, module: Module, micro, phase, op):
        ready = self.ready[module.name]
        if phase != Phase.BACKWARD or not ready:
            return
        if self.ipg_bytes and self.ipg_micro < 0:
            ctx.b.add_alloc(op, Alloc(Tag(Buffer.IPG, micro), Category.BUCKETS, self.ipg_bytes))
            self.ipg_micro, self.ipg_op = micro, op
        if self.buckets.lazy_grads and self.stage in (0, 1) and micro == 0:
            ctx.b.add_alloc(op, *[Alloc(Tag(Buffer.GRAD16, key=pid), Category.GRADIENTS,
                                        self.buckets.numels[pid] * ctx.param_bytes) for pid in ready])
        if self.stage == 2 or micro == ctx.last_micro:
            # DeepSpeed's per-parameter gradient handling on the host: stage 2's hooks every
            # micro-step, stage 0/1's boundary walk over the gradients (charged where each is ready)
            ctx.b.add_grad_hooks(op, len(ready))
        if not self.reduce_in_hooks or (self.stage == 1 and micro != ctx.last_micro):
            return
        if self.stage == 2 and self.buckets.contiguous:
            self.buckets.fresh_grads(module.name, ready, micro, op)
        # see [Note: gradient hook order]
        for pid in reversed(ready):
            self.buckets.add(pid, micro, op)

    def end_backward(self, ctx, micro, last_op):
        self.last_reduce = last_op
        boundary = micro == ctx.last_micro
        if self.boundary_allreduce:
            if boundary:
                self.last_reduce = self._boundary_allreduce(micro, last_op)
            return
        if self.buckets.walk_at_boundary and boundary:
            for pid in self.buckets.trainable:   # frozen params have no gradient
                self.buckets.add(pid, micro, last_op)
        if self.stage == 2 or boundary:
            self.buckets.flush(micro, last_op)
        flushed = self.buckets.flushed_in(micro)
        if flushed is not None and (self.stage == 2 or boundary):
            self.last_reduce = flushed
        epilogue = last_op if flushed is None else flushed   # after this micro-step's last reduction
        if self.buckets.nocg:
            self.buckets.epilogue(epilogue)
        if self.ipg_micro >= 0 and (self.ipg_per_backward or boundary):
            ctx.b.add_free(epilogue, Tag(Buffer.IPG, self.ipg_micro))
            # see [Note: IPG buffer first touch]: only the epilogue's micro-step writes it
            ctx.b.set_touched(self.ipg_op, Tag(Buffer.IPG, self.ipg_micro),
                              self.buckets.ipg_touched_numel(micro, self.ipg_buffers) * ctx.param_bytes)
            self.ipg_micro = -1

    def _boundary_allreduce(self, micro: int, after: int) -> int:
        """engine.allreduce_gradients -> buffered_allreduce_fallback: all grads, in
        MEMORY_OPT_ALLREDUCE_SIZE element buffers; with DeepSpeed-MoE the dense gradients over the
        data-parallel group, then the experts' over their expert-data-parallel group
        (_reduce_non_expert_gradients, _reduce_expert_gradients)."""
        ctx = self.ctx
        last, chunk, start = after, 0, 0
        for group in self.buckets.groups:
            total = sum(self.buckets.numels[p] for p in group.pids)
            for offset in range(0, total, MEMORY_OPT_ALLREDUCE_SIZE):
                n = min(MEMORY_OPT_ALLREDUCE_SIZE, total - offset)
                # engine.allreduce_bucket casts to communication_data_type (engine.py:3800)
                comm = Comm(Collective.ALL_REDUCE, n, n * ctx.reduce_bytes, group=flat_group_process_group(ctx, group),
                            dtype=ctx.reduce_dtype)
                # allreduce_and_copy (engine.py:3795-3826): allreduce_bucket flattens the .grad
                # tensors into a new buffer (plus a cast copy when communication_data_type differs),
                # reduces it and copies it back; both live for the call. The bf16 optimizer reduces
                # its own fp32 accumulation buffers instead.
                flat = ((n * ctx.param_bytes,) + ((n * ctx.reduce_bytes,) if ctx.reduce_bytes != ctx.param_bytes else ())
                        if not self.bf16_optimizer else ())
                allocs = tuple(Alloc(Tag(Buffer.ALLREDUCE_FLAT, micro, f"{chunk}/{i}"), Category.BUCKETS, size)
                               for i, size in enumerate(flat))
                last = ctx.b.add(OpKind.GRAD_ALLREDUCE, Stream.COMPUTE, Phase.BACKWARD, micro,
                                 GradReduce(comm, call=chunk, offset=start + offset), [last], allocs)
                if allocs:
                    ctx.b.add_free(last, *(a.tag for a in allocs))
                chunk += 1
            start += total
        return last


def allocate_states(ctx: StepContext, hooks: Zero012Hooks):
    """The rank's model states: 16-bit params, gradients and the optimizer's shard."""
    z = ctx.sc.zero
    buckets = hooks.buckets
    n_params = sum(ctx.wl.stored_numels(ctx.param_bytes))
    n_trainable = buckets.trainable_numel
    # the flat groups (and their partitions) hold the trainable params only; the frozen ones stay
    # whole on every rank (see [Note: frozen parameters under ZeRO])
    shard = buckets.optimized_numel(z.stage)
    states = model_state_bytes(n_params, shard, z.stage, ctx.param_bytes, trainable=(n_trainable, shard),
                               state_bytes=optimizer_state_bytes(ctx.sc.deepspeed))
    states[Category.PARAMETERS] += ctx.wl.quant_state_bytes
    if hooks.bf16_optimizer:
        states[Category.GRADIENTS] = FP32_BYTES * n_trainable   # fp32 accumulation buffers for every trained param
    if buckets.lazy_grads:
        states[Category.GRADIENTS] = 0.0
    states = offload.place_states(ctx, states, shard)
    for cat, size in states.items():
        ctx.b.static_alloc(cat, size)


def optimizer_boundary(ctx: StepContext, hooks: Zero012Hooks, last: int) -> int:
    """After the last backward: the optimizer step over the rank's shard and, for ZeRO-1/2,
    the all-gather of the updated 16-bit partitions. Returns the last op."""
    z = ctx.sc.zero
    buckets = hooks.buckets
    n_trainable = buckets.trainable_numel
    shard = buckets.optimized_numel(z.stage)
    # the step waits for every reduction (reduction stream synchronised before the step)
    step_deps = [last, hooks.last_reduce]
    tp_grads = sequence_parallel_grads(ctx, step_deps)
    if tp_grads is not None:
        step_deps = [tp_grads]
    if z.stage == 0:
        # the FP16 / DDP_BFLOAT16 wrapper; a bf16 pipeline runs BF16_Optimizer instead
        # (engine.py _do_optimizer_sanity_check), which zsim does not model at stage 0
        wrapped = (ctx.param_bytes < FP32_BYTES and not hooks.bf16_optimizer
                   and not (ctx.sc.precision == "bf16" and ctx.sc.pipeline_stages > 1))
        if ctx.sc.deepspeed.gradient_clipping > 0 and ctx.sc.precision == "fp32":
            step_deps = [clip_fp32_norm_ops(ctx, n_trainable, len(buckets.trainable), step_deps)]
        elif wrapped:
            step_deps = [stage0_16bit_check_ops(ctx, n_trainable, len(buckets.trainable), step_deps)]
        last = optimizer_step(ctx, n_trainable, step_deps, flatten=False,
                              per_tensor=len(buckets.trainable) if wrapped else 0,
                              largest_tensor=max((buckets.numels[p] for p in buckets.trainable), default=0))
        if buckets.lazy_grads:
            # [Note: ZeRO-0 gradient lifetime] without a ZeRO optimizer, _take_model_step ends in
            # the engine's zero_grad (fp32: param.grad = None, engine.py:3495-3500) or
            # FP16_Optimizer.zero_grad(set_to_none=True) (fp16/fused_optimizer.py:137): every
            # gradient is freed after the step, and autograd allocates each again as the next
            # window's first backward produces it, while that backward frees its activations.
            # So at GAS 1 the gradients never coexist with the whole forward's activations.
            # (The bf16 optimizer keeps fp32 accumulation buffers instead.)
            ctx.b.add_free(last, *[Tag(Buffer.GRAD16, key=pid) for pid in buckets.trainable])
        return last
    if not hooks.bf16_optimizer:
        pieces = sum(pieces_in_partition(g, buckets.numels, 0) for g in buckets.groups)
        experts = sum(g.expert for g in buckets.groups)
        step_deps = [grad_norm_ops(ctx, shard, pieces, step_deps, device_passes=not ctx.optimizer_offloaded,
                                   norm_calls=len(buckets.groups),
                                   expert_norms=(expert_data_parallel_group(ctx),) * experts)]
    if ctx.optimizer_offloaded:
        last = offload.offloaded_step(ctx, shard, step_deps + [buckets.last_d2h], None)
    else:
        # stage_1_and_2.py step: `for i, group in enumerate(self.bit16_groups)` flattens and converts
        # one flat group's gradient partition, steps it (_optimizer_step(i)) and drops its copies
        # before the next group's, so only one group's temporaries are alive at a time
        # (see [Note: MoE parameter groups]); the partition buffer itself (grads_in_partition) is
        # one allocation for all groups, gone once the last group has converted its slice
        chain: list[int | None] = step_deps
        stepped = None
        for g, group in enumerate(buckets.groups):
            before = chain[0]
            assert before is not None     # the backward's last op (or the TP gradient reduction)
            # see [Note: the 16-bit partition before the update]
            dropped = (buckets.partition_bytes if g == len(buckets.groups) - 1 and buckets.partition_live
                       and not buckets.held_partition else 0.0)
            stepped = optimizer_step(ctx, group.partition, chain, sub_group=g, dropped_before_update=dropped)
            chain = [stepped]
            if buckets.keeps_all_grads:
                buckets.release_stage1_grads(g, before, stepped)
        assert stepped is not None        # the flat groups: the dense one at least
        last = stepped
        if buckets.partition_live:
            ctx.b.add_free(last, buckets.partition_tag, *((buckets.held_partition,) if buckets.held_partition else ()))
        if buckets.nocg:
            buckets.release_kept(last)
    # all_gather_dp_groups: one all-gather of each whole flat 16-bit group over its own group
    for g in gathered_groups(buckets.groups):
        group = buckets.groups[g]
        n = group.padded
        last = ctx.b.add(OpKind.UPDATED_GATHER, Stream.COMPUTE, Phase.STEP, ctx.last_micro,
                         ParamGather(Comm(Collective.ALL_GATHER, n, n * ctx.param_bytes,
                                          group=flat_group_process_group(ctx, group))), [last])
    return last


def build(ctx: StepContext):
    hooks = Zero012Hooks(ctx)
    allocate_states(ctx, hooks)
    last = None
    # independent_gradient_partition_epilogue (stage_1_and_2.py:1026-1028): under overlap_comm the
    # host synchronizes the device after each backward's last reduction, so the next micro-step's
    # forward starts only when the reduction stream has drained
    sync = ctx.sc.zero.overlap and hooks.reduce_in_hooks
    for micro in range(ctx.gas):
        last = forward(ctx, hooks, micro, last)
        last = backward(ctx, hooks, micro, last)
        if sync and hooks.last_reduce is not None:
            last = hooks.last_reduce
    assert last is not None     # GAS >= 1: the step has its passes
    optimizer_boundary(ctx, hooks, last)
