"""Pipeline parallelism as DeepSpeed's PipelineEngine runs it (runtime/pipe/): each stage's
instructions come from TrainSchedule (schedule.py, ported in `train_schedule`), each stage is
one representative rank of its data-parallel group (ops carry `stage`), and the stages meet
only where DeepSpeed's do: the point-to-point sends of activations and gradients (p2p.py)
and ReduceTiedGrads.

A send and its recv are a rendezvous (a blocking NCCL send/recv pair): the SEND op waits for
both ranks to reach the pair and carries the transfer; the RECV op waits for the SEND. With
tensor parallelism each rank sends its part of the tensor and the tensor-parallel group
all-gathers it where it is used (see [Note: partitioned pipeline sends]). The
per-stage ZeRO-0/1 (and BF16_Optimizer) machinery is stage012's, over the stage's slice of
the model and its data-parallel group (see [Note: pipeline gradient reduction]).
"""
from __future__ import annotations

from dataclasses import replace
from enum import Enum

from zsim.schedule import offload, stage012
from zsim.schedule.context import StageHooks, StepContext
from zsim.schedule.ir import (Alloc, Buffer, Category, Collective, Group, HostSettings, OpKind, Phase, ProcessGroup,
                              Stream, Tag)
from zsim.schedule.payloads import Comm, GradReduce, PipeTransfer, ScalarAllReduce, TensorComm
from zsim.schedule.passes import backward, exchanges, forward
from zsim.schedule.pipe_partition import stage_slices
from zsim.schedule.pipe_wire import Wire, deepspeed_wires
from zsim.workload.module import DTYPE_BYTES, Workload


class Cmd(Enum):
    """TrainSchedule's instructions (schedule.py); LoadMicroBatch costs nothing in zsim's model."""
    LOAD = "LoadMicroBatch"
    FORWARD = "ForwardPass"
    BACKWARD = "BackwardPass"
    SEND_ACTIVATION = "SendActivation"
    RECV_ACTIVATION = "RecvActivation"
    SEND_GRAD = "SendGrad"
    RECV_GRAD = "RecvGrad"


def _step_to_micro_batch(step_id: int, stage_id: int, stages: int) -> tuple[int, bool]:
    """TrainSchedule._step_to_micro_batch: even stages run forwards on even steps."""
    if step_id % 2 == stage_id % 2:
        base = step_id // 2 if step_id % 2 == 0 else (step_id - 1) // 2
        return base - stage_id // 2, True
    if step_id % 2 == 0:   # odd stage, even step
        return step_id // 2 - stages + (stage_id + 1) // 2, False
    return (step_id - 1) // 2 - stages + 1 + stage_id // 2, False   # even stage, odd step


def train_schedule(stages: int, stage_id: int, micro_batches: int) -> list[tuple[Cmd, int]]:
    """TrainSchedule.steps() of one stage, flattened: (instruction, micro-batch). The final
    ReduceTiedGrads, ReduceGrads and OptimizerStep are the builder's."""
    valid = range(micro_batches).__contains__
    prev_stage, next_stage = stage_id > 0, stage_id < stages - 1
    out: list[tuple[Cmd, int]] = []
    prev = -1
    for step_id in range(2 * (micro_batches + stages - 1)):
        micro, is_forward = _step_to_micro_batch(step_id, stage_id, stages)
        if is_forward:
            if valid(prev) and prev_stage:
                out.append((Cmd.SEND_GRAD, prev))
            if valid(micro) and prev_stage:
                out.append((Cmd.RECV_ACTIVATION, micro))
        else:
            if valid(micro) and next_stage:
                out.append((Cmd.RECV_GRAD, micro))
            if valid(prev) and next_stage:
                out.append((Cmd.SEND_ACTIVATION, prev))
        if (stage_id == 0 or stage_id == stages - 1) and is_forward and valid(micro):
            out.append((Cmd.LOAD, micro))
        if valid(micro):
            out.append((Cmd.FORWARD if is_forward else Cmd.BACKWARD, micro))
        prev = micro
    return out


_PAIR = {Cmd.SEND_ACTIVATION: (Cmd.RECV_ACTIVATION, 1, OpKind.SEND_ACTIVATION, OpKind.RECV_ACTIVATION),
         Cmd.SEND_GRAD: (Cmd.RECV_GRAD, -1, OpKind.SEND_GRAD, OpKind.RECV_GRAD)}


class DeferredHooks(StageHooks):
    """A stage's ZeRO hooks with the boundary's end_backward held back: ReduceTiedGrads and
    ReduceGrads run after the last instruction of the schedule, not inside the backward."""

    def __init__(self, inner: stage012.Zero012Hooks):
        self.inner = inner
        self.boundary_last: int | None = None

    def pre_module(self, ctx, module, micro, phase):
        return self.inner.pre_module(ctx, module, micro, phase)

    def post_module(self, ctx, module, micro, phase, op):
        self.inner.post_module(ctx, module, micro, phase, op)

    def stationary(self, ctx, phase, micro):
        return self.inner.stationary(ctx, phase, micro)

    def accumulated_grads(self, ctx, module, micro):
        return self.inner.accumulated_grads(ctx, module, micro)

    def end_backward(self, ctx, micro, last_op):
        if micro == ctx.last_micro:
            self.boundary_last = last_op
        else:
            self.inner.end_backward(ctx, micro, last_op)


class _Stage:
    def __init__(self, ctx: StepContext, index: int, stages: int):
        self.ctx, self.index, self.stages = ctx, index, stages
        self.hooks = DeferredHooks(stage012.Zero012Hooks(ctx, pipelined=True))
        self.program = train_schedule(stages, index, ctx.gas)
        self.pos = 0
        self.last: int | None = None
        self.gathers: dict[str, TensorComm] = {}    # what it gathers -> its payload

    @property
    def next_cmd(self) -> tuple[Cmd, int] | None:
        return self.program[self.pos] if self.pos < len(self.program) else None


def build(ctx0: StepContext) -> tuple[tuple[tuple[int, int], ...], HostSettings]:
    """Add every stage's ops to ctx0's builder; returns each stage's [first, end) layers and
    the host settings (PipelineModule builds only its stage's layers: module.py _build)."""
    sc, b = ctx0.sc, ctx0.b
    stages = sc.pipeline_stages
    slices = stage_slices(ctx0.wl, stages, sc.parallelism.partition_method)
    ranks = []
    for s, (wl, _) in enumerate(slices):
        b.pipe_stage = s
        ctx = ctx0.for_slice(wl)
        # no token exchanges: an MoE model under a pipeline is refused (config/parallel.py)
        ctx.exchanges = exchanges(ctx)
        rank = _Stage(ctx, s, stages)
        stage012.allocate_states(ctx, rank.hooks.inner)
        ranks.append(rank)
    _run_programs(ranks, deepspeed_wires(sc, ctx0.wl.layer_input_bytes, ctx0.wl.act_dtype_bytes))
    tied = tied_params(slices[0][0], slices[-1][0]) if stages > 1 else 0
    return tuple(layers for _, layers in slices), finish(ctx0, ranks, tied)


def finish(ctx0: StepContext, ranks: list, tied: int) -> HostSettings:
    """Every stage's epilogue after its last instruction: ReduceTiedGrads (`tied` elements),
    ReduceGrads, the optimizer step, then the loss aggregation; the host settings. A rank has
    `index`, `ctx` (its StepContext) and `hooks` (DeferredHooks)."""
    b, stages = ctx0.b, len(ranks)
    finished = []
    for rank in ranks:
        b.pipe_stage = rank.index
        last = rank.hooks.boundary_last
        tied_op = _reduce_tied_grads(rank, ranks, tied) if tied and rank.index in (0, stages - 1) else None
        first = b.next_id
        # ReduceGrads: the walk's gradient hooks follow the last backward; its first reduction
        # waits for ReduceTiedGrads (the instruction before it)
        rank.hooks.inner.end_backward(rank.ctx, rank.ctx.last_micro, last)
        if tied_op is not None and first < b.next_id:
            b.add_deps(first, tied_op)
        finished.append(stage012.optimizer_boundary(rank.ctx, rank.hooks.inner,
                                                    tied_op if tied_op is not None else last))
    _aggregate_total_loss(ranks, finished)
    b.pipe_stage = 0
    load = max(offload.host_load_bytes(rank.ctx) for rank in ranks)
    return replace(offload.host_settings(ctx0), host_load_bytes_per_gpu=load)


def _run_programs(ranks: list[_Stage], wires: tuple[Wire, Wire]):
    """Emit every stage's instructions in an order that respects the rendezvous of each
    send/recv pair (TrainSchedule orders them so that one exists). `wires`: the activation's
    and the gradient's (see [Note: partitioned pipeline sends])."""
    b = ranks[0].ctx.b
    acts, grads = wires
    while True:
        progressed = False
        for rank in ranks:
            while (cmd := rank.next_cmd) is not None:
                kind, micro = cmd
                if kind in (Cmd.RECV_ACTIVATION, Cmd.RECV_GRAD):
                    break                       # emitted with its send
                b.pipe_stage = rank.index
                first, last = rank.index == 0, rank.index == rank.stages - 1
                if kind == Cmd.LOAD:
                    pass
                elif kind == Cmd.FORWARD:
                    if not first:   # _exec_forward_pass: the received part, made whole
                        _gather(b, rank, acts, micro, Phase.FORWARD, "p2p recv activation")
                    rank.last = forward(rank.ctx, rank.hooks, micro, rank.last)
                    if not last:   # pipe_buffers['outputs'], kept for its backward: only the part
                        # when partitioned (the output's data is dropped, engine.py:745-750)
                        b.add_alloc(rank.last, Alloc(Tag(Buffer.PIPE_OUTPUT, micro), Category.ACTIVATIONS,
                                                     acts.size_bytes))
                elif kind == Cmd.BACKWARD:
                    if not last and grads.gather is not None:   # _exec_backward_pass
                        _gather(b, rank, acts, micro, Phase.BACKWARD, "pipe output")
                        _gather(b, rank, grads, micro, Phase.BACKWARD, "p2p recv grad")
                    assert rank.last is not None     # the micro-batch's forward ran first
                    rank.last = backward(rank.ctx, rank.hooks, micro, rank.last)
                    if not last:
                        b.add_free(rank.last, Tag(Buffer.PIPE_OUTPUT, micro))
                elif not _send(b, rank, ranks, kind, micro, wires):
                    break
                rank.pos += 1
                progressed = True
        if all(rank.next_cmd is None for rank in ranks):
            return
        if not progressed:
            stuck = ", ".join(f"stage {r.index}: {r.next_cmd[0].value} {r.next_cmd[1]}" for r in ranks if r.next_cmd)
            raise RuntimeError(f"pipeline schedule deadlock ({stuck})")


def _gather(b, rank: _Stage, w: Wire, micro: int, phase: Phase, what: str):
    """PartitionedTensor.full(): the all-gather over the tensor-parallel group, when partitioned."""
    if w.gather is not None:
        payload = rank.gathers.get(what)     # the same payload every micro-step, made once
        if payload is None:
            payload = rank.gathers[what] = TensorComm(w.gather, what)
        rank.last = b.add(OpKind.TP_ALL_GATHER, Stream.COMPUTE, phase, micro, payload, [rank.last])


def _send(b, rank: _Stage, ranks: list[_Stage], kind: Cmd, micro: int, wires: tuple[Wire, Wire]) -> bool:
    """A send and its peer's recv when the peer has reached it; False while it has not. A
    partitioned tensor goes as two pairs: its meta, then its part."""
    recv, step, send_kind, recv_kind = _PAIR[kind]
    peer = ranks[rank.index + step]
    if peer.next_cmd != (recv, micro):
        return False
    phase = Phase.FORWARD if kind == Cmd.SEND_ACTIVATION else Phase.BACKWARD
    acts, w = wires if kind == Cmd.SEND_GRAD else (wires[0], wires[0])
    if kind == Cmd.SEND_GRAD and w.gather is None:
        # _exec_recv_grads with pipe_partitioned only: the output made whole before the whole
        # gradient comes (nothing when the activation went whole too)
        b.pipe_stage = peer.index
        _gather(b, peer, acts, micro, phase, "pipe output")
        b.pipe_stage = rank.index
    parts = [PipeTransfer(w.meta_bytes, rank.index, peer.index, meta=True)] if w.meta_bytes else []
    for payload in parts + [PipeTransfer(w.size_bytes, rank.index, peer.index)]:
        rank.last = b.add(send_kind, Stream.COMPUTE, phase, micro, payload, [rank.last, peer.last])
        b.pipe_stage = peer.index
        peer.last = b.add(recv_kind, Stream.COMPUTE, phase, micro, payload, [rank.last, peer.last])
        b.pipe_stage = rank.index
    peer.pos += 1
    return True


def _aggregate_total_loss(ranks: list[_Stage], finished: list[int]):
    """pipe/engine.py _aggregate_total_loss, at the end of train_batch: the last stage
    all-reduces the mean loss over its data-parallel group (when there is one), then broadcasts
    it (with the aggregated loss: 2 elements) over the pipe group; every stage takes part."""
    last = ranks[-1]
    b = last.ctx.b
    src = finished[-1]
    if last.ctx.dp_size > 1:
        b.pipe_stage = last.index
        src = b.add(OpKind.LOSS_ALLREDUCE, Stream.COMPUTE, Phase.STEP, last.ctx.last_micro,
                    ScalarAllReduce(Comm(Collective.ALL_REDUCE, 1, 4)), [src])
    pipe = ProcessGroup(Group.PIPE, len(ranks), last.ctx.dp_size)
    for rank, done in zip(ranks, finished):
        b.pipe_stage = rank.index
        b.add(OpKind.LOSS_BROADCAST, Stream.COMPUTE, Phase.STEP, rank.ctx.last_micro,
              ScalarAllReduce(Comm(Collective.BROADCAST, 2, 8, group=pipe)), [done, src])


def tied_params(first: Workload, last: Workload) -> int:
    """Elements of the weights both the first and the last stage hold (the tied embedding)."""
    names = {p.name for p in first.params}
    return sum(p.numel for p in last.params if p.name in names)


def _reduce_tied_grads(rank: _Stage, ranks: list[_Stage], numel: int) -> int:
    """pipe/engine.py _exec_reduce_tied_grads: all-reduce of the tied weight's gradient over
    the tie group (the BF16_Optimizer's fp32 _hp_grad, else the 16-bit .grad); both ranks enter
    it together, each after its last backward."""
    ctx = rank.ctx
    dtype = "fp32" if rank.hooks.inner.bf16_optimizer else ctx.sc.precision
    peer = ranks[-1] if rank.index == 0 else ranks[0]
    # the tie group: the same data-parallel rank of the first and the last stage
    tied = ProcessGroup(Group.TIED, 2, (len(ranks) - 1) * ctx.dp_size)
    comm = Comm(Collective.ALL_REDUCE, numel, numel * DTYPE_BYTES[dtype], group=tied, dtype=dtype)
    return ctx.b.add(OpKind.TIED_ALLREDUCE, Stream.COMPUTE, Phase.BACKWARD, ctx.last_micro, GradReduce(comm),
                     [rank.hooks.boundary_last, peer.hooks.boundary_last])
