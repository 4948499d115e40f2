"""zsim calibrate --pool-collectives: collectives fitted over several complete runs of one
cluster, refusals in one line, and a refit that reproduces the pooled profile."""
from __future__ import annotations

import json

import pytest

from calibration.harness.fit import build_profile
from calibration.harness.fit_comm import fit_collectives
from tests.helpers import SIZES, run_doc, zsim_cli
from zsim.errors import ZsimInputError
from zsim.hardware.collectives import Tier, collective_cost


def test_pooled_collectives_fit_the_mean_call_over_all_runs(tmp_path):
    from calibration.harness.pool import add_sources, pooled

    _, recs, prov = run_doc(tmp_path, "a", 1.0, "2026-01-01T00:00:00Z")
    b, _, _ = run_doc(tmp_path, "b", 3.0, "2026-01-01T01:00:00Z")
    pool = add_sources([], [str(b)], prov)
    records, prov2 = pooled(recs, prov, pool)
    assert "2026-01-01T01:00:00Z" in prov2["pooled_collectives"]
    fit = fit_collectives(records, "bf16")["intra_node"]
    tier = Tier(fit["busbw_GBps"] * 1e9, fit["latency_us"] * 1e-6, ((1.0, 1.0),),
                tuple((k, tuple(map(tuple, v))) for k, v in fit["efficiency_by_collective"].items()))
    for k, s in enumerate(SIZES, start=1):   # every call of both runs: (1 + 3) / 2 ms per k
        assert collective_cost("all_reduce", s, 1, 2, tier, tier).time_s == pytest.approx(2e-3 * k, rel=1e-9)
    # the compute figures are the fitted run's alone
    assert build_profile("x", records, prov2, ("bf16",))[0]["gpu"] == build_profile("x", recs, prov, ("bf16",))[0]["gpu"]


@pytest.mark.parametrize("changes,needle", [
    ({"world_size": "4"}, "world_size"),
    ({"backend": "nccl"}, "backend"),
    ({"date": "2026-01-01T00:00:00Z"}, "already pooled"),
])
def test_pooling_another_cluster_or_the_same_run_is_refused(tmp_path, changes, needle):
    from calibration.harness.pool import add_sources

    _, _, prov = run_doc(tmp_path, "a", 1.0, "2026-01-01T00:00:00Z")
    b, _, _ = run_doc(tmp_path, "b", 3.0, changes.pop("date", "2026-01-01T01:00:00Z"), **changes)
    with pytest.raises(ZsimInputError) as e:
        add_sources([], [str(b)], prov)
    assert "--pool-collectives" in str(e.value) and needle in str(e.value)


def test_pooling_an_incomplete_or_missing_run_or_the_one_being_replaced_is_refused(tmp_path):
    from calibration.harness.pool import precheck

    b, _, _ = run_doc(tmp_path, "b", 1.0, "2026-01-01T01:00:00Z")
    doc = json.loads((b / "records.json").read_text())
    (b / "records.json").write_text(json.dumps({**doc, "status": "failed"}))
    for src, needle in ((b, "not complete"), (tmp_path / "nope", "records.json"), (tmp_path / "x", "overwrites")):
        with pytest.raises(ZsimInputError) as e:
            precheck([str(src)], tmp_path / "x")
        assert needle in str(e.value)


def test_pooled_refit_from_the_cli_reproduces_the_profile(tmp_path):
    pytest.importorskip("torch")
    a, _, _ = run_doc(tmp_path, "a", 1.0, "2026-01-01T00:00:00Z")
    b, _, _ = run_doc(tmp_path, "b", 3.0, "2026-01-01T01:00:00Z")
    r = zsim_cli("calibrate", "--out", "p", "--from-run", str(a), "--pool-collectives", str(b), "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "calibration" / "runs" / "p"
    assert json.loads((run / "pooled_collectives.json").read_text())["runs"][0]["source"] == str(b)
    prof = tmp_path / "hardware_profiles" / "p.yaml"
    first = prof.read_text()
    assert "pooled_collectives" in first
    r = zsim_cli("calibrate", "--out", "p", "--from-run", str(run), "--force", "--root", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert prof.read_text() == first
    r = zsim_cli("calibrate", "--out", "p", "--from-run", str(run), "--force", "--pool-collectives", str(b),
              "--root", str(tmp_path))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "already pooled" in r.stderr
