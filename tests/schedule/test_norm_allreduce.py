"""The step's scalar all-reduces as DeepSpeed 0.19.8 issued them (tests/fixtures/deepspeed): the
stage-0 fp32 clip norm (runtime/utils.py clip_grad_norm_), and each norm / overflow all-reduce's
bytes: uint8 overflow flag, fp32 norm at ZeRO-0/1/2, fp64 norm in ZeRO-3's device path."""
from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import fixture_names, load_fixture, scenario_for
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import OpKind

SCALAR = (OpKind.NORM_ALLREDUCE, OpKind.OVERFLOW_ALLREDUCE)


def _recorded_step_all_reduces(fx: dict) -> list[int]:
    last = max(c["opt_step"] for c in fx["collectives"] if c["opt_step"] is not None)
    return [c["nbytes"] for c in fx["collectives"]
            if c["opt_step"] == last and c["phase"] == "step" and c["op"] == "all_reduce"]


@pytest.mark.parametrize("name", fixture_names())
def test_scalar_all_reduce_bytes_match_deepspeed(name):
    fx = load_fixture(name)
    _, schedule = build_schedule(scenario_for(fx))
    assert [op.comm.size_bytes for op in schedule.ops if op.kind in SCALAR] == _recorded_step_all_reduces(fx)


def test_stage0_fp32_clip_norm_is_scheduled():
    fx = load_fixture("stage0_fp32_clip")
    assert _recorded_step_all_reduces(fx) == [4]
    sc = scenario_for(fx)
    _, schedule = build_schedule(sc)
    assert [op.kind for op in schedule.ops if op.kind in SCALAR] == [OpKind.NORM_ALLREDUCE]
    # without clipping engine.py:3506 skips clip_grad_norm_: no collective in the step
    _, plain = build_schedule(dataclasses.replace(sc, deepspeed=dataclasses.replace(sc.deepspeed,
                                                                                    gradient_clipping=0.0)))
    assert not [op for op in plain.ops if op.kind in SCALAR]


def test_zero3_norm_is_fp64_on_device():
    sc = scenario_for(load_fixture("stage3_clip"))
    _, schedule = build_schedule(sc)
    assert [op.comm.size_bytes for op in schedule.ops if op.kind == OpKind.NORM_ALLREDUCE] == [8]
