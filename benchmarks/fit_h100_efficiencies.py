"""Fit the dgx-h100 profile's compute efficiencies to the published llm-foundry H100 table.

Step time is close to linear in the inverse efficiencies: sum over compute ops of
GEMM FLOPs/(peak*eff_gemm*dimfactor) + attention FLOPs/(peak*eff_fa) + bytes/(HBM*eff_mem)
+ kernels*overhead. The script builds each row's schedule, sums those components, and
solves a non-negative least-squares problem on relative error for three inverse
efficiencies (GEMM, FlashAttention, memory-bound). FlashAttention's backward efficiency is
tied to its forward one by FA2_BWD_OVER_FWD (Dao 2023, FlashAttention-2, fig. 7: H100
backward throughput ~0.8x forward), since the table cannot separate the two. It prints the fitted
values, the in-sample error of the linear model and a leave-one-model-out cross-validation
error (each MPT size predicted from a fit to the others), so the values are checkable and
their generality is measured. Run benchmarks/published_h100.py afterwards for the full
simulation (communication, overlap, interference included).
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from published_h100 import DEFAULT_CSV, read_rows, scenario_mapping  # noqa: E402
from calibration.harness.fit_layer import nnls_relative  # noqa: E402  (pure numpy, no torch)
from zsim.config.scenario import scenario_from_mapping  # noqa: E402
from zsim.schedule.build import build_schedule  # noqa: E402


FA2_BWD_OVER_FWD = 0.8


def components(sc) -> np.ndarray:
    gpu = sc.cluster.profile.gpu
    peak = sc.cluster.peak_flops(sc.precision)
    hbm = gpu.hbm_bw_GBps * 1e9
    dh = gpu.gemm_half_efficiency_dim
    _, schedule = build_schedule(sc)
    g = af = ab = mem = kern = 0.0
    for op in schedule.ops:
        if op.comm or op.stream != "compute":
            continue
        w = op.work
        for m, n, k in w.gemms:
            dim = (m / (m + dh)) * (n / (n + dh)) * (k / (k + dh))
            g += 2 * m * n * k / (peak * dim)
        if w.attention_flops:
            if w.attention_backward:
                ab += w.attention_flops / peak
            else:
                af += w.attention_flops / peak
        mem += w.mem_bytes / hbm
        kern += w.kernels * gpu.kernel_overhead_us * 1e-6
    return np.array([g, af + ab / FA2_BWD_OVER_FWD, mem, kern])


def fit_scales(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min sum(((X b + k) - y) / y)^2 over b >= 0 for the first three columns; the kernel
    overhead column keeps coefficient 1 (it is already in seconds)."""
    return nnls_relative(X[:, :3], y - X[:, 3], weight=y)


def main() -> int:
    rows = read_rows(DEFAULT_CSV)
    X, y, models = [], [], []
    for row in rows:
        sc = scenario_from_mapping(scenario_mapping(row), ROOT)
        X.append(components(sc))
        tokens = sc.micro_batch_size * sc.gradient_accumulation_steps * sc.seq_len
        y.append(tokens / float(row["tokens_per_s_per_gpu"]))
        models.append(row["model"])
    X, y = np.array(X), np.array(y)
    b = fit_scales(X, y)
    eff = [1 / v if v > 0 else float("inf") for v in b]
    names = ["gemm_max_efficiency", "flash_attention_fwd_efficiency", "memory_bound_efficiency"]
    for n, e in zip(names, eff):
        print(f"{n}: {e:.3f}")
    print(f"flash_attention_bwd_efficiency: {eff[1] * FA2_BWD_OVER_FWD:.3f}")
    pred = X[:, :3] @ b + X[:, 3]
    ape = np.abs(pred - y) / y
    print(f"in-sample linear-model MAPE: {ape.mean() * 100:.1f}% (max {ape.max() * 100:.1f}%)")
    cv = []
    for m in sorted(set(models)):
        train = np.array([x != m for x in models])
        bm = fit_scales(X[train], y[train])
        p = X[~train, :3] @ bm + X[~train, 3]
        cv.extend((np.abs(p - y[~train]) / y[~train]).tolist())
    print(f"leave-one-model-out MAPE: {statistics.mean(cv) * 100:.1f}% (max {max(cv) * 100:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
