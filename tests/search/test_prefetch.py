"""Searches with worker processes (zsim/search/variants.py Base.prefetch): the same answer as
one process, bit for bit, and the worker's simulation is the one used."""
import json

import yaml

from tests.helpers import ROOT, mapping, over_by, tight_gpu
from zsim.cli import main as cli_main
from zsim.search import variants
from zsim.search.tune import tune
from zsim.search.variants import Base, Variant


def _tune_answer(res):
    return ([(c.key(), r) for c, r in res.ranked], [(c.key(), out) for c, out in res.evaluated],
            [c.key() for c in res.pruned], res.rejected)


def test_tune_with_workers_gives_the_same_answer():
    one = tune(Base(tight_gpu(0.5), ROOT, "tight"), "tokens_per_s", budget=24)
    base = Base(tight_gpu(0.5), ROOT, "tight", workers=2)
    try:
        two = tune(base, "tokens_per_s", budget=24)
    finally:
        base.close()
    assert _tune_answer(one) == _tune_answer(two)
    assert one.simulated == two.simulated > 5


def test_doctor_cli_with_workers_writes_the_same_report(tmp_path, capsys):
    path = tmp_path / "over.yaml"
    path.write_text(yaml.safe_dump(over_by(0.20)))
    reports, texts = [], []
    for workers in ("1", "2"):
        out = tmp_path / f"doctor-{workers}.json"
        assert cli_main(["doctor", str(path), "--workers", workers, "--json", str(out)]) == 0
        texts.append(capsys.readouterr().out)
        reports.append(json.loads(out.read_text()))
    assert reports[0] == reports[1] and len(reports[0]["tried"]) >= 5
    assert texts[0].split("\nwrote")[0] == texts[1].split("\nwrote")[0]


def test_run_takes_the_prefetched_simulation_and_invalid_variants_stay_errors(monkeypatch):
    base = Base(mapping(**{"training.micro_batch_size": 4}), ROOT, "tiny", workers=2)
    stage3 = Variant("stage 3", ("deepspeed.zero_optimization.stage=3",))
    bad = Variant("bad stage", ("deepspeed.zero_optimization.stage=7",))
    try:
        base.prefetch([stage3, bad])
        assert len(base._ahead.pending) == 1    # the invalid variant is left to run
        # the parent would fail if it simulated: the result must come from the worker
        monkeypatch.setattr(variants, "run_scenario", lambda *a: (_ for _ in ()).throw(AssertionError("simulated")))
        got = base.run(stage3)
        assert got.ok and not base._ahead.pending
        err = base.run(bad)
        assert not err.ok and "stage" in err.error
    finally:
        base.close()
    monkeypatch.undo()
    assert got.result == Base(mapping(**{"training.micro_batch_size": 4}), ROOT, "tiny").run(stage3).result


def test_workers_flag_is_checked(capsys):
    assert cli_main(["doctor", str(ROOT / "scenarios" / "default.yaml"), "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--workers" in err[0] and "0" in err[0]


def test_a_worker_that_dies_costs_time_not_the_answer(monkeypatch):
    """BrokenProcessPool: the variants are simulated here instead, no hang, the same results."""
    import os
    raw = mapping(**{"training.micro_batch_size": 4})
    variants_ = [Variant(f"stage {s}", (f"deepspeed.zero_optimization.stage={s}",)) for s in (1, 2, 3)]
    monkeypatch.setattr(variants, "_simulate_variant", lambda assignments: os._exit(3))
    base = Base(raw, ROOT, "tiny", workers=2)
    try:
        base.prefetch(variants_[:2])
        got = [base.run(v).result for v in variants_[:2]]
        base.prefetch(variants_[2:])     # the pool is broken: nothing is submitted
        got.append(base.run(variants_[2]).result)
    finally:
        base.close()
    plain = Base(raw, ROOT, "tiny")
    assert got == [plain.run(v).result for v in variants_]


def test_two_bases_with_workers_each_simulate_their_own_scenario():
    """Each pool's workers start with their own Base, whenever the pool forks them."""
    raws = [mapping(**{"training.micro_batch_size": mb}) for mb in (2, 4)]
    stage3 = Variant("stage 3", ("deepspeed.zero_optimization.stage=3",))
    bases = [Base(raw, ROOT, f"mb{i}", workers=2) for i, raw in enumerate(raws)]
    try:
        for base in bases:
            base.prefetch([stage3])
        got = [base.run(stage3).result for base in bases]
    finally:
        for base in bases:
            base.close()
    assert got == [Base(raw, ROOT, "plain").run(stage3).result for raw in raws]
    assert got[0] != got[1]
