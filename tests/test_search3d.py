"""Layouts (TP x PP x DP) in the search tools: tune's layouts, batch keys re-derived when an
override or a sweep point changes the data-parallel size."""
from __future__ import annotations

import json

import yaml

from tests.fuzz import run_cli
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
    assert all(lay.sequence_parallel == (lay.tensor > 1) for lay in found[1:])


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
