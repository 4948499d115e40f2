"""The typed result of one simulated training step: what `summarize` returns and every reader
(table, JSON/CSV writers, plots, doctor, tune, compare, sweep) consumes.

Field names and order are the JSON schema of `zsim run --json`: `to_dict()` is the
serialisation, so a field added here appears in the JSON (and as a CSV column of a sweep) in
the position it is declared. Byte sizes are per GPU unless the name says per node.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping

# Result.host_time_s's key for ZeRO-3's host loops over ranks (see [Note: per-rank host loops]);
# its other keys are offload transfers and cpu_adam
ZERO3_RANK_LOOPS = "zero3_rank_loops"


def fits(gpu_fits: bool, host_fits: bool) -> bool:
    """The OOM rule every tool shares: a configuration fits when its peak fits in HBM and its
    host-side buffers fit in the node's memory (a CPU OOM kills the job too)."""
    return bool(gpu_fits and host_fits)


def fits_with_headroom(peak_bytes: float, capacity_bytes: float, host_fits: bool, headroom_fraction: float) -> bool:
    """`fits` with a safety margin (`--headroom 10%`): the peak must stay within (1 - headroom) of
    the HBM capacity, for what the simulation does not see (allocator behaviour of a particular
    torch version, kernels' workspaces, a longer sequence in the data). 0 is the plain rule."""
    return fits(peak_bytes <= capacity_bytes * (1.0 - headroom_fraction), host_fits)


def row_fits(row: Mapping) -> bool:
    """`fits` read back from a written row: a sweep row (a flattened Result, `memory.fits` and
    `memory.host.fits` columns) or a compare row (its `fits` column is already the rule)."""
    return fits(row.get("memory.fits", row.get("fits")), row.get("memory.host.fits", True))


@dataclass(frozen=True)
class HostMemory:
    """Host (CPU) memory per node: the offloaded states and pinned buffers of its ranks."""
    bytes_per_node: float
    load_bytes_per_node: float      # while loading the model (every rank materialises it without zero.Init)
    capacity_bytes: float
    fits: bool
    breakdown: dict[str, float]


@dataclass(frozen=True)
class Memory:
    """GPU memory per rank at the step's peak (`fits` is the HBM verdict alone; Result.fits adds the host)."""
    peak_bytes: float
    capacity_bytes: float
    fits: bool
    headroom_bytes: float
    peak_time_s: float
    breakdown: dict[str, float]     # category -> bytes at the peak instant, CUDA reserve included
    host: HostMemory


@dataclass(frozen=True)
class Comm:
    """Collectives of one rank in one step, per collective kind."""
    bytes_per_gpu: dict[str, float]     # bytes sent (bus bytes)
    calls: dict[str, int]
    time_s: dict[str, float]            # busy time on the comm streams
    exposed_time_s: float               # comm time not hidden under compute
    # "<algorithm>/<protocol>" -> calls: NCCL's tuner choice per call (zsim.hardware.nccl), or the
    # tier model's algorithm ("ring", "hierarchical", "tree") where it prices the collective
    algorithms: dict[str, dict[str, int]] = field(default_factory=dict)
    achieved_busbw_Bps: dict[str, float] = field(default_factory=dict)  # bytes sent / busy time
    link_busbw_Bps: float = 0.0         # the links' peak bus bandwidth (NVLink, or min(NVLink, NICs) across nodes)
    # per collective kind, the peak of the tier(s) its process group crosses (NVLink for a group
    # inside a node, e.g. tensor parallel; one rail for a send across nodes): the table's "of"
    # figure. Left out of the JSON, whose comm block keeps its one link_busbw_Bps
    tier_busbw_Bps: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes_per_gpu(self) -> float:
        return sum(self.bytes_per_gpu.values())


@dataclass(frozen=True)
class MoE:
    """A Mixture-of-Experts model's sizes: `Result.n_params` is what one rank holds (the dense
    params and its experts / ep_size local experts); the model's total and the params one token
    uses (top_k of the routed experts) are here."""
    experts: int
    top_k: int
    expert_parallel_size: int
    total_params: int
    active_params: int
    rank_expert_params: int             # this rank's local experts' params (Result.n_params includes them)


@dataclass(frozen=True)
class Pipeline:
    """A pipeline-parallel run (DeepSpeed PipelineEngine): per-stage figures. The worst stage's
    peak is Result.memory (it decides the verdict); comm and compute figures of the Result are
    the average over the stages' ranks."""
    stages: int
    data_parallel: int
    partition_method: str
    layers: list[list[int]]             # per stage: [first, end) transformer layers
    peak_bytes: list[float]             # per stage, CUDA reserve included
    worst_stage: int
    bubble_fraction: float              # share of the stages' time their rank does nothing (1F1B bubble)
    # Megatron's interleaved 1F1B only (absent from the JSON of DeepSpeed's 1F1B): the schedule and
    # the model chunks per rank; `layers` is then per virtual stage (chunk j of stage i: j * stages + i)
    schedule: str | None = None
    virtual_stages: int | None = None


@dataclass(frozen=True)
class TensorParallel:
    """A tensor-parallel run (Megatron-LM): the layout tp x dp x pp and where every rank sits
    (zsim.hardware.placement: rank = (stage * dp + dp_rank) * tp + tp_rank). Result.n_params and
    the memory figures are one rank's: its 1/tp slice of the split layers; `model_params` is the
    whole model's count."""
    tensor: int
    sequence_parallel: bool
    data_parallel: int
    pipeline: int
    rank_map: list[dict]                # per global rank: rank, node, stage, dp_rank, tp_rank
    model_params: int = 0               # the model's parameters, all tensor-parallel slices together


@dataclass(frozen=True)
class Result:
    scenario: str
    stage: int
    world_size: int
    nodes: int
    gpus_per_node: int
    hardware_profile: str
    precision: str
    n_params: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    global_batch_size: int
    seq_len: int
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    compute_time_s: float
    model_flops_per_gpu: float
    memory: Memory
    comm: Comm
    host_time_s: dict[str, float]       # offload busy time per transfer kind / cpu_adam; ZERO3_RANK_LOOPS
    events: int                         # ops simulated
    warnings: tuple[str, ...]
    implementation: str                 # Scenario.implementation: attention, elementwise kernels, MoE experts
    # params with requires_grad (LoRA adapters, what training.frozen leaves); None when all are
    # trained, and then left out of the JSON
    trainable_params: int | None = None
    # a preference run's reference model, when it is a copy of its own (see [Note: preference
    # training]): its params, besides n_params; None otherwise, and then left out of the JSON
    reference_params: int | None = None
    moe: MoE | None = None              # MoE models only (absent from the JSON of dense ones)
    pipeline: Pipeline | None = None    # only for a pipeline-parallel run (and only then in the JSON)
    tensor_parallel: TensorParallel | None = None   # only for a tensor-parallel run (likewise)

    @property
    def fits(self) -> bool:
        return fits(self.memory.fits, self.memory.host.fits)

    def fits_with(self, headroom_fraction: float) -> bool:
        return fits_with_headroom(self.memory.peak_bytes, self.memory.capacity_bytes, self.memory.host.fits,
                                  headroom_fraction)

    def to_dict(self) -> dict:
        """The JSON/CSV shape: nested mappings in declaration order, warnings as a list."""
        out = asdict(self)
        out["warnings"] = list(self.warnings)
        if self.trainable_params is None:
            del out["trainable_params"]
        if self.reference_params is None:
            del out["reference_params"]
        if self.moe is None:
            del out["moe"]
        if self.pipeline is None:
            del out["pipeline"]
        elif self.pipeline.virtual_stages is None:
            del out["pipeline"]["schedule"], out["pipeline"]["virtual_stages"]
        if self.tensor_parallel is None:
            del out["tensor_parallel"]
        del out["comm"]["tier_busbw_Bps"]
        return out
