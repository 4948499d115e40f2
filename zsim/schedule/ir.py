"""The schedule IR: a training step as typed data.

An op runs on one stream (streams are FIFO, like CUDA streams) once every op in `deps` has
finished (like waiting on a CUDA event). Its `kind` says what it does and its `payload` carries
the facts of it (module, parameter ids, bucket and call, bytes, FLOPs): the engine prices the
payload, the training core (calibration/core) executes the kind, the writers display a label
derived from both. Nothing reads a label back.

Memory effects are structured too: an op allocates `alloc` when it starts and frees the tags in
`free` when it ends; a `Tag` names the buffer kind and the ids it belongs to.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum


class Stream(StrEnum):
    COMPUTE = "compute"
    ALLGATHER = "allgather"
    REDUCE = "reduce"
    H2D = "h2d"
    D2H = "d2h"
    CPU = "cpu"
    NVME = "nvme"


STREAMS = tuple(Stream)


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"      # a checkpointed block's forward, re-run in backward
    STEP = "step"


# the pass an op's phase counts in when a real step is measured: recompute runs inside backward
MEASURED_PASS = {Phase.FORWARD: "forward", Phase.RECOMPUTE: "backward", Phase.BACKWARD: "backward", Phase.STEP: "step"}


class Collective(StrEnum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    REDUCE = "reduce"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"


class Group(StrEnum):
    """The process groups a collective runs over (DeepSpeed's deepspeed/utils/groups.py and the
    PipelineModule's PipelineParallelGrid, runtime/pipe/topology.py)."""
    DATA = "data"                    # the data-parallel group of the op's pipeline stage
    EXPERT = "expert"                # ranks splitting one MoE layer's experts (all-to-all)
    EXPERT_DATA = "expert_data"      # ranks holding the same experts (their gradients)
    TIED = "tied"        # a tied weight's group: the same data-parallel rank of the first and last stage
    PIPE = "pipe"        # every stage's rank of one data-parallel index (PipelineParallelGrid's model-parallel group)


# groups inside one pipeline stage's data-parallel group: their ranks start at the stage's first rank
STAGE_GROUPS = frozenset({Group.DATA, Group.EXPERT, Group.EXPERT_DATA})


@dataclass(frozen=True, slots=True)
class ProcessGroup:
    """A process group as its ranks are placed: `size` ranks, `stride` apart, from the first rank of
    the op's stage (STAGE_GROUPS) or of the world (TIED, PIPE: data-parallel index 0). The
    expert-parallel group is consecutive, the expert-data-parallel group strided by ep_size
    (groups.py _create_expert_and_data_parallel); the pipe group strided by the data-parallel size
    (PipeDataParallelTopology: rank = stage * dp + dp_rank). zsim.hardware.placement places it."""
    kind: Group
    size: int
    stride: int = 1


class Transfer(StrEnum):
    H2D = "h2d"
    D2H = "d2h"
    NVME_READ = "nvme_read"
    NVME_WRITE = "nvme_write"


class OpKind(Enum):
    # device compute (payload ModulePass)
    FORWARD = "forward"                      # a module's forward (phase forward or recompute)
    BACKWARD = "backward"                    # a module's backward; its grad hooks bucket `bucketed`
    # device compute of the step (payload StepCompute)
    GRAD_NORM = "grad norm"                  # local overflow check and norm passes
    OPTIMIZER_STEP = "optimizer step"        # fused Adam over the local shard
    STEP_DONE = "step done"                  # the offloaded step's join point (no work)
    # collectives (payload ParamGather / GradReduce / ScalarAllReduce)
    PARAM_GATHER = "param gather"            # ZeRO-3 fetch of partitioned params (own or prefetch)
    PERSISTENT_GATHER = "persistent gather"  # ZeRO-3 post-step gather of one persistent param
    UPDATED_GATHER = "updated gather"        # ZeRO-1/2 post-step all-gather of the flat 16-bit group
    BUCKET_REDUCE = "bucket reduce"          # one call of an IPG bucket's gradient reduction
    GRAD_ALLREDUCE = "grad allreduce"        # ZeRO-0 / BF16_Optimizer boundary all-reduce chunk
    OVERFLOW_ALLREDUCE = "overflow allreduce"
    NORM_ALLREDUCE = "norm allreduce"
    CAPACITY_ALLREDUCE = "capacity allreduce"  # DeepSpeed-MoE gate without drop_tokens: max expert load
    EXPERT_ALL_TO_ALL = "expert all-to-all"  # DeepSpeed-MoE token dispatch / combine (payload TokenExchange)
    # host traffic (payload Copy / CpuAdam)
    CHECKPOINT_COPY = "checkpoint copy"      # cpu_checkpointing block input, out (D2H) or back (H2D)
    PARAM_FETCH = "param fetch"              # offload_param: partition from host/NVMe before its gather
    GRAD_COPY = "grad copy"                  # offload_optimizer: reduced gradient slice to/from host
    PARAM_UPLOAD = "param upload"            # offload_optimizer: updated 16-bit params back to the GPU
    OPTIMIZER_SWAP = "optimizer swap"        # NVMe optimizer-state read or write of one sub-group
    CPU_ADAM = "cpu adam"                    # DeepSpeedCPUAdam over one sub-group
    # pipeline point-to-point (payload PipeTransfer; runtime/pipe/p2p.py send / recv)
    SEND_ACTIVATION = "send activation"      # the stage's output to the next stage (does the transfer)
    RECV_ACTIVATION = "recv activation"      # waits for the previous stage's send (no work of its own)
    SEND_GRAD = "send grad"                  # the input's gradient to the previous stage
    RECV_GRAD = "recv grad"
    # pipe/engine.py _exec_reduce_tied_grads: all-reduce of a tied weight's gradient (payload GradReduce)
    TIED_ALLREDUCE = "tied allreduce"
    # pipe/engine.py _aggregate_total_loss, after the step (payload ScalarAllReduce): the last
    # stage all-reduces the loss over its data-parallel group, then broadcasts it to every stage
    LOSS_ALLREDUCE = "loss allreduce"
    LOSS_BROADCAST = "loss broadcast"


# -- payloads ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ComputeWork:
    """What the cost model prices on the compute stream."""
    gemms: tuple[tuple[float, float, float], ...] = ()   # (m, n, k) each
    attention_flops: float = 0.0
    attention_backward: bool = False
    mem_bytes: float = 0.0          # memory-bound kernel traffic
    optimizer_bytes: float = 0.0    # optimizer-step traffic (fp32 master, moments, grad conversion)
    kernels: int = 0
    model_flops: float = 0.0        # MFU convention (full attention); recompute included


@dataclass(frozen=True, slots=True)
class ModulePass:
    module: str
    work: ComputeWork
    bucketed: tuple[int, ...] = ()  # params whose gradients enter the IPG bucket after it, in hook order


@dataclass(frozen=True, slots=True)
class StepCompute:
    work: ComputeWork
    shard_params: float = 0.0       # parameters of the local partition it streams
    sub_group: int = 0              # OPTIMIZER_STEP: the ZeRO-3 optimizer sub-group it updates


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class ParamGather:
    comm: Comm
    pids: tuple[int, ...] = ()      # params gathered (UPDATED_GATHER: the whole flat group, empty)
    visit: str = ""                 # module whose hook issued it (PERSISTENT_GATHER: the param's name)
    prefetch: bool = False


@dataclass(frozen=True, slots=True)
class GradReduce:
    comm: Comm
    bucket: int = -1                # IPG bucket id (GRAD_ALLREDUCE: -1)
    call: int = 0                   # index of this call within its bucket (GRAD_ALLREDUCE: the chunk)
    pids: tuple[int, ...] = ()      # the bucket's params, in bucket order
    dst: int = -1                   # destination rank of a `reduce` call
    offset: int = 0                 # GRAD_ALLREDUCE: first element of the chunk in the flat gradients
    flat_group: int = 0             # ZeRO-1/2: the flat parameter group whose slices it reduces (see [Note: MoE parameter groups])


@dataclass(frozen=True, slots=True)
class ScalarAllReduce:
    """A few-element collective (a flag, a norm, the loss): an all-reduce, or LOSS_BROADCAST's broadcast."""
    comm: Comm


@dataclass(frozen=True, slots=True)
class TokenExchange:
    """One MoE layer's all-to-all over the expert-parallel group (sharded_moe.py _AllToAll): the
    capacity buffer [experts, capacity, hidden] out to the experts' ranks (dispatch) or back
    (combine). In backward each runs again on the gradients, in the mirrored order."""
    comm: Comm
    layer: int
    combine: bool = False


@dataclass(frozen=True, slots=True)
class Copy:
    transfer: Transfer
    size_bytes: float
    pinned: bool | None = None      # host buffer pinned? None: the schedule's pin_memory setting
    what: str = ""                  # display: the buffer ("fp32 grads", "checkpoint layer 3", ...)


@dataclass(frozen=True, slots=True)
class CpuAdam:
    params: float
    group: int


@dataclass(frozen=True, slots=True)
class PipeTransfer:
    """One micro-batch's activation (or its gradient) between adjacent pipeline stages: a
    point-to-point send over the link between the two stages' ranks of the same data-parallel index."""
    size_bytes: float
    src_stage: int
    dst_stage: int


Payload = (ModulePass | StepCompute | ParamGather | GradReduce | ScalarAllReduce | TokenExchange | Copy | CpuAdam
           | PipeTransfer)


# -- memory -----------------------------------------------------------------------------------

class Buffer(Enum):
    STATE = "state"                  # static model state of one category
    ACTIVATION = "act"               # saved for backward
    WORKSPACE = "ws"                 # alive during one module's pass
    CHECKPOINT = "ckpt"              # a checkpointed block's input
    BLOCK_TEMP = "tmp"               # activations inside a checkpointed block while it runs
    GATHERED = "gathered"            # a ZeRO-3 param gathered on this rank
    GATHER_FLAT = "agflat"           # a coalesced all-gather's flat output buffer (key: the gather op)
    GRAD16 = "grad16"                # a ZeRO-1 accumulated 16-bit .grad
    GRAD_PENDING = "grad"            # a ZeRO-2 .grad waiting for its bucket (contiguous_gradients false)
    GRAD_PARTITION = "grads"         # ZeRO-1/2 16-bit gradient partition (grads_in_partition)
    EXPERT_BUFFER = "moe"            # an MoE layer's capacity buffer around one all-to-all
    IPG = "ipg"                      # ZeRO-1/2 IPG bucket buffer of one backward
    SCATTER_COPY = "rs"              # reduce_scatter_coalesced's interleaved copy of a bucket
    OPT_FP32_GRADS = "opt/fp32_grads"
    OPT_FLAT16 = "opt/flat16_grads"
    PIPE_OUTPUT = "pipe/output"      # a stage's output, kept until its gradient comes back (pipe_buffers['outputs'])


@dataclass(frozen=True, slots=True)
class Tag:
    buffer: Buffer
    micro: int = -1
    key: int | str = ""             # param id, module name, layer, bucket, or the state's category
    phase: str = ""                 # WORKSPACE: the pass

    def __str__(self) -> str:
        parts = [self.buffer.value]
        if self.micro >= 0:
            parts.append(str(self.micro))
        if self.phase:
            parts.append(self.phase)
        if self.key != "":
            parts.append(str(self.key))
        return "/".join(parts)


class Category(StrEnum):
    """Memory breakdown categories (the keys of the result's breakdown)."""
    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER_STATES = "optimizer states"
    ACTIVATIONS = "activations"
    LOGITS = "logits/loss buffers"
    CHECKPOINTS = "activation checkpoints"
    ACTIVATION_GRADIENTS = "activation gradients"
    GATHERED = "gathered params"
    PERSISTENT = "persistent params"
    BUCKETS = "gradient buckets"
    OPTIMIZER_TEMPORARIES = "optimizer temporaries"


MODEL_STATES = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATES)


@dataclass(frozen=True, slots=True)
class Alloc:
    tag: Tag
    category: str                   # a Category on the GPU; host categories are display strings
    size_bytes: float


# -- ops and the schedule ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Op:
    id: int
    kind: OpKind
    stream: Stream
    phase: Phase
    micro_step: int
    payload: Payload
    deps: tuple[int, ...] = ()
    alloc: tuple[Alloc, ...] = ()
    free: tuple[Tag, ...] = ()
    hook_visits: int = 0            # ZeRO-3 module visits whose hooks run on the host before it
    grad_hooks: int = 0             # ZeRO-0/1/2 params whose gradients DeepSpeed handles after it
    stage: int = 0                  # the pipeline stage whose representative rank runs it
    free_before: tuple[Tag, ...] = ()   # freed when the op starts, before its allocations (a hook's wait)

    @property
    def comm(self) -> Comm | None:
        return getattr(self.payload, "comm", None)

    @property
    def work(self) -> ComputeWork | None:
        return getattr(self.payload, "work", None)

    @property
    def name(self) -> str:
        """Display label, derived from kind and payload (never parsed)."""
        return label(self)


def label(op: Op) -> str:
    p, k = op.payload, op.kind
    if k in (OpKind.FORWARD, OpKind.BACKWARD):
        return f"{op.phase} {p.module}"
    if k == OpKind.PARAM_GATHER:
        return f"all-gather prefetch from {p.visit}" if p.prefetch else f"all-gather {p.visit}"
    if k == OpKind.PERSISTENT_GATHER:
        return f"all-gather persistent {p.visit}"
    if k == OpKind.BUCKET_REDUCE:
        name = f"{p.comm.collective.replace('_', '-')} bucket {p.bucket}"
        return f"{name} -> rank {p.dst}" if p.comm.collective == Collective.REDUCE else name
    if k == OpKind.GRAD_ALLREDUCE:
        return f"allreduce gradients {p.call}"
    if k == OpKind.EXPERT_ALL_TO_ALL:
        return f"all-to-all {'combine' if p.combine else 'dispatch'} layer {p.layer}"
    if k in (OpKind.CHECKPOINT_COPY, OpKind.PARAM_FETCH, OpKind.GRAD_COPY, OpKind.PARAM_UPLOAD,
             OpKind.OPTIMIZER_SWAP):
        return f"{_TRANSFER_LABELS[p.transfer]} {p.what}"
    if k == OpKind.CPU_ADAM:
        return f"CPU Adam group {p.group}"
    if k in (OpKind.SEND_ACTIVATION, OpKind.SEND_GRAD):
        return f"{k.value} {op.micro_step} -> stage {p.dst_stage}"
    if k in (OpKind.RECV_ACTIVATION, OpKind.RECV_GRAD):
        return f"{k.value} {op.micro_step} <- stage {p.src_stage}"
    return _FIXED_LABELS[k]


_TRANSFER_LABELS = {Transfer.H2D: "H2D", Transfer.D2H: "D2H", Transfer.NVME_READ: "NVMe read",
                    Transfer.NVME_WRITE: "NVMe write"}

_FIXED_LABELS = {
    OpKind.GRAD_NORM: "grad norm (local)",
    OpKind.OPTIMIZER_STEP: "optimizer step (Adam)",
    OpKind.STEP_DONE: "optimizer step done",
    OpKind.UPDATED_GATHER: "all-gather updated params",
    OpKind.OVERFLOW_ALLREDUCE: "overflow check",
    OpKind.NORM_ALLREDUCE: "grad norm all-reduce",
    OpKind.CAPACITY_ALLREDUCE: "MoE capacity all-reduce",
    OpKind.TIED_ALLREDUCE: "all-reduce tied embedding grads",
    OpKind.LOSS_ALLREDUCE: "loss all-reduce",
    OpKind.LOSS_BROADCAST: "loss broadcast",
}


@dataclass(frozen=True, slots=True)
class HostSettings:
    """Host-side settings of the step the cost model needs (from the ds_config)."""
    pin_memory: bool
    cpu_cores_fraction: float            # offload_optimizer.cpuadam_cores_perc
    aio_block_size: int                  # the ds_config's aio block
    aio_queue_depth: int
    aio_thread_count: int
    host_load_bytes_per_gpu: float       # while the model is built and loaded, before training


@dataclass(frozen=True)
class PipelineLayout:
    """A pipeline's stages (DeepSpeed PipelineEngine): each stage is simulated as one
    representative rank with its own streams and memory ledger."""
    stages: int
    data_parallel: int
    layers: tuple[tuple[int, int], ...]           # per stage: [first, end) transformer layer
    static: tuple[tuple[Alloc, ...], ...]         # per stage: its model states
    host_static: tuple[tuple[Alloc, ...], ...]    # per stage


@dataclass(frozen=True)
class Schedule:
    stage: int
    world_size: int
    ops: tuple[Op, ...]
    static: tuple[Alloc, ...]       # allocated for the whole step (model states, persistent buffers)
    host: HostSettings
    host_static: tuple[Alloc, ...] = ()  # host (CPU) memory per GPU: offloaded states, pinned buffers
    pipeline: PipelineLayout | None = None   # None: one stage (static, host_static are its rank's)

    @property
    def stages(self) -> int:
        return self.pipeline.stages if self.pipeline else 1

    def static_of(self, stage: int) -> tuple[Alloc, ...]:
        return self.pipeline.static[stage] if self.pipeline else self.static
