"""zsim sweep and doctor tell the truth: failed points keep their one-line reason (table, JSON,
CSV, plots), a global batch too small for the GPUs says so, and the doctor names the op the
ledger shows at the peak."""
from __future__ import annotations

import csv
import json

import yaml

from tests.helpers import run_cli
from tests.helpers import mapping


def _pinned_batch(tmp_path) -> str:
    # train_batch_size 16 and micro-batch 2 pinned, GAS free: DeepSpeed derives GAS = 16 // (2 x DP)
    raw = mapping(**{"deepspeed.train_batch_size": 16})
    del raw["training"]["gradient_accumulation_steps"]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_global_batch_below_one_sample_per_rank_says_so(tmp_path):
    out = run_cli(["run", _pinned_batch(tmp_path), "--quiet", "--set", "hardware.nodes=2"])
    assert out.code == 2
    line = out.stderr.strip()
    assert "\n" not in line and "gradient_accumulation_steps (0)" not in line
    assert ("deepspeed.train_batch_size: 16" in line and "train_micro_batch_size_per_gpu (2) x data-parallel size (16)"
            " = 32" in line and "DeepSpeed derives gradient_accumulation_steps = 0" in line
            and "multiple of 32" in line)


def test_sweep_lists_failed_points_whole_and_plots_mark_them(tmp_path):
    from zsim.report import plots

    js, cs = tmp_path / "rows.json", tmp_path / "rows.csv"
    out = run_cli(["sweep", _pinned_batch(tmp_path), "--vary", "hardware.nodes=1,2", "--workers", "1", "--width", "80",
                   "--json", str(js), "--csv", str(cs)])
    assert out.code == 0, out.stderr
    reason = next(r for r in json.loads(js.read_text()) if not r["ok"])["error"]
    assert reason.startswith("deepspeed.train_batch_size: 16") and "give a multiple of 32" in reason
    # the table marks the row and lists the point with its whole reason (no cell cuts it)
    assert "failed points (1):" in out.stdout and f"point 1 (nodes=2): {reason}" in out.stdout.replace("\n", " ")
    csv_rows = list(csv.DictReader(cs.read_text().splitlines()))
    assert [r["error"] for r in csv_rows] == ["", reason]
    for path in (js, cs):
        _, rows = plots.load_results(str(path))
        assert plots.failed_points(rows) == [{"label": "nodes=2", "error": reason}]
        assert [("error" in d) for d in plots.throughput_data(rows)] == [False, True]
        assert [d.get("error") for d in plots.memory_data("rows", rows)] == [None, reason]
    for kind in ("throughput", "memory", "scaling"):
        png = tmp_path / f"{kind}.png"
        drawn = run_cli(["plot", str(js), "--kind", kind, "--out", str(png)])
        assert drawn.code == 0, drawn.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_doctor_names_the_op_at_the_peak_of_a_shortened_step():
    # Llama-2 70B under ZeRO-3 without checkpointing: the step is simulated with repeated layers,
    # and the peak (in a layer window's last copy) is not the simulated events' own highest point;
    # the op named is the one an every-op simulation shows at the peak (see [Note: peak of a
    # shortened step])
    from zsim.api import run_scenario
    from zsim.engine.ledger import timeline
    from zsim.search.doctor import _op_at_peak
    from zsim.search.variants import Base
    from tests.helpers import ROOT

    base = Base.load(ROOT / "scenarios" / "llama2-70b-zero3-64xa100.yaml", ("training.activation_checkpointing=none",))
    sc = base.scenario(())
    short, short_trace = run_scenario(sc)
    full, full_trace = run_scenario(sc, steady=False)
    assert short_trace.repeat is not None and full_trace.repeat is None
    simulated_top = max(used for _, used in timeline(short_trace.ledger_events))
    assert short_trace.repeat.peak_and_breakdown(short_trace.ledger_events)[0] > simulated_top
    assert short.memory.peak_bytes == full.memory.peak_bytes
    assert _op_at_peak(short_trace) == _op_at_peak(full_trace)


def test_doctor_rules_out_pairs_by_the_memory_bound_with_the_same_fixes(monkeypatch):
    from zsim.search import doctor as doctor_mod
    from tests.helpers import ROOT

    path = ROOT / "scenarios" / "oom-gpt3-2.7b-zero1-40g.yaml"
    sets = ("training.micro_batch_size=64",)
    bounded = doctor_mod.doctor_file(path, sets)
    ruled_out = [t for t in bounded["tried"] if t.get("simulated") is False]
    assert ruled_out and all(t["memory_lower_bound_bytes"] > t["capacity_bytes"] and not t["fits"] for t in ruled_out)
    monkeypatch.setattr(doctor_mod, "_memory_bound", lambda base, cand: None)   # every pair simulated
    every = doctor_mod.doctor_file(path, sets)
    assert bounded["fixes"] == every["fixes"] and bounded["diagnosis"] == every["diagnosis"]
    simulated = {t["name"]: t for t in every["tried"]}
    assert all(not simulated[t["name"]]["gpu_fits"] for t in ruled_out)   # the bound was right
