"""Host-side fits: DeepSpeed's hook costs, CPU Adam, file I/O and compute/communication
interference."""
from __future__ import annotations

import statistics

from calibration.harness.fit_common import fit_rate, usable


def fit_zero3_hooks(records: list[dict]) -> dict:
    """cpu.zero3_hook_{fwd,bwd}_us and cpu.zero{0,1,2}_grad_hook_us from
    bench_zero.bench_zero3_hooks (DeepSpeed installed): per-module slopes of a tiny-module stack over
    plain torch (records before the plain baseline: over ZeRO-0, ZeRO-3 only); {} when not
    measured."""
    rs = usable(records, "zero3_hooks")
    if not rs:
        return {}
    out = {"zero3_hook_fwd_us": max(0.0, rs[0]["fwd_s_per_visit"]) * 1e6,
           "zero3_hook_bwd_us": max(0.0, rs[0]["bwd_s_per_visit"]) * 1e6}
    for stage, s_per_param in rs[0].get("grad_hook_s_per_param", {}).items():
        out[f"zero{stage}_grad_hook_us"] = max(0.0, s_per_param) * 1e6
    return out


def fit_adam(records: list[dict]) -> tuple[float, str]:
    """(params/s per core, implementation): DeepSpeedCPUAdam when measured, else the fastest
    torch CPU Adam; a rank's rate is divided by the threads it ran with. The cores' rate comes
    from the cache-resident size; the out-of-cache run measures the host's bandwidth instead
    (see [Note: CPU step traffic]; fit.py)."""
    cpu = [r for r in records if r.get("kind") == "adam" and r.get("device") == "cpu" and "error" not in r
           and not r.get("regime")]
    if not cpu:
        raise ValueError("no CPU Adam records")
    ds = [r for r in cpu if r["impl"] == "DeepSpeedCPUAdam"]
    r = ds[0] if ds else max(cpu, key=lambda r: r["params_per_s"])
    return fit_rate(r, "params_per_s") / max(1, int(r.get("threads", 1))), r["impl"]


def fit_io(records: list[dict]) -> dict:
    io = {r["op"]: r for r in records if r.get("kind") == "file_io" and "error" not in r}
    return {"read_GBps": fit_rate(io["read"], "node_GBps") if "read" in io else None,
            "write_GBps": fit_rate(io["write"], "node_GBps") if "write" in io else None,
            "o_direct": bool(io.get("read", io.get("write", {})).get("o_direct", False))}


def fit_interference(records: list[dict]) -> dict:
    r = next((r for r in records if r.get("kind") == "interference"), None)
    if not r or r["gemm_alone_s"] <= 0 or r["gemm_during_comm_s"] <= 0:
        return {"compute_slowdown_during_comm": 0.0, "comm_slowdown_during_compute": 0.0}
    return {"compute_slowdown_during_comm": max(0.0, r["gemm_during_comm_s"] / r["gemm_alone_s"] - 1.0),
            "comm_slowdown_during_compute": max(0.0, r["comm_during_gemm_s"] / r["comm_alone_s"] - 1.0)}


def fit_rank_views(records: list[dict]) -> tuple[dict, dict]:
    """(cpu fields, provenance) of cpu.zero3_rank_view_us from bench_zero.bench_rank_views: per
    case, the slope of the call's time over the views zsim counts for it between the smallest and
    the largest world size (what a call costs at one world size more is views, not fixed
    overhead); the profile takes the median of the cases and the provenance keeps each."""
    rs = usable(records, "rank_views")
    by_case: dict[str, list[dict]] = {}
    for r in rs:
        by_case.setdefault(r["case"], []).append(r)
    slopes = {}
    for case, recs in sorted(by_case.items()):
        lo, hi = min(recs, key=lambda r: r["world"]), max(recs, key=lambda r: r["world"])
        if hi["views"] > lo["views"]:
            slopes[case] = max(0.0, (hi["time_s"] - lo["time_s"]) / (hi["views"] - lo["views"])) * 1e6
    if not slopes:
        return {}, {}
    return ({"zero3_rank_view_us": statistics.median(slopes.values())},
            {"zero3_rank_view_us_by_case": ", ".join(f"{c} {v:.3f}" for c, v in slopes.items())})
