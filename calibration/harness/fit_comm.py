"""Collective fits: t(size) = alpha + size/beta per (collective, tier, dtype) by robust
regression, and the latency / bus bandwidth / efficiency tables zsim's collective cost
reproduces each measurement with (method: calibration/harness/fit.py)."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from calibration.harness.fit_common import fit_time_s, relative_errors, usable
from calibration.harness.plan import stats
from zsim.hardware.collectives import bus_factor, ring_steps
from zsim.specs.hardware import REDUCING_COLLECTIVES


HUBER_K = 1.345   # 95% efficiency under Gaussian noise (Huber 1964)


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


def mean_call_time_s(r: dict) -> float:
    """Mean per-call time over all repetitions. A step's collectives are many calls in a row, so
    their sum is the mean times the count: gloo's random stalls (a small call is 0.2 ms typically
    and 1-5 ms one time in ten after a compute phase) land in the step and must land in the fit,
    which the median repetition drops."""
    ts = r.get("times_s")
    return float(np.mean(ts)) if ts else fit_time_s(r)


def smoothed_times(recs: list[dict]) -> dict[tuple[str, int], float]:
    """{(op, size): time} with each collective's time made non-decreasing in size: moving more
    bytes cannot be cheaper on average, so a dip is timing noise (gloo's small-message calls
    stall at random), and pooling it with its neighbours averages the noise out."""
    out = {}
    for op in sorted({r["op"] for r in recs}):
        pts = sorted((r["size_bytes"], mean_call_time_s(r)) for r in recs if r["op"] == op)
        for (s, _), t in zip(pts, isotonic_increasing([t for _, t in pts])):
            out[(op, s)] = t
    return out


def collective_kind(op: str) -> str:
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
    for r in usable(pool_passes(records), "collective"):
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
            ab[op] = {"alpha_us": a * 1e6, "alpha_per_step_us": a * 1e6 / ring_steps(collective_kind(op), n),
                      "busbw_GBps": (bus_factor(collective_kind(op), n) / spb / 1e9) if spb > 0 else float("inf"),
                      "residuals": [[s, e] for (s, _), e in zip(pts, relative_errors(pred, [p[1] for p in pts]))]}
        min_step_s = min(sm[(r["op"], r["size_bytes"])] / ring_steps(collective_kind(r["op"]), n) for r in recs)
        latency_s = min(min(v["alpha_per_step_us"] for v in ab.values()) * 1e-6, 0.95 * min_step_s)
        rate = {}
        for r in recs:
            transfer_s = sm[(r["op"], r["size_bytes"])] - ring_steps(collective_kind(r["op"]), n) * latency_s
            rate[(r["op"], r["size_bytes"])] = r["size_bytes"] * bus_factor(collective_kind(r["op"]), n) / transfer_s
        busbw_Bps = max(rate.values())
        tables = {}
        for op in sorted({r["op"] for r in recs}):
            tables[op] = [[int(s), rate[(o, s)] / busbw_Bps] for (o, s) in sorted(rate) if o == op]
        out[tier] = {"ranks": n, "latency_us": latency_s * 1e6, "busbw_GBps": busbw_Bps / 1e9,
                     "efficiency_by_collective": tables, "alpha_beta": ab}
    return out


def fit_reductions_16bit(records: list[dict], base: dict, dtype: str) -> None:
    """Add to each tier of `base` (fit_collectives of another dtype) the tables of the reducing
    collectives measured in the 16-bit `dtype`, "<op>_<dtype>", against the tier's own latency and
    peak so that zsim's ring_cost reproduces each (size-smoothed) time (see [Note: 16-bit
    reductions on the host] in zsim/hardware/collectives.py)."""
    by_tier: dict[str, list[dict]] = defaultdict(list)
    for r in usable(pool_passes(records), "collective"):
        if r["dtype"] == dtype and r["ranks"] > 1 and r["op"] in REDUCING_COLLECTIVES:
            by_tier[r["tier"]].append(r)
    for tier, recs in sorted(by_tier.items()):
        t = base.get(tier)
        if t is None:
            continue
        n, latency_s, busbw_Bps = recs[0]["ranks"], t["latency_us"] * 1e-6, t["busbw_GBps"] * 1e9
        sm = smoothed_times(recs)
        for op in sorted({r["op"] for r in recs}):
            kind = collective_kind(op)
            table = []
            for s in sorted(size for o, size in sm if o == op):
                transfer_s = max(sm[(op, s)] - ring_steps(kind, n) * latency_s, 1e-12)
                table.append([int(s), min(1.0, s * bus_factor(kind, n) / transfer_s / busbw_Bps)])
            t["efficiency_by_collective"][f"{op}_{dtype}"] = table
