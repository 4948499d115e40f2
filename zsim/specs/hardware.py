"""Hardware profiles: frozen dataclasses with human units in the key names (the YAML files in
hardware_profiles/ are read by zsim.config.profile).

A profile describes one node type. `Cluster` adds the node count and converts to SI
units (bytes, seconds, FLOP/s) once, so no other module sees GiB or Gbps.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from zsim.errors import did_you_mean
from zsim.schema import spec
from zsim.specs.nccl import NcclProfile
from zsim.units import GB, GiB

# Size-dependent efficiency: list of (message_bytes, fraction of the tier's peak bus bandwidth).
EffTable = tuple[tuple[float, float], ...]


@dataclass(frozen=True, kw_only=True)
class GpuProfile:
    model: str
    peak_tflops_fp32: float = spec(gt=0)
    peak_tflops_tf32: float = spec(gt=0)
    peak_tflops_fp16: float = spec(gt=0)
    peak_tflops_bf16: float = spec(gt=0)
    peak_tflops_fp8: Optional[float] = spec(None, gt=0, doc="dense FP8 (E4M3/E5M2) tensor-core peak; unset: the GPU "
                                                             "has no FP8 GEMMs (A100, V100) and training.fp8 is refused")
    hbm_capacity_GiB: float = spec(gt=0)
    hbm_bw_GBps: float = spec(gt=0)
    cuda_context_GiB: float = spec(0.5, ge=0, doc="CUDA context + NCCL/cuBLAS workspaces")
    allocator_fragmentation_fraction: float = spec(0.02, ge=0, le=0.5,
                                                   doc="caching-allocator slack, as a fraction of capacity")
    gemm_max_efficiency: float = spec(0.7, gt=0, le=1, doc="large-GEMM fraction of dense peak")
    gemm_half_efficiency_dim: float = spec(64.0, ge=0, doc="a GEMM dim of this size halves efficiency")
    flash_attention_fwd_efficiency: float = spec(0.5, gt=0, le=1)
    flash_attention_bwd_efficiency: float = spec(0.4, gt=0, le=1)
    flash_attention_fwd_overhead_us: float = spec(0.0, ge=0, doc="fixed time per attention call beyond its "
                                                               "FLOPs (set-up, partial tiles at short sequences)")
    flash_attention_bwd_overhead_us: float = spec(0.0, ge=0)
    memory_bound_efficiency: float = spec(0.7, gt=0, le=1, doc="fraction of HBM bandwidth reached by elementwise kernels")
    optimizer_efficiency: Optional[float] = spec(None, gt=0, le=1,
                                                 doc="fraction of HBM bandwidth reached by the optimizer step's passes "
                                                     "(long fp32 streams); unset: memory_bound_efficiency")
    grad_accumulate_efficiency: Optional[float] = spec(None, gt=0, le=1,
                                                       doc="fraction of HBM bandwidth reached by autograd's in-place "
                                                           "add of a new gradient into an existing .grad "
                                                           "(AccumulateGrad); unset: memory_bound_efficiency")
    gemm_decode_efficiency: EffTable = spec((), doc="[[rows, fraction of hbm_bw_GBps], ...]: the rate a GEMM of few "
                                                    "rows (a decode step's) reads its operands at, measured "
                                                    "(calibration's gemm_decode records); empty: the GEMM law "
                                                    "(see [Note: few-row GEMMs])")
    kernel_overhead_us: float = spec(5.0, ge=0, doc="launch + framework time per kernel")
    step_kernel_overhead_us: Optional[float] = spec(
        None, ge=0, doc="host time per kernel of the optimizer step's per-gradient passes (DeepSpeed's "
                        "has_inf_or_nan and norms: a few small torch calls each); unset: kernel_overhead_us. "
                        "See [Note: launch-bound step passes]")
    fresh_alloc_threshold_bytes: Optional[float] = spec(None, gt=0,
                                                        doc="a tensor larger than this is mapped fresh from the OS "
                                                            "at every allocation (glibc's mmap threshold on a CPU "
                                                            "device); unset: a caching allocator, no such cost")
    fresh_alloc_GBps: Optional[float] = spec(None, gt=0, doc="first-touch (page-fault) rate of such a tensor")
    reduce_scatter_temp_fraction: float = spec(
        0.0, ge=0, le=4, doc="tensor memory a reduce_scatter_tensor call allocates while it runs, as a fraction of "
                             "its input (zsim calibrate measures it; NCCL: 0, gloo: 1)")   # see [Note: gloo reduce-scatter copy]
    concurrent_streams: bool = spec(True, doc="side streams run beside compute (CUDA); false: one stream in "
                                              "program order, as DeepSpeed's and torch's CPU backends run")
    datasheet_tflops: dict[str, float] = spec(
        factory=dict, doc="the vendor's dense peak per dtype (fp32, tf32, fp16, bf16), MFU's and HFU's denominator "
                          "where a calibrated profile's peak_tflops_* is its fitted GEMM law's asymptote instead; "
                          "a dtype not listed uses its peak_tflops_*")
    by_dtype: dict[str, DtypeCompute] = spec(   # type: ignore[valid-type]  # a make_dataclass class (below)
        factory=dict, doc="per training precision (fp32, fp16, bf16): compute figures that replace the fields "
                          "above for a run in that dtype (zsim calibrate --dtype fp32,bf16 writes them); a dtype "
                          "not listed, or a field not set, uses the fields above")

    def __post_init__(self):
        for dtype, value in self.datasheet_tflops.items():
            if dtype not in ("fp32", "tf32", "fp16", "bf16"):
                raise ValueError(f"datasheet_tflops.{dtype}", dtype, "use fp32, tf32, fp16 or bf16")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"datasheet_tflops.{dtype}", value, "give the dense peak in TFLOP/s (> 0)")
        if self.gemm_decode_efficiency:
            _check_table("gemm_decode_efficiency", self.gemm_decode_efficiency)
        for dtype, own in self.by_dtype.items():
            if own.gemm_decode_efficiency:
                _check_table(f"by_dtype.{dtype}.gemm_decode_efficiency", own.gemm_decode_efficiency)
            if dtype not in TRAINING_DTYPES:
                raise ValueError(f"by_dtype.{dtype}", dtype, f"not a training precision"
                                 f"{did_you_mean(dtype, TRAINING_DTYPES)}; use one of {', '.join(TRAINING_DTYPES)}")

    def for_dtype(self, dtype: str) -> GpuProfile:
        """The device as a run in `dtype` sees it: the by_dtype entry's fields over the top-level
        ones. A GEMM, attention or elementwise kernel in fp32 runs at other efficiencies than in
        bf16 (tensor cores, FlashAttention only in 16-bit; on a CPU without bf16 units bf16 is
        emulated). The cost model prices every op through this one view (CostModel.__init__)."""
        own = self.by_dtype.get(dtype)
        if own is None:
            return self
        return dataclasses.replace(self, **{k: v for k, v in dataclasses.asdict(own).items() if v is not None})


TRAINING_DTYPES = ("fp32", "fp16", "bf16")
# The compute figures that depend on the training precision. The peaks already do, one field per
# dtype; capacity, bandwidth, the allocator and the streams are the device's whatever it computes.
DTYPE_COMPUTE_FIELDS = ("gemm_max_efficiency", "gemm_half_efficiency_dim", "flash_attention_fwd_efficiency",
                        "flash_attention_bwd_efficiency", "flash_attention_fwd_overhead_us",
                        "flash_attention_bwd_overhead_us", "memory_bound_efficiency", "optimizer_efficiency",
                        "grad_accumulate_efficiency", "kernel_overhead_us", "step_kernel_overhead_us",
                        "gemm_decode_efficiency")


def _dtype_field(name: str) -> tuple:
    """A by_dtype field: optional, with the bounds of the GpuProfile field it replaces."""
    field = GpuProfile.__dataclass_fields__[name]
    meta = field.metadata
    kind = Optional[EffTable] if name == "gemm_decode_efficiency" else Optional[float]
    return name, kind, spec(None, ge=meta["ge"], gt=meta["gt"], le=meta["le"], doc=f"unset: the top-level {name}")


# one training precision's compute figures (GpuProfile.by_dtype), derived from GpuProfile's fields
# so the two keep the same names and bounds
DtypeCompute = dataclasses.make_dataclass("DtypeCompute", [_dtype_field(n) for n in DTYPE_COMPUTE_FIELDS],
                                          frozen=True, kw_only=True)
DtypeCompute.__module__ = __name__   # where pickle (dask sweeps) finds the class


# "<collective>_coalesced": calls launched async back to back, then all waited (calibrated
# profiles measure all_gather so, as DeepSpeed's _allgather_params_coalesced issues it)
# the collectives that sum, and the 16-bit dtypes a calibrated tier may give them their own
# table for (see [Note: 16-bit reductions on the host] in zsim/hardware/collectives.py)
REDUCING_COLLECTIVES = ("reduce_scatter", "all_reduce", "reduce")
REDUCED_16BIT = ("bf16", "fp16")
_COLLECTIVE_NAMES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all",
                     "all_gather_coalesced",
                     *(f"{k}_{d}" for k in REDUCING_COLLECTIVES for d in REDUCED_16BIT))


def _check_table(key: str, table: EffTable) -> None:
    """collectives.efficiency_at interpolates in log(size) between points sorted by size, and
    divides the tier's bandwidth by the fraction: a table must have a point, positive
    ascending sizes and fractions in (0, 1]."""
    sizes = [size for size, _ in table]
    if (not table or any(not 0 < eff <= 1 for _, eff in table) or any(size <= 0 for size in sizes)
            or sizes != sorted(set(sizes))):
        raise ValueError(key, [list(p) for p in table],
                         "give [[bytes, fraction], ...] with ascending sizes > 0 and fractions in (0, 1]")


def _check_collective_tables(tables: dict) -> None:
    for kind, table in tables.items():
        if kind not in _COLLECTIVE_NAMES:
            raise ValueError(f"efficiency_by_collective.{kind}", kind,
                             f"unknown collective{did_you_mean(kind, _COLLECTIVE_NAMES)}; use one of "
                             f"{', '.join(_COLLECTIVE_NAMES)}")
        _check_table(f"efficiency_by_collective.{kind}", table)


@dataclass(frozen=True, kw_only=True)
class _TierShape:
    """What every communication tier carries besides its bandwidth."""
    fabric: str
    latency_us: float = spec(ge=0, doc="alpha: per ring step")
    efficiency_by_size: EffTable = spec(((1.0, 1.0),))
    efficiency_by_collective: dict[str, EffTable] = spec(
        factory=dict, doc="per-collective tables that replace efficiency_by_size (calibrated profiles)")
    sync_overhead_us: float = spec(0.0, ge=0, doc="extra time per collective inside a step: ranks reach it at "
                                                  "different times and the early ones wait (zsim calibrate leaves it 0: "
                                                  "its collective tables are timed in-step and include the wait)")

    def __post_init__(self):
        _check_table("efficiency_by_size", self.efficiency_by_size)
        _check_collective_tables(self.efficiency_by_collective)


@dataclass(frozen=True, kw_only=True)
class LinkTierProfile(_TierShape):
    busbw_GBps: float = spec(gt=0, doc="peak nccl-tests bus bandwidth per GPU on this tier")


@dataclass(frozen=True, kw_only=True)
class InterNodeProfile(_TierShape):
    nics_per_node: int = spec(ge=1)
    nic_bw_Gbps: float = spec(gt=0)


@dataclass(frozen=True, kw_only=True)
class PcieProfile:
    generation: int = spec(ge=1)
    bw_GBps_per_gpu: float = spec(gt=0, doc="achieved H2D/D2H bandwidth of one GPU, pinned memory")
    gpus_per_switch: int = spec(1, ge=1)
    latency_us: float = spec(10.0, ge=0)
    pageable_fraction: float = spec(0.5, gt=0, le=1, doc="pageable-memory copies' share of the pinned bandwidth "
                                                          "(a staging copy through a pinned buffer); default: the CUDA "
                                                          "Best Practices Guide's rough half, `zsim calibrate` "
                                                          "measures it on a GPU")
    switch_uplink_GBps: Optional[float] = spec(None, gt=0, doc="switch-to-CPU link shared by the GPUs (and NVMe) "
                                                               "under one PCIe switch; none = each GPU has its own")
    nics_share_gpu_link: bool = spec(False, doc="NICs sit under the GPU's switch (GPUDirect RDMA): inter-node "
                                                "traffic and H2D/D2H share the GPU's PCIe link")


@dataclass(frozen=True, kw_only=True)
class NvmeProfile:
    drives_per_node: int = spec(ge=0)
    read_GBps_per_drive: float = spec(gt=0)
    write_GBps_per_drive: float = spec(gt=0)


@dataclass(frozen=True, kw_only=True)
class CpuProfile:
    model: str
    cores_per_node: int = spec(ge=1)
    memory_GiB: float = spec(gt=0)
    memory_bw_GBps: float = spec(gt=0)
    adam_params_per_s_per_core: float = spec(gt=0, doc="DeepSpeedCPUAdam (AVX) fp32 params/s per core")
    zero3_hook_fwd_us: float = spec(0.0, ge=0, doc="host time of DeepSpeed ZeRO-3's hooks per module visit in "
                                                   "forward (fetch/release bookkeeping) over plain torch; "
                                                   "0: not measured")
    zero3_hook_bwd_us: float = spec(0.0, ge=0, doc="the same per module visit in backward")
    zero0_grad_hook_us: float = spec(0.0, ge=0, doc="host time of DeepSpeed ZeRO-0's gradient handling per "
                                                    "parameter (the boundary all-reduce's per-tensor flatten and "
                                                    "copy-back) over plain torch; 0: not measured")
    zero1_grad_hook_us: float = spec(0.0, ge=0, doc="the same for ZeRO-1 (per-parameter bucketing at the boundary)")
    zero2_grad_hook_us: float = spec(0.0, ge=0, doc="the same for ZeRO-2 (per-parameter gradient hooks)")
    zero3_rank_view_us: float = spec(0.0, ge=0, doc="host time per per-rank tensor view DeepSpeed ZeRO-3's Python "
                                                    "loops make and consume (reduce_scatter_coalesced, a coalesced "
                                                    "all-gather's launch and wait): a call costs world size x "
                                                    "tensors of them (see [Note: per-rank host loops]); 0: not measured")

    def grad_hook_us(self, stage: int) -> float:
        return (self.zero0_grad_hook_us, self.zero1_grad_hook_us, self.zero2_grad_hook_us)[stage] if stage < 3 else 0.0


@dataclass(frozen=True, kw_only=True)
class InterferenceProfile:
    compute_slowdown_during_comm: float = spec(0.0, ge=0, le=1,
                                               doc="fractional compute slowdown while a collective runs")


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    name: str
    description: str = spec("")
    gpus_per_node: int = spec(ge=1)
    gpu: GpuProfile = spec()
    intra_node: LinkTierProfile = spec()
    inter_node: InterNodeProfile = spec()
    pcie: PcieProfile = spec()
    nvme: NvmeProfile = spec()
    cpu: CpuProfile = spec()
    interference: InterferenceProfile = spec(factory=InterferenceProfile)
    nccl: Optional[NcclProfile] = spec(None, doc="NCCL's view of the node (and the job's NCCL_* settings): "
                                                 "collectives are priced by NCCL's tuner model, not the tiers' "
                                                 "latency_us/efficiency tables; unset or calibrated tables: "
                                                 "the tier model")
    provenance: dict[str, str] = spec(factory=dict, doc="where the numbers came from (calibration run, datasheet)")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A profile instantiated for a job: node count and SI units."""
    profile: HardwareProfile
    nodes: int
    gpus_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def peak_flops(self, dtype: str) -> float:
        """The GEMM law's peak a run in `dtype` ("tf32": fp32 matmuls on tensor cores) is priced at."""
        return getattr(self.profile.gpu, f"peak_tflops_{dtype}") * 1e12

    def fp8_peak_flops(self) -> float:
        """The FP8 GEMMs' peak (see [Note: FP8 linears]); 0 where the GPU has none."""
        return (self.profile.gpu.peak_tflops_fp8 or 0.0) * 1e12

    def datasheet_flops(self, dtype: str) -> float:
        """MFU's denominator: the vendor's dense peak where the profile gives it."""
        gpu = self.profile.gpu
        return gpu.datasheet_tflops.get(dtype, getattr(gpu, f"peak_tflops_{dtype}")) * 1e12

    @property
    def hbm_capacity_bytes(self) -> float:
        return self.profile.gpu.hbm_capacity_GiB * GiB

    @property
    def hbm_bw_Bps(self) -> float:
        return self.profile.gpu.hbm_bw_GBps * GB

    @property
    def reserved_bytes(self) -> float:
        """Memory the job cannot use: CUDA context plus allocator fragmentation slack."""
        g = self.profile.gpu
        return g.cuda_context_GiB * GiB + g.allocator_fragmentation_fraction * self.hbm_capacity_bytes

    @property
    def intra_busbw_Bps(self) -> float:
        return self.profile.intra_node.busbw_GBps * GB

    @property
    def inter_node_bw_Bps(self) -> float:
        """Aggregate NIC bandwidth of one node, one direction."""
        n = self.profile.inter_node
        return n.nics_per_node * n.nic_bw_Gbps * 1e9 / 8

    @property
    def pcie_bw_Bps(self) -> float:
        return self.profile.pcie.bw_GBps_per_gpu * GB

    @property
    def host_memory_bytes(self) -> float:
        return self.profile.cpu.memory_GiB * GiB
