"""Megatron-LM tensor parallelism in the schedule: the collectives of the activations over the
tensor-parallel group (megatron/core/tensor_parallel/mappings.py, layers.py, cross_entropy.py).

Each simulated rank is one rank of its tensor-parallel group; the group runs in lockstep, so
its collectives are blocking calls on the compute stream (Megatron issues them on the default
stream; the wgrad/dgrad overlap of its sequence-parallel backward is not modelled). Where a
module meets them is its TensorRole (zsim/workload/module.py):

 without sequence parallelism (Shoeybi et al. 2019, fig. 3's f and g):
   ENTER  (column-parallel input): nothing in forward, all-reduce of the input gradient after
          its backward
   EXIT   (row-parallel output, vocab-parallel embedding): all-reduce after its forward,
          nothing in backward
 with sequence parallelism (Korthikanti et al. 2022 sec. 4.2.2, fig. 5's g and g-bar):
   ENTER  all-gather of the sequence-sharded input before its forward; in backward the
          all-gather again (the input is kept sharded: LinearWithGradAccumulationAndAsync
          Communication re-gathers it for the weight gradient) and a reduce-scatter of the input
          gradient after it
   EXIT   reduce-scatter after its forward, all-gather of the output gradient before its backward
          (the embedding without learned positions too: reduce_scatter_embeddings)
   EMBED  (the vocab-parallel embedding before learned positions) all-reduce after its forward,
          all-gather of the gradient of the scattered sum before its backward
          (language_model_embedding.py: scatter_to_sequence_parallel_region after the positions)
 VOCAB_LOSS: vocab_parallel_cross_entropy's three all-reduces of one fp32 per token (max,
          target logit, sum of exponentials) in forward.

After the step's last backward (`sequence_parallel_grads`, finalize_model_grads.py
_allreduce_non_tensor_model_parallel_grads, after the data-parallel grad sync): one all-reduce
over the TP group of the flattened gradients every TP rank only partly computed
(Param.tensor_partial_grad: the sequence-sharded norms and row-parallel biases, qk layernorms).

A checkpointed block's recompute re-runs its forward collectives (Megatron's full recompute
re-runs the block's forward, communication included).
"""
from __future__ import annotations

from zsim.schedule.ir import Collective, Group, OpKind, Phase, ProcessGroup, Stream
from zsim.schedule.payloads import Comm, TensorComm
from zsim.workload.module import Module, TensorRole

FP32_BYTES = 4


AR, RS, AG = Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.ALL_GATHER
_KINDS = {AR: OpKind.TP_ALL_REDUCE, RS: OpKind.TP_REDUCE_SCATTER, AG: OpKind.TP_ALL_GATHER}
# (sequence parallel, role, forward (recompute included), before the module) -> its collectives
_PLAN = {
    (False, TensorRole.ENTER, False, False): (AR,),
    (False, TensorRole.EXIT, True, False): (AR,),
    (True, TensorRole.ENTER, True, True): (AG,),
    (True, TensorRole.ENTER, False, True): (AG,),
    (True, TensorRole.ENTER, False, False): (RS,),
    (True, TensorRole.EXIT, True, False): (RS,),
    (True, TensorRole.EXIT, False, True): (AG,),
    (False, TensorRole.EMBED, True, False): (AR,),
    (True, TensorRole.EMBED, True, False): (AR,),
    (True, TensorRole.EMBED, False, True): (AG,),
    (False, TensorRole.VOCAB_LOSS, True, False): (AR,) * 3,
    (True, TensorRole.VOCAB_LOSS, True, False): (AR,) * 3,
}


def tensor_parallel_group(tensor: int) -> ProcessGroup:
    """megatron/core/parallel_state.py: tensor-parallel ranks are consecutive (order tp-dp-pp)."""
    return ProcessGroup(Group.TENSOR, tensor, 1)


class TensorCollectives:
    """The tensor-parallel collectives the passes add around the modules (zsim/schedule/passes.py)."""

    def __init__(self, ctx):
        par = ctx.sc.parallelism
        self.active = par.tensor > 1
        self.sp = par.sequence_parallel
        self.group = tensor_parallel_group(par.tensor)
        self.a = ctx.wl.act_dtype_bytes
        self.tokens = ctx.wl.tokens

    def _plan(self, module: Module, phase: Phase, before: bool) -> tuple[Collective, ...]:
        if not self.active or module.tensor_role is None:
            return ()
        return _PLAN.get((self.sp, module.tensor_role, phase != Phase.BACKWARD, before), ())

    def _add(self, ctx, module: Module, micro: int, phase: Phase, collectives, last):
        for collective in collectives:
            if module.tensor_role == TensorRole.VOCAB_LOSS:
                numel = self.tokens
                size = float(numel * FP32_BYTES)
            else:
                numel = self.tokens * module.tensor_width
                size = float(numel * self.a)
            payload = TensorComm(Comm(collective, numel, size, group=self.group), module.name)
            last = ctx.b.add(_KINDS[collective], Stream.COMPUTE, phase, micro, payload, [last])
        return last

    def before(self, ctx, module: Module, micro: int, phase: Phase, last: int | None) -> int | None:
        return self._add(ctx, module, micro, phase, self._plan(module, phase, True), last)

    def after(self, ctx, module: Module, micro: int, phase: Phase, op: int) -> int:
        return self._add(ctx, module, micro, phase, self._plan(module, phase, False), op)


def sequence_parallel_grads(ctx, deps) -> int | None:
    """finalize_model_grads' all-reduce of the stage's partly computed replicated gradients over
    the TP group: one coalesced call (_flatten_dense_tensors), in the width the gradients are
    reduced in, on the compute stream after the last backward and the data-parallel reduction;
    None without such parameters."""
    numel = sum(p.numel for p in ctx.wl.params if p.tensor_partial_grad and p.trainable)
    if ctx.sc.parallelism.tensor == 1 or not numel:
        return None
    payload = TensorComm(Comm(Collective.ALL_REDUCE, numel, float(numel * ctx.reduce_bytes),
                              group=tensor_parallel_group(ctx.sc.parallelism.tensor)), "tensor_partial_grads")
    return ctx.b.add(OpKind.TP_ALL_REDUCE, Stream.COMPUTE, Phase.BACKWARD, ctx.last_micro, payload, deps)
