"""TRL's DPO step under ZeRO-3 against DeepSpeed 0.19.8 recorded on CPU/gloo, world size 2
(calibration/deepspeed_record/dpo.py, tests/fixtures/deepspeed_dpo/): the trained engine's and
the reference engine's collectives of one optimizer step. See [Note: preference training],
see [Note: a reference engine under ZeRO-3] and see [Note: a PEFT reference under ZeRO-3]."""
import json
from collections import defaultdict
from pathlib import Path

import pytest

from calibration.deepspeed_record.cases import MODEL
from tests.helpers import recorded_steady_state, scenario_for, simulated
from zsim.schedule.build import workload_for

FIXTURES = Path(__file__).parents[1] / "fixtures" / "deepspeed_dpo"


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def volumes(seq) -> dict:
    """(phase, collective) -> (calls, elements)."""
    out: dict = defaultdict(lambda: [0, 0])
    for phase, op, numel in seq:
        out[(phase, op)][0] += 1
        out[(phase, op)][1] += numel
    return dict(out)


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_the_fixture_is_the_workload_zsim_builds(name):
    fx = load(name)
    sc = scenario_for(fx)
    assert sc.model == MODEL and sc.training.preference is not None
    assert [p["numel"] for p in fx["params"]] == [p.numel for p in workload_for(sc).params]
    assert fx["ranks_identical_trace"]


@pytest.mark.parametrize("name", ["stage3_dpo", "stage3_dpo_prefetch_0_reuse_0"])
def test_a_reference_copy_s_engine_issues_what_zsim_schedules(name):
    """The reference copy's own engine: every collective of the step, in order."""
    fx = load(name)
    assert simulated(fx) == recorded_steady_state(fx)


@pytest.mark.parametrize("name", ["stage3_dpo_lora", "stage3_dpo_lora_prefetch_0_reuse_0"])
def test_a_peft_reference_fetches_on_demand_as_deepspeed_does(name):
    """The adapter-disabled reference forward leaves DeepSpeed's trace incomplete: backward
    re-gathers what the forwards released, as zsim schedules (elements within 0.1%); the step's
    collectives are exact; for the forward's known gaps see [Note: a PEFT reference under ZeRO-3]."""
    fx = load(name)
    rec, sim = volumes(recorded_steady_state(fx)), volumes(simulated(fx))
    back = ("backward", "all_gather")
    assert sim[back][1] == pytest.approx(rec[back][1], rel=1e-3)
    assert abs(sim[back][0] - rec[back][0]) <= 1
    for key in (("backward", "reduce_scatter"), ("step", "all_gather"), ("step", "all_reduce")):
        assert sim[key] == rec[key]
    forward = ("forward", "all_gather")
    if "prefetch_0" in name:    # at the default bucket the recorded forward has the unmodelled root prefetch
        assert sim[forward][1] == pytest.approx(rec[forward][1], rel=5e-3)
