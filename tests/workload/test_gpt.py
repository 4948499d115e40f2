"""calibration's one torch GPT mirrors zsim's workload: the same parameters (names, shapes,
registration order, tied weights once), the same modules owning them, one segment per workload
module in forward order, and the module path computing what the segment path computes. A drift
between the torch model and the simulator fails here."""
from __future__ import annotations

import pytest

from zsim.config.hf_config import model_files, preset_model
from zsim.schema import build
from zsim.specs.model import PRESETS, ModelSpec
from zsim.specs.scenario import TrainingSpec
from zsim.workload.transformer import build_workload

torch = pytest.importorskip("torch")
from calibration.core.model import GPT, build_segments, param_shapes  # noqa: E402  (needs torch)

SMALL = dict(layers=2, hidden=32, heads=4, vocab=64, seq_len=16, ffn_hidden=48)
VARIANTS = {
    "gpt2_tied": dict(SMALL),
    "untied": dict(SMALL, tied_embeddings=False),
    "llama_gqa": dict(SMALL, position="rope", norm="rmsnorm", glu=True, fused_qkv=False, bias=False,
                      kv_heads=2, tied_embeddings=False),
    "mqa_fused_rope": dict(SMALL, position="rope", kv_heads=1),
    "bloom": dict(SMALL, position="alibi", embedding_norm=True),
    "rmsnorm_glu_fused_bias": dict(SMALL, norm="rmsnorm", glu=True),
    # DeepSpeed-MoE blocks (calibration/core/moe.py): top-2 of 4 experts, every other layer dense
    "moe_glu": dict(SMALL, glu=True, moe=dict(experts=4, top_k=2, capacity_factor=1.0, min_capacity=2)),
    "moe_top1_gelu_freq2": dict(SMALL, layers=3, moe=dict(experts=4, top_k=1, layer_freq=2, min_capacity=0)),
    # the Hugging Face architectures' variations (zsim/config/hf_config.py)
    "gemma_head_dim": dict(SMALL, position="rope", norm="rmsnorm", glu=True, fused_qkv=False, bias=False,
                           head_dim=16, heads=4, kv_heads=2),
    "qwen2_qkv_bias": dict(SMALL, position="rope", norm="rmsnorm", glu=True, fused_qkv=False, bias=False,
                           qkv_bias=True),
    "phi3_fused_gate_up_window": dict(SMALL, position="rope", norm="rmsnorm", glu=True, bias=False,
                                      fused_gate_up=True, sliding_window=5),
    "neox_parallel": dict(SMALL, position="rope", parallel_residual=True),
    "falcon_shared_norm_mqa": dict(SMALL, position="rope", bias=False, parallel_residual=True, shared_norm=True,
                                   kv_heads=1),
    "gemma2_post_norms_alternating_window": dict(SMALL, norm="rmsnorm", glu=True, bias=False, post_norms=True,
                                                 sliding_window=4, sliding_window_layers="even"),
    "qwen3_qk_norm": dict(SMALL, position="rope", norm="rmsnorm", glu=True, fused_qkv=False, bias=False, kv_heads=2,
                          head_dim=16, qk_norm=True),
    "opt_position_offset": dict(SMALL, fused_qkv=False, position_offset=2),
    "opt350m_post_ln_projection": dict(SMALL, fused_qkv=False, position_offset=2, post_layernorm=True,
                                       embed_proj_dim=16),
    "deepseek_mla": dict(SMALL, position="rope", norm="rmsnorm", glu=True, fused_qkv=False, bias=False,
                         mla=dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)),
    "deepseek_mla_q_lora": dict(SMALL, position="rope", norm="rmsnorm", glu=True, fused_qkv=False, bias=False,
                                mla=dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                         q_lora_rank=10)),
}


def _spec(variant) -> ModelSpec:
    return build(ModelSpec, dict(VARIANTS[variant]), "model")


def _workload(spec: ModelSpec, ep: int = 1):
    return build_workload(spec, micro_batch_size=2, seq_len=spec.seq_len, precision="fp32",
                          flash_attention=True, dropout=False, expert_parallel_size=ep)


def _check_mirror(spec: ModelSpec, ep: int = 1):
    wl = _workload(spec, ep)
    with torch.device("meta"):
        gpt = GPT(spec, ep)
    named = list(gpt.named_parameters())
    assert [n for n, _ in named] == [p.name for p in wl.params]
    assert [tuple(p.shape) for _, p in named] == param_shapes(wl)
    assert [p.numel() for _, p in named] == [p.numel for p in wl.params]
    # every workload module with parameters is the nn.Module owning exactly those parameters
    pid = {id(p): i for i, (_, p) in enumerate(named)}
    for m in wl.modules:
        if m.params:
            owned = gpt.get_submodule(m.name)._parameters.values()
            assert tuple(pid[id(p)] for p in owned) == m.params, m.name
    with torch.device("meta"):
        segments = GPT(spec, ep).segments()
    assert list(segments) == [m.name for m in wl.modules]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gpt_mirrors_the_workload(variant):
    _check_mirror(_spec(variant))


@pytest.mark.parametrize("variant", ["moe_glu", "moe_top1_gelu_freq2"])
def test_gpt_mirrors_one_ranks_experts_under_expert_parallelism(variant):
    _check_mirror(_spec(variant), ep=2)
    _check_mirror(_spec(variant), ep=4)


def test_full_model_pids_map_local_experts_to_their_global_ones():
    from calibration.core.moe import full_model_pids

    spec = _spec("moe_glu")
    full, local = _workload(spec), _workload(spec, ep=2)
    mapping = full_model_pids(full, local, ep_rank=1)
    assert sorted(set(mapping)) == sorted(mapping) and -1 not in mapping
    for pid, f in enumerate(mapping):
        a, b = local.params[pid], full.params[f]
        assert a.numel == b.numel and a.expert == b.expert
        if a.expert:   # local expert j of rank 1 is global expert 2 + j
            j = int(a.name.split(".experts.")[1].split(".")[0])
            assert b.name == a.name.replace(f".experts.{j}.", f".experts.{2 + j}.")
        else:
            assert a.name == b.name


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_gpt_mirrors_every_preset(preset):
    _check_mirror(ModelSpec(**PRESETS[preset]))


# the MoE presets (mixtral-8x7b, deepseek-*) are Hugging Face (dropless) MoE blocks: calibration's GPT
# mirrors DeepSpeed-MoE's capacity dispatch only (calibration/core/moe.py)
@pytest.mark.parametrize("preset", sorted(n for n in model_files() if "moe" not in preset_model(n)))
def test_gpt_mirrors_every_dense_config_json_preset(preset):
    _check_mirror(build(ModelSpec, preset_model(preset), "model"))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_module_path_computes_what_the_segments_compute(variant):
    """The nn.Module the DeepSpeed/FSDP peers run and the segments the core runs: same loss and
    same gradients (the segments' swappable linear differs from F.linear only in how it saves
    the weight)."""
    from types import SimpleNamespace

    spec = _spec(variant)
    wl = _workload(spec)
    gpt = GPT(spec).initialized(seed=7)
    ids = torch.randint(0, spec.vocab, (2, spec.seq_len), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, dims=1)
    loss = gpt(ids, labels)
    loss.backward()
    params = [p.detach().clone().requires_grad_(True) for p in gpt.parameters()]
    segs = build_segments(SimpleNamespace(model=spec, training=TrainingSpec(), expert_parallel_size=1), wl)
    env = {"ids": ids, "labels": labels}
    for s in segs.values():
        env[s.output] = s.fn(lambda i: params[i], *[env[k] for k in s.inputs])
    env["loss"].backward()
    assert float(env["loss"].detach()) == pytest.approx(float(loss.detach()), rel=1e-6)
    for (name, p), q in zip(gpt.named_parameters(), params):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
