"""Compute fits: the GEMM efficiency law, attention and memory-bound efficiencies, fresh
allocations and the optimizer step, then the layer closure (fit_layer.py)."""
from __future__ import annotations

import numpy as np

from calibration.harness.fit_common import fit_rate, fit_time_s, usable
from calibration.harness.fit_layer import (fit_layer_closure, held_out_layer_errors, layer_residuals,
                                           nnls_relative)
from zsim.specs.hardware import DTYPE_COMPUTE_FIELDS

def gemm_law(m: float, n: float, k: float, d_half: float) -> float:
    return (m / (m + d_half)) * (n / (n + d_half)) * (k / (k + d_half))


# [Note: the GEMM law against the datasheet]
# A GEMM benchmark that ran under LAUNCH_BOUND x the measured launch overhead is left out of the
# law: its time is the launch rate, not the kernel's (the H200 run's 1024^3 square took 18.5 us
# against 13.2 us of launch; zsim charges launches apart, kernel_overhead_us). On a GPU whose datasheet dense peak is known the peak is the datasheet's and the
# law's max efficiency is fitted (<= 1): fitting the peak freely with the launch-bound square in
# put the H200's asymptote at 1752 TFLOP/s (d_half 1218), 1.8x the 989.4 of the datasheet, with
# every LLM-sized GEMM priced by the law's steep part. A CPU rank (no datasheet) keeps the
# asymptote as its peak, max efficiency 1. Shapes that are all large cannot tell d_half apart
# (the H200 run's twelve LLM GEMMs, 2048-8192 per side: RMS error 4.47% at d_half 0, 4.61% at 64):
# within INDISTINCT of the best error, the base profile's d_half (a prior) is kept.
LAUNCH_BOUND = 3.0
INDISTINCT = 0.05


def fit_gemm(records: list[dict], overhead_s: float = 0.0, datasheet_tflops: dict | None = None,
             d_half_prior: float | None = None) -> dict:
    """Peak TFLOP/s and max efficiency per dtype and d_half shared by all dtypes (see
    [Note: the GEMM law against the datasheet]).

    Without a datasheet peak for a dtype (a CPU rank's share of cores, turbo, AVX licences),
    the peak reported is the law's asymptote, max efficiency 1; with one, the peak is the
    datasheet's and the max efficiency is fitted. For each d_half on a log grid, the free factor
    per dtype has a closed form (least squares in relative time error); the d_half with the
    smallest error wins."""
    recs = [r for r in usable(records, "gemm") if fit_time_s(r) >= LAUNCH_BOUND * overhead_s]
    if not recs:
        raise ValueError("no GEMM records")
    sheet = datasheet_tflops or {}
    best, prior = None, None
    dtypes = sorted({r["dtype"] for r in recs})
    grid = [0.0] + [float(v) for v in np.geomspace(1, 4096, 97)]
    for d_half in grid + ([d_half_prior] if d_half_prior is not None else []):
        peaks, effs, err = {}, {}, 0.0
        for d in dtypes:
            rs = [r for r in recs if r["dtype"] == d]
            x = np.array([r["flops"] / gemm_law(r["m"], r["n"], r["k"], d_half) for r in rs])
            y = np.array([fit_time_s(r) for r in rs])
            inv = float(np.sum(x / y) / np.sum(x * x / (y * y)))   # time = inv * x
            if d in sheet:
                peak = sheet[d] * 1e12
                eff = min(1.0, 1.0 / (inv * peak))     # time = x / (peak * eff)
                inv = 1.0 / (peak * eff)
                peaks[d], effs[d] = peak, eff
            else:
                peaks[d], effs[d] = 1.0 / inv, 1.0
            err += float(np.sum(((inv * x - y) / y) ** 2))
        if d_half_prior is not None and d_half == d_half_prior:
            prior = (err, d_half, peaks, effs)
        if best is None or err < best[0] - 1e-15:
            best = (err, d_half, peaks, effs)
    d_half_from = "fitted"
    if prior is not None and np.sqrt(prior[0]) <= (1 + INDISTINCT) * np.sqrt(best[0]):
        best, d_half_from = prior, "base profile (the shapes do not tell it apart)"
    err, d_half, peaks, effs = best
    res = []
    for r in recs:
        d = r["dtype"]
        pred = r["flops"] / (peaks[d] * effs[d] * gemm_law(r["m"], r["n"], r["k"], d_half))
        res.append({"dtype": d, "shape": [r["m"], r["n"], r["k"]], "module": r.get("module"),
                    "pass": r.get("pass"), "measured_s": fit_time_s(r), "predicted_s": pred,
                    "error": (pred - fit_time_s(r)) / fit_time_s(r)})
    left_out = [[r["m"], r["n"], r["k"]] for r in usable(records, "gemm") if r not in recs]
    return {"peak_tflops": {d: p / 1e12 for d, p in sorted(peaks.items())},
            "max_efficiency": dict(sorted(effs.items())), "gemm_max_efficiency": effs[dtypes[0]],
            "peak_from": {d: "datasheet" if d in sheet else "asymptote" for d in dtypes},
            "gemm_half_efficiency_dim": d_half, "d_half_from": d_half_from, "launch_bound_left_out": left_out,
            "residuals": res}


def fit_efficiency_ratio(work: list[float], time_s: list[float], rate: float) -> float:
    """Single efficiency e with sum(work)/(rate*e) = sum(time): the ratio of totals, so the
    efficiency reproduces the total time of the measured kernels (what a layer sums)."""
    return float(sum(work) / (rate * sum(time_s)))


def fit_gemm_decode(records: list[dict], overhead_s: float, hbm_GBps: float) -> tuple[tuple[float, float], ...]:
    """gemm_decode_efficiency: per row count, the fraction of the device's bandwidth the decode
    GEMMs' operand reads reach, less a launch each (bench_compute.bench_decode_gemms; see
    [Note: few-row GEMMs])."""
    out = {}
    for m in sorted({r["m"] for r in records}):
        rs = [r for r in records if r["m"] == m]
        out[float(m)] = min(1.0, fit_efficiency_ratio([r["bytes"] for r in rs],
                                                      [max(fit_time_s(r) - r["gemms"] * overhead_s, 1e-9) for r in rs],
                                                      hbm_GBps * 1e9))
    return tuple(out.items())


def fit_attention(rs: list[dict], time_s: list[float], peak_flops: float) -> tuple[float, float]:
    """(efficiency, fixed s per call) of t = flops / (peak * eff) + fixed over the layer shapes,
    least squares in relative error, eff <= 1 and fixed >= 0. On CPU a short sequence's
    attention is far from its FLOP rate (h256/s128 backward ran at 40% of the s256 rate), which
    one efficiency cannot hold. One shape: the efficiency alone (ratio of totals)."""
    if len({r.get("layer") for r in rs}) < 2:
        return min(1.0, fit_efficiency_ratio([r["flops"] for r in rs], time_s, peak_flops)), 0.0
    X = np.array([[r["flops"] / peak_flops, 1.0] for r in rs])
    inv_eff, fixed_s = nnls_relative(X, np.array(time_s), np.array([1.0, 0.0]))
    return float(1.0 / inv_eff), float(fixed_s)


def fit_fresh_alloc(records: list[dict]) -> dict:
    """fresh_alloc_threshold_bytes and fresh_alloc_GBps (zsim.hardware.compute.fresh_alloc_time_s).

    A size is "fresh" when allocating costs at least the fill of a kept buffer again on top of it
    (first touch faults each page in, zeroes it and maps it: on the 2026-11 Xeon VM 2-3 GB/s
    against a 6-20 GB/s fill, so 1.5-4x the fill; an earlier VM measured ~10x, and a 3x bar
    missed this one's fresh sizes whenever a large kept fill fell out of cache and slowed); the
    threshold is the largest size below every fresh one, the rate the median first-touch rate of
    the fresh sizes. No fresh size: {}.
    """
    rs = sorted(usable(records, "fresh_alloc"), key=lambda r: r["size_bytes"])
    is_fresh = [fit_time_s(r) - r["kept_time_s"] > r["kept_time_s"] for r in rs]
    if not is_fresh or not is_fresh[-1]:
        return {}
    first = len(rs) - 1
    while first > 0 and is_fresh[first - 1]:
        first -= 1
    lim = rs[first - 1]["size_bytes"] if first > 0 else rs[0]["size_bytes"] / 2
    rates = sorted(r["size_bytes"] / (fit_time_s(r) - r["kept_time_s"]) for r in rs[first:])
    return {"fresh_alloc_threshold_bytes": float(lim), "fresh_alloc_GBps": rates[len(rates) // 2] / 1e9}


def fit_collective_memory(records: list[dict]) -> dict:
    """gpu.reduce_scatter_temp_fraction: what a reduce_scatter_tensor call allocated beyond its
    input and output, over its input's bytes (see [Note: gloo reduce-scatter copy]); the largest
    rank's figure, rounded to 1/64 (the measurement is whole tensors). Not measured: {}."""
    rs = [r for r in records if r.get("kind") == "collective_memory" and "error" not in r
          and r["op"] == "reduce_scatter" and r["input_bytes"] > 0]
    if not rs:
        return {}
    return {"reduce_scatter_temp_fraction": round(max(r["temp_bytes"] / r["input_bytes"] for r in rs) * 64) / 64}


def _optimizer_passes_s(rec: dict, overhead_s: float) -> float:
    """A streaming benchmark's time (the optimizer step, the gradient accumulation add) without
    its kernels' launch overhead, which zsim charges apart from the bytes (kernel_overhead_us per
    kernel)."""
    return fit_time_s(rec) - rec.get("kernels", 6) * overhead_s


def fit_step_passes(rec: dict, device_Bps: float, overhead_s: float) -> tuple[float | None, float | None]:
    """A GPU's optimizer_step record read as zsim prices it there (see [Note: launch-bound step
    passes]): its grad-norm op (the per-piece kernels, the norm and overflow bytes) then its step op
    (6 kernels, the step's bytes), each the longer of its launches and its streaming at the
    device's rate. Returns (optimizer_efficiency, step_kernel_overhead_s). When the launches at
    kernel_overhead could not have kept the device waiting as long as the benchmark ran, the
    benchmark was launch-bound: the per-kernel host time is solved for and the device's rate was
    not observed (efficiency None: zsim uses memory_bound_efficiency). Otherwise the streaming
    was the bound: efficiency = bytes / (rate x time), the launch cost stays kernel_overhead."""
    from zsim.schedule.optimizer import STEP_KERNELS, norm_bytes_per_param, overflow_bytes_per_param
    from zsim.workload.module import DTYPE_BYTES

    width = DTYPE_BYTES[rec["dtype"]]
    norm_bytes = rec["params"] * (norm_bytes_per_param(width) + (overflow_bytes_per_param(width) if width < 4 else 0.0))
    k_step = STEP_KERNELS
    k_norm = rec["kernels"] - k_step
    d_norm, d_step = norm_bytes / device_Bps, (rec["bytes"] - norm_bytes) / device_Bps
    t = fit_time_s(rec)

    def modelled(h: float) -> float:
        return max(k_norm * h, d_norm) + max(k_step * h, d_step)

    if t <= modelled(overhead_s):
        return min(1.0, rec["bytes"] / (device_Bps * t)), None
    lo, hi = overhead_s, t / max(k_norm, 1)
    for _ in range(100):   # modelled() is nondecreasing in h: bisect to the measured time
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if modelled(mid) < t else (lo, mid)
    return None, (lo + hi) / 2


def fit_compute(records: list[dict], dtypes: tuple[str, ...], concurrent: bool = False,
                datasheet_tflops: dict | None = None, d_half_prior: float | None = None) -> tuple[dict, dict, dict]:
    """GpuProfile fields for dtypes[0] (the top level), one by_dtype entry per dtype when several
    are fitted (DTYPE_COMPUTE_FIELDS, each from that dtype's own records and layer closure), and
    a report of residuals. Launch overhead, the device's bandwidth, the GEMM law's d_half and fresh
    allocations are the device's: one fit over all dtypes. `concurrent`: a GPU's streams (the
    host launches ahead of the device)."""
    over = usable(records, "kernel_overhead")
    overhead_s = fit_time_s(over[0]) if over else 0.0
    ag = usable(records, "autograd_overhead")
    # a backward benchmark is one autograd.grad call on an isolated op: drop the engine's
    # start-up (paid once per layer backward, not per op), keeping the op's own kernel cost
    autograd_s = max(0.0, fit_time_s(ag[0]) - overhead_s) if ag else 0.0
    # the device's copy (a CPU rank's device is the host)
    mc = ([r for r in usable(records, "memcpy") if r.get("where") == "device"]
          or [r for r in usable(records, "memcpy") if r.get("where") == "host"])
    opt = [r for r in usable(records, "optimizer_step") if r["dtype"] in dtypes]
    # the device's bandwidth is at least the best streaming rate any benchmark reached (the
    # copy and the optimizer's passes), so every efficiency against it stays <= 1
    rates = ([fit_rate(mc[0], "GBps")] if mc else []) + [o["bytes"] / _optimizer_passes_s(o, overhead_s) / 1e9
                                                      for o in opt]
    dev = {"concurrent": concurrent, "overhead_s": overhead_s, "autograd_s": autograd_s, "hbm_GBps": max(rates) if rates else 1.0,
           "gemm": fit_gemm([r for r in records if r.get("kind") == "gemm"], overhead_s, datasheet_tflops,
                            d_half_prior),
           "fresh_alloc": fit_fresh_alloc(records),
           "collective_memory": fit_collective_memory(records)}
    report = {"kernel_overhead_measured_us": overhead_s * 1e6, "autograd_call_us": autograd_s * 1e6,
              "hbm_bw_GBps": dev["hbm_GBps"], "gemm": dev["gemm"]}
    fitted = {d: _fit_dtype(records, d, dev) for d in dtypes}
    fields, first = fitted[dtypes[0]]
    report.update(first)
    by_dtype = {}
    if len(dtypes) > 1:
        by_dtype = {d: {k: f[k] for k in DTYPE_COMPUTE_FIELDS if k in f} for d, (f, _) in fitted.items()}
        report["by_dtype"] = {d: rep for d, (_, rep) in fitted.items()}
        # every dtype's layers, so the lines printed per layer (calibrate, the profile header) show them all
        for key in ("layers", "layers_held_out"):
            report[key] = [r for _, rep in fitted.values() for r in rep.get(key, [])]
    return fields, by_dtype, report


def _fit_dtype(records: list[dict], dtype: str, dev: dict) -> tuple[dict, dict]:
    """The fields of one training precision: attention, memory-bound and optimizer efficiencies
    from its kernels, then its layer closure (which may rescale its GEMM peak in dev["gemm"])."""
    overhead_s, autograd_s, hbm_GBps, gemm = dev["overhead_s"], dev["autograd_s"], dev["hbm_GBps"], dev["gemm"]
    opt = [r for r in usable(records, "optimizer_step") if r["dtype"] == dtype]
    peak = gemm["peak_tflops"]
    p = peak.get(dtype) or max(peak.values())
    att = [r for r in usable(records, "attention") if r["dtype"] == dtype]
    eff, att_over_us = {}, {}
    for pas, kernels in (("fwd", 1), ("bwd", 2)):
        rs = [r for r in att if r["pass"] == pas]
        if rs:
            y = [max(fit_time_s(r) - kernels * overhead_s - (autograd_s if pas == "bwd" else 0.0), 1e-9) for r in rs]
            e, over_s = fit_attention(rs, y, p * 1e12)
            eff[pas], att_over_us[pas] = e, over_s * 1e6
    mb = [r for r in usable(records, "membound") if r["dtype"] == dtype]
    mem_eff = min(1.0, fit_efficiency_ratio([r["bytes"] for r in mb],
                                            [max(fit_time_s(r) - overhead_s - (autograd_s if r["pass"] == "bwd" else 0.0), 1e-9)
                                             for r in mb], hbm_GBps * 1e9)) if mb else 0.5
    fields = {"gemm_max_efficiency": gemm["max_efficiency"].get(dtype, 1.0),
              "gemm_half_efficiency_dim": gemm["gemm_half_efficiency_dim"],
              "flash_attention_fwd_efficiency": eff.get("fwd", 0.5),
              "flash_attention_bwd_efficiency": eff.get("bwd", 0.4),
              "flash_attention_fwd_overhead_us": att_over_us.get("fwd", 0.0),
              "flash_attention_bwd_overhead_us": att_over_us.get("bwd", 0.0),
              "memory_bound_efficiency": mem_eff, "kernel_overhead_us": overhead_s * 1e6, **dev["fresh_alloc"],
              **dev["collective_memory"]}
    dec = [r for r in usable(records, "gemm_decode") if r["dtype"] == dtype]
    if dec:   # the decode GEMMs' operand reads, less a launch each (zsim.hardware.compute.gemm_time_s)
        fields["gemm_decode_efficiency"] = fit_gemm_decode(dec, overhead_s, hbm_GBps)
    acc = [r for r in usable(records, "grad_accumulate") if r["dtype"] == dtype]
    if acc:   # bytes as zsim charges them (see [Note: gradient accumulation add]), less the add_ launches
        fields["grad_accumulate_efficiency"] = min(1.0, acc[0]["bytes"] / max(_optimizer_passes_s(acc[0], overhead_s),
                                                                              1e-9) / (hbm_GBps * 1e9))
    if opt and dev["concurrent"]:
        eff_opt, step_kernel_s = fit_step_passes(opt[0], hbm_GBps * 1e9 * mem_eff, overhead_s)
        if eff_opt is not None:
            fields["optimizer_efficiency"] = eff_opt * mem_eff
        if step_kernel_s is not None:
            fields["step_kernel_overhead_us"] = step_kernel_s * 1e6
    elif opt:   # bytes as zsim charges them (step_bytes_per_param), over the device bandwidth above
        fields["optimizer_efficiency"] = min(1.0, opt[0]["bytes"] / max(_optimizer_passes_s(opt[0], overhead_s), 1e-9)
                                             / (hbm_GBps * 1e9))
    report = {}
    layers = [r for r in usable(records, "layer") if r["dtype"] == dtype]
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
