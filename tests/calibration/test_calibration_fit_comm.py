"""Collective fits on synthetic records (no torch): robust alpha-beta regression, tables that
reproduce every measurement through zsim's collective cost, the mean call, coalesced batches."""
from __future__ import annotations

import pytest

from calibration.harness.fit_comm import fit_collectives, robust_alpha_beta
from tests.helpers import SIZES, coll_records
from zsim.schema import build
from zsim.errors import ZsimInputError
from zsim.hardware.collectives import Tier, collective_cost
from zsim.config.profile import load_profile
from zsim.specs.hardware import Cluster, HardwareProfile


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


def test_fit_collectives_reproduces_every_measurement():
    truth = Tier(4e9, 30e-6, ((1024, 0.05), (1 << 20, 0.6), (1 << 24, 1.0)),
                 (("broadcast", ((1024, 0.1), (1 << 24, 0.9))),))
    recs = coll_records(truth)
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
    recs = coll_records(truth, ops=("all_gather", "all_gather_coalesced"))
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


def test_isotonic_pools_noise_dips_and_keeps_monotone_data():
    from calibration.harness.fit_comm import isotonic_increasing
    assert isotonic_increasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    # a stalled small call (3.0) followed by a quicker larger one (1.0): pooled to their mean
    assert isotonic_increasing([0.5, 3.0, 1.0, 4.0]) == [0.5, 2.0, 2.0, 4.0]
    out = isotonic_increasing([5.0, 1.0, 1.0, 1.0])
    assert out == [2.0] * 4 and sum(out) == pytest.approx(8.0)
