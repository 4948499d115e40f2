"""zsim calibrate and zsim validate as a user brings them to a cluster: bad input in one line
(exit 2) before anything is measured, nothing of a failed fit left behind, a complete run not
replaced by one that fails, and validate runs only what its engine would run as predicted."""
import json

import pytest

from tests.helpers import ROOT
from zsim.cli import main

RUNS = ROOT / "calibration" / "runs"
SMALL = ROOT / "benchmarks" / "validate_scenarios" / "small.yaml"


def _error(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("zsim: error")]
    assert len(err) == 1, err
    return err[0]


@pytest.fixture
def root(tmp_path):
    pytest.importorskip("torch")   # zsim calibrate needs the harness's torch
    (tmp_path / "hardware_profiles").mkdir()
    (tmp_path / "calibration" / "runs").mkdir(parents=True)
    return tmp_path


def test_a_dtype_the_run_did_not_measure_is_refused_even_alone(root, capsys):
    # the H200 run measured bf16 only: an fp32 profile would repeat bf16's peak (fp32 15x too fast)
    argv = ["calibrate", "--out", "h2", "--root", str(root), "--from-run", str(RUNS / "h200-1gpu"), "--dtype", "fp32"]
    assert main(argv) == 2
    assert "measured no fp32 layer" in _error(capsys)
    assert not (root / "calibration" / "runs" / "h2").exists()


def test_a_corrupt_run_is_one_line_and_leaves_nothing(root, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "records.json").write_text("{not json")
    assert main(["calibrate", "--out", "b", "--root", str(root), "--from-run", str(bad)]) == 2
    assert "records.json is not valid JSON" in _error(capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "records.json").write_text(json.dumps({"status": "complete", "records": [], "provenance": {}}))
    assert main(["calibrate", "--out", "e", "--root", str(root), "--from-run", str(empty)]) == 2
    assert "cannot be fitted" in _error(capsys)
    assert not (root / "calibration" / "runs" / "e").exists()


@pytest.mark.parametrize("argv, words", [
    (["--out", "x.yaml"], "without the suffix"),
    (["--out", "a", "--quick", "--io-path", "/etc/passwd"], "give an existing directory"),
    (["--out", "a", "--quick", "--base", "nosuch"], "--base: 'nosuch'"),
])
def test_calibrate_arguments_are_checked_before_measuring(root, capsys, argv, words):
    extra = [] if "--quick" in argv else ["--from-run", str(RUNS / "cpu-xeon-vm-2ranks")]
    assert main(["calibrate", *argv, "--root", str(root), *extra]) == 2
    assert words in _error(capsys)


def test_from_run_does_not_replace_another_run_without_force(root, capsys):
    assert main(["calibrate", "--out", "c", "--root", str(root), "--from-run", str(RUNS / "cpu-xeon-vm-2ranks")]) == 0
    (root / "hardware_profiles" / "c.yaml").unlink()
    before = (root / "calibration" / "runs" / "c" / "records.json").read_bytes()
    assert main(["calibrate", "--out", "c", "--root", str(root), "--from-run", str(RUNS / "cpu-xeon-vm-4ranks")]) == 2
    assert "holds another run" in _error(capsys)
    assert (root / "calibration" / "runs" / "c" / "records.json").read_bytes() == before


def test_validate_refuses_what_the_deepspeed_peer_would_not_run(capsys):
    from calibration.core.peers import unsupported
    from tests.helpers import scenario
    assert "fp16" in unsupported(scenario(**{"training.precision": "fp16", "deepspeed.fp16": {"enabled": True}}), False)
    assert "activation_checkpointing" in unsupported(scenario(**{"training.activation_checkpointing": "full"}), False)
    offloaded = scenario(**{"deepspeed.zero_optimization.offload_optimizer": {"device": "cpu"}})
    assert "ZeRO-Offload on a CPU device" in unsupported(offloaded, False)
    assert unsupported(offloaded, True) is None and unsupported(scenario(), False) is None


def test_validate_takes_the_profile_once(capsys):
    argv = ["validate", str(SMALL), "--steps", "1", "--set", "hardware.profile=dgx-h100", "--profile", "cpu-gloo-localhost"]
    assert main(argv) == 2
    assert "disagrees with --profile" in _error(capsys)


def test_a_pool_json_that_is_not_json_is_one_line(tmp_path):
    from calibration.harness.pool import read_json
    from zsim.errors import ZsimInputError
    p = tmp_path / "records.json"
    p.write_text("[1, 2")
    with pytest.raises(ZsimInputError, match="records.json is not valid JSON"):
        read_json(p, "--pool-collectives", str(tmp_path))


def test_hooks_need_deepspeed_and_a_measurement(root, capsys, monkeypatch):
    """--hooks times DeepSpeed's hooks in DeepSpeed: refused in one line where the ranks' Python
    cannot import it, and with --from-run, which measures nothing."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    assert main(["calibrate", "--out", "h", "--quick", "--hooks", "--root", str(root)]) == 2
    assert "cannot import" in _error(capsys)
    assert main(["calibrate", "--out", "h", "--hooks", "--root", str(root),
                 "--from-run", str(RUNS / "cpu-xeon-vm-2ranks")]) == 2
    assert "drop --hooks" in _error(capsys)
    assert not (root / "hardware_profiles" / "h.yaml").exists()
