"""ZeRO stage 3 as DeepSpeed 0.19.8 runs it, in steady state (trace complete).

Follows runtime/zero/partitioned_param_coordinator.py:
- A module visit (pre-forward / pre-backward hook, containers included) first all-gathers
  its own NOT_AVAILABLE parameters in one coalesced call, then prefetches along the recorded
  parameter trace: pop params while numel_prefetching < min(max_live_parameters -
  n_available, prefetch_bucket_size), gathering those NOT_AVAILABLE in one more call and
  marking every popped use (most_recent_step_id_param_fetched_for).
- After a visit, its non-persistent params are released unless a later use was already
  passed by the prefetcher or a use occurs within max_reuse_distance numel of the trace.
- At the end of each backward everything non-persistent is released (release_and_reset_all),
  so every micro-step gathers again.
- Params with numel <= param_persistence_threshold stay gathered; after each optimizer step
  they are all-gathered one call per parameter.
- Gradients fill an IPG bucket of reduce_bucket_size elements in grad-ready order; a full
  bucket is reduce-scattered in one coalesced call (all-reduce if reduce_scatter: false),
  on the reduction stream when overlap_comm.
Timing assumption: the host reaches a visit's hook when the previous compute op has finished
(lock-step), so a prefetch overlaps the compute of the module before its consumer.
Checked against recorded DeepSpeed runs in tests/fixtures/deepspeed/.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from zsim.schedule.common import (StageHooks, StepContext, backward, forward, grad_norm_ops, grads_ready_at,
                                  model_state_bytes, optimizer_step)
from zsim.schedule import offload
from zsim.schedule.ops import Alloc
from zsim.workload.transformer import Module

NOT_AVAILABLE, AVAILABLE = 0, 1


@dataclass(frozen=True)
class Visit:
    module: str              # workload module name, or a container name
    params: tuple[int, ...]  # distinct param ids fetched by this visit
    phase: str


def padded(numel: int, world: int) -> int:
    """Gathered size of one partitioned param: ceil(numel / world) * world."""
    return int(math.ceil(numel / world)) * world


def _containers_before(module: Module, prev: Module | None) -> list[str]:
    """Containers whose hooks fire before this leaf (block, attn, mlp), GPT/Llama layout."""
    out = []
    if module.layer >= 0 and (prev is None or prev.layer != module.layer):
        out.append(f"layers.{module.layer}")
    name = module.name
    if ".attn." in name and (prev is None or ".attn." not in prev.name):
        out.append(name.rsplit(".", 1)[0])
    if ".mlp." in name and (prev is None or ".mlp." not in prev.name):
        out.append(name.rsplit(".", 1)[0])
    return out


def visit_sequence(ctx: StepContext) -> list[Visit]:
    """The recorded module trace of one micro-step: forward, then backward (with recompute)."""
    # only nn.Modules with parameters get ZeRO hooks in zsim's model; functional pieces
    # (attention core, activation, loss) are not visits
    mods = [m for m in ctx.wl.modules if m.params]
    seq: list[Visit] = [Visit("<root>", (), "forward")]
    prev = None
    for m in mods:
        for c in _containers_before(m, prev):
            seq.append(Visit(c, (), "forward"))
        seq.append(Visit(m.name, tuple(dict.fromkeys(m.params)), "forward"))
        prev = m
    seq.append(Visit("<root>", (), "backward"))
    recomputed: set[int] = set()
    full = ctx.checkpointing == "full"
    for m in reversed(mods):
        if full and m.layer >= 0 and m.layer not in recomputed:
            recomputed.add(m.layer)
            p = None
            for rm in ctx.wl.layer_modules(m.layer):
                for c in _containers_before(rm, p):
                    seq.append(Visit(c, (), "recompute"))
                seq.append(Visit(rm.name, tuple(dict.fromkeys(rm.params)), "recompute"))
                p = rm
        seq.append(Visit(m.name, tuple(dict.fromkeys(m.params)), "backward"))
    return seq


class Zero3Hooks(StageHooks):
    def __init__(self, ctx: StepContext):
        self.ctx = ctx
        z = ctx.sc.zero
        self.numels = [p.numel for p in ctx.wl.params]
        self.persistent = set()
        total = 0
        for pid, n in enumerate(self.numels):
            # stage3.py _mark_persistent_parameters: per-param and whole-model thresholds
            if n <= z.param_persistence_threshold and total + n <= z.model_persistence_threshold:
                self.persistent.add(pid)
                total += n
        self.visits = visit_sequence(ctx)
        self.trace = [(pid, k) for k, v in enumerate(self.visits) for pid in sorted(v.params)]
        # prefix sums of visited numel and each param's visit positions, for the reuse-distance scan
        self.visit_prefix = [0]
        self.uses: dict[int, list[int]] = {}
        for k, v in enumerate(self.visits):
            self.visit_prefix.append(self.visit_prefix[-1] + sum(self.numels[p] for p in v.params))
            for p in v.params:
                self.uses.setdefault(p, []).append(k)
        self.ready = grads_ready_at(ctx.wl)
        self.bucket: list[int] = []
        self.bucket_numel = 0
        self.flushes = 0
        self.last_reduce = None
        self.last_d2h = None
        self.last_compute = None
        self.pending_visits = 0
        self._reset_step()

    # -- coordinator state, reset per micro-step (reset_step) ---------------------------
    def _reset_step(self):
        self.status = {pid: (AVAILABLE if pid in self.persistent else NOT_AVAILABLE) for pid in range(len(self.numels))}
        self.gather_op: dict[int, int] = {}
        self.queue = deque(self.trace)
        self.most_recent = {pid: -10**10 for pid in range(len(self.numels))}
        self.n_available = 0
        self.step_id = 0

    def _gather(self, pids, micro: int, phase: str, what: str) -> int | None:
        pids = [p for p in pids if self.status[p] == NOT_AVAILABLE]
        if not pids:
            return None
        ctx = self.ctx
        numel = sum(padded(self.numels[p], ctx.world) for p in pids)
        deps = [self.last_compute]
        if offload.param_device(ctx) != "none":
            deps = [offload.params_to_device(ctx, numel / ctx.world, micro, phase, deps, what)]
        op = ctx.b.add(f"all-gather {what}", "allgather", phase, micro, deps, collective="all_gather",
                       size_bytes=numel * ctx.param_bytes, numel=numel,
                       alloc=tuple(Alloc(f"gathered/{micro}/{p}", "gathered params",
                                         self.numels[p] * ctx.param_bytes) for p in pids))
        for p in pids:
            self.status[p] = AVAILABLE
            self.gather_op[p] = op
            self.n_available += self.numels[p]
        return op

    def _visit(self, visit: Visit, micro: int, phase: str) -> list[int]:
        self.pending_visits += 1
        z = self.ctx.sc.zero
        k = self.step_id
        own = list(visit.params)
        self._gather(sorted(own), micro, phase, visit.module)
        deps = [self.gather_op[p] for p in own if p in self.gather_op]
        not_fetched = [p for p in own if self.most_recent[p] < k]
        popped = 0
        while self.queue and popped < len(set(not_fetched)):
            pid, used_at = self.queue.popleft()
            self.most_recent[pid] = used_at
            popped += 1
        if z.prefetch_bucket_size > 0:
            limit = min(z.max_live_parameters - self.n_available, z.prefetch_bucket_size)
            chosen, numel = [], 0
            while self.queue and numel < limit:
                pid, used_at = self.queue.popleft()
                if self.status[pid] == NOT_AVAILABLE and pid not in chosen:
                    chosen.append(pid)
                    numel += self.numels[pid]
                self.most_recent[pid] = max(self.most_recent[pid], used_at)
            if chosen:
                self._gather(sorted(chosen), micro, phase, f"prefetch from {visit.module}")
        self.step_id += 1
        return deps

    def _release(self, visit_index: int, params, op: int):
        z = self.ctx.sc.zero
        candidates = [p for p in params if p not in self.persistent and self.most_recent[p] <= visit_index]
        if z.max_reuse_distance > 0 and candidates:
            # __params_to_release: walking the trace from the next visit, a param reused at
            # visit j is kept if the numel traversed before j is still under the distance
            start = self.visit_prefix[visit_index + 1]
            kept = set()
            for p in candidates:
                uses = self.uses[p]
                j = bisect.bisect_right(uses, visit_index)
                if j < len(uses) and self.visit_prefix[uses[j]] - start < z.max_reuse_distance:
                    kept.add(p)
            candidates = [p for p in candidates if p not in kept]
        for p in candidates:
            if self.status[p] == AVAILABLE:
                self.status[p] = NOT_AVAILABLE
                self.gather_op.pop(p, None)
                self.n_available -= self.numels[p]
                self.ctx.b.add_free(op, f"gathered/{self.micro}/{p}")

    # -- hooks called by the common passes ---------------------------------------------
    def pre_module(self, ctx, module: Module, micro, phase):
        self.micro = micro
        deps: list[int] = []
        # container visits and param-less leaves that precede this module in the trace
        while self.step_id < len(self.visits) and self.visits[self.step_id].module != module.name:
            v = self.visits[self.step_id]
            if v.params:
                break
            self._visit(v, micro, phase)
        if self.step_id < len(self.visits) and self.visits[self.step_id].module == module.name:
            self.current_visit = self.step_id
            deps = self._visit(self.visits[self.step_id], micro, phase)
        else:
            self.current_visit = None
        return deps

    def post_module(self, ctx, module: Module, micro, phase, op):
        self.last_compute = op
        # the hooks of the visits since the last module (containers, this module) run on the host
        # before the module computes; their cost is the profile's (engine), the count is data
        if self.pending_visits:
            ctx.b.add_hook_visits(op, self.pending_visits)
            self.pending_visits = 0
        if self.current_visit is not None:
            self._release(self.current_visit, self.visits[self.current_visit].params, op)
        if phase == "backward":
            # stage 3 hooks fire weight before bias (recorded, tests/fixtures/deepspeed)
            for pid in self.ready[module.name]:
                self._add_grad(pid, micro, op)

    def end_backward(self, ctx, micro, last_op):
        self._flush(micro, last_op)
        # release_and_reset_all: everything gathered goes back to its partition
        for p, st in self.status.items():
            if st == AVAILABLE and p not in self.persistent:
                ctx.b.add_free(last_op, f"gathered/{micro}/{p}")
        self._reset_step()

    # -- gradient reduction --------------------------------------------------------------
    def _add_grad(self, pid: int, micro: int, after: int):
        numel = self.numels[pid]
        if self.bucket_numel + numel > self.ctx.sc.zero.reduce_bucket_size:
            self._flush(micro, after)
        self.bucket.append(pid)
        self.bucket_numel += numel

    def _scatter_traffic_bytes(self, numel: int, micro: int, interleaved: bool) -> float:
        """Buffer passes around one bucket's reduce-scatter in DeepSpeed 0.19.8: stage3.py
        __avg_scatter_grads -> coalesced_collectives.py reduce_scatter_coalesced interleaves the
        bucket's per-rank chunks into a new buffer (torch.cat: read + write, skipped for a single
        tensor that divides evenly) and pre-divides it in place (div_: read + write); then
        partition_grads copies each rank's partition into its grad buffer (copy_ at the first
        micro-step, add_ after: read + write, or 2 reads + write)."""
        b = self.ctx.param_bytes
        interleave = 2.0 * numel * b if interleaved else 0.0
        predivide = 2.0 * numel * b
        partition = (2.0 if micro == 0 else 3.0) * numel / self.ctx.world * b
        return interleave + predivide + partition

    def _flush(self, micro: int, after: int):
        if not self.bucket:
            return
        ctx, z = self.ctx, self.ctx.sc.zero
        numel = sum(padded(self.numels[p], ctx.world) for p in self.bucket)
        kind = "reduce_scatter" if z.reduce_scatter else "all_reduce"
        mem_bytes, allocs = 0.0, ()
        if kind == "reduce_scatter":
            interleaved = not (len(self.bucket) == 1 and self.numels[self.bucket[0]] % ctx.world == 0)
            mem_bytes = self._scatter_traffic_bytes(numel, micro, interleaved)
            if interleaved:   # reduce_scatter_coalesced's interleaved copy lives for the call
                allocs = (Alloc(f"rs/{micro}/{self.flushes}", "gradient buckets", numel * ctx.param_bytes),)
        self.last_reduce = ctx.b.add(f"{kind.replace('_', '-')} bucket {self.flushes}", ctx.grad_stream,
                                     "backward", micro, [after], collective=kind,
                                     size_bytes=numel * ctx.param_bytes, numel=numel, mem_bytes=mem_bytes,
                                     alloc=allocs)
        ctx.b.add_free(self.last_reduce, *(a.tag for a in allocs))
        if offload.optimizer_device(ctx) != "none":
            self.last_d2h = offload.grads_to_host(ctx, numel / ctx.world, micro, self.last_reduce,
                                                  f"bucket {self.flushes}")
        self.flushes += 1
        self.bucket, self.bucket_numel = [], 0


def build(ctx: StepContext):
    z = ctx.sc.zero
    hooks = Zero3Hooks(ctx)
    n_params = ctx.wl.n_params
    shard = sum(math.ceil(n / ctx.world) for n in hooks.numels)
    states = offload.place_states(ctx, model_state_bytes(n_params, shard, 3, ctx.param_bytes), shard)
    for cat, size in states.items():
        ctx.b.static_alloc(cat, size)
    ctx.b.static_alloc("persistent params", sum(hooks.numels[p] for p in hooks.persistent) * ctx.param_bytes)
    if z.contiguous_gradients:
        # stage3.py:780-784: one IPG buffer of the full reduce_bucket_size elements
        ctx.b.static_alloc("gradient buckets", z.reduce_bucket_size * ctx.param_bytes)
    last = None
    for micro in range(ctx.gas):
        last = forward(ctx, hooks, micro, last)
        last = backward(ctx, hooks, micro, last)
    # stage3.py _overflow_check_and_loss_scale_update: the overflow all-reduce runs for fp16 only
    offloaded = offload.optimizer_device(ctx) != "none"
    last = grad_norm_ops(ctx, shard, len(hooks.numels), [last, hooks.last_reduce],
                         overflow_check=ctx.sc.precision == "fp16", device_passes=not offloaded)
    if offloaded:
        last = offload.offloaded_step(ctx, shard, [last, hooks.last_d2h], z.sub_group_size)
    else:
        last = optimizer_step(ctx, shard, [last])
    # _post_step: persistent params re-gathered one call each, in registration order, all launched
    # async before any is waited (partition_parameters.py _allgather_params_coalesced)
    for p in sorted(hooks.persistent):
        n = padded(hooks.numels[p], ctx.world)
        last = ctx.b.add(f"all-gather persistent {ctx.wl.params[p].name}", "compute", "step", ctx.gas - 1,
                         [last], collective="all_gather", size_bytes=n * ctx.param_bytes, numel=n,
                         coalesced=len(hooks.persistent) > 1)
