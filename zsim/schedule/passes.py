"""The forward and backward passes over the workload's modules, with activation memory under
each checkpointing mode. Stage behaviour plugs in through StageHooks (context.py)."""
from __future__ import annotations

from dataclasses import replace

from typing import overload

from zsim.schedule.context import StageHooks, StepContext
from zsim.schedule.ir import Alloc, Buffer, Category, OpKind, Phase, Stream, Tag, Transfer
from zsim.schedule.moe import TokenExchanges
from zsim.schedule.payloads import ComputeWork, Copy, ModulePass
from zsim.schedule.sequence import UlyssesExchanges
from zsim.schedule.tensor import TensorCollectives
from zsim.workload.module import Module, Workload


def exchanges(ctx: StepContext) -> tuple:
    """The communication the passes add around the modules (MoE all-to-alls, tensor-parallel
    collectives, Ulysses' exchanges): only the kinds the run has, so a module visit asks nothing of the others."""
    return tuple(x for x in (TokenExchanges(ctx), TensorCollectives(ctx.sc.parallelism, ctx.wl, ctx.sc.precision),
                             UlyssesExchanges(ctx))
                 if x.active)


@overload
def _before(ctx: StepContext, module: Module, micro: int, phase: Phase, last: int) -> int: ...
@overload
def _before(ctx: StepContext, module: Module, micro: int, phase: Phase, last: None) -> int | None: ...
def _before(ctx, module, micro, phase, last):
    """The communication the passes add before `module` (ctx.exchanges: MoE, tensor parallel);
    the op it ends with (`last` when it adds none)."""
    for exchange in ctx.exchanges:
        last = exchange.before(ctx, module, micro, phase, last)
    return last


def _after(ctx: StepContext, module: Module, micro: int, phase: Phase, op: int) -> int:
    for exchange in ctx.exchanges:
        op = exchange.after(ctx, module, micro, phase, op)
    return op


def _overlapping_tensor(ctx: StepContext, module: Module) -> TensorCollectives | None:
    """The tensor-parallel exchange when it runs `module`'s backward beside its collectives."""
    if not ctx.exchanges:    # asked for every module's backward: most runs have none
        return None
    return next((x for x in ctx.exchanges if isinstance(x, TensorCollectives) and x.overlaps_backward(module)), None)


def linear_gemms(module: Module, backward: bool) -> tuple:
    if module.gemm is None:
        return ()
    m, n, k = module.gemm
    g = module.groups
    if g > 1 and not module.grouped_mm:     # one GEMM per expert (see [Note: transformers 5 MoE experts])
        return tuple(x for gemm in linear_gemms(replace(module, gemm=(m // g, n, k), groups=1), backward)
                     for x in (gemm,) * g)
    if module.tile_shards > 1:             # one tile's rows a GEMM (see [Note: tiled MLP])
        s = module.tile_shards
        return linear_gemms(replace(module, gemm=(m // s, n, k), tile_shards=0), backward) * s
    if not backward:
        return ((m, n, k),)
    # backward: dgrad (m x k from m x n . n x k) and wgrad (n x k from n x m . m x k), each only
    # where autograd needs it (a frozen weight has no wgrad, an input without grad no dgrad);
    # a grouped GEMM's wgrad is `g` weights, each over its own m / g rows
    return ((m, k, n),) * module.input_grad + ((g * n, k, m // g),) * module.weight_grad


def _saved_bytes(ctx: StepContext, module: Module) -> float:
    if module.tile_shards:     # a tiled MLP keeps its input alone (see [Note: tiled MLP])
        return module.tile_input_bytes
    if ctx.checkpointing == "selective":
        return module.act_bytes - module.act_bytes_s2
    return module.act_bytes


def _is_layer(module: Module) -> bool:
    return module.layer >= 0


def _is_last_in_layer(wl: Workload, module: Module) -> bool:
    return wl.layer_modules(module.layer)[-1].name == module.name


def _forward_op(ctx: StepContext, module: Module, micro: int, phase: Phase, deps, keep: bool) -> int:
    allocs = []
    saved = _saved_bytes(ctx, module)
    if keep:   # allocated even when empty, so backward's free always names a live buffer
        allocs.append(Alloc(Tag(Buffer.ACTIVATION, micro, module.name), Category.ACTIVATIONS, saved))
    workspace = None
    if module.fwd_workspace_bytes > 0:
        workspace = Tag(Buffer.WORKSPACE, micro, module.name, phase)
        category = Category.LOGITS if module.kind == "loss" else Category.ACTIVATIONS
        allocs.append(Alloc(workspace, category, module.fwd_workspace_bytes))
    op = ctx.b.add(OpKind.FORWARD, Stream.COMPUTE, phase, micro, _forward_pass(ctx, module), deps, tuple(allocs))
    if workspace:
        ctx.b.add_free(op, workspace)
    return op


def _forward_pass(ctx: StepContext, module: Module) -> ModulePass:
    """The module's forward (also its recompute): the same payload every micro-step, made once
    per step (ctx.passes), so the cost model prices it once."""
    key = (id(module), False)
    mp = ctx.passes.get(key)
    if mp is None:
        mp = ctx.passes[key] = ModulePass(module.name, forward_work(module))
    return mp


def forward_work(module: Module) -> ComputeWork:
    """The compute of `module`'s forward (and of its recompute); with the backward's GEMMs where
    they run in it (see [Note: fused linear cross-entropy])."""
    gemms, model_flops = linear_gemms(module, False), module.model_fwd_flops
    if module.backward_in_forward:
        gemms += linear_gemms(module, True)
        model_flops += _backward_passes(module) * module.model_fwd_flops
    return ComputeWork(gemms=() if module.fp8 else gemms, fp8_gemms=gemms if module.fp8 else (),
                       attention_flops=module.fwd_flops if module.kind == "attention" else 0.0,
                       mem_bytes=module.fwd_mem_bytes, fp32_mem_bytes=module.fp32_fwd_mem_bytes,
                       copy_bytes=module.fwd_copy_bytes, kernels=module.kernels_fwd, model_flops=model_flops)


def _backward_pass(ctx: StepContext, module: Module, accumulated: tuple[int, ...] = ()) -> ModulePass:
    """The module's backward, made once per step like _forward_pass (once more where it adds
    its gradients into .grads kept from an earlier micro-step: `accumulated`)."""
    key = (id(module), True, bool(accumulated))
    mp = ctx.passes.get(key)
    if mp is None:
        # see [Note: gradient accumulation add]: grad += new, one add_ per param (read both, write one)
        accumulate = 3.0 * ctx.param_bytes * sum(ctx.wl.params[p].numel for p in accumulated)
        mp = ctx.passes[key] = ModulePass(module.name, backward_work(module, ctx.checkpointing, accumulate,
                                                                     len(accumulated)))
    return mp


def backward_work(module: Module, checkpointing: str, accumulate_bytes: float = 0.0, adds: int = 0) -> ComputeWork:
    """The compute of `module`'s backward under `checkpointing` (a selective recompute runs in it;
    a full one is its block's forwards, `forward_work`), with `adds` gradient adds of
    `accumulate_bytes` into .grads kept from an earlier micro-step."""
    selective_recompute = checkpointing == "selective" and module.act_bytes_s2 > 0
    # Korthikanti selective: recompute the attention core. Megatron re-runs the whole
    # CoreAttention forward under tensor_parallel.checkpoint (megatron/model/transformer.py
    # _checkpointed_attention_forward): baddbmm, scale-mask-softmax, attention dropout and
    # bmm, so the recompute pays the core's forward memory passes and kernels, not only its FLOPs
    extra_attn = module.fwd_flops if selective_recompute else 0.0
    extra_mem, extra_kernels = (module.fwd_mem_bytes, module.kernels_fwd) if selective_recompute else (0.0, 0)
    extra_fp32 = module.fp32_fwd_mem_bytes if selective_recompute else 0.0
    in_forward = module.backward_in_forward    # its GEMMs ran in the forward
    gemms = () if in_forward else linear_gemms(module, True)
    return ComputeWork(gemms=() if module.fp8 else gemms, fp8_gemms=gemms if module.fp8 else (),
                       attention_flops=(module.bwd_flops + extra_attn) if module.kind == "attention" else 0.0,
                       attention_backward=True, mem_bytes=module.bwd_mem_bytes + extra_mem,
                       fp32_mem_bytes=module.fp32_bwd_mem_bytes + extra_fp32,
                       accumulate_bytes=accumulate_bytes, kernels=module.kernels_bwd + extra_kernels + adds,
                       model_flops=0.0 if in_forward else
                       (_backward_passes(module) + (1 if extra_attn else 0)) * module.model_fwd_flops)


def _backward_passes(module: Module) -> int:
    """The backward's work in forwards of the module: a linear runs the GEMMs autograd needs (dgrad
    where its input wants a gradient, wgrad where its weight is trained: a frozen LoRA base runs
    one or none), anything else twice its forward. HFU counts what runs."""
    if module.gemm is None:
        return 2
    return int(module.input_grad) + int(module.weight_grad)


def _templated(ctx: StepContext, hooks: StageHooks, phase: Phase, micro: int, after: int | None, build) -> int:
    """`build(ctx, hooks, micro, after)`, or the copy of the same pass built at another
    micro-step when the hooks say it adds the same ops.

    [Note: pass templates]
    A forward (or a backward's module walk) adds ops that differ between micro-steps only in
    their micro-step, their ids and the op they follow, unless the stage's hooks act on state
    that changes between micro-steps (ZeRO-3's fetches and releases, gradient buckets that fill
    across passes, a first micro-step's allocations, the boundary's reductions). Hooks that know
    a pass is free of that say so (StageHooks.stationary); the first such pass is built and kept
    (Builder.pass_template), the later ones copied from it (Builder.replay_pass): the same ops a
    build would add, tested op for op (tests/schedule/test_pass_templates.py). CPU checkpointing keeps
    per-micro-step state in the context (ckpt_offload_ops), so its passes are built."""
    templates = ctx.pass_templates
    if templates is None or ctx.cpu_checkpointing or not hooks.stationary(ctx, phase, micro):
        return build(ctx, hooks, micro, after)
    key = (phase, after is None)
    tpl = templates.get(key)
    if tpl is None:
        first = ctx.b.next_id
        last = build(ctx, hooks, micro, after)
        templates[key] = ctx.b.pass_template(first, micro, after, last) or False
        return last
    if tpl is False:
        return build(ctx, hooks, micro, after)
    return ctx.b.replay_pass(tpl, micro, after)


def forward(ctx: StepContext, hooks: StageHooks, micro: int, after: int | None) -> int:
    return _templated(ctx, hooks, Phase.FORWARD, micro, after, _forward)


def _forward(ctx: StepContext, hooks: StageHooks, micro: int, after: int | None) -> int:
    full = ctx.checkpointing == "full"
    last = after
    block_temps: list[Tag] = []
    mods, skip = ctx.wl.modules, ctx.layer_skip
    if skip is not None:
        skip.start_pass()
    i = 0
    while i < len(mods):
        module = mods[i]
        i += 1
        if skip is not None and module.layer >= 0 and skip.geo.first_module[module.layer] == i - 1:
            # see [Note: layers the builder skips]
            layer = skip.forward(micro, module.layer)
            if layer != module.layer:
                module = mods[skip.geo.first_module[layer]]
                i = skip.geo.first_module[layer] + 1
        last = _before(ctx, module, micro, Phase.FORWARD, last)
        deps = hooks.pre_module(ctx, module, micro, Phase.FORWARD) + [last]
        checkpointed = full and _is_layer(module)
        # a module run under no_grad keeps nothing for a backward (see [Note: preference training])
        op = _forward_op(ctx, module, micro, Phase.FORWARD, deps, keep=not checkpointed and not module.no_grad)
        if checkpointed:
            if module.name == ctx.wl.layer_modules(module.layer)[0].name:
                _checkpoint_block_input(ctx, module.layer, micro, op)
            # activations inside a checkpointed block live only while the block runs
            saved = _saved_bytes(ctx, module)
            if saved > 0:
                tag = Tag(Buffer.BLOCK_TEMP, micro, module.name)
                ctx.b.add_alloc(op, Alloc(tag, Category.ACTIVATIONS, saved))
                block_temps.append(tag)
        hooks.post_module(ctx, module, micro, Phase.FORWARD, op)
        last = _after(ctx, module, micro, Phase.FORWARD, op)
        if checkpointed and _is_last_in_layer(ctx.wl, module):
            ctx.b.add_free(op, *block_temps)
            block_temps = []
    if ctx.cpu_checkpointing and micro == 0:
        # .to("cpu") tensors: pageable host memory, one micro-step's block inputs at a time
        ctx.b.host_alloc("activation checkpoints (cpu_checkpointing)", ctx.wl.layers * ctx.wl.layer_input_bytes)
    assert last is not None    # a workload has modules: the pass added ops
    return last


def _checkpoint_block_input(ctx: StepContext, layer: int, micro: int, op: int):
    tag = Tag(Buffer.CHECKPOINT, micro, layer)
    ctx.b.add_alloc(op, Alloc(tag, Category.CHECKPOINTS, ctx.wl.layer_input_bytes))
    if ctx.cpu_checkpointing:
        # copy_to_device(cpu): the GPU copy lives until the D2H copy ends
        d2h = ctx.b.add(OpKind.CHECKPOINT_COPY, Stream.D2H, Phase.FORWARD, micro,
                        Copy(Transfer.D2H, ctx.wl.layer_input_bytes, pinned=False, what=f"checkpoint layer {layer}"),
                        [op])
        ctx.b.add_free(d2h, tag)
        ctx.ckpt_offload_ops[(micro, layer)] = d2h


def _recompute_block(ctx: StepContext, hooks: StageHooks, layer: int, micro: int, last: int) -> int:
    """torch.utils.checkpoint / deepspeed.checkpointing: re-run the block's forward first."""
    if ctx.cpu_checkpointing:
        # CheckpointFunction.backward moves the saved input back before recomputing (blocking);
        # it can only come back once it has reached the host
        size = ctx.wl.layer_input_bytes
        last = ctx.b.add(OpKind.CHECKPOINT_COPY, Stream.H2D, Phase.RECOMPUTE, micro,
                         Copy(Transfer.H2D, size, pinned=False, what=f"checkpoint layer {layer}"),
                         [last, ctx.ckpt_offload_ops.get((micro, layer))],
                         (Alloc(Tag(Buffer.CHECKPOINT, micro, layer), Category.CHECKPOINTS, size),))
    for rm in ctx.wl.layer_modules(layer):
        last = _before(ctx, rm, micro, Phase.RECOMPUTE, last)
        deps = hooks.pre_module(ctx, rm, micro, Phase.RECOMPUTE) + [last]
        op = _forward_op(ctx, rm, micro, Phase.RECOMPUTE, deps, keep=True)
        hooks.post_module(ctx, rm, micro, Phase.RECOMPUTE, op)
        last = _after(ctx, rm, micro, Phase.RECOMPUTE, op)
    return last


def _recompute_tiles(ctx: StepContext, hooks: StageHooks, layer: int, group: str, micro: int, last: int) -> int:
    """TiledMLP's backward: x's gradient allocated whole, then the MLP's forward again with grad,
    holding one tile of each module's activations (see [Note: tiled MLP])."""
    mlp = [m for m in ctx.wl.layer_modules(layer) if m.tile_shards and m.containers[-1] == group]
    x_grad = Alloc(Tag(Buffer.TILE, micro, f"{group}/x_grad"), Category.ACTIVATION_GRADIENTS, mlp[0].tile_input_bytes)
    for rm in mlp:
        deps = hooks.pre_module(ctx, rm, micro, Phase.RECOMPUTE) + [last]
        tile = Alloc(Tag(Buffer.TILE, micro, rm.name), Category.ACTIVATIONS, rm.act_bytes / rm.tile_shards)
        op = ctx.b.add(OpKind.FORWARD, Stream.COMPUTE, Phase.RECOMPUTE, micro, _forward_pass(ctx, rm), deps,
                       (x_grad, tile) if rm is mlp[0] else (tile,))
        hooks.post_module(ctx, rm, micro, Phase.RECOMPUTE, op)
        last = op
    return last


def backward(ctx: StepContext, hooks: StageHooks, micro: int, after: int) -> int:
    last = _templated(ctx, hooks, Phase.BACKWARD, micro, after, _backward_modules)
    hooks.end_backward(ctx, micro, last)
    return last


def _backward_modules(ctx: StepContext, hooks: StageHooks, micro: int, after: int) -> int:
    full = ctx.checkpointing == "full"
    last = after
    recomputed: set[int] = set()
    tiles_recomputed: set[str] = set()
    mods, skip = ctx.wl.modules, ctx.layer_skip
    if skip is not None:
        skip.start_pass()
    i = len(mods)
    while i > 0:
        i -= 1
        module = mods[i]
        if skip is not None and module.layer >= 0 and skip.geo.last_module[module.layer] == i:
            # see [Note: layers the builder skips]
            layer = skip.backward(micro, module.layer)
            if layer != module.layer:
                i = skip.geo.last_module[layer]
                module = mods[i]
        if module.no_grad:    # autograd recorded nothing for it
            continue
        checkpointed = full and _is_layer(module)
        if checkpointed and module.layer not in recomputed:
            recomputed.add(module.layer)
            last = _recompute_block(ctx, hooks, module.layer, micro, last)
        tile_group = module.containers[-1] if module.tile_shards else None
        if tile_group is not None and tile_group not in tiles_recomputed:
            tiles_recomputed.add(tile_group)
            last = _recompute_tiles(ctx, hooks, module.layer, tile_group, micro, last)
        last = _before(ctx, module, micro, Phase.BACKWARD, last)
        deps = hooks.pre_module(ctx, module, micro, Phase.BACKWARD) + [last]
        frees = [Tag(Buffer.ACTIVATION, micro, module.name)]
        if tile_group is not None:
            frees.append(Tag(Buffer.TILE, micro, module.name))
            if module.tile_input_bytes:    # the first of the MLP: x's gradient is complete
                frees.append(Tag(Buffer.TILE, micro, f"{tile_group}/x_grad"))
        if checkpointed and ctx.wl.layer_modules(module.layer)[0].name == module.name:
            frees.append(Tag(Buffer.CHECKPOINT, micro, module.layer))
        workspace = Tag(Buffer.WORKSPACE, micro, module.name, Phase.BACKWARD)
        mp = _backward_pass(ctx, module, hooks.accumulated_grads(ctx, module, micro))
        allocs = ((Alloc(workspace, Category.ACTIVATION_GRADIENTS, module.bwd_workspace),)
                  if module.bwd_workspace > 0 else ())
        tensor = _overlapping_tensor(ctx, module)
        if tensor is not None:   # see [Note: tensor-parallel backward overlap]
            op, done = tensor.backward_overlapped(ctx, module, micro, deps, mp.work, allocs,
                                                  (workspace,) if allocs else (), frees)
        else:
            op = done = ctx.b.add(OpKind.BACKWARD, Stream.COMPUTE, Phase.BACKWARD, micro, mp, deps, allocs)
            ctx.b.add_free(op, *((workspace,) if allocs else ()), *frees)
        hooks.post_module(ctx, module, micro, Phase.BACKWARD, op)
        last = _after(ctx, module, micro, Phase.BACKWARD, done)
    return last
