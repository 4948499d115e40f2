"""The schedule IR's payloads: the facts of one op (zsim/schedule/ir.py's Op.payload), frozen.

The engine prices a payload (zsim/hardware/cost_model.py), the training core executes the op's
kind with it, the writers label it; nothing reads a label back.
"""
from __future__ import annotations

from zsim.record import record

from zsim.schedule.ir import Collective, ProcessGroup, Transfer


@record
class ComputeWork:
    """What the cost model prices on the compute stream."""
    gemms: tuple[tuple[float, float, float], ...] = ()   # (m, n, k) each
    fp8_gemms: tuple[tuple[float, float, float], ...] = ()   # run in FP8 (see [Note: FP8 linears])
    attention_flops: float = 0.0
    attention_backward: bool = False
    mem_bytes: float = 0.0          # memory-bound kernel traffic
    fp32_mem_bytes: float = 0.0     # memory-bound traffic in fp32 whatever the precision (the loss after its upcast)
    optimizer_bytes: float = 0.0    # optimizer-step traffic (fp32 master, moments, grad conversion)
    accumulate_bytes: float = 0.0   # AccumulateGrad's adds into existing .grads (see [Note: gradient accumulation add])
    copy_bytes: float = 0.0         # plain copies (a KV cache concatenated: see [Note: generation]), at the device's copy rate
    kernels: int = 0
    model_flops: float = 0.0        # MFU convention (full attention); recompute included


@record
class ModulePass:
    module: str
    work: ComputeWork
    bucketed: tuple[int, ...] = ()  # params whose gradients enter the IPG bucket after it, in hook order
    # a part of the module's backward run as its own op: "dgrad" or "wgrad"
    # (see [Note: tensor-parallel backward overlap]); "" for the whole pass
    part: str = ""


@record
class StepCompute:
    work: ComputeWork
    shard_params: float = 0.0       # parameters of the local partition it streams
    sub_group: int = 0              # OPTIMIZER_STEP: the ZeRO-3 optimizer sub-group, or ZeRO-1/2 flat group, it updates


@record
class Comm:
    """One collective call, over the data-parallel group unless `group` names another."""
    collective: Collective
    numel: int
    size_bytes: float               # full buffer (nccl-tests convention)
    buffer_bytes: float = 0.0       # the call's own buffer passes (packing, pre-division) on its stream
    # launched async with its neighbours, then all waited; priced from the tier's
    # "<collective>_coalesced" table (see [Note: coalesced post-step gathers])
    coalesced: bool = False
    group: ProcessGroup | None = None   # None: the op's stage's whole data-parallel group
    # the element type a reducing collective sums in ("": a copy, or a scalar); a calibrated
    # tier prices 16-bit sums on their own tables (see [Note: 16-bit reductions on the host])
    dtype: str = ""


@record
class ParamGather:
    comm: Comm
    pids: tuple[int, ...] = ()      # params gathered (UPDATED_GATHER: the whole flat group, empty)
    visit: str = ""                 # module whose hook issued it (PERSISTENT_GATHER: the param's name)
    prefetch: bool = False


@record
class GradReduce:
    comm: Comm
    bucket: int = -1                # IPG bucket id (GRAD_ALLREDUCE: -1)
    call: int = 0                   # index of this call within its bucket (GRAD_ALLREDUCE: the chunk)
    pids: tuple[int, ...] = ()      # the bucket's params, in bucket order
    dst: int = -1                   # destination rank of a `reduce` call
    offset: int = 0                 # GRAD_ALLREDUCE: first element of the chunk in the flat gradients
    flat_group: int = 0             # ZeRO-1/2: the flat parameter group whose slices it reduces (see [Note: MoE parameter groups])


@record
class ScalarAllReduce:
    """A few-element collective (a flag, a norm, the loss): an all-reduce, or LOSS_BROADCAST's broadcast."""
    comm: Comm


@record
class TokenExchange:
    """One MoE layer's all-to-all over the expert-parallel group (sharded_moe.py _AllToAll): the
    capacity buffer [experts, capacity, hidden] out to the experts' ranks (dispatch) or back
    (combine). In backward each runs again on the gradients, in the mirrored order."""
    comm: Comm
    layer: int
    combine: bool = False


@record
class Copy:
    transfer: Transfer
    size_bytes: float
    pinned: bool | None = None      # host buffer pinned? None: the schedule's pin_memory setting
    what: str = ""                  # display: the buffer ("fp32 grads", "checkpoint layer 3", ...)


def payload_shape(payload):
    """What an op's cost depends on in its payload: its collective call, its compute work, a
    copy's transfer, size and pinning (not the buffer it names), or the payload itself. The key
    of CostModel.op_cost and of the engine's checks that two ops run alike."""
    shape = getattr(payload, "comm", None) or getattr(payload, "work", None)
    if shape is None:
        shape = (payload.transfer, payload.size_bytes, payload.pinned) if isinstance(payload, Copy) else payload
    return shape


@record
class CpuAdam:
    """DeepSpeed's CPU optimizer step over one group (DeepSpeedCPUAdam, or its Adagrad and Lion
    kernels, priced by their traffic relative to Adam's: see [Note: optimizer states by type])."""
    params: float
    group: int
    pass_bytes: float = 0.0     # host traffic of the step's other passes on this group (unscale/clip, 16-bit copy)
    update_bytes_per_param: float = 28.0   # the optimizer's own update traffic (Adam: 28)


@record
class PipeTransfer:
    """One micro-batch's activation (or its gradient) between adjacent pipeline stages: a
    point-to-point send over the link between the two stages' ranks of the same data-parallel index."""
    size_bytes: float
    src_stage: int
    dst_stage: int
    chunks: tuple[int, int] | None = None   # interleaved: the (sender's, receiver's) model chunk
    # DeepSpeed's PartitionedTensor meta (int64 shape and partition), sent before each part
    # (see [Note: partitioned pipeline sends])
    meta: bool = False


@record
class TensorComm:
    """One tensor-parallel collective of `module`'s activations or their gradients (Megatron-LM's
    mappings.py). `comm.size_bytes` is the whole activation tensor (micro-batch x sequence x
    width x dtype, nccl-tests' convention: the all-reduce's buffer, the reduce-scatter's input,
    the all-gather's output); `comm.group` the tensor-parallel group."""
    comm: Comm
    module: str

    @property
    def size_bytes(self) -> float:
        return self.comm.size_bytes


@record
class SequenceExchange:
    """One DeepSpeed-Ulysses call of attention layer `layer` over the sequence-parallel group: the
    all-to-all of `tensor` (q, k, v or context; in backward its gradient), or the all-gather of the
    position_ids; see [Note: DeepSpeed-Ulysses]."""
    comm: Comm
    layer: int
    tensor: str


Payload = (ModulePass | StepCompute | ParamGather | GradReduce | ScalarAllReduce | TokenExchange | Copy | CpuAdam
           | PipeTransfer | TensorComm | SequenceExchange)
