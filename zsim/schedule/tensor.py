"""Megatron-LM tensor parallelism in the schedule: the collectives of the activations over the
tensor-parallel group (megatron/core/tensor_parallel/mappings.py, layers.py, cross_entropy.py).

Each simulated rank is one rank of its tensor-parallel group; the group runs in lockstep, so
its collectives are blocking calls on the compute stream (mappings.py's autograd functions wait
for them), except the column-parallel linear's backward ones, which overlap its GEMMs: see
[Note: tensor-parallel backward overlap]. Where a module meets them is its TensorRole
(zsim/workload/module.py):

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

[Note: tensor-parallel backward overlap] Megatron's column-parallel linear runs its backward
in LinearWithGradAccumulationAndAsyncCommunication.backward (megatron/core/tensor_parallel/
layers.py; CUDA_DEVICE_MAX_CONNECTIONS=1 keeps the launch order on the GPU), which issues the
ENTER collectives with async_op=True around its two GEMMs:
  with sequence parallelism: the all-gather of the saved input shard (for the wgrad), then the
      dgrad GEMM (grad_output . weight) while it runs; handle.wait(); the reduce-scatter of the
      input gradient, then the wgrad GEMM (grad_output^T . total_input, and the bias gradient)
      while it runs; handle.wait() before returning the gradient shard.
  without: the dgrad GEMM, the all-reduce of the input gradient (allreduce_dgrad, the
      ColumnParallelLinear then skips copy_to_tensor_model_parallel_region), the wgrad GEMM
      while it runs; handle.wait().
So the schedule splits such a module's backward into a dgrad and a wgrad op on the compute
stream and puts the collectives on the tensor-parallel group's own stream (Stream.TENSOR): the
all-gather waits for what precedes the module (the NCCL stream waits on the compute stream when
the call is issued), the dgrad does not wait for it; the reduce-scatter / all-reduce waits for
the dgrad and the all-gather, the wgrad too (its input is the gathered one); the next module
waits for the collective (its input gradient) and, the compute stream being in order, the
wgrad. The calls, their order and bytes are the blocking schedule's. A linear without a weight
gradient (LinearWithFrozenWeight: "async and sync are effectively the same") or without an
input gradient has nothing to overlap and keeps the blocking calls.
"""
from __future__ import annotations

from dataclasses import replace

from zsim.schedule.ir import Alloc, Collective, Group, OpKind, Phase, ProcessGroup, Stream, Tag
from zsim.schedule.payloads import Comm, ComputeWork, ModulePass, TensorComm
from zsim.workload.module import Module, TensorRole, Workload

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
    """The tensor-parallel collectives the passes add around the modules (zsim/schedule/passes.py)
    of the workload `wl` (one rank's shard) under `parallelism`."""

    def __init__(self, parallelism, wl: Workload, precision: str):
        self.active = parallelism.tensor > 1
        self.sp = parallelism.sequence_parallel
        self.group = tensor_parallel_group(parallelism.tensor)
        self.a = wl.act_dtype_bytes
        self.precision = precision     # the activations' dtype, which their all-reduces sum in
        self.tokens = wl.tokens
        self._payloads: dict[tuple, TensorComm] = {}

    def blocking(self, module: Module, phase: Phase) -> tuple[Comm, ...]:
        """The calls `module`'s pass in `phase` (FORWARD and RECOMPUTE alike) makes on the
        compute stream, before and after it (`before`/`after`): the ones it waits for."""
        return tuple(self._payload(module, c).comm for before in (True, False) for c in self._plan(module, phase, before))

    def overlaps_backward(self, module: Module) -> bool:
        """Whether `module`'s backward runs its collectives asynchronously beside its GEMMs (see
        [Note: tensor-parallel backward overlap]): a column-parallel linear with both GEMMs."""
        return (self.active and module.tensor_role == TensorRole.ENTER and module.gemm is not None
                and module.input_grad and module.weight_grad)

    def _plan(self, module: Module, phase: Phase, before: bool) -> tuple[Collective, ...]:
        if not self.active or module.tensor_role is None:
            return ()
        if phase == Phase.BACKWARD and self.overlaps_backward(module):
            return ()   # backward_overlapped issues them
        return _PLAN.get((self.sp, module.tensor_role, phase != Phase.BACKWARD, before), ())

    def _payload(self, module: Module, collective: Collective) -> TensorComm:
        """The same payload every micro-step, made once (like a module's pass, passes.py)."""
        key = (module.name, collective)
        payload = self._payloads.get(key)
        if payload is None:
            payload = self._payloads[key] = self._make_payload(module, collective)
        return payload

    def _make_payload(self, module: Module, collective: Collective) -> TensorComm:
        if module.tensor_role == TensorRole.VOCAB_LOSS:
            numel, dtype = self.tokens, "fp32"
            size = float(numel * FP32_BYTES)
        else:
            numel, dtype = self.tokens * module.tensor_width, self.precision
            size = float(numel * self.a)
        return TensorComm(Comm(collective, numel, size, group=self.group, dtype=dtype), module.name)

    def _add(self, ctx, module: Module, micro: int, phase: Phase, collectives, last):
        for collective in collectives:
            payload = self._payload(module, collective)
            last = ctx.b.add(_KINDS[collective], Stream.COMPUTE, phase, micro, payload, [last])
        return last

    def backward_overlapped(self, ctx, module: Module, micro: int, deps, work: ComputeWork,
                            allocs: tuple[Alloc, ...], workspace: tuple[Tag, ...], frees) -> tuple[int, int]:
        """`module`'s backward as Megatron's column-parallel linear runs it
        (see [Note: tensor-parallel backward overlap]): `work` (its dgrad and wgrad GEMMs) split
        in two ops, the collectives on Stream.TENSOR. `allocs` (the input gradient, `workspace`)
        start with the dgrad and end with the collective that reduces it; `frees` (the saved
        input) end with the wgrad. Returns (the wgrad op: the module's gradients are ready, the
        op the next module waits for: its input gradient's collective)."""
        dgrad, wgrad = self._split(ctx, module, work)
        b, phase = ctx.b, Phase.BACKWARD
        gather = None
        if self.sp:   # the saved input shard re-gathered for the wgrad, beside the dgrad
            gather = b.add(OpKind.TP_ALL_GATHER, Stream.TENSOR, phase, micro, self._payload(module, AG), deps)
        dgrad_op = b.add(OpKind.BACKWARD, Stream.COMPUTE, phase, micro, dgrad, deps, allocs)
        reduce = RS if self.sp else AR
        comm = b.add(_KINDS[reduce], Stream.TENSOR, phase, micro, self._payload(module, reduce), [dgrad_op, gather])
        wgrad_op = b.add(OpKind.BACKWARD, Stream.COMPUTE, phase, micro, wgrad, [dgrad_op, gather])
        b.add_free(wgrad_op, *frees)
        b.add_free(comm, *workspace)
        return wgrad_op, comm

    @staticmethod
    def _split(ctx, module: Module, work: ComputeWork) -> tuple[ModulePass, ModulePass]:
        """The dgrad's and the wgrad's payloads, made once per step (ctx.passes) like a module's
        whole pass (passes.py): the bias gradient (grad_output.sum), any memory-bound pass and
        the add into an accumulated .grad (the weight gradient's) run with the wgrad."""
        key = (id(module), "split", id(work))
        split = ctx.passes.get(key)
        if split is None:
            dgrad_gemm, wgrad_gemm = work.gemms
            half = work.model_flops / 2
            dgrad = replace(work, gemms=(dgrad_gemm,), mem_bytes=0.0, fp32_mem_bytes=0.0, accumulate_bytes=0.0,
                            kernels=1, model_flops=half)
            wgrad = replace(work, gemms=(wgrad_gemm,), kernels=work.kernels - 1, model_flops=half)
            split = ctx.passes[key] = (work, ModulePass(module.name, dgrad, part="dgrad"),
                                       ModulePass(module.name, wgrad, part="wgrad"))
        return split[1], split[2]

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
                              group=tensor_parallel_group(ctx.sc.parallelism.tensor), dtype=ctx.reduce_dtype),
                         "tensor_partial_grads")
    return ctx.b.add(OpKind.TP_ALL_REDUCE, Stream.COMPUTE, Phase.BACKWARD, ctx.last_micro, payload, deps)
