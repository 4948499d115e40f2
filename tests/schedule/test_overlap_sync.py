"""overlap_comm's device synchronize after each backward (stage_1_and_2.py:1026-1028,
independent_gradient_partition_epilogue): the next micro-step's forward waits for the last
reduction; without overlap_comm the reductions run on the compute stream and nothing extra waits."""
from __future__ import annotations

import dataclasses

from tests.helpers import load_fixture, scenario_for
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import OpKind


def _first_forward_of_micro1_waits_on_reduction(overlap: bool) -> bool:
    sc = scenario_for(load_fixture("stage2_gas2"))
    sc = dataclasses.replace(sc, deepspeed=dataclasses.replace(
        sc.deepspeed, zero_optimization=dataclasses.replace(sc.deepspeed.zero_optimization, overlap_comm=overlap)))
    _, schedule = build_schedule(sc)
    by_id = {op.id: op for op in schedule.ops}
    first = next(op for op in schedule.ops if op.kind == OpKind.FORWARD and op.micro_step == 1)
    return any(by_id[d].kind == OpKind.BUCKET_REDUCE and by_id[d].micro_step == 0 for d in first.deps)


def test_overlap_comm_next_forward_waits_for_the_reduction_stream():
    assert _first_forward_of_micro1_waits_on_reduction(True)
    assert not _first_forward_of_micro1_waits_on_reduction(False)
