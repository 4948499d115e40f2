"""What every ZeRO stage shares: the forward and backward passes over the workload's modules,
activation memory with each checkpointing mode, model-state accounting and the optimizer step.

Stage builders plug in through `StageHooks`: collectives and memory that differ by stage
(parameter fetches before a module runs, gradient reduction when grads become ready).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zsim.specs.scenario import Scenario
from zsim.schedule.ops import Alloc, Builder
from zsim.workload.transformer import Module, Workload

FP32_BYTES = 4
ADAM_STATE_BYTES = 8          # exp_avg + exp_avg_sq, fp32
# Fused Adam traffic per parameter: read+write fp32 master, m, v (24 B), read the fp32 grad
# (4 B) (apex/DeepSpeed FusedAdam, multi_tensor_apply).
ADAM_STEP_BYTES_PER_PARAM = 28
NORM_DTYPE_BYTES = 8          # fp64


def step_bytes_per_param(param_bytes: int, clipping: bool, flatten: bool = True) -> float:
    """HBM traffic per local parameter of one optimizer step, counting the passes DeepSpeed
    makes (stage_1_and_2.py / stage3.py step): the partition's gradient pieces flattened into one
    buffer (read, write; `self.flatten(self.averaged_gradients[i])`), converted to fp32 (read 2,
    write 4), unscale/clip (read+write 8), fused Adam (28), the updated fp32 master copied back
    into the 16-bit params (read 4, write 2) and the gradient buffers zeroed (write 2). fp32
    training skips the conversion but still copies the master back. The stage-0 optimizer
    converts each gradient on its own and does not flatten (fp16/unfused_optimizer.py)."""
    flat = 2.0 * param_bytes if flatten else 0.0
    convert = param_bytes + FP32_BYTES if param_bytes < FP32_BYTES else 0.0
    clip = 2 * FP32_BYTES if clipping else 0.0
    copy_back = FP32_BYTES + param_bytes
    return flat + convert + clip + ADAM_STEP_BYTES_PER_PARAM + copy_back + param_bytes


def norm_bytes_per_param(param_bytes: int) -> float:
    """get_grad_norm_direct (stage_1_and_2.py, stage3.py): each gradient piece is converted to
    fp64 (zero/utils.py get_norm_dtype, wherever the device has fp64) and then reduced: read it,
    write 8, read 8."""
    return param_bytes + 2 * NORM_DTYPE_BYTES


def overflow_bytes_per_param(param_bytes: int) -> float:
    """The overflow check reads each local gradient twice: amax and amin per piece
    (runtime/utils.py has_inf_or_nan, stages 1/2) or isinf/isnan over the flat buffer (stage 3)."""
    return 2.0 * param_bytes


# kernels per gradient piece: has_inf_or_nan (amax, amin, 2 isfinite, and, not) and its
# accumulation; the fp64 conversion and the norm
OVERFLOW_KERNELS_PER_TENSOR = 7
NORM_KERNELS_PER_TENSOR = 2


@dataclass
class StepContext:
    sc: Scenario
    wl: Workload
    b: Builder
    param_bytes: int            # 16-bit (2) or fp32 (4) model/gradient width
    world: int
    ckpt_offload_ops: dict = field(default_factory=dict)   # (micro, layer) -> D2H op of its checkpoint

    @property
    def gas(self) -> int:
        return self.sc.gradient_accumulation_steps

    @property
    def checkpointing(self) -> str:
        return self.sc.training.activation_checkpointing

    @property
    def cpu_checkpointing(self) -> bool:
        """deepspeed.checkpointing with cpu_checkpointing: each block's input goes to host memory
        (activation_checkpointing/checkpointing.py:613-616 forward, 639-640 backward). It applies
        to checkpointed blocks, i.e. full checkpointing."""
        return self.checkpointing == "full" and self.sc.deepspeed.activation_checkpointing.cpu_checkpointing

    @property
    def grad_stream(self) -> str:
        return "reduce" if self.sc.zero.overlap else "compute"


class StageHooks:
    """Default: a plain data-parallel replica (no communication in the passes)."""

    def pre_module(self, ctx: StepContext, module: Module, micro: int, phase: str) -> list[int]:
        return []

    def post_module(self, ctx: StepContext, module: Module, micro: int, phase: str, op: int):
        pass

    def end_backward(self, ctx: StepContext, micro: int, last_op: int):
        pass


def grads_ready_at(wl: Workload) -> dict[str, tuple[int, ...]]:
    """Param ids whose gradient is final after each module's backward, in registration order.
    A tied weight's gradient is final only at its first module in forward order."""
    first_use: dict[int, int] = {}
    for i, m in enumerate(wl.modules):
        for pid in m.params:
            first_use.setdefault(pid, i)
    return {m.name: tuple(p for p in m.params if first_use[p] == i) for i, m in enumerate(wl.modules)}


def linear_gemms(module: Module, backward: bool) -> tuple:
    if module.gemm is None:
        return ()
    m, n, k = module.gemm
    # backward: dgrad (m x k from m x n . n x k) and wgrad (n x k from n x m . m x k)
    return ((m, k, n), (n, k, m)) if backward else ((m, n, k),)


def _act_tag(micro: int, module: Module) -> str:
    return f"act/{micro}/{module.name}"


def _saved_bytes(ctx: StepContext, module: Module) -> float:
    if ctx.checkpointing == "selective":
        return module.act_bytes - module.act_bytes_s2
    return module.act_bytes


def _forward_op(ctx: StepContext, module: Module, micro: int, phase: str, deps, keep: bool) -> int:
    allocs = []
    saved = _saved_bytes(ctx, module)
    if keep and saved > 0:
        allocs.append(Alloc(_act_tag(micro, module), "activations", saved))
    workspace_tag = None
    if module.fwd_workspace_bytes > 0:
        workspace_tag = f"ws/{micro}/{phase}/{module.name}"
        category = "logits/loss buffers" if module.kind == "loss" else "activations"
        allocs.append(Alloc(workspace_tag, category, module.fwd_workspace_bytes))
    op = ctx.b.add(f"{phase} {module.name}", "compute", phase, micro, deps,
                   gemms=linear_gemms(module, False),
                   attention_flops=module.fwd_flops if module.kind == "attention" else 0.0,
                   mem_bytes=module.fwd_mem_bytes, kernels=module.kernels_fwd, alloc=tuple(allocs),
                   model_flops=module.model_fwd_flops)
    if workspace_tag:
        ctx.b.add_free(op, workspace_tag)
    return op


def _is_layer(module: Module) -> bool:
    return module.layer >= 0


def forward(ctx: StepContext, hooks: StageHooks, micro: int, after: int | None) -> int:
    full = ctx.checkpointing == "full"
    last = after
    layer_ops: dict[int, list[int]] = {}
    for module in ctx.wl.modules:
        deps = hooks.pre_module(ctx, module, micro, "forward") + [last]
        keep = not (full and _is_layer(module))
        op = _forward_op(ctx, module, micro, "forward", deps, keep)
        if full and _is_layer(module):
            first_of_layer = module.layer not in layer_ops
            layer_ops.setdefault(module.layer, []).append(op)
            if first_of_layer:
                ctx.b.add_alloc(op, Alloc(f"ckpt/{micro}/{module.layer}", "activation checkpoints",
                                          ctx.wl.layer_input_bytes))
                if ctx.cpu_checkpointing:
                    # copy_to_device(cpu): the GPU copy lives until the D2H copy ends
                    d2h = ctx.b.add(f"D2H checkpoint layer {module.layer}", "d2h", "forward", micro, [op],
                                    transfer="d2h", size_bytes=ctx.wl.layer_input_bytes, pinned=False)
                    ctx.b.add_free(d2h, f"ckpt/{micro}/{module.layer}")
                    ctx.ckpt_offload_ops[(micro, module.layer)] = d2h
            # activations inside a checkpointed block live only while the block runs
            saved = _saved_bytes(ctx, module)
            if saved > 0:
                tag = f"tmp/{micro}/fwd/{module.name}"
                ctx.b.add_alloc(op, Alloc(tag, "activations", saved))
                layer_ops[module.layer].append(tag)
        hooks.post_module(ctx, module, micro, "forward", op)
        last = op
        if full and _is_layer(module) and _is_last_in_layer(ctx.wl, module):
            tags = [x for x in layer_ops[module.layer] if isinstance(x, str)]
            ctx.b.add_free(op, *tags)
    if ctx.cpu_checkpointing and micro == 0:
        # .to("cpu") tensors: pageable host memory, one micro-step's block inputs at a time
        ctx.b.host_alloc("activation checkpoints (cpu_checkpointing)", ctx.wl.layers * ctx.wl.layer_input_bytes)
    return last


def _is_last_in_layer(wl: Workload, module: Module) -> bool:
    mods = wl.layer_modules(module.layer)
    return mods[-1].name == module.name


def backward(ctx: StepContext, hooks: StageHooks, micro: int, after: int) -> int:
    full = ctx.checkpointing == "full"
    last = after
    recomputed: set[int] = set()
    for module in reversed(ctx.wl.modules):
        if full and _is_layer(module) and module.layer not in recomputed:
            # torch.utils.checkpoint / deepspeed.checkpointing: re-run the block's forward first
            recomputed.add(module.layer)
            if ctx.cpu_checkpointing:
                # CheckpointFunction.backward moves the saved input back before recomputing (blocking)
                # it can only come back once it has reached the host
                back_deps = [last, ctx.ckpt_offload_ops.get((micro, module.layer))]
                last = ctx.b.add(f"H2D checkpoint layer {module.layer}", "h2d", "recompute", micro, back_deps,
                                 transfer="h2d", size_bytes=ctx.wl.layer_input_bytes, pinned=False,
                                 alloc=(Alloc(f"ckpt/{micro}/{module.layer}", "activation checkpoints",
                                              ctx.wl.layer_input_bytes),))
            for rm in ctx.wl.layer_modules(module.layer):
                deps = hooks.pre_module(ctx, rm, micro, "recompute") + [last]
                last = _forward_op(ctx, rm, micro, "recompute", deps, keep=True)
                hooks.post_module(ctx, rm, micro, "recompute", last)
        deps = hooks.pre_module(ctx, module, micro, "backward") + [last]
        frees = [_act_tag(micro, module)]
        if full and _is_layer(module) and ctx.wl.layer_modules(module.layer)[0].name == module.name:
            frees.append(f"ckpt/{micro}/{module.layer}")
        extra_attn = 0.0
        if ctx.checkpointing == "selective" and module.act_bytes_s2 > 0:
            extra_attn = module.fwd_flops   # Korthikanti selective: recompute the attention core
        ws_tag = f"ws/{micro}/bwd/{module.name}"
        workspace = module.bwd_workspace
        op = ctx.b.add(f"backward {module.name}", "compute", "backward", micro, deps,
                       gemms=linear_gemms(module, True),
                       attention_flops=(module.bwd_flops + extra_attn) if module.kind == "attention" else 0.0,
                       attention_backward=True,
                       mem_bytes=module.bwd_mem_bytes, kernels=module.kernels_bwd,
                   model_flops=2 * module.model_fwd_flops + (module.model_fwd_flops if extra_attn else 0.0),
                       alloc=(Alloc(ws_tag, "activation gradients", workspace),) if workspace > 0 else ())
        ctx.b.add_free(op, ws_tag, *frees)
        hooks.post_module(ctx, module, micro, "backward", op)
        last = op
    hooks.end_backward(ctx, micro, last)
    return last


def model_state_bytes(n_params: int, shard_params: float, stage: int, param_bytes: int) -> dict[str, float]:
    """Model states per GPU (Rajbhandari et al. 2020, ZeRO, sec. 5): 16-bit params and grads,
    fp32 master weights and Adam moments; sharded by stage."""
    master = FP32_BYTES if (param_bytes < FP32_BYTES or stage > 0) else 0
    opt_params = shard_params if stage >= 1 else n_params
    return {
        "parameters": param_bytes * (shard_params if stage >= 3 else n_params),
        "gradients": param_bytes * (shard_params if stage >= 2 else n_params),
        "optimizer states": (master + ADAM_STATE_BYTES) * opt_params,
    }


def optimizer_step(ctx: StepContext, shard_params: float, deps, flatten: bool = True) -> int:
    """Fused Adam over the local shard; the fp32 gradient copy (the flattened partition, converted
    if 16-bit) lives during the step."""
    tag = "opt/fp32_grads"
    temp = FP32_BYTES * shard_params if (ctx.param_bytes < FP32_BYTES or flatten) else 0.0
    allocs = [Alloc(tag, "optimizer temporaries", temp)] if temp else []
    if flatten and ctx.param_bytes < FP32_BYTES:
        # self.flatten(averaged_gradients).to(fp32): the flat 16-bit copy is alive while it is
        # converted (stage_1_and_2.py step, stage3.py _prepare_fp32_grad_for_sub_group)
        allocs.append(Alloc("opt/flat16_grads", "optimizer temporaries", ctx.param_bytes * shard_params))
    per_param = step_bytes_per_param(ctx.param_bytes, ctx.sc.deepspeed.gradient_clipping > 0, flatten)
    op = ctx.b.add("optimizer step (Adam)", "compute", "step", ctx.gas - 1, deps,
                   optimizer_bytes=per_param * shard_params, kernels=6, alloc=tuple(allocs))
    ctx.b.add_free(op, *[a.tag for a in allocs])
    return op


def grad_norm_ops(ctx: StepContext, shard_params: float, n_tensors: int, deps, overflow_check: bool = True,
                  device_passes: bool = True) -> int:
    """The local gradient shard's overflow check and norm, then scalar all-reduces (fp16/bf16
    overflow flag, squared norm) as DeepSpeed 0.19.8 issues them before the step (recorded,
    tests/fixtures). The local passes stream the shard like the step does and are charged at
    its rate (calibration times them together). With the optimizer offloaded the gradients are
    checked on the host as they are copied (`local_overflow`, the CPU norm): one read here."""
    check = overflow_check and ctx.param_bytes < FP32_BYTES
    if device_passes:
        per_param = norm_bytes_per_param(ctx.param_bytes) + (overflow_bytes_per_param(ctx.param_bytes) if check else 0.0)
        kernels = n_tensors * (NORM_KERNELS_PER_TENSOR + (OVERFLOW_KERNELS_PER_TENSOR if check else 0)) + 3
        last = ctx.b.add("grad norm (local)", "compute", "step", ctx.gas - 1, deps,
                         optimizer_bytes=per_param * shard_params, kernels=kernels)
    else:
        last = ctx.b.add("grad norm (local)", "compute", "step", ctx.gas - 1, deps,
                         mem_bytes=ctx.param_bytes * shard_params, kernels=2)
    if check:
        last = ctx.b.add("overflow check", "compute", "step", ctx.gas - 1, [last],
                         collective="all_reduce", size_bytes=1, numel=1)
    last = ctx.b.add("grad norm all-reduce", "compute", "step", ctx.gas - 1, [last],
                     collective="all_reduce", size_bytes=4, numel=1)
    return last
