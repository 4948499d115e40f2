"""Closing the calibration loop: does zsim, on a calibrated profile, predict what the
harness measured?

    python benchmarks/calibration_loop.py calibration/runs/cpu-gloo-localhost
    python benchmarks/calibration_loop.py RUN_DIR --profile PATH_OR_NAME   # another profile

For every collective record (each op, size and dtype) it prints the measured mean per call, its
spread ((p90 - p10) / median over repetitions), zsim's prediction
(zsim.hardware.collectives.collective_cost on the profile's tiers, what `zsim run` charges)
and the error; and a held-out error, predicting each size from a table refitted without it
(interpolation between its neighbours: how well the calibration generalises to sizes it
did not measure). For every measured transformer layer it runs `zsim run` (the same
scenario path as the CLI) on a one-layer model of that shape on one rank and compares the
simulated forward and backward time of block 0 with the measurement.
Target: |error| <= 5% for every collective size (profile dtype) and every layer pass.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from calibration.harness.fit_comm import collective_kind, mean_call_time_s, pool_passes  # noqa: E402
from calibration.harness.fit_common import FIT_STATISTIC, fit_time_s  # noqa: E402
from calibration.harness.pool import read_pool                          # noqa: E402
from zsim.api import run_scenario                                     # noqa: E402
from zsim.config.profile import load_profile                           # noqa: E402
from zsim.config.scenario import load_scenario                         # noqa: E402
from zsim.hardware.collectives import bus_factor, collective_cost, efficiency_at, ring_steps, tiers_for  # noqa: E402
from zsim.schedule.build import workload_for                         # noqa: E402
from zsim.schedule.ir import OpKind                                  # noqa: E402
from zsim.specs.hardware import Cluster                              # noqa: E402

TARGET = 0.05


def predict_collective(profile, rec: dict) -> float:
    n = rec["ranks"]
    if rec["tier"] == "inter_node":   # one rank per node
        cluster = Cluster(profile=profile, nodes=n, gpus_per_node=1)
    else:
        cluster = Cluster(profile=profile, nodes=1, gpus_per_node=n)
    intra, inter = tiers_for(cluster)
    kind = collective_kind(rec["op"])
    return collective_cost(kind, rec["size_bytes"], cluster.nodes, cluster.gpus_per_node, intra, inter,
                           coalesced=rec["op"] != kind).time_s


def held_out(profile, rec: dict) -> float | None:
    """Prediction at rec's size from the collective's table without that size's point."""
    if rec["tier"] == "inter_node":
        return None
    table = dict(profile.intra_node.efficiency_by_collective).get(rec["op"])
    if not table:
        return None
    rest = tuple(p for p in table if p[0] != rec["size_bytes"])
    if len(rest) == len(table) or not rest or rec["size_bytes"] < rest[0][0] or rec["size_bytes"] > rest[-1][0]:
        return None   # not a table point, or an end point (extrapolation is not the question)
    cluster = Cluster(profile=profile, nodes=1, gpus_per_node=rec["ranks"])
    intra, _ = tiers_for(cluster)
    n = rec["ranks"]
    bw = intra.busbw_Bps * efficiency_at(rest, rec["size_bytes"])
    kind = collective_kind(rec["op"])
    return ring_steps(kind, n) * intra.latency_s + rec["size_bytes"] * bus_factor(kind, n) / bw


def layer_scenario(profile_path: str, rec: dict) -> str:
    doc = {"name": f"calibration-layer-{rec['layer']}",
           "model": {"layers": 1, "hidden": rec["hidden"], "heads": rec["heads"], "vocab": 128,
                     "seq_len": rec["seq_len"]},
           "hardware": {"profile": str(profile_path), "nodes": 1, "gpus_per_node": 1},
           "training": {"micro_batch_size": rec["micro_batch"], "gradient_accumulation_steps": 1,
                        "seq_len": rec["seq_len"], "precision": rec["dtype"], "flash_attention": True},
           "deepspeed": {"zero_optimization": {"stage": 0}}}
    return yaml.safe_dump(doc)


def predict_layer(profile_path: str, rec: dict) -> tuple[float, float]:
    """(forward_s, backward_s) of block 0 in a `zsim run` of a one-layer model of rec's shape."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "layer.yaml"
        p.write_text(layer_scenario(profile_path, rec))
        sc = load_scenario(p)
    _, trace = run_scenario(sc)
    fwd = bwd = 0.0
    block0 = {m.name for m in workload_for(sc).layer_modules(0)}
    for op, t in zip(trace.schedule.ops, trace.timings):
        if op.kind in (OpKind.FORWARD, OpKind.BACKWARD) and op.payload.module in block0:
            if op.kind == OpKind.FORWARD:
                fwd += t.end_s - t.start_s
            else:
                bwd += t.end_s - t.start_s
    return fwd, bwd


def tolerance(r: dict) -> float:
    return max(TARGET, r.get("spread", 0.0) / 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--profile", default=None, help="profile name or path (default: the run's own)")
    ap.add_argument("--all-sizes", action="store_true", help="print every row, not only the profile dtype")
    args = ap.parse_args(argv)
    run = Path(args.run_dir)
    doc = json.loads((run / "records.json").read_text())
    # the collectives of the runs pooled into the profile (--pool-collectives) are what it fits
    recs = pool_passes(doc["records"] + [r for p in read_pool(run) for r in p["records"]])
    profile_ref = args.profile or str(ROOT / "hardware_profiles" / f"{run.name}.yaml")
    profile = load_profile(profile_ref)
    dtype = profile.provenance.get("compute_dtype", "bf16")
    # a profile calibrated with --dtype fp32,bf16 has each dtype's own compute fit (gpu.by_dtype)
    fitted = profile.provenance.get("compute_dtypes", dtype).split(",")
    coll_dtypes = sorted({r["dtype"] for r in recs if r.get("kind") == "collective" and "error" not in r})
    fit_dtype = dtype if dtype in coll_dtypes else "fp32"
    prov = doc.get("provenance", {})
    print(f"run {run} ({prov.get('mode')} mode, {prov.get('world_size')} ranks, {prov.get('backend')}, "
          f"{prov.get('date')}); profile {profile_ref}")
    print(f"target: |error| <= {TARGET:.0%}, or within half the measurement's own spread when that is wider "
          f"(a prediction inside the p10-p90 band of its repetitions is as good as the data can show). "
          f"Collective tables fitted on {fit_dtype}, made non-decreasing in size. 'measured' is the fit's "
          f"statistic (collectives: the mean per call; others: {FIT_STATISTIC} over repetitions; see "
          f"calibration/harness/fit.py), 'spread' = (p90 - p10) / median.\n")

    print(f"{'collective':<22}{'tier':<11}{'dtype':<6}{'size':>10}{'measured':>12}{'spread':>8}"
          f"{'zsim':>12}{'error':>8}{'held-out':>10}")
    worst = {}
    for r in sorted((r for r in recs if r.get("kind") == "collective" and "error" not in r),
                    key=lambda r: (r["dtype"] != fit_dtype, r["dtype"], r["op"], r["size_bytes"])):
        pred = predict_collective(profile, r)
        m = mean_call_time_s(r)
        err = (pred - m) / m
        ho = held_out(profile, r)
        ho_err = (ho - m) / m if ho else None
        key = (r["op"], r["dtype"])
        w = worst.setdefault(key, [0.0, 0.0, 0, True])
        w[0] = max(w[0], abs(err))
        w[3] &= abs(err) <= tolerance(r)
        w[1] = max(w[1], abs(ho_err)) if ho_err is not None else w[1]
        w[2] += 1
        if r["dtype"] == fit_dtype or args.all_sizes:
            print(f"{r['op']:<22}{r['tier']:<11}{r['dtype']:<6}{r['size_bytes']:>10}{m * 1e3:>10.4f}ms"
                  f"{r.get('spread', 0):>7.0%} {pred * 1e3:>10.4f}ms{err:>+8.1%}"
                  + (f"{ho_err:>+10.1%}" if ho_err is not None else f"{'':>10}"))
    print("\nsummary (max |error| over sizes)")
    ok = True
    for (op, dt), (w, h, n, within) in sorted(worst.items()):
        flag = "" if dt != fit_dtype else ("  OK" if within else "  MISS")
        ok &= dt != fit_dtype or within
        print(f"  {op:<22}{dt:<6}{n:>3} sizes  max |err| {w:6.1%}   held-out max |err| {h:6.1%}{flag}")

    print(f"\n{'layer':<22}{'dtype':<6}{'pass':<5}{'measured':>12}{'spread':>8}{'zsim run':>12}{'error':>8}")
    layers = [r for r in recs if r.get("kind") == "layer" and "error" not in r]
    cache = {}
    for r in sorted(layers, key=lambda r: (r["dtype"] not in fitted, r["dtype"], r["layer"], r["pass"] == "bwd")):
        key = (r["layer"], r["dtype"])
        if key not in cache:
            cache[key] = predict_layer(profile_ref, r)
        pred = cache[key][r["pass"] == "bwd"]
        m = fit_time_s(r)
        err = (pred - m) / m
        flag = ("  OK" if abs(err) <= tolerance(r) else "  MISS") if r["dtype"] in fitted else "  (other dtype)"
        ok &= r["dtype"] not in fitted or abs(err) <= tolerance(r)
        print(f"{r['layer']:<22}{r['dtype']:<6}{r['pass']:<5}{m * 1e3:>10.3f}ms{r.get('spread', 0):>7.0%} "
              f"{pred * 1e3:>10.3f}ms{err:>+8.1%}{flag}")
    print(f"\nclosing the loop ({','.join(fitted)} compute, {fit_dtype} collectives): {'PASS' if ok else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
