"""Model states and the optimizer step on the device: what ZeRO shards (Rajbhandari et al. 2020,
sec. 5), the passes DeepSpeed 0.19.8's step makes over the local gradient shard, and the
scalar all-reduces before it."""
from __future__ import annotations

from zsim.schedule.context import StepContext
from zsim.schedule.ir import Alloc, Buffer, Category, Collective, Group, OpKind, Phase, ProcessGroup, Stream, Tag
from zsim.schedule.payloads import Comm, ComputeWork, ScalarAllReduce, StepCompute
from zsim.schedule.tensor import tensor_parallel_group

FP32_BYTES = 4
ADAM_STATE_BYTES = 8          # exp_avg + exp_avg_sq, fp32
# Fused Adam traffic per parameter: read+write fp32 master, m, v (24 B), read the fp32 grad
# (4 B) (apex/DeepSpeed FusedAdam, multi_tensor_apply).
ADAM_STEP_BYTES_PER_PARAM = 28
NORM_DTYPE_BYTES = 8          # fp64
# kernels per gradient piece: has_inf_or_nan (amax, amin, 2 isfinite, and, not) and its
# accumulation; the fp64 conversion and the norm
OVERFLOW_KERNELS_PER_TENSOR = 7
NORM_KERNELS_PER_TENSOR = 2
# the fused update's own kernels (the flatten, conversion, clip, multi-tensor Adam, copy-back,
# zeroing), and the norm's closing scalar ops (sum, sqrt, the coefficient)
STEP_KERNELS = 6
NORM_SCALAR_KERNELS = 3
# DeepSpeed's stage-0 16-bit wrapper per gradient (see [Note: stage-0 16-bit step]): the fp32
# norm's cast, norm, pow and .item(); the step's cast to fp32, unscale and copy back
STAGE0_NORM_KERNELS_PER_TENSOR = 4
STAGE0_STEP_KERNELS_PER_TENSOR = 3


def step_bytes_per_param(param_bytes: int, clipping: bool, flatten: bool = True,
                         update_bytes: float = ADAM_STEP_BYTES_PER_PARAM) -> float:
    """HBM traffic per local parameter of one optimizer step, counting the passes DeepSpeed
    makes (stage_1_and_2.py / stage3.py step): the partition's gradient pieces flattened into one
    buffer (read, write; `self.flatten(self.averaged_gradients[i])`), converted to fp32 (read 2,
    write 4), unscale/clip (read+write 8), fused Adam (28), the updated fp32 master copied back
    into the 16-bit params (read 4, write 2) and the gradient buffers zeroed (write 2). fp32
    training skips the conversion but still copies the master back. The stage-0 optimizer
    converts each gradient on its own and does not flatten (fp16/unfused_optimizer.py).
    `update_bytes`: the optimizer's own update (see [Note: optimizer states by type])."""
    flat = 2.0 * param_bytes if flatten else 0.0
    convert = param_bytes + FP32_BYTES if param_bytes < FP32_BYTES else 0.0
    clip = 2 * FP32_BYTES if clipping else 0.0
    copy_back = FP32_BYTES + param_bytes
    return flat + convert + clip + update_bytes + copy_back + param_bytes


def norm_bytes_per_param(param_bytes: int) -> float:
    """get_grad_norm_direct (stage_1_and_2.py, stage3.py): each gradient piece is converted to
    fp64 (zero/utils.py get_norm_dtype, wherever the device has fp64) and then reduced: read it,
    write 8, read 8."""
    return param_bytes + 2 * NORM_DTYPE_BYTES


def overflow_bytes_per_param(param_bytes: int) -> float:
    """The overflow check reads each local gradient twice: amax and amin per piece
    (runtime/utils.py has_inf_or_nan, stages 1/2) or isinf/isnan over the flat buffer (stage 3)."""
    return 2.0 * param_bytes


def model_state_bytes(n_params: int, shard_params: float, stage: int, param_bytes: int,
                      trainable: tuple[int, float] | None = None,
                      state_bytes: float = ADAM_STATE_BYTES) -> dict[str, float]:
    """Model states per GPU (Rajbhandari et al. 2020, ZeRO, sec. 5): 16-bit params and grads,
    fp32 master weights and the optimizer's states (`state_bytes` a parameter: Adam's two
    moments by default, see [Note: optimizer states by type]); sharded by stage. `trainable` (count, this rank's
    shard of them) when some params are frozen: gradients and optimizer states cover only
    those (see [Note: frozen parameters under ZeRO]).

    [Note: one-rank stage ordering] On one GPU, ZeRO-1 holds more than stage 0, as DeepSpeed
    0.19.8 does. fp32: stage 0 runs the client optimizer on the fp32 params themselves (engine.py
    _do_optimizer_sanity_check returns no wrapper, 2315-2316), while DeepSpeedZeroOptimizer
    always clones an fp32 master partition (stage_1_and_2.py:560-561), +4 bytes a param, and its
    IPG buffer holds reduce_bucket_size fp32 elements (setup_buckets 3256-3270). bf16: both keep
    fp32 masters (stage 0's DDP_BFLOAT16 -> FP16_UnfusedOptimizer), but ZeRO-1's step flattens
    the 16-bit gradient partition before casting it to fp32 (the flat copy, +2 bytes a param,
    lives during the cast; see optimizer_step). Measured on one CPU rank
    (tests/fixtures/single_rank, tests/schedule/test_one_rank_stages.py): bf16 70.89 -> 77.98 MiB,
    fp32 70.89 -> 85.55 MiB of peak tensors for a 3.7M-param GPT."""
    n_train, train_shard = trainable if trainable is not None else (n_params, shard_params)
    master = FP32_BYTES if (param_bytes < FP32_BYTES or stage > 0) else 0
    opt_params = train_shard if stage >= 1 else n_train
    return {
        Category.PARAMETERS: param_bytes * (shard_params if stage >= 3 else n_params),
        Category.GRADIENTS: param_bytes * (train_shard if stage >= 2 else n_train),
        Category.OPTIMIZER_STATES: (master + state_bytes) * opt_params,
    }


def optimizer_state_bytes(ds) -> float:
    """fp32 optimizer-state bytes per parameter of the ds_config's optimizer (see [Note: optimizer
    states by type]; Adam: 8)."""
    return FP32_BYTES * ds.optimizer.state_tensors


# [Note: torch Adam step temporaries] With "torch_adam": true an Adam/AdamW optimizer block builds
# torch.optim.AdamW (torch.optim.Adam when adam_w_mode is false) from the block's params, its `foreach`
# passed on (DeepSpeed 0.19.8 runtime/engine.py:2378-2382 get_optimizer_configuration, 2486-2493), as a
# client torch optimizer handed to deepspeed.initialize is; without it DeepSpeed builds FusedAdam,
# which updates in place. torch's update allocates beside the master (torch 2.13, measured on CPU with
# calibration/core/memory.py's tracker, per fp32 element stepped): the for-loop (_single_tensor_adam,
# foreach=False, and torch's default on a CPU) 8 bytes, `exp_avg_sq.sqrt()` and its quotient alive
# together (adam.py:544 `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`), 12 for Adam
# with an L2 weight_decay (`grad.add(param, alpha=weight_decay)` as well); foreach (_multi_tensor_adam,
# torch's default on a CUDA device: `torch._foreach_sqrt`) 4, over every tensor of the step at once;
# fused=True none. zsim simulates a CUDA device: an unset foreach is foreach there; a CPU rank's
# default, the for-loop, is written foreach: false. The ZeRO optimizers step one flat fp32 tensor at a
# time (stage3.py:1235-1262 _optimizer_step, stage_1_and_2.py:2967-2983), so these sit beside that
# sub-group's fp32 gradient; the flat 16-bit copy of the conversion is gone by then, so the step holds
# the larger of the two. Stage 0 steps the separate fp32 params: the for-loop's temporaries are the
# largest param's.
# Traced on DeepSpeed 0.19.8 (CPU/gloo, 26.3M-param GPT, bf16, world 4, ZeRO-3 with prefetch 0,
# reuse 0 and a 1e6 bucket, client torch.optim.AdamW(lr=1e-3);
# tests/fixtures/deepspeed_zeropp/stage3_prefetch_0_reuse_0_reduce_bucket_1e6_w4.json): the peak,
# 186,343,593 bytes, is inside adam.py:544 with the sub-group's fp32 gradient (26,334,208,
# stage3.py:2686) and two 26,334,208-byte fp32 temporaries beside the model states and the IPG buffer.
ADAM_FOR_LOOP_TEMP_TENSORS = 2
ADAM_FOREACH_TEMP_TENSORS = 1


def update_temp_bytes_per_param(ds) -> float:
    """Bytes the optimizer's update allocates per fp32 element of the tensors it steps (see
    [Note: torch Adam step temporaries]); 0 for DeepSpeed's fused optimizers."""
    opt = ds.optimizer
    params = opt.params
    if opt.name not in ("adam", "adamw") or not params.get("torch_adam"):
        return 0.0
    if params.get("fused") is True:
        return 0.0
    if params.get("foreach") is False:
        adam_w = opt.name == "adamw" or params.get("adam_w_mode", True) is not False
        weight_decay = params.get("weight_decay") or 0
        l2 = not adam_w and isinstance(weight_decay, (int, float)) and weight_decay > 0
        return FP32_BYTES * (ADAM_FOR_LOOP_TEMP_TENSORS + (1 if l2 else 0))
    return FP32_BYTES * ADAM_FOREACH_TEMP_TENSORS


# [Note: the 16-bit partition before the update]
# stage_1_and_2.py step (DeepSpeed 0.19.8), per flat group: flatten the 16-bit gradient partition
# (averaged_gradients: views of grads_in_partition) and convert it to fp32, then
# free_grad_in_param_list and averaged_gradients[i] = None drop the last views of the partition
# (grads_in_partition itself was let go at the backward's end, _release_ipg_buffers) before
# _optimizer_step(i). So at the last group's conversion the partition, its flat 16-bit copy and the
# fp32 gradient coexist, and during its update only the fp32 gradient and the optimizer's
# temporaries: the step's peak is max(partition + flat16 + fp32, fp32 + update). The step is one
# op whose buffers the ledger frees at its end, so the partition (freed after it) stands in for
# that many bytes of the update's temporaries: the same peak, its split between "gradients" and
# "optimizer temporaries" moved by the partition's size. Measured: a ZeRO-2 run whose peak is a
# torch AdamW's for-loop step was 7.7% over DeepSpeed's before (tests/fixtures/deepspeed_ulysses,
# the stage2 cases with and without Ulysses alike).
def optimizer_step(ctx: StepContext, shard_params: float, deps, flatten: bool = True, sub_group: int = 0,
                   per_tensor: int = 0, largest_tensor: float | None = None, dropped_before_update: float = 0.0) -> int:
    """Fused Adam over the local shard, or over one ZeRO-3 sub-group of it; the fp32 gradient
    copy (the flattened partition, converted if 16-bit) lives during the step, and so do the
    optimizer's own temporaries (see [Note: torch Adam step temporaries]). `per_tensor`:
    the gradients DeepSpeed's stage-0 16-bit wrapper converts, unscales and copies back one at a
    time (see [Note: stage-0 16-bit step]); `largest_tensor`: the elements of the largest tensor
    a step over separate tensors (stage 0) updates, where a for-loop optimizer's temporaries peak."""
    temp = FP32_BYTES * shard_params if (ctx.param_bytes < FP32_BYTES or flatten) else 0.0
    allocs = [Alloc(Tag(Buffer.OPT_FP32_GRADS, key=sub_group), Category.OPTIMIZER_TEMPORARIES, temp)] if temp else []
    # self.flatten(averaged_gradients).to(fp32): the flat 16-bit copy is alive while it is
    # converted (stage_1_and_2.py step, stage3.py _prepare_fp32_grad_for_sub_group)
    flat16 = ctx.param_bytes * shard_params if flatten and ctx.param_bytes < FP32_BYTES else 0.0
    update_per_param = update_temp_bytes_per_param(ctx.sc.deepspeed)
    for_loop = update_per_param > FP32_BYTES * ADAM_FOREACH_TEMP_TENSORS
    update = update_per_param * (largest_tensor if for_loop and not flatten and largest_tensor is not None
                          else shard_params)
    update -= dropped_before_update     # see [Note: the 16-bit partition before the update]
    if update > flat16:
        allocs.append(Alloc(Tag(Buffer.OPT_UPDATE, key=sub_group), Category.OPTIMIZER_TEMPORARIES, update))
    elif flat16:
        allocs.append(Alloc(Tag(Buffer.OPT_FLAT16, key=sub_group), Category.OPTIMIZER_TEMPORARIES, flat16))
    # the stage-0 wrapper unscales every gradient whether it clips or not (unscale_and_clip_grads,
    # apply_scale=True)
    per_param = step_bytes_per_param(ctx.param_bytes, ctx.sc.deepspeed.gradient_clipping > 0 or per_tensor > 0,
                                     flatten, ctx.sc.deepspeed.optimizer.step_bytes_per_param)
    op = ctx.b.add(OpKind.OPTIMIZER_STEP, Stream.COMPUTE, Phase.STEP, ctx.last_micro,
                   StepCompute(ComputeWork(optimizer_bytes=per_param * shard_params,
                                           kernels=STEP_KERNELS + STAGE0_STEP_KERNELS_PER_TENSOR * per_tensor),
                               shard_params, sub_group),
                   deps, tuple(allocs))
    ctx.b.add_free(op, *[a.tag for a in allocs])
    return op


def _scalar_allreduce(ctx: StepContext, kind: OpKind, size_bytes: int, deps, group: ProcessGroup | None = None) -> int:
    last = ctx.b.add(kind, Stream.COMPUTE, Phase.STEP, ctx.last_micro,
                     ScalarAllReduce(Comm(Collective.ALL_REDUCE, 1, size_bytes, group=group)), deps)
    if ctx.sc.pipeline_stages > 1:
        # stage_1_and_2.py _model_parallel_all_reduce: then over the model-parallel group, which a
        # PipelineModule's grid makes the stages' ranks of this data-parallel index (recorded,
        # tests/fixtures/pipeline)
        pipe = ProcessGroup(Group.PIPE, ctx.sc.pipeline_stages, ctx.sc.data_parallel_size)
        last = ctx.b.add(kind, Stream.COMPUTE, Phase.STEP, ctx.last_micro,
                         ScalarAllReduce(Comm(Collective.ALL_REDUCE, 1, size_bytes, group=pipe)), [last])
    elif ctx.sc.tensor_parallel_size > 1:
        # with Megatron's mpu the model-parallel group is the tensor-parallel group (each rank
        # holds a slice of every weight: the norm and the overflow flag sum over it)
        tensor = tensor_parallel_group(ctx.sc.tensor_parallel_size)
        last = ctx.b.add(kind, Stream.COMPUTE, Phase.STEP, ctx.last_micro,
                         ScalarAllReduce(Comm(Collective.ALL_REDUCE, 1, size_bytes, group=tensor)), [last])
    return last


def clip_fp32_norm_ops(ctx: StepContext, n_params: float, n_tensors: int, deps) -> int:
    """Stage 0 in fp32 with gradient clipping: no optimizer wrapper clips, so engine.py:3510-3511
    (_take_model_step) calls runtime/utils.py clip_grad_norm_: one fp32 norm per gradient, summed
    (reads each gradient once), over the model-parallel group first where there is one (utils.py:410,
    the pipe or tensor group), then divided by the data-parallel size and all-reduced over it
    (utils.py:418; recorded, tests/fixtures/deepspeed/stage0_fp32_clip.json: one float32 element).
    The clip's multiply is in the step's passes (step_bytes_per_param)."""
    work = ComputeWork(optimizer_bytes=FP32_BYTES * n_params, kernels=n_tensors * NORM_KERNELS_PER_TENSOR + NORM_SCALAR_KERNELS)
    last = ctx.b.add(OpKind.GRAD_NORM, Stream.COMPUTE, Phase.STEP, ctx.last_micro, StepCompute(work, n_params), deps)
    model_parallel = None
    if ctx.sc.pipeline_stages > 1:
        model_parallel = ProcessGroup(Group.PIPE, ctx.sc.pipeline_stages, ctx.sc.data_parallel_size)
    elif ctx.sc.tensor_parallel_size > 1:
        model_parallel = tensor_parallel_group(ctx.sc.tensor_parallel_size)
    for group in ((model_parallel,) if model_parallel else ()) + (None,):
        last = ctx.b.add(OpKind.NORM_ALLREDUCE, Stream.COMPUTE, Phase.STEP, ctx.last_micro,
                         ScalarAllReduce(Comm(Collective.ALL_REDUCE, 1, FP32_BYTES, group=group)), [last])
    return last


def stage0_16bit_check_ops(ctx: StepContext, n_params: float, n_tensors: int, deps) -> int:
    """[Note: stage-0 16-bit step] Without ZeRO, fp16 and bf16 (the FP16 and DDP_BFLOAT16
    wrappers, engine.py _do_optimizer_sanity_check) step through fp16/unfused_optimizer.py (a
    client optimizer) or fused_optimizer.py (DeepSpeed's FusedAdam). Both start with the overflow
    check, one has_inf_or_nan per gradient (runtime/utils.py CheckOverflow.has_overflow_serial:
    amax, amin and their tests), and take the gradients' norm: the unfused wrapper one gradient at
    a time in fp32 (get_weight_norm: .float(), norm, pow, and an .item() each), then converts each
    gradient to fp32, unscales it (unscale_and_clip_grads multiplies even without clipping),
    steps, and copies each master back into its 16-bit param. Measured on one H200 (1.42B GPT,
    293 gradients, torch AdamW client: tests/fixtures/measured/gpu/h200-deepspeed/z0.profile.txt)
    881 copies, 293 mul_, 293 norms, 293 amax/amin, 296 .item(); on one CPU rank, amax 2.3 ms,
    amin 1.0 ms and the norms 0.5 ms of a 21 ms small-GPT step. No collective: without an mpu
    neither the flag nor the norm is all-reduced. zsim charges the unfused wrapper's calls (the
    validation peers' and the HF Trainer's client optimizer); the fused one's norm over its flat
    buffer would launch fewer. Its calls are host-bound on a GPU (see [Note: launch-bound step
    passes])."""
    w = ctx.param_bytes
    per_param = overflow_bytes_per_param(w) + w + 2 * FP32_BYTES     # amax/amin; .float() and its norm
    kernels = n_tensors * (OVERFLOW_KERNELS_PER_TENSOR + STAGE0_NORM_KERNELS_PER_TENSOR) + NORM_SCALAR_KERNELS
    return ctx.b.add(OpKind.GRAD_NORM, Stream.COMPUTE, Phase.STEP, ctx.last_micro,
                     StepCompute(ComputeWork(optimizer_bytes=per_param * n_params, kernels=kernels), n_params), deps)


def grad_norm_ops(ctx: StepContext, shard_params: float, n_tensors: int, deps, overflow_check: bool = True,
                  device_passes: bool = True, norm_calls: int = 1, expert_norms: tuple[ProcessGroup, ...] = (),
                  norm_size_bytes: int = FP32_BYTES) -> int:
    """The local gradient shard's overflow check and norm, then scalar all-reduces (fp16/bf16
    overflow flag, squared norm) as DeepSpeed 0.19.8 issues them before the step (recorded,
    tests/fixtures); with several flat groups one norm all-reduce each, then each MoE group's
    norm averaged over its expert-data-parallel group (see [Note: MoE parameter groups]). The
    local passes stream the shard like the step does and are charged at
    its rate (calibration times them together). With the optimizer offloaded (ZeRO-1/2) the
    overflow flag and the norms come from the backward's per-parameter passes. The overflow flag
    is one uint8; the norm is reduced in `norm_size_bytes`: fp32 at ZeRO-1/2
    (stage_1_and_2.py:2689 `.float()`, 1944 FloatTensor when offloaded) and under ZeRO-3 offload
    (stage3.py:1989), fp64 in
    ZeRO-3's device path (stage3.py:2457-2469, get_norm_dtype)."""
    check = overflow_check and ctx.param_bytes < FP32_BYTES
    if device_passes:
        per_param = norm_bytes_per_param(ctx.param_bytes) + (overflow_bytes_per_param(ctx.param_bytes) if check else 0.0)
        kernels = n_tensors * (NORM_KERNELS_PER_TENSOR + (OVERFLOW_KERNELS_PER_TENSOR if check else 0)) + NORM_SCALAR_KERNELS
        work = ComputeWork(optimizer_bytes=per_param * shard_params, kernels=kernels)
    else:
        # the norms were taken per parameter in the backward (see [Note: ZeRO-Offload gradient
        # copies]); the step sums them on the host, one .item() each
        work = ComputeWork(kernels=n_tensors)
    last = ctx.b.add(OpKind.GRAD_NORM, Stream.COMPUTE, Phase.STEP, ctx.last_micro, StepCompute(work, shard_params),
                     deps)
    if check:
        last = _scalar_allreduce(ctx, OpKind.OVERFLOW_ALLREDUCE, 1, [last])
    for _ in range(norm_calls):
        last = _scalar_allreduce(ctx, OpKind.NORM_ALLREDUCE, norm_size_bytes, [last])
    for group in expert_norms:
        last = _scalar_allreduce(ctx, OpKind.NORM_ALLREDUCE, norm_size_bytes, [last], group)
    return last
