"""The sampler of benchmarks/validate_random.py (calibration/random_cases.py), without launching
anything: a seed names a fixed list of cases, the draws cover the whole space (DeepSpeed's
defaults and "auto" included), and every case is one zsim accepts and the engines can run."""
from __future__ import annotations

import importlib.util
from collections import defaultdict
from pathlib import Path

import pytest

from calibration.core.plan import unsupported
from calibration.random_cases import (AUTO, DEFAULT, GAS, MODELS, PRECISIONS, REDUCE_BUCKET, STAGE3_SIZES, STAGES,
                                      WORLD_SIZES, deepspeed_default, describe, sample)
from calibration.validation import TENSOR_ONLY_OVERRIDES
from zsim.config.scenario import load_scenario
from zsim.schedule.build import build_schedule

ROOT = Path(__file__).resolve().parents[2]
SCEN = ROOT / "benchmarks" / "validate_scenarios"


def _load(case):
    # what `zsim validate` adds (calibration/commands/validate.py main)
    extra = ("hardware.profile=cpu-gloo-localhost", "hardware.nodes=1") + TENSOR_ONLY_OVERRIDES
    return load_scenario(str(SCEN / f"{case.scenario}.yaml"), case.overrides + extra)


def test_a_seed_names_a_fixed_list_of_cases():
    a, b = sample(1234, 12), sample(1234, 12)
    assert a == b
    assert sample(1234, 5) == a[:5]                 # a longer draw extends a shorter one
    assert [c.draws for c in sample(1235, 12)] != [c.draws for c in a]
    # the offload switch changes the offload draw only: the other dimensions stay the seed's
    off = sample(1234, 12, offload=False)
    assert [[d for d in c.draws if d[0] != "offload_optimizer"] for c in off] == \
        [[d for d in c.draws if d[0] != "offload_optimizer"] for c in a]
    assert not any(c.offloaded for c in off) and any(c.offloaded for c in a)


def test_the_draws_cover_the_space_defaults_and_auto_included():
    seen = defaultdict(set)
    for case in sample(7, 400):
        for dim, option in case.draws:
            seen[dim].add(option)
    assert seen["model"] == set(MODELS) and seen["world"] == set(WORLD_SIZES)
    assert seen["stage"] == set(STAGES) and seen["precision"] == set(PRECISIONS) and seen["gas"] == set(GAS)
    assert seen["overlap_comm"] == {DEFAULT, True, False} and seen["contiguous_gradients"] == {True, False}
    assert seen["reduce_bucket_size"] == set(REDUCE_BUCKET) >= {DEFAULT, AUTO}
    for key, options in STAGE3_SIZES.items():
        assert seen[key] == set(options) and DEFAULT in options
    assert seen["offload_optimizer"] == {"none", "cpu"}
    assert AUTO in seen["stage3_prefetch_bucket_size"] and AUTO in seen["stage3_param_persistence_threshold"]


def test_default_and_auto_resolve_to_deepspeeds_and_hf_trainers_values():
    cases = sample(7, 400)
    d = next(c for c in cases if dict(c.draws)["reduce_bucket_size"] == DEFAULT)
    assert _load(d).zero.reduce_bucket_size == deepspeed_default("reduce_bucket_size") == int(5e8)
    a = next(c for c in cases if dict(c.draws)["stage"] == 3 and dict(c.draws)["stage3_prefetch_bucket_size"] == AUTO)
    sc = _load(a)
    # transformers' HfTrainerDeepSpeedConfig: 0.9 * hidden^2
    assert sc.zero.prefetch_bucket_size == int(0.9 * sc.model.hidden ** 2)
    p = next(c for c in cases if dict(c.draws)["stage"] == 3 and
             dict(c.draws)["stage3_param_persistence_threshold"] == DEFAULT)
    assert _load(p).zero.param_persistence_threshold == deepspeed_default("stage3_param_persistence_threshold") == int(1e5)


@pytest.mark.parametrize("seed", [11, 12])
def test_every_case_is_accepted_and_runs_on_the_engines(seed):
    for case in sample(seed, 20):
        sc = _load(case)
        d = dict(case.draws)
        assert (sc.zero.stage, sc.precision, sc.gradient_accumulation_steps, sc.cluster.world_size) == \
            (d["stage"], d["precision"], d["gas"], d["world"]), describe(case)
        build_schedule(sc)
        why = unsupported(sc)
        # the own core runs every case but an offloaded optimizer, which it refuses in one line
        assert (why is not None) == case.offloaded, (describe(case), why)


def test_the_benchmark_refuses_a_seed_it_was_tuned_on(tmp_path):
    spec = importlib.util.spec_from_file_location("validate_random", ROOT / "benchmarks" / "validate_random.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    f = tmp_path / "seeds.txt"
    f.write_text("# comment\n42  prefetch rule (2026-11-23)\n\n")
    assert mod.tuned_seeds(f) == {42: "prefetch rule (2026-11-23)"}
    assert isinstance(mod.tuned_seeds(), dict)      # the shipped list parses


def test_runs_log_resumes_only_the_run_that_wrote_it(tmp_path):
    spec = importlib.util.spec_from_file_location("validate_random", ROOT / "benchmarks" / "validate_random.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    log = tmp_path / "runs.jsonl"
    header = {"seed": 7, "n": 2, "steps": 4, "warmup": 1, "profile": None}
    assert mod.load_runs_log(log, header) == {}
    with mod.open_runs_log(log, header) as f:
        f.write('{"key": "own/c00", "pass": 0, "result": {"failed": "x"}}\n')
    with mod.open_runs_log(log, header) as f:      # reopened: the header is not written twice
        f.write('{"key": "own/c00", "pass": 1, "result": {"failed": "y"}}\n')
    assert mod.load_runs_log(log, header) == {("own/c00", 0): {"failed": "x"}, ("own/c00", 1): {"failed": "y"}}
    with pytest.raises(ValueError, match="--runs-log"):
        mod.load_runs_log(log, {**header, "steps": 8})


def test_a_profile_per_world_size():
    spec = importlib.util.spec_from_file_location("validate_random", ROOT / "benchmarks" / "validate_random.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.profiles_by_world(None)(4) is None
    assert mod.profiles_by_world("p.yaml")(2) == "p.yaml"
    f = mod.profiles_by_world("2=a.yaml,4=b.yaml")
    assert (f(2), f(4)) == ("a.yaml", "b.yaml")
    with pytest.raises(ValueError, match="no profile for world size 8"):
        f(8)
    with pytest.raises(ValueError, match="WORLD=PROFILE"):
        mod.profiles_by_world("2=a.yaml,four=b.yaml")


def test_the_benchmark_refuses_a_world_size_without_its_profile(tmp_path):
    import subprocess
    import sys
    seed = next(s for s in range(1000, 2000) if any(c.world_size == 4 for c in sample(s, 3)))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "validate_random.py"), "--seed", str(seed), "--n", "3",
                        "--profile", "2=a.yaml"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "no profile for world size 4" in p.stderr and "Traceback" not in p.stderr


def test_repredict_compares_the_logged_measurement_with_the_current_prediction(tmp_path):
    # a logged launch (its measured figures, a stale prediction) is compared again with what the
    # current tree predicts for the case through validate's own predict
    from calibration.commands.validate import predict
    from calibration.validation import TENSOR_ONLY_OVERRIDES
    from zsim.config.scenario import load_scenario

    spec = importlib.util.spec_from_file_location("validate_random", ROOT / "benchmarks" / "validate_random.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    case = sample(7, 1, offload=False)[0]
    measured = {"step_time_s": 2.0, "peak_bytes": 1e8, "phases_s": {"forward": 0.5}, "collectives": [],
                "collectives_summary": {}}
    stale = {"measured": measured, "predicted": {"step_time_s": 1.0, "peak_bytes": 1.0}, "error": {}}
    (new,) = mod.repredict(case, None, [stale])
    ov = (*case.overrides, "hardware.nodes=1", f"hardware.gpus_per_node={case.world_size}", *TENSOR_ONLY_OVERRIDES)
    expected, _ = predict(load_scenario(str(ROOT / "benchmarks" / "validate_scenarios" / f"{case.scenario}.yaml"), ov))
    assert new["measured"] == measured
    assert new["predicted"]["step_time_s"] == expected["step_time_s"] != 1.0
    assert new["error"]["step_time"] == pytest.approx(expected["step_time_s"] / 2.0 - 1)
    assert mod.repredict(case, None, [{"failed": "x"}]) == [{"failed": "x"}]


def test_repredict_without_report_only_is_refused_in_one_line():
    import subprocess
    import sys
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "validate_random.py"), "--seed", "7", "--n", "1",
                        "--repredict"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "--repredict needs --report-only" in p.stderr and "Traceback" not in p.stderr


def test_probe_scales_each_prediction_by_the_machines_speed_at_its_case(capsys):
    """--probe's diagnostic: a case's launches' median probe ratio multiplies its prediction before
    the error is taken; launches without a usable probe leave the case out of it."""
    spec = importlib.util.spec_from_file_location("validate_random", ROOT / "benchmarks" / "validate_random.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.probe_ratio([{"probe": {"ratio": 1.1}}, {"probe": {"ratio": 1.3}}, {"probe": {"failed": "x"}}]) == pytest.approx(1.2)
    assert mod.probe_ratio([{}, {"probe": {"ratio": None}}]) is None
    a, b = sample(7, 2, offload=False)

    def result(pred, meas, ratio):
        return {"measured": {"step_time_s": meas, "peak_bytes": 1.0, "run_spread": 0.0},
                "predicted": {"step_time_s": pred, "peak_bytes": 1.0},
                "error": {"step_time": pred / meas - 1, "peak_bytes": 0.0}, "collectives_equal": True,
                "probe_ratio": ratio}
    summary = mod.report("own", [a, b], {f"own/{a.name}": result(0.8, 1.0, 1.25),   # scaled: exact
                                         f"own/{b.name}": result(0.5, 1.0, None)})   # no probe: left out
    assert summary["step_time_mape"] == pytest.approx(0.35)
    assert summary["probe_scaled_mape"] == pytest.approx(0.0) and summary["probe_scaled_cases"] == 1
    assert "a diagnostic, not the target" in capsys.readouterr().out
