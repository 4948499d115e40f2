"""zsim calibrate end to end: argument errors and --force protection (no torch), a quick run
whose profile zsim loads, and runs with a killed or hung rank (torch only; skipped without it)."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import zsim_cli
from zsim.config.profile import load_profile


@pytest.mark.parametrize("args, needle", [
    (["--out", "bad name!"], "--out"),
    (["--out", "x", "--max-size", "12XB"], "--max-size"),
    (["--out", "x", "--max-size", "10"], "--max-size"),
    (["--out", "x", "--layer", "10,3,4,1"], "--layer"),
    (["--out", "x", "--layer", "10,3"], "--layer"),
    (["--out", "x", "--nproc-per-node", "0"], "--nproc-per-node"),
    (["--out", "x", "--timeout", "-1"], "--timeout"),
    (["--out", "x", "--dtype", "int8"], "--dtype"),
    (["--out", "x", "--dtype", "fp32,int8"], "--dtype"),
    (["--out", "x", "--dtype", "bf16,bf16"], "--dtype"),
    (["--out", "x", "--backend", "mpi"], "--backend"),
    ([], "--out"),
])
def test_bad_arguments_one_line_exit_2(args, needle, tmp_path):
    r = zsim_cli("calibrate", "--root", str(tmp_path), *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_existing_profile_is_not_overwritten_without_force(tmp_path):
    prof = tmp_path / "hardware_profiles" / "mine.yaml"
    prof.parent.mkdir()
    prof.write_text("precious: true\n")
    r = zsim_cli("calibrate", "--out", "mine", "--quick", "--root", str(tmp_path))
    assert r.returncode == 2 and "--force" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert prof.read_text() == "precious: true\n"


TINY = ["--quick", "--max-size", "4KiB", "--layer", "64,2,32,1", "--timeout", "30"]


def test_quick_calibration_end_to_end(tmp_path):
    pytest.importorskip("torch")
    r = zsim_cli("calibrate", "--out", "tiny", "--root", str(tmp_path), *TINY)
    assert r.returncode == 0, r.stderr
    prof = tmp_path / "hardware_profiles" / "tiny.yaml"
    hp = load_profile(str(prof))
    assert hp.gpus_per_node == 2 and hp.intra_node.efficiency_by_collective
    doc = json.loads((tmp_path / "calibration" / "runs" / "tiny" / "records.json").read_text())
    assert doc["status"] == "complete" and doc["provenance"]["backend"] == "gloo"
    kinds = {x["kind"] for x in doc["records"]}
    assert {"collective", "gemm", "attention", "membound", "layer", "adam", "file_io", "memcpy",
            "interference", "kernel_overhead", "collective_memory"} <= kinds
    # gloo's reduce_scatter_tensor copies its input (see [Note: gloo reduce-scatter copy])
    assert hp.gpu.reduce_scatter_temp_fraction == 1.0
    assert not list((tmp_path / "calibration" / "runs").glob(".*scratch*"))
    # and zsim run loads it like a hand-written profile
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump({"name": "t", "model": {"layers": 2, "hidden": 64, "heads": 2, "vocab": 128,
                                                         "seq_len": 32},
                                  "hardware": {"profile": str(prof)},
                                  "training": {"micro_batch_size": 1, "gradient_accumulation_steps": 1,
                                               "precision": "bf16"},
                                  "deepspeed": {"zero_optimization": {"stage": 2}}}))
    assert zsim_cli("run", str(sc), "--quiet").returncode == 0
    again = zsim_cli("calibrate", "--out", "tiny", "--root", str(tmp_path), *TINY)
    assert again.returncode == 2 and "--force" in again.stderr


def test_killed_rank_names_rank_and_benchmark_and_keeps_records(tmp_path):
    pytest.importorskip("torch")
    r = zsim_cli("calibrate", "--out", "dies", "--root", str(tmp_path), *TINY,
              env={"ZSIM_CALIB_FAULT": "1:collective/all_reduce/world/fp32/4096:kill"})
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "rank 1" in last and "collective/all_reduce/world/fp32/4096" in last and "kept" in last, r.stderr
    doc = json.loads((tmp_path / "calibration" / "runs" / "dies" / "records.json").read_text())
    assert doc["status"] == "failed" and "rank 1" in doc["error"]
    done = [x["item"] for x in doc["records"]]
    assert "collective/all_reduce/world/fp32/1024" in done and not any("gemm" in x for x in done)
    assert not (tmp_path / "hardware_profiles" / "dies.yaml").exists()


def test_hung_rank_times_out_naming_it(tmp_path):
    pytest.importorskip("torch")
    r = zsim_cli("calibrate", "--out", "hangs", "--root", str(tmp_path), *TINY[:-1], "5",
              env={"ZSIM_CALIB_FAULT": "1:collective/broadcast/world/fp32/1024:hang"})
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "rank 1 hung" in last and "collective/broadcast/world/fp32/1024" in last, r.stderr
    doc = json.loads((tmp_path / "calibration" / "runs" / "hangs" / "records.json").read_text())
    assert doc["status"] == "failed" and len(doc["records"]) > 0
