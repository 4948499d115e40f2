"""Pipeline parallelism in the training core, as DeepSpeed 0.19.8's PipelineEngine runs it
(runtime/pipe/): each rank executes its stage's ops of zsim's schedule (zsim/schedule/pipeline.py,
the ported 1F1B TrainSchedule) over its stage's slice of the model (PipelineModule's
partition_method, zsim/schedule/pipe_partition.py), with

- real point-to-point transfers: SendActivation / RecvActivation of the stage boundary's hidden
  states and SendGrad / RecvGrad of their gradients, blocking torch.distributed send / recv to
  the neighbouring stage's rank (pipe/p2p.py send, recv where can_send_recv());
- PipeDataParallelTopology's rank order: rank = stage * dp + dp_rank (runtime/pipe/topology.py);
- ZeRO-0/1 over each stage's data-parallel group (ZeroCore with rank/world of that group);
- ReduceTiedGrads: the tied embedding's gradient all-reduced over the tie group (the same
  dp_rank of the first and the last stage; pipe/engine.py _exec_reduce_tied_grads);
- the gradient norm's squares summed over the data-parallel group, then over the pipe group
  (stage_1_and_2.py get_grad_norm_direct, _model_parallel_all_reduce), the tied copy counted
  once (module.py marks it ds_pipe_replicated on the ranks other than the tie's first);
- the loss: the last stage's mean over micro-batches, all-reduced over its data-parallel group
  and broadcast with it over the pipe group (pipe/engine.py _aggregate_total_loss).

Micro-batches are in flight together (1F1B), so each one keeps its own values, saved inputs and
activation gradients (`_Micro`), swapped in before its forward or backward runs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from calibration.core.comm import Comm
from calibration.core.ds_passes import squared_norm
from calibration.core.engine import ZeroCore
from calibration.core.model import init_params, param_shapes
from calibration.core.plan import EXECUTABLE, plan_for
from zsim.schedule.ir import OpKind

PIPE_KINDS = frozenset({OpKind.SEND_ACTIVATION, OpKind.RECV_ACTIVATION, OpKind.SEND_GRAD, OpKind.RECV_GRAD,
                        OpKind.TIED_ALLREDUCE, OpKind.LOSS_ALLREDUCE, OpKind.LOSS_BROADCAST})


def stage_plan(sc, stage: int):
    """(the stage's workload, its Plan, its expected calls): the stage's ops of zsim's schedule."""
    from calibration.validation import stage_calls
    from zsim.schedule.build import DTYPE_BYTES, build_schedule, workload_for
    from zsim.schedule.pipe_partition import stage_slices

    _, sched = build_schedule(sc)
    wl = stage_slices(workload_for(sc), sc.pipeline_stages, sc.parallelism.partition_method)[stage][0]
    plan = plan_for(sc, wl, [op for op in sched.ops if op.pipe_stage == stage], sc.data_parallel_size,
                    EXECUTABLE | PIPE_KINDS)
    plan.expected = [c[:3] for c in stage_calls(sched, stage, DTYPE_BYTES[sc.precision])]
    return wl, plan


class Grid:
    """PipeDataParallelTopology's process groups (topology.py PipelineParallelGrid), created in
    the same order on every rank: each stage's data-parallel group, each dp_rank's pipe group
    and tie group (the first and the last stage)."""

    def __init__(self, rank: int, world: int, stages: int):
        self.stages, self.dp = stages, world // stages
        self.stage, self.dp_rank = divmod(rank, self.dp)
        self.rank = rank
        for s in range(stages):
            g = dist.new_group([s * self.dp + d for d in range(self.dp)])
            if s == self.stage:
                self.dp_group = g
        for d in range(self.dp):
            g = dist.new_group([s * self.dp + d for s in range(stages)])
            if d == self.dp_rank:
                self.pipe_group = g
        for d in range(self.dp):
            g = dist.new_group([d, (stages - 1) * self.dp + d])
            if d == self.dp_rank:
                self.tied_group = g

    def global_rank(self, stage: int) -> int:
        return stage * self.dp + self.dp_rank


class _Micro:
    def __init__(self, env):
        self.env, self.saved, self.act_grads = env, {}, {}


class PipeCore(ZeroCore):
    def __init__(self, sc, rank: int, world: int, seed: int = 1234):
        from zsim.schedule.build import workload_for

        self.grid = grid = Grid(rank, world, sc.pipeline_stages)
        self.full = workload_for(sc)
        wl, plan = stage_plan(sc, grid.stage)
        super().__init__(sc, plan, grid.dp_rank, grid.dp, Comm(grid.dp_group), seed, wl=wl)
        # the segments name the whole model's params; this rank holds its stage's, by name
        local = {p.name: i for i, p in enumerate(wl.params)}
        self.local = {f: local[p.name] for f, p in enumerate(self.full.params) if p.name in local}
        first, last = self.segs[wl.modules[0].name], self.segs[wl.modules[-1].name]
        self.input_name = first.inputs[0] if grid.stage > 0 else None
        self.output_name = last.output if grid.stage < grid.stages - 1 else None
        self.act_shape = (sc.micro_batch_size, sc.seq_len, sc.model.hidden)
        tied = [local[n] for n in sorted(self._stage_names(0) & self._stage_names(grid.stages - 1)) if n in local]
        self.tied = tied[0] if tied and grid.stage in (0, grid.stages - 1) else None
        # module.py: the tie's copies other than the first stage's are ds_pipe_replicated
        self.replicated = self.tied if grid.stage > 0 else None
        self.dispatch.update({
            OpKind.SEND_ACTIVATION: self._send_activation, OpKind.RECV_ACTIVATION: self._recv_activation,
            OpKind.SEND_GRAD: self._send_grad, OpKind.RECV_GRAD: self._recv_grad,
            OpKind.TIED_ALLREDUCE: self._reduce_tied_grads, OpKind.LOSS_ALLREDUCE: self._loss_allreduce,
            OpKind.LOSS_BROADCAST: self._loss_broadcast,
        })

    def _stage_names(self, stage: int) -> set[str]:
        from zsim.schedule.pipe_partition import stage_slices

        wl = stage_slices(self.full, self.grid.stages, self.sc.parallelism.partition_method)[stage][0]
        return {p.name for p in wl.params}

    def initial_values(self) -> list[torch.Tensor]:
        """The whole model's initial values (the unsharded reference's), this stage's by name."""
        values = dict(zip((p.name for p in self.full.params), init_params(self.full, param_shapes(self.full),
                                                                            self.seed)))
        return [values[p.name] for p in self.wl.params]

    def P(self, pid):
        return self.params[self.local[pid]]

    # -- one micro-batch's state ----------------------------------------------------------------
    def _micro(self, micro: int) -> _Micro:
        if micro not in self.micros:
            ids, labels = self.batches[micro]
            self.micros[micro] = _Micro({"ids": ids, "labels": labels})
        m = self.micros[micro]
        self.env, self.saved, self.act_grads, self.micro = m.env, m.saved, m.act_grads, micro
        return m

    def _forward(self, op):
        self._micro(op.micro_step)
        super()._forward(op)

    def _backward(self, op):
        self._micro(op.micro_step)
        super()._backward(op)

    # -- pipe/p2p.py ------------------------------------------------------------------------------
    def _send_activation(self, op):
        out = self._micro(op.micro_step).env[self.output_name]
        self.comm.send(out.detach().contiguous(), self.grid.global_rank(self.grid.stage + 1))

    def _recv_activation(self, op):
        t = torch.empty(self.act_shape, dtype=self.dtype)
        self.comm.recv(t, self.grid.global_rank(self.grid.stage - 1))
        self._micro(op.micro_step).env[self.input_name] = t.requires_grad_(True)

    def _send_grad(self, op):
        g = self._micro(op.micro_step).act_grads.pop(self.input_name)
        self.comm.send(g.contiguous(), self.grid.global_rank(self.grid.stage - 1))
        del self.micros[op.micro_step]    # its last instruction on this stage

    def _recv_grad(self, op):
        g = torch.empty(self.act_shape, dtype=self.dtype)
        self.comm.recv(g, self.grid.global_rank(self.grid.stage + 1))
        self._micro(op.micro_step).act_grads[self.output_name] = g

    # -- the boundary -----------------------------------------------------------------------------
    def _reduce_tied_grads(self, op):
        """The accumulated gradient of the tied weight (ZeRO-0: a view of the flat gradients,
        ZeRO-1: autograd's .grad), summed over the tie group in place."""
        grad = self.params[self.tied].grad
        if grad.numel() != op.comm.numel:
            raise RuntimeError(f"tied gradient of {grad.numel()} elements, the schedule reduces {op.comm.numel}")
        self.comm.all_reduce(grad, group=self.grid.tied_group)

    def _norm_and_overflow_local(self):
        super()._norm_and_overflow_local()
        if self.stage == 0:
            # clip_grad_norm_ (runtime/utils.py:391-398) counts a parameter on model-parallel rank 0
            # only (the grid's model-parallel rank is the pipe stage, topology.py:304-313): the
            # first stage's gradients, tied copy included, make the whole norm
            self._sq = self._sq if self.grid.stage == 0 else torch.zeros_like(self._sq)
            return
        if self.replicated is not None:   # the tied copy's share of this rank's partition, not counted
            piece = self._own_piece(self.replicated)
            if piece is not None:
                scale = 1.0 / self.world ** 2
                self._sq = self._sq - (squared_norm([piece]) * scale).float()

    def _own_piece(self, pid):
        if self.stage == 0:
            return self.flatgrad[self.span(pid)]
        (base, own, local, _), = self.layout
        a, b = max(own.start, self.offsets[pid]), min(own.stop, self.offsets[pid] + self.numels[pid])
        if a >= b:
            return None
        return self.grads.partition_grads()[local + a - own.start: local + b - own.start]

    def _norm_allreduce(self, op):
        """Squares over the data-parallel group, then over the pipe group, then the root. ZeRO-0's
        clip_grad_norm_: squares over the pipe group, then the root divided by the data-parallel
        size summed over it (utils.py:410-418)."""
        if self.stage == 0:
            if op.comm.group is not None:
                self._sq_total = self._sq.reshape(1).clone()
                self.comm.all_reduce(self._sq_total, group=self.grid.pipe_group)
                return
            t = self._sq_total.sqrt().div(self.world)
            self.comm.all_reduce(t)
            self._norm = t[0]
            return
        if op.comm.group is None:
            t = self._sq.reshape(1).clone()
            self.comm.all_reduce(t)
        else:
            t = self._sq_total
            self.comm.all_reduce(t, group=self.grid.pipe_group)
        self._sq_total = t
        self._norm = t.sqrt()[0]

    def _dp_group_loss(self) -> torch.Tensor:
        """total_loss / gas: the mean of this rank's micro-batch losses in the step."""
        return torch.tensor([sum(self.losses) / self.gas])

    def _loss_allreduce(self, op):
        t = self._dp_group_loss()
        self.comm.all_reduce(t)
        self.agg_loss = t / self.grid.dp

    def _loss_broadcast(self, op):
        last = self.grid.stages - 1
        if self.grid.stage == last:
            mine = self._dp_group_loss()
            losses = torch.cat([mine, mine if self.agg_loss is None else self.agg_loss]).float()
        else:
            losses = torch.zeros(2)
        self.comm.broadcast(losses, self.grid.global_rank(last), group=self.grid.pipe_group)
        self.agg_loss = losses[1:]

    def train_step(self, step: int, record: bool = False) -> list[float]:
        """One train_batch; returns its loss as every stage gets it: the mean over the
        micro-batches and the data-parallel group (agg_train_loss)."""
        self.micros: dict[int, _Micro] = {}
        self.agg_loss = None
        super().train_step(step, record)
        return [float(self.agg_loss[0])]
