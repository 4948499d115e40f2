"""Device compute cost: pure roofline functions.

A GEMM takes max(FLOPs / (peak * eff), bytes / (HBM bw * mem_eff)) (Williams, Waterman &
Patterson 2009, "Roofline"). GEMM efficiency saturates with each dimension,
eff = max_eff * prod(d / (d + d_half)): small dimensions under-fill the tensor-core tiles
and waves. Memory-bound kernels (norms, activations, residuals, softmax, loss, optimizer)
run at a fraction of HBM bandwidth. Every kernel pays a fixed launch/framework overhead.
"""
from __future__ import annotations

from zsim.hardware.profile import GpuProfile


def gemm_efficiency(m: float, n: float, k: float, gpu: GpuProfile) -> float:
    d_half = gpu.gemm_half_efficiency_dim
    eff = gpu.gemm_max_efficiency
    for d in (m, n, k):
        eff *= d / (d + d_half)
    return eff


def gemm_time_s(m: float, n: float, k: float, dtype_bytes: int, gpu: GpuProfile, peak_flops: float) -> float:
    flops = 2.0 * m * n * k
    t_compute = flops / (peak_flops * gemm_efficiency(m, n, k, gpu))
    t_memory = (m * k + k * n + m * n) * dtype_bytes / (gpu.hbm_bw_GBps * 1e9 * gpu.memory_bound_efficiency)
    return max(t_compute, t_memory)


def memory_bound_time_s(bytes_moved: float, gpu: GpuProfile) -> float:
    return bytes_moved / (gpu.hbm_bw_GBps * 1e9 * gpu.memory_bound_efficiency)


def attention_time_s(flops: float, backward: bool, gpu: GpuProfile, peak_flops: float) -> float:
    eff = gpu.flash_attention_bwd_efficiency if backward else gpu.flash_attention_fwd_efficiency
    return flops / (peak_flops * eff)


def kernel_overhead_s(kernels: int, gpu: GpuProfile) -> float:
    return kernels * gpu.kernel_overhead_us * 1e-6
