"""Hugging Face config.json -> model (zsim/config/hf_config.py): the shipped presets count the
published parameters, every supported model_type reads its fields, bad configs are refused in one
line, and the scenario/CLI paths resolve where the user means."""
import json

import pytest

from tests.helpers import ROOT, mapping
from zsim.config.hf_config import model_files, model_from_hf, preset_model
from zsim.config.scenario import load_scenario, scenario_from_mapping
from zsim.errors import ZsimInputError
from zsim.schema import build
from zsim.specs.model import PRESETS, ModelSpec
from zsim.workload.transformer import build_workload, count_active_params, count_params

MODELS = ROOT / "scenarios" / "models"

# Published totals: exact where the model card or safetensors index gives them
PUBLISHED = {
    "mistral-7b": 7_241_732_096, "mixtral-8x7b": 46_702_792_704, "qwen2-7b": 7_615_616_512,
    "gemma-7b": 8_537_680_896, "phi3-mini": 3_821_079_552,
}
# Rounded ones (total, active) as the authors state them, in billions
PUBLISHED_ROUNDED = {
    "deepseek-v2-lite": (15.7, 2.4), "deepseek-v3": (671, 37), "qwen2-72b": (72.7, 72.7), "mixtral-8x7b": (46.7, 12.9),
}


def _spec(fields: dict) -> ModelSpec:
    return build(ModelSpec, fields, "model")


def test_every_shipped_config_is_a_preset():
    assert set(model_files()) == {"mistral-7b", "mixtral-8x7b", "qwen2-7b", "qwen2-72b", "gemma-7b", "phi3-mini",
                                  "deepseek-v2-lite", "deepseek-v3"}
    assert not set(model_files()) & set(PRESETS)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_config_counts_the_published_total_exactly(name):
    assert count_params(_spec(preset_model(name))) == PUBLISHED[name]


def test_mixtral_active_parameters():
    assert count_active_params(_spec(preset_model("mixtral-8x7b"))) == 12_879_925_248


@pytest.mark.parametrize("name", sorted(PUBLISHED_ROUNDED))
def test_moe_and_large_configs_match_the_published_rounding(name):
    m = _spec(preset_model(name))
    total, active = PUBLISHED_ROUNDED[name]
    digits = 1 if total < 100 else 0
    assert round(count_params(m) / 1e9, digits) == total
    n_active = count_active_params(m)
    if name == "deepseek-v2-lite":
        # DeepSeek's 2.4B leaves out the input embedding (a lookup, no FLOPs): 2.45B, stated as 2.4B
        embedding = 102400 * 2048
        assert n_active == 2_661_150_208 and 2.4e9 <= n_active - embedding < 2.5e9
    elif name == "deepseek-v3":
        assert int(n_active / 1e9) == active          # 37.55B, stated as 37B
    else:
        assert round(n_active / 1e9, 1) == active


def _llama_cfg(**changes):
    base = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, vocab_size=32000, max_position_embeddings=4096,
                rms_norm_eps=1e-5, hidden_act="silu")
    return {**base, **changes}


@pytest.mark.parametrize("preset,config", [
    ("llama2-7b", _llama_cfg()),    # meta-llama/Llama-2-7b-hf (num_key_value_heads, tie default)
    ("llama3-8b", _llama_cfg(intermediate_size=14336, num_key_value_heads=8, vocab_size=128256,
                             max_position_embeddings=8192, rope_theta=500000.0)),
    ("gpt2", dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=768, n_layer=12, n_head=12,
                  n_positions=1024, vocab_size=50257, n_inner=None)),
    ("bloom-176b", dict(model_type="bloom", architectures=["BloomForCausalLM"], hidden_size=14336, n_layer=70,
                        n_head=112, vocab_size=250880, seq_length=2048)),
])
def test_reader_gives_the_hand_written_presets_model(preset, config):
    assert _spec(model_from_hf(config, "config.json")) == _spec(PRESETS[preset])


def test_other_families_count_their_published_totals():
    # EleutherAI/pythia-160m and -70m (parallel residual, two LayerNorms, untied embed_out)
    neox = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=768, num_hidden_layers=12,
                num_attention_heads=12, intermediate_size=3072, vocab_size=50304, max_position_embeddings=2048,
                rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)
    assert count_params(_spec(model_from_hf(neox, "c"))) == 162_322_944
    neox.update(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=2048)
    assert count_params(_spec(model_from_hf(neox, "c"))) == 70_426_624
    # tiiuae/falcon-7b: multi-query (one K/V head) in a fused query_key_value, one shared LayerNorm
    falcon = dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=4544, num_hidden_layers=32,
                  num_attention_heads=71, vocab_size=65024, multi_query=True, parallel_attn=True, bias=False,
                  alibi=False, new_decoder_architecture=False)
    m = model_from_hf(falcon, "c")
    assert m["kv_heads"] == 1 and m["shared_norm"] and count_params(_spec(m)) == 6_921_720_704
    # google/gemma-2-9b: 4 norms per block, head_dim 256, alternating sliding window
    gemma2 = dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_size=3584, num_hidden_layers=42,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=256, intermediate_size=14336,
                  vocab_size=256000, max_position_embeddings=8192, sliding_window=4096,
                  final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=256)
    m = model_from_hf(gemma2, "c")
    assert m["sliding_window_layers"] == "even" and count_params(_spec(m)) == 9_241_705_984
    # Qwen/Qwen1.5-MoE-A2.7B: 60 experts top-4, a gated shared expert; 14.3B total, 2.7B active
    qmoe = dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=2048, num_hidden_layers=24,
                num_attention_heads=16, num_key_value_heads=16, intermediate_size=5632, moe_intermediate_size=1408,
                shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4, decoder_sparse_step=1,
                vocab_size=151936, max_position_embeddings=8192, mlp_only_layers=[])
    m = _spec(model_from_hf(qmoe, "c"))
    assert count_params(m) == 14_315_784_192 and count_active_params(m) == 2_689_173_504


def test_qwen3_counts_its_q_and_k_norms():
    # Qwen/Qwen3-8B: 8,190,735,360 (head_dim 128, q_norm and k_norm of 128 per block, untied)
    qwen3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=4096, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                 vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
                 attention_bias=False, use_sliding_window=False, sliding_window=None)
    m = _spec(model_from_hf(qwen3, "c"))
    assert m.qk_norm and count_params(m) == 8_190_735_360
    # Qwen/Qwen3-30B-A3B: 128 experts of 768, top-8, no shared expert; 30.5B total, 3.3B active
    moe = dict(qwen3, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, intermediate_size=6144,
               moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
               mlp_only_layers=[])
    m = _spec(model_from_hf(moe, "c"))
    assert count_params(m) == 30_532_122_624 and round(count_params(m) / 1e9, 1) == 30.5
    assert count_active_params(m) == 3_353_032_704    # 3.35B, which Qwen states as 3.3B (truncated, as V3's 37B)


def test_opt_learned_positions_have_two_extra_rows():
    opt = dict(model_type="opt", architectures=["OPTForCausalLM"], hidden_size=768, num_hidden_layers=12,
               num_attention_heads=12, ffn_dim=3072, vocab_size=50272, max_position_embeddings=2048,
               do_layer_norm_before=True, word_embed_proj_dim=768)
    wl = build_workload(_spec(model_from_hf(opt, "c")), 1, 128, "bf16", True, False)
    assert {p.name: p.numel for p in wl.params}["wpe.weight"] == 2050 * 768
    # facebook/opt-350m: post-LN blocks without a final norm, a 512-wide embedding projected to 1024
    opt.update(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, ffn_dim=4096,
               do_layer_norm_before=False, word_embed_proj_dim=512)
    m = _spec(model_from_hf(opt, "c"))
    wl = build_workload(m, 1, 128, "bf16", True, False)
    names = [x.name for x in wl.modules]
    assert names[:3] == ["wte", "project_in", "wpe"] and names[-3:] == ["project_out", "lm_head", "loss"]
    assert names[names.index("layers.0.attn.o_proj") + 1] == "layers.0.ln_1" and "ln_f" not in names
    assert count_params(m) == 331_196_416        # published: 331M


@pytest.mark.parametrize("config,key", [
    ([1, 2], "config.json"),
    ({"hidden_size": 8}, "model_type"),
    ({"model_type": "bert"}, "model_type"),
    ({"model_type": "mamba"}, "model_type"),
    (_llama_cfg(architectures=["LlamaForSequenceClassification"]), "architectures"),
    (_llama_cfg(num_attention_heads=30), "num_attention_heads"),
    (_llama_cfg(num_hidden_layers=None), "num_hidden_layers"),
    (_llama_cfg(num_hidden_layers="32"), "num_hidden_layers"),
    (_llama_cfg(quantization_config="fp8"), "quantization_config"),
    (json.loads((MODELS / "mixtral-8x7b.json").read_text()) | {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    (dict(_llama_cfg(), model_type="opt", _remove_final_layer_norm=True), "_remove_final_layer_norm"),
    (dict(_llama_cfg(), model_type="qwen2", use_sliding_window=True), "use_sliding_window"),
])
def test_bad_configs_are_refused_naming_the_key(config, key):
    with pytest.raises(ZsimInputError) as err:
        model_from_hf(config, "config.json")
    assert key in err.value.field and "\n" not in str(err.value)


def test_head_dim_may_leave_hidden_indivisible():
    m = model_from_hf(_llama_cfg(num_attention_heads=30, head_dim=128), "c")
    assert m["head_dim"] == 128
    wl = build_workload(_spec(m), 1, 64, "bf16", True, False)
    assert {p.name: p.numel for p in wl.params}["layers.0.attn.q_proj.weight"] == 4096 * 30 * 128
    # GemmaConfig's head_dim defaults to 256, not hidden / heads
    gemma = json.loads((MODELS / "gemma-7b.json").read_text())
    del gemma["head_dim"]
    assert model_from_hf(gemma, "c")["head_dim"] == 256
    assert "head_dim" not in model_from_hf(_llama_cfg(head_dim=128), "c")     # = 4096 / 32: the default


# ---- scenario and CLI paths ---------------------------------------------------------------------
def test_scenario_hf_config_is_relative_to_the_file_and_keys_beside_it_override(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((MODELS / "mistral-7b.json").read_text())
    raw = mapping(model={"hf_config": "cfg/config.json", "seq_len": 4096})
    import yaml
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    sc = load_scenario(tmp_path / "s.yaml")
    assert sc.model.seq_len == 4096 and sc.model.sliding_window == 4096 and sc.model.kv_heads == 8
    with pytest.raises(ZsimInputError, match="keep one"):
        scenario_from_mapping(mapping(model={"hf_config": "cfg/config.json", "preset": "gpt2"}), tmp_path)


def test_set_hf_config_is_relative_to_the_working_directory_and_replaces_the_preset(monkeypatch):
    monkeypatch.chdir(ROOT)
    sc = load_scenario(ROOT / "scenarios" / "default.yaml", ("model.hf_config=scenarios/models/qwen2-7b.json",))
    assert count_params(sc.model) == 7_615_616_512
    sc = load_scenario(ROOT / "scenarios" / "default.yaml", ("model.preset=gemma-7b",))
    assert sc.model.head_dim == 256


def test_zsim_run_with_a_70b_class_config_is_quick():
    import subprocess
    import sys
    import time
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "zsim.cli", "run", "--quiet", "--set",
                        "model.hf_config=scenarios/models/qwen2-72b.json"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert time.perf_counter() - start < 5    # the target is under a second; the margin is for a loaded CI


def test_gemma3_text_reads_its_local_global_pattern_and_qk_norm(tmp_path):
    """Gemma3TextConfig: layer i slides unless (i + 1) % sliding_window_pattern == 0 (default 6),
    or as layer_types lists; Gemma-2's four norms plus q_norm/k_norm; tied, head_dim 256."""
    import json as _json
    from zsim.config.hf_config import read_hf_config
    from zsim.schema import build as _build
    from zsim.specs.model import ModelSpec as _Spec
    from zsim.workload.transformer import count_params
    base = {"model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912, "num_attention_heads": 4,
            "num_key_value_heads": 1, "head_dim": 256, "num_hidden_layers": 26, "vocab_size": 262144,
            "max_position_embeddings": 32768, "sliding_window": 512}
    path = tmp_path / "config.json"
    path.write_text(_json.dumps(base))
    m = _build(_Spec, read_hf_config(path), "model")
    assert (m.qk_norm, m.post_norms, m.tied_embeddings, m.sliding_window_pattern) == (True, True, True, 6)
    assert [i for i in range(26) if not m.has_window(i)] == [5, 11, 17, 23]
    # google/gemma-3-1b-it: 999,885,952 parameters (its model card's safetensors count)
    assert count_params(m) == 999_885_952
    types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(26)]
    path.write_text(_json.dumps(dict(base, layer_types=types)))
    m4 = _build(_Spec, read_hf_config(path), "model")
    assert [i for i in range(26) if not m4.has_window(i)] == [3, 7, 11, 15, 19, 23]


def test_gpt_oss_reads_as_transformers_builds_it():
    """openai/gpt-oss-20b's config.json (scenarios/hub/): modeling_gpt_oss.py's GptOssAttention
    (q/k/v/o_proj with bias, head_dim 64, a sink logit per head), layer_types alternating sliding
    (128) and full, GptOssExperts (gate_up_proj of 2 x intermediate_size and down_proj, with biases)
    under a router; its parameters counted from those modules' shapes. zsim leaves out the sinks
    and the router's bias (one scalar per head and per expert: 2,304 of 20.9 B)."""
    import json as _json
    from zsim.config.hf_config import read_hf_config
    from zsim.schema import build as _build
    from zsim.specs.model import ModelSpec as _Spec
    from zsim.workload.transformer import count_params
    from tests.helpers import ROOT
    path = ROOT / "scenarios" / "hub" / "openai--gpt-oss-20b.json"
    m = _build(_Spec, read_hf_config(path), "model")
    assert (m.attention_sinks, m.attn_bias, m.mlp_proj_bias, m.fused_gate_up, m.head_size) == (True, True, True, True, 64)
    assert (m.moe.experts, m.moe.top_k, m.moe.dispatch, m.sliding_window) == (32, 4, "dropless", 128)
    assert [i for i in range(24) if m.has_window(i)] == list(range(0, 24, 2))
    c = _json.loads(path.read_text())
    V, H, L, nh, nkv, hd = (c["vocab_size"], c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
                            c["num_key_value_heads"], c["head_dim"])
    E, inter = c["num_local_experts"], c["intermediate_size"]
    attention = (H * nh * hd + nh * hd) + 2 * (H * nkv * hd + nkv * hd) + (nh * hd * H + H) + nh   # + sinks
    experts = E * H * 2 * inter + E * 2 * inter + E * inter * H + E * H
    layer = 2 * H + attention + (E * H + E) + experts
    total = 2 * V * H + L * layer + H
    assert total == 20_914_757_184                       # the 20.9 B of OpenAI's model card
    assert count_params(m) == total - L * (nh + E)


def test_a_model_with_attention_sinks_runs_eager_by_default_and_refuses_sdpa():
    """GptOssPreTrainedModel._supports_sdpa is False: from_pretrained's default falls back to eager
    under the HF Trainer, and an explicit sdpa is refused as transformers refuses it."""
    from tests.helpers import ROOT, scenario
    gpt_oss = {"hf_config": str(ROOT / "scenarios" / "hub" / "openai--gpt-oss-20b.json")}
    sc = scenario(**{"model": gpt_oss, "training.framework": "hf_trainer", "training.seq_len": 512})
    assert sc.training.attn_implementation_used == "eager"
    assert any("attention: eager" in n for n in sc.notes)
    fa3 = scenario(**{"model": gpt_oss, "training.framework": "hf_trainer", "training.seq_len": 512,
                      "training.attn_implementation": "flash_attention_3"})
    assert fa3.training.attn_implementation_used == "flash_attention_3"
    with pytest.raises(ZsimInputError, match="attention sinks"):
        scenario(**{"model": gpt_oss, "training.attn_implementation": "sdpa", "training.seq_len": 512})


@pytest.mark.parametrize("model_type, extra, per_layer, outside", [
    # glm4 (modeling_glm4.py): q/k/v_proj with bias, o_proj without, gate_up_proj, down_proj, 4 RMSNorms
    ("glm4", {"head_dim": 16, "attention_bias": True, "tie_word_embeddings": False},
     lambda H, q, kv, f: (H * q + q) + 2 * (H * kv + kv) + q * H + H * 2 * f + f * H + 4 * H,
     lambda V, H: 2 * V * H + H),
    # granite (Llama's modules): q/k/v/o, gate/up/down, 2 RMSNorms; tied
    ("granite", {"tie_word_embeddings": True},
     lambda H, q, kv, f: H * q + 2 * H * kv + q * H + 3 * H * f + 2 * H, lambda V, H: V * H + H),
    ("smollm3", {"tie_word_embeddings": True},
     lambda H, q, kv, f: H * q + 2 * H * kv + q * H + 3 * H * f + 2 * H, lambda V, H: V * H + H),
    # starcoder2: LayerNorms with bias, every projection with bias (use_bias), c_fc/c_proj GeLU MLP; tied
    ("starcoder2", {"tie_word_embeddings": True, "use_bias": True},
     lambda H, q, kv, f: 2 * H + (H * q + q) + 2 * (H * kv + kv) + (q * H + H) + 2 * H + (H * f + f) + (f * H + H),
     lambda V, H: V * H + 2 * H),
])
def test_more_llama_like_families_count_their_modules(model_type, extra, per_layer, outside):
    from zsim.schema import build as _build
    from zsim.specs.model import ModelSpec as _Spec
    from zsim.workload.transformer import count_params
    H, heads, kv, f, V, L = 64, 4, 2, 128, 100, 3
    config = {"model_type": model_type, "hidden_size": H, "num_attention_heads": heads, "num_key_value_heads": kv,
              "intermediate_size": f, "num_hidden_layers": L, "vocab_size": V, "max_position_embeddings": 256, **extra}
    m = _build(_Spec, model_from_hf(config, "config.json"), "model")
    hd = config.get("head_dim", H // heads)
    assert count_params(m) == L * per_layer(H, heads * hd, kv * hd, f) + outside(V, H)


def test_new_families_need_the_keys_whose_defaults_moved():
    config = {"model_type": "granite", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
              "num_hidden_layers": 2, "vocab_size": 100, "max_position_embeddings": 256, "tie_word_embeddings": True}
    with pytest.raises(ZsimInputError, match="num_key_value_heads"):
        model_from_hf(config, "config.json")
