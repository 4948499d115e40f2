"""ZeRO-Offload and ZeRO-Infinity pieces shared by the stage builders.

Placement (Ren et al. 2021, ZeRO-Offload; Rajbhandari et al. 2021, ZeRO-Infinity; DeepSpeed
0.19.8 stage_1_and_2.py / stage3.py with offload_optimizer / offload_param):
- offload_optimizer: fp32 master weights and Adam moments live in host memory (cpu) or on
  NVMe (swapped through pinned host buffers); reduced gradients are copied to pinned fp32
  host buffers as their bucket is reduced; the CPU runs DeepSpeedCPUAdam; updated 16-bit
  parameters are copied back to the GPU.
- offload_param (stage 3): 16-bit parameter partitions live on the host (or NVMe) and are
  copied to the GPU before their all-gather.
- Stage 3 runs the optimizer per sub_group_size group, so NVMe reads, the CPU step, NVMe
  writes and the H2D copy of one group overlap those of the next.
"""
from __future__ import annotations

import math

from zsim.schedule.context import StepContext
from zsim.schedule.ir import Category, HostSettings, OpKind, Phase, Stream, Transfer
from zsim.schedule.partition import sub_group_sizes, trainable_numels
from zsim.schedule.payloads import ComputeWork, Copy, CpuAdam, StepCompute
from zsim.schedule.optimizer import (FP32_BYTES, NORM_KERNELS_PER_TENSOR, OVERFLOW_KERNELS_PER_TENSOR,
                                     norm_bytes_per_param, optimizer_state_bytes, optimizer_step,
                                     overflow_bytes_per_param)

H2D, D2H = Transfer.H2D, Transfer.D2H


def optimizer_device(ctx: StepContext) -> str:
    return ctx.sc.zero.optimizer_offload_device


def param_device(ctx: StepContext) -> str:
    return ctx.sc.zero.param_offload_device


def host_load_bytes(ctx: StepContext) -> float:
    """Host memory one rank needs while the model is built and loaded, before training.
    With ZeRO-3, deepspeed.zero.Init (which the HF Trainer enables for stage-3 configs)
    partitions each parameter as it is created; otherwise every rank materialises the whole
    model on the CPU first (HF from_pretrained in the training dtype) before moving it to the GPU."""
    n = sum(ctx.wl.stored_numels(ctx.param_bytes))
    if ctx.sc.zero.stage == 3:
        return math.ceil(n / ctx.dp_size) * ctx.param_bytes
    return n * ctx.param_bytes


def host_settings(ctx: StepContext) -> HostSettings:
    z, ds = ctx.sc.zero, ctx.sc.deepspeed
    pin = True
    if z.offload_optimizer is not None:
        pin = z.offload_optimizer.pin_memory
    if z.offload_param is not None:
        pin = pin and z.offload_param.pin_memory
    frac = z.offload_optimizer.cpuadam_cores_perc if z.offload_optimizer is not None else 0.8
    return HostSettings(pin_memory=pin, cpu_cores_fraction=frac, host_load_bytes_per_gpu=host_load_bytes(ctx),
                        aio_block_size=ds.aio.block_size, aio_queue_depth=ds.aio.queue_depth,
                        aio_thread_count=ds.aio.thread_count)


def width_label(param_bytes: int) -> str:
    """The model dtype's width as the host buffers' labels name it: 16-bit (fp16/bf16) or fp32
    (fp32 training keeps these buffers in fp32)."""
    return "16-bit" if param_bytes == 2 else "fp32"


def place_states(ctx: StepContext, states: dict[str, float], shard: float) -> dict[str, float]:
    """Move offloaded model states from the GPU ledger to the host ledger."""
    states = dict(states)
    width = width_label(ctx.param_bytes)
    z = ctx.sc.zero
    opt = optimizer_device(ctx)
    if opt != "none":
        ratio = z.offload_optimizer.ratio if z.offload_optimizer is not None else 1.0
        moved = states[Category.OPTIMIZER_STATES] * ratio
        states[Category.OPTIMIZER_STATES] -= moved
        if opt == "cpu":
            ctx.b.host_alloc(Category.OPTIMIZER_STATES, moved)
        else:
            o = z.offload_optimizer
            # the swapper's buffers hold the largest sub-group (stage3.py:851 largest_numel)
            sub = (max(sub_group_sizes(trainable_numels(ctx.wl), ctx.dp_size, z.sub_group_size))
                   if z.stage == 3 else shard)
            ctx.b.host_alloc("NVMe swap buffers (optimizer)", (o.buffer_count if o else 4) * sub * FP32_BYTES)
        if z.stage == 3:
            # grad_partitions_flat_buffer: 16-bit accumulation buffer on the host (stage3.py:786-795);
            # the fp32 gradients live with the fp32 partition (swapped to NVMe with it)
            ctx.b.host_alloc(f"gradient accumulation buffer ({width})", ctx.param_bytes * shard)
            if opt == "cpu":
                ctx.b.host_alloc("gradients (fp32, pinned)", FP32_BYTES * shard * ratio)
        else:
            ctx.b.host_alloc("gradients (fp32, pinned)", FP32_BYTES * shard)
            if ctx.gas > 1:
                # accumulated_grads_in_cpu: 16-bit, per parameter in the partition (stage_1_and_2.py:1822-1825)
                ctx.b.host_alloc(f"gradient accumulation buffer ({width})", ctx.param_bytes * shard)
        if ctx.sc.zero.stage >= 2:
            states[Category.GRADIENTS] = 0.0
        if z.stage in (1, 2):
            # stage_1_and_2.py:646-660: the offloaded optimizer's staging buffers for one gradient
            # of the largest trained param, one on the GPU (temp_grad_buffer_for_gpu_offload) and
            # one on the host (temp_grad_buffer_for_cpu_offload), both in the 16-bit dtype
            staging = max((p.numel for p in ctx.wl.params if p.trainable), default=0) * ctx.param_bytes
            states[Category.GRADIENTS] = states.get(Category.GRADIENTS, 0.0) + staging
            ctx.b.host_alloc(f"gradient staging buffer ({width})", staging)
    if param_device(ctx) != "none":
        moved = states[Category.PARAMETERS]
        states[Category.PARAMETERS] = 0.0
        if param_device(ctx) == "cpu":
            ctx.b.host_alloc(f"parameters ({width})", moved)
        else:
            p = z.offload_param
            ctx.b.host_alloc("NVMe swap buffers (params)", p.buffer_count * p.buffer_size * ctx.param_bytes)
    return states


def grads_to_host(ctx: StepContext, numel_owned: float, micro: int, after: int, label: str, n_tensors: int = 1) -> int:
    """PCIe traffic of this rank's reduced gradient slice with optimizer offload.

    Stage 3 (stage3.py:2022-2045 partition_grads): the 16-bit partition goes to the host
    accumulation buffer and back to the GPU on the first micro-step (`.to(device)` keeps a GPU
    copy); later micro-steps bring the buffer to the GPU, add, and copy it back; at the boundary
    the fp32 cast is copied to the optimizer's fp32 gradient (_offload_grad_partition_at_boundary).
    Stages 1/2: see [Note: ZeRO-Offload gradient copies]."""
    if ctx.sc.zero.stage != 3:
        return _zero12_grads_to_host(ctx, numel_owned, micro, after, label, n_tensors)
    b, w = ctx.b, ctx.param_bytes
    boundary = micro == ctx.gas - 1
    last = after
    steps = [(D2H, w), (H2D, w)] if micro == 0 else [(H2D, w), (D2H, w)]
    if boundary:
        steps.append((D2H, FP32_BYTES))
    for transfer, width in steps:
        what = "fp32 grads" if width == FP32_BYTES and transfer == Transfer.D2H and boundary else "grad accumulation"
        last = b.add(OpKind.GRAD_COPY, Stream(transfer.value), Phase.BACKWARD, micro,
                     Copy(transfer, numel_owned * width, what=f"{what} {label}"), [last])
    return last


def _zero12_grads_to_host(ctx: StepContext, numel_owned: float, micro: int, after: int, label: str,
                          n_tensors: int) -> int:
    """[Note: ZeRO-Offload gradient copies] DeepSpeed 0.19.8's ZeRO-1/2 with offload_optimizer
    handles each reduced gradient of its partition in reduce_ipg_grads -> copy_grads_in_partition
    (stage_1_and_2.py:2142-2178), on the stream the bucket was reduced on: the reduction stream
    with overlap_comm, else the current (compute) stream (2239-2246), so without overlap_comm
    the backward's next kernels wait for the copies. Per parameter:
    - accumulating (a micro-step before the boundary, or any after the first;
      async_accumulate_grad_in_cpu_via_gpu, 1809-1860): the 16-bit running sum comes back from
      the host (H2D, after the first micro-step) and is added on the GPU (read 2 x, write 1 x),
      and goes out again (D2H, 16-bit) unless this is the boundary;
    - at the boundary: the norm, cast to fp64 on the GPU (set_norm_for_param_grad_in_gpu,
      1873-1886: read 16-bit, write and read fp64), the overflow check (has_inf_or_nan,
      runtime/utils.py:205-228: amax and amin, two reads), then the fp16/bf16 -> fp32 cast on
      the GPU (`src_tensor.to(fp32)`, 1899-1900: read 16-bit, write fp32) and its non-blocking
      D2H copy into the fp32 gradient partition, pinned when offload_optimizer.pin_memory
      (async_inplace_copy_grad_to_fp32_buffer_from_gpu, 1888-1912; 4 bytes an element cross PCIe).
    zsim charges a bucket's parameters together: one GPU pass op (its kernels counted per
    parameter) and one copy per direction.
    The step then sums the per-parameter norms on the host (one `.item()` each,
    complete_grad_norm_calculation_for_cpu_offload 1914-1944), runs DeepSpeedCPUAdam, casts the
    fp32 partition into a pinned 16-bit host buffer and copies that to the GPU (2 bytes an
    element, 3092-3096)."""
    b, w = ctx.b, ctx.param_bytes
    stream = ctx.grad_stream
    boundary = micro == ctx.gas - 1
    last = after
    if micro > 0:
        last = b.add(OpKind.GRAD_COPY, stream, Phase.BACKWARD, micro,
                     Copy(H2D, numel_owned * w, what=f"grad accumulation {label}"), [last])
    gpu_bytes, kernels = (3.0 * w, 1) if micro > 0 else (0.0, 0)
    if boundary:
        # fp64 norm, overflow check, fp32 cast
        gpu_bytes += norm_bytes_per_param(w) + overflow_bytes_per_param(w) + (w + FP32_BYTES)
        kernels += NORM_KERNELS_PER_TENSOR + OVERFLOW_KERNELS_PER_TENSOR + 1
    if gpu_bytes:
        last = b.add(OpKind.GRAD_NORM, stream, Phase.BACKWARD, micro,
                     StepCompute(ComputeWork(mem_bytes=gpu_bytes * numel_owned, kernels=kernels * n_tensors),
                                 numel_owned), [last])
    width, what = (FP32_BYTES, "fp32 grads") if boundary else (w, "grad accumulation")
    return b.add(OpKind.GRAD_COPY, stream, Phase.BACKWARD, micro, Copy(D2H, numel_owned * width, what=f"{what} {label}"),
                 [last])


def step_host_pass_bytes(ctx: StepContext) -> float:
    """Host traffic per parameter of the offloaded step's passes besides CPU Adam (DeepSpeed
    0.19.8; see [Note: CPU step traffic]):
    - unscale/clip, `grad.mul_(1 / combined_scale)` on the fp32 gradient (read 4, write 4):
      ZeRO-3 always (stage3.py:2979-2988); ZeRO-1/2 unless clipping is off and the loss scale is 1
      (stage_1_and_2.py:3193-3195);
    - the updated fp32 master converted to the 16-bit parameter dtype on the host (read 4, write
      the width): ZeRO-1/2 into the bit16 buffer (stage_1_and_2.py:3093); ZeRO-3 by the
      cross-device `copy_` (stage3.py:2858), which converts on the CPU before the copy (torch's
      copy_kernel_cuda converts a CPU source with `.to(dtype)` first) when the dtypes differ."""
    sc, w = ctx.sc, ctx.param_bytes
    # fp16's loss scale (dynamic, or a static one other than 1) is divided out here too
    scaled = sc.deepspeed.gradient_clipping > 0 or (sc.precision == "fp16" and sc.deepspeed.fp16.loss_scale != 1)
    clip = 2 * FP32_BYTES if sc.zero.stage == 3 or scaled else 0.0
    convert = FP32_BYTES + w if sc.zero.stage < 3 or w < FP32_BYTES else 0.0
    return clip + convert


def offloaded_step(ctx: StepContext, shard: float, deps, sub_groups: list[int] | None) -> int:
    """CPU (or NVMe-backed) optimizer step over the local shard, one group after another (ZeRO-3:
    `sub_groups`, the elements of each optimizer sub-group, partition.sub_group_sizes; ZeRO-1/2:
    None, the whole shard); returns the op after which the GPU holds the updated 16-bit partition."""
    z = ctx.sc.zero
    step = ctx.last_micro
    deps = list(deps)
    # partial offload (stage 3 `ratio`): that fraction of the shard steps on the CPU, the rest
    # with the GPU's fused Adam, concurrently
    ratio = z.offload_optimizer.ratio if z.offload_optimizer is not None else 1.0
    gpu_part = None
    if ratio < 1.0:
        gpu_part = optimizer_step(ctx, shard * (1.0 - ratio), deps)
        shard = shard * ratio
    sizes = [shard] if not sub_groups else [n * shard / sum(sub_groups) for n in sub_groups]
    nvme = optimizer_device(ctx) == "nvme"
    o = z.offload_optimizer
    pipelined = bool(o and (o.pipeline_read or o.pipeline_write or o.pipeline))
    last_h2d = None
    prev_write = None
    b = ctx.b
    pass_bytes_per_numel = step_host_pass_bytes(ctx)
    # the fp32 master and the optimizer's states swapped per group (Adam: exp_avg, exp_avg_sq)
    swapped = FP32_BYTES + optimizer_state_bytes(ctx.sc.deepspeed)
    update_bytes = ctx.sc.deepspeed.optimizer.step_bytes_per_param
    # ZeRO-3's copy converts into a fresh pageable CPU tensor, then copies that (stage3.py:2858);
    # ZeRO-1/2 copy the bit16 buffer, pinned when pin_memory (stage_1_and_2.py:569-575)
    pinned = False if z.stage == 3 and ctx.param_bytes < FP32_BYTES else None
    for g, per in enumerate(sizes):
        pass_bytes = pass_bytes_per_numel * per
        read = None
        if nvme:
            read_deps = deps if pipelined or prev_write is None else deps + [prev_write]
            read = b.add(OpKind.OPTIMIZER_SWAP, Stream.NVME, Phase.STEP, step,
                         Copy(Transfer.NVME_READ, per * swapped, what=f"optimizer group {g}"), read_deps)
        adam = b.add(OpKind.CPU_ADAM, Stream.CPU, Phase.STEP, step, CpuAdam(per, g, pass_bytes, update_bytes),
                     deps + [read])
        if nvme:
            prev_write = b.add(OpKind.OPTIMIZER_SWAP, Stream.NVME, Phase.STEP, step,
                               Copy(Transfer.NVME_WRITE, per * swapped, what=f"optimizer group {g}"), [adam])
        if param_device(ctx) == "none":
            last_h2d = b.add(OpKind.PARAM_UPLOAD, Stream.H2D, Phase.STEP, step,
                             Copy(Transfer.H2D, per * ctx.param_bytes, pinned, what=f"updated params group {g}"),
                             [adam])
        else:
            last_h2d = adam   # the updated 16-bit partition stays on the host with the params
    return b.add(OpKind.STEP_DONE, Stream.COMPUTE, Phase.STEP, step, StepCompute(ComputeWork()),
                 [last_h2d, prev_write, gpu_part])


def params_to_device(ctx: StepContext, numel_shard: float, micro: int, phase: Phase, deps, label: str,
                     allocs=()) -> int:
    """Stage 3 offload_param: bring this rank's partitions to the GPU before the all-gather
    (`allocs`: what the copy itself allocates; on one rank the param's GPU data)."""
    size_bytes = numel_shard * ctx.param_bytes
    if param_device(ctx) == "nvme":
        deps = [ctx.b.add(OpKind.PARAM_FETCH, Stream.NVME, phase, micro,
                          Copy(Transfer.NVME_READ, size_bytes, what=f"params {label}"), deps)]
    return ctx.b.add(OpKind.PARAM_FETCH, Stream.H2D, phase, micro, Copy(Transfer.H2D, size_bytes, what=f"params {label}"),
                     deps, allocs)
