"""The unfused loss's time by dtype (see [Note: HF loss memory]): the upcast and its cast back run
in the precision's kernels (not at all with fp32 logits), log_softmax and its backward in fp32."""
from __future__ import annotations

import pytest

from tests.helpers import scenario
from zsim.hardware.compute import memory_bound_time_s
from zsim.hardware.cost_model import CostModel
from zsim.schedule.build import build_schedule, workload_for
from zsim.schedule.ir import OpKind


def _loss(sc):
    return next(m for m in workload_for(sc).modules if m.name == "loss")


@pytest.mark.parametrize("precision,cast", [("bf16", 6.0), ("fp16", 6.0), ("fp32", 0.0)])
def test_the_cast_runs_in_the_precision_and_the_rest_in_fp32(precision, cast):
    sc = scenario(**{"training.precision": precision})
    loss = _loss(sc)
    logits = workload_for(sc).tokens * sc.model.vocab
    assert (loss.fwd_mem_bytes, loss.bwd_mem_bytes) == (cast * logits, cast * logits)
    assert (loss.fp32_fwd_mem_bytes, loss.fp32_bwd_mem_bytes) == (8.0 * logits, 20.0 * logits)
    # the 16-bit totals are the memory note's (a + 12 forward, 24 + a backward per logit)
    if precision != "fp32":
        assert loss.fwd_mem_bytes + loss.fp32_fwd_mem_bytes == 14.0 * logits
        assert loss.bwd_mem_bytes + loss.fp32_bwd_mem_bytes == 26.0 * logits


def test_the_fp32_part_is_priced_at_fp32s_memory_bound_rate():
    """A profile whose bf16 elementwise kernels are 4x slower than its fp32 ones (an emulated
    dtype) prices the bf16 run's loss forward as cast at the bf16 rate plus log_softmax at fp32's."""
    sc = scenario(**{"training.precision": "bf16",
                     "hardware.override": {"gpu": {"memory_bound_efficiency": 0.8,
                                                   "by_dtype": {"bf16": {"memory_bound_efficiency": 0.2}}}}})
    _, schedule = build_schedule(sc)
    op = next(o for o in schedule.ops if o.kind == OpKind.FORWARD and o.payload.module == "loss")
    cost = CostModel(sc.cluster, sc.precision, sc.zero.stage, schedule.host)
    gpu = sc.cluster.profile.gpu
    loss = _loss(sc)
    expected = (memory_bound_time_s(loss.fwd_mem_bytes, gpu.for_dtype("bf16"))
                + memory_bound_time_s(loss.fp32_fwd_mem_bytes, gpu.for_dtype("fp32")))
    assert gpu.for_dtype("fp32").memory_bound_efficiency == 0.8
    assert cost.compute_work_s(op.payload.work) == pytest.approx(expected, rel=1e-12)
