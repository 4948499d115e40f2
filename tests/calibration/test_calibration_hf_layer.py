"""`zsim calibrate --hf-layer` (calibration/commands/calibrate_hf.py): the fit of a measured HF
decoder layer on records committed from a CPU run (no torch needed), the written profile loaded
and run by zsim, argument errors, and a real measurement of a tiny Llama (torch and transformers
only; skipped without them)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from calibration.commands.calibrate_hf import fit_profile, model_spec, pricings, timed_layer_index
from calibration.harness.fit_hf_layer import GROUPS, PASSES, measured_groups, zsim_group
from zsim.cli import main as cli_main
from zsim.config.profile import load_profile

FIX = Path(__file__).parents[1] / "fixtures" / "hf_layer"
DENSE_GROUPS = {"attn_proj", "attention_core", "mlp_proj", "mlp_act", "norm", "residual", "layer"}
MOE_GROUPS = {"attn_proj", "attention_core", "router", "experts", "norm", "residual", "layer"}


def _doc(name: str) -> dict:
    return json.loads((FIX / name / "records.json").read_text())


@pytest.mark.parametrize("name,groups", [("tiny-llama", DENSE_GROUPS), ("tiny-mixtral", MOE_GROUPS)])
def test_records_hold_every_module_kind_and_pass(name, groups):
    doc = _doc(name)
    measured = measured_groups(doc["records"])
    for s, b in doc["plan"]["shapes"]:
        have = {g for (s2, b2, g, p) in measured if (s2, b2) == (s, b)}
        assert have == groups
        for g in groups:
            assert all((s, b, g, p) in measured for p in PASSES), g
    # the raw records name each linear of the layer, per pass
    mods = {r["module"] for r in doc["records"]}
    assert {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "layer",
            "input_layernorm", "post_attention_layernorm", "+"} <= mods
    assert ({"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"} if name == "tiny-llama" else {"mlp.gate"}) <= mods


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mixtral"])
def test_every_zsim_module_of_the_layer_has_a_measured_kind(name):
    plan = _doc(name)["plan"]
    spec = model_spec(plan["config"], plan["model"])
    layer = timed_layer_index(spec)
    pr = pricings(spec, [tuple(x) for x in plan["shapes"]], plan["dtype"], plan["attn_implementation"], layer)
    for p in pr.values():
        kinds = {zsim_group(m, p.moe_layer) for m in p.modules}
        assert "other" not in kinds and kinds <= set(GROUPS)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mixtral"])
def test_fit_reduces_the_error_on_the_measured_layer(name):
    profile, report = fit_profile(name + "-fit", _doc(name), "cpu-gloo-localhost")
    assert report["rms_error"] < report["rms_error_before"]
    # the layer's own rows too: their summed squared error falls
    def layer_sq(res):
        return sum(r["error"] ** 2 for r in res if r["group"] == "layer" and r["fitted"])
    assert layer_sq(report["residuals"]) < layer_sq(report["residuals_before"])
    g = profile["gpu"]
    base = load_profile("cpu-gloo-localhost").gpu
    assert g["peak_tflops_fp32"] == base.peak_tflops_fp32   # the peak stays the base profile's
    for k in ("gemm_max_efficiency", "memory_bound_efficiency", "flash_attention_fwd_efficiency",
              "flash_attention_bwd_efficiency"):
        assert 0 < g[k] <= 1
    assert profile["provenance"]["model"] == f"{name}.json" and profile["provenance"]["transformers"]


def test_refit_writes_a_profile_zsim_loads_and_runs(tmp_path, capsys):
    root = tmp_path / "root"
    code = cli_main(["calibrate", "--hf-layer", "--from-run", str(FIX / "tiny-llama"), "--out", "hf-tiny",
                     "--root", str(root)])
    assert code == 0
    err = capsys.readouterr().err
    assert "s64-b2 layer fwd: measured" in err and "RMS relative error" in err
    path = root / "hardware_profiles" / "hf-tiny.yaml"
    first = path.read_text()
    rep = json.loads((root / "calibration" / "runs" / "hf-tiny" / "fit_report.json").read_text())
    assert rep["residuals"] and {r["group"] for r in rep["residuals"]} == DENSE_GROUPS
    assert (root / "calibration" / "runs" / "hf-tiny" / "records.json").is_file()
    prof = load_profile(str(path))
    assert prof.gpu.kernel_overhead_us == pytest.approx(rep["fields"]["kernel_overhead_us"], rel=1e-5)
    # a scenario of the same model runs on the profile
    import yaml
    from zsim.api import run_file
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({
        "model": {"hf_config": str(FIX / "tiny-llama.json")},
        "training": {"seq_len": 64, "precision": "fp32", "micro_batch_size": 2},
        "hardware": {"profile": str(path), "nodes": 1, "gpus_per_node": 2},
        "deepspeed": {"zero_optimization": {"stage": 3}}}))
    res, _ = run_file(tmp_path / "s.yaml")
    assert res.step_time_s > 0
    # refused without --force; byte-identical with it
    assert cli_main(["calibrate", "--hf-layer", "--from-run", str(FIX / "tiny-llama"), "--out", "hf-tiny",
                     "--root", str(root)]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli_main(["calibrate", "--hf-layer", "--from-run", str(FIX / "tiny-llama"), "--out", "hf-tiny",
                     "--root", str(root), "--force"]) == 0
    assert path.read_text() == first


@pytest.mark.parametrize("argv,field", [
    (["--model", "no/such/config.json", "--base", "cpu-gloo-localhost"], "--model"),
    (["--model", str(FIX / "tiny-llama.json")], "--base"),
    (["--model", str(FIX / "tiny-llama.json"), "--base", "cpu-gloo-localhost", "--seq-len", "0"], "--seq-len"),
    (["--model", str(FIX / "tiny-llama.json"), "--base", "cpu-gloo-localhost", "--dtype", "fp32,bf16"], "--dtype"),
    (["--model", str(FIX / "tiny-llama.json"), "--base", "cpu-gloo-localhost", "--quick"], "--quick"),
    (["--model", str(FIX.parents[2] / "scenarios" / "gpt3-175b-zero3.yaml"), "--base", "cpu-gloo-localhost"], "--model"),
])
def test_bad_arguments_are_one_line(tmp_path, capsys, argv, field):
    code = cli_main(["calibrate", "--hf-layer", "--out", "x", "--root", str(tmp_path), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and field in err[0], err


def test_without_transformers_the_error_names_the_extra(tmp_path, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "transformers" else real(n, *a))
    code = cli_main(["calibrate", "--hf-layer", "--out", "x", "--root", str(tmp_path), "--model",
                     str(FIX / "tiny-llama.json"), "--base", "cpu-gloo-localhost"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "[calibration,hf]" in err[0]


def test_measure_a_tiny_llama_layer_on_this_device():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from calibration.harness.hf_layer import measure
    cfg = json.loads((FIX / "tiny-llama.json").read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        recs = measure(cfg, [(32, 1)], "fp32", "sdpa", 0, reps=2, warmup=1, min_rep_s=0.0005)
    finally:
        torch.set_num_threads(threads)
    assert {(r["module"], r["pass"]) for r in recs} == {
        (m, p) for m in ("layer", "self_attn", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                         "self_attn.o_proj", "mlp", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                         "input_layernorm", "post_attention_layernorm", "+")
        for p in ("fwd", "bwd", "bwd_ckpt")}
    assert all(r["time_s"] > 0 and len(r["times_s"]) == 2 for r in recs)
    assert set(g for (_, _, g, _) in measured_groups(recs)) == DENSE_GROUPS


def test_calibrate_a_tiny_mixtral_layer_end_to_end(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code = cli_main(["calibrate", "--hf-layer", "--model", str(FIX / "tiny-mixtral.json"), "--seq-len", "32",
                         "--micro-batch", "1", "--dtype", "fp32", "--reps", "2", "--base", "cpu-gloo-localhost",
                         "--out", "hf-mix", "--root", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "calibration" / "runs" / "hf-mix" / "records.json").read_text())
    assert doc["provenance"]["transformers"] and doc["provenance"]["device"] in ("cpu", "cuda")
    assert {g for (_, _, g, _) in measured_groups(doc["records"])} == MOE_GROUPS
    prof = load_profile(str(tmp_path / "hardware_profiles" / "hf-mix.yaml"))
    assert prof.provenance["model_type"] == "mixtral" and prof.provenance["shapes"] == "s32-b1"
