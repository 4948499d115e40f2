"""zsim doctor: diagnosis of the peak and ranked fixes that fit (issue 3: a scenario 20% over capacity gets
at least three fixes, and applying the top one makes `zsim run` report fits)."""
import json

import pytest
import yaml

from tests.helpers import ROOT, mapping, over_by
from zsim.api import run_scenario
from zsim.cli import main as cli_main
from zsim.config.scenario import scenario_from_mapping
from zsim.search.doctor import diagnose, doctor, playbook
from zsim.search.variants import Base, Variant


def test_twenty_percent_over_gets_three_fixes_and_the_top_one_fits(tmp_path, capsys):
    raw = over_by(0.20)
    path = tmp_path / "over.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "doctor.json"
    assert cli_main(["doctor", str(path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "OOM by" in text and "(20.0% over)" in text and "pushing it over:" in text
    rep = json.loads(out.read_text())
    fixes = rep["fixes"]
    assert len(fixes) >= 3
    rates = [f["tokens_per_s"] for f in fixes]
    assert rates == sorted(rates, reverse=True)
    # the top fix, applied through --set, makes `zsim run` report fits
    run_json = tmp_path / "run.json"
    sets = [a for o in fixes[0]["overrides"] for a in ("--set", o)]
    assert cli_main(["run", str(path), "--quiet", "--json", str(run_json), *sets]) == 0
    result = json.loads(run_json.read_text())
    assert result["memory"]["fits"] and result["memory"]["host"]["fits"]
    assert result["global_batch_size"] == rep_global_batch(raw)
    # and reports the step time and peak doctor promised for it
    assert result["step_time_s"] == pytest.approx(fixes[0]["step_time_s"], rel=1e-9)
    assert result["memory"]["peak_bytes"] == pytest.approx(fixes[0]["peak_bytes"], rel=1e-9)


def rep_global_batch(raw):
    return scenario_from_mapping(raw, ROOT).global_batch_size


def test_diagnosis_names_the_peak_components_and_when():
    raw = over_by(0.20)
    sc = scenario_from_mapping(raw, ROOT)
    result, trace = run_scenario(sc)
    d = diagnose(result, trace)
    assert d["over_fraction"] == pytest.approx(0.20, rel=1e-9)
    # the largest components, just enough of them to make up the overflow
    pushing = [d["components"][k] for k in d["pushing_over"]]
    assert pushing == sorted(d["components"].values(), reverse=True)[:len(pushing)]
    assert sum(pushing) >= d["over_bytes"] > sum(pushing[:-1])
    # the op named as the one that allocates the peak is running at the peak's time
    at = d["at"]
    spans = [(t.start_s, t.end_s) for op, t in zip(trace.schedule.ops, trace.timings)
             if (op.name, op.phase, op.micro_step) == (at["op"], at["phase"], at["micro_step"])]
    assert any(s <= d["peak_time_s"] <= e for s, e in spans)


def test_fitting_scenario_gets_candidates_but_is_reported_as_fitting():
    base = Base(mapping(), ROOT, "tiny")
    rep = doctor(base)
    assert rep["baseline"]["fits"] and rep["diagnosis"]["over_bytes"] < 0
    assert rep["fixes"]
    # every suggestion, simulated again on its own, fits and runs as fast as doctor reported
    for f in rep["fixes"]:
        r = base.run(Variant(f["name"], tuple(f["overrides"]))).result
        assert r.fits
        assert (r.step_time_s, r.tokens_per_s) == (f["step_time_s"], f["tokens_per_s"])


def test_batch_candidates_keep_the_global_batch():
    raw = mapping(**{"training.micro_batch_size": 6, "training.gradient_accumulation_steps": 1})
    sc = scenario_from_mapping(raw, ROOT)
    names = [c.name for c in playbook(raw, sc) if c.name.startswith("micro-batch")]
    assert names == ["micro-batch 3 x GAS 2 (same global batch)", "micro-batch 2 x GAS 3 (same global batch)",
                     "micro-batch 1 x GAS 6 (same global batch)"]


def test_candidates_combine_without_repeating_keys():
    a = Variant("a", ("x.y=1", "x.z=2"))
    b = Variant("b", ("x.y=3", "x.w=4"))
    assert (a + b).assignments == ("x.y=1", "x.z=2", "x.w=4")


def test_host_oom_is_an_oom(tmp_path):
    """Offloading past the node's memory is a CPU OOM: doctor reports it, and no fix keeps it."""
    raw = mapping(**{"deepspeed.zero_optimization.offload_optimizer": {"device": "cpu"},
                     "hardware.override": {"cpu": {"memory_GiB": 0.001}}})
    rep = doctor(Base(raw, ROOT, "tiny"))
    assert rep["diagnosis"]["host_over_bytes"] > 0
    assert not rep["baseline"]["fits"] and rep["diagnosis"]["fits"]    # the GPU side fits: a host OOM only
    # every change doctor tries keeps the offload (or adds more), so each one is a host OOM and none is a fix
    tried = [t for t in rep["tried"] if t["valid"]]
    assert tried and all(t["gpu_fits"] and not t["host_fits"] and not t["fits"] for t in tried)
    assert rep["fixes"] == []


def test_a_pair_that_adds_nothing_to_one_of_its_changes_is_not_simulated(tmp_path):
    """GPT-3 13B, ZeRO-1, micro-batch 8 on 2 GPUs: too few single changes fit, so doctor pairs
    them; 'full checkpointing, checkpoints in CPU memory' + 'full checkpointing' is the first
    again, and is not simulated twice."""
    from tests.helpers import mapping
    from zsim.search.doctor import doctor
    from zsim.search.variants import Base
    path = tmp_path / "d13.yaml"
    path.write_text(yaml.safe_dump(mapping(**{"model": {"preset": "gpt3-13b"}, "hardware.gpus_per_node": 2,
                                              "deepspeed.zero_optimization.stage": 1,
                                              "training.micro_batch_size": 8})))
    tried = doctor(Base.load(path, (), workers=1))["tried"]
    assert any(" + " in t["name"] for t in tried)   # pairs were tried
    sets = [frozenset(t["overrides"]) for t in tried]
    assert len(set(sets)) == len(sets)
