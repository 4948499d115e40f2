"""DeepSpeed-Ulysses sequence parallelism in the schedule: the exchanges the passes add around
every attention core, and the loss's all-reduce over the sequence group."""
from __future__ import annotations

from zsim.schedule.ir import Alloc, Buffer, Category, Collective, Group, OpKind, Phase, ProcessGroup, Stream, Tag
from zsim.schedule.payloads import Comm, ScalarAllReduce, SequenceExchange
from zsim.workload.attention import ulysses_kv_heads
from zsim.workload.module import Module, ModuleKind

POSITION_ID_BYTES = 8     # position_ids: int64
LOSS_TOTALS_BYTES = 8     # torch.stack((local_sum, good_tokens)): two fp32


# [Note: DeepSpeed-Ulysses]
# DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509) as DeepSpeed 0.19.8 ships it for Hugging
# Face models (ALST: runtime/sequence_parallel/ulysses_sp.py UlyssesSPAttentionHF, installed by
# accelerate's parallelism_config sp_backend deepspeed, the HF Trainer, or
# register_with_transformers directly). parallel_state_sp.initialize_sequence_parallel puts `sp`
# consecutive ranks in a sequence group; UlyssesSPDataLoaderAdapter gives each 1/sp of every
# sample's tokens, and every module runs on that shard but the attention core. Per attention layer:
# - forward, before the core: an all_gather of the position_ids (int64, micro x local seq) over the
#   group, then _combine_local_sequences' three all-to-alls, q, k and v ([sl_l bs hc hs] ->
#   [sl bs hc_l hs]; K and V first repeated to sp heads when there are fewer,
#   kv_replication_factor); the core then sees the whole sequence for heads / sp heads;
# - after the core: _partition_global_sequence's one all-to-all sends the context back;
# - backward: each exchange's backward is the same all-to-all on the gradient
#   (_dim_zero_all_to_all_backward): the context's before the core's backward, then v's, k's and
#   q's after it (autograd runs the later-made node first); the all_gather has no backward;
# - a checkpointed block's recompute runs the forward's calls again.
# The HF Trainer's loss under SP (transformers integrations/deepspeed.py deepspeed_sp_compute_loss)
# all-reduces the shard's loss sum and token count (two fp32) over the group after each forward.
# ZeRO partitions over the sequence-data-parallel group (engine.py seq_data_parallel_group: the
# whole world beside data parallelism), and the batch divides by world / sp (runtime/config.py
# DeepSpeedConfig world_size; accelerate's train_batch_size = micro x GAS x dp).
def sequence_group(ctx) -> ProcessGroup:
    """parallel_state_sp.initialize_sequence_parallel: ranks [i*sp, (i+1)*sp)."""
    return ProcessGroup(Group.SEQUENCE, ctx.sc.sequence_parallel_size, 1)


def exchange_numels(model, tokens: int, sp: int) -> dict[str, int]:
    """Elements each rank sends in one layer's all-to-alls (in = out), `tokens` its micro-batch's
    local tokens: q and the context are the rank's tokens x every head; k and v every key-value
    head (repeated to sp when fewer, ulysses_sp.py kv_replication_factor). Multi-head Latent
    Attention exchanges per-head keys of qk_nope + qk_rope and values of v_head_dim."""
    if model.mla is not None:
        mla = model.mla
        q = k = model.heads * mla.qk_head_dim
        v = context = model.heads * mla.v_head_dim
    else:
        hd = model.head_size
        q = context = model.heads * hd
        k = v = ulysses_kv_heads(model.n_kv_heads, sp) * hd
    return {"q": tokens * q, "k": tokens * k, "v": tokens * v, "context": tokens * context}


class UlyssesExchanges:
    """The calls the passes add around each attention core (ModuleKind.ATTENTION) and after the
    loss's forward: see [Note: DeepSpeed-Ulysses]."""

    def __init__(self, ctx):
        sc, wl = ctx.sc, ctx.wl
        sp = sc.sequence_parallel_size
        self.active = sp > 1
        if not self.active:
            return
        group = sequence_group(ctx)
        a = wl.act_dtype_bytes
        self.comms = {name: Comm(Collective.ALL_TO_ALL, n, float(n * a), group=group)
                      for name, n in exchange_numels(sc.model, wl.tokens, sp).items()}
        positions = wl.tokens * sp        # the gathered position_ids: the whole sequence
        self.positions = Comm(Collective.ALL_GATHER, positions, float(positions * POSITION_ID_BYTES), group=group)
        self.loss = Comm(Collective.ALL_REDUCE, 2, float(LOSS_TOTALS_BYTES), group=group)
        self.loss_module = wl.modules[-1].name

    def before(self, ctx, module: Module, micro: int, phase: Phase, last: int | None) -> int | None:
        if module.kind != ModuleKind.ATTENTION:
            return last
        if phase == Phase.BACKWARD:
            return self._exchange(ctx, module, micro, phase, "context", last, keep=False)
        last = ctx.b.add(OpKind.SEQUENCE_ALL_GATHER, Stream.COMPUTE, phase, micro,
                         SequenceExchange(self.positions, module.layer, "position_ids"), [last])
        for name in ("q", "k", "v"):
            last = self._exchange(ctx, module, micro, phase, name, last)
        return last

    def after(self, ctx, module: Module, micro: int, phase: Phase, op: int) -> int:
        if module.kind == ModuleKind.ATTENTION:
            if phase != Phase.BACKWARD:
                return self._exchange(ctx, module, micro, phase, "context", op)
            for name in ("v", "k", "q"):
                op = self._exchange(ctx, module, micro, phase, name, op, keep=name != "q")
            # the three exchanged gradients go on together to the projections' backward
            ctx.b.add_free(op, *(self._output(micro, module.layer, name, phase) for name in ("v", "k")))
            return op
        if phase == Phase.FORWARD and module.name == self.loss_module:
            return ctx.b.add(OpKind.LOSS_ALLREDUCE, Stream.COMPUTE, phase, micro, ScalarAllReduce(self.loss), [op])
        return op

    @staticmethod
    def _output(micro: int, layer: int, tensor: str, phase: Phase) -> Tag:
        return Tag(Buffer.SEQUENCE_BUFFER, micro, f"{layer}/{tensor}", phase)

    def _exchange(self, ctx, module: Module, micro: int, phase: Phase, tensor: str, after: int | None,
                  keep: bool = False) -> int:
        # _dim_zero_all_to_all sends a contiguous copy of its (rearranged) input and returns a new
        # tensor: both live for the call. What the core keeps of a forward exchange is its own
        # activation; in backward v's and k's exchanged gradients wait (`keep`) for q's, the three
        # then going on to the projections' backward together
        comm = self.comms[tensor]
        out = self._output(micro, module.layer, tensor, phase)
        sent = Tag(Buffer.SEQUENCE_BUFFER, micro, f"{module.layer}/{tensor}/sent", phase)
        op = ctx.b.add(OpKind.SEQUENCE_ALL_TO_ALL, Stream.COMPUTE, phase, micro,
                       SequenceExchange(comm, module.layer, tensor), [after],
                       (Alloc(sent, Category.ACTIVATIONS, comm.size_bytes), Alloc(out, Category.ACTIVATIONS, comm.size_bytes)))
        ctx.b.add_free(op, sent, *(() if keep else (out,)))
        return op
