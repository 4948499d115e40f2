"""See [Note: IPG buffer first touch]: a ZeRO-1/2 IPG buffer is reduce_bucket_size elements in the
ledger, but only the pages its buckets write are faulted in (stage_1_and_2.py setup_buckets,
reduce_independent_p_g_buckets_and_remove_grads)."""
import pytest

from tests.helpers import scenario
from zsim.api import run_scenario
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Buffer, OpKind

Z = "deepspeed.zero_optimization."
FRESH = {"hardware.override": {"gpu": {"fresh_alloc_threshold_bytes": 32e6, "fresh_alloc_GBps": 2.0}}}


def _expected_touched(sched, numels, micro: int, buffers: int, rbs: float, param_bytes: int) -> float:
    # from the schedule's own bucket reductions: bucket k of a backward is written to buffer
    # k % buffers, up to its gradients' elements (one over reduce_bucket_size bypasses the buffer)
    pids = {}
    for op in sched.ops:
        if op.kind == OpKind.BUCKET_REDUCE and op.micro_step == micro:
            pids.setdefault(op.payload.bucket, op.payload.pids)
    fills = [sum(numels[p] for p in ps if numels[p] <= rbs) for _, ps in sorted(pids.items())]
    return sum(max(fills[i::buffers], default=0) for i in range(buffers)) * param_bytes


@pytest.mark.parametrize("overlap,rbs,gas", [(False, 5e8, 1), (True, 5e8, 2), (False, 2e5, 2), (True, 1.5e5, 3)])
def test_ipg_buffer_touches_what_its_buckets_fill(overlap, rbs, gas):
    sc = scenario(**{f"{Z}stage": 2, f"{Z}contiguous_gradients": True, f"{Z}overlap_comm": overlap,
                     f"{Z}reduce_bucket_size": rbs, "training.gradient_accumulation_steps": gas,
                     "training.precision": "bf16"})
    wl, sched = build_schedule(sc)
    numels = [p.numel for p in wl.params]
    allocs = [(op, a) for op in sched.ops for a in op.alloc if a.tag.buffer == Buffer.IPG]
    buffers = 2 if overlap else 1
    assert len(allocs) == gas                         # one IPG allocation per backward
    for op, a in allocs:
        assert a.size_bytes == buffers * rbs * 2      # the ledger holds the whole buffer
        assert 0 < a.touched_bytes == _expected_touched(sched, numels, op.micro_step, buffers, rbs, 2) <= a.size_bytes
    if rbs >= sum(numels):
        # one bucket holds every gradient: buffer 0 is written over the model's size, buffer 1 never
        assert allocs[0][1].touched_bytes == sum(numels) * 2


def test_a_bucket_larger_than_the_model_costs_no_more_first_touch():
    # 5e8 and 5e9 elements both exceed the tiny model: the same pages are written, so the same
    # step time, while the ledger's peak holds the full buffer
    runs = {}
    for rbs in (5e8, 5e9):
        sc = scenario(**{f"{Z}stage": 2, f"{Z}contiguous_gradients": True, f"{Z}reduce_bucket_size": rbs, **FRESH})
        runs[rbs] = run_scenario(sc)[0]
    assert runs[5e8].step_time_s == runs[5e9].step_time_s
    assert runs[5e9].memory.peak_bytes - runs[5e8].memory.peak_bytes == pytest.approx(4.5e9 * 2)
