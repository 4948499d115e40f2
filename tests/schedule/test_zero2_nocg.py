"""See [Note: ZeRO-2 gradients without contiguous_gradients]: the grads of params touching this
rank's partition live from their first backward to the step, the others until their bucket's
reduction (the next one with overlap_comm), and each reduction flattens its bucket into a
transient copy."""
import pytest

from tests.helpers import scenario
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Buffer, Category, OpKind

Z = "deepspeed.zero_optimization."


def _schedule(overlap: bool, gas: int = 3):
    sc = scenario(**{"hardware.gpus_per_node": 2, f"{Z}stage": 2, f"{Z}contiguous_gradients": False,
                     f"{Z}overlap_comm": overlap, f"{Z}reduce_bucket_size": 2e6,
                     "training.gradient_accumulation_steps": gas})
    return build_schedule(sc)[1]


def _where(schedule):
    alloc, free = {}, {}
    for i, op in enumerate(schedule.ops):
        for a in op.alloc:
            alloc.setdefault(a.tag, []).append(i)
        for t in op.free:
            free.setdefault(t, []).append(i)
    return alloc, free


@pytest.mark.parametrize("overlap", [False, True])
def test_in_partition_grads_live_to_the_step_and_others_to_their_reduction(overlap):
    s = _schedule(overlap)
    alloc, free = _where(s)
    kept = [t for t in alloc if t.buffer == Buffer.GRAD_KEPT]
    others = [t for t in alloc if t.buffer == Buffer.GRAD_PENDING]
    flats = [t for t in alloc if t.buffer == Buffer.ALLREDUCE_FLAT]
    assert kept and others and flats
    step = [i for i, op in enumerate(s.ops) if op.kind == OpKind.OPTIMIZER_STEP][-1]
    for t in kept:   # allocated once in the window (autograd accumulates into it), freed at the step
        assert len(alloc[t]) == 1 and free[t] == [step]
        assert s.ops[alloc[t][0]].micro_step == 0
    reduces = [i for i, op in enumerate(s.ops) if op.kind == OpKind.BUCKET_REDUCE]
    for t in flats:   # the flat copy lives on its reduction alone
        assert alloc[t] == free[t] and alloc[t][0] in reduces
    for t in others:
        assert len(free[t]) == 1
        later = [r for r in reduces if r >= alloc[t][0]]
        # freed with the bucket's reduction, or with the next reduction (or the step) under overlap_comm
        if overlap:
            assert free[t][0] in later[1:] + [step]
        else:
            assert free[t][0] == later[0]
    # no partition buffer without contiguous gradients
    assert not [t for t in alloc if t.buffer == Buffer.GRAD_PARTITION]


def test_fresh_grads_beside_the_accumulator_live_to_each_epilogue():
    """The epilogue keeps the in-partition .grads as all_grad_tensors and leaves .grad None, so
    every later backward makes fresh ones until its own epilogue adds them in."""
    for gas in (1, 3):
        s = _schedule(False, gas=gas)
        alloc, free = _where(s)
        kept = {t.key for t in alloc if t.buffer == Buffer.GRAD_KEPT}
        copies = [t for t in alloc if t.buffer == Buffer.GRAD_ACCUM_COPY]
        # one fresh copy of every kept grad in each micro-step after the first
        assert sorted((t.micro, t.key) for t in copies) == sorted((m, k) for m in range(1, gas) for k in kept)
        for t in copies:
            (a,), (f,) = alloc[t], free[t]
            assert s.ops[a].micro_step == s.ops[f].micro_step == t.micro
            # freed with the micro-step's last reduction (its epilogue), before the next forward
            last = max(i for i, op in enumerate(s.ops) if op.kind == OpKind.BUCKET_REDUCE and op.micro_step == t.micro)
            assert f == last


def test_kept_grads_count_as_gradients():
    s = _schedule(False, gas=1)
    cats = {a.category for op in s.ops for a in op.alloc if a.tag.buffer == Buffer.GRAD_KEPT}
    assert cats == {Category.GRADIENTS}


def test_zero3_without_contiguous_gradients_holds_each_grad_until_its_reduce_scatter():
    """stage3.py copies a .grad into the IPG buffer only with contiguous_gradients: without it
    autograd's .grad is memory of its own until partition_grads drops it after the reduction."""
    for cg in (True, False):
        sc = scenario(**{"hardware.gpus_per_node": 2, f"{Z}stage": 3, f"{Z}contiguous_gradients": cg,
                         f"{Z}reduce_bucket_size": 2e6})
        s = build_schedule(sc)[1]
        alloc, free = _where(s)
        grads = [t for t in alloc if t.buffer == Buffer.GRAD_PENDING]
        assert bool(grads) == (not cg)
        for t in grads:
            assert s.ops[free[t][0]].kind == OpKind.BUCKET_REDUCE and free[t][0] > alloc[t][0]
