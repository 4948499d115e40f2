"""Layouts (TP x PP x DP) in the search tools: tune's layouts, batch keys re-derived when an
override or a sweep point changes the data-parallel size."""
from __future__ import annotations

import json

import yaml

from tests.helpers import run_cli
from tests.helpers import mapping, scenario


def _pinned(tmp_path) -> str:
    # TINY pins micro 2 x GAS 1 on 8 GPUs: a global batch of 16
    raw = mapping(**{"deepspeed.train_batch_size": 16})
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_layout_override_keeps_the_global_batch_and_rederives_gas(tmp_path):
    out = run_cli(["run", _pinned(tmp_path), "--json", str(tmp_path / "r.json"), "--quiet",
                   "--set", "parallelism.tensor=2", "--set", "deepspeed.zero_optimization.stage=1"])
    assert out.code == 0, out.stderr
    assert "training.gradient_accumulation_steps -> 2" in out.stderr and "global batch kept" in out.stderr
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["global_batch_size"] == 16 and r["gradient_accumulation_steps"] == 2


def test_a_cluster_override_still_moves_the_global_batch(tmp_path):
    out = run_cli(["run", _pinned(tmp_path), "--quiet", "--set", "hardware.nodes=2"])
    assert out.code == 0 and "deepspeed.train_batch_size -> 32" in out.stderr


def test_sweep_over_tensor_rederives_gas_per_point(tmp_path):
    rows_path = tmp_path / "rows.json"
    out = run_cli(["sweep", _pinned(tmp_path), "--vary", "parallelism.tensor=1,2,4", "--workers", "1", "--quiet",
                   "--json", str(rows_path)])
    assert out.code == 0, out.stderr
    rows = json.loads(rows_path.read_text())
    assert [r["ok"] for r in rows] == [True, True, True]
    assert [r["gradient_accumulation_steps"] for r in rows] == [1, 2, 4]
    assert {r["global_batch_size"] for r in rows} == {16}
    assert "note" not in rows[0] and "gradient_accumulation_steps -> 4" in rows[2]["note"]


def test_tune_layouts_follow_megatrons_rules():
    from zsim.search.tune import Layout, layouts
    # 8 GPUs per node, 4 heads, 2 layers: TP divides both 8 and the heads, PP <= layers
    found = layouts(scenario())
    assert found[0] == Layout(1, 1, False)
    assert {(lay.tensor, lay.pipeline) for lay in found} == {(t, p) for t in (1, 2, 4) for p in (1, 2)}
    # sequence parallelism searched on (first) and off wherever TP > 1; never without TP
    assert sorted((lay.tensor, lay.pipeline, lay.sequence_parallel) for lay in found) == sorted(
        [(1, p, False) for p in (1, 2)] + [(t, p, sp) for t in (2, 4) for p in (1, 2) for sp in (True, False)])
    on = [i for i, lay in enumerate(found) if lay.sequence_parallel]
    assert all(found[i + 1] == Layout(found[i].pipeline, found[i].tensor, False) for i in on)
    assert len(set(found)) == len(found)
    # the scenario's own layout first, not repeated; a sequence length TP does not divide: SP off only
    own = scenario(**{"parallelism.tensor": 2, "parallelism.sequence_parallel": True})
    assert layouts(own)[0] == Layout(1, 2, True) and layouts(own).count(Layout(1, 2, True)) == 1
    assert Layout(1, 2, False) in layouts(own)
    odd = layouts(scenario(**{"training.seq_len": 250, "model.seq_len": 250}))   # 250 % 4: no TP4 shards
    assert not any(lay.tensor == 4 and lay.sequence_parallel for lay in odd) and Layout(1, 4, False) in odd
    assert Layout(1, 2, True) in odd


def test_tune_on_a_small_model_keeps_pure_data_parallelism(tmp_path):
    # a model that fits one GPU many times over: tensor or pipeline parallelism only add
    # per-layer all-reduces and bubbles, so the winner is TP 1 x PP 1 x DP 8
    out = run_cli(["tune", _pinned(tmp_path), "--budget", "12", "--json", str(tmp_path / "t.json")])
    assert out.code == 0, out.stderr
    best = json.loads((tmp_path / "t.json").read_text())["candidates"][0]
    assert (best["tensor_parallel_size"], best["pipeline_stages"], best["data_parallel_size"]) == (1, 1, 8)
    cands = json.loads((tmp_path / "t.json").read_text())["candidates"]
    assert any(c["tensor_parallel_size"] > 1 or c["pipeline_stages"] > 1 for c in cands)


def test_doctor_suggests_other_layouts_that_tune_finds_fitting():
    from tests.helpers import ROOT
    from zsim.search.doctor import layout_fixes
    from zsim.search.variants import Base
    base = Base(mapping(), ROOT, "tiny")
    fixes = layout_fixes(base, base.scenario(()))
    assert fixes and all(f.name.startswith("layout TP ") for f in fixes)
    for f in fixes:
        out = base.run(f)
        sc = base.scenario(f.assignments)
        assert out.fits and (sc.tensor_parallel_size, sc.pipeline_stages) != (1, 1)
        assert sc.global_batch_size == 16


def test_the_doctors_layout_search_spends_nothing_on_the_scenarios_own_layout():
    """Its own layout is what the doctor's other fixes change: tune's search for other layouts
    neither simulates the own configuration first nor tries the own layout."""
    from tests.helpers import ROOT
    from zsim.search.tune import own_layout, tune
    from zsim.search.variants import Base
    base = Base(mapping(), ROOT, "tiny")
    own = own_layout(base.scenario(()))
    res = tune(base, budget=6, other_layouts=True)
    assert res.evaluated and all(c.layout != own for c, _ in res.evaluated)
    assert any(c.layout == own for c, _ in tune(base, budget=6).evaluated)


def _tp_sp(tmp_path, folder: str = "sub") -> str:
    raw = mapping(**{"parallelism.tensor": 2, "parallelism.sequence_parallel": True,
                     "deepspeed.zero_optimization.stage": 1})
    path = tmp_path / folder / "s.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_tune_scenario_out_keeps_the_chosen_layout_and_runs_as_simulated(tmp_path):
    """--scenario-out: the winner's parallelism block (TP 2 with sequence parallelism, which no
    ds_config key carries) and its ds_config; zsim run on it gives the tuned figures."""
    # budget 1: the scenario's own layout, TP 2 + SP, is the one simulated and the winner
    scen, ds, tuned = tmp_path / "out" / "best.yaml", tmp_path / "out" / "ds.json", tmp_path / "t.json"
    out = run_cli(["tune", _tp_sp(tmp_path), "--budget", "1", "--json", str(tuned), "--out", str(ds),
                   "--scenario-out", str(scen)])
    assert out.code == 0, out.stderr
    best = json.loads(tuned.read_text())["candidates"][0]
    assert (best["tensor_parallel_size"], best["sequence_parallel"]) == (2, True)
    written = yaml.safe_load(scen.read_text())
    assert written["parallelism"] == {"tensor": 2, "sequence_parallel": True, "pipeline": 1}
    assert written["deepspeed"] == "ds.json"     # the --out file, relative to the scenario's folder
    assert written["training"]["micro_batch_size"] == best["micro_batch_size"]
    ran = run_cli(["run", str(scen), "--json", str(tmp_path / "r.json"), "--quiet"])
    assert ran.code == 0, ran.stderr
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["tensor_parallel"]["sequence_parallel"] is True and r["tensor_parallel"]["tensor"] == 2
    assert r["step_time_s"] == best["step_time_s"] and r["memory"]["peak_bytes"] == best["peak_bytes"]
    # without --out the tuned ds_config goes inline
    alone = tmp_path / "alone.yaml"
    assert run_cli(["tune", _tp_sp(tmp_path, "x"), "--budget", "1", "--scenario-out", str(alone)]).code == 0
    inline = yaml.safe_load(alone.read_text())
    assert inline["deepspeed"]["zero_optimization"]["stage"] == best["stage"]
    assert run_cli(["run", str(alone), "--quiet"]).code == 0


def test_tune_out_alone_says_the_ds_config_cannot_carry_sequence_parallelism(tmp_path):
    out = run_cli(["tune", _tp_sp(tmp_path), "--budget", "1", "--out", str(tmp_path / "ds.json")])
    assert out.code == 0, out.stderr
    assert "cannot say sequence_parallel" in out.stderr and "--scenario-out" in out.stderr
    assert json.loads((tmp_path / "ds.json").read_text())["zero_optimization"]["stage"] in (0, 1)


def test_tune_scenario_out_refuses_an_existing_file_or_the_out_path(tmp_path):
    scen = tmp_path / "exists.yaml"
    scen.write_text("x: 1\n")
    out = run_cli(["tune", _tp_sp(tmp_path), "--budget", "1", "--scenario-out", str(scen)])
    assert out.code == 2 and "--scenario-out" in out.stderr and "--force" in out.stderr
    same = tmp_path / "same.json"
    out = run_cli(["tune", _tp_sp(tmp_path, "y"), "--budget", "1", "--out", str(same), "--scenario-out", str(same)])
    assert out.code == 2 and "its own path" in out.stderr


def test_an_moe_oom_gets_larger_expert_parallel_sizes_from_doctor_and_tune(tmp_path):
    """DeepSpeed-MoE's ep_size splits each MoE layer's experts over more ranks: the playbook and
    tune's layouts offer the sizes dividing the data-parallel size and the experts, and tune finds
    a fitting one for the shipped MoE scenario run without expert parallelism (no pipeline for an
    MoE model, which zsim refuses)."""
    from tests.helpers import ROOT
    from zsim.search.doctor import playbook
    from zsim.search.tune import layouts, tune
    from zsim.search.variants import Base
    path = ROOT / "scenarios" / "deepspeed-moe-ep8-zero2-32xh100.yaml"
    base = Base.load(path, ("parallelism.expert=1",), workers=1)
    sc = base.scenario(())
    offered = [v.assignments for v in playbook(base.raw, sc) if v.name.startswith("expert parallel size")]
    assert offered == [("parallelism.expert=2",), ("parallelism.expert=4",), ("parallelism.expert=8",)]
    found = layouts(sc)
    assert all(lay.pipeline == 1 for lay in found)
    assert {lay.expert for lay in found} == {1, 2, 4, 8, 16, 32}   # the divisors of DP 32 dividing 64 experts
    res = tune(base, budget=12)
    assert res.ranked and res.ranked[0][0].layout.expert > 1


def test_tune_writes_every_expert_parallel_size_it_tries():
    """On a base with ep_size 8, tune's candidate with ep_size 1 sets it: its scenario runs with
    1 (the assignment was left out for ep_size 1, so the candidate ran, and was ranked, as 8)."""
    from tests.helpers import ROOT
    from zsim.search.tune import layouts, structural_candidates
    from zsim.search.variants import Base
    base = Base.load(ROOT / "scenarios" / "deepspeed-moe-ep8-zero2-32xh100.yaml", (), workers=1)
    sc = base.scenario(())
    assert sc.expert_parallel_size == 8
    one = next(c for c in structural_candidates(sc) if c.layout.expert == 1)
    assert "parallelism.expert=1" in one.assignments()
    assert base.resolve(one.variant)[0].expert_parallel_size == 1
    assert all(lay.expert_searched for lay in layouts(sc))
    assert not any(lay.expert_searched for lay in layouts(scenario()))
