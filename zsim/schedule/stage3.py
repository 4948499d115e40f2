"""ZeRO stage 3 as DeepSpeed 0.19.8 runs it: parameter fetch and release around every module
(param_fetch.py), gradients reduce-scattered from the hooks (grad_buckets.py), persistent
params re-gathered after the step. Checked against recorded DeepSpeed runs in
tests/fixtures/deepspeed/."""
from __future__ import annotations

from zsim.schedule import offload
from zsim.schedule.context import StageHooks, StepContext
from zsim.schedule.grad_buckets import Zero3Buckets
from zsim.schedule.layer_skip import LayerSkip
from zsim.schedule.ir import Category, Collective, OpKind, Phase, Stream
from zsim.schedule.payloads import Comm, ParamGather
from zsim.schedule.optimizer import (FP32_BYTES, NORM_DTYPE_BYTES, grad_norm_ops, model_state_bytes,
                                     optimizer_state_bytes, optimizer_step)
from zsim.schedule.param_fetch import ParamCoordinator, leaf_of
from zsim.schedule.zeropp import qgz_nodes, secondary_bytes, stored_groups, stored_int8
from zsim.schedule.partition import (grads_ready_at, padded, persistent_params, shard_numel, sub_group_sizes,
                                     trainable_numels)
from zsim.schedule.passes import backward, forward
from zsim.schedule.tensor import TensorCollectives, sequence_parallel_grads
from zsim.workload.module import Module
from zsim.workload.preference import is_reference, reference_engine, runs_peft_reference


# [Note: a reference engine under ZeRO-3] A preference run's frozen reference copy is an engine
# of its own (TRL prepare_deepspeed: deepspeed.initialize(model=ref, config=<the trainer's>), no
# optimizer; see [Note: preference training]): its own parameter coordinator, whose trace is its
# forward alone, so neither engine prefetches the other's parameters. Recorded on DeepSpeed 0.19.8
# (tests/fixtures/deepspeed_dpo/stage3_dpo*.json): it gathers every one of its parameters in each
# forward, those under the persistence threshold too (without a ZeRO-3 optimizer nothing gathers
# them once and keeps them), and has no step, so no post-step gather.
#
# [Note: a PEFT reference under ZeRO-3] With PEFT and no ref_model the reference forward is the
# trained engine's own modules with the adapters disabled (TRL null_ref_context): each micro-step
# the coordinator sees two forwards whose module orders differ (the adapters run in one, not the
# other), so the trace it records never repeats (partitioned_param_coordinator.py: "Invalidate
# trace cache"), is never complete, and the coordinator runs as it does while recording: no
# prefetch, and release_sub_module frees every parameter of a module after it ran (no reuse
# distance; the persistent ones too, which the post-step gather brings back). Recorded
# (tests/fixtures/deepspeed_dpo/stage3_dpo_lora*.json): every base weight fetched on demand in
# both forwards and again in backward; zsim's gathered elements agree within 0.5% a phase with
# prefetch off. Not modelled: the adapter-disabled forward still fetches each lora_A (32 small
# calls here), and at DeepSpeed's default prefetch bucket the reference forward also issues one
# prefetch at its root (26.9 M elements here) besides its on-demand fetches, so the recorded
# forward gathers 78.3 M elements to zsim's 52.5 M.
class Zero3Hooks(StageHooks):
    def __init__(self, ctx: StepContext, persistent: tuple[int, ...]):
        peft_reference = runs_peft_reference(ctx.wl)
        self.fetch = ParamCoordinator(ctx, persistent, traced=not peft_reference)
        # see [Note: a reference engine under ZeRO-3]
        self.ref_engine = reference_engine(ctx.wl)
        self.ref_fetch = ParamCoordinator(ctx, (), self.ref_engine) if self.ref_engine else None
        self.ref_last = next((m.name for m in reversed(ctx.wl.modules) if m.name in self.ref_engine), None)
        self.visit_fetch = self.fetch      # the coordinator of the open visit
        self.buckets = Zero3Buckets(ctx)
        self.ready = grads_ready_at(ctx.wl)
        self.current_visit: int | None = None
        # see [Note: ZeRO-3 leaf modules]: the leaf's visit is released after its last module
        # runs (forward order) or its first (backward)
        self.leaf_span: dict[str, list[str]] = {}
        for m in ctx.wl.modules:
            leaf = leaf_of(m, self.fetch.leaves)
            if leaf is not None:
                self.leaf_span.setdefault(leaf, [m.name, m.name])[1] = m.name
        self.leaf: tuple[str, int] | None = None     # the open leaf container and its visit

    def pre_module(self, ctx, module: Module, micro, phase):
        f = self.visit_fetch = self.ref_fetch if module.name in self.ref_engine and self.ref_fetch else self.fetch
        if self.leaf is not None and self.leaf[0] in module.containers:
            self.current_visit = None
            return []
        # container visits and param-less leaves that precede this module in the trace, of its
        # pass: the root's backward visit runs when backward starts (its pre-backward hook), not
        # at the loss's forward, though no module with params comes between
        f.visit_containers(module.name, micro, phase)
        self.current_visit = None
        if f.step_id < len(f.visits):
            v = f.visits[f.step_id]
            if v.module == module.name or (v.module in f.leaves and v.module in module.containers):
                if v.module in f.leaves:
                    self.leaf = (v.module, f.step_id)
                else:
                    self.current_visit = f.step_id
                return f.visit(v, micro, phase)
        return []

    def post_module(self, ctx, module: Module, micro, phase, op):
        f = self.visit_fetch
        f.module_ran(op)
        if self.current_visit is not None:
            f.release(self.current_visit, micro, op)
        if self.leaf is not None:
            first, last = self.leaf_span[self.leaf[0]]
            if module.name == (first if phase == Phase.BACKWARD else last):
                f.release(self.leaf[1], micro, op)
                self.leaf = None
        if module.name == self.ref_last and self.ref_fetch is not None:
            self.ref_fetch.release_all(micro, op)     # the reference engine's forward ends
        if phase == Phase.BACKWARD:
            # see [Note: gradient hook order]
            for pid in self.ready[module.name]:
                self.buckets.add(pid, micro, op)

    def end_backward(self, ctx, micro, last_op):
        self.buckets.flush(micro, last_op)
        self.fetch.release_all(micro, last_op)


def build(ctx: StepContext):
    z = ctx.sc.zero
    numels = ctx.wl.stored_numels(ctx.param_bytes)   # a 4-bit weight's packed elements (see [Note: bitsandbytes quantized base weights])
    # the trained engine's (a reference copy's engine keeps none: see [Note: a reference engine under ZeRO-3])
    reference = {i for i, p in enumerate(ctx.wl.params) if is_reference(p)}
    persistent = tuple(p for p in persistent_params(numels, z.param_persistence_threshold,
                                                    z.model_persistence_threshold) if p not in reference)
    hooks = Zero3Hooks(ctx, persistent)
    # layers the builder skips: one dense stack on a data-parallel group, nothing per layer
    # that the hooks' state does not hold (MoE's exchanges, CPU checkpoints, leaves); tensor
    # parallelism's collectives hold none (TensorCollectives: per module only), nor do the
    # offloaded copies (offload.params_to_device per gather, grads_to_host per bucket after its
    # reduction; the bucket's last copy is in the state)
    if (ctx.skip_layers and ctx.dp_size > 1
            and all(isinstance(x, TensorCollectives) for x in ctx.exchanges)
            and not ctx.cpu_checkpointing and not hooks.fetch.leaves and not hooks.fetch.hpz
            and not hooks.fetch.qwz and qgz_nodes(ctx) <= 1):
        skip = LayerSkip(ctx, hooks)
        ctx.layer_skip = skip if skip.active else None
    shard = shard_numel(numels, ctx.dp_size)
    # every param is partitioned; gradients and optimizer states cover the trainable ones
    # (see [Note: frozen parameters under ZeRO])
    trained = trainable_numels(ctx.wl)
    train_shard = shard_numel(trained, ctx.dp_size)
    states = offload.place_states(ctx, model_state_bytes(sum(numels), shard, 3, ctx.param_bytes,
                                                         trainable=(sum(trained), train_shard),
                                                         state_bytes=optimizer_state_bytes(ctx.sc.deepspeed)),
                                  train_shard)
    states[Category.PARAMETERS] += ctx.wl.quant_state_bytes   # not parameters: whole on every rank
    # see [Note: quantized frozen weights]: a frozen shard stored int8 with its scales
    for p in stored_int8(ctx):
        own = -(-numels[p] // ctx.dp_size)
        states[Category.PARAMETERS] += own * (1 - ctx.param_bytes) + FP32_BYTES * stored_groups(numels[p], ctx.dp_size,
                                                                                                False, ctx)
    for cat, size in states.items():
        ctx.b.static_alloc(cat, size)
    # persistent params hold a gathered copy, except one rank's views of its partitions
    # (see [Note: one-rank ZeRO-3 fetch])
    if ctx.dp_size > 1 or ctx.params_offloaded:
        ctx.b.static_alloc(Category.PERSISTENT, sum(numels[p] for p in persistent) * ctx.param_bytes)
    if hooks.ref_fetch is not None and hooks.ref_fetch.secondary_kept:
        # see [Note: hpZ secondary partitions]: the reference engine's, held from its first step on
        ctx.b.static_alloc(Category.SECONDARY, sum(secondary_bytes(numels[p], ctx, p in hooks.ref_fetch.stored_int8)
                                                   for p in hooks.ref_fetch.secondary))
    if z.contiguous_gradients:
        # stage3.py:780-784: one IPG buffer of the full reduce_bucket_size elements, in
        # communication_data_type (the key of ipg_buckets), not the model dtype
        ctx.b.static_alloc(Category.BUCKETS, z.reduce_bucket_size * ctx.reduce_bytes)
    last = None
    for micro in range(ctx.gas):
        last = forward(ctx, hooks, micro, last)
        last = backward(ctx, hooks, micro, last)
    # stage3.py _overflow_check_and_loss_scale_update: the overflow all-reduce runs for fp16 only
    step_deps = [last, hooks.buckets.last_reduce]
    tp_grads = sequence_parallel_grads(ctx, step_deps)
    last = grad_norm_ops(ctx, train_shard, len(trained), step_deps if tp_grads is None else [tp_grads],
                         overflow_check=ctx.sc.precision == "fp16", device_passes=not ctx.optimizer_offloaded,
                         norm_size_bytes=FP32_BYTES if ctx.optimizer_offloaded else NORM_DTYPE_BYTES)
    if ctx.optimizer_offloaded:
        last = offload.offloaded_step(ctx, train_shard, [last, hooks.buckets.last_d2h],
                                      sub_group_sizes(trained, ctx.dp_size, z.sub_group_size))
    else:
        # [Note: ZeRO-3 optimizer sub-groups] stage3.py step() updates one sub-group at a time:
        # _prepare_fp32_grad_for_sub_group flattens and converts that group's gradients, the
        # optimizer steps it, and _release_sub_group drops its fp32 gradient before the next, so
        # the temporaries peak at the largest sub-group, not the whole shard
        for g, numel in enumerate(sub_group_sizes(trained, ctx.dp_size, z.sub_group_size)):
            last = optimizer_step(ctx, numel, [last], sub_group=g)
    hooks.fetch.drop_secondaries(last)
    # [Note: coalesced post-step gathers] _post_step: persistent params re-gathered one call each,
    # in registration order, all launched async before any is waited
    # (partition_parameters.py _allgather_params_coalesced)
    gathered = persistent if ctx.dp_size > 1 else ()   # one rank gathers nothing (see [Note: one-rank ZeRO-3 fetch])
    # see [Note: layers the builder skips]: the middle layers' gathers repeat one layer on
    skipped = ctx.layer_skip.post_step(gathered) if ctx.layer_skip is not None and gathered else None
    i = 0
    while i < len(gathered):
        if skipped is not None and i == skipped[0] and ctx.layer_skip is not None:
            ctx.layer_skip.note_post_step(ctx.last_micro, ctx.b.next_id)
            i = skipped[1]
        p = gathered[i]
        i += 1
        n = padded(numels[p], ctx.dp_size)
        name = ctx.wl.params[p].name
        if p in hooks.fetch.stored_int8:
            # _all_gather's quantized path for a shard stored int8: its data, then its scales
            # (see [Note: quantized frozen weights])
            g = stored_groups(numels[p], ctx.dp_size, False, ctx) * ctx.dp_size
            last = ctx.b.add(OpKind.PERSISTENT_GATHER, Stream.COMPUTE, Phase.STEP, ctx.last_micro,
                             ParamGather(Comm(Collective.ALL_GATHER, n, float(n), dtype="int8"), (p,), name), [last])
            last = ctx.b.add(OpKind.PERSISTENT_GATHER, Stream.COMPUTE, Phase.STEP, ctx.last_micro,
                             ParamGather(Comm(Collective.ALL_GATHER, g, FP32_BYTES * g, dtype="fp32"), (p,), name),
                             [last])
            continue
        last = ctx.b.add(OpKind.PERSISTENT_GATHER, Stream.COMPUTE, Phase.STEP, ctx.last_micro,
                         ParamGather(Comm(Collective.ALL_GATHER, n, n * ctx.param_bytes,
                                          coalesced=len(persistent) > 1), (p,), name),
                         [last])
