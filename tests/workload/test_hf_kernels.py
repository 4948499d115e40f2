"""training.kernels / attn_implementation / padding_mask: HF's op-by-op kernels and SDPA's
backend choice (zsim/workload/hf_kernels.py; see [Note: SDPA with a padding mask])."""
import subprocess
import sys

import pytest

from zsim.config.scenario import scenario_from_mapping
from zsim.errors import ZsimInputError
from zsim.schema import build
from zsim.specs.model import PRESETS, ModelSpec
from zsim.specs.scenario import TrainingSpec
from zsim.workload import hf_kernels
from zsim.workload.transformer import build_workload

LLAMA = build(ModelSpec, dict(PRESETS["llama3-8b"], layers=2, hidden=512, heads=8, kv_heads=2, ffn_hidden=1408,
                              vocab=1000, seq_len=256), "model")


def _wl(**kw):
    return build_workload(LLAMA, micro_batch_size=2, seq_len=256, precision="bf16", flash_attention=True,
                          dropout=False, **kw)


def _mod(wl, suffix):
    return next(m for m in wl.modules if m.name.endswith(suffix))


def test_per_element_bytes_follow_the_op_by_op_counts():
    n = hf_kernels.rms_norm(2)
    assert (n.fwd + n.fp32_fwd, n.bwd + n.fp32_bwd, n.act) == (36, 92, 6)
    n32 = hf_kernels.rms_norm(4)      # the two casts are no-ops in fp32
    assert (n32.fwd + n32.fp32_fwd, n32.act, n32.kernels_fwd) == (28, 8, 6)
    r = hf_kernels.rope(2)
    assert (r.fwd, r.bwd, r.act) == (20, 30, 0)
    g = hf_kernels.swiglu(2)
    assert (g.fwd, g.bwd, g.act) == (10, 18, 6)
    k = hf_kernels.repeat_kv(2, heads=8, kv_heads=2)
    assert (k.fwd, k.bwd, k.act) == (10, 10, 6)


def test_hf_kernels_charge_the_norm_rope_and_swiglu_op_by_op():
    t, h, f = 2 * 256, 512, 1408
    fused, hf = _wl(), _wl(kernels="hf")
    nf, nh = _mod(fused, "layers.0.ln_1"), _mod(hf, "layers.0.ln_1")
    assert (nf.fwd_mem_bytes + nf.fp32_fwd_mem_bytes, nf.act_bytes) == (4 * t * h, 2 * t * h)
    assert (nh.fwd_mem_bytes + nh.fp32_fwd_mem_bytes, nh.bwd_mem_bytes + nh.fp32_bwd_mem_bytes) == (36 * t * h,
                                                                                                     92 * t * h)
    assert nh.act_bytes == 6 * t * h and nh.kernels_fwd == 8
    af, ah = _mod(fused, "layers.0.mlp.act"), _mod(hf, "layers.0.mlp.act")
    assert (af.fwd_mem_bytes, ah.fwd_mem_bytes, ah.bwd_mem_bytes) == (6 * t * f, 10 * t * f, 18 * t * f)
    assert ah.act_bytes - af.act_bytes == 2 * t * f       # the SiLU output mul saves
    cf, ch = _mod(fused, "layers.0.attn.core"), _mod(hf, "layers.0.attn.core")
    rope_elems = t * (512 + 128)                          # q and k widths (2 of 8 heads for k)
    assert ch.fwd_mem_bytes - cf.fwd_mem_bytes == (20 - 8) * rope_elems
    assert ch.bwd_mem_bytes - cf.bwd_mem_bytes == (30 - 8) * rope_elems
    # FLOPs and GEMMs are the same code's either way
    assert [m.fwd_flops for m in fused.modules] == [m.fwd_flops for m in hf.modules]


def test_sdpa_with_a_padding_mask_runs_the_full_square_and_repeats_kv():
    causal = _mod(_wl(kernels="hf", attn_implementation="sdpa"), "attn.core")
    masked = _mod(_wl(kernels="hf", attn_implementation="sdpa", padding_mask=True), "attn.core")
    assert masked.fwd_flops == 2 * causal.fwd_flops and masked.bwd_flops == 2 * causal.bwd_flops
    assert masked.model_fwd_flops == causal.model_fwd_flops          # MFU counts the same work
    t = 2 * 256
    # repeat_kv: K and V (128 wide each) copied to 512 (6 B more kept per K/V element)
    assert masked.act_bytes - causal.act_bytes == 6 * t * 2 * 128
    fa2 = _mod(_wl(kernels="hf", attn_implementation="flash_attention_2", padding_mask=True), "attn.core")
    assert fa2.fwd_flops == causal.fwd_flops and fa2.act_bytes == causal.act_bytes


def _scenario(training):
    return scenario_from_mapping({
        "name": "t", "model": {"preset": "llama3-8b"}, "hardware": {"profile": "dgx-h100", "nodes": 1},
        "training": dict(dict(micro_batch_size=1, gradient_accumulation_steps=1, seq_len=1024), **training),
        "deepspeed": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}}, None)


def test_defaults_follow_the_framework_and_are_shown():
    hf = _scenario({"framework": "hf_trainer"}).training
    assert (hf.attn_implementation_used, hf.kernels_used) == ("sdpa", "hf")
    assert hf.implementation == "implementation: attention sdpa (flash backend, causal); kernels hf (op by op)"
    other = _scenario({}).training
    assert (other.attn_implementation_used, other.kernels_used) == ("flash_attention_2", "fused")
    assert _scenario({"flash_attention": False}).training.attn_implementation_used == "eager"
    eager = _scenario({"attn_implementation": "eager"}).training
    assert eager.flash_attention is False


def test_an_hf_run_is_slower_op_by_op_than_fused():
    from zsim.api import run_scenario
    hf, _ = run_scenario(_scenario({"framework": "hf_trainer"}))
    fused, _ = run_scenario(_scenario({"framework": "hf_trainer", "kernels": "fused"}))
    assert hf.compute_time_s > fused.compute_time_s
    assert hf.implementation.endswith("kernels hf (op by op)") and fused.implementation.endswith("kernels fused")


def test_contradictory_attention_settings_are_refused_in_one_line():
    with pytest.raises(ZsimInputError, match="training.attn_implementation"):
        _scenario({"attn_implementation": "sdpa", "flash_attention": False})
    with pytest.raises(ZsimInputError, match="training.attn_implementation"):
        _scenario({"attn_implementation": "flash_attention_9"})
    assert TrainingSpec(attn_implementation="flash_attention_3").implementation.startswith(
        "implementation: attention flash_attention_3 (priced at the profile's FlashAttention figures)")


def test_launch_flag_attn_implementation(tmp_path):
    cmd = ("deepspeed --num_gpus 8 train.py --deepspeed ds.json --model_name_or_path llama3-8b "
           "--per_device_train_batch_size 1 --bf16 --attn_implementation flex_attention")
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}, '
                                      '"train_micro_batch_size_per_gpu": "auto"}')
    (tmp_path / "run.sh").write_text(cmd + "\n")
    out = subprocess.run([sys.executable, "-m", "zsim.cli", "run", str(tmp_path / "run.sh"), "--profile",
                          "dgx-h100"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "flex_attention: priced as flash_attention_2" in out.stderr
    assert "implementation: attention flash_attention_2; kernels hf (op by op)" in out.stdout


def _run_recipe(tmp_path, text):
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}, '
                                      '"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": '
                                      '"auto"}')
    (tmp_path / "r.yaml").write_text(text)
    out = subprocess.run([sys.executable, "-m", "zsim.cli", "run", str(tmp_path / "r.yaml"), "--profile", "dgx-h100",
                          "--gpus", "8", "--json", str(tmp_path / "o.json"), "--quiet"], capture_output=True, text=True,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    import json
    return json.loads((tmp_path / "o.json").read_text())["implementation"], out.stderr


def test_axolotl_attention_switches_and_liger(tmp_path):
    base = ("base_model: meta-llama/Llama-3.1-8B\nsequence_len: 1024\nmicro_batch_size: 1\n"
            "gradient_accumulation_steps: 1\nbf16: true\ndeepspeed: ds.json\n")
    impl, _ = _run_recipe(tmp_path, base)
    assert impl == "implementation: attention sdpa (flash backend, causal); kernels hf (op by op)"
    impl, _ = _run_recipe(tmp_path, base + "flash_attention: true\n")
    assert impl == "implementation: attention flash_attention_2; kernels hf (op by op)"
    impl, err = _run_recipe(tmp_path, base + "flash_attention: true\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\n"
                            "liger_rms_norm: true\nliger_glu_activation: true\nliger_rope: true\n"
                            "liger_fused_linear_cross_entropy: true\n")
    assert impl == "implementation: attention flash_attention_2; kernels fused; loss Liger's fused linear cross-entropy"
    assert "LigerPlugin" not in err        # modelled, so not in the 'ignored' note


def test_llama_factory_flash_attn_and_liger(tmp_path):
    base = ("model_name_or_path: meta-llama/Llama-3.1-8B\nstage: sft\nfinetuning_type: full\ncutoff_len: 1024\n"
            "per_device_train_batch_size: 1\ngradient_accumulation_steps: 1\nbf16: true\ndeepspeed: ds.json\n")
    impl, _ = _run_recipe(tmp_path, base)
    assert impl.startswith("implementation: attention sdpa")
    impl, _ = _run_recipe(tmp_path, base + "flash_attn: disabled\nenable_liger_kernel: true\n")
    assert impl == "implementation: attention eager; kernels fused; loss Liger's fused linear cross-entropy"
    impl, _ = _run_recipe(tmp_path, base + "flash_attn: fa2\n")
    assert impl == "implementation: attention flash_attention_2; kernels hf (op by op)"


def test_an_auto_ds_config_is_an_hf_trainer_run():
    sc = scenario_from_mapping({
        "name": "t", "model": {"preset": "llama3-8b"}, "hardware": {"profile": "dgx-h100", "nodes": 1},
        "training": {"micro_batch_size": 1, "seq_len": 1024},
        "deepspeed": {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3},
                      "gradient_accumulation_steps": "auto"}}, None)
    assert sc.training.framework == "hf_trainer" and sc.training.kernels_used == "hf"
    assert any(n.startswith("training.framework: hf_trainer, as the ds_config's \"auto\" values say")
               for n in sc.notes)
    stated = scenario_from_mapping({
        "name": "t", "model": {"preset": "llama3-8b"}, "hardware": {"profile": "dgx-h100", "nodes": 1},
        "training": {"micro_batch_size": 1, "seq_len": 1024, "framework": "deepspeed"},
        "deepspeed": {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}}, None)
    assert stated.training.framework == "deepspeed" and stated.training.kernels_used == "fused"


def test_the_trainers_optim_builds_the_optimizer_only_without_a_block():
    """training.optim (HF TrainingArguments.optim): adamw_torch is torch AdamW (foreach, weight
    decay 0.0) when the ds_config has no optimizer block; a block wins, as in the HF Trainer."""
    base = {"name": "t", "model": {"preset": "llama3-8b"}, "hardware": {"profile": "dgx-h100", "nodes": 1},
            "training": {"micro_batch_size": 1, "seq_len": 1024, "optim": "adamw_torch"},
            "deepspeed": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}}
    sc = scenario_from_mapping(base, None)
    assert sc.deepspeed.optimizer.params == {"torch_adam": True, "weight_decay": 0.0}
    assert sc.deepspeed.optimizer.step_bytes_per_param == 72.0
    with_block = dict(base, deepspeed=dict(base["deepspeed"], optimizer={"type": "AdamW", "params": {"lr": 1e-5}}))
    sc = scenario_from_mapping(with_block, None)
    assert sc.deepspeed.optimizer.step_bytes_per_param == 28.0
    assert any(n.startswith("training.optim adamw_torch: not used") for n in sc.notes)
    fused = scenario_from_mapping(dict(base, training=dict(base["training"], optim="adamw_torch_fused")), None)
    assert fused.deepspeed.optimizer.step_bytes_per_param == 28.0
