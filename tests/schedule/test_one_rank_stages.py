"""On one GPU, ZeRO-1 reports more memory than stage 0 (see [Note: one-rank stage ordering]):
real DeepSpeed 0.19.8 does the same, measured on one CPU rank (tests/fixtures/single_rank/
small_world1.json, recorded with `zsim validate --engine deepspeed` at world 1)."""
import json

import pytest

from calibration.validation import TENSOR_ONLY_OVERRIDES
from tests.helpers import ROOT
from zsim.api import run_scenario
from zsim.config.scenario import load_scenario

FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "single_rank" / "small_world1.json").read_text())


def _predicted(precision: str, stage: int) -> float:
    sc = load_scenario(str(ROOT / "benchmarks" / "validate_scenarios" / "small.yaml"),
                       (f"deepspeed.zero_optimization.stage={stage}", f"training.precision={precision}",
                        "hardware.gpus_per_node=1", "hardware.profile=cpu-gloo-localhost") + TENSOR_ONLY_OVERRIDES)
    return run_scenario(sc)[0].memory.peak_bytes


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_stage1_holds_more_than_stage0_on_one_rank_as_deepspeed_does(precision):
    measured = {st: FIXTURE["cases"][f"{precision}/stage{st}"]["peak_bytes"] for st in (0, 1)}
    predicted = {st: _predicted(precision, st) for st in (0, 1)}
    assert measured[1] > measured[0] and predicted[1] > predicted[0]
    # ZeRO-1's peak to the byte level of the tracker
    assert predicted[1] == pytest.approx(measured[1], rel=1e-3)


def test_one_rank_peaks_against_the_measurement():
    err = {k: _predicted(k.split("/")[0], int(k[-1])) / v["peak_bytes"] - 1 for k, v in FIXTURE["cases"].items()}
    assert abs(err["bf16/stage0"]) < 1e-3 and abs(err["bf16/stage1"]) < 1e-3 and abs(err["fp32/stage1"]) < 1e-3
    # fp32 stage 0 without a wrapper: the engine's zero_grad drops the gradients after the step
    # (see [Note: ZeRO-0 gradient lifetime]); zsim kept them and over-predicted by 8.9% until
    # the twelfth session
    assert abs(err["fp32/stage0"]) < 1e-3


def test_one_rank_runs_no_post_step_all_gather():
    """all_gather_into_tensor_dp_groups skips a data-parallel group of one rank
    (runtime/utils.py:1008-1015): the measured ZeRO-1 step has no all-gather, nor has zsim's."""
    from zsim.schedule.build import build_schedule
    for precision in ("bf16", "fp32"):
        measured = FIXTURE["cases"][f"{precision}/stage1"]["collectives"]
        assert not [c for c in measured if c[1] == "all_gather"]
        sc = load_scenario(str(ROOT / "benchmarks" / "validate_scenarios" / "small.yaml"),
                           ("deepspeed.zero_optimization.stage=1", f"training.precision={precision}",
                            "hardware.gpus_per_node=1"))
        _, schedule = build_schedule(sc)
        assert not [op for op in schedule.ops if op.comm and op.comm.collective.value == "all_gather"]
