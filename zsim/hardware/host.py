"""Host-side costs: PCIe copies, NVMe I/O and CPU Adam. Pure functions.

- PCIe: alpha-beta with the GPU's achieved pinned-memory bandwidth; pageable memory goes
  through a staging copy at the profile's pcie.pageable_fraction of it (roughly half: NVIDIA
  CUDA C Best Practices Guide, "Pinned Memory"; 0.26 measured on an H200's host).
- NVMe: the node's drives are shared by its GPUs; DeepSpeed's aio reaches the drives'
  sequential rate only with enough requests in flight: efficiency = min(1, queue_depth *
  block_size * thread_count / 8 MiB) (ZeRO-Infinity, Rajbhandari et al. 2021, sec. 6.3:
  deep queues of large blocks saturate NVMe).
- CPU Adam: DeepSpeedCPUAdam's parameters/s per core (ZeRO-Offload, Ren et al. 2021, sec. 4.1)
  times the cores a rank gets: cores_per_node * cpuadam_cores_perc / gpus_per_node, or the
  rank's share of host memory bandwidth, whichever is slower (see [Note: CPU step traffic]).

[Note: CPU step traffic]
DeepSpeedCPUAdam's kernel (deepspeed 0.19.8 csrc/includes/cpu_adam.h, Step_AVX) loads the
fp32 gradient, exp_avg, exp_avg_sq and parameter and stores the parameter and both moments:
28 bytes per parameter. At the shard sizes offload is used for (10^8-10^10 parameters, GBs of
state) nothing stays in cache, so the step streams from host memory, and a node's cores reach
its memory bandwidth long before they run out of arithmetic: measured on one H200's 16-core
host, the kernel ran 4.9-7.5 G params/s on 1M parameters (cache-resident) and 3.9 G params/s on
67M (1 GiB of fp32 streams). The other host passes of the offloaded step
(the unscale/clip multiply, the 16-bit copy of the master) stream too; they are charged at the
same bandwidth (zsim/schedule/offload.py offloaded_step). The profile's cpu.memory_bw_GBps
counts bytes read + written per second (STREAM's copy convention, as the bytes here do);
`zsim calibrate` takes the better of a 1 GiB host copy and DeepSpeedCPUAdam out of cache (on
the H200's host: 65 and 108 GB/s). That host's whole step is still 3x zsim's estimate: see
docs/validation.md, "One GPU".
"""
from __future__ import annotations

def host_link_Bps(gpu_link_Bps: float, uplink_Bps: float | None, gpus_per_switch: int) -> float:
    """What one GPU gets for host traffic when every GPU under its PCIe switch copies at once
    (data-parallel ranks are symmetric): its own link, or its share of the switch's uplink to
    the CPU, whichever is smaller (NVIDIA DGX A100 / H100 system architecture: two GPUs, two
    NICs and NVMe drives under each PCIe switch with one x16 uplink)."""
    if uplink_Bps is None:
        return gpu_link_Bps
    return min(gpu_link_Bps, uplink_Bps / gpus_per_switch)
AIO_SATURATION_BYTES = 8 * 2**20


def pcie_time_s(size_bytes: float, bw_Bps: float, latency_s: float, pinned: bool = True,
                pageable_fraction: float = 0.5) -> tuple[float, float]:
    """(latency_s, transfer_s) of one host<->device copy."""
    if size_bytes <= 0:
        return 0.0, 0.0
    return latency_s, size_bytes / (bw_Bps * (1.0 if pinned else pageable_fraction))


def aio_efficiency(block_size: int, queue_depth: int, thread_count: int) -> float:
    return min(1.0, block_size * queue_depth * thread_count / AIO_SATURATION_BYTES)


def nvme_time_s(size_bytes: float, node_bw_Bps: float, gpus_per_node: int, efficiency: float) -> float:
    if size_bytes <= 0:
        return 0.0
    return size_bytes / (node_bw_Bps / gpus_per_node * efficiency)


# DeepSpeedCPUAdam's host memory traffic per parameter: see [Note: CPU step traffic]
CPU_ADAM_BYTES_PER_PARAM = 28.0


def cpu_adam_time_s(params: float, per_core_per_s: float, cores_per_node: int, gpus_per_node: int,
                    cores_fraction: float, memory_Bps: float) -> float:
    """DeepSpeedCPUAdam over `params` on one rank: its cores' rate or its share of the node's
    host memory bandwidth (`memory_Bps`), whichever is slower (see [Note: CPU step traffic])."""
    cores = max(1.0, cores_per_node * cores_fraction / gpus_per_node)
    return max(params / (per_core_per_s * cores), host_pass_time_s(params * CPU_ADAM_BYTES_PER_PARAM, memory_Bps,
                                                                   gpus_per_node))


def host_pass_time_s(size_bytes: float, memory_Bps: float, gpus_per_node: int) -> float:
    """A streaming pass over host memory (bytes read + written) on one rank, the node's
    bandwidth shared by its GPUs' ranks, which step at once (see [Note: CPU step traffic])."""
    if size_bytes <= 0:
        return 0.0
    return size_bytes / (memory_Bps / max(1, gpus_per_node))


def hook_visit_us(cpu, backward: bool) -> float:
    """The profile's host time per ZeRO-3 module visit: its backward hooks' in a backward, its
    forward hooks' in a forward or a recompute."""
    return cpu.zero3_hook_bwd_us if backward else cpu.zero3_hook_fwd_us


def hook_visits_time_s(visits: int, per_visit_us: float) -> float:
    """Host time of DeepSpeed ZeRO-3's module hooks: `visits` module visits at the profile's
    `cpu.zero3_hook_fwd_us` / `zero3_hook_bwd_us` each (measured by `zsim calibrate --hooks`)."""
    return visits * 1e-6 * per_visit_us


def rank_views_time_s(views: int, view_us: float) -> float:
    """Host time of ZeRO-3's per-rank Python loops: `views` per-rank tensor views at the
    profile's `cpu.zero3_rank_view_us` each (see [Note: per-rank host loops])."""
    return views * view_us * 1e-6
