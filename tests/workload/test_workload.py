"""Parameter counts equal the published ones; activation bytes follow Korthikanti et al. 2022."""
import pytest

from zsim.schema import build
from zsim.specs.model import PRESETS, PUBLISHED_NOMINAL_PARAMS, PUBLISHED_PARAMS, ModelSpec
from zsim.workload.transformer import build_workload, count_params


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_count_is_published_exactly(name):
    assert count_params(build(ModelSpec, PRESETS[name], "model")) == PUBLISHED_PARAMS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_NOMINAL_PARAMS))
def test_gpt3_sizes_match_the_paper_within_two_percent(name):
    n = count_params(build(ModelSpec, PRESETS[name], "model"))
    assert abs(n - PUBLISHED_NOMINAL_PARAMS[name]) / PUBLISHED_NOMINAL_PARAMS[name] < 0.02


def test_mpt_counts_match_the_reference_table_at_other_sequence_lengths():
    # shared/reference/published-h100-bf16.csv: learned positions make the count depend on seq_len
    spec = build(ModelSpec, dict(PRESETS["mpt-7b"], seq_len=65536), "model")
    assert count_params(spec) == 6918905856
    spec = build(ModelSpec, dict(PRESETS["mpt-760m"], seq_len=512), "model")
    assert count_params(spec) == 758111232


def _layer_act(m, b, s, flash, dropout, precision="bf16"):
    wl = build_workload(m, b, s, precision, flash_attention=flash, dropout=dropout)
    return sum(x.act_bytes for x in wl.layer_modules(0)), wl


GPT = build(ModelSpec, dict(layers=2, hidden=1024, heads=16, vocab=1000, seq_len=512), "model")


def test_korthikanti_34sbh_plus_5as2b_without_flash_with_dropout():
    b, s, h, a = 4, 512, 1024, 16
    act, _ = _layer_act(GPT, b, s, flash=False, dropout=True)
    assert act == 34 * s * b * h + 5 * a * s * s * b


def test_flash_attention_drops_the_s2_terms():
    b, s, h, a = 4, 512, 1024, 16
    act, _ = _layer_act(GPT, b, s, flash=True, dropout=True)
    lse = 4 * b * a * s   # FlashAttention's fp32 log-sum-exp
    assert act == 34 * s * b * h + lse


def test_no_dropout_removes_the_two_masks():
    b, s, h, a = 4, 512, 1024, 16
    act, _ = _layer_act(GPT, b, s, flash=False, dropout=False)
    assert act == 32 * s * b * h + 2 * a * s * s * b   # softmax output only (2 bytes per score)


def test_gqa_shrinks_k_and_v():
    m = build(ModelSpec, dict(layers=1, hidden=1024, heads=16, kv_heads=4, vocab=1000, seq_len=512), "model")
    full, _ = _layer_act(GPT, 1, 512, flash=True, dropout=False)
    gqa, _ = _layer_act(m, 1, 512, flash=True, dropout=False)
    kv_saved = 2 * 2 * 512 * (1024 - 256)   # K and V, 2 bytes, hidden vs kv_dim
    assert full - gqa == kv_saved


def test_model_flops_follow_6n_plus_attention():
    m = build(ModelSpec, dict(layers=4, hidden=2048, heads=16, vocab=50000, seq_len=2048, position="rope",
                              tied_embeddings=False, bias=False, norm="rmsnorm"), "model")
    b, s = 2, 2048
    wl = build_workload(m, b, s, "bf16", flash_attention=True, dropout=False)
    matmul_params = 4 * 12 * 2048 * 2048 + 50000 * 2048          # blocks + lm_head
    attention = 4 * (4 * b * s * s * 2048)
    assert wl.model_flops == pytest.approx(3 * (2 * b * s * matmul_params + attention))


def test_optimizer_step_traffic_counts_deepspeeds_passes():
    from zsim.schedule.optimizer import step_bytes_per_param
    # bf16 with clipping: flatten 2+2, convert 2+4, clip 8, Adam 28, copy back 4+2, zero grads 2
    assert step_bytes_per_param(2, True) == 4 + 6 + 8 + 28 + 6 + 2
    # fp32 without clipping: flatten 4+4, no conversion, copy back 4+4, zero 4
    assert step_bytes_per_param(4, False) == 8 + 28 + 8 + 4
    # stage 0 converts each gradient on its own: no flatten
    assert step_bytes_per_param(2, True, flatten=False) == 6 + 8 + 28 + 6 + 2


def test_norm_and_overflow_passes_are_charged_at_the_step_rate():
    """DeepSpeed 0.19.8 takes the norm of every local gradient piece in fp64 and checks each for
    inf/NaN with amax/amin; both stream the shard before the step, on the optimizer's rate."""
    from pathlib import Path
    from zsim.config.scenario import load_scenario
    from zsim.schedule.build import build_schedule
    from zsim.schedule.ir import OpKind
    from zsim.schedule.optimizer import norm_bytes_per_param, overflow_bytes_per_param
    assert norm_bytes_per_param(2) == 2 + 8 + 8
    assert overflow_bytes_per_param(2) == 4
    sc = load_scenario(str(Path(__file__).resolve().parents[2] / "scenarios" / "default.yaml"), ("deepspeed.zero_optimization.stage=2",
                                                                  "training.precision=bf16"))
    _, sched = build_schedule(sc)
    norm = next(o for o in sched.ops if o.kind == OpKind.GRAD_NORM)
    adam = next(o for o in sched.ops if o.kind == OpKind.OPTIMIZER_STEP)
    shard = adam.work.optimizer_bytes / 54   # bf16 with clipping, flattened
    assert norm.work.optimizer_bytes == pytest.approx(shard * (18 + 4))
    assert norm.work.mem_bytes == 0


# ---- architectures beyond GPT/Llama (docs/model.md) ----------------------------------------------
SMALL = dict(layers=2, hidden=64, heads=4, vocab=128, seq_len=64, ffn_hidden=96, position="rope", norm="rmsnorm",
             glu=True, fused_qkv=False, bias=False, tied_embeddings=False)


def _modules(fields, s=32, flash=True):
    wl = build_workload(build(ModelSpec, fields, "model"), 1, s, "bf16", flash_attention=flash, dropout=False)
    return {m.name: m for m in wl.modules}, {p.name: p.numel for p in wl.params}


def test_sliding_window_attention_computes_the_band_only_with_flash_attention():
    b, s, w, h = 1, 32, 8, 64
    full, _ = _modules(SMALL, s)
    win, _ = _modules(dict(SMALL, sliding_window=w), s)
    core, wcore = full["layers.0.attn.core"], win["layers.0.attn.core"]
    assert wcore.model_fwd_flops == 2 * b * s * w * 2 * h                    # s x W pairs, QK^T and AV
    assert wcore.fwd_flops == 2 * b * (s * w - w * (w - 1) / 2) * 2 * h       # the causal band
    assert core.fwd_flops == core.model_fwd_flops / 2
    eager, _ = _modules(dict(SMALL, sliding_window=w), s, flash=False)
    assert eager["layers.0.attn.core"].fwd_flops == 2 * b * s * s * 2 * h     # a mask saves eager nothing
    alt, _ = _modules(dict(SMALL, sliding_window=w, sliding_window_layers="even"), s)
    assert alt["layers.0.attn.core"].fwd_flops < alt["layers.1.attn.core"].fwd_flops


def test_biases_norms_and_fused_projections_follow_the_fields():
    _, p = _modules(dict(SMALL, qkv_bias=True))                               # Qwen2
    assert "layers.0.attn.q_proj.bias" in p and "layers.0.attn.o_proj.bias" not in p
    _, p = _modules(dict(SMALL, post_norms=True))                             # Gemma-2: 4 norms a block
    block_norms = [n for n in p if n.startswith("layers.0.") and n.count(".") == 3]   # layers.0.<norm>.weight
    assert block_norms == ["layers.0.ln_1.weight", "layers.0.post_attn_ln.weight", "layers.0.ln_2.weight",
                           "layers.0.post_mlp_ln.weight"]
    _, p = _modules(dict(SMALL, fused_qkv=True, fused_gate_up=True))          # Phi-3
    assert p["layers.0.mlp.gate_up_proj.weight"] == 64 * 2 * 96 and "layers.0.mlp.up_proj.weight" not in p
    _, p = _modules(dict(SMALL, parallel_residual=True, shared_norm=True))    # Falcon-7B
    assert "layers.0.ln_2.weight" not in p


def test_mla_projections_and_core_widths():
    mla = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=24)
    m, p = _modules(dict(SMALL, mla=mla))
    assert p["layers.0.attn.q_a_proj.weight"] == 64 * 24 and p["layers.0.attn.q_a_layernorm.weight"] == 24
    assert p["layers.0.attn.q_b_proj.weight"] == 24 * 4 * 24
    assert p["layers.0.attn.kv_a_proj_with_mqa.weight"] == 64 * (32 + 8)
    assert p["layers.0.attn.kv_b_proj.weight"] == 32 * 4 * (16 + 12)
    assert p["layers.0.attn.o_proj.weight"] == 4 * 12 * 64
    s = 32
    assert m["layers.0.attn.core"].model_fwd_flops == 2 * s * s * (4 * 24 + 4 * 12)
    with pytest.raises(Exception, match="MLA"):
        build(ModelSpec, dict(SMALL, mla=mla, kv_heads=2), "model")


def test_workloads_are_memoised_on_every_input_they_read():
    """zsim/schedule/build.py workload_for: equal inputs share one frozen workload (a search's
    variants), any input that changes the model's modules gives another."""
    from tests.helpers import ROOT, mapping
    from zsim.config.scenario import scenario_from_mapping
    from zsim.schedule.build import workload_for

    base = mapping(**{"training.micro_batch_size": 2})
    same = workload_for(scenario_from_mapping(base, ROOT))
    assert workload_for(scenario_from_mapping(mapping(**{"training.micro_batch_size": 2,
                                                         "deepspeed.zero_optimization.stage": 2}), ROOT)) is same
    for change in ({"training.micro_batch_size": 4}, {"training.activation_checkpointing": "full",
                                                      "training.lora": {"r": 4}},
                   {"parallelism.tensor": 2}, {"training.precision": "fp32"}):
        other = workload_for(scenario_from_mapping(mapping(**{"training.micro_batch_size": 2, **change}), ROOT))
        assert other is not same and other != same
