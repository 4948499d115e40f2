"""See [Note: a grads_in_partition per backward], see [Note: autograd's gradient before the hook]:
ZeRO-2 with contiguous gradients, checked against the peaks DeepSpeed measured for every such
case of the random validations (tests/fixtures/measured/zero2_cg_peaks.json), and the rules
themselves on small schedules."""
import statistics

from tests.helpers import measured_cases, peak_error, scenario
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Buffer, OpKind
from zsim.schedule.partition import flat_group, in_rank_partition, params_in_partition_numel

Z = "deepspeed.zero_optimization."


def test_zero2_contiguous_peaks_against_deepspeed():
    """Before the two notes every case was under, -0.1% to -12.7% (the small fp32 ones at
    GAS >= 2 with 5e5-element buckets by 10-13%: the second grads_in_partition)."""
    errors = {c["case"]: peak_error(c) for c in measured_cases("zero2_cg_peaks.json")}
    assert len(errors) == 23
    assert all(abs(e) < 0.03 for e in errors.values()), errors     # issue 18's peak target
    assert statistics.median(abs(e) for e in errors.values()) < 0.005, errors


def test_params_in_partition_counts_straddling_params_whole():
    # params of 3, 5, 4 and 4 elements over 2 ranks: partitions [0, 8) and [8, 16); the
    # second param (elements 3-7) is inside rank 0's, the third (8-11) inside rank 1's
    numels = [3, 5, 4, 4]
    assert params_in_partition_numel(flat_group(range(4), numels, 2), numels) == [8, 8]
    # 3, 6, 3, 4: the second param (3-8) straddles the edge at 8 and counts on both ranks
    numels = [3, 6, 3, 4]
    g = flat_group(range(4), numels, 2)
    assert params_in_partition_numel(g, numels) == [9, 13]
    assert [in_rank_partition(g, numels, p, 1) for p in range(4)] == [False, True, True, True]
    # 10 elements over 4 ranks pad to 16 (partitions of 4): rank 3's partition is padding only
    numels = [5, 5]
    assert params_in_partition_numel(flat_group(range(2), numels, 4), numels) == [5, 10, 5, 0]


def _partition_ops(sched):
    alloc = [(a.tag.micro, op.micro_step) for op in sched.ops for a in op.alloc if a.tag.buffer == Buffer.GRAD_PARTITION]
    free = [(t.micro, op.micro_step) for op in sched.ops for t in op.free if t.buffer == Buffer.GRAD_PARTITION]
    return alloc, free


def test_stage2_allocates_a_partition_buffer_per_backward():
    sc = scenario(**{f"{Z}stage": 2, f"{Z}reduce_bucket_size": 5e5, "training.gradient_accumulation_steps": 3})
    alloc, free = _partition_ops(build_schedule(sc)[1])
    assert [m for _, m in alloc] == [0, 1, 2]
    # the previous buffer is freed within the next micro-step, the last one after the step
    assert sorted(free) == [(-1, 1), (1, 2), (2, 2)]


def test_stage1_keeps_one_partition_buffer():
    sc = scenario(**{f"{Z}stage": 1, f"{Z}overlap_comm": True, f"{Z}reduce_bucket_size": 5e5,
                     "training.gradient_accumulation_steps": 3})
    alloc, free = _partition_ops(build_schedule(sc)[1])
    assert len(alloc) == 1 and len(free) == 1


def test_fresh_gradient_lives_for_its_backward_op():
    sc = scenario(**{f"{Z}stage": 2, f"{Z}reduce_bucket_size": 5e5})
    wl, sched = build_schedule(sc)
    fresh = [(op, a) for op in sched.ops for a in op.alloc if a.tag.buffer == Buffer.GRAD_FRESH]
    assert fresh
    freed_by = {t: op for op in sched.ops for t in op.free}
    for op, a in fresh:
        # freed when the op ends (its hook copied it), or when the reduction its hook ran ends
        # (see [Note: a reduction inside the hook])
        end = freed_by[a.tag]
        assert end is op or (end.kind == OpKind.BUCKET_REDUCE and op.id in end.deps)
        module = next(m for m in wl.modules if m.name == op.payload.module)
        assert a.tag.key == module.name
        assert a.size_bytes == sum(wl.params[p].numel for p in module.params) * 2   # bf16 .grads
    assert sum(a.size_bytes for _, a in fresh) == 2 * sum(p.numel for p in wl.params)   # every param once


def test_gradient_over_the_bucket_waits_for_its_reduction():
    sc = scenario(**{f"{Z}stage": 2, f"{Z}reduce_bucket_size": 2e5})
    wl, sched = build_schedule(sc)
    large = {i for i, p in enumerate(wl.params) if p.numel > 2e5}
    assert large and len(large) < len(wl.params)
    held = [a.tag.key for op in sched.ops for a in op.alloc if a.tag.buffer == Buffer.GRAD_PENDING]
    fresh = [a.tag.key for op in sched.ops for a in op.alloc if a.tag.buffer == Buffer.GRAD_FRESH]
    assert set(held) == large and not large & set(fresh)


def test_a_reduction_run_by_a_hook_holds_the_module_backward_tensors():
    """See [Note: a reduction inside the hook]: without overlap_comm the reduction a gradient
    hook runs ends before the module's input gradient and fresh .grads are freed; with it (a GPU's
    reduction stream) they are freed when the module's backward ends."""
    def held(overlap):
        _, sched = build_schedule(scenario(**{f"{Z}stage": 2, f"{Z}reduce_bucket_size": 5e5,
                                              f"{Z}overlap_comm": overlap}))
        return [t.buffer for op in sched.ops if op.kind == OpKind.BUCKET_REDUCE for t in op.free
                if t.buffer in (Buffer.WORKSPACE, Buffer.GRAD_FRESH)]
    assert Buffer.WORKSPACE in held(False) and Buffer.GRAD_FRESH in held(False)
    assert held(True) == []
