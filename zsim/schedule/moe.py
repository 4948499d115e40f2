"""DeepSpeed-MoE in the schedule (deepspeed/moe/sharded_moe.py, deepspeed/utils/groups.py):
the expert-parallel all-to-alls around every MoE layer's local experts, the process groups,
and which flat parameter groups ZeRO-1/2 keeps (see [Note: MoE parameter groups]).

MOELayer.forward (sharded_moe.py) gates the tokens, packs them into the capacity buffer
[experts, capacity, hidden] (_sparse_encode), sends each expert's slots to the rank holding it
(_AllToAll over the expert-parallel group), runs the local experts, and sends the results back
(_AllToAll again) before _sparse_decode mixes them. _AllToAll's backward is the same exchange on
the gradients, so backward runs the pair mirrored: the combine's first, the dispatch's after the
experts' backward; a checkpointed block re-runs both in its recompute. With ep_size 1 there is no
exchange (`if self.ep_size > 1`). Without drop_tokens the gate agrees on the capacity with a
max all-reduce over the expert-parallel group before the dispatch (top1gating/top2gating/
topkgating, `dist.all_reduce(new_capacity, op=MAX, group=ep_group)`).

Only DeepSpeed's own MoE layer (model.moe.dispatch: capacity) is an MoE model to DeepSpeed's
engine (has_moe_layers, is_moe_param); a Hugging Face MoE (dispatch: dropless) is a dense model
to it: one parameter group, every expert's gradient reduced over the data-parallel group.
"""
from __future__ import annotations

from zsim.schedule.ir import Alloc, Buffer, Category, Collective, Group, OpKind, Phase, ProcessGroup, Stream, Tag
from zsim.schedule.payloads import Comm, ScalarAllReduce, TokenExchange
from zsim.schedule.partition import FlatGroup, flat_groups
from zsim.workload.module import Module
from zsim.workload.moe import capacity

INT64_BYTES = 8   # the capacity all-reduce's tensor (torch.max of int64 expert counts)


def deepspeed_moe(sc) -> bool:
    """The model's MoE layers are DeepSpeed-MoE's `deepspeed.moe.layer.MoE` (engine has_moe_layers)."""
    return sc.model.moe is not None and sc.model.moe.dispatch == "capacity"


def expert_parallel_group(ctx) -> ProcessGroup:
    """groups.py _create_expert_and_data_parallel: ranks [i*ep, (i+1)*ep), consecutive."""
    return ProcessGroup(Group.EXPERT, ctx.sc.expert_parallel_size, 1)


def expert_data_parallel_group(ctx) -> ProcessGroup:
    """groups.py _create_expert_and_data_parallel (E + D ordering): ranks i, i+ep, i+2ep, ..."""
    ep = ctx.sc.expert_parallel_size
    return ProcessGroup(Group.EXPERT_DATA, ctx.dp_size // ep, ep)


def moe_param_groups(sc, wl, world: int) -> list[FlatGroup]:
    """ZeRO-1/2's flat groups of the trainable params: see partition.flat_groups."""
    numels = [p.numel for p in wl.params]
    expert = [p.expert and deepspeed_moe(sc) for p in wl.params]
    return flat_groups(numels, expert, [p.trainable for p in wl.params], world, sc.expert_parallel_size)


def gathered_groups(groups: list[FlatGroup]) -> list[int]:
    """The flat groups all-gathered after the step (all_gather_dp_groups): all but a group of one
    rank, which all_gather_into_tensor_dp_groups skips (runtime/utils.py:1008-1015): an expert
    group with ep_size = world, or every group on one GPU."""
    return [g for g, group in enumerate(groups) if group.ranks > 1]


def flat_group_process_group(ctx, group: FlatGroup) -> ProcessGroup | None:
    """The group a flat group is reduced and gathered over (None: the data-parallel group)."""
    return expert_data_parallel_group(ctx) if group.expert else None


def moe_blocks(wl) -> dict[str, str]:
    """Block -> its MoE block container: the deepest container of the block's first expert module
    that also holds a dense module of the block (the router), e.g. layers.3.mlp (Mixtral's
    block_sparse_moe, a MixtralSparseMoeBlock). A block is named by its outermost container
    (layers.3; a preference run's reference.layers.3, which sits outside the layer numbering)."""
    dense: dict[str, set[str]] = {}
    for d in wl.modules:
        if d.expert is None and d.containers:
            dense.setdefault(d.containers[0], set()).update(d.containers)
    out: dict[str, str] = {}
    for m in wl.modules:
        if m.expert is None or not m.containers or m.containers[0] in out:
            continue
        out[m.containers[0]] = next(c for c in reversed(m.containers) if c in dense.get(m.containers[0], ()))
    return out


def z3_leaf_blocks(ctx) -> dict[str, tuple[int, ...]]:
    """ZeRO-3 leaf containers -> the params one fetch of each gathers: see [Note: ZeRO-3 leaf modules].

    [Note: ZeRO-3 leaf modules] DeepSpeed ZeRO-3 hooks every nn.Module and fetches its direct
    params before it runs (parameter_offload.py), so a Hugging Face MoE block fetches its router
    and then each expert's projections one module at a time (and an expert no token reached is
    never fetched, which can hang the ranks). A module marked a leaf (deepspeed.utils.
    set_z3_leaf_modules; in 0.19.8 also zero_optimization.leaf_module, whose default classes are
    Mixtral's, Qwen2-MoE's and Qwen3-MoE's sparse MoE blocks) gets no hooks below it: its own
    pre-forward and pre-backward hooks fetch every param of its subtree in one gather
    (iter_params(module, recurse=z3_leaf_module(module))) and release them after it ran.
    training.z3_leaf_moe_block picks the one or the other for zsim's MoE blocks."""
    if ctx.sc.zero.stage != 3:
        return {}
    return zero3_leaves(ctx.wl, moe_blocks_are_leaves(ctx.sc))


def moe_blocks_are_leaves(sc) -> bool:
    """The model has MoE blocks and training.z3_leaf_moe_block makes them ZeRO-3 leaves."""
    return sc.model.moe is not None and sc.training.z3_leaf_moe_block


def zero3_leaves(wl, leaf_moe_block: bool) -> dict[str, tuple[int, ...]]:
    """`z3_leaf_blocks` of a ZeRO-3 run of `wl`; `leaf_moe_block`: `moe_blocks_are_leaves`. Without
    leaf blocks, a transformers 5 experts module is still one fetch of its two 3D parameters (its
    own hooks fetch its direct parameters; its act_fn holds none: see [Note: transformers 5 MoE
    experts]), which zsim builds as three modules: their container is the leaf."""
    if leaf_moe_block:
        params: dict[str, set[int]] = {block: set() for block in moe_blocks(wl).values()}
    else:
        params = {m.containers[-1]: set() for m in wl.modules if m.groups > 1}
        if not params:
            return {}
    for m in wl.modules:     # one walk over the modules, not one per block
        for c in m.containers:
            if c in params:
                params[c].update(m.params)
    return {block: tuple(sorted(ps)) for block, ps in params.items()}


class TokenExchanges:
    """The all-to-alls of every MoE layer, added by the passes around the local experts."""

    def __init__(self, ctx):
        sc, wl = ctx.sc, ctx.wl
        self.active = deepspeed_moe(sc) and sc.expert_parallel_size > 1
        self.first: dict[str, int] = {}   # first local-expert module of a layer (forward order) -> layer
        self.last: dict[str, int] = {}
        if not self.active:
            return
        seen: dict[int, str] = {}
        for m in wl.modules:
            if m.expert is not None:
                if m.layer not in seen:
                    self.first[m.name] = m.layer
                seen[m.layer] = m.name
        self.last = {name: layer for layer, name in seen.items()}
        moe = sc.model.moe
        numel = moe.experts * capacity(moe, wl.tokens) * sc.model.hidden
        self.buffer_bytes = float(numel * wl.act_dtype_bytes)
        self.comm = Comm(Collective.ALL_TO_ALL, numel, self.buffer_bytes, group=expert_parallel_group(ctx))
        self.capacity_comm = (None if moe.drop_tokens else
                              Comm(Collective.ALL_REDUCE, 1, INT64_BYTES, group=expert_parallel_group(ctx)))

    def before(self, ctx, module: Module, micro: int, phase: Phase, last: int | None) -> int | None:
        """Exchanges that run before `module`'s pass: the dispatch in forward, the combine's
        gradient in backward."""
        if phase == Phase.BACKWARD:
            layer = self.last.get(module.name)
            return last if layer is None else self._exchange(ctx, layer, micro, phase, True, last)
        layer = self.first.get(module.name)
        if layer is None:
            return last
        if self.capacity_comm is not None:
            last = ctx.b.add(OpKind.CAPACITY_ALLREDUCE, Stream.COMPUTE, phase, micro,
                             ScalarAllReduce(self.capacity_comm), [last])
        return self._exchange(ctx, layer, micro, phase, False, last)

    def after(self, ctx, module: Module, micro: int, phase: Phase, op: int) -> int:
        """Exchanges that run after `module`'s pass: the combine in forward, the dispatch's
        gradient in backward."""
        if phase == Phase.BACKWARD:
            layer = self.first.get(module.name)
            return op if layer is None else self._exchange(ctx, layer, micro, phase, False, op)
        layer = self.last.get(module.name)
        return op if layer is None else self._exchange(ctx, layer, micro, phase, True, op)

    def _exchange(self, ctx, layer: int, micro: int, phase: Phase, combine: bool, after: int | None) -> int:
        # the buffer it sends (the encoded tokens, the experts' output, or their gradients) lives
        # for the call: _AllToAll keeps nothing for backward
        tag = Tag(Buffer.EXPERT_BUFFER, micro, f"{layer}/{'combine' if combine else 'dispatch'}", phase)
        op = ctx.b.add(OpKind.EXPERT_ALL_TO_ALL, Stream.COMPUTE, phase, micro, TokenExchange(self.comm, layer, combine),
                       [after], (Alloc(tag, Category.ACTIVATIONS, self.buffer_bytes),))
        ctx.b.add_free(op, tag)
        return op
