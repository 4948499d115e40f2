"""The MoE block's structure and costs (zsim/workload/moe.py): DeepSpeed-MoE's capacity rule,
experts per rank under expert parallelism, active parameters, FLOPs of the routed tokens."""
import math

import pytest

from zsim.schema import build
from zsim.specs.model import ModelSpec, MoESpec
from zsim.workload.moe import capacity, expert_tokens
from zsim.workload.transformer import build_workload, count_active_params, count_params

LLAMA_LIKE = dict(glu=True, tied_embeddings=False, position="rope", norm="rmsnorm", bias=False, fused_qkv=False)
# Mixtral-8x7B's shapes (mistralai/Mixtral-8x7B-v0.1 config.json)
MIXTRAL = dict(LLAMA_LIKE, layers=32, hidden=4096, heads=32, kv_heads=8, vocab=32000, seq_len=32768,
               ffn_hidden=14336, moe=dict(experts=8, top_k=2, dispatch="dropless"))
SMALL = dict(LLAMA_LIKE, layers=4, hidden=64, heads=4, vocab=128, seq_len=32, ffn_hidden=96)


def _spec(base, **moe):
    return build(ModelSpec, dict(base, moe=dict(base.get("moe", {}), **moe)), "model")


def test_mixtral_total_and_active_parameters_are_the_published_ones():
    m = _spec(MIXTRAL)
    assert count_params(m) == 46_702_792_704
    # 2 of 8 experts per token: 12,879,925,248, published as 12.9B (embeddings included)
    assert count_active_params(m) == 12_879_925_248
    assert round(count_active_params(m) / 1e9, 1) == 12.9


def test_deepspeed_capacity_rule():
    moe = MoESpec(experts=8, top_k=1, capacity_factor=1.25, min_capacity=4)
    assert capacity(moe, 4096) == math.ceil(4096 / 8 * 1.25)               # top1: factor as given
    assert capacity(MoESpec(experts=8, top_k=2, capacity_factor=1.25), 4096) == 1280   # top2gating: factor x 2
    assert capacity(MoESpec(experts=8, top_k=3, capacity_factor=1.0), 4096) == 1536    # topkgating: factor x k
    assert capacity(MoESpec(experts=64, top_k=1, min_capacity=16), 128) == 16         # at least min_capacity
    assert capacity(MoESpec(experts=8, top_k=2, drop_tokens=False), 1000) == 250      # balanced load, no padding


def test_expert_parallel_ranks_receive_ep_times_capacity_per_local_expert():
    moe = MoESpec(experts=8, top_k=2, capacity_factor=1.0, min_capacity=0)
    assert expert_tokens(moe, 1024, 1) == 256
    assert expert_tokens(moe, 1024, 4) == 4 * 256
    dropless = MoESpec(experts=8, top_k=2, dispatch="dropless")
    assert expert_tokens(dropless, 1000, 2) == 2 * 250


def _experts(wl, layer):
    return [x for x in wl.layer_modules(layer) if x.expert is not None]


def test_each_rank_builds_its_local_experts_only_and_the_counts_stay_the_full_models():
    m = _spec(SMALL, experts=8, top_k=2)
    full = build_workload(m, 2, 32, "bf16", True, False)
    ep4 = build_workload(m, 2, 32, "bf16", True, False, expert_parallel_size=4)
    assert sorted({x.expert for x in _experts(full, 0)}) == list(range(8))
    assert sorted({x.expert for x in _experts(ep4, 0)}) == [0, 1]
    expert_numel = sum(p.numel for p in full.params if p.expert)
    assert expert_numel == 4 * 8 * 3 * 64 * 96                       # layers x experts x gate/up/down
    assert sum(p.numel for p in ep4.params if p.expert) == expert_numel // 4
    assert full.n_params - ep4.n_params == expert_numel * 3 // 4     # the dense part is whole on every rank
    assert count_params(m) == full.n_params
    assert count_active_params(m) == full.n_params - expert_numel + expert_numel * 2 // 8
    # an expert's modules sit in its own container, its params are expert params
    e0 = _experts(ep4, 0)[0]
    assert e0.containers[-1] == "layers.0.mlp.experts.0" and all(ep4.params[i].expert for i in e0.params)
    with pytest.raises(ValueError):
        build_workload(m, 2, 32, "bf16", True, False, expert_parallel_size=3)


def test_executed_flops_cover_the_padded_capacity_model_flops_the_routed_tokens():
    m = _spec(SMALL, experts=4, top_k=1, capacity_factor=2.0, min_capacity=0)
    wl = build_workload(m, 2, 32, "bf16", True, False, expert_parallel_size=2)
    t = 64
    rows = 2 * math.ceil(t / 4 * 2.0)                                   # ep x capacity
    proj = [x for x in _experts(wl, 0) if x.kind == "linear"]
    assert {x.gemm[0] for x in proj} == {rows}
    per_expert_weights = 3 * 64 * 96
    assert sum(x.fwd_flops for x in proj) == 2 * 2 * rows * per_expert_weights     # 2 local experts
    # MFU counts each token's one expert: 2 * t * (expert weights), over this rank's share
    assert sum(x.model_fwd_flops for x in proj) == pytest.approx(2 * t * per_expert_weights)


def test_router_and_dispatch_keep_logits_and_the_capacity_buffer():
    m = _spec(SMALL, experts=4, top_k=2, capacity_factor=1.0, min_capacity=0)
    wl = build_workload(m, 1, 32, "bf16", True, False)
    by_name = {x.name: x for x in wl.layer_modules(0)}
    gate = by_name["layers.0.mlp.gate"]
    assert gate.gemm == (32, 4, 64) and len(gate.params) == 1        # hidden -> experts, no bias
    assert gate.act_bytes == 32 * 64 * 4 + 32 * 4 * 4                 # fp32 input copy + fp32 gates
    routed = 4 * capacity(m.moe, 32) * 64 * 2                          # experts x capacity x hidden, bf16
    assert by_name["layers.0.mlp.dispatch"].fwd_workspace_bytes == routed
    assert by_name["layers.0.mlp.combine"].act_bytes >= routed


def test_layer_freq_and_first_dense_layers_pick_the_moe_blocks():
    m = _spec(SMALL, experts=4, top_k=1, first_dense_layers=1, layer_freq=2)
    wl = build_workload(m, 1, 32, "bf16", True, False)
    assert [bool(_experts(wl, i)) for i in range(4)] == [False, False, True, False]
    assert any(x.name == "layers.1.mlp.fc_out" for x in wl.layer_modules(1))


def test_shared_experts_qwen_gate_and_residual_moe_are_dense_params():
    m = _spec(SMALL, experts=4, top_k=1, shared_experts=1, shared_ffn_hidden=48, shared_expert_gate=True,
              use_residual=True)
    wl = build_workload(m, 1, 32, "bf16", True, False)
    names = {p.name: p for p in wl.params}
    assert names["layers.0.mlp.shared_experts.gate_proj.weight"].numel == 64 * 48
    assert not names["layers.0.mlp.shared_experts.fc_out.weight"].expert
    assert names["layers.0.mlp.shared_expert_gate.weight"].numel == 64
    assert names["layers.0.mlp.residual_mlp.up_proj.weight"].numel == 64 * 96
    # DeepSpeed's coefficient: nn.Linear(hidden, 2) with its bias
    assert names["layers.0.mlp.coefficient.weight"].numel == 128 and "layers.0.mlp.coefficient.bias" in names


def test_deepseek_v2_lite_shapes_count_15_7b_total():
    m = build(ModelSpec, dict(LLAMA_LIKE, layers=27, hidden=2048, heads=16, vocab=102400, seq_len=163840,
                              ffn_hidden=10944,
                              mla=dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
                              moe=dict(experts=64, top_k=6, expert_ffn_hidden=1408, shared_experts=2,
                                       first_dense_layers=1, dispatch="dropless")), "model")
    assert count_params(m) == 15_706_484_224
    assert count_active_params(m) == 2_661_150_208


def test_bad_moe_specs_are_refused():
    from zsim.errors import ZsimInputError
    with pytest.raises(ZsimInputError, match="top_k"):
        build(MoESpec, dict(experts=4, top_k=5), "model.moe")
    with pytest.raises(ZsimInputError, match="shared_experts"):
        build(MoESpec, dict(experts=4, top_k=1, shared_expert_gate=True), "model.moe")


# -- transformers 5's experts (see [Note: transformers 5 MoE experts]) -------------------------
def _layer0_mlp(impl: str, base=MIXTRAL, micro_batch: int = 1, seq_len: int = 4096):
    wl = build_workload(_spec(base), micro_batch, seq_len, "bf16", flash_attention=True, dropout=False,
                        experts_implementation=impl)
    return wl, [m for m in wl.modules if m.name.startswith("layers.0.mlp.")]


def test_grouped_experts_are_two_3d_parameters_a_block_with_the_same_counts_and_flops():
    wl5, mods5 = _layer0_mlp("grouped_mm")
    wl4, mods4 = _layer0_mlp("modules")
    assert wl5.n_params == wl4.n_params == 46_702_792_704
    experts = [m for m in mods5 if m.params and m.expert is not None]
    assert [m.name for m in experts] == ["layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.fc_out"]
    # gate_up_proj [8, 2 x 14336, 4096] and down_proj [8, 4096, 14336]
    assert [wl5.params[m.params[0]].numel for m in experts] == [8 * 2 * 14336 * 4096, 8 * 4096 * 14336]
    assert sum(m.fwd_flops for m in mods5) == pytest.approx(sum(m.fwd_flops for m in mods4), rel=1e-12)
    assert sum(m.model_fwd_flops for m in mods5) == pytest.approx(sum(m.model_fwd_flops for m in mods4), rel=1e-12)
    assert sum(m.act_bytes for m in mods5) == pytest.approx(sum(m.act_bytes for m in mods4), rel=1e-12)
    # 3 params a expert under transformers 4 (w1, w3, w2), 2 a block under 5
    assert sum(len(m.params) for m in mods4 if m.expert is not None) == 8 * 3


def test_grouped_mm_is_one_gemm_per_projection_and_eager_one_per_expert():
    from zsim.schedule.passes import linear_gemms
    rows = 4096 * 2 // 8     # tokens x top-2 over 8 experts
    (gate_up,) = [m for m in _layer0_mlp("grouped_mm")[1] if m.name.endswith("gate_up_proj")]
    assert linear_gemms(gate_up, False) == ((8 * rows, 2 * 14336, 4096),)
    # dgrad stacks the experts' rows, wgrad their weights, each reduced over its own rows
    assert linear_gemms(gate_up, True) == ((8 * rows, 4096, 2 * 14336), (8 * 2 * 14336, 4096, rows))
    assert (gate_up.kernels_fwd, gate_up.kernels_bwd) == (1, 2)
    (eager,) = [m for m in _layer0_mlp("eager")[1] if m.name.endswith("gate_up_proj")]
    assert linear_gemms(eager, False) == ((rows, 2 * 14336, 4096),) * 8
    assert linear_gemms(eager, True) == ((rows, 4096, 2 * 14336),) * 8 + ((2 * 14336, 4096, rows),) * 8
    assert (eager.kernels_fwd, eager.kernels_bwd) == (8, 16)


def test_peft_and_bitsandbytes_see_no_linear_in_a_transformers_5_moe_block():
    from zsim.specs.scenario import LoraSpec, TrainingSpec
    from zsim.workload.lora import apply_training, trainable_params
    lora = TrainingSpec(lora=LoraSpec(rank=8, target_modules="all-linear"))
    wl5 = apply_training(_layer0_mlp("grouped_mm", seq_len=64)[0], lora, zero3_linear=False)
    wl4 = apply_training(_layer0_mlp("modules", seq_len=64)[0], lora, zero3_linear=False)
    adapters5 = {m.name.rsplit(".lora_", 1)[0] for m in wl5.modules if ".lora_" in m.name}
    adapters4 = {m.name.rsplit(".lora_", 1)[0] for m in wl4.modules if ".lora_" in m.name}
    assert not [n for n in adapters5 if ".mlp." in n]           # neither the router nor the experts
    assert "layers.0.mlp.gate" in adapters4 and "layers.0.mlp.experts.0.fc_out" in adapters4
    assert trainable_params(wl5) < trainable_params(wl4)
