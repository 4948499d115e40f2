"""Few-row GEMMs priced at their measured rate (see [Note: few-row GEMMs]), and the calibration's fit
of that rate from its gemm_decode records."""
from __future__ import annotations

import dataclasses
import math

import pytest

from calibration.harness.fit_compute import fit_gemm_decode
from zsim.config.profile import load_profile
from tests.helpers import ROOT
from zsim.hardware.compute import gemm_efficiency, gemm_time_s


def gpu(table=()):
    g = load_profile("dgx-h100", None, ROOT).gpu
    return dataclasses.replace(g, gemm_decode_efficiency=table)


TABLE = ((1.0, 0.8), (2.0, 0.6), (4.0, 0.4), (32.0, 0.2))


def test_a_measured_row_count_is_its_weights_read_at_its_rate():
    g = gpu(TABLE)
    n, k = 4096, 4096
    bw = g.hbm_bw_GBps * 1e9
    assert gemm_time_s(1, n, k, 2, g, 989e12) == pytest.approx((k + n * k + n) * 2 / (bw * 0.8))
    # between measured counts: linear in log(rows)
    eff3 = 0.6 + (0.4 - 0.6) * (math.log(3) - math.log(2)) / (math.log(4) - math.log(2))
    assert gemm_time_s(3, n, k, 2, g, 989e12) == pytest.approx((3 * k + n * k + 3 * n) * 2 / (bw * eff3))


def test_past_the_table_and_without_one_the_law_prices_it():
    n, k, m = 4096, 4096, 64
    law = max(2.0 * m * n * k / (989e12 * gemm_efficiency(m, n, k, gpu())),
              (m * k + n * k + m * n) * 2 / (gpu().hbm_bw_GBps * 1e9 * gpu().memory_bound_efficiency))
    assert gemm_time_s(m, n, k, 2, gpu(TABLE), 989e12) == gemm_time_s(m, n, k, 2, gpu(), 989e12) == law
    assert gemm_time_s(1, n, k, 2, gpu(), 989e12) > gemm_time_s(1, n, k, 2, gpu(TABLE), 989e12)


def test_fit_gives_each_row_count_its_rate_less_the_launches():
    recs = [{"kind": "gemm_decode", "dtype": "bf16", "m": m, "gemms": 10, "bytes": 1e9, "time_s": t, "spread": 0.0}
            for m, t in ((1, 0.5 + 10e-5), (4, 0.25 + 10e-5))]
    table = fit_gemm_decode(recs, 1e-5, 4.0)     # 4 GB/s device
    assert [m for m, _ in table] == [1.0, 4.0]
    assert [e for _, e in table] == pytest.approx([0.5, 1.0])
