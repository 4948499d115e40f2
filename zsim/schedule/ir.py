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

from zsim.record import record
from enum import Enum, StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # payloads.py builds on this module's enums and groups
    from zsim.schedule.payloads import Comm, ComputeWork, Payload


class Stream(StrEnum):
    COMPUTE = "compute"
    ALLGATHER = "allgather"
    REDUCE = "reduce"
    H2D = "h2d"
    D2H = "d2h"
    CPU = "cpu"
    NVME = "nvme"
    # Megatron's batched point-to-point call (interleaved.py): NCCL runs a group's sends at once,
    # one on the compute stream, the other here
    P2P = "p2p"
    # the tensor-parallel group's NCCL stream: Megatron's asynchronous backward collectives
    # (see [Note: tensor-parallel backward overlap]); the blocking ones stay on the compute stream
    TENSOR = "tensor"
    # the hpZ group's NCCL stream: ZeRO++'s secondary-partition all-gathers (see [Note: hpZ
    # secondary partitions]), launched from the allgather stream and ordered with its gathers
    HPZ = "hpz"


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
    # Megatron-LM's tensor-model-parallel group (megatron/core/parallel_state.py): `tensor`
    # consecutive ranks inside a node, from the first rank of the op's stage and data-parallel index
    TENSOR = "tensor"
    # ZeRO++ hpZ's zero_param_process_group (utils/groups.py _create_zero_param_parallel_group):
    # consecutive blocks of zero_hpz_partition_size global ranks
    HPZ = "hpz"
    # ZeRO++ qgZ's all-to-all groups (utils/groups.py _get_local_all_to_all_group): local_i, the
    # GPUs of node i; global_j, the j-th GPU of every node (stride: the GPUs per node)
    QGZ_LOCAL = "qgz_local"
    QGZ_GLOBAL = "qgz_global"
    # DeepSpeed-Ulysses's sequence-parallel group (parallel_state_sp.py): `sequence` consecutive
    # global ranks (see [Note: DeepSpeed-Ulysses])
    SEQUENCE = "sequence"


# groups inside one pipeline stage's data-parallel group: their ranks start at the stage's first rank
STAGE_GROUPS = frozenset({Group.DATA, Group.EXPERT, Group.EXPERT_DATA})


@record
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
    DEQUANTIZE = "dequantize"                # ZeRO++ qwZ: a quantized gather's int8 flat back to 16 bits, at its wait
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
    # Megatron-LM tensor parallelism (payload TensorComm; megatron/core/tensor_parallel/mappings.py):
    # activations (or their gradients) over the tensor-parallel group, on the compute stream but
    # for the column-parallel backward's asynchronous ones (Stream.TENSOR)
    TP_ALL_REDUCE = "tp allreduce"           # _ReduceFromModelParallelRegion and its conjugate
    TP_REDUCE_SCATTER = "tp reduce-scatter"  # sequence parallel: _ReduceScatterToSequenceParallelRegion
    TP_ALL_GATHER = "tp all-gather"          # sequence parallel: _GatherFromSequenceParallelRegion
    # DeepSpeed-Ulysses (payload SequenceExchange; see [Note: DeepSpeed-Ulysses]) over the
    # sequence-parallel group, on the compute stream
    SEQUENCE_ALL_TO_ALL = "sp all-to-all"    # ulysses_sp.py _dim_zero_all_to_all: q, k, v or the context
    SEQUENCE_ALL_GATHER = "sp all-gather"    # UlyssesSPAttentionHF.forward: the position_ids


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
    GRAD_PENDING = "grad"            # a ZeRO-2/3 .grad waiting for its bucket (contiguous_gradients false)
    GRAD_FRESH = "grad/fresh"        # autograd's .grad until its hook copies it into the IPG buffer (contiguous_gradients)
    GRAD_KEPT = "grad/kept"          # a ZeRO-2 .grad of the rank's partition, held to the step (same)
    GRAD_ACCUM_COPY = "grad/acc"     # its fresh .grad beside the accumulator, from the second micro-step (same)
    COLLECTIVE_TEMP = "colltmp"      # the communication backend's own copy of a call's input (gloo)
    GRAD_PARTITION = "grads"         # ZeRO-1/2 16-bit gradient partition (grads_in_partition)
    EXPERT_BUFFER = "moe"            # an MoE layer's capacity buffer around one all-to-all
    SEQUENCE_BUFFER = "sp"           # a Ulysses all-to-all's output tensor during the call
    TILE = "tile"                    # a tiled MLP's one tile of activations, and x's gradient, in its backward
    IPG = "ipg"                      # ZeRO-1/2 IPG bucket buffer of one backward
    SCATTER_COPY = "rs"              # reduce_scatter_coalesced's interleaved copy of a bucket
    ALLREDUCE_FLAT = "arflat"        # allreduce_bucket's flat copy of the gradients it reduces (key: the call)
    OPT_FP32_GRADS = "opt/fp32_grads"
    OPT_FLAT16 = "opt/flat16_grads"
    OPT_UPDATE = "opt/update"         # the optimizer's own temporaries while it updates (see [Note: torch Adam step temporaries])
    PIPE_OUTPUT = "pipe/output"      # a stage's output, kept until its gradient comes back (pipe_buffers['outputs'])
    SECONDARY = "hpz/secondary"      # a param's hpZ secondary partition, from its release to the step
    KV_CACHE = "kv"                  # one attention layer's KV cache during generation (key: the layer)
    HIDDEN = "hidden"                # generation: a forward's hidden states between its modules


@record
class Tag:
    buffer: Buffer
    micro: int = -1
    key: int | str = ""             # param id, module name, layer, bucket, or the state's category
    phase: str = ""                 # WORKSPACE: the pass

    def __hash__(self) -> int:
        # the dataclass's own hash, in one call: an Enum member hashes as its name (the ledger
        # looks a tag up a few times per allocation)
        return hash((self.buffer._name_, self.micro, self.key, self.phase))

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
    SECONDARY = "hpZ secondary partitions"
    PERSISTENT = "persistent params"
    BUCKETS = "gradient buckets"
    OPTIMIZER_TEMPORARIES = "optimizer temporaries"
    KV_CACHE = "kv cache"
    INFERENCE_WORKSPACE = "inference workspace"   # DeepSpeed-Inference's kernels' activations and scores


MODEL_STATES = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATES)


@record
class Alloc:
    tag: Tag
    category: str                   # a Category on the GPU; host categories are display strings
    size_bytes: float
    # the bytes its writers touch while it lives, when fewer than size_bytes (see [Note: IPG
    # buffer first touch]); None: all of it. Costs only: the ledger holds size_bytes.
    touched_bytes: float | None = None

    @property
    def first_touch_bytes(self) -> float:
        return self.size_bytes if self.touched_bytes is None else self.touched_bytes


# -- ops and the schedule ---------------------------------------------------------------------

@record
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
    pipe_stage: int = 0             # the pipeline stage whose representative rank runs it
    free_before: tuple[Tag, ...] = ()   # freed when the op starts, before its allocations (a hook's wait)
    host_views: int = 0             # per-rank views ZeRO-3's host loops make before it, see [Note: per-rank host loops]

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
    """The op's display label, by its payload's type (and kind where one type serves several)."""
    from zsim.schedule.payloads import Copy, CpuAdam, GradReduce, ModulePass, ParamGather, PipeTransfer, \
        SequenceExchange, TensorComm, TokenExchange
    p, k = op.payload, op.kind
    if isinstance(p, ModulePass) and k in (OpKind.FORWARD, OpKind.BACKWARD):
        return f"{op.phase} {p.module}" + (f" ({p.part})" if p.part else "")
    if isinstance(p, ParamGather) and k == OpKind.PARAM_GATHER:
        return f"all-gather prefetch from {p.visit}" if p.prefetch else f"all-gather {p.visit}"
    if isinstance(p, ParamGather) and k == OpKind.PERSISTENT_GATHER:
        return f"all-gather persistent {p.visit}"
    if isinstance(p, GradReduce) and k == OpKind.BUCKET_REDUCE:
        name = f"{p.comm.collective.replace('_', '-')} bucket {p.bucket}"
        return f"{name} -> rank {p.dst}" if p.comm.collective == Collective.REDUCE else name
    if isinstance(p, GradReduce) and k == OpKind.GRAD_ALLREDUCE:
        return f"allreduce gradients {p.call}"
    if isinstance(p, TokenExchange):
        return f"all-to-all {'combine' if p.combine else 'dispatch'} layer {p.layer}"
    if isinstance(p, Copy):
        return f"{_TRANSFER_LABELS[p.transfer]} {p.what}"
    if isinstance(p, CpuAdam):
        return f"CPU Adam group {p.group}"
    if isinstance(p, PipeTransfer):
        send = k in (OpKind.SEND_ACTIVATION, OpKind.SEND_GRAD)
        chunk = "" if p.chunks is None else f" chunk {p.chunks[0 if send else 1]}"
        return f"{k.value} {op.micro_step}{chunk} {'->' if send else '<-'} stage {p.dst_stage if send else p.src_stage}"
    if isinstance(p, TensorComm):
        return f"{k.value} {p.module}"
    if isinstance(p, SequenceExchange):
        return f"{k.value} {p.tensor} layer {p.layer}"
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


@record
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
    layers: tuple[tuple[int, int], ...]           # per (virtual) stage, in model order: [first, end) layers
    static: tuple[tuple[Alloc, ...], ...]         # per stage: its model states
    host_static: tuple[tuple[Alloc, ...], ...]    # per stage
    virtual_stages: int = 1   # Megatron's interleaved 1F1B: chunk j of stage i is virtual stage j * stages + i


@dataclass(frozen=True)
class SkippedLayers:
    """Layers a pass did not build (see [Note: layers the builder skips]): `count` copies, each
    `length` ops over `layers` layers, of the `length` ops just before op `at` (the window),
    which stand in for them; the ops from `at` on come after the skipped ones. `settle`:
    periodic copies built before the window."""
    name: str
    region: tuple[int, str]     # (micro-step, "f" forward, "b" recompute and backward, "s" post-step gathers)
    at: int
    count: int
    length: int
    settle: int
    layers: int = 1             # layers per copy (a backward whose gradient bucket repeats every few layers)


@dataclass(frozen=True)
class Schedule:
    zero_stage: int
    world_size: int
    ops: tuple[Op, ...]
    static: tuple[Alloc, ...]       # allocated for the whole step (model states, persistent buffers)
    host: HostSettings
    host_static: tuple[Alloc, ...] = ()  # host (CPU) memory per GPU: offloaded states, pinned buffers
    pipeline: PipelineLayout | None = None   # None: one stage (static, host_static are its rank's)
    tensor: int = 1                 # tensor-parallel size: each simulated rank is one rank of a TP group
    tf32: bool = False              # fp32 matmuls on tensor cores (training.tf32): priced at the tf32 peak
    skipped: tuple[SkippedLayers, ...] = ()     # in `at` order; ops the full step has beyond `ops`

    @property
    def full_ops(self) -> int:
        """Ops of the full step: those built and those the skipped layers would have added."""
        return len(self.ops) + sum(k.count * k.length for k in self.skipped)

    @property
    def data_parallel(self) -> int:
        """world / (tensor x pipeline): Megatron's data-parallel size."""
        return self.world_size // (self.tensor * self.stages)

    @property
    def stages(self) -> int:
        return self.pipeline.stages if self.pipeline else 1

    def static_of(self, stage: int) -> tuple[Alloc, ...]:
        return self.pipeline.static[stage] if self.pipeline else self.static
