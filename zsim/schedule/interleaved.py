"""Megatron-LM's interleaved 1F1B pipeline schedule (Narayanan et al., SC'21, section 2.2.2;
megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving,
get_pp_rank_microbatches, get_schedule_table). DeepSpeed's PipelineEngine has no interleaving:
this is the schedule Megatron(-DeepSpeed) runs when a rank holds several model chunks.

Each pipeline rank holds `chunks` model chunks (chunk j of rank i is virtual stage j * p + i,
pipe_partition.chunk_slices). A rank walks the virtual micro-batches k = 0 .. m * v - 1 of
Megatron's schedule table (groups of p micro-batches, each group through every chunk in
turn): a warm-up of forwards, then one forward and one backward per step, then the
cool-down's backwards. Activations go to the next rank (the last rank's chunk j to rank 0's
chunk j + 1), gradients back. The sends are Megatron's blocking batched exchange (p2p_communication.py
_communicate with batch_p2p_comm, no overlap_p2p_comm; the only kind in v2.x-v3.0, the versions of
the published SC'21 and Korthikanti et al. runs): after each step a rank posts its sends and
receives in one batch_isend_irecv, which NCCL runs at once, and waits for all of them; each send
is a rendezvous with the peer's matching receive and crosses one direction of each rank's
full-duplex link. With tensor parallelism and no sequence parallelism, each rank sends its 1/t
of the tensor and the receiver all-gathers it after the call (v2.x-v3.0's
scatter_gather_tensors_in_pipeline, on by default; see [Note: partitioned pipeline sends]). The warm-up, the bubble and each rank's in-flight activations come out
of the run.

The per-rank ZeRO-0/1 machinery is stage012's over the rank's chunks (one optimizer for all of
them) and the epilogue is pipeline.finish, as for DeepSpeed's schedule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from zsim.schedule import stage012
from zsim.schedule.context import StepContext
from zsim.schedule.ir import Alloc, Buffer, Category, HostSettings, OpKind, Phase, Stream, Tag
from zsim.schedule.passes import backward, exchanges, forward
from zsim.schedule.payloads import PipeTransfer, TensorComm
from zsim.schedule.pipe_partition import chunk_slices
from zsim.schedule.pipe_wire import Wire, wire
from zsim.schedule.pipeline import DeferredHooks, finish, tied_params


def schedule_table(micro_batches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """get_schedule_table: (micro-batch, chunk) of each virtual micro-batch, in groups of
    `group` micro-batches (microbatch_group_size_per_vp_stage, by default the pipeline size)."""
    table = []
    for first in range(0, micro_batches, group):
        end = micro_batches if first + group >= micro_batches else first + group
        table += [(micro, chunk) for chunk in range(chunks) for micro in range(first, end)]
    return table


def warmup_micro_batches(stages: int, rank: int, chunks: int, micro_batches: int) -> int:
    """get_pp_rank_microbatches (interleaved branch): (p - rank - 1) * 2 forwards plus
    (v - 1) * group on every rank, at most all m * v of them."""
    return min((stages - rank - 1) * 2 + (chunks - 1) * stages, micro_batches * chunks)


class Step(NamedTuple):
    """A forward or backward of one (micro-batch, chunk)."""
    forward: bool
    micro: int
    chunk: int


class Message(NamedTuple):
    """One point-to-point tensor: an activation (forward) or its gradient, named by whom it is
    for: the destination rank and the (micro-batch, chunk) it feeds."""
    forward: bool
    dst: int
    micro: int
    chunk: int


@dataclass
class Exchange:
    """One p2p call of a rank (send_forward_recv_forward, send_backward_recv_backward,
    send_forward_backward_recv_forward_backward): its sends, then its receives."""
    sends: list[Message] = field(default_factory=list)
    recvs: list[Message] = field(default_factory=list)


def rank_program(stages: int, rank: int, chunks: int, micro_batches: int) -> list[Step | Exchange]:
    """forward_backward_pipelining_with_interleaving for one rank (the default path: no
    overlap_p2p_comm): its forwards, backwards and p2p calls in order."""
    p, v, m = stages, chunks, micro_batches
    total = m * v
    table = schedule_table(m, v, p)
    warm = warmup_micro_batches(p, rank, v, m)
    remaining = total - warm
    received = {True: [0] * v, False: [0] * v}   # tensors received so far per direction and chunk

    def chunk_of(k: int, fwd: bool) -> int:      # get_model_chunk_id
        c = table[k % total][1]
        return c if fwd else v - 1 - c

    def step(k: int, fwd: bool) -> Step:
        return Step(fwd, table[k % total][0], chunk_of(k, fwd))

    def recv_from_previous_stage(k: int, fwd: bool) -> tuple[bool, int]:   # recv_tensor_from_previous_stage
        if rank != (0 if fwd else p - 1):
            return True, chunk_of(k + 1, fwd)
        # the leading rank is p - 1 virtual micro-batches ahead of the rank that feeds it
        recv = k >= p - 1
        nxt = chunk_of(k - (p - 1) if recv else k + 1, fwd)
        if nxt == (v - 1 if fwd else 0):
            recv = False
        return recv, nxt + (1 if fwd else -1)

    def recv(ex: Exchange, fwd: bool, chunk: int):
        # each chunk's inputs (and output gradients) arrive in micro-batch order (FIFO lists)
        ex.recvs.append(Message(fwd, rank, received[fwd][chunk], chunk))
        received[fwd][chunk] += 1

    def exchange(*steps: Step) -> Exchange:
        """The call after `steps`: sends their outputs (activation) and input gradients."""
        ex = Exchange()
        for s in steps:
            if s.forward and not (rank == p - 1 and s.chunk == v - 1):
                ex.sends.append(Message(True, (rank + 1) % p, s.micro, s.chunk + (rank == p - 1)))
            elif not s.forward and not (rank == 0 and s.chunk == 0):
                ex.sends.append(Message(False, (rank - 1) % p, s.micro, s.chunk - (rank == 0)))
        return ex

    def receive_next(ex: Exchange, k: int, fwd: bool, last: bool):
        """What virtual micro-batch k + 1 (of that direction) needs, but not after the last one."""
        want, chunk = recv_from_previous_stage(k, fwd)
        if want and not last:
            recv(ex, fwd, chunk)

    prog: list[Step | Exchange] = []
    first = Exchange()
    if rank != 0:                                  # recv_forward before the warm-up
        recv(first, True, 0)
    prog.append(first)
    for k in range(warm):
        fwd = step(k, True)
        ex = exchange(fwd)
        receive_next(ex, k, True, k == total - 1)
        if k == warm - 1 and remaining and rank != p - 1:   # the last warm-up call also receives a gradient
            recv(ex, False, v - 1)
        prog += [fwd, ex]
    for k in range(remaining):
        fwd, bwd = step(k + warm, True), step(k, False)
        ex = exchange(fwd, bwd)
        receive_next(ex, k + warm, True, k == remaining - 1)
        receive_next(ex, k, False, False)
        prog += [fwd, bwd, ex]
    if not remaining and rank != p - 1:            # recv_backward before an all-warm-up cool-down
        tail = Exchange()
        recv(tail, False, v - 1)
        prog.append(tail)
    for k in range(remaining, total):
        bwd = step(k, False)
        ex = exchange(bwd)
        receive_next(ex, k, False, k == total - 1)
        prog += [bwd, ex]
    return [x for x in prog if isinstance(x, Step) or x.sends or x.recvs]


def programs(stages: int, chunks: int, micro_batches: int) -> list[list[Step | Exchange]]:
    """Every rank's program, with its pairing checked: what each rank sends a peer is what the
    peer receives from it, in the same order (NCCL matches a pair's sends and receives in order)."""
    progs = [rank_program(stages, r, chunks, micro_batches) for r in range(stages)]
    sent: dict[tuple[int, int], list[Message]] = {}
    got: dict[tuple[int, int], list[Message]] = {}
    for r, prog in enumerate(progs):
        for ex in (x for x in prog if isinstance(x, Exchange)):
            for msg in ex.sends:
                sent.setdefault((r, msg.dst), []).append(msg)
            for msg in ex.recvs:
                src = (r - 1) % stages if msg.forward else (r + 1) % stages
                got.setdefault((src, r), []).append(msg)
    if sent != got:
        raise RuntimeError("interleaved schedule: sends and receives do not pair")
    return progs


class _Rank:
    def __init__(self, ctx: StepContext, chunk_ctxs: list[StepContext], index: int, program):
        self.ctx, self.chunks, self.index, self.program = ctx, chunk_ctxs, index, program
        self.hooks = DeferredHooks(stage012.Zero012Hooks(ctx, pipelined=True, ipg_per_backward=True))
        self.pos = 0
        self.last: int | None = None
        self.posted = False        # inside an Exchange: its receives are posted
        self.batch: list[int] = []  # the Exchange's sends on the P2P stream, not yet waited for
        # the program's last forward/backward: the boundary's backward, whose ReduceGrads is deferred
        self.final = max(i for i, x in enumerate(program) if isinstance(x, Step))


def build(ctx0: StepContext) -> tuple[tuple[tuple[int, int], ...], HostSettings]:
    """Add every rank's ops to ctx0's builder; returns each virtual stage's [first, end) layers
    (model order) and the host settings."""
    sc, b = ctx0.sc, ctx0.b
    p, v = sc.pipeline_stages, sc.parallelism.virtual_stages
    slices = chunk_slices(ctx0.wl, p, v)
    progs = programs(p, v, ctx0.gas)
    ranks = []
    for r, (rank_wl, chunks) in enumerate(slices):
        b.pipe_stage = r
        ctx = ctx0.for_slice(rank_wl)
        # no token exchanges: an MoE model under a pipeline is refused (config/parallel.py)
        ctx.exchanges = exchanges(ctx)
        chunk_ctxs = []
        for wl, _ in chunks:
            chunk_ctx = ctx0.for_slice(wl)
            chunk_ctx.exchanges = ctx.exchanges
            chunk_ctxs.append(chunk_ctx)
        rank = _Rank(ctx, chunk_ctxs, r, progs[r])
        stage012.allocate_states(ctx, rank.hooks.inner)
        ranks.append(rank)
    act_bytes = ctx0.wl.layer_input_bytes
    _run(ranks, act_bytes, wire(sc, act_bytes, ctx0.wl.act_dtype_bytes))
    layers: list[tuple[int, int]] = [(0, 0)] * (p * v)
    for r, (_, chunks) in enumerate(slices):
        for j, (_, span) in enumerate(chunks):
            layers[j * p + r] = span
    return tuple(layers), finish(ctx0, ranks, tied_params(slices[0][0], slices[-1][0]))


def _run(ranks: list[_Rank], act_bytes: float, wire: Wire):
    """Emit every rank's program in an order that respects each send's rendezvous: a rank's
    sends go out once every receiver has posted the call that receives them, its receives once
    their sends are out (Megatron's schedule guarantees one exists)."""
    b = ranks[0].ctx.b
    posts: dict[Message, int | None] = {}                 # a message -> the receiver's last op before its call
    sent: dict[Message, tuple[int, PipeTransfer]] = {}    # a message -> its SEND op and payload
    while True:
        before = (sum(rank.pos for rank in ranks), len(posts), len(sent))
        for rank in ranks:
            b.pipe_stage = rank.index
            while rank.pos < len(rank.program):
                item = rank.program[rank.pos]
                if isinstance(item, Step):
                    _compute(b, rank, item, act_bytes, len(ranks))
                elif not _exchange(b, rank, item, posts, sent, wire, len(ranks)):
                    break
                rank.pos += 1
        if all(rank.pos == len(rank.program) for rank in ranks):
            return
        # a posted call or a send that went out is progress too: a peer may go on from it
        if (sum(rank.pos for rank in ranks), len(posts), len(sent)) == before:
            raise RuntimeError("interleaved pipeline schedule deadlock at "
                               + ", ".join(f"rank {r.index} item {r.pos}" for r in ranks if r.pos < len(r.program)))


def _compute(b, rank: _Rank, s: Step, act_bytes: float, p: int):
    """One chunk's forward or backward. The output a chunk sends is kept until its backward
    (as pipe_buffers['outputs']); each chunk's backward is one autograd backward with its own
    IPG buffer (see [Note: IPG buffer lifetime])."""
    ctx, hooks = rank.chunks[s.chunk], rank.hooks
    sends_output = not (rank.index == p - 1 and s.chunk == len(rank.chunks) - 1)
    tag = Tag(Buffer.PIPE_OUTPUT, s.micro, s.chunk)
    if s.forward:
        rank.last = forward(ctx, hooks, s.micro, rank.last)
        if sends_output:
            b.add_alloc(rank.last, Alloc(tag, Category.ACTIVATIONS, act_bytes))
        return
    inner = hooks.inner
    inner.ipg_micro = -1           # a new backward: its first gradient hook allocates the IPG buffer
    assert rank.last is not None     # the micro-batch's forward ran first
    rank.last = backward(ctx, hooks, s.micro, rank.last)
    if sends_output:
        b.add_free(rank.last, tag)
    if s.micro == ctx.last_micro and rank.pos != rank.final and inner.ipg_micro == s.micro:
        # the boundary's end_backward (ReduceGrads) runs once, after the final backward
        b.add_free(rank.last, Tag(Buffer.IPG, s.micro))
        inner.ipg_micro = -1


def _exchange(b, rank: _Rank, ex: Exchange, posts, sent, wire: Wire, p: int) -> bool:
    """One batched p2p call (p2p_communication.py _communicate: batch_isend_irecv, then every
    request waited and torch.cuda.synchronize()); False while a peer has not reached its side
    of it. Its sends start together once their receivers have posted their calls (NCCL runs a
    group's sends at once: the first on the compute stream, the other on the P2P stream); the
    receives wait for the peers' sends, the first of them for the rank's own sends too, so
    the compute stream goes on only when the whole batch is done. With scatter/gather, each
    received piece is then all-gathered over the tensor-parallel group (gather_split_1d_tensor)."""
    if not rank.posted:
        for msg in ex.recvs:
            posts[msg] = rank.last
        rank.posted = True
    pending = [msg for msg in ex.sends if msg not in sent]
    if pending:
        if not all(msg in posts for msg in pending):
            return False
        start, rank.batch = rank.last, []
        for i, msg in enumerate(pending):
            kind = OpKind.SEND_ACTIVATION if msg.forward else OpKind.SEND_GRAD
            # the chunk it leaves: rank p - 1's chunk j feeds rank 0's chunk j + 1 (and back)
            wraps = rank.index == (p - 1 if msg.forward else 0)
            src_chunk = msg.chunk + (-1 if msg.forward else 1) * wraps
            payload = PipeTransfer(wire.size_bytes, rank.index, msg.dst, (src_chunk, msg.chunk))
            phase = Phase.FORWARD if msg.forward else Phase.BACKWARD
            # a call that receives nothing sends one tensor (Megatron's schedule): the compute stream
            stream = Stream.COMPUTE if i == 0 or not ex.recvs else Stream.P2P
            op = b.add(kind, stream, phase, msg.micro, payload, [start, posts[msg]])
            if stream == Stream.COMPUTE:
                rank.last = op
            else:
                rank.batch.append(op)
            sent[msg] = (op, payload)
    if not all(msg in sent for msg in ex.recvs):
        return False
    for msg in ex.recvs:
        kind = OpKind.RECV_ACTIVATION if msg.forward else OpKind.RECV_GRAD
        op, payload = sent[msg]
        rank.last = b.add(kind, Stream.COMPUTE, Phase.FORWARD if msg.forward else Phase.BACKWARD, msg.micro,
                          payload, [op, rank.last, *rank.batch])
        rank.batch = []
    tp_gather = wire.gather
    for msg in ex.recvs if tp_gather is not None else ():
        assert tp_gather is not None
        gather = TensorComm(tp_gather, "p2p recv activation" if msg.forward else "p2p recv grad")
        rank.last = b.add(OpKind.TP_ALL_GATHER, Stream.COMPUTE, Phase.FORWARD if msg.forward else Phase.BACKWARD,
                          msg.micro, gather, [rank.last])
    rank.posted = False
    return True
