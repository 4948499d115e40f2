"""Device compute cost: pure roofline functions.

A GEMM takes max(FLOPs / (peak * eff), bytes / (HBM bw * mem_eff)) (Williams, Waterman &
Patterson 2009, "Roofline"). GEMM efficiency saturates with each dimension,
eff = max_eff * prod(d / (d + d_half)): small dimensions under-fill the tensor-core tiles
and waves. Memory-bound kernels (norms, activations, residuals, softmax, loss, optimizer)
run at a fraction of HBM bandwidth. Every kernel pays a fixed launch/framework overhead.
"""
from __future__ import annotations

from zsim.hardware.collectives import efficiency_at
from zsim.specs.hardware import GpuProfile


def gemm_efficiency(m: float, n: float, k: float, gpu: GpuProfile) -> float:
    d_half = gpu.gemm_half_efficiency_dim
    eff = gpu.gemm_max_efficiency
    for d in (m, n, k):
        eff *= d / (d + d_half)
    return eff


def gemm_time_s(m: float, n: float, k: float, dtype_bytes: int, gpu: GpuProfile, peak_flops: float) -> float:
    """See [Note: few-row GEMMs]."""
    nbytes = (m * k + k * n + m * n) * dtype_bytes
    rows = gpu.gemm_decode_efficiency
    if rows and m <= rows[-1][0]:
        return nbytes / (gpu.hbm_bw_GBps * 1e9 * efficiency_at(rows, m))
    t_compute = 2.0 * m * n * k / (peak_flops * gemm_efficiency(m, n, k, gpu))
    return max(t_compute, nbytes / (gpu.hbm_bw_GBps * 1e9 * gpu.memory_bound_efficiency))


# [Note: few-row GEMMs]
# A decode step's linears run over one token per sequence: a GEMM of a few rows, whose time is set
# by reading its weights and by kernels the tile law above does not describe (BLAS sends one row to
# its matrix-vector kernel: OpenBLAS's GEMM_GEMV_FORWARD, cuBLAS's gemv heuristics; a few rows to
# small-M kernels). A profile that measured them (calibration's bench_decode_gemms: GEMMs of
# 1-32 rows over a 1 GiB pool of 7B-class weights, so no cache holds them) prices a GEMM of at most
# its largest measured rows at the rate measured for its row count (piecewise linear in log(rows)
# between the measured counts), its whole time; larger GEMMs keep the law. Measured on the dev VM
# (one process, Intel Xeon, torch 2.13): bf16 reads 8.2 GB/s at one row and 11-12 at 2-16; fp32
# 14.5 at one row, 13 at two, then 6.8, 4.5 and 4.8 at 4, 8 and 16 rows, where the arithmetic bounds
# it (38 GFLOP/s at 16 rows) and the law at d_half 38 would price it 1.25x faster. Without the
# measurement a GEMM's reads run at memory_bound_efficiency, the elementwise kernels' figure (0.36
# on the DGX H100 profile), so a GPU profile's decode is pessimistic until `zsim calibrate` runs.


def memory_bound_time_s(bytes_moved: float, gpu: GpuProfile) -> float:
    return bytes_moved / (gpu.hbm_bw_GBps * 1e9 * gpu.memory_bound_efficiency)


def optimizer_time_s(bytes_moved: float, gpu: GpuProfile) -> float:
    """The optimizer step's passes stream long fp32 buffers (multi_tensor_apply chunks), which
    reach a different fraction of bandwidth than activation-sized elementwise kernels; a
    profile without the calibrated figure uses memory_bound_efficiency."""
    eff = gpu.optimizer_efficiency or gpu.memory_bound_efficiency
    return bytes_moved / (gpu.hbm_bw_GBps * 1e9 * eff)


def copy_time_s(bytes_moved: float, gpu: GpuProfile) -> float:
    """A plain device copy (torch.cat's, a KV cache grown by a token): the device's bandwidth, which
    calibration measures as a copy (fit_compute: the best streaming rate, the memcpy's)."""
    return bytes_moved / (gpu.hbm_bw_GBps * 1e9)


def grad_accumulate_time_s(bytes_moved: float, gpu: GpuProfile) -> float:
    """AccumulateGrad's in-place add into an existing .grad (read both, write one: see
    [Note: gradient accumulation add]), a long stream per parameter whose rate differs from
    activation-sized kernels (on a CPU without bf16 arithmetic a bf16 add converts each element
    both ways); a profile without the calibrated figure uses memory_bound_efficiency."""
    eff = gpu.grad_accumulate_efficiency or gpu.memory_bound_efficiency
    return bytes_moved / (gpu.hbm_bw_GBps * 1e9 * eff)


def fresh_alloc_time_s(buffers, gpu: GpuProfile) -> float:
    """First touch of the buffers an op allocates that the allocator maps fresh from the OS;
    `buffers` holds (size_bytes, touched_bytes) pairs.

    torch's CPU allocator is malloc: glibc serves a request above its mmap threshold (dynamic,
    at most DEFAULT_MMAP_THRESHOLD_MAX = 32 MiB on 64-bit; mallopt(3)) with a new mapping and
    returns it on free, so every such tensor page-faults its memory in again. The mapping is
    chosen by the request's size, the faults by the pages written: a page never written is
    never faulted in (mmap(2) maps anonymous memory lazily). The CUDA caching allocator reuses
    blocks: profiles without the two fields pay nothing."""
    lim, rate = gpu.fresh_alloc_threshold_bytes, gpu.fresh_alloc_GBps
    if not lim or not rate:
        return 0.0
    return sum(touched for size, touched in buffers if size > lim) / (rate * 1e9)


def attention_time_s(flops: float, backward: bool, gpu: GpuProfile, peak_flops: float) -> float:
    eff = gpu.flash_attention_bwd_efficiency if backward else gpu.flash_attention_fwd_efficiency
    fixed_us = gpu.flash_attention_bwd_overhead_us if backward else gpu.flash_attention_fwd_overhead_us
    return flops / (peak_flops * eff) + fixed_us * 1e-6


def kernel_overhead_s(kernels: int, gpu: GpuProfile) -> float:
    return kernels * gpu.kernel_overhead_us * 1e-6


def step_passes_time_s(kernels: int, device_s: float, gpu: GpuProfile) -> tuple[float, float]:
    """The optimizer step's passes (the per-gradient overflow check and norms, the fused update):
    (host time the device cannot hide, device time). See [Note: launch-bound step passes].

    [Note: launch-bound step passes]
    DeepSpeed 0.19.8's ZeRO-1/2 step checks every gradient piece for inf/nan and takes its norm
    one piece at a time (stage_1_and_2.py has_overflow_partitioned_grads_serial ->
    runtime/utils.py has_inf_or_nan: amax, amin, two isfinite, logical_and, logical_not, an add;
    get_grad_norm_direct: a cast and a norm), a few small torch calls per piece with no
    synchronisation until the flag's and the norm's .item(). On a GPU the host enqueues them
    ahead of the stream, so the passes take the longer of the launches and the device's
    streaming, not their sum; measured on one H200 (DeepSpeed ZeRO-2, bf16, 1.42B params, 293
    pieces; tests/fixtures/measured/gpu/h200-deepspeed/z2.profile.txt): 41 ms of kernels in a
    68 ms step, the host busy throughout (about 200 us per piece in DeepSpeed's Python and
    torch's dispatch). The per-kernel host time of these calls is more than a bare launch's
    (kernel_overhead_us: 13 us there), so a GPU calibration fits it apart
    (step_kernel_overhead_us, from the optimizer_step benchmark, which runs the same calls). On
    a CPU device the calls and the arithmetic run on the same cores, one after the other."""
    per_us = gpu.step_kernel_overhead_us if gpu.step_kernel_overhead_us is not None else gpu.kernel_overhead_us
    launch_s = kernels * per_us * 1e-6
    if gpu.concurrent_streams:
        return max(0.0, launch_s - device_s), device_s
    return launch_s, device_s
