"""`zsim run` as a user runs it: table, --json, --trace, --set, and one-line errors (exit 2)."""
import json
import subprocess
import sys

import pytest
import yaml

from tests.helpers import ROOT, mapping
from zsim.cli import main

REQUIRED = ["step_time_s", "samples_per_s", "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu",
            "world_size", "compute_time_s"]


def write(tmp_path, raw, name="s.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw))
    return p


def test_default_scenario_prints_the_table(capsys):
    assert main(["run"]) == 0
    out = capsys.readouterr().out
    for word in ("step time", "tokens/s per GPU", "MFU", "Peak memory per GPU", "fits", "all_reduce"):
        assert word in out


def test_json_has_the_documented_keys(tmp_path):
    out = tmp_path / "r.json"
    assert main(["run", str(write(tmp_path, mapping())), "--quiet", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for k in REQUIRED:
        assert isinstance(r[k], (int, float)) and r[k] > 0
    for k in ("peak_bytes", "capacity_bytes", "fits", "breakdown"):
        assert k in r["memory"]
    assert r["comm"]["bytes_per_gpu"]["all_reduce"] > 0
    assert r["comm"]["exposed_time_s"] >= 0
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_s_per_gpu"] * r["world_size"])


def test_json_dash_is_standard_output(tmp_path, capsys, monkeypatch):
    # the Unix convention: `--json -` prints the JSON (alone with --quiet) and writes no file named "-"
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(write(tmp_path, mapping())), "--quiet", "--json", "-"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["step_time_s"] > 0
    assert not (tmp_path / "-").exists() and "wrote" not in cap.err


def test_trace_is_valid_chrome_json_with_streams_and_memory(tmp_path):
    out = tmp_path / "t.json"
    raw = mapping(**{"deepspeed.zero_optimization.stage": 3})
    assert main(["run", str(write(tmp_path, raw)), "--quiet", "--trace", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    threads = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"compute stream", "allgather stream", "reduce stream"} <= threads
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 for e in spans)
    assert any(e["ph"] == "C" and e["name"] == "memory allocated" for e in events)


def test_set_overrides_through_the_same_validator(tmp_path):
    p = write(tmp_path, mapping())
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["run", str(p), "--quiet", "--json", str(a)]) == 0
    assert main(["run", str(p), "--quiet", "--json", str(b), "--set", "deepspeed.zero_optimization.stage=3"]) == 0
    assert json.loads(a.read_text())["stage"] == 2 and json.loads(b.read_text())["stage"] == 3


def test_deepspeed_may_be_a_path_to_ds_config_json(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                                   "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}))
    raw = mapping()
    raw["training"].pop("micro_batch_size")
    raw["deepspeed"] = "ds.json"
    out = tmp_path / "r.json"
    assert main(["run", str(write(tmp_path, raw)), "--quiet", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["stage"] == 1 and r["micro_batch_size"] == 2


@pytest.mark.parametrize("change,field,fix", [
    ({"deepspeed.zero_optimization.stage3_prefetch_bucket_sz": 5e8},
     "deepspeed.zero_optimization.stage3_prefetch_bucket_sz", "did you mean 'stage3_prefetch_bucket_size'"),
    ({"deepspeed.zero_optimization.stage": 4}, "deepspeed.zero_optimization.stage", "choose one of 0, 1, 2, 3"),
    ({"deepspeed.zero_optimization.reduce_bucket_size": "big"}, "deepspeed.zero_optimization.reduce_bucket_size",
     "expected an integer"),
    ({"deepspeed.zero_optimization.reduce_bucket_size": -5}, "deepspeed.zero_optimization.reduce_bucket_size",
     "must be greater than 0"),
    ({"deepspeed.train_batch_size": 1000}, "deepspeed.train_batch_size", "must equal train_micro_batch_size_per_gpu"),
    ({"deepspeed.train_micro_batch_size_per_gpu": 3}, "deepspeed.train_micro_batch_size_per_gpu",
     "disagrees with training.micro_batch_size=2"),
    ({"training.precision": "fp8"}, "training.precision", "choose one of"),
    ({"model.preset": "gpt5"}, "model.preset", "unknown preset"),
    ({"hardware.profile": "dgx-a100-80"}, "hardware.profile", "did you mean 'dgx-a100-80g'"),
    ({"hardware.nodes": 0}, "hardware.nodes", "must be greater than 0"),
    ({"model.hidden": 250}, "model.hidden", "divisible by heads"),
    ({"deepspeed.fp16": {"enabled": True}}, "training.precision", "the ds_config enables fp16"),
    ({"trainig": {}}, "trainig", "did you mean 'training'"),
    ({"deepspeed.zero_optimization.offload_param": {"device": "cpu"}}, "deepspeed.zero_optimization.offload_param.device",
     "needs ZeRO stage 3"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, change, field, fix):
    assert main(["run", str(write(tmp_path, mapping(**change))), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert field in err and fix in err


def test_bad_set_and_missing_file_are_one_line(tmp_path, capsys):
    p = write(tmp_path, mapping())
    assert main(["run", str(p), "--set", "deepspeed.zero_optimization.stage"]) == 2
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--set" in err[0] and "file not found" in err[1]


def test_console_entry_point_exits_2_without_traceback(tmp_path):
    p = write(tmp_path, mapping(**{"deepspeed.zero_optimization.overlap_com": True}))
    proc = subprocess.run([sys.executable, "-m", "zsim.cli", "run", str(p)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.startswith("zsim: error: deepspeed.zero_optimization.overlap_com")
    assert "did you mean 'overlap_comm'" in proc.stderr and "Traceback" not in proc.stderr
