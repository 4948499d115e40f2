"""ZeRO-3 parameter fetch and release as DeepSpeed 0.19.8's coordinator runs it
(runtime/zero/partitioned_param_coordinator.py), in steady state (trace complete):

- A module visit (pre-forward / pre-backward hook, containers included) first all-gathers
  its own NOT_AVAILABLE parameters in one coalesced call, then prefetches along the recorded
  parameter trace: pop params while numel_prefetching < min(max_live_parameters -
  n_available, prefetch_bucket_size), gathering those NOT_AVAILABLE in one more call and
  marking every popped use (most_recent_step_id_param_fetched_for).
- [Note: parameter release] After a visit, its non-persistent params are released unless a
  later use was already passed by the prefetcher (most_recent_step_id_param_fetched_for beyond
  the step the release runs at, the visit's index + 1) or a use occurs within
  max_reuse_distance numel of the trace (__params_to_release); so a small max_reuse_distance
  or prefetch re-gathers a tied or recomputed weight.
- [Note: release sets frozen at the first complete trace] __params_to_release is an
  functools.lru_cache on (module, step id) (partitioned_param_coordinator.py:633), never
  cleared: what it decides in the first micro-step with a complete trace holds for the rest of
  training. That is training's second micro-step (the first, reset_step's RECORD pass,
  releases every param after its module, persistent ones included, having no trace). With
  gradient accumulation it follows the record pass inside the same optimizer step, so the
  persistent params are not gathered yet: they are fetched and prefetched like the others and
  count against max_live_parameters and the prefetch bucket, the prefetcher stops earlier in
  the trace, marks fewer later uses, and more params are released than the steady state's own
  state would say. Without accumulation an optimizer step comes between (stage3.py _post_step
  gathers the persistent params again), and the sets are the steady state's. Traced on
  DeepSpeed 0.19.8 (small GPT, ZeRO-3, GAS 2, max_reuse_distance 0, 4 ranks): lm_head's weight
  is released after its forward and gathered again for its backward in every micro-step,
  though from the second complete micro-step on the prefetcher has passed its backward use;
  at GAS 1 it is kept (tests/fixtures/deepspeed/stage3_max_live_3e6_reuse_0.json).
- At the end of each backward everything non-persistent is released (release_and_reset_all),
  so every micro-step gathers again.
- Params with numel <= param_persistence_threshold stay gathered (partition.persistent_params).
- [Note: all-gather flat buffer] A coalesced gather of more than one param
  (partition_parameters.py _all_gather_dtype) allocates one flat output buffer of
  sum(ceil(numel / world)) * world elements; the handle's wait (AllGatherCoalescedHandle.wait)
  gives every param its own copy (torch.cat of its pieces), and the flat buffer lives as long
  as the handle: the inflight registry holds it once per param and pops a param when a visit
  waits for it (_fetch_sub_module_impl), or at release_and_reset_all. So the buffer is freed
  in the hook of the visit that waits for the bucket's last param, before that module runs;
  a prefetch of many modules' params holds it until the last of them is used. A single param
  (_all_gather_sequential) is gathered into its own buffer, no copy.
- [Note: one-rank ZeRO-3 fetch] With a partition group of one rank there is nothing to gather:
  all_gather_coalesced and _allgather_params_coalesced take _no_gather_coalesced
  (partition_parameters.py:904-913, 1559-1560, 2029-2032), which sets
  `param.data = param.ds_tensor.data.to(device).view(shape)`: a view of the partition, no
  collective, no flat buffer, no new memory. An offloaded partition's `.to(device)` is the
  param's own GPU copy (the H2D copy, then freed at release). Measured: DeepSpeed on one rank
  issues no all_gather (CPU/gloo, medium GPT; validate --nproc-per-node 1).
Timing assumption: the host reaches a visit's hook when the previous compute op has finished
(lock-step), so a prefetch overlaps the compute of the module before its consumer.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from zsim.schedule import offload
from zsim.schedule.context import StepContext
from zsim.schedule.ir import Alloc, Buffer, Category, Collective, Group, OpKind, Phase, ProcessGroup, Stream, Tag
from zsim.schedule.payloads import Comm, ComputeWork, ParamGather, StepCompute
from zsim.schedule.moe import z3_leaf_blocks
from zsim.schedule.partition import coalesced_gather_views, padded
from zsim.schedule.zeropp import (FP16_BYTES, FP32_BYTES, checked_quant_groups, hpz_size, secondary_bytes,
                                   stored_groups, stored_int8)
from zsim.workload.module import Module
from zsim.workload.preference import REFERENCE, reference_engine

NOT_AVAILABLE, AVAILABLE = 0, 1
# how a fetch goes: 16-bit, quantized at the fetch (qwZ), or as the int8 shards are stored
NOT_QUANTIZED, QUANTIZED, STORED = 0, 1, 2


@dataclass(frozen=True)
class Visit:
    module: str              # workload module name, or a container name
    params: tuple[int, ...]  # distinct param ids fetched by this visit
    phase: Phase


def leaf_of(module: Module, leaves) -> str | None:
    """The ZeRO-3 leaf container `module` sits in, if any."""
    if not leaves:      # dense models: asked for every module of every pass
        return None
    return next((c for c in module.containers if c in leaves), None)


def _visits_of(mods, phase: Phase, leaves: dict[str, tuple[int, ...]]) -> list[Visit]:
    """Forward-order visits; a leaf container's modules are one visit of the container, with all
    their params, and no hooks inside it (see [Note: ZeRO-3 leaf modules])."""
    seq, prev = [], None
    for m in mods:
        leaf = leaf_of(m, leaves)
        if leaf is not None and prev is not None and leaf_of(prev, leaves) == leaf:
            prev = m
            continue
        outer = m.containers[:m.containers.index(leaf)] if leaf is not None else m.containers
        entered = prev.containers if prev is not None else ()
        seq += [Visit(c, (), phase) for c in outer if c not in entered]
        seq.append(Visit(leaf, leaves[leaf], phase) if leaf is not None
                   else Visit(m.name, tuple(dict.fromkeys(m.params)), phase))
        prev = m
    return seq


def visit_sequence(ctx: StepContext, engine: frozenset[str] | None = None) -> list[Visit]:
    """The recorded module trace of one micro-step: forward, then backward (with recompute);
    `engine`: the modules of a second engine (a preference run's reference copy), whose own
    coordinator traces only them, or none: every module but a second engine's."""
    return module_visits(ctx.wl, ctx.checkpointing, z3_leaf_blocks(ctx), engine)


def module_visits(wl, checkpointing: str, leaves: dict[str, tuple[int, ...]],
                  engine: frozenset[str] | None = None) -> list[Visit]:
    """`visit_sequence` of the workload `wl` under `checkpointing` with ZeRO-3 leaf containers
    `leaves` (moe.zero3_leaves)."""
    # only nn.Modules with parameters get ZeRO hooks in zsim's model; functional pieces
    # (attention core, activation, loss) are not visits
    if engine is not None:     # a reference engine: its forward under no_grad, nothing more
        mods = [m for m in wl.modules if m.params and m.name in engine]
        return [Visit(REFERENCE, (), Phase.FORWARD)] + _visits_of(mods, Phase.FORWARD, leaves)
    second = reference_engine(wl)
    mods = [m for m in wl.modules if m.params and m.name not in second]
    seq = ([Visit("<root>", (), Phase.FORWARD)] + _visits_of(mods, Phase.FORWARD, leaves)
           + [Visit("<root>", (), Phase.BACKWARD)])
    recomputed: set[int] = set()
    full = checkpointing == "full"
    prev_leaf = None
    reached = {leaf_of(m, leaves) for m in mods if m.input_grad or m.weight_grad}
    for m in reversed(mods):
        if full and m.layer >= 0 and m.layer not in recomputed:
            recomputed.add(m.layer)
            seq += _visits_of([rm for rm in wl.layer_modules(m.layer) if rm.params], Phase.RECOMPUTE, leaves)
            prev_leaf = None
        # a module autograd never reaches (frozen, no gradient flowing into its input:
        # zsim/workload/lora.py) gets no pre-backward hook, so no fetch; a leaf container's hook
        # fires when any module under it gets a gradient
        leaf = leaf_of(m, leaves)
        if leaf is None:
            if m.input_grad or m.weight_grad:
                seq.append(Visit(m.name, tuple(dict.fromkeys(m.params)), Phase.BACKWARD))
        elif leaf != prev_leaf and leaf in reached:
            seq.append(Visit(leaf, leaves[leaf], Phase.BACKWARD))
        prev_leaf = leaf
    return seq


class ParamCoordinator:
    """The coordinator's state over one micro-step; `visit` and `release` add the gathers and
    the frees to the schedule."""

    def __init__(self, ctx: StepContext, persistent: tuple[int, ...], engine: frozenset[str] | None = None,
                 traced: bool = True):
        self.ctx = ctx
        # whether the coordinator's trace is ever complete (see [Note: a PEFT reference under
        # ZeRO-3]): without it nothing is prefetched and a module's params go right after it
        self.traced = traced
        self.numels = ctx.wl.stored_numels(ctx.param_bytes)
        self.persistent = set(persistent)
        self.leaves = z3_leaf_blocks(ctx)
        self.visits = visit_sequence(ctx, engine)
        self.trace = [(pid, k) for k, v in enumerate(self.visits) for pid in sorted(v.params)]
        # prefix sums of visited numel and each param's visit positions, for the reuse-distance scan
        self.visit_prefix = [0]
        self.uses: dict[int, list[int]] = {}
        for k, v in enumerate(self.visits):
            self.visit_prefix.append(self.visit_prefix[-1] + sum(self.numels[p] for p in v.params))
            for p in v.params:
                self.uses.setdefault(p, []).append(k)
        self.last_compute: int | None = None
        # see [Note: hpZ secondary partitions]: the hpZ group's size (0: off), the params that hold
        # a secondary partition (kept across micro-steps: the optimizer step drops them; a
        # reference engine never steps, so its params keep theirs: `secondary_kept`), and the
        # last gather launched on the allgather stream with whether it went over the hpZ group
        self.hpz = hpz_size(ctx)
        self.secondary_kept = engine is not None and self.hpz > 0
        self.secondary: set[int] = ({p for v in self.visits for p in v.params if p not in self.persistent}
                                    if self.secondary_kept else set())
        self.last_gather: tuple[int, bool] | None = None
        # see [Note: qwZ quantized gathers]: whether the fetches go quantized, and per quantized
        # flat buffer its scale gather (the wait's dependency) and, once waited, its dequantize op
        self.qwz = ctx.sc.zero.stage == 3 and ctx.sc.zero.zero_quantized_weights and ctx.dp_size > 1
        self.stored_int8 = stored_int8(ctx) if ctx.dp_size > 1 else frozenset()
        self.scales_of: dict[int, tuple[int, int]] = {}    # flat -> (scale gather op, numel gathered)
        self.dequant_of: dict[int, int] = {}
        # a fetched param holds memory of its own unless it is a view of its one-rank partition
        # (see [Note: one-rank ZeRO-3 fetch])
        self.allocates = ctx.dp_size > 1 or ctx.params_offloaded
        self.dry = False
        # per visit index, the params its release frees in every micro-step, decided at its first
        # release (see [Note: release sets frozen at the first complete trace]); without
        # accumulation or persistent params that first micro-step starts as every micro-step does
        self.release_sets: dict[int, tuple[int, ...]] = {}
        if ctx.gas > 1 and self.persistent:
            self._first_complete_releases()
        self.reset()

    def _first_complete_releases(self):
        """Decide every release set in the first micro-step with a complete trace under gradient
        accumulation, where no param is gathered at the start, the persistent ones neither (see
        [Note: release sets frozen at the first complete trace]). A dry run of the coordinator:
        nothing is added to the schedule."""
        self.reset()
        # the record pass released every param after its module, but its pre-backward hooks
        # fetched the params of the modules that compute a weight gradient, and the post-backward
        # hook of one whose inputs carry no gradient never fires (PostBackwardFunctionModule wraps
        # only inputs that require grad, parameter_offload.py:507): release_backward_leftovers
        # releases what it holds except the persistent params (coordinator:565), which stay
        no_post_hook = {p for m in self.ctx.wl.modules if m.weight_grad and not m.input_grad for p in m.params}
        for p in self.persistent - no_post_hook:
            self.status[p] = NOT_AVAILABLE
        self.dry = True
        for k, v in enumerate(self.visits):
            self.visit(v, 0, v.phase)
            if v.params:
                self.release(k, 0, None)
        self.dry = False

    def _to_release(self, visit_index: int) -> tuple[int, ...]:
        """__params_to_release at the release of visit `visit_index` (step id visit_index + 1):
        see [Note: parameter release]."""
        z = self.ctx.sc.zero
        params = self.visits[visit_index].params
        step_id = visit_index + 1
        if not self.traced:    # persistent ones too: the post-step gather brings them back
            return tuple(params)
        candidates = [p for p in params if p not in self.persistent and self.most_recent[p] <= step_id]
        if z.max_reuse_distance > 0 and candidates:
            kept = self.reused_within(visit_index)
            candidates = [p for p in candidates if p not in kept]
        return tuple(candidates)

    def reused_within(self, visit_index: int) -> set[int]:
        """The params of visit `visit_index` reused within max_reuse_distance: walking the trace
        from the next visit, a param reused at visit j is kept if the numel traversed before j
        is still under the distance (see [Note: parameter release])."""
        z = self.ctx.sc.zero
        start = self.visit_prefix[visit_index + 1]
        kept = set()
        for p in self.visits[visit_index].params:
            uses = self.uses[p]
            j = bisect.bisect_right(uses, visit_index)
            if j < len(uses) and self.visit_prefix[uses[j]] - start < z.max_reuse_distance:
                kept.add(p)
        return kept

    def reset(self):
        """reset_step: every non-persistent param back in its partition, the trace rewound."""
        self.status = {pid: (AVAILABLE if pid in self.persistent else NOT_AVAILABLE) for pid in range(len(self.numels))}
        # the params gathered and not yet released (never the persistent ones), and the pid whose
        # GATHERED tag a param's free names where a skipped layer gathered it (layer_skip.py)
        self.gathered: set[int] = set()
        self.tag_pid: dict[int, int] = {}
        self.gather_op: dict[int, int] = {}
        # see [Note: all-gather flat buffer]: the gather (op id) each in-flight param is waited from,
        # the params of each flat buffer not yet waited, and the buffers the next module frees
        self.inflight: dict[int, int] = {}
        self.unwaited: dict[int, set[int]] = {}
        self.waited: list[Tag] = []
        # see [Note: per-rank host loops]: the wait views of each coalesced handle not yet waited,
        # and the views the next module's hook makes
        self.wait_views: dict[int, int] = {}
        self.pending_views = 0
        # the visits whose hooks ran since the last module's compute (containers, the module's
        # own): they run on the host before it computes; their cost is the profile's (engine)
        self.pending_visits = 0
        self.queue = deque(self.trace)
        self.most_recent = {pid: -10**10 for pid in range(len(self.numels))}
        self.n_available = 0
        self.step_id = 0

    def _gather(self, pids, micro: int, phase: Phase, visit: str, prefetch: bool) -> int | None:
        """__all_gather_params: the fetch's params that hold an hpZ secondary partition in one
        coalesced gather over the hpZ group, then the others over the data-parallel group
        (partitioned_param_coordinator.py:594-611; see [Note: hpZ secondary partitions])."""
        pids = [p for p in pids if self.status[p] == NOT_AVAILABLE]
        if not pids:
            return None
        if self.dry:
            return self._gather_group(pids, micro, phase, visit, prefetch, False, NOT_QUANTIZED)
        # frozen shards stored int8 go first, quantized whatever zero_quantized_weights says
        # (see [Note: quantized frozen weights]); then the others, quantized under qwZ
        op = None
        for quant, part in ((STORED, [p for p in pids if p in self.stored_int8]),
                            (QUANTIZED if self.qwz else NOT_QUANTIZED, [p for p in pids if p not in self.stored_int8])):
            if not part:
                continue
            with_secondary = [p for p in part if p in self.secondary] if self.hpz else []
            for group in (with_secondary, [p for p in part if p not in with_secondary]):
                if group:
                    op = self._gather_group(group, micro, phase, visit, prefetch, bool(group is with_secondary), quant)
        return op

    def _gather_group(self, pids, micro: int, phase: Phase, visit: str, prefetch: bool, secondary: bool,
                      quant: int) -> int | None:
        self.gathered.update(pids)
        if self.dry:
            for p in pids:
                self.status[p] = AVAILABLE
                self.n_available += self.numels[p]
            return None
        ctx = self.ctx
        numel = sum(padded(self.numels[p], ctx.dp_size) for p in pids)
        what = f"prefetch from {visit}" if prefetch else visit
        deps = [self.last_compute]
        if ctx.dp_size == 1:   # see [Note: one-rank ZeRO-3 fetch]
            op = None
            if ctx.params_offloaded:
                op = offload.params_to_device(ctx, numel, micro, phase, deps, what, allocs=tuple(
                    Alloc(Tag(Buffer.GATHERED, micro, p), Category.GATHERED, self.numels[p] * ctx.param_bytes)
                    for p in pids if p not in self.persistent))
            for p in pids:
                self.status[p] = AVAILABLE
                if op is not None:
                    self.gather_op[p] = op
                self.n_available += self.numels[p]
            return op
        if ctx.params_offloaded:
            deps = [offload.params_to_device(ctx, numel / ctx.dp_size, micro, phase, deps, what)]
        # a persistent param fetched again (an untraced coordinator released it) comes back into
        # the persistent region it holds for the whole run
        allocs = tuple(Alloc(Tag(Buffer.GATHERED, micro, p), Category.GATHERED, self.numels[p] * ctx.param_bytes)
                       for p in pids if p not in self.persistent)
        ranks = self.hpz if secondary else ctx.dp_size
        # the scales a rank sends: one quantization of its whole slice (qwZ), or the ones each frozen
        # shard is stored with (see [Note: quantized frozen weights])
        if quant == QUANTIZED:
            groups = checked_quant_groups(numel // ranks, "zero_quantized_weights", "a rank's fetch")
        elif quant == STORED:
            groups = sum(stored_groups(self.numels[p], ranks, secondary, ctx) for p in pids)
        else:
            groups = 0
        if len(pids) > 1 or quant:
            flat = ctx.b.next_id
            # see [Note: qwZ quantized gathers]: the int8 flat and the scales in place of the 16-bit flat
            flat_bytes = numel + FP32_BYTES * groups * ranks if quant else numel * ctx.param_bytes
            allocs += (Alloc(Tag(Buffer.GATHER_FLAT, micro, flat), Category.GATHERED, flat_bytes),)
            self.unwaited[flat] = set(pids)
            self.inflight.update((p, flat) for p in pids)
            if len(pids) > 1:
                launch, self.wait_views[flat] = coalesced_gather_views(ctx.dp_size, len(pids))
                self.pending_views += launch
        # an hpZ gather runs on its group's NCCL stream, launched in order with the allgather
        # stream's other gathers (a gather after one on the other stream waits for it)
        stream, group = (Stream.HPZ, ProcessGroup(Group.HPZ, self.hpz)) if secondary else (Stream.ALLGATHER, None)
        if self.last_gather is not None and self.last_gather[1] != secondary:
            deps.append(self.last_gather[0])
        if quant:
            # the cast to fp16 and the quantize pass over the rank's S elements (a stored shard: the
            # concatenation of its int8 slices), then the int8 data
            s = numel // ranks
            passes = 7.0 * s + FP32_BYTES * groups if quant == QUANTIZED else 2.0 * s
            comm = Comm(Collective.ALL_GATHER, numel, float(numel), buffer_bytes=passes, group=group, dtype="int8")
        else:
            comm = Comm(Collective.ALL_GATHER, numel, numel * ctx.param_bytes, group=group)
        op = ctx.b.add(OpKind.PARAM_GATHER, stream, phase, micro, ParamGather(comm, tuple(pids), visit, prefetch),
                       deps, allocs)
        if quant:
            op = ctx.b.add(OpKind.PARAM_GATHER, stream, phase, micro,
                           ParamGather(Comm(Collective.ALL_GATHER, groups * ranks, FP32_BYTES * groups * ranks,
                                            group=group, dtype="fp32"), tuple(pids), visit, prefetch), [op])
            self.scales_of[flat] = (op, numel)
        if self.hpz:
            self.last_gather = (op, secondary)
        for p in pids:
            self.status[p] = AVAILABLE
            self.gather_op[p] = op
            self.n_available += self.numels[p]
        return op

    def visit_containers(self, module: str, micro: int, phase: Phase):
        """The visits of `phase` before `module`'s own that fetch nothing (the containers it sits in,
        a second engine's root): their hooks run, in trace order."""
        while self.step_id < len(self.visits) and self.visits[self.step_id].module != module:
            v = self.visits[self.step_id]
            if v.params or v.phase != phase:
                break
            self.visit(v, micro, phase)

    def visit(self, visit: Visit, micro: int, phase: Phase) -> list[int]:
        """fetch_sub_module: gather this visit's params, then prefetch along the trace; returns
        the gathers the module's compute waits for."""
        z = self.ctx.sc.zero
        k = self.step_id
        if not self.dry:
            self.pending_visits += 1
        own = list(visit.params)
        self._gather(sorted(own), micro, phase, visit.module, prefetch=False)
        if self.scales_of and not self.dry:
            # the wait dequantizes each quantized fetch the module's params came in (once)
            flats = sorted({self.inflight[p] for p in own if p in self.inflight and self.inflight[p] in self.scales_of})
            waits = {f: self._dequantize(f, micro, phase) for f in flats}
            deps = [waits[self.inflight[p]] if self.inflight.get(p) in waits else self.gather_op[p]
                    for p in own if p in self.gather_op]
        else:
            deps = [self.gather_op[p] for p in own if p in self.gather_op]
        for p in own:
            self._wait(p, micro)
        not_fetched = [p for p in own if self.most_recent[p] < k]
        popped = 0
        while self.queue and popped < len(set(not_fetched)):
            pid, used_at = self.queue.popleft()
            self.most_recent[pid] = used_at
            popped += 1
        if z.prefetch_bucket_size > 0 and self.traced:
            limit = min(z.max_live_parameters - self.n_available, z.prefetch_bucket_size)
            chosen, numel = [], 0
            while self.queue and numel < limit:
                pid, used_at = self.queue.popleft()
                if self.status[pid] == NOT_AVAILABLE and pid not in chosen:
                    chosen.append(pid)
                    numel += self.numels[pid]
                self.most_recent[pid] = max(self.most_recent[pid], used_at)
            if chosen:
                self._gather(sorted(chosen), micro, phase, visit.module, prefetch=True)
        self.step_id += 1
        return deps

    def _dequantize(self, flat: int, micro: int, phase: Phase) -> int:
        """The first wait on a quantized fetch: its int8 flat dequantized into an fp16 flat (held
        while it runs), each param cast to its dtype (see [Note: qwZ quantized gathers])."""
        op = self.dequant_of.get(flat)
        if op is not None:
            return op
        ctx = self.ctx
        scales, n = self.scales_of[flat]
        cast = 0.0 if ctx.sc.precision == "fp16" else float(FP16_BYTES + ctx.param_bytes) * n
        work = ComputeWork(mem_bytes=3.0 * n + cast, kernels=2 if cast else 1)
        tag = Tag(Buffer.WORKSPACE, micro, flat, "dequant")
        op = ctx.b.add(OpKind.DEQUANTIZE, Stream.COMPUTE, phase, micro, StepCompute(work),
                       [scales, self.last_compute],
                       (Alloc(tag, Category.GATHERED, FP16_BYTES * n),))
        ctx.b.add_free(op, tag)
        self.dequant_of[flat] = op
        return op

    def _wait(self, p: int, micro: int):
        """The registry pops `p`; its flat buffer goes when no param of it is left in flight."""
        flat = self.inflight.pop(p, None)
        if flat is not None:
            # the first wait on a handle splits out every param of it
            self.pending_views += self.wait_views.pop(flat, 0)
            self.unwaited[flat].discard(p)
            if not self.unwaited[flat]:
                del self.unwaited[flat]
                self.waited.append(Tag(Buffer.GATHER_FLAT, micro, flat))

    def module_ran(self, op: int):
        """The module's compute op: the hooks of the visits since the last module run before it
        (their count is data), and the flat buffers its hook's wait dropped go before it runs."""
        self.last_compute = op
        if self.pending_visits:
            self.ctx.b.add_hook_visits(op, self.pending_visits)
            self.pending_visits = 0
        if self.pending_views:
            self.ctx.b.add_host_views(op, self.pending_views)
            self.pending_views = 0
        if self.waited:
            self.ctx.b.add_free_before(op, *self.waited)
            self.waited = []

    def release(self, visit_index: int, micro: int, op: int | None):
        """release_sub_module after the visit's module ran (op): the params frozen for it (see
        [Note: release sets frozen at the first complete trace]) that are gathered."""
        frozen = self.release_sets.get(visit_index)
        if frozen is None:
            frozen = self.release_sets[visit_index] = self._to_release(visit_index)
        for p in frozen:
            if self.status[p] == AVAILABLE:
                self._drop(p)
                tag_pid = self.tag_pid.pop(p, p)
                if self.allocates and not self.dry and p not in self.persistent:
                    assert op is not None     # a real (not dry) release follows its module's op
                    self.ctx.b.add_free(op, Tag(Buffer.GATHERED, micro, tag_pid))
                    self._keep_secondary(p, op)

    def release_all(self, micro: int, op: int):
        """release_and_reset_all at the end of backward."""
        for p, st in self.status.items():
            if st == AVAILABLE and p not in self.persistent and self.allocates:
                self.ctx.b.add_free(op, Tag(Buffer.GATHERED, micro, self.tag_pid.get(p, p)))
                self._keep_secondary(p, op)
        # the registry's leftovers are waited here; their flat buffers go with them
        self.ctx.b.add_free(op, *(Tag(Buffer.GATHER_FLAT, micro, flat) for flat in self.unwaited), *self.waited)
        views = self.pending_views + sum(self.wait_views.values())
        if views:
            self.ctx.b.add_host_views(op, views)
        self.reset()

    def _keep_secondary(self, p: int, op: int):
        """_partition_param_sec at a gathered param's release: its secondary partition (see
        [Note: hpZ secondary partitions]), allocated once until the optimizer step drops it."""
        if self.hpz and p not in self.secondary:
            self.secondary.add(p)
            self.ctx.b.add_alloc(op, Alloc(Tag(Buffer.SECONDARY, -1, p), Category.SECONDARY,
                                           secondary_bytes(self.numels[p], self.ctx, p in self.stored_int8)))

    def drop_secondaries(self, op: int):
        """The optimizer step's _post_step invalidates every secondary partition (stage3.py:755-759,
        2846): the next step's first gathers go over the data-parallel group again."""
        if self.secondary and not self.secondary_kept:
            self.ctx.b.add_free(op, *(Tag(Buffer.SECONDARY, -1, p) for p in sorted(self.secondary)))
            self.secondary = set()

    def _drop(self, p: int):
        self.gathered.discard(p)
        self.status[p] = NOT_AVAILABLE
        self.gather_op.pop(p, None)
        self.n_available -= self.numels[p]
