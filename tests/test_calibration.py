"""zsim calibrate: pure fitting functions on synthetic records (no torch), the profile schema
extension, argument errors and --force protection (no torch), and end-to-end runs with a
killed rank (torch only; skipped without it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from calibration.harness.fit import (build_profile, fit_collectives, fit_gemm, gemm_law, layer_components,
                                     predict_layer_s, robust_alpha_beta)
from calibration.harness.plan import LayerShape, default_plan, items, layer_gemms, message_sizes
from zsim.config.profile import load_profile
from zsim.errors import ZsimInputError
from zsim.hardware.collectives import Tier, collective_cost, ring_cost
from zsim.schema import build
from zsim.specs.hardware import Cluster, GpuProfile, HardwareProfile

ROOT = Path(__file__).resolve().parents[1]
SIZES = [1024 * 4**i for i in range(8)]


# ----------------------------------------------------------------------------- plan
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
    assert names[0] == "overhead" and names[-2:] == ["io", "interference"]
    assert sum(n.startswith("collective/") for n in names) == 7 * 6   # 7 ops x 6 sizes, fp32
    assert plan.from_json(plan.to_json()) == plan
    assert any(n.startswith("collective/all_reduce/inter_node") for n in items(plan, 16, 2))


def test_collective_passes_are_spread_and_pooled():
    """Full mode measures every collective size in 3 passes over all sizes; the fit pools them
    into one point whose mean per call is the mean over every pass's calls."""
    from dataclasses import replace
    from calibration.harness.fit import _t_mean, pool_passes
    plan = replace(default_plan("quick"), coll_passes=3)
    names = [n for n in items(plan, 2, 1) if n.startswith("collective/")]
    assert len(names) == 3 * 7 * 6 and len(set(names)) == len(names)
    first = names.index("collective/all_reduce/world/fp32/1024/pass1")
    second = names.index("collective/all_reduce/world/fp32/1024/pass2")
    assert second - first == 7 * 6            # a whole pass over the sizes in between
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
    assert _t_mean(pooled[0]) == pytest.approx(3.0) and pooled[0]["time_s"] == 2.0
    assert pooled[0]["last_arriver_s"] == pytest.approx(2.0)
    assert pooled[0]["item"] == "collective/all_reduce/world/bf16/1024"
    assert recs[0]["times_s"] == [1.0, 2.0]   # the input records are left as they were


# ----------------------------------------------------------------------------- regression
def test_alpha_beta_exact_on_linear_data():
    a, spb = robust_alpha_beta(SIZES, [50e-6 + s / 2e9 for s in SIZES])
    assert a == pytest.approx(50e-6, rel=1e-9)
    assert spb == pytest.approx(1 / 2e9, rel=1e-9)


def test_alpha_beta_ignores_one_outlier():
    t = [50e-6 + s / 2e9 for s in SIZES]
    t[3] *= 10            # a repetition hit by a noisy neighbour
    a, spb = robust_alpha_beta(SIZES, t)
    assert a == pytest.approx(50e-6, rel=1e-4)
    assert spb == pytest.approx(1 / 2e9, rel=1e-4)


def test_alpha_beta_never_negative():
    a, spb = robust_alpha_beta([1e3, 1e6], [2e-3, 1e-3])   # noise made the large message faster
    assert spb == 0.0 and 1e-3 < a < 2e-3


# ----------------------------------------------------------------------------- collectives
def _coll_records(tier: Tier, n=2, ops=("all_gather", "all_reduce", "broadcast")):
    return [{"kind": "collective", "op": op, "group": "world", "tier": "intra_node", "ranks": n, "dtype": "fp32",
             "size_bytes": s, "time_s": ring_cost(op.removesuffix("_coalesced"), s, n, tier, "intra_node",
                                                  op.endswith("_coalesced")).time_s}
            for op in ops for s in SIZES]


def test_fit_collectives_reproduces_every_measurement():
    truth = Tier(4e9, 30e-6, ((1024, 0.05), (1 << 20, 0.6), (1 << 24, 1.0)),
                 (("broadcast", ((1024, 0.1), (1 << 24, 0.9))),))
    recs = _coll_records(truth)
    fit = fit_collectives(recs, "fp32")["intra_node"]
    fitted = Tier(fit["busbw_GBps"] * 1e9, fit["latency_us"] * 1e-6, ((1.0, 1.0),),
                  tuple((k, tuple(map(tuple, v))) for k, v in fit["efficiency_by_collective"].items()))
    for r in recs:
        t = collective_cost(r["op"], r["size_bytes"], 1, 2, fitted, fitted).time_s
        assert t == pytest.approx(r["time_s"], rel=1e-9)
    assert all(0 < e <= 1 for tab in fit["efficiency_by_collective"].values() for _, e in tab)
    assert 0 < fit["latency_us"] <= 0.95 * 32.56 + 1e-9   # capped below the fastest step (all_gather, 1 KB)


def test_profile_efficiency_by_collective_is_used_and_validated():
    base, _ = __import__("zsim.config.profile", fromlist=["x"]).read_profile_mapping("dgx-a100-80g")
    base["intra_node"]["efficiency_by_collective"] = {"broadcast": [[1e3, 0.5], [1e9, 0.5]]}
    prof = build(HardwareProfile, base)
    cl = Cluster(profile=prof, nodes=1, gpus_per_node=8)
    from zsim.hardware.collectives import tiers_for
    intra, inter = tiers_for(cl)
    bc = collective_cost("broadcast", 1e8, 1, 8, intra, inter)
    assert bc.transfer_s == pytest.approx(1e8 / (235e9 * 0.5))
    ref = load_profile("dgx-a100-80g")   # other collectives keep the shared table
    ri, rx = tiers_for(Cluster(profile=ref, nodes=1, gpus_per_node=8))
    assert collective_cost("all_reduce", 1e8, 1, 8, intra, inter) == collective_cost("all_reduce", 1e8, 1, 8, ri, rx)
    base["intra_node"]["efficiency_by_collective"] = {"alreduce": [[1e3, 0.5]]}
    with pytest.raises(ZsimInputError, match="did you mean 'all_reduce'"):
        build(HardwareProfile, base)


# ----------------------------------------------------------------------------- compute
def test_fit_gemm_recovers_law():
    shapes = [(128, 768, 256), (128, 256, 256), (1024, 256, 128), (2048, 2048, 2048), (64, 64, 64)]
    recs = [{"kind": "gemm", "dtype": "bf16", "m": m, "n": n, "k": k, "flops": 2.0 * m * n * k,
             "time_s": 2.0 * m * n * k / (1e12 * gemm_law(m, n, k, 64.0))} for m, n, k in shapes]
    fit = fit_gemm(recs)
    assert fit["gemm_half_efficiency_dim"] == pytest.approx(64.0, rel=1e-9)
    assert fit["peak_tflops"]["bf16"] == pytest.approx(1.0, rel=1e-9)
    assert max(abs(r["error"]) for r in fit["residuals"]) < 1e-9


def test_layer_prediction_is_its_components_plus_launch_overhead():
    gpu = GpuProfile(model="x", peak_tflops_fp32=1, peak_tflops_tf32=1, peak_tflops_fp16=1, peak_tflops_bf16=1,
                     hbm_capacity_GiB=1, hbm_bw_GBps=20, gemm_max_efficiency=1.0, gemm_half_efficiency_dim=16,
                     flash_attention_fwd_efficiency=0.1, flash_attention_bwd_efficiency=0.05,
                     memory_bound_efficiency=0.4, kernel_overhead_us=7.0)
    shape = {"hidden": 256, "heads": 4, "seq_len": 128, "micro_batch": 1, "dtype": "bf16"}
    kernels = []
    for backward in (False, True):
        g, a, m, k = layer_components(gpu, 1e12, shape, "bf16", backward)
        assert g > 0 and a > 0 and m > 0
        assert predict_layer_s(gpu, 1e12, shape, "bf16", backward) == pytest.approx(g + a + m + k * 7e-6, rel=1e-12)
        kernels.append(k)
    assert tuple(kernels) == (8, 15)


def _synthetic_run():
    recs = _coll_records(Tier(4e9, 30e-6, ((1024, 0.05), (1 << 24, 1.0))))
    L = {"hidden": 128, "heads": 2, "seq_len": 64, "micro_batch": 1}
    for name, pas, m, n, k in layer_gemms(LayerShape(**L)):
        recs.append({"kind": "gemm", "dtype": "bf16", "module": name, "pass": pas, "m": m, "n": n, "k": k,
                     "flops": 2.0 * m * n * k, "time_s": 2.0 * m * n * k / 1e11})
    recs += [{"kind": "kernel_overhead", "time_s": 3e-6}, {"kind": "autograd_overhead", "time_s": 13e-6},
             {"kind": "memcpy", "where": "host", "GBps": 20.0, "time_s": 1e-3},
             {"kind": "attention", "dtype": "bf16", "pass": "fwd", "flops": 1e6, "time_s": 1e-4},
             {"kind": "attention", "dtype": "bf16", "pass": "bwd", "flops": 2.5e6, "time_s": 5e-4},
             {"kind": "membound", "dtype": "bf16", "pass": "fwd", "bytes": 1e5, "time_s": 1e-5},
             {"kind": "layer", "dtype": "bf16", "layer": "x", "pass": "fwd", **L, "time_s": 1e-3},
             {"kind": "layer", "dtype": "bf16", "layer": "x", "pass": "bwd", **L, "time_s": 2e-3},
             {"kind": "adam", "impl": "torch.optim.Adam(fused)", "device": "cpu", "params": 100, "threads": 2,
              "params_per_s": 4e8, "time_s": 1e-3},
             {"kind": "file_io", "op": "read", "node_GBps": 2.0, "o_direct": True, "time_s": 1.0},
             {"kind": "file_io", "op": "write", "node_GBps": 1.0, "o_direct": True, "time_s": 1.0},
             {"kind": "interference", "gemm_alone_s": 1.0, "gemm_during_comm_s": 1.25, "comm_alone_s": 1.0,
              "comm_during_gemm_s": 2.0}]
    prov = {"world_size": "2", "ranks_per_node": "2", "nodes": "1", "backend": "gloo", "cpu_cores": "2",
            "host_memory_GiB": "16", "mode": "quick", "date": "2026-01-01T00:00:00Z", "hosts": "h"}
    return recs, prov


def test_build_profile_is_loadable_and_exact():
    recs, prov = _synthetic_run()
    prof, report = build_profile("synthetic", recs, prov, "bf16")
    hp = build(HardwareProfile, prof)
    assert hp.gpus_per_node == 2
    assert hp.cpu.adam_params_per_s_per_core == pytest.approx(2e8)
    assert hp.nvme.read_GBps_per_drive == 2.0 and hp.nvme.write_GBps_per_drive == 1.0
    assert hp.interference.compute_slowdown_during_comm == pytest.approx(0.25)
    kernel = report["compute"]["kernel_fits"]    # before the layer closure adjusts them
    assert kernel["memory_bound_efficiency"] == pytest.approx(1e5 / (20e9 * (1e-5 - 3e-6)), rel=1e-5)
    assert kernel["flash_attention_bwd_efficiency"] == pytest.approx(
        2.5e6 / (1e11 * (5e-4 - 2 * 3e-6 - 10e-6)), rel=1e-5)
    assert 0 < hp.gpu.memory_bound_efficiency <= 1 and 0 < hp.gpu.flash_attention_bwd_efficiency <= 1
    assert hp.provenance["backend"] == "gloo" and hp.provenance["comm_slowdown_during_compute"] == "1.000"
    assert set(hp.intra_node.efficiency_by_collective) == {"all_gather", "all_reduce", "broadcast"}


# ----------------------------------------------------------------------------- CLI (no torch needed)
def _zsim(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "zsim.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.mark.parametrize("args, needle", [
    (["--out", "bad name!"], "--out"),
    (["--out", "x", "--max-size", "12XB"], "--max-size"),
    (["--out", "x", "--max-size", "10"], "--max-size"),
    (["--out", "x", "--layer", "10,3,4,1"], "--layer"),
    (["--out", "x", "--layer", "10,3"], "--layer"),
    (["--out", "x", "--nproc-per-node", "0"], "--nproc-per-node"),
    (["--out", "x", "--timeout", "-1"], "--timeout"),
    (["--out", "x", "--dtype", "int8"], "--dtype"),
    (["--out", "x", "--backend", "mpi"], "--backend"),
    ([], "--out"),
])
def test_bad_arguments_one_line_exit_2(args, needle, tmp_path):
    r = _zsim("calibrate", "--root", str(tmp_path), *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_existing_profile_is_not_overwritten_without_force(tmp_path):
    prof = tmp_path / "hardware_profiles" / "mine.yaml"
    prof.parent.mkdir()
    prof.write_text("precious: true\n")
    r = _zsim("calibrate", "--out", "mine", "--quick", "--root", str(tmp_path))
    assert r.returncode == 2 and "--force" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert prof.read_text() == "precious: true\n"


# ----------------------------------------------------------------------------- end to end (torch)
TINY = ["--quick", "--max-size", "4KiB", "--layer", "64,2,32,1", "--timeout", "30"]


def test_quick_calibration_end_to_end(tmp_path):
    pytest.importorskip("torch")
    r = _zsim("calibrate", "--out", "tiny", "--root", str(tmp_path), *TINY)
    assert r.returncode == 0, r.stderr
    prof = tmp_path / "hardware_profiles" / "tiny.yaml"
    hp = load_profile(str(prof))
    assert hp.gpus_per_node == 2 and hp.intra_node.efficiency_by_collective
    doc = json.loads((tmp_path / "calibration" / "runs" / "tiny" / "records.json").read_text())
    assert doc["status"] == "complete" and doc["provenance"]["backend"] == "gloo"
    kinds = {x["kind"] for x in doc["records"]}
    assert {"collective", "gemm", "attention", "membound", "layer", "adam", "file_io", "memcpy",
            "interference", "kernel_overhead"} <= kinds
    assert not list((tmp_path / "calibration" / "runs").glob(".*scratch*"))
    # and zsim run loads it like a hand-written profile
    sc = tmp_path / "s.yaml"
    sc.write_text(yaml.safe_dump({"name": "t", "model": {"layers": 2, "hidden": 64, "heads": 2, "vocab": 128,
                                                         "seq_len": 32},
                                  "hardware": {"profile": str(prof)},
                                  "training": {"micro_batch_size": 1, "gradient_accumulation_steps": 1,
                                               "precision": "bf16"},
                                  "deepspeed": {"zero_optimization": {"stage": 2}}}))
    assert _zsim("run", str(sc), "--quiet").returncode == 0
    again = _zsim("calibrate", "--out", "tiny", "--root", str(tmp_path), *TINY)
    assert again.returncode == 2 and "--force" in again.stderr


def test_killed_rank_names_rank_and_benchmark_and_keeps_records(tmp_path):
    pytest.importorskip("torch")
    r = _zsim("calibrate", "--out", "dies", "--root", str(tmp_path), *TINY,
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
    r = _zsim("calibrate", "--out", "hangs", "--root", str(tmp_path), *TINY[:-1], "5",
              env={"ZSIM_CALIB_FAULT": "1:collective/broadcast/world/fp32/1024:hang"})
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "rank 1 hung" in last and "collective/broadcast/world/fp32/1024" in last, r.stderr
    doc = json.loads((tmp_path / "calibration" / "runs" / "hangs" / "records.json").read_text())
    assert doc["status"] == "failed" and len(doc["records"]) > 0


def test_layer_closure_recovers_known_scales():
    """Layers generated by zsim's own model with slower attention (forward 1.5x, backward 2x):
    the closure finds exactly those scales and then predicts every layer."""
    from calibration.harness.fit import _gpu, fit_layer_closure, layer_components, layer_residuals
    fields = {"gemm_max_efficiency": 1.0, "gemm_half_efficiency_dim": 0.0, "flash_attention_fwd_efficiency": 0.5,
              "flash_attention_bwd_efficiency": 0.4, "memory_bound_efficiency": 0.5, "kernel_overhead_us": 0.0}
    peak, hbm = 1.0, 20.0
    gpu = _gpu(fields, peak, hbm, "bf16")
    layers = []
    for h, a, s_, b in ((256, 4, 128, 2), (512, 8, 128, 1), (384, 6, 256, 1)):
        for pas in ("fwd", "bwd"):
            shape = {"hidden": h, "heads": a, "seq_len": s_, "micro_batch": b}
            g, att, m, k = layer_components(gpu, peak * 1e12, shape, "bf16", pas == "bwd")
            t = g + att * (1.5 if pas == "fwd" else 2.0) + m
            layers.append({**shape, "layer": f"h{h}", "dtype": "bf16", "pass": pas, "time_s": t, "min_s": t})
    closed, peak_scale, scales = fit_layer_closure(layers, fields, peak, hbm, "bf16")
    assert scales["attention_fwd"] == pytest.approx(1.5, rel=1e-6)
    assert scales["attention_bwd"] == pytest.approx(2.0, rel=1e-6)
    assert scales["gemm"] == pytest.approx(1.0, rel=1e-6)
    assert closed["flash_attention_fwd_efficiency"] == pytest.approx(0.5 / 1.5, rel=1e-6)
    for r in layer_residuals(layers, closed, {"bf16": peak * peak_scale}, hbm):
        assert abs(r["error"]) < 1e-6


def test_collective_fit_reproduces_the_mean_call_not_the_median_repetition():
    # a step sums many calls, so one stalled repetition in five must land in the fit
    reps = [1e-3, 1e-3, 1e-3, 1e-3, 6e-3]
    recs = [{"kind": "collective", "op": "all_reduce", "group": "world", "tier": "intra_node", "ranks": 2,
             "dtype": "fp32", "size_bytes": s, "time_s": 1e-3 * k, "times_s": [t * k for t in reps]}
            for k, s in enumerate(SIZES, start=1)]
    fit = fit_collectives(recs, "fp32")["intra_node"]
    tier = Tier(fit["busbw_GBps"] * 1e9, fit["latency_us"] * 1e-6, ((1.0, 1.0),),
                tuple((k, tuple(map(tuple, v))) for k, v in fit["efficiency_by_collective"].items()))
    for k, s in enumerate(SIZES, start=1):
        assert collective_cost("all_reduce", s, 1, 2, tier, tier).time_s == pytest.approx(2e-3 * k, rel=1e-9)


def test_coalesced_all_gather_gets_its_own_table():
    truth = Tier(4e9, 30e-6, ((1024, 0.05), (1 << 24, 1.0)),
                 (("all_gather_coalesced", ((1024, 0.04), (1 << 24, 0.5))),))
    recs = _coll_records(truth, ops=("all_gather", "all_gather_coalesced"))
    fit = fit_collectives(recs, "fp32")["intra_node"]
    assert set(fit["efficiency_by_collective"]) == {"all_gather", "all_gather_coalesced"}
    tier = Tier(fit["busbw_GBps"] * 1e9, fit["latency_us"] * 1e-6, ((1.0, 1.0),),
                tuple((k, tuple(map(tuple, v))) for k, v in fit["efficiency_by_collective"].items()))
    for r in recs:
        coalesced = r["op"] == "all_gather_coalesced"
        t = collective_cost("all_gather", r["size_bytes"], 1, 2, tier, tier, coalesced).time_s
        assert t == pytest.approx(r["time_s"], rel=1e-9)
    # a batch of calls costs more per call here than one call alone, as measured
    assert collective_cost("all_gather", 1 << 20, 1, 2, tier, tier, True).time_s > \
        collective_cost("all_gather", 1 << 20, 1, 2, tier, tier).time_s


def test_attention_fit_separates_the_fixed_cost_per_call():
    from calibration.harness.fit import fit_attention
    peak = 1e12
    rs = [{"layer": f"L{i}", "flops": f} for i, f in enumerate((1e8, 4e8, 1.6e9))]
    times = [f / (peak * 0.25) + 300e-6 for f in (1e8, 4e8, 1.6e9)]
    eff, fixed_s = fit_attention(rs, times, peak)
    assert eff == pytest.approx(0.25, rel=1e-6) and fixed_s == pytest.approx(300e-6, rel=1e-6)
    # one shape cannot separate the two: efficiency alone
    eff1, fixed1 = fit_attention(rs[:1], times[:1], peak)
    assert fixed1 == 0.0 and eff1 == pytest.approx(1e8 / (peak * times[0]))


def test_fresh_alloc_fit_finds_the_mmap_threshold_and_first_touch_rate():
    from calibration.harness.fit import fit_fresh_alloc
    mib = 1 << 20
    recs = []
    for m in (8, 16, 31, 33, 48, 64):
        kept = m * mib / 20e9
        fresh = kept + (m * mib / 3e9 if m > 32 else 0.1 * kept)
        recs.append({"kind": "fresh_alloc", "size_bytes": m * mib, "time_s": fresh, "kept_time_s": kept})
    f = fit_fresh_alloc(recs)
    assert f["fresh_alloc_threshold_bytes"] == 31 * mib
    assert f["fresh_alloc_GBps"] == pytest.approx(3.0, rel=1e-9)
    # a caching allocator (no size ever fresh): nothing to charge
    assert fit_fresh_alloc([{**r, "time_s": r["kept_time_s"]} for r in recs]) == {}


def test_isotonic_pools_noise_dips_and_keeps_monotone_data():
    from calibration.harness.fit import isotonic_increasing
    assert isotonic_increasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    # a stalled small call (3.0) followed by a quicker larger one (1.0): pooled to their mean
    assert isotonic_increasing([0.5, 3.0, 1.0, 4.0]) == [0.5, 2.0, 2.0, 4.0]
    out = isotonic_increasing([5.0, 1.0, 1.0, 1.0])
    assert out == [2.0] * 4 and sum(out) == pytest.approx(8.0)


def test_zero3_hook_fit_reads_the_measured_slopes():
    from calibration.harness.fit import fit_zero3_hooks
    assert fit_zero3_hooks([]) == {}
    assert fit_zero3_hooks([{"kind": "zero3_hooks", "error": "not measured: deepspeed unavailable"}]) == {}
    f = fit_zero3_hooks([{"kind": "zero3_hooks", "fwd_s_per_visit": 1.5e-4, "bwd_s_per_visit": -1e-6,
                          "deepspeed": "0.19.8", "time_s": 0.01}])
    assert f == {"zero3_hook_fwd_us": pytest.approx(150.0), "zero3_hook_bwd_us": 0.0}
    f = fit_zero3_hooks([{"kind": "zero3_hooks", "fwd_s_per_visit": 1e-5, "bwd_s_per_visit": 2e-4,
                          "grad_hook_s_per_param": {"0": 4e-5, "1": 7e-5, "2": -1e-6}, "time_s": 0.01}])
    assert f == {"zero3_hook_fwd_us": pytest.approx(10.0), "zero3_hook_bwd_us": pytest.approx(200.0),
                 "zero0_grad_hook_us": pytest.approx(40.0), "zero1_grad_hook_us": pytest.approx(70.0),
                 "zero2_grad_hook_us": 0.0}


# ----------------------------------------------------------------------------- pooled collectives
def _run_doc(tmp_path, name, factor, date, **prov_changes):
    """A complete run whose all-reduce calls take factor * k ms at the k-th size."""
    recs, prov = _synthetic_run()
    recs = [r for r in recs if r["kind"] != "collective"]
    recs += [{"kind": "collective", "op": "all_reduce", "group": "world", "tier": "intra_node", "ranks": 2,
              "dtype": "bf16", "size_bytes": s, "time_s": factor * 1e-3 * k, "times_s": [factor * 1e-3 * k] * 4}
             for k, s in enumerate(SIZES, start=1)]
    prov = {**prov, "date": date, **prov_changes}
    d = tmp_path / "calibration" / "runs" / name
    d.mkdir(parents=True)
    (d / "records.json").write_text(json.dumps({"format": 1, "status": "complete", "error": "", "provenance": prov,
                                                "plan": {}, "records": recs}))
    return d, recs, prov


def test_pooled_collectives_fit_the_mean_call_over_all_runs(tmp_path):
    from calibration.harness.pool import add_sources, pooled

    _, recs, prov = _run_doc(tmp_path, "a", 1.0, "2026-01-01T00:00:00Z")
    b, _, _ = _run_doc(tmp_path, "b", 3.0, "2026-01-01T01:00:00Z")
    pool = add_sources([], [str(b)], prov)
    records, prov2 = pooled(recs, prov, pool)
    assert "2026-01-01T01:00:00Z" in prov2["pooled_collectives"]
    fit = fit_collectives(records, "bf16")["intra_node"]
    tier = Tier(fit["busbw_GBps"] * 1e9, fit["latency_us"] * 1e-6, ((1.0, 1.0),),
                tuple((k, tuple(map(tuple, v))) for k, v in fit["efficiency_by_collective"].items()))
    for k, s in enumerate(SIZES, start=1):   # every call of both runs: (1 + 3) / 2 ms per k
        assert collective_cost("all_reduce", s, 1, 2, tier, tier).time_s == pytest.approx(2e-3 * k, rel=1e-9)
    # the compute figures are the fitted run's alone
    assert build_profile("x", records, prov2, "bf16")[0]["gpu"] == build_profile("x", recs, prov, "bf16")[0]["gpu"]


@pytest.mark.parametrize("changes,needle", [
    ({"world_size": "4"}, "world_size"),
    ({"backend": "nccl"}, "backend"),
    ({"date": "2026-01-01T00:00:00Z"}, "already pooled"),
])
def test_pooling_another_cluster_or_the_same_run_is_refused(tmp_path, changes, needle):
    from calibration.harness.pool import add_sources

    _, _, prov = _run_doc(tmp_path, "a", 1.0, "2026-01-01T00:00:00Z")
    b, _, _ = _run_doc(tmp_path, "b", 3.0, changes.pop("date", "2026-01-01T01:00:00Z"), **changes)
    with pytest.raises(ZsimInputError) as e:
        add_sources([], [str(b)], prov)
    assert "--pool-collectives" in str(e.value) and needle in str(e.value)


def test_pooling_an_incomplete_or_missing_run_or_the_one_being_replaced_is_refused(tmp_path):
    from calibration.harness.pool import precheck

    b, _, _ = _run_doc(tmp_path, "b", 1.0, "2026-01-01T01:00:00Z")
    doc = json.loads((b / "records.json").read_text())
    (b / "records.json").write_text(json.dumps({**doc, "status": "failed"}))
    for src, needle in ((b, "not complete"), (tmp_path / "nope", "records.json"), (tmp_path / "x", "overwrites")):
        with pytest.raises(ZsimInputError) as e:
            precheck([str(src)], tmp_path / "x")
        assert needle in str(e.value)


def test_pooled_refit_from_the_cli_reproduces_the_profile(tmp_path):
    pytest.importorskip("torch")
    a, _, _ = _run_doc(tmp_path, "a", 1.0, "2026-01-01T00:00:00Z")
    b, _, _ = _run_doc(tmp_path, "b", 3.0, "2026-01-01T01:00:00Z")
    r = _zsim("calibrate", "--out", "p", "--from-run", str(a), "--pool-collectives", str(b), "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "calibration" / "runs" / "p"
    assert json.loads((run / "pooled_collectives.json").read_text())["runs"][0]["source"] == str(b)
    prof = tmp_path / "hardware_profiles" / "p.yaml"
    first = prof.read_text()
    assert "pooled_collectives" in first
    r = _zsim("calibrate", "--out", "p", "--from-run", str(run), "--force", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert prof.read_text() == first
    r = _zsim("calibrate", "--out", "p", "--from-run", str(run), "--force", "--pool-collectives", str(b),
              "--root", str(tmp_path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "already pooled" in r.stderr
