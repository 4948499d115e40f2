"""The sharded training core: ZeRO stages 0-3 in plain torch.distributed, executing zsim's
schedule for the scenario op by op (calibration/core/plan.py).

Model states, as DeepSpeed 0.19.8 keeps them:
- stages 0-2: one flat 16-bit buffer of all parameters (padded to 2*world), params are views;
  stage 0 gradients are views of one flat 16-bit gradient buffer (accumulated in place over
  micro-steps). Stage 1/2 gradients are autograd's own .grad tensors (stage 1 accumulates them
  over micro-steps); at a bucket's reduction they are copied into the IPG bucket buffer
  (contiguous_gradients; stage 2 from the hooks, stage 1 at the boundary) and dropped, and
  only this rank's partition is kept (16-bit, allocated by the step's first reduction, freed
  after the step). The IPG buffer lives from a backward's first gradient to the epilogue that
  drops it: its backward's end at stage 2, the accumulation boundary's at stage 1.
- stages 1-3: fp32 master weights and AdamW moments of the local partition only; after the
  step the updated 16-bit partitions are all-gathered (stage 1/2, one call) or the persistent
  params are re-gathered one call each (stage 3), all launched async before any is waited.
- stage 3: each rank keeps ceil(n/world) elements of every param; a gather points the params at
  their full data (p.data = ...; a coalesced gather's flat output is kept until the schedule frees
  it, see [Note: all-gather flat buffer]), a release drops it (p.data = empty), so autograd's
  saved weights see whatever is gathered when backward runs (ZeRO-3's trick).
  Gradients go into the IPG buffer in gradient order; at a bucket's reduce-scatter they are
  interleaved per rank into a new buffer and pre-divided by the world size, as DeepSpeed's
  reduce_scatter_coalesced does (with reduce_scatter false: a rank-major buffer, all-reduced).
Other gradients are communicated as sums and divided by the world size once, at the step.
Collectives are blocking and issued in program order (on CPU DeepSpeed does the same: the
accelerator is "synchronized", no side streams), except that post-step batch.
"""
from __future__ import annotations

import math
import time
from itertools import groupby

import torch
from torch.autograd.graph import get_gradient_edge

from calibration.core.comm import Comm
from calibration.core.grads import GradBuckets
from calibration.core.model import DTYPES, batch, build_segments, param_shapes
from calibration.core.moe import exchange, expert_groups, rank_initial_values
from calibration.core.plan import Plan
from calibration.core.step import OptimizerStep, adamw_per_group
from calibration.core.segments import SegmentEntry, last_reads
from zsim.schedule.ir import Buffer, Op, OpKind, Phase


class ZeroCore(OptimizerStep):
    def __init__(self, sc, plan: Plan, rank: int, world: int, comm: Comm, seed: int = 1234, wl=None):
        """`rank` and `world` are within the data-parallel group `comm` runs over; `wl`: the
        params this rank holds (a pipeline stage's slice; default the whole model)."""
        from zsim.schedule.build import workload_for

        self.sc, self.plan, self.rank, self.world, self.comm, self.seed = sc, plan, rank, world, comm, seed
        self.wl = wl if wl is not None else workload_for(sc)
        self.dtype = DTYPES[sc.precision]
        self.stage = plan.stage
        self.shapes = param_shapes(self.wl)
        self.segs = build_segments(sc, self.wl if wl is None else workload_for(sc))   # the whole model's
        self.numels = plan.numels
        self.trainable = plan.trainable
        # stages 0-2: each trainable param's start in the flat buffer (_layout); a frozen param
        # is in no flat group (see [Note: frozen parameters under ZeRO]); total: the trained elements
        self.offsets = [0]
        for n, t in zip(self.numels, self.trainable):
            self.offsets.append(self.offsets[-1] + (n if t else 0))
        self.total = self.offsets[-1]
        self.gas = sc.gradient_accumulation_steps
        self.clip = sc.deepspeed.gradient_clipping
        # modules after whose backward a trainable gradient is ready: DeepSpeed's first gradient
        # hook of each backward allocates the ZeRO-1/2 IPG buffer (see [Note: IPG buffer
        # lifetime]) whether or not the hook reduces anything then (ZeRO-1 reduces at the boundary)
        from zsim.schedule.partition import grads_ready_at
        self.grad_modules = {name for name, pids in grads_ready_at(self.wl).items() if pids}
        self.ep = sc.expert_parallel_size
        self.ep_group, self.edp_group = expert_groups(rank, world, self.ep)
        self.group_of: dict[int, int] = {}
        self.layout: list[tuple] = []
        if self.stage < 3:
            self._layout()
        init = self.initial_values()
        self.empty = torch.empty(0, dtype=self.dtype)
        self.params = [torch.empty(0, dtype=self.dtype).requires_grad_(t) for t in self.trainable]
        self.c, self.soff = [], [0]
        master = self._init_flat(init) if self.stage < 3 else self._init_sharded(init)
        del init
        self.master = torch.nn.Parameter(master, requires_grad=False)
        self.opts = adamw_per_group(self)
        self.grads = GradBuckets(self)
        self.times: list[tuple[str, str, str, int, float, float]] = []
        # see [Note: coalesced post-step gathers]: runs of post-step persistent gathers, launched async
        # together as DeepSpeed's _allgather_params_coalesced does: first op id -> the run's pids
        self.coalesced_runs: dict[int, list[int]] = {}
        for persistent, run in groupby(plan.ops, key=lambda op: op.kind == OpKind.PERSISTENT_GATHER):
            run = list(run)
            if persistent and len(run) > 1:
                self.coalesced_runs[run[0].id] = [op.payload.pids[0] for op in run]
        self.inflight: dict[int, tuple] = {}
        self.flat_out: dict[int, torch.Tensor] = {}     # gather op id -> its flat output buffer
        self.last_reads = last_reads(plan.ops, self.segs, sc)
        self._anchor = torch.empty(0, requires_grad=True)   # SegmentEntry's input that needs a gradient
        self.check_overflow = any(op.kind == OpKind.OVERFLOW_ALLREDUCE for op in plan.ops)
        self.dispatch = {
            OpKind.FORWARD: self._forward, OpKind.BACKWARD: self._backward,
            OpKind.PARAM_GATHER: lambda op: self._gather(list(op.payload.pids), op.id),
            OpKind.PERSISTENT_GATHER: self._gather_persistent,
            OpKind.UPDATED_GATHER: self._updated_gather,
            OpKind.BUCKET_REDUCE: lambda op: self.grads.reduce(op.payload),
            OpKind.GRAD_ALLREDUCE: self._grads_allreduce,
            OpKind.GRAD_NORM: lambda op: self._norm_and_overflow_local(),
            OpKind.OVERFLOW_ALLREDUCE: self._overflow_allreduce,
            OpKind.NORM_ALLREDUCE: self._norm_allreduce,
            OpKind.OPTIMIZER_STEP: lambda op: self._step(op.payload.sub_group),
            OpKind.EXPERT_ALL_TO_ALL: lambda op: exchange(self, op),
        }

    def _layout(self):
        """ZeRO-0/1/2: the flat groups (see [Note: MoE parameter groups]) end to end in one buffer,
        each partitioned over its own group: a param's position, this rank's partition of each
        group and where it sits in the local partition (the fp32 master and the gradient
        partition concatenate them in group order). One group: DeepSpeed's single flat buffer."""
        self.layout = []       # per group: (start in flat16, own slice of flat16, start in the partition, torch group)
        base = local = 0
        for g, group in enumerate(self.plan.groups):
            grank = self.rank // self.ep if group.expert else self.rank
            own = slice(base + grank * group.partition, base + (grank + 1) * group.partition)
            self.layout.append((base, own, local, self.edp_group if group.expert else None))
            for pid in group.pids:
                self.offsets[pid] = base + group.starts[pid]
                self.group_of[pid] = g
            base += group.padded
            local += group.partition

    def _init_flat(self, init):
        """ZeRO-0/1/2: one flat 16-bit buffer of all params (params are views); ZeRO-0 gradients
        are views of one flat gradient buffer. Returns the fp32 master of what this rank steps."""
        self.flat16 = torch.zeros(self.plan.flat_padded, dtype=self.dtype)
        for pid, t in enumerate(init):
            if not self.trainable[pid]:   # whole on every rank, in no flat group
                self.params[pid].data = t.to(self.dtype)
                continue
            self.flat16[self.span(pid)].copy_(t.flatten())
            self.params[pid].data = self.flat16[self.span(pid)].view(self.shapes[pid])
        if self.stage > 0:
            # DeepSpeedZeroOptimizer clones its fp32 master partition whatever the model dtype
            # (stage_1_and_2.py:560-561, see [Note: one-rank stage ordering]): in fp32 too, the
            # master is memory of its own, not a view of the 16-bit (here fp32) flat buffer
            if len(self.layout) == 1:
                return self.flat16[self.layout[0][1]].to(torch.float32, copy=True)
            return torch.cat([self.flat16[own] for _, own, _, _ in self.layout]).float()
        self.flatgrad = torch.zeros(self.plan.flat_padded, dtype=self.dtype)
        for pid in range(len(self.numels)):
            if self.trainable[pid]:
                self.params[pid].grad = self.flatgrad[self.span(pid)].view(self.shapes[pid])
        src = self.flat16[: self.total]
        return src if self.dtype == torch.float32 else src.float()

    def _init_sharded(self, init):
        """ZeRO-3: ceil(n/world) elements of every param on each rank; persistent params whole.
        The gradient partition and the fp32 master cover the trainable params' shards (goff)."""
        W, rank = self.world, self.rank
        self.c = [math.ceil(n / W) for n in self.numels]
        self.goff = [0]
        for c, t in zip(self.c, self.trainable):
            self.soff.append(self.soff[-1] + c)
            self.goff.append(self.goff[-1] + (c if t else 0))
        self.shard16 = torch.zeros(self.soff[-1], dtype=self.dtype)
        for pid, t in enumerate(init):
            flat = torch.zeros(self.c[pid] * W)
            flat[: self.numels[pid]] = t.flatten()
            self.shard16[self.soff[pid]:self.soff[pid + 1]].copy_(flat[rank * self.c[pid]:(rank + 1) * self.c[pid]])
        for pid in self.plan.persistent:
            self.params[pid].data = init[pid].to(self.dtype)
        if all(self.trainable):   # cloned in fp32 too (stage3.py _create_fp32_partitions), as at stages 1-2
            return self.shard16.to(torch.float32, copy=True)
        return torch.cat([self.shard16[self.soff[p]:self.soff[p + 1]] for p in self._trained()]).float()

    def initial_values(self) -> list[torch.Tensor]:
        return rank_initial_values(self.sc, self.wl, self.shapes, self.rank, self.seed)

    def _trained(self) -> list[int]:
        return [p for p, t in enumerate(self.trainable) if t]

    # -- helpers -----------------------------------------------------------------------
    def P(self, pid):
        return self.params[pid]

    def span(self, pid) -> slice:
        """ZeRO-0/1/2: the param's elements in the flat buffer."""
        return slice(self.offsets[pid], self.offsets[pid] + self.numels[pid])

    def _release(self, pid):
        if pid not in self.plan.persistent:
            self.params[pid].data = self.empty

    def _gather(self, pids, op_id: int):
        W = self.world
        S = sum(self.soff[p + 1] - self.soff[p] for p in pids)
        out = torch.empty(S * W, dtype=self.dtype)
        if len(pids) > 1:
            inp = torch.cat([self.shard16[self.soff[p]:self.soff[p + 1]] for p in pids],
                            out=out.narrow(0, self.rank * S, S))
            self.flat_out[op_id] = out
        else:
            inp = self.shard16[self.soff[pids[0]]:self.soff[pids[0] + 1]]
        self.comm.all_gather(out, inp)
        if len(pids) == 1:
            p = pids[0]
            self.params[p].data = out[: self.numels[p]].view(self.shapes[p])
            return
        view = out.view(W, S)
        o = 0
        for p in pids:
            c = self.c[p]
            self.params[p].data = view[:, o:o + c].reshape(-1)[: self.numels[p]].view(self.shapes[p])
            o += c

    def _drop_flat(self, tags):
        for key in [t.key for t in tags if t.buffer == Buffer.GATHER_FLAT]:
            del self.flat_out[key]

    def _launch_coalesced(self, pids):
        W = self.world
        for p in pids:
            inp = self.shard16[self.soff[p]:self.soff[p + 1]]
            out = torch.empty(inp.numel() * W, dtype=self.dtype)
            self.inflight[p] = (self.comm.all_gather(out, inp, async_op=True), out)

    def _finish_gather(self, p):
        handle, out = self.inflight.pop(p)
        handle.wait()
        self.params[p].data = out[: self.numels[p]].view(self.shapes[p])

    # -- what each op kind does -------------------------------------------------------------
    def _forward(self, op: Op):
        """Run one segment. The core holds what DeepSpeed's autograd graph holds and no more (see
        [Note: segment values]): its inputs enter through `SegmentEntry` (which keeps no reference), its
        output is kept as its gradient edge, and env drops a value after its last reader."""
        module, micro = op.payload.module, op.micro_step
        if micro != self.micro or not self.env:
            self.micro = micro
            ids, labels = self.batches[micro]
            self.env = {"ids": ids, "labels": labels}
        s = self.segs[module]
        # a segment's input carries a gradient where its producer's output does (none before the
        # first trained parameter: zsim/workload/lora.py)
        ins, boxes = [], []
        for n in s.inputs:
            v = self.env[n]
            if v.is_floating_point() and v.requires_grad:
                boxes.append((n, []))
                ins.append(SegmentEntry.apply(v.detach(), self._anchor, boxes[-1][1]))
            else:
                ins.append(v.detach() if v.is_floating_point() else v)
        with torch.enable_grad():
            out = s.fn(self.P, *ins)
        if module == "loss":
            self.losses.append(float(out.detach()))
            out = out / self.gas
        self.env[s.output] = out
        root = out if module == "loss" else get_gradient_edge(out) if out.requires_grad else None
        self.saved[module] = (boxes, root)

    def _backward(self, op: Op):
        module = op.payload.module
        s = self.segs[module]
        boxes, root = self.saved.pop(module)
        if module == "loss":
            torch.autograd.backward(root)
        elif root is None:
            pass   # frozen and no gradient into its input: autograd never reaches it
        else:
            torch.autograd.backward(root, self.act_grads.pop(s.output))
        self.env.pop(s.output, None)
        for n, box in boxes:
            for g in box:
                self.act_grads[n] = self.act_grads[n] + g if n in self.act_grads else g
        if op.payload.bucketed or module in self.grad_modules:
            self.grads.grads_ready(op.micro_step, op.payload.bucketed)

    def _gather_persistent(self, op: Op):
        if op.id in self.coalesced_runs:
            self._launch_coalesced(self.coalesced_runs[op.id])
        pid = op.payload.pids[0]
        if pid in self.inflight:
            self._finish_gather(pid)
        else:
            self._gather([pid], op.id)

    def _grads_allreduce(self, op: Op):
        lo = op.payload.offset
        self.comm.all_reduce(self.flatgrad[lo: lo + op.comm.numel])

    def _overflow_allreduce(self, op: Op):
        self.comm.all_reduce(self._bad.to(torch.uint8), op=torch.distributed.ReduceOp.MAX)

    def _norm_allreduce(self, op: Op):
        if len(self.layout) > 1:
            return self._group_norm_allreduce(op)
        # clip_grad_norm_ averages the ranks' norms (runtime/utils.py:415-418); ZeRO sums squares
        t = self._sq.sqrt().div(self.world).reshape(1) if self.stage == 0 else self._sq.reshape(1).clone()
        self.comm.all_reduce(t)
        self._norm = t[0] if self.stage == 0 else t.sqrt()[0]

    def _group_norm_allreduce(self, op: Op):
        """See [Note: MoE parameter groups]: each group's squared norm summed over the data-parallel
        group, then each MoE group's norm averaged over its expert-data-parallel group
        (_average_expert_grad_norms); the total is the L2 of the group norms."""
        k = len(self._norms)
        if k < len(self.layout):
            t = self._sq_groups[k].reshape(1).clone()
            self.comm.all_reduce(t)
            self._norms.append(t.sqrt())
        else:
            g = [i for i, group in enumerate(self.plan.groups) if group.expert][k - len(self.layout)]
            t = self._norms[g] / (self.world // self.ep)
            self.comm.all_reduce(t, group=self.edp_group)
            self._norms[g] = t
            self._norms.append(t)
        self._norm = torch.cat(self._norms[:len(self.layout)]).square().sum().sqrt()

    def _updated_gather(self, op: Op):
        """all_gather_dp_groups: each flat group over its own group."""
        g = self.plan.gather_group[op.id]
        base, own, _, group = self.layout[g]
        self.comm.all_gather(self.flat16[base: base + self.plan.groups[g].padded], self.flat16[own], group=group)

    # -- one optimizer step ------------------------------------------------------------------
    def train_step(self, step: int, record: bool = False) -> list[float]:
        """Run every op of the schedule once; returns the local loss of each micro-step."""
        self.batches = [batch(self.sc, step, m, self.rank, self.seed) for m in range(self.gas)]
        self.env, self.act_grads, self.saved, self.losses = {}, {}, {}, []
        self.grads.begin_step()
        self._norm = None
        self.micro = 0
        times = []
        t_start = time.perf_counter()
        for op in self.plan.ops:
            t0 = time.perf_counter()
            self.comm.phase = "backward" if op.phase == Phase.RECOMPUTE else op.phase.value
            if op.phase not in (Phase.BACKWARD, Phase.RECOMPUTE):
                self.grads.end_backward(boundary=op.phase == Phase.STEP)
            self._drop_flat(op.free_before)
            self.dispatch[op.kind](op)
            for n in self.last_reads.get(op.id, ()):
                if n in self.env and self.env[n].is_floating_point():
                    del self.env[n]
            for pid in self.plan.releases.get(op.id, ()):
                self._release(pid)
            self._drop_flat(op.free)
            t1 = time.perf_counter()
            if record:
                times.append((op.name, op.stream.value, op.phase.value, op.micro_step, t0 - t_start, t1 - t0))
        if record:
            self.times = times
        return self.losses
