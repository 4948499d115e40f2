"""zsim calibrate's plan: message sizes, the layer's GEMMs, the benchmark items and their
collective passes (no torch)."""
from __future__ import annotations

import pytest

from calibration.harness.plan import LayerShape, default_plan, items, layer_gemms, message_sizes


def test_message_sizes_log_spaced_with_max():
    assert message_sizes(1 << 20, 4) == [1024, 4096, 16384, 65536, 262144, 1048576]
    assert message_sizes(3000, 2) == [1024, 2048, 3000]


def test_layer_gemms_match_zsim_layouts():
    g = layer_gemms(LayerShape(512, 8, 256, 2))
    assert ("qkv", "fwd", 512, 1536, 512) in g
    assert ("fc_out", "dgrad", 512, 2048, 512) in g      # dx = dy W: (t, in, out)
    assert ("fc_in", "wgrad", 2048, 512, 512) in g       # dW: (out, in, t)
    assert len(g) == 12


def test_plan_items_and_roundtrip():
    plan = default_plan("quick")
    names = items(plan, 2, 1)
    assert names[0] == "overhead" and names[-4:] == ["io", "interference", "rank_views", "collective_memory"]
    assert "collective_memory" not in items(plan, 1, 1)   # one rank: no collective to measure
    # 7 ops x 6 sizes in fp32, the 3 reducing ones again in bf16 (the default --dtype)
    assert sum(n.startswith("collective/") for n in names) == 7 * 6 + 3 * 6
    assert plan.from_json(plan.to_json()) == plan
    assert any(n.startswith("collective/all_reduce/inter_node") for n in items(plan, 16, 2))


def test_collective_passes_are_spread_and_pooled():
    """Full mode measures every collective size in 3 passes over all sizes; the fit pools them
    into one point whose mean per call is the mean over every pass's calls."""
    from dataclasses import replace
    from calibration.harness.fit_comm import mean_call_time_s, pool_passes
    plan = replace(default_plan("quick"), coll_passes=3)
    names = [n for n in items(plan, 2, 1) if n.startswith("collective/")]
    assert len(names) == 3 * (7 + 3) * 6 and len(set(names)) == len(names)
    first = names.index("collective/all_reduce/world/fp32/1024/pass1")
    second = names.index("collective/all_reduce/world/fp32/1024/pass2")
    assert second - first == (7 + 3) * 6      # a whole pass over the sizes (and bf16 reductions) in between
    assert default_plan("full").coll_passes == 3
    base = {"kind": "collective", "op": "all_reduce", "group": "world", "tier": "intra_node", "dtype": "bf16",
            "size_bytes": 1024, "ranks": 2}
    recs = [dict(base, item="collective/all_reduce/world/bf16/1024/pass1", times_s=[1.0, 2.0], time_s=1.5,
                 last_arriver_s=1.0),
            {"kind": "gemm", "time_s": 0.1},
            dict(base, item="collective/all_reduce/world/bf16/1024/pass2", times_s=[6.0], time_s=6.0,
                 last_arriver_s=4.0)]
    pooled = pool_passes(recs)
    assert len(pooled) == 2 and pooled[1] == {"kind": "gemm", "time_s": 0.1}
    assert mean_call_time_s(pooled[0]) == pytest.approx(3.0) and pooled[0]["time_s"] == 2.0
    assert pooled[0]["last_arriver_s"] == pytest.approx(2.0)
    assert pooled[0]["item"] == "collective/all_reduce/world/bf16/1024"
    assert recs[0]["times_s"] == [1.0, 2.0]   # the input records are left as they were


def test_a_dtype_list_measures_each_dtype_and_its_optimizer_step():
    import json
    from calibration.harness.plan import Plan
    plan = default_plan("quick", dtypes=("fp32", "bf16"))
    assert plan.profile_dtype == "fp32" and plan.fitted_dtypes == ("fp32", "bf16")
    layers = [n for n in items(plan, 2, 1) if n.startswith("layer/")]
    assert layers == ["layer/fp32/h256-a4-s128-b1", "layer/bf16/h256-a4-s128-b1"]
    assert Plan.from_json(plan.to_json()) == plan
    # one dtype: today's plan, no by_dtype fit
    one = default_plan("quick")
    assert one.fit_dtypes == () and one.fitted_dtypes == ("bf16",) and one.compute_dtypes == ("bf16",)
    assert default_plan("full", dtypes=("fp16", "bf16")).compute_dtypes == ("fp16", "bf16", "fp32")
    # a plan.json written before fit_dtypes existed still loads
    old = json.loads(one.to_json())
    del old["fit_dtypes"]
    assert Plan.from_json(json.dumps(old)) == one


def test_quick_plan_times_deepspeeds_hooks_when_asked():
    from dataclasses import replace

    assert "zero3_hooks" not in items(default_plan("quick"), 2, 1)
    assert "zero3_hooks" in items(replace(default_plan("quick"), hooks=True), 2, 1)
    assert "zero3_hooks" in items(default_plan("full"), 2, 1)


def test_oversubscribed_cpu_ranks_time_longer_repetitions(monkeypatch):
    """More CPU ranks than cores: a quick run times each repetition as a full run does (10 ms), three
    times as many; a run with a core per rank keeps the quick plan."""
    import argparse

    from calibration.commands.calibrate import add_parser, resolve

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    quick = default_plan("quick")
    plan, *_ = resolve(p.parse_args(["calibrate", "--out", "x", "--quick", "--nproc-per-node", "4"]))
    assert (plan.reps, plan.min_rep_time_s) == (3 * quick.reps, 0.01)
    plan, *_ = resolve(p.parse_args(["calibrate", "--out", "x", "--quick", "--nproc-per-node", "2"]))
    assert (plan.reps, plan.min_rep_time_s) == (quick.reps, quick.min_rep_time_s)
