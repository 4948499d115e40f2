"""Issue 17's examples, one regression test each (in process through zsim.cli.main), and every new
CLI path as a user runs it (subprocess), refusals included."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.commands.fuzz import Deep
from tests.helpers import check, run_cli
from tests.helpers import ROOT, TINY, mapping

DEFAULT = str(ROOT / "scenarios" / "default.yaml")
LLAMA3 = str(ROOT / "scenarios" / "llama3-8b-zero3-8xh100.yaml")


def write(tmp_path, raw, name="s.yaml") -> str:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw))
    return str(p)


def zsim(*argv, cwd=ROOT):
    """`zsim ...` as a user runs it (the console script is `python -m zsim.cli`)."""
    return subprocess.run([sys.executable, "-m", "zsim.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


def refused(argv, *words):
    out = run_cli(argv)
    check(out, argv)
    assert out.code == 2, out
    for w in words:
        assert w in out.stderr, (w, out.stderr)
    return out.stderr


# ---- the fuzzer's findings --------------------------------------------------------------------
@pytest.mark.parametrize("assignment,words", [
    ("deepspeed.zero_optimization.stage=true", ["stage", "True", "boolean"]),
    ("model.preset=[gpt2]", ["model.preset", "unknown preset"]),
    ("hardware.override.intra_node.efficiency_by_size=[]", ["efficiency_by_size", "fractions in (0, 1]"]),
    ("hardware.override.intra_node.efficiency_by_size=[[1000, 0]]", ["efficiency_by_size"]),
    ("hardware.override.intra_node.efficiency_by_size=[[1000, -0.5]]", ["efficiency_by_size"]),
    ("training.gradient_accumulation_steps=1000000", ["gradient_accumulation_steps", "at most 65536"]),
    ("hardware.nodes=1e30", ["hardware.nodes", "2**63"]),
    ("hardware.nodes=40000", ["hardware.nodes", "262,144"]),
    ("model.layers=100000", ["model.layers", "at most 1024"]),
    ("hardware.override.gpu.hbm_bw_GBps=5e-324", ["hbm_bw_GBps", "at least 1e-9"]),
    ("training.micro_batch_size=1e30", ["micro_batch_size", "too large"]),
    ("deepspeed.communication_data_type=bfp16", ["communication_data_type", "fp16, bf16, fp32"]),
    (("deepspeed.bf16={enabled: true}", "deepspeed.bfloat16={enabled: false}"), ["bfloat16", "keep one block"]),
])
def test_set_values_the_fuzzer_broke_are_refused_in_one_line(assignment, words):
    sets = (assignment,) if isinstance(assignment, str) else assignment
    refused(["run", DEFAULT, "--quiet", *(a for s in sets for a in ("--set", s))], *words)


def test_a_whole_number_float_stage_is_the_integer():
    assert run_cli(["run", DEFAULT, "--quiet", "--set", "deepspeed.zero_optimization.stage=2.0"]).code == 0


def test_yaml_nested_3000_deep_is_refused(tmp_path):
    p = tmp_path / "deep.yaml"
    p.write_text(Deep(3000).text())
    refused(["run", str(p)], "nested")
    refused(["run", DEFAULT, "--set", f"deepspeed.x={Deep(3000).text()}"], "nested")


@pytest.mark.parametrize("argv", [["run", "BIN"], ["memory", "BIN"], ["compare", "BIN"],
                                  ["plot", "BIN", "--kind", "scaling", "--out", "o.png"], ["run", "DSREF"]])
def test_a_binary_file_is_refused_by_every_reader(tmp_path, argv):
    (tmp_path / "bin.yaml").write_bytes(bytes(range(256)) * 4)
    ref = write(tmp_path, dict(TINY, deepspeed="bin.yaml"), "ref.yaml")
    argv = [a.replace("BIN", str(tmp_path / "bin.yaml")).replace("DSREF", ref) for a in argv]
    refused(argv, "not a text file")


def test_calibrate_refuses_overflowing_and_nan_arguments_as_a_user_sees_it(tmp_path):
    for extra in (["--max-size", "1e400"], ["--timeout", "nan"]):
        p = zsim("calibrate", "--out", "x", "--root", tmp_path, *extra)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and extra[0] in p.stderr


def test_calibrate_refuses_overflowing_and_nan_arguments():
    import argparse

    from calibration.commands import calibrate
    from zsim.errors import ZsimInputError
    p = argparse.ArgumentParser()
    calibrate.add_parser(p.add_subparsers())
    for extra, word in ((["--max-size", "1e400"], "too large"), (["--timeout", "nan"], "finite"),
                        (["--timeout", "inf"], "finite")):
        with pytest.raises(ZsimInputError, match=word):
            calibrate.resolve(p.parse_args(["calibrate", "--out", "x", *extra]))


def test_control_characters_in_a_key_stay_on_one_line():
    err = refused(["run", DEFAULT, "--quiet", "--set", "0\r0=1"])
    assert "\\r" in err


# ---- a ds_config where a scenario belongs -----------------------------------------------------
DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "fp16": {"enabled": True},
      "zero_optimization": {"stage": 3, "overlap_comm": True}}


def test_zsim_run_ds_config_names_the_flags_it_needs(tmp_path):
    ds = tmp_path / "ds_config_zero3.json"
    ds.write_text(json.dumps(DS))
    p = zsim("run", ds)
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "is a ds_config.json" in p.stderr and "--model NAME --gpus N" in p.stderr
    p = zsim("run", ds, "--model", "gpt2")
    assert p.returncode == 2 and "add --gpus N" in p.stderr and "--model" not in p.stderr.split("add")[1]
    p = zsim("run", ds, "--model", "config.json", "--gpus", "8")    # a config.json that is not there
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "model.hf_config" in p.stderr and "file not found" in p.stderr
    p = zsim("run", ds, "--quiet", "--model", str(ROOT / "scenarios" / "models" / "mistral-7b.json"), "--gpus", "8")
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("command", [["run", "--quiet"], ["memory"], ["compare", "--quiet"], ["doctor"],
                                     ["tune", "--budget", "2"]])
def test_ds_config_with_model_and_gpus_runs_in_every_command(tmp_path, command):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(DS))
    gpus = ["--gpus-per-node", "4"] if command[0] == "memory" else ["--gpus", "4", "--nodes", "2"]
    p = zsim(command[0], ds, *command[1:], "--model", "gpt2", "--profile", "dgx-h100", *gpus)
    assert p.returncode == 0, p.stderr
    if command[0] == "run":
        out = run_cli(["run", str(ds), "--json", str(tmp_path / "r.json"), "--quiet", "--model", "gpt2",
                       "--gpus", "4", "--nodes", "2", "--profile", "dgx-h100"])
        r = json.loads((tmp_path / "r.json").read_text())
        assert out.code == 0 and r["world_size"] == 8 and r["stage"] == 3 and r["precision"] == "fp16"
        assert r["hardware_profile"] == "dgx-h100" and r["global_batch_size"] == 2 * 4 * 8


# ---- overrides that derive --------------------------------------------------------------------
def test_overrides_of_world_size_and_gas_rederive_the_pinned_batch():
    p = zsim("run", LLAMA3, "--quiet", "--set", "hardware.nodes=2")
    assert p.returncode == 0 and "deepspeed.train_batch_size -> 128" in p.stderr
    p = zsim("run", LLAMA3, "--quiet", "--set", "training.gradient_accumulation_steps=16")
    assert p.returncode == 0
    assert "deepspeed.gradient_accumulation_steps -> 16" in p.stderr and "train_batch_size -> 128" in p.stderr
    p = zsim("run", str(ROOT / "scenarios" / "gpt3-175b-zero3.yaml"), "--quiet", "--set", "hardware.nodes=512")
    assert p.returncode == 0 and "train_batch_size" in p.stderr


def test_a_training_batch_key_carries_its_pinned_deepspeed_twin(tmp_path):
    raw = mapping(**{"deepspeed.gradient_accumulation_steps": 1})
    out = run_cli(["run", write(tmp_path, raw), "--quiet", "--set", "training.gradient_accumulation_steps=4"])
    assert out.code == 0 and "deepspeed.gradient_accumulation_steps -> 4" in out.stderr
    assert "train_batch_size" not in out.stderr


def test_a_batch_that_cannot_be_derived_names_the_pair_to_set(tmp_path):
    # train_batch_size and micro-batch pinned, GAS free: DeepSpeed derives GAS, 64 / (3 x 8) has a remainder
    raw = mapping(**{"deepspeed.train_batch_size": 64, "deepspeed.train_micro_batch_size_per_gpu": 1})
    raw["training"] = {"seq_len": 256, "precision": "bf16"}
    refused(["run", write(tmp_path, raw), "--quiet", "--set", "hardware.gpus_per_node=3"],
            "deepspeed.train_batch_size", "train_micro_batch_size_per_gpu (1) x gradient_accumulation_steps")


# ---- tune keeps the user's config -------------------------------------------------------------
def test_tune_out_keeps_auto_values_scheduler_and_loss_scaling(tmp_path):
    hf = ROOT / "scenarios" / "seed004-hf-auto-zero2-7b.yaml"
    user = yaml.safe_load(hf.read_text())["deepspeed"]
    out = tmp_path / "ds.json"
    p = zsim("tune", hf, "--budget", "6", "--out", out, "--headroom", "10%", "--json", tmp_path / "t.json")
    assert p.returncode == 0, p.stderr
    cfg = json.loads(out.read_text())
    assert cfg["scheduler"] == user["scheduler"] and cfg["optimizer"]["params"]["lr"] == "auto"
    assert cfg["fp16"]["initial_scale_power"] == user["fp16"]["initial_scale_power"]
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert cfg[key] == "auto"
    # the winner's bucket, else YAML's "2e8", as a JSON number
    best = json.loads((tmp_path / "t.json").read_text())["candidates"][0]
    assert cfg["zero_optimization"]["reduce_bucket_size"] == int(best["knobs"].get("reduce_bucket_size", 2e8))
    assert type(cfg["zero_optimization"]["reduce_bucket_size"]) is int
    # a tensor-parallel or pipelined winner adds DeepSpeed's layout blocks, and only those
    assert set(cfg) - {"tensor_parallel", "pipeline"} == set(user)
    assert "tensor_parallel" not in cfg or cfg["tensor_parallel"]["autotp_size"] > 1
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("│")]
    assert len(rows) == len(set(rows))


def test_tune_headroom_keeps_winners_under_the_margin(tmp_path):
    p = zsim("tune", write(tmp_path, TINY), "--budget", "8", "--json", tmp_path / "t.json", "--headroom", "90%")
    rows = json.loads((tmp_path / "t.json").read_text())["candidates"]
    cap = 80 * 2**30
    assert p.returncode in (0, 1) and all(r["peak_bytes"] <= 0.1 * cap for r in rows)
    p = zsim("tune", write(tmp_path, TINY), "--headroom", "95%")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "0% to 90%" in p.stderr


def test_doctor_headroom_lists_only_fixes_inside_the_margin():
    oom = ROOT / "scenarios" / "oom-gpt3-2.7b-zero1-40g.yaml"
    plain, margin = zsim("doctor", oom, "--top", "50"), zsim("doctor", oom, "--top", "50", "--headroom", "30%")
    assert plain.returncode == margin.returncode == 0 and "within 30% headroom" in margin.stdout
    count = lambda out: int(out.split("simulated changes fit")[0].rsplit("\n", 1)[1].split(" of ")[0])
    assert count(margin.stdout) < count(plain.stdout)


# ---- exit codes -------------------------------------------------------------------------------
def test_run_check_exits_3_on_a_predicted_oom():
    assert zsim("run", ROOT / "scenarios" / "oom-gpt3-2.7b-zero1-40g.yaml", "--check", "--quiet").returncode == 3
    assert zsim("run", DEFAULT, "--check", "--quiet").returncode == 0
    p = zsim("run", DEFAULT, "--check", "--quiet", "--headroom", "90%")
    assert p.returncode == 3 and "headroom" in p.stderr


def test_a_sweep_with_no_successful_point_exits_non_zero():
    p = zsim("sweep", DEFAULT, "--vary", "deepspeed.zero_optimization.stage=5,7", "--workers", "1", "--quiet")
    assert p.returncode == 1 and "no point of the sweep" in p.stderr.splitlines()[-1]


# ---- the small things -------------------------------------------------------------------------
def test_tables_are_full_width_when_piped():
    p = zsim("compare", str(ROOT / "scenarios" / "seed004-zero2-64gpu.yaml"))
    assert p.returncode == 0 and "…" not in p.stdout and "peak/cap GiB" in p.stdout
    narrow = zsim("run", DEFAULT, "--width", "60").stdout
    assert max(len(ln) for ln in narrow.splitlines()) <= 60


def test_memory_total_params_without_like_deepspeed_is_refused():
    p = zsim("memory", "--total-params", "1000000000")
    assert p.returncode == 2 and "--like-deepspeed" in p.stderr


def test_the_llama3_scenario_is_named_for_the_stage_it_runs():
    from zsim.config.scenario import load_scenario
    sc = load_scenario(LLAMA3)
    assert sc.zero.stage == 3 and "zero3" in sc.name


def test_scaling_plot_keeps_every_curve_and_ideal_line_visible(monkeypatch, tmp_path):
    from zsim.report import plots
    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig))
    data = {0: [{"gpus": g, "tokens_per_s": 1000.0 * g, "tokens_per_s_per_gpu": 1000.0, "oom": True} for g in (8, 16)],
            3: [{"gpus": g, "tokens_per_s": 900.0 * g, "tokens_per_s_per_gpu": 900.0, "oom": False} for g in (8, 16)]}
    plots.scaling_plot(data, "t", str(tmp_path / "s.png"))
    ax1 = figs[0].axes[0]
    drawn = [ln for ln in ax1.lines if len(ln.get_xdata())]
    ideal = [ln for ln in drawn if ln.get_linestyle() == "--" and ln.get_marker() in ("None", None, "")]
    faint = [ln for ln in drawn if (ln.get_alpha() or 1) < 0.5]
    assert len(ideal) == 1                       # the all-OOM stage gets no ideal line of its own
    assert len(faint) == 2                       # each stage's whole curve, faint, under the bold fitting part
    assert all(i.get_zorder() > c.get_zorder() for i in ideal for c in drawn if c is not i and c.get_marker() != "x")


@pytest.mark.parametrize("name,text", [("inf.json", '[{"world_size": Infinity, "stage": false}]'),
                                       ("inf.csv", "world_size,stage,tokens_per_s,tokens_per_s_per_gpu,ok\n"
                                                   "inf,1,2,3,True\n")])
def test_plot_refuses_non_finite_numbers(tmp_path, name, text):
    # found by the long fuzzing profile: int(float('inf')) in the scaling reader
    (tmp_path / name).write_text(text)
    refused(["plot", str(tmp_path / name), "--kind", "scaling", "--out", str(tmp_path / "o.png")], "RESULTS")
