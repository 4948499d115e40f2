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
    sc = load_scenario(str(Path(__file__).resolve().parents[1] / "scenarios" / "default.yaml"), ("deepspeed.zero_optimization.stage=2",
                                                                  "training.precision=bf16"))
    _, sched = build_schedule(sc)
    norm = next(o for o in sched.ops if o.kind == OpKind.GRAD_NORM)
    adam = next(o for o in sched.ops if o.kind == OpKind.OPTIMIZER_STEP)
    shard = adam.work.optimizer_bytes / 54   # bf16 with clipping, flattened
    assert norm.work.optimizer_bytes == pytest.approx(shard * (18 + 4))
    assert norm.work.mem_bytes == 0
