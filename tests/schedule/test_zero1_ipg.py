"""See [Note: IPG buffer lifetime]: stage 2 drops the IPG buffer in the epilogue of every
backward, stage 1 (which DeepSpeed's engine reduces at the accumulation boundary alone) keeps it
from the first gradient hook of the step's first micro-step to the boundary's epilogue. The
peaks of every ZeRO-1 case with contiguous gradients and accumulation that DeepSpeed ran in the
random validations are checked (tests/fixtures/measured/zero1_ipg_peaks.json)."""
import statistics

import pytest

from tests.helpers import measured_cases, peak_error, scenario
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Buffer

Z = "deepspeed.zero_optimization."


def test_zero1_peaks_against_deepspeed():
    """With a buffer per backward (the previous rule) s590797542-06 (medium, bf16, GAS 2,
    overlap_comm, 1e7-element buckets: the peak at the second micro-step's loss backward) was
    7.1% under and four more 1.7-3.2% under; s63308492-14 stays 2.9% under (another mechanism)."""
    errors = {c["case"]: peak_error(c) for c in measured_cases("zero1_ipg_peaks.json")}
    assert len(errors) == 16
    assert all(abs(e) < 0.03 for e in errors.values()), errors
    assert statistics.median(abs(e) for e in errors.values()) < 0.001, errors
    assert abs(errors["s590797542-06"]) < 0.001


def _ipg_ops(sched):
    alloc = [(op.micro_step, op.phase) for op in sched.ops for a in op.alloc if a.tag.buffer == Buffer.IPG]
    free = [(op.micro_step, op.phase) for op in sched.ops for t in op.free if t.buffer == Buffer.IPG]
    return alloc, free


@pytest.mark.parametrize("overlap", [False, True])
def test_stage1_keeps_the_buffer_to_the_boundary(overlap):
    sc = scenario(**{f"{Z}stage": 1, f"{Z}overlap_comm": overlap, "training.gradient_accumulation_steps": 3})
    alloc, free = _ipg_ops(build_schedule(sc)[1])
    assert [m for m, _ in alloc] == [0]
    assert [m for m, _ in free] == [2]


def test_stage2_drops_the_buffer_after_every_backward():
    sc = scenario(**{f"{Z}stage": 2, "training.gradient_accumulation_steps": 3})
    alloc, free = _ipg_ops(build_schedule(sc)[1])
    assert [m for m, _ in alloc] == [0, 1, 2] and [m for m, _ in free] == [0, 1, 2]
