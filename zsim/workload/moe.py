"""A Mixture-of-Experts MLP: router, token dispatch, this rank's routed experts, combine, and the
dense companions (shared experts, Qwen's shared-expert gate, Residual MoE's dense MLP and
coefficient).

Semantics:
 - DeepSpeed-MoE (deepspeed/moe/layer.py MoE, sharded_moe.py MOELayer/TopKGate, experts.py
   Experts): the gate is `wg`, a Linear hidden -> experts without bias, run in fp32; each rank
   holds num_experts / ep_size experts (Experts' deepspeed_experts); the dispatch writes an
   (experts, capacity, hidden) buffer, the all-to-all hands each rank ep_size x capacity rows
   per local expert, and every expert computes its whole padded capacity. Residual MoE
   (use_residual): the dense `mlp` beside the experts, mixed by `coefficient` (Linear hidden -> 2).
 - Hugging Face MoE models (Mixtral, Qwen2-MoE, DeepSeek-V2/V3): dropless; each expert runs on
   the tokens routed to it, modelled as the mean load tokens*top_k/experts (balanced routing).
   Shared experts (DeepSeek n_shared_experts, Qwen's shared_expert with its sigmoid
   shared_expert_gate) run on every token.
 - Model FLOPs (MFU) count the routed tokens only (active parameters), not the padding.
The all-to-alls themselves are the schedule's (they move bytes, not FLOPs).
"""
from __future__ import annotations

import math

from zsim.specs.model import MoESpec
from zsim.workload.builder import Builder

FP32_BYTES = 4
INDEX_BYTES = 8   # int64 expert indices / slots kept for backward


def capacity(moe: MoESpec, tokens: int) -> int:
    """Rows of each expert's slot in one rank's dispatch buffer. DeepSpeed's _capacity
    (sharded_moe.py): ceil(tokens / experts * capacity_factor), with the factor doubled by
    top2gating and multiplied by k in topkgating (so k x factor for every k), at least
    min_capacity. Without drop_tokens DeepSpeed sizes it to the most-loaded expert, which zsim
    takes as the balanced load ceil(tokens * k / experts)."""
    if not moe.drop_tokens:
        return math.ceil(tokens * moe.top_k / moe.experts)
    return max(math.ceil(tokens / moe.experts * moe.capacity_factor * moe.top_k), moe.min_capacity)


def expert_tokens(moe: MoESpec, tokens: int, ep_size: int) -> int:
    """Rows one local expert computes per micro-batch when each rank routes `tokens` tokens:
    with capacity dispatch its padded capacity from each of the ep_size ranks of its
    expert-parallel group (after the all-to-all); dropless, the mean routed load from each."""
    if moe.dispatch == "capacity":
        return ep_size * capacity(moe, tokens)
    return ep_size * math.ceil(tokens * moe.top_k / moe.experts)


# [Note: transformers 5 MoE experts]
# transformers 5 keeps a MoE block's routed experts as one module of 3D parameters, not v4's
# nn.ModuleList of expert MLPs: gate_up_proj [experts, 2 x moe_intermediate, hidden] (gate and
# up concatenated) and down_proj [experts, hidden, moe_intermediate], plus their biases in
# gpt-oss (models/qwen3_moe/modeling_qwen3_moe.py Qwen3MoeExperts; Mixtral, Qwen2-MoE,
# DeepSeek-V3 and gpt-oss alike). Its forward is picked by `experts_implementation`
# (integrations/moe.py use_experts_implementation): from_pretrained's default is grouped_mm
# wherever torch's grouped_mm runs (modeling_utils.get_correct_experts_implementation: CUDA
# SM80+, CPU with torch >= 2.9; every zsim profile), which sorts the routed rows by expert and
# runs each projection as ONE grouped GEMM over all experts (grouped_mm_experts_forward);
# eager loops over the experts, one F.linear (and its elementwise kernels) per expert. To
# DeepSpeed the experts are then two parameters per layer: ZeRO-3 gathers them with the block
# and reduces two gradients, not three per expert; PEFT's target_modules cannot wrap them (no
# nn.Linear; nor the router, a bare weight too: Qwen3MoeTopKRouter) and bitsandbytes leaves
# them 16-bit. training.experts_implementation picks
# grouped_mm (default), eager, or modules (transformers 4's per-expert modules). A grouped GEMM
# is priced as one GEMM of all routed rows (passes.linear_gemms: forward and dgrad stack the
# groups along the rows, wgrad along the output features, each reduced over its own rows),
# every expert at the balanced mean load; the kernel's per-group tile padding is not charged.
def moe_mlp(bld: Builder, layer_pfx: str, layer: int, ep_size: int) -> None:
    """The MoE block in the MLP slot of block `layer` (modules named `layer_pfx`.mlp.*)."""
    m, moe, t, a = bld.m, bld.m.moe, bld.t, bld.a
    assert moe is not None
    h, k, n_experts = m.hidden, moe.top_k, moe.experts
    pfx = f"{layer_pfx}.mlp"
    local = n_experts // ep_size
    rows = expert_tokens(moe, t, ep_size)
    routed_bytes = local * rows * h * a          # this rank's expert inputs (= its dispatch buffer)
    mean_load = t * k / n_experts * ep_size      # rows per local expert the MFU convention counts
    bld.scope = (layer_pfx, pfx)
    if moe.dispatch == "capacity":
        # TopKGate: logits = F.linear(input.float(), wg.weight.float()): keeps the fp32 input copy
        # and the softmax's fp32 gates
        bld.linear(f"{pfx}.gate", layer, h, n_experts, False, saves_input=False,
                   extra_act=t * h * FP32_BYTES + t * n_experts * FP32_BYTES)
    else:
        # HF: router_logits in the activation dtype (kept for the load-balancing loss), the
        # routing weights softmax(..., dtype=float) in fp32; transformers 5's router is a bare
        # weight under F.linear (Qwen3MoeTopKRouter), 4's an nn.Linear
        bld.linear(f"{pfx}.gate", layer, h, n_experts, False, extra_act=t * n_experts * (a + FP32_BYTES),
                   nn_linear=bld.experts_implementation == "modules")
    # scatter the tokens into the per-expert rows (keeps only the int64 slots)
    bld.activation(f"{pfx}.dispatch", layer, flops=0.0, fwd_mem=t * h * a + routed_bytes,
                   bwd_mem=t * h * a + routed_bytes, act=t * k * INDEX_BYTES, fwd_workspace=routed_bytes)
    width = moe.expert_ffn_hidden or m.ffn
    if moe.dispatch == "dropless" and bld.experts_implementation != "modules":
        # see [Note: transformers 5 MoE experts]: every expert in two grouped linears
        bld.scope, bld.expert = (layer_pfx, pfx, f"{pfx}.experts"), 0
        bld.mlp(f"{pfx}.experts", layer, width, tokens=local * rows, model_tokens=local * mean_load,
                residual_add=False, groups=local)
    else:
        for j in range(local):
            bld.scope, bld.expert = (layer_pfx, pfx, f"{pfx}.experts", f"{pfx}.experts.{j}"), j
            bld.mlp(f"{pfx}.experts.{j}", layer, width, tokens=rows, model_tokens=mean_load, residual_add=False)
    bld.scope, bld.expert = (layer_pfx, pfx), None
    # gate-weighted sum of the expert outputs back into token order, plus the residual add: keeps
    # the expert outputs and the fp32 combine weights (the gates' gradient needs both) and the
    # dropout mask
    bld.activation(f"{pfx}.combine", layer, flops=2.0 * local * rows * h, fwd_mem=routed_bytes + 3 * t * h * a,
                   bwd_mem=2 * routed_bytes + 2 * t * h * a,
                   act=routed_bytes + t * k * FP32_BYTES + bld.drop * t * h)
    shared = moe.shared_ffn_hidden or moe.shared_experts * width
    if moe.shared_experts:
        bld.scope = (layer_pfx, pfx, f"{pfx}.shared_experts")
        bld.mlp(f"{pfx}.shared_experts", layer, shared, residual_add=False)
        bld.scope = (layer_pfx, pfx)
        if moe.shared_expert_gate:
            # Qwen2MoeSparseMoeBlock: sigmoid(shared_expert_gate(x)) * shared_expert(x)
            bld.linear(f"{pfx}.shared_expert_gate", layer, h, 1, False, saves_input=False)
            bld.activation(f"{pfx}.shared_mix", layer, flops=2.0 * t * h, fwd_mem=3 * t * h * a,
                           bwd_mem=4 * t * h * a, act=t * h * a + t * a)
    if moe.use_residual:
        # DeepSpeed MoE(use_residual=True): output * coef[..., 0:1] + mlp(x) * coef[..., 1:],
        # coef = softmax(coefficient(x)); the dense mlp is the expert module itself
        bld.scope = (layer_pfx, pfx, f"{pfx}.residual_mlp")
        bld.mlp(f"{pfx}.residual_mlp", layer, width, residual_add=False)
        bld.scope = (layer_pfx, pfx)
        bld.linear(f"{pfx}.coefficient", layer, h, 2, True, saves_input=False)
        bld.activation(f"{pfx}.residual_mix", layer, flops=3.0 * t * h, fwd_mem=4 * t * h * a,
                       bwd_mem=5 * t * h * a, act=2 * t * h * a + 2 * t * FP32_BYTES)
