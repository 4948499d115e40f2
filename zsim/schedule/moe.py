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

import math

from zsim.schedule.ir import (Alloc, Buffer, Category, Collective, Comm, Group, OpKind, Phase, ProcessGroup,
                              ScalarAllReduce, Stream, Tag, TokenExchange)
from zsim.schedule.partition import FlatGroup, flat_groups
from zsim.workload.transformer import Module

INT64_BYTES = 8   # the capacity all-reduce's tensor (torch.max of int64 expert counts)


def deepspeed_moe(sc) -> bool:
    """The model's MoE layers are DeepSpeed-MoE's `deepspeed.moe.layer.MoE` (engine has_moe_layers)."""
    return sc.model.moe is not None and sc.model.moe.dispatch == "capacity"


def expert_parallel_group(ctx) -> ProcessGroup:
    """groups.py _create_expert_and_data_parallel: ranks [i*ep, (i+1)*ep), consecutive."""
    return ProcessGroup(Group.EXPERT_PARALLEL, ctx.sc.expert_parallel_size, 1)


def expert_data_parallel_group(ctx) -> ProcessGroup:
    """groups.py _create_expert_and_data_parallel (E + D ordering): ranks i, i+ep, i+2ep, ..."""
    ep = ctx.sc.expert_parallel_size
    return ProcessGroup(Group.EXPERT_DATA_PARALLEL, ctx.world // ep, ep)


def moe_param_groups(ctx) -> list[FlatGroup]:
    """ZeRO-1/2's flat groups: see [Note: MoE parameter groups]."""
    numels = [p.numel for p in ctx.wl.params]
    expert = [p.expert and deepspeed_moe(ctx.sc) for p in ctx.wl.params]
    return flat_groups(numels, expert, ctx.world, ctx.sc.expert_parallel_size)


def flat_group_process_group(ctx, group: FlatGroup) -> ProcessGroup | None:
    """The group a flat group is reduced and gathered over (None: the data-parallel group)."""
    return expert_data_parallel_group(ctx) if group.expert else None


def capacity_tokens(sc, tokens: int) -> int:
    """Slots per expert in one rank's capacity buffer (sharded_moe.py _capacity: ceil(tokens /
    experts * capacity_factor * k), at least min_capacity); without drop_tokens the buffer is
    sized by the busiest expert, which for a balanced router is the mean load, ceil(tokens * k /
    experts)."""
    moe = sc.model.moe
    if not moe.drop_tokens:
        return math.ceil(tokens * moe.top_k / moe.experts)
    return max(math.ceil(tokens / moe.experts * moe.capacity_factor * moe.top_k), moe.min_capacity)


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
            if any(wl.params[p].expert for p in m.params):
                if m.layer not in seen:
                    self.first[m.name] = m.layer
                seen[m.layer] = m.name
        self.last = {name: layer for layer, name in seen.items()}
        moe = sc.model.moe
        numel = moe.experts * capacity_tokens(sc, wl.tokens) * sc.model.hidden
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
