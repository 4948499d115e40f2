"""compare, sweep, plot and tune, as users run them, with assertions on the data behind the plots."""
import csv
import json

import matplotlib.image as mpimg
import pytest
import yaml

from tests.helpers import mapping, tight_gpu
from zsim.cli import main
from tests.helpers import ROOT
from zsim.report import plots
from zsim.search.tune import memory_lower_bound, score, tune
from zsim.search.variants import Base

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def scen(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(mapping(**{"training.micro_batch_size": 4})))
    return p


def _valid_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    img = mpimg.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 200


def test_compare_rows_winner_and_files(tmp_path, scen):
    js, cs, png = tmp_path / "c.json", tmp_path / "c.csv", tmp_path / "c.png"
    assert main(["compare", str(scen), "--quiet", "--json", str(js), "--csv", str(cs), "--plot", str(png)]) == 0
    rows = json.loads(js.read_text())
    assert [r["stage"] for r in rows[:4]] == [0, 1, 2, 3]
    assert {r["offload"] for r in rows} >= {"none", "optimizer cpu", "optimizer+params cpu"}
    winners = [r for r in rows if r["winner"]]
    assert len(winners) == 1
    assert winners[0]["tokens_per_s_per_gpu"] == max(r["tokens_per_s_per_gpu"] for r in rows if r["fits"])
    # the winner's assignments, run again through `zsim run --set`, fit and give the same throughput
    again = tmp_path / "again.json"
    assert main(["run", str(scen), "--quiet", "--json", str(again), *(a for s in winners[0]["set"] for a in ("--set", s))]) == 0
    r = json.loads(again.read_text())
    assert r["memory"]["fits"] and r["memory"]["host"]["fits"]
    assert r["tokens_per_s_per_gpu"] == pytest.approx(winners[0]["tokens_per_s_per_gpu"], rel=1e-9)
    # full replicas hold the most (on this tiny model buckets and gathered params blur the rest)
    peaks = [r["peak_bytes"] for r in rows[:4]]
    assert peaks[0] == max(peaks)
    assert len(list(csv.DictReader(cs.read_text().splitlines()))) == len(rows)
    data = plots.compare_data(rows)
    assert all(v is not None for v in data["throughput"]["none"])   # a bar for every stage
    assert len(data["memory"]) == len(rows)
    _valid_png(png)


def test_sweep_product_failing_point_and_parallel_equivalence(tmp_path, scen):
    a, b = tmp_path / "a.json", tmp_path / "b.csv"
    args = ["sweep", str(scen), "--quiet", "--vary", "deepspeed.zero_optimization.stage=2,3,5",
            "--vary", "hardware.nodes=1,2"]
    assert main(args + ["--workers", "2", "--json", str(a), "--csv", str(b)]) == 0
    rows = json.loads(a.read_text())
    assert len(rows) == 6 and [r["point"] for r in rows] == list(range(6))
    bad = [r for r in rows if not r["ok"]]
    assert [r["deepspeed.zero_optimization.stage"] for r in bad] == [5, 5]
    assert "choose one of 0, 1, 2, 3" in bad[0]["error"]
    good = [r for r in rows if r["ok"]]
    assert all(r["step_time_s"] > 0 and "memory.breakdown.activations" in r for r in good)
    serial = tmp_path / "s.json"
    assert main(args + ["--workers", "1", "--json", str(serial)]) == 0
    assert json.loads(serial.read_text()) == rows
    header = b.read_text().splitlines()[0].split(",")
    assert header[:4] == ["point", "varied", "deepspeed.zero_optimization.stage", "hardware.nodes"]
    # plot labels name the swept keys, from CSV and from (key-sorted) JSON alike
    for path in (a, b):
        kind, loaded = plots.load_results(str(path))
        labels = [d["label"] for d in plots.throughput_data(loaded)]
        assert labels[0] == "stage=2, nodes=1"


def test_sweep_bad_vary_is_one_line(capsys, scen):
    assert main(["sweep", str(scen), "--vary", "hardware.nodes"]) == 2
    assert "--vary" in capsys.readouterr().err


def test_scaling_plot_data_monotonic_and_oom_flagged(tmp_path, scen):
    out = tmp_path / "sw.csv"
    assert main(["sweep", str(scen), "--quiet", "--workers", "1", "--csv", str(out),
                 "--vary", "hardware.nodes=1,2,4", "--vary", "deepspeed.zero_optimization.stage=0,3",
                 "--vary", "training.micro_batch_size=4,16384"]) == 0
    kind, rows = plots.load_results(str(out))
    assert kind == "rows"
    data = plots.scaling_data(rows)
    assert set(data) == {0, 3}
    for pts in data.values():
        assert [p["gpus"] for p in pts] == [8, 16, 32]
        totals = [p["tokens_per_s"] for p in pts]
        assert totals == sorted(totals)            # more GPUs, more tokens/s (weak scaling)
        assert not any(p["oom"] for p in pts)      # micro-batch 4 fits at every size
    oom_only = [r for r in rows if r["training.micro_batch_size"] == 16384]
    assert all(p["oom"] for pts in plots.scaling_data(oom_only).values() for p in pts)
    png = tmp_path / "scaling.png"
    assert main(["plot", str(out), "--kind", "scaling", "--out", str(png)]) == 0
    _valid_png(png)
    svg = tmp_path / "t.svg"
    assert main(["plot", str(out), "--kind", "throughput", "--out", str(svg)]) == 0
    assert svg.read_text().lstrip().startswith("<?xml")
    assert len(plots.throughput_data(rows)) == len(rows)


def test_memory_timeline_and_gantt_from_a_run(tmp_path, scen):
    run_json, trace = tmp_path / "r.json", tmp_path / "t.json"
    assert main(["run", str(scen), "--quiet", "--json", str(run_json), "--trace", str(trace),
                 "--set", "deepspeed.zero_optimization.stage=3"]) == 0
    result = json.loads(run_json.read_text())
    kind, tr = plots.load_results(str(trace))
    assert kind == "trace"
    lanes = plots.timeline_data(tr)["lanes"]
    assert {"compute stream", "allgather stream", "reduce stream"} <= set(lanes)
    mt = plots.memory_timeline_data(tr)
    reserve = result["memory"]["breakdown"]["CUDA context + allocator reserve"]
    assert mt["peak_GiB"] * 2**30 == pytest.approx(result["memory"]["peak_bytes"] - reserve, rel=1e-5)
    mem = plots.memory_data("run", result)
    assert mem == [{"label": result["scenario"], "breakdown": result["memory"]["breakdown"],
                    "capacity_bytes": result["memory"]["capacity_bytes"]}]
    for k in ("timeline", "memory-timeline"):
        out = tmp_path / f"{k}.png"
        assert main(["plot", str(trace), "--kind", k, "--out", str(out)]) == 0
        _valid_png(out)
    out = tmp_path / "m.png"
    assert main(["plot", str(run_json), "--kind", "memory", "--out", str(out)]) == 0
    _valid_png(out)


def test_plot_rejects_the_wrong_input(capsys, tmp_path, scen):
    run_json = tmp_path / "r.json"
    assert main(["run", str(scen), "--quiet", "--json", str(run_json)]) == 0
    capsys.readouterr()
    assert main(["plot", str(run_json), "--kind", "timeline", "--out", str(tmp_path / "x.png")]) == 2
    assert main(["plot", str(run_json), "--kind", "memory", "--out", str(tmp_path / "x.jpg")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "needs trace results" in err[0] and ".png or .svg" in err[1]


@pytest.mark.parametrize("objective", ["tokens_per_s", "step_time_s"])
def test_tune_winner_beats_every_evaluated_point_and_pruning_is_sound(objective):
    base = Base(tight_gpu(0.5), ROOT, "tight")
    res = tune(base, objective, budget=24)
    assert res.pruned and res.simulated <= 24
    winner, best = res.ranked[0]
    for c, out in res.evaluated:
        again = base.run(c.variant).result     # simulated afresh, outside tune's bookkeeping
        assert again == out.result
        if again is not None and again.fits:
            assert score(best, objective) >= score(again, objective)
            # the pruning bound is a true lower bound of the simulated peak
            assert memory_lower_bound(base.scenario(c.assignments())) <= again.memory.peak_bytes
    for c in res.pruned:
        again = base.run(c.variant).result
        assert again is None or not again.fits


def test_tune_writes_a_ds_config_that_reproduces_the_winner(tmp_path, scen):
    base = Base.load(scen)
    winner, best = tune(base, "tokens_per_s", budget=24).ranked[0]
    out = tmp_path / "ds.json"
    assert main(["tune", str(scen), "--budget", "24", "--out", str(out)]) == 0
    cfg = json.loads(out.read_text())
    world = 8
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * world
    assert cfg["train_micro_batch_size_per_gpu"] == winner.micro_batch
    assert cfg["bf16"] == {"enabled": True} and cfg["zero_optimization"]["stage"] == winner.stage
    # the written config runs in zsim as the deepspeed block, with the winner's step time, and does
    # not get overwritten silently
    raw = mapping(**{"training.micro_batch_size": None})
    raw["training"].pop("micro_batch_size")
    raw["training"].pop("gradient_accumulation_steps")
    raw["training"]["activation_checkpointing"] = winner.checkpointing
    raw["deepspeed"] = str(out)
    p2 = tmp_path / "from_tune.yaml"
    p2.write_text(yaml.safe_dump(raw))
    run_json = tmp_path / "r.json"
    assert main(["run", str(p2), "--quiet", "--json", str(run_json)]) == 0
    assert json.loads(run_json.read_text())["step_time_s"] == pytest.approx(best.step_time_s, rel=1e-9)
    assert main(["tune", str(scen), "--budget", "4", "--out", str(out)]) == 2


def test_tuned_ds_config_loads_in_deepspeed(tmp_path, scen):
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as dsc
    from zsim.config.ds_writer import tuned_ds_config
    from zsim.search.tune import KNOBS, KNOBS_STAGE3
    base = Base.load(scen)
    best, _ = tune(base, "tokens_per_s", budget=12).ranked[0]
    cfg, _ = tuned_ds_config(base.raw.get("deepspeed"), base.scenario(()), base.scenario(best.assignments()),
                             [*KNOBS, *KNOBS_STAGE3])

    class MPU:   # the data-parallel world size DeepSpeed would see in the real job
        def get_data_parallel_world_size(self):
            return 8

    dsc.dist.get_rank = lambda: 0
    parsed = dsc.DeepSpeedConfig(cfg, mpu=MPU())
    assert parsed.train_batch_size == cfg["train_batch_size"]
    assert parsed.zero_optimization_stage == cfg["zero_optimization"]["stage"]


def test_variants_resolving_to_one_scenario_are_simulated_once(tmp_path, monkeypatch):
    from zsim.search import variants
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(mapping()))
    base = variants.Base.load(path)
    calls = []
    real = variants.run_scenario
    monkeypatch.setattr(variants, "run_scenario", lambda sc, *a: calls.append(sc) or real(sc, *a))
    same = base.run(variants.Variant("stage 2 again", ("deepspeed.zero_optimization.stage=2",)))
    plain = base.run(variants.Variant("as is", ()))
    other = base.run(variants.Variant("stage 3", ("deepspeed.zero_optimization.stage=3",)))
    assert len(calls) == 2 and same.result is plain.result and other.result is not plain.result


def test_tune_searches_pipeline_layouts_and_writes_their_stage_count():
    """Pipeline sizes are a dimension of the search (ZeRO-0/1 only, the batch split over the
    data-parallel ranks left); a pipelined winner's ds_config carries DeepSpeed's pipeline.stages."""
    from zsim.config.ds_writer import tuned_ds_config
    from zsim.search.tune import KNOBS, layouts, structural_candidates

    flat = Base(mapping(**{"model.layers": 4, "training.micro_batch_size": 4}), ROOT, "flat")
    cands = structural_candidates(flat.scenario(()))
    assert {c.layout.pipeline for c in cands} == {1, 2, 4}
    assert all(c.stage <= 1 for c in cands if c.layout.pipeline > 1)
    # the scenario's own layout first, then the others in `layouts` order (TP down, PP up)
    order = layouts(flat.scenario(()))
    assert [order.index(c.layout) for c in cands] == sorted(order.index(c.layout) for c in cands)
    assert order[0].model_parallel == 1
    base = Base(mapping(**{"model.layers": 4, "training.micro_batch_size": 4, "parallelism.pipeline": 2,
                           "deepspeed.zero_optimization.stage": 1}), ROOT, "pp")
    sc = base.scenario(())
    assert structural_candidates(sc)[0].layout.pipeline == 2
    res = tune(base, "tokens_per_s", budget=24)
    for c, out in res.evaluated:
        if out.ok:
            assert out.result.pipeline is None if c.layout.pipeline == 1 else out.result.pipeline.stages == c.layout.pipeline
            assert out.result.global_batch_size == sc.global_batch_size
    # the tiny model runs fastest without a pipeline; the best pipelined point's ds_config
    winner = next(c for c, _ in res.ranked if c.layout.pipeline == 2)
    cfg, notes = tuned_ds_config({}, flat.scenario(()), base.scenario(winner.assignments()), list(KNOBS))
    assert cfg["pipeline"] == {"stages": 2}
    assert any("num_stages=2" in n for n in notes)


def test_points_keeping_the_same_parameters_gathered_share_one_simulation_exactly():
    """tune's structural_key: stage-3 persistence thresholds that keep the same parameters
    gathered build the same schedule, so tune simulates one of them; every point of a shared
    group, simulated on its own, gives the same Result and JSON, and different groups differ."""
    from dataclasses import replace

    from zsim.search.tune import point_workload, structural_candidates, structural_key
    raw = mapping(**{"deepspeed.zero_optimization.stage": 3, "training.micro_batch_size": 4})
    sc = Base(raw, ROOT, "p").scenario(())
    sample = [c for c in structural_candidates(sc) if c.stage == 3 and c.layout.model_parallel == 1][::4][:3]
    assert sample
    for c in sample:
        groups: dict = {}
        wl = point_workload(sc, c)
        for t in (0, 1e3, 1e4, 1e5, 1e6, 1e9):
            p = replace(c, knobs={"stage3_param_persistence_threshold": t})
            groups.setdefault(structural_key(sc, p, wl), []).append(p)
        assert 1 < len(groups) < 6
        firsts = []
        for group in groups.values():
            fresh = [Base(raw, ROOT, "p").run(p.variant).result for p in group]   # no cache shared
            assert all(r == fresh[0] and r.to_dict() == fresh[0].to_dict() for r in fresh)
            firsts.append(fresh[0])
        assert len({json.dumps(r.to_dict(), sort_keys=True) for r in firsts}) == len(firsts)


def test_tune_reports_shared_simulations(tmp_path, scen):
    out = tmp_path / "t.json"
    assert main(["tune", str(scen), "--budget", "40", "--json", str(out),
                 "--set", "deepspeed.zero_optimization.stage=3"]) == 0
    data = json.loads(out.read_text())
    assert 0 <= data["shared"] < data["simulated"] <= 40


def test_tune_budget_all_evaluates_every_candidate_the_bounds_leave(tmp_path, capsys):
    from zsim.search.tune import structural_candidates
    raw = mapping(**{"training.micro_batch_size": 2, "hardware.gpus_per_node": 1})
    base = Base(raw, ROOT, "one")
    res = tune(base, "tokens_per_s", budget=None)
    run = {c.key() for c, _ in res.evaluated}
    bounded = {c.key() for c, _ in res.bounded}
    cands = structural_candidates(base.scenario(()))
    # each candidate pruned by the memory bound, simulated, or skipped by the step-time bound
    assert all((c in res.pruned) + (c.key() in run) + (c.key() in bounded) == 1 for c in cands)
    assert run - {c.key() for c in cands}   # the knob refinement of the best three too
    p = tmp_path / "one.yaml"
    p.write_text(yaml.safe_dump(raw))
    assert main(["tune", str(p), "--budget", "all", "--top", "1"]) == 0
    assert "none left out can enter the best 3" in capsys.readouterr().err
    assert main(["tune", str(p), "--budget", "some"]) == 2


@pytest.mark.parametrize("stage", (1, 2, 3))
def test_the_pruning_bound_stays_below_the_peak_with_checkpoints_on_the_host(stage):
    """cpu_checkpointing moves every block input to host memory: the bound counts none of them on
    the GPU (it counted all, above the simulated peak at stage 1)."""
    from tests.helpers import scenario
    from tests.helpers import LAYER_MODELS as MODELS
    from tests.helpers import VARIANTS
    from zsim.api import run_scenario
    sc = scenario(**{**VARIANTS["stage2-full-cpu-checkpointing"], "deepspeed.zero_optimization.stage": stage},
                  **MODELS["gpt-32"])
    assert memory_lower_bound(sc) <= run_scenario(sc)[0].memory.peak_bytes


@pytest.mark.parametrize("stage, offload", [(0, False), (1, False), (1, True), (2, False), (2, True)])
@pytest.mark.parametrize("gas", (1, 4))
def test_the_pruning_bound_stays_below_the_peak_whatever_the_gradients_lifetime(stage, offload, gas):
    """ZeRO-0/1 gradients are autograd's, made while the backward frees the activations: with one
    micro-step the bound counts the larger of the two, not both (it was above the simulated peak,
    30.71 vs 28.84 GiB, for llama2-7b ZeRO-1 at GAS 1 on 64 GPUs)."""
    from tests.helpers import scenario
    from zsim.api import run_scenario
    kw = {"model": {"preset": "llama2-7b"}, "hardware.nodes": 8, "training.micro_batch_size": 2,
          "training.gradient_accumulation_steps": gas, "deepspeed.zero_optimization.stage": stage}
    if offload:
        kw["deepspeed.zero_optimization.offload_optimizer"] = {"device": "cpu"}
    sc = scenario(**kw)
    assert memory_lower_bound(sc) <= run_scenario(sc)[0].memory.peak_bytes


def test_a_pipeline_trace_plots_each_stage_on_its_own(tmp_path):
    """A pipeline's trace has one process per stage: the Gantt gets each stage's lanes and the
    memory timeline one line per stage, the peak named with its stage."""
    from tests.helpers import mapping
    scen = tmp_path / "pp.yaml"
    scen.write_text(yaml.safe_dump(mapping(**{"parallelism.pipeline": 2, "deepspeed.zero_optimization.stage": 1,
                                              "training.gradient_accumulation_steps": 4})))
    run_json, trace = tmp_path / "r.json", tmp_path / "t.json"
    assert main(["run", str(scen), "--quiet", "--json", str(run_json), "--trace", str(trace)]) == 0
    _, tr = plots.load_results(str(trace))
    lanes = plots.timeline_data(tr)["lanes"]
    assert {"pipeline stage 0: compute stream", "pipeline stage 1: compute stream"} <= set(lanes)
    mt = plots.memory_timeline_data(tr)
    assert set(mt["series"]) == {"pipeline stage 0", "pipeline stage 1"}
    assert mt["peak_GiB"] == max(g for pts in mt["series"].values() for _, g in pts)
    assert mt["peak_GiB"] in [g for _, g in mt["series"][mt["peak_of"]]]
    for k in ("timeline", "memory-timeline"):
        assert main(["plot", str(trace), "--kind", k, "--out", str(tmp_path / f"{k}.png")]) == 0
