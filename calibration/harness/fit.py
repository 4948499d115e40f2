"""Raw calibration records -> a zsim hardware profile. Pure functions: no torch, no I/O.

Methods
- Collectives: t(size) = alpha + size/beta per (collective, tier, dtype), fitted by
  iteratively reweighted least squares with Huber weights on relative residuals (Huber 1964,
  "Robust Estimation of a Location Parameter"; Holland & Welsch 1977, "Robust regression
  using iteratively reweighted least-squares"): relative, because sizes span 5 decades and a
  fit in absolute time would ignore every small message. The profile then stores what
  zsim's cost function (zsim/hardware/collectives.py) needs to reproduce each measurement:
  a per-step latency, a peak bus bandwidth (nccl-tests convention) and, per collective, the
  fraction of that peak reached at each measured size.
- GEMMs: zsim's efficiency law eff = max_eff * prod(d / (d + d_half)) with max_eff = 1 and
  the peak per dtype as the law's asymptote; d_half by grid search, the peaks in closed form
  (least squares in relative time error).
- Attention, memory-bound kernels: measured time minus zsim's per-kernel overhead, against
  the FLOPs and bytes zsim's workload charges (zsim/workload/transformer.py), so the fitted
  efficiencies reproduce what the simulator predicts for exactly these ops.
- Layer closure: the real layer also runs work zsim does not cost per op (reshapes,
  autograd bookkeeping, bias-gradient reductions); the remaining time is spread over the
  layer's kernels as kernel overhead (forward and backward share one overhead, fitted by
  least squares over all measured layers).
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from calibration.harness.plan import stats
from zsim.hardware.collectives import bus_factor, ring_steps
from zsim.hardware.compute import attention_time_s, gemm_time_s, kernel_overhead_s, memory_bound_time_s
from zsim.specs.hardware import GpuProfile

HUBER_K = 1.345   # 95% efficiency under Gaussian noise (Huber 1964)
# Which per-benchmark statistic the fit reproduces: the median repetition, each repetition the
# mean of its calls (collectives: the mean over all calls, _t_mean). zsim predicts the typical
# step (zsim validate compares with the median step), and a step sums many calls, so it pays
# the mean per-call cost, occasional stalls included. The fastest repetition (Chen & Revels
# 2016) is the more repeatable estimate of the uncontended time, but it biased every in-step
# prediction low (collectives by 2-3x on gloo). Records keep the minimum and the spread too.
FIT_STATISTIC = "time_s"


def _t(r: dict) -> float:
    return r.get(FIT_STATISTIC, r["time_s"])


def _rate(r: dict, key: str) -> float:
    """A rate the worker computed from the median, restated at the fit statistic."""
    return r[key] * r["time_s"] / _t(r) if r.get("time_s") else r[key]


# ----------------------------------------------------------------------------- regression
def robust_alpha_beta(size_bytes, time_s, iters: int = 50) -> tuple[float, float]:
    """(alpha_s, seconds_per_byte) of t = alpha + size * spb, robust in relative error.

    Both coefficients are kept non-negative: a negative latency or bandwidth has no meaning
    and would make zsim's cost negative at some size."""
    x = np.asarray(size_bytes, dtype=float)
    y = np.asarray(time_s, dtype=float)
    if len(x) == 0:
        raise ValueError("no points to fit")
    if len(x) == 1 or np.ptp(x) == 0:
        return float(y.mean()), 0.0
    w = 1.0 / y          # relative residuals: weight each row by 1/t
    coef = np.zeros(2)
    A = np.stack([np.ones_like(x), x], axis=1)
    hub = np.ones_like(x)
    for _ in range(iters):
        W = w * np.sqrt(hub)
        coef_new, *_ = np.linalg.lstsq(A * W[:, None], y * W, rcond=None)
        if coef_new[0] < 0:
            coef_new = np.array([0.0, max(0.0, float(np.sum(W**2 * x * y) / np.sum(W**2 * x * x)))])
        elif coef_new[1] < 0:
            coef_new = np.array([float(np.sum(W**2 * y) / np.sum(W**2)), 0.0])
        r = (y - A @ coef_new) / y
        mad = float(np.median(np.abs(r - np.median(r)))) / 0.6745
        scale = max(mad, 1e-12)
        u = np.abs(r) / (HUBER_K * scale)
        hub = np.where(u <= 1, 1.0, 1.0 / np.maximum(u, 1e-300))
        if np.allclose(coef_new, coef, rtol=1e-12, atol=0):
            coef = coef_new
            break
        coef = coef_new
    return float(coef[0]), float(coef[1])


def relative_errors(predicted, measured) -> list[float]:
    return [(p - m) / m for p, m in zip(predicted, measured)]


# ----------------------------------------------------------------------------- collectives
def _ok(records, kind):
    return [r for r in records if r.get("kind") == kind and "error" not in r and r.get("time_s", 0) > 0]


def isotonic_increasing(y) -> list[float]:
    """Least-squares non-decreasing fit of y (pool adjacent violators; Ayer et al. 1955)."""
    blocks: list[list[float]] = []          # [mean, count]
    for v in y:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    out: list[float] = []
    for m, n in blocks:
        out += [m] * int(n)
    return out


def _t_mean(r: dict) -> float:
    """Mean per-call time over all repetitions. A step's collectives are many calls in a row, so
    their sum is the mean times the count: gloo's random stalls (a small call is 0.2 ms typically
    and 1-5 ms one time in ten after a compute phase) land in the step and must land in the fit,
    which the median repetition drops."""
    ts = r.get("times_s")
    return float(np.mean(ts)) if ts else _t(r)


def smoothed_times(recs: list[dict]) -> dict[tuple[str, int], float]:
    """{(op, size): time} with each collective's time made non-decreasing in size: moving more
    bytes cannot be cheaper on average, so a dip is timing noise (gloo's small-message calls
    stall at random), and pooling it with its neighbours averages the noise out."""
    out = {}
    for op in sorted({r["op"] for r in recs}):
        pts = sorted((r["size_bytes"], _t_mean(r)) for r in recs if r["op"] == op)
        for (s, _), t in zip(pts, isotonic_increasing([t for _, t in pts])):
            out[(op, s)] = t
    return out


def _kind(op: str) -> str:
    """The collective an op name times ("all_gather_coalesced" is a batch of all_gather calls)."""
    return op.removesuffix("_coalesced")


def pool_passes(records: list[dict]) -> list[dict]:
    """One record per collective point: the passes over a size (plan.coll_passes) pooled into the
    first one's place, their repetitions and last-arriver means combined."""
    out, first = [], {}
    for r in records:
        if r.get("kind") != "collective" or "error" in r or not r.get("times_s"):
            out.append(r)
            continue
        key = (r["op"], r["group"], r["tier"], r["dtype"], r["size_bytes"], r["ranks"])
        if key not in first:
            first[key] = dict(r)
            out.append(first[key])
            continue
        p = first[key]
        n_p, n_r = len(p["times_s"]), len(r["times_s"])
        last = (p.get("last_arriver_s", 0.0) * n_p + r.get("last_arriver_s", 0.0) * n_r) / (n_p + n_r)
        p.update(stats(p["times_s"] + r["times_s"]))
        p["last_arriver_s"] = last
        p["item"] = p.get("item", "").split("/pass")[0]
    return out


def fit_collectives(records: list[dict], dtype: str) -> dict:
    """Per tier: latency_us, busbw_GBps, efficiency tables and the alpha-beta fits.

    The tier latency is the smallest per-step alpha over its collectives, capped at half the
    fastest measured step (x0.95) so that every measured time keeps a positive transfer part; the
    peak busbw is the best transfer rate any collective reached at any size, so all
    efficiencies are <= 1. With these, zsim's ring_cost reproduces each (size-smoothed) time exactly."""
    by_tier: dict[str, list[dict]] = defaultdict(list)
    for r in _ok(pool_passes(records), "collective"):
        if r["dtype"] == dtype and r["ranks"] > 1:
            by_tier[r["tier"]].append(r)
    out = {}
    for tier, recs in sorted(by_tier.items()):
        n = recs[0]["ranks"]
        sm = smoothed_times(recs)
        ab = {}
        for op in sorted({r["op"] for r in recs}):
            pts = sorted((r["size_bytes"], sm[(r["op"], r["size_bytes"])]) for r in recs if r["op"] == op)
            a, spb = robust_alpha_beta([p[0] for p in pts], [p[1] for p in pts])
            pred = [a + s * spb for s, _ in pts]
            ab[op] = {"alpha_us": a * 1e6, "alpha_per_step_us": a * 1e6 / ring_steps(_kind(op), n),
                      "busbw_GBps": (bus_factor(_kind(op), n) / spb / 1e9) if spb > 0 else float("inf"),
                      "residuals": [[s, e] for (s, _), e in zip(pts, relative_errors(pred, [p[1] for p in pts]))]}
        min_step_s = min(sm[(r["op"], r["size_bytes"])] / ring_steps(_kind(r["op"]), n) for r in recs)
        latency_s = min(min(v["alpha_per_step_us"] for v in ab.values()) * 1e-6, 0.95 * min_step_s)
        rate = {}
        for r in recs:
            transfer_s = sm[(r["op"], r["size_bytes"])] - ring_steps(_kind(r["op"]), n) * latency_s
            rate[(r["op"], r["size_bytes"])] = r["size_bytes"] * bus_factor(_kind(r["op"]), n) / transfer_s
        busbw_Bps = max(rate.values())
        tables = {}
        for op in sorted({r["op"] for r in recs}):
            tables[op] = [[int(s), rate[(o, s)] / busbw_Bps] for (o, s) in sorted(rate) if o == op]
        out[tier] = {"ranks": n, "latency_us": latency_s * 1e6, "busbw_GBps": busbw_Bps / 1e9,
                     "efficiency_by_collective": tables, "alpha_beta": ab}
    return out


# ----------------------------------------------------------------------------- compute
def gemm_law(m: float, n: float, k: float, d_half: float) -> float:
    return (m / (m + d_half)) * (n / (n + d_half)) * (k / (k + d_half))


def fit_gemm(records: list[dict]) -> dict:
    """Peak TFLOP/s per dtype and d_half shared by all dtypes, max_eff = 1.

    A rank has no trustworthy datasheet peak (a CPU rank's share of cores, turbo, AVX
    licences), so the peak reported is the law's asymptote: the rate the fitted law reaches
    for infinitely large GEMMs. For each d_half on a log grid, 1/peak per dtype has a closed
    form (least squares in relative time error); the d_half with the smallest error wins."""
    recs = [r for r in _ok(records, "gemm")]
    if not recs:
        raise ValueError("no GEMM records")
    best = None
    dtypes = sorted({r["dtype"] for r in recs})
    for d_half in [0.0] + [float(v) for v in np.geomspace(1, 4096, 97)]:
        peaks, err = {}, 0.0
        for d in dtypes:
            rs = [r for r in recs if r["dtype"] == d]
            x = np.array([r["flops"] / gemm_law(r["m"], r["n"], r["k"], d_half) for r in rs])
            y = np.array([_t(r) for r in rs])
            inv_peak = float(np.sum(x / y) / np.sum(x * x / (y * y)))   # time = x / peak
            peaks[d] = 1.0 / inv_peak
            err += float(np.sum(((inv_peak * x - y) / y) ** 2))
        if best is None or err < best[0] - 1e-15:
            best = (err, d_half, peaks)
    err, d_half, peaks = best
    res = []
    for r in recs:
        pred = r["flops"] / (peaks[r["dtype"]] * gemm_law(r["m"], r["n"], r["k"], d_half))
        res.append({"dtype": r["dtype"], "shape": [r["m"], r["n"], r["k"]], "module": r.get("module"),
                    "pass": r.get("pass"), "measured_s": _t(r), "predicted_s": pred,
                    "error": (pred - _t(r)) / _t(r)})
    return {"peak_tflops": {d: p / 1e12 for d, p in sorted(peaks.items())}, "gemm_max_efficiency": 1.0,
            "gemm_half_efficiency_dim": d_half, "residuals": res}


def fit_efficiency_ratio(work: list[float], time_s: list[float], rate: float) -> float:
    """Single efficiency e with sum(work)/(rate*e) = sum(time): the ratio of totals, so the
    efficiency reproduces the total time of the measured kernels (what a layer sums)."""
    return float(sum(work) / (rate * sum(time_s)))


def _model_spec(shape: dict):
    from zsim.specs.model import ModelSpec
    return ModelSpec(layers=1, hidden=shape["hidden"], heads=shape["heads"], vocab=128, seq_len=shape["seq_len"])


def layer_modules(shape: dict, dtype: str):
    """zsim's modules of transformer block 0 for this layer shape."""
    from zsim.workload.transformer import build_workload
    wl = build_workload(_model_spec(shape), shape["micro_batch"], shape["seq_len"], dtype,
                        flash_attention=True, dropout=False)
    return wl.layer_modules(0)


def predict_layer_s(gpu: GpuProfile, peak_flops: float, shape: dict, dtype: str, backward: bool) -> float:
    """What zsim's engine charges for block 0's compute ops (engine.sim.compute_work_s plus
    kernel overhead), without communication interference."""
    g, a, m, k = layer_components(gpu, peak_flops, shape, dtype, backward)
    return g + a + m + kernel_overhead_s(k, gpu)


DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def fit_attention(rs: list[dict], time_s: list[float], peak_flops: float) -> tuple[float, float]:
    """(efficiency, fixed s per call) of t = flops / (peak * eff) + fixed over the layer shapes,
    least squares in relative error, eff <= 1 and fixed >= 0. On CPU a short sequence's
    attention is far from its FLOP rate (h256/s128 backward ran at 40% of the s256 rate), which
    one efficiency cannot hold. One shape: the efficiency alone (ratio of totals)."""
    if len({r.get("layer") for r in rs}) < 2:
        return min(1.0, fit_efficiency_ratio([r["flops"] for r in rs], time_s, peak_flops)), 0.0
    X = np.array([[r["flops"] / peak_flops, 1.0] for r in rs])
    inv_eff, fixed_s = _nnls_relative(X, np.array(time_s), np.array([1.0, 0.0]))
    return float(1.0 / inv_eff), float(fixed_s)


def fit_fresh_alloc(records: list[dict]) -> dict:
    """fresh_alloc_threshold_bytes and fresh_alloc_GBps (zsim.hardware.compute.fresh_alloc_time_s).

    A size is "fresh" when allocating costs over 3x the fill of a kept buffer on top of it (page
    faults run ~10x slower than a fill; a size just under the threshold still costs up to ~1x
    more because a kept buffer's fill hits the cache); the threshold is the largest size below every
    fresh one, the rate the median first-touch rate of the fresh sizes. No fresh size: {}."""
    rs = sorted(_ok(records, "fresh_alloc"), key=lambda r: r["size_bytes"])
    is_fresh = [_t(r) - r["kept_time_s"] > 3.0 * r["kept_time_s"] for r in rs]
    if not is_fresh or not is_fresh[-1]:
        return {}
    first = len(rs) - 1
    while first > 0 and is_fresh[first - 1]:
        first -= 1
    lim = rs[first - 1]["size_bytes"] if first > 0 else rs[0]["size_bytes"] / 2
    rates = sorted(r["size_bytes"] / (_t(r) - r["kept_time_s"]) for r in rs[first:])
    return {"fresh_alloc_threshold_bytes": float(lim), "fresh_alloc_GBps": rates[len(rates) // 2] / 1e9}


def _optimizer_passes_s(rec: dict, overhead_s: float) -> float:
    """The optimizer benchmark's time without its kernels' launch overhead, which zsim charges
    apart from optimizer_bytes (kernel_overhead_us per kernel)."""
    return _t(rec) - rec.get("kernels", 6) * overhead_s


def fit_compute(records: list[dict], dtype: str) -> tuple[dict, dict]:
    """GpuProfile fields for `dtype` (the training precision) and a report of residuals."""
    over = _ok(records, "kernel_overhead")
    overhead_s = _t(over[0]) if over else 0.0
    ag = _ok(records, "autograd_overhead")
    # a backward benchmark is one autograd.grad call on an isolated op: drop the engine's
    # start-up (paid once per layer backward, not per op), keeping the op's own kernel cost
    autograd_s = max(0.0, _t(ag[0]) - overhead_s) if ag else 0.0
    mc = [r for r in _ok(records, "memcpy") if r.get("where") in ("device", "host")]
    opt = [r for r in _ok(records, "optimizer_step") if r["dtype"] == dtype]
    # the device's bandwidth is at least the best streaming rate any benchmark reached (the
    # copy and the optimizer's passes), so every efficiency against it stays <= 1
    rates = ([_rate(mc[0], "GBps")] if mc else []) + [o["bytes"] / _optimizer_passes_s(o, overhead_s) / 1e9
                                                      for o in opt]
    hbm_GBps = max(rates) if rates else 1.0
    gemm = fit_gemm([r for r in records if r.get("kind") == "gemm"])
    peak = gemm["peak_tflops"]
    p = peak.get(dtype) or max(peak.values())
    att = [r for r in _ok(records, "attention") if r["dtype"] == dtype]
    eff, att_over_us = {}, {}
    for pas, kernels in (("fwd", 1), ("bwd", 2)):
        rs = [r for r in att if r["pass"] == pas]
        if rs:
            y = [max(_t(r) - kernels * overhead_s - (autograd_s if pas == "bwd" else 0.0), 1e-9) for r in rs]
            e, over_s = fit_attention(rs, y, p * 1e12)
            eff[pas], att_over_us[pas] = e, over_s * 1e6
    mb = [r for r in _ok(records, "membound") if r["dtype"] == dtype]
    mem_eff = min(1.0, fit_efficiency_ratio([r["bytes"] for r in mb],
                                            [max(_t(r) - overhead_s - (autograd_s if r["pass"] == "bwd" else 0.0), 1e-9)
                                             for r in mb], hbm_GBps * 1e9)) if mb else 0.5
    fields = {"gemm_max_efficiency": gemm["gemm_max_efficiency"],
              "gemm_half_efficiency_dim": gemm["gemm_half_efficiency_dim"],
              "flash_attention_fwd_efficiency": eff.get("fwd", 0.5),
              "flash_attention_bwd_efficiency": eff.get("bwd", 0.4),
              "flash_attention_fwd_overhead_us": att_over_us.get("fwd", 0.0),
              "flash_attention_bwd_overhead_us": att_over_us.get("bwd", 0.0),
              "memory_bound_efficiency": mem_eff, "kernel_overhead_us": overhead_s * 1e6}
    fields.update(fit_fresh_alloc(records))
    if opt:   # bytes as zsim charges them (step_bytes_per_param), over the device bandwidth above
        fields["optimizer_efficiency"] = min(1.0, opt[0]["bytes"] / max(_optimizer_passes_s(opt[0], overhead_s), 1e-9)
                                             / (hbm_GBps * 1e9))
    report = {"kernel_overhead_measured_us": overhead_s * 1e6, "autograd_call_us": autograd_s * 1e6,
              "hbm_bw_GBps": hbm_GBps, "gemm": gemm}
    layers = [r for r in _ok(records, "layer") if r["dtype"] == dtype]
    if layers:
        report["layers_before_closure"] = layer_residuals(layers, {**fields, "kernel_overhead_us": overhead_s * 1e6},
                                                          peak, hbm_GBps)
        report["kernel_fits"] = dict(fields)
        closed, peak_scale, scales = fit_layer_closure(layers, fields, p, hbm_GBps, dtype)
        report["layer_closure_scales"] = scales
        report["layers_held_out"] = held_out_layer_errors(layers, fields, p, hbm_GBps, dtype)
        fields = closed
        if peak_scale != 1.0:
            gemm["peak_tflops"] = {**peak, dtype: p * peak_scale}
            peak = gemm["peak_tflops"]
        report["layers"] = layer_residuals(layers, fields, peak, hbm_GBps)
    return fields, report


def layer_components(gpu: GpuProfile, peak_flops: float, shape: dict, dtype: str, backward: bool) -> tuple:
    """(GEMM s, attention s, memory-bound s, kernels) of block 0, the terms predict_layer_s sums."""
    from zsim.schedule.common import linear_gemms
    g = a = m = 0.0
    k = 0
    for mod in layer_modules(shape, dtype):
        k += mod.kernels_bwd if backward else mod.kernels_fwd
        g += sum(gemm_time_s(x, y, z, DTYPE_BYTES[dtype], gpu, peak_flops) for x, y, z in linear_gemms(mod, backward))
        if mod.kind == "attention":
            a += attention_time_s(mod.bwd_flops if backward else mod.fwd_flops, backward, gpu, peak_flops)
        mem = mod.bwd_mem_bytes if backward else mod.fwd_mem_bytes
        if mem:
            m += memory_bound_time_s(mem, gpu)
    return g, a, m, k


def _nnls_relative(X: np.ndarray, y: np.ndarray, lower: np.ndarray | None = None,
                   weight: np.ndarray | None = None) -> np.ndarray:
    """min sum(((X b) - y) / w)^2 over b >= lower (default 0), w = weight (default y), by
    exhaustive active sets (few columns): b = lower + t with t >= 0."""
    from itertools import product
    lower = np.zeros(X.shape[1]) if lower is None else lower
    w = y if weight is None else weight
    A = X / w[:, None]
    r = (y - X @ lower) / w
    best, best_b = None, np.zeros(X.shape[1])
    for mask in product([0, 1], repeat=X.shape[1]):
        cols = [i for i in range(X.shape[1]) if mask[i]]
        b = np.zeros(X.shape[1])
        if cols:
            sol, *_ = np.linalg.lstsq(A[:, cols], r, rcond=None)
            if (sol < 0).any():
                continue
            b[cols] = sol
        err = float(((A @ b - r) ** 2).sum())
        if best is None or err < best - 1e-15:
            best, best_b = err, b
    return best_b + lower


def fit_layer_closure(layers: list[dict], fields: dict, peak_tflops: float, hbm_GBps: float, dtype: str):
    """Close the gap between the kernel-level fits and the measured transformer layers (the
    compute model's ground truth): one non-negative scale each for GEMM, attention forward and
    attention backward time, least squares in relative error over every (layer, pass), the
    way benchmarks/fit_h100_efficiencies.py fits the H100 profile. Memory-bound efficiency
    and kernel overhead stay at their directly measured values: letting them float lets the
    fit trade one component against another (elementwise kernels made implausibly fast to
    pay for slow GEMMs), which then mispredicts models whose mix differs from these layers.
    Returns (fields, peak scale, scales); a GEMM speed-up beyond the fitted asymptote raises
    the peak rather than an efficiency above 1."""
    gpu = _gpu(fields, peak_tflops, hbm_GBps, dtype)
    rows, fixed, y = [], [], []
    for r in layers:
        back = r["pass"] == "bwd"
        g, a, m, k = layer_components(gpu, peak_tflops * 1e12, r, dtype, back)
        rows.append([g, 0.0 if back else a, a if back else 0.0])
        fixed.append(m + kernel_overhead_s(k, gpu))
        y.append(_t(r))
    y = np.array(y)
    # an efficiency cannot exceed 1: a scale s turns efficiency e into e/s, so s >= e
    lower = np.array([0.0, fields["flash_attention_fwd_efficiency"], fields["flash_attention_bwd_efficiency"]])
    b = _nnls_relative(np.array(rows), y - np.array(fixed), lower, y)
    sg, saf, sab = (float(v) for v in b)
    out = dict(fields)
    peak_scale = 1.0
    if sg > 0:
        if sg >= 1.0:
            out["gemm_max_efficiency"] = fields["gemm_max_efficiency"] / sg
        else:
            peak_scale = 1.0 / sg
    # the scale applies to the whole attention time, its fixed part included
    if saf > 0:
        out["flash_attention_fwd_efficiency"] = min(1.0, fields["flash_attention_fwd_efficiency"] / saf)
        out["flash_attention_fwd_overhead_us"] = fields.get("flash_attention_fwd_overhead_us", 0.0) * saf
    if sab > 0:
        out["flash_attention_bwd_efficiency"] = min(1.0, fields["flash_attention_bwd_efficiency"] / sab)
        out["flash_attention_bwd_overhead_us"] = fields.get("flash_attention_bwd_overhead_us", 0.0) * sab
    return out, peak_scale, {"gemm": sg, "attention_fwd": saf, "attention_bwd": sab}


def held_out_layer_errors(layers: list[dict], fields: dict, peak_tflops: float, hbm_GBps: float,
                          dtype: str) -> list[dict]:
    """Each layer shape predicted by a closure fitted on the other shapes: how well the fit
    generalises beyond the shapes it saw."""
    out = []
    for shape in sorted({r["layer"] for r in layers}):
        train = [r for r in layers if r["layer"] != shape]
        test = [r for r in layers if r["layer"] == shape]
        if not train:
            continue
        f, scale, _ = fit_layer_closure(train, fields, peak_tflops, hbm_GBps, dtype)
        peak = {dtype: peak_tflops * scale}
        for r in layer_residuals(test, f, peak, hbm_GBps):
            out.append(r)
    return out


def _gpu(fields: dict, peak: dict | float, hbm_GBps: float, dtype: str = "bf16") -> GpuProfile:
    pk = peak if isinstance(peak, dict) else {dtype: peak}
    v = max(pk.values())
    return GpuProfile(model="calibration", peak_tflops_fp32=pk.get("fp32", v), peak_tflops_tf32=pk.get("tf32", pk.get("fp32", v)),
                      peak_tflops_fp16=pk.get("fp16", v), peak_tflops_bf16=pk.get("bf16", v), hbm_capacity_GiB=1,
                      hbm_bw_GBps=hbm_GBps, **fields)


def layer_residuals(layers: list[dict], fields: dict, peak: dict, hbm_GBps: float) -> list[dict]:
    out = []
    for r in layers:
        d = r["dtype"]
        gpu = _gpu(fields, peak, hbm_GBps, d)
        pred = predict_layer_s(gpu, peak[d] * 1e12, r, d, r["pass"] == "bwd")
        out.append({"layer": r["layer"], "dtype": d, "pass": r["pass"], "measured_s": _t(r),
                    "predicted_s": pred, "error": (pred - _t(r)) / _t(r), "spread": r.get("spread", 0.0)})
    return out


# ----------------------------------------------------------------------------- host side
def fit_zero3_hooks(records: list[dict]) -> dict:
    """cpu.zero3_hook_{fwd,bwd}_us and cpu.zero{0,1,2}_grad_hook_us from
    worker.bench_zero3_hooks (DeepSpeed installed): per-module slopes of a tiny-module stack over
    plain torch (records before the plain baseline: over ZeRO-0, ZeRO-3 only); {} when not
    measured."""
    rs = _ok(records, "zero3_hooks")
    if not rs:
        return {}
    out = {"zero3_hook_fwd_us": max(0.0, rs[0]["fwd_s_per_visit"]) * 1e6,
           "zero3_hook_bwd_us": max(0.0, rs[0]["bwd_s_per_visit"]) * 1e6}
    for stage, s_per_param in rs[0].get("grad_hook_s_per_param", {}).items():
        out[f"zero{stage}_grad_hook_us"] = max(0.0, s_per_param) * 1e6
    return out


def fit_adam(records: list[dict]) -> tuple[float, str]:
    """(params/s per core, implementation): DeepSpeedCPUAdam when measured, else the fastest
    torch CPU Adam; a rank's rate is divided by the threads it ran with."""
    cpu = [r for r in records if r.get("kind") == "adam" and r.get("device") == "cpu" and "error" not in r]
    if not cpu:
        raise ValueError("no CPU Adam records")
    ds = [r for r in cpu if r["impl"] == "DeepSpeedCPUAdam"]
    r = ds[0] if ds else max(cpu, key=lambda r: r["params_per_s"])
    return _rate(r, "params_per_s") / max(1, int(r.get("threads", 1))), r["impl"]


def fit_io(records: list[dict]) -> dict:
    io = {r["op"]: r for r in records if r.get("kind") == "file_io" and "error" not in r}
    return {"read_GBps": _rate(io["read"], "node_GBps") if "read" in io else None,
            "write_GBps": _rate(io["write"], "node_GBps") if "write" in io else None,
            "o_direct": bool(io.get("read", io.get("write", {})).get("o_direct", False))}


def fit_interference(records: list[dict]) -> dict:
    r = next((r for r in records if r.get("kind") == "interference"), None)
    if not r or r["gemm_alone_s"] <= 0 or r["gemm_during_comm_s"] <= 0:
        return {"compute_slowdown_during_comm": 0.0, "comm_slowdown_during_compute": 0.0}
    return {"compute_slowdown_during_comm": max(0.0, r["gemm_during_comm_s"] / r["gemm_alone_s"] - 1.0),
            "comm_slowdown_during_compute": max(0.0, r["comm_during_gemm_s"] / r["comm_alone_s"] - 1.0)}


# ----------------------------------------------------------------------------- the profile
def build_profile(name: str, records: list[dict], prov: dict, dtype: str) -> tuple[dict, dict]:
    """The profile mapping (same keys as hardware_profiles/*.yaml) and the fit report."""
    world = int(prov.get("world_size", 1))
    per_node = int(prov.get("ranks_per_node", world))
    coll = fit_collectives(records, "fp32" if dtype not in {r.get("dtype") for r in _ok(records, "collective")} else dtype)
    if not coll:   # the profile dtype was not measured for collectives: fall back to fp32
        coll = fit_collectives(records, "fp32")
    fields, comp = fit_compute(records, dtype)
    peak = comp["gemm"]["peak_tflops"]
    v = peak.get(dtype, max(peak.values()))
    adam_rate, adam_impl = fit_adam(records)
    io = fit_io(records)
    interf = fit_interference(records)
    cuda = prov.get("backend") == "nccl"
    host_GiB = float(prov.get("host_memory_GiB", 16))
    intra = coll.get("intra_node") or coll.get("world")
    inter = coll.get("inter_node")

    def tier_map(t, fabric):
        if not t:
            return None
        eff_default = t["efficiency_by_collective"].get("all_reduce") or next(iter(t["efficiency_by_collective"].values()))
        return {"fabric": fabric, "busbw_GBps": t["busbw_GBps"], "latency_us": t["latency_us"],
                "efficiency_by_size": eff_default, "efficiency_by_collective": t["efficiency_by_collective"]}

    backend = prov.get("backend", "gloo")
    intra_m = tier_map(intra, f"{backend}-intra-node" if cuda else "gloo-loopback (shared memory / TCP)")
    if inter:
        inter_m = {"fabric": f"{backend}-inter-node", "nics_per_node": 1,
                   # one rank per node drives the node's NIC(s): its busbw is the node's bandwidth
                   "nic_bw_Gbps": inter["busbw_GBps"] * 8, "latency_us": inter["latency_us"],
                   "efficiency_by_size": inter["efficiency_by_collective"].get("all_reduce")
                   or next(iter(inter["efficiency_by_collective"].values())),
                   "efficiency_by_collective": inter["efficiency_by_collective"]}
    else:   # single node: nothing to measure; mirror the intra tier so multi-node what-ifs stay finite
        inter_m = {"fabric": "not measured (single-node calibration; copy of intra_node)", "nics_per_node": 1,
                   "nic_bw_Gbps": intra["busbw_GBps"] * 8 * per_node, "latency_us": intra["latency_us"],
                   "efficiency_by_size": intra_m["efficiency_by_size"],
                   "efficiency_by_collective": intra["efficiency_by_collective"]}
    pcie = [r for r in records if r.get("kind") == "pcie" and r.get("pinned") and "error" not in r]
    memcpy = _ok(records, "memcpy")
    if pcie:
        pcie_GBps = min(_rate(r, "GBps") for r in pcie)
    else:   # no device: an "offload copy" is a host memcpy of one direction
        pcie_GBps = _rate(memcpy[0], "GBps") / 2 if memcpy else 1.0
    gpu = {"model": prov.get("gpu", "unknown"),
           "peak_tflops_fp32": peak.get("fp32", v), "peak_tflops_tf32": peak.get("tf32", peak.get("fp32", v)),
           "peak_tflops_fp16": peak.get("fp16", v), "peak_tflops_bf16": peak.get("bf16", v),
           "hbm_capacity_GiB": float(prov.get("gpu_memory_GiB", host_GiB / max(per_node, 1))),
           "hbm_bw_GBps": comp["hbm_bw_GBps"],
           "cuda_context_GiB": 0.75 if cuda else 0.3,
           "allocator_fragmentation_fraction": 0.02,
           # torch's and DeepSpeed's CPU backends run collectives and copies in program order
           "concurrent_streams": bool(cuda), **fields}
    profile = {
        "name": name,
        "description": f"calibrated by zsim calibrate ({prov.get('mode', '?')} mode) on {prov.get('hosts', '?')}: "
                       f"{world} ranks, {backend}",
        "gpus_per_node": per_node,
        "gpu": gpu,
        "intra_node": intra_m,
        "inter_node": inter_m,
        "pcie": {"generation": 4, "bw_GBps_per_gpu": pcie_GBps, "gpus_per_switch": 1,
                 "latency_us": 10.0 if cuda else fields["kernel_overhead_us"]},
        "nvme": {"drives_per_node": 1,
                 "read_GBps_per_drive": io["read_GBps"] or 1.0, "write_GBps_per_drive": io["write_GBps"] or 1.0},
        "cpu": {"model": prov.get("cpu", "unknown"), "cores_per_node": int(prov.get("cpu_cores", 1)),
                "memory_GiB": host_GiB, "memory_bw_GBps": (_rate(memcpy[0], "GBps") * per_node if memcpy else 10.0),
                "adam_params_per_s_per_core": adam_rate, **fit_zero3_hooks(records)},
        "interference": {"compute_slowdown_during_comm": min(1.0, interf["compute_slowdown_during_comm"])},
        # sorted: a fresh run and a refit of its records.json (written with sorted keys) give
        # byte-identical profiles
        "provenance": {**{k: str(v) for k, v in sorted(prov.items())}, "adam_implementation": adam_impl,
                       "file_io_o_direct": str(io["o_direct"]),
                       "comm_slowdown_during_compute": f"{interf['comm_slowdown_during_compute']:.3f}",
                       "compute_dtype": dtype},
    }
    hooks = _ok(records, "zero3_hooks")
    if hooks:
        profile["provenance"]["zero3_hooks_deepspeed"] = hooks[0]["deepspeed"]
    report = {"collectives": coll, "compute": comp, "adam": {"params_per_s_per_core": adam_rate, "impl": adam_impl},
              "io": io, "interference": interf}
    return _round(profile), report


def _round(x):
    """Round floats to 6 significant digits so the YAML stays readable and diffs stay small."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x
