"""The torch MoE block of calibration's GPT: zsim/workload/moe.py's modules (router `mlp.gate`,
`mlp.dispatch`, this rank's `mlp.experts.{j}`, `mlp.combine`), computing what DeepSpeed-MoE's
MOELayer computes (deepspeed/moe/sharded_moe.py): top-k gating over fp32 softmax probabilities,
each expert's slots filled in order (first choices before second ones, as top2gating offsets
its second locations), routes over capacity dropped, the tokens packed into the capacity buffer
[experts, capacity, hidden] (_sparse_encode), the experts' outputs mixed back weighted by their
gate probability (_sparse_decode) plus the residual stream. Deterministic (no random token
selection, no noisy gate), so a sharded run can be compared with the unsharded one.

With expert parallelism each rank holds experts / ep_size of them; the buffer is viewed as
[ep, local experts, capacity, hidden] and the training core exchanges it over the
expert-parallel group between `dispatch` and the experts, and the experts' outputs before
`combine` (the schedule's EXPERT_ALL_TO_ALL ops; the module path runs without exchange, at
ep_size 1). Shared experts and Residual MoE are not mirrored here.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zsim.schedule.ir import Phase
from zsim.workload.moe import capacity


def route(logits, moe):
    """(slot of every route in the flat [experts * capacity] buffer, its gate weight, capacity);
    routes are ordered choice-major ([k, tokens]); a dropped route points at the extra zero slot."""
    S, E, k = logits.shape[0], moe.experts, moe.top_k
    C = capacity(moe, S)
    gates = logits.float().softmax(-1)
    weight, idx = gates.topk(k, dim=-1)
    idx = idx.t().reshape(-1)
    loc = (F.one_hot(idx, E).cumsum(0) - 1).gather(1, idx[:, None]).squeeze(1)
    keep = loc < C
    slots = torch.where(keep, idx * C + loc, torch.full_like(idx, E * C))
    return slots, weight.t().reshape(-1) * keep, C


def dispatch(moe, ep: int, b, logits):
    """_sparse_encode: the capacity buffer, viewed [ep, local experts, capacity, hidden]."""
    h = b.shape[-1]
    x = b.reshape(-1, h)
    S = x.shape[0]
    slots, _, C = route(logits.reshape(S, -1), moe)
    E = moe.experts
    source = torch.full((E * C + 1,), S, dtype=torch.long)
    source.scatter_(0, slots, torch.arange(S).repeat(moe.top_k))
    padded = torch.cat([x, x.new_zeros(1, h)])
    return padded.index_select(0, source[:-1]).view(ep, E // ep, C, h)


def combine(moe, ep: int, logits, x1, *ys):
    """_sparse_decode plus the residual: every route's expert output (ys[j] is local expert j's
    rows, [ep * capacity, hidden], after the exchange the results of the j-th expert of each
    rank of the group) weighted by its fp32 gate probability, summed over the k routes."""
    h = x1.shape[-1]
    S = x1.numel() // h
    slots, weight, _ = route(logits.reshape(S, -1), moe)
    out = torch.stack([y.view(ep, -1, h) for y in ys], 1).reshape(-1, h)
    padded = torch.cat([out, out.new_zeros(1, h)])
    routed = padded.index_select(0, slots).float() * weight[:, None]
    mixed = routed.view(moe.top_k, S, h).sum(0).to(x1.dtype)
    return x1 + mixed.view(x1.shape)


def build_moe(graph_cls, linear_cls, m, ep: int):
    """The MoE MLP as a container of calibration/core/model.py (its Graph and Linear classes)."""
    moe = m.moe
    if moe.shared_experts or moe.use_residual or m.fused_gate_up or m.post_norms:
        raise ValueError("calibration's GPT mirrors plain MoE blocks only (no shared experts, Residual MoE, "
                         "fused gate_up_proj or post norms)")
    if moe.dispatch != "capacity" or not moe.drop_tokens:
        raise ValueError("calibration's GPT runs DeepSpeed-MoE's capacity dispatch with drop_tokens")

    class ExpertLinear(linear_cls):
        """An expert's first projection: reads its own expert's rows of the (exchanged) buffer."""

        def __init__(self, j, *args):
            super().__init__(*args)
            self.j = j

        def run(self, ws, linear, tokens, residual=None):
            return super().run(ws, linear, tokens[:, self.j].reshape(-1, tokens.shape[-1]))

    class Expert(graph_cls):
        def __init__(self, j):
            super().__init__(("tokens",), "y")
            h, f, bias = m.hidden, moe.expert_ffn_hidden or m.ffn, m.mlp_proj_bias
            if m.glu:
                self.gate_proj = ExpertLinear(j, h, f, bias)
                self.up_proj = ExpertLinear(j, h, f, bias)
                self.ops["act"] = lambda g, u: F.silu(g) * u
                self.steps += [("gate_proj", ("tokens",), "gate"), ("up_proj", ("tokens",), "up"),
                               ("act", ("gate", "up"), "g")]
            else:
                self.fc_in = ExpertLinear(j, h, f, bias)
                self.ops["act"] = lambda x: F.gelu(x, approximate="tanh")
                self.steps += [("fc_in", ("tokens",), "f"), ("act", ("f",), "g")]
            self.fc_out = linear_cls(f, h, bias)
            self.steps.append(("fc_out", ("g",), "y"))

    class MoEMLP(graph_cls):
        def __init__(self):
            super().__init__(("b", "x1"), "x2")
            local = moe.experts // ep
            self.gate = linear_cls(m.hidden, moe.experts, False)
            self.experts = nn.ModuleList([Expert(j) for j in range(local)])
            self.ops["dispatch"] = lambda b, logits: dispatch(moe, ep, b, logits)
            self.ops["combine"] = lambda logits, x1, *ys: combine(moe, ep, logits, x1, *ys)
            ys = tuple(f"y{j}" for j in range(local))
            self.steps = ([("gate", ("b",), "logits"), ("dispatch", ("b", "logits"), "tokens")]
                          + [(f"experts.{j}", ("tokens",), ys[j]) for j in range(local)]
                          + [("combine", ("logits", "x1") + ys, "x2")])

    return MoEMLP()


def exchanged_values(layer: int, local: int) -> tuple[str, tuple[str, ...]]:
    """The core's value names an MoE layer exchanges: the dispatched buffer and the experts' outputs."""
    pfx = f"layers.{layer}.mlp"
    return f"{pfx}.tokens", tuple(f"{pfx}.y{j}" for j in range(local))


def full_model_pids(full_wl, wl, ep_rank: int) -> list[int]:
    """Each of this rank's params' index in the full model's (ep_size 1) workload: dense params
    are the same, local expert j of a layer is expert ep_rank * local + j of the full model
    (DeepSpeed's Experts: num_experts / ep_size consecutive experts per rank)."""
    local: dict[int, int] = {}      # layer -> its local experts
    for m in wl.modules:
        if m.expert is not None:
            local[m.layer] = max(local.get(m.layer, 0), m.expert + 1)

    def keyed(workload, offset):
        out, seen = {}, {}
        for m in workload.modules:
            if m.params and m.expert is not None:
                key = (m.layer, m.expert + offset.get(m.layer, 0))
                out[key + (seen.get(key, 0),)] = m.params
                seen[key] = seen.get(key, 0) + 1
        return out

    full_experts = keyed(full_wl, {})
    by_name = {p.name: i for i, p in enumerate(full_wl.params)}
    mapping = [by_name.get(p.name, -1) if not p.expert else -1 for p in wl.params]
    for key, pids in keyed(wl, {layer: ep_rank * n for layer, n in local.items()}).items():
        for pid, full in zip(pids, full_experts[key]):
            mapping[pid] = full
    return mapping


def expert_groups(rank: int, world: int, ep: int):
    """(expert-parallel group, expert-data-parallel group) of this rank, created as DeepSpeed's
    groups.py _create_expert_and_data_parallel does (every rank creates every group, in the same
    order); (None, None) without expert parallelism (the default group serves both)."""
    import torch.distributed as dist

    if ep == 1:
        return None, None
    ep_group = edp_group = None
    for i in range(world // ep):
        g = dist.new_group(list(range(i * ep, (i + 1) * ep)))
        if rank // ep == i:
            ep_group = g
    for i in range(ep):
        g = dist.new_group(list(range(i, world, ep)))
        if rank % ep == i:
            edp_group = g
    return ep_group, edp_group


def rank_initial_values(sc, wl, shapes, rank: int, seed: int) -> list[torch.Tensor]:
    """The initial values of this rank's params: the full model's (the unsharded reference's),
    its local experts' those of the experts it holds."""
    from dataclasses import replace

    from calibration.core.model import init_params
    from zsim.schedule.build import workload_for
    from zsim.specs.parallelism import ParallelismSpec

    ep = sc.expert_parallel_size
    if ep == 1:
        return init_params(wl, shapes, seed)
    from calibration.core.model import param_shapes
    full = workload_for(replace(sc, parallelism=ParallelismSpec()))
    values = init_params(full, param_shapes(full), seed)
    return [values[f] for f in full_model_pids(full, wl, rank % ep)]


def deepspeed_moe_gpt(sc, seed: int):
    """calibration's GPT for DeepSpeed (`zsim validate --engine deepspeed`): each MoE block's
    router and this rank's experts inside DeepSpeed-MoE's own layer, `deepspeed.moe.layer.MoE`
    (so the engine sees has_moe_layers, is_moe_param and builds the expert groups), with the same
    parameters in the same order (gate.wg, then the local experts) and the own core's initial
    values. DeepSpeed's gate is its own (random token selection, sampled second expert): the
    collectives and their sizes do not depend on the routing, the losses do."""
    import torch.nn as nn
    from deepspeed.moe.layer import MoE

    from calibration.core.layers import Linear
    from calibration.core.model import GPT

    m, moe, ep = sc.model, sc.model.moe, sc.expert_parallel_size
    f = moe.expert_ffn_hidden or m.ffn

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            if m.glu:
                self.gate_proj = Linear(m.hidden, f, m.mlp_proj_bias)
                self.up_proj = Linear(m.hidden, f, m.mlp_proj_bias)
            else:
                self.fc_in = Linear(m.hidden, f, m.mlp_proj_bias)
            self.fc_out = Linear(f, m.hidden, m.mlp_proj_bias)

        def forward(self, x):
            g = F.silu(self.gate_proj(x)) * self.up_proj(x) if m.glu else F.gelu(self.fc_in(x), approximate="tanh")
            return self.fc_out(g)

    class Block(nn.Module):
        def __init__(self, full):
            super().__init__()
            self.moe = MoE(m.hidden, Expert(), num_experts=moe.experts, ep_size=ep, k=moe.top_k,
                           capacity_factor=moe.capacity_factor, eval_capacity_factor=moe.eval_capacity_factor,
                           min_capacity=moe.min_capacity, drop_tokens=moe.drop_tokens, use_residual=False)
            with torch.no_grad():   # the full model's gate and the experts this rank holds
                self.moe.deepspeed_moe.gate.wg.weight.copy_(full.gate.weight)
                rank = torch.distributed.get_rank() % ep
                local = self.moe.deepspeed_moe.experts.deepspeed_experts
                for j, expert in enumerate(local):
                    src = full.experts[rank * len(local) + j]
                    for (_, dst), (_, val) in zip(expert.named_parameters(), src.named_parameters()):
                        dst.copy_(val)

        def forward(self, b, x1):
            out, _, _ = self.moe(b)
            return x1 + out

    model = GPT(m).initialized(seed)
    for i, blk in enumerate(model.layers):
        if m.is_moe_layer(i):
            blk.mlp = Block(blk.mlp)
    return model


def exchange(core, op):
    """DeepSpeed-MoE's _AllToAll over the expert-parallel group, forward or on the gradients in
    backward (the core's EXPERT_ALL_TO_ALL op): the dispatched buffer [ep, local, capacity,
    hidden] in place, or the local experts' outputs stacked the same way."""
    p = op.payload
    values = core.act_grads if op.phase == Phase.BACKWARD else core.env
    tokens, outputs = exchanged_values(p.layer, core.sc.model.moe.experts // core.ep)
    # what arrives carries a gradient where what was sent does (the core's rule for segment
    # inputs: none before the first trained parameter, zsim/workload/lora.py)
    if not p.combine:
        t = values[tokens].contiguous()
        out = torch.empty_like(t)
        core.comm.all_to_all(out, t, group=core.ep_group)
        values[tokens] = out.requires_grad_(t.requires_grad)
        return
    h = core.sc.model.hidden
    t = torch.stack([values[y].reshape(core.ep, -1, h) for y in outputs], 1).contiguous()
    out = torch.empty_like(t)
    core.comm.all_to_all(out, t, group=core.ep_group)
    out.requires_grad_(t.requires_grad)
    for j, y in enumerate(outputs):
        values[y] = out[:, j].reshape(-1, h)
