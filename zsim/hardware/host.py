"""Host-side costs: PCIe copies, NVMe I/O and CPU Adam. Pure functions.

- PCIe: alpha-beta with the GPU's achieved pinned-memory bandwidth; pageable memory goes
  through a staging copy, which roughly halves the rate (NVIDIA CUDA C Best Practices
  Guide, "Pinned Memory").
- NVMe: the node's drives are shared by its GPUs; DeepSpeed's aio reaches the drives'
  sequential rate only with enough requests in flight: efficiency = min(1, queue_depth *
  block_size * thread_count / 8 MiB) (ZeRO-Infinity, Rajbhandari et al. 2021, sec. 6.3:
  deep queues of large blocks saturate NVMe).
- CPU Adam: DeepSpeedCPUAdam's parameters/s per core (ZeRO-Offload, Ren et al. 2021, sec. 4.1)
  times the cores a rank gets: cores_per_node * cpuadam_cores_perc / gpus_per_node.
"""
from __future__ import annotations

PAGEABLE_FACTOR = 0.5


def host_link_Bps(gpu_link_Bps: float, uplink_Bps: float | None, gpus_per_switch: int) -> float:
    """What one GPU gets for host traffic when every GPU under its PCIe switch copies at once
    (data-parallel ranks are symmetric): its own link, or its share of the switch's uplink to
    the CPU, whichever is smaller (NVIDIA DGX A100 / H100 system architecture: two GPUs, two
    NICs and NVMe drives under each PCIe switch with one x16 uplink)."""
    if uplink_Bps is None:
        return gpu_link_Bps
    return min(gpu_link_Bps, uplink_Bps / gpus_per_switch)
AIO_SATURATION_BYTES = 8 * 2**20


def pcie_time_s(size_bytes: float, bw_Bps: float, latency_s: float, pinned: bool = True) -> tuple[float, float]:
    """(latency_s, transfer_s) of one host<->device copy."""
    if size_bytes <= 0:
        return 0.0, 0.0
    return latency_s, size_bytes / (bw_Bps * (1.0 if pinned else PAGEABLE_FACTOR))


def aio_efficiency(block_size: int, queue_depth: int, thread_count: int) -> float:
    return min(1.0, block_size * queue_depth * thread_count / AIO_SATURATION_BYTES)


def nvme_time_s(size_bytes: float, node_bw_Bps: float, gpus_per_node: int, efficiency: float) -> float:
    if size_bytes <= 0:
        return 0.0
    return size_bytes / (node_bw_Bps / gpus_per_node * efficiency)


def cpu_adam_time_s(params: float, per_core_per_s: float, cores_per_node: int, gpus_per_node: int,
                    cores_fraction: float) -> float:
    cores = max(1.0, cores_per_node * cores_fraction / gpus_per_node)
    return params / (per_core_per_s * cores)


def rank_views_time_s(views: int, view_us: float) -> float:
    """Host time of ZeRO-3's per-rank Python loops: `views` per-rank tensor views at the
    profile's `cpu.zero3_rank_view_us` each (see [Note: per-rank host loops])."""
    return views * view_us * 1e-6
