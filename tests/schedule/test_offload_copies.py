"""ZeRO-Offload (stages 1/2 with offload_optimizer) as DeepSpeed 0.19.8 runs it: see
[Note: ZeRO-Offload gradient copies]. The copies and the GPU passes around them run on the
stream the bucket was reduced on (the compute stream without overlap_comm), move 16-bit
running sums while accumulating and the fp32 cast at the boundary, and the step uploads the
16-bit partition."""
import pytest

from tests.helpers import scenario
from zsim.api import run_scenario
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import OpKind, Stream, Transfer

GAS = 3


def _sc(overlap: bool, precision: str = "bf16"):
    return scenario(**{"hardware.gpus_per_node": 1, "training.gradient_accumulation_steps": GAS,
                       "training.precision": precision, "deepspeed.zero_optimization.overlap_comm": overlap,
                       "deepspeed.zero_optimization.offload_optimizer": {"device": "cpu"}})


@pytest.mark.parametrize("overlap", [False, True])
def test_gradient_copies_run_on_the_reduction_stream_and_hold_the_backward_without_overlap(overlap):
    sc = _sc(overlap)
    result, trace = run_scenario(sc, steady=False)
    ops = trace.schedule.ops
    copies = [i for i, op in enumerate(ops) if op.kind == OpKind.GRAD_COPY]
    assert copies and {ops[i].stream for i in copies} == {Stream.COMPUTE if not overlap else Stream.REDUCE}
    if not overlap:
        # stream order: a backward issued after a copy starts once the copy is done
        for i in copies:
            later = [j for j in range(i + 1, len(ops)) if ops[j].kind == OpKind.BACKWARD
                     and ops[j].micro_step == ops[i].micro_step]
            if later:
                assert trace.timings[later[0]].start_s >= trace.timings[i].end_s
    # a copy is host traffic, not compute time
    busy = sum(t.end_s - t.start_s for op, t in zip(ops, trace.timings)
               if op.stream == Stream.COMPUTE and op.kind != OpKind.GRAD_COPY)
    assert result.compute_time_s <= busy + 1e-9


def test_bytes_of_each_micro_step_and_of_the_step():
    sc = _sc(False)
    _, schedule = build_schedule(sc)
    shard = sum(p.numel for p in _wl_params(sc))
    moved = {}
    for op in schedule.ops:
        if op.kind in (OpKind.GRAD_COPY, OpKind.PARAM_UPLOAD):
            key = (op.kind, op.micro_step, op.payload.transfer)
            moved[key] = moved.get(key, 0) + op.payload.size_bytes
    last = GAS - 1
    for micro in range(GAS):
        # the 16-bit running sum comes back after the first micro-step ...
        assert moved.get((OpKind.GRAD_COPY, micro, Transfer.H2D), 0) == (2 * shard if micro else 0)
        # ... and goes out again before the boundary, where the fp32 cast goes out instead
        assert moved[(OpKind.GRAD_COPY, micro, Transfer.D2H)] == (4 if micro == last else 2) * shard
    assert moved[(OpKind.PARAM_UPLOAD, last, Transfer.H2D)] == 2 * shard
    # the GPU's own passes: the add of a returning sum (3 x 2 bytes), and at the boundary the
    # fp64 norm (2 + 8 + 8), the overflow check's amax and amin (2 x 2) and the fp32 cast (2 + 4)
    gpu = {}
    for op in schedule.ops:
        if op.kind == OpKind.GRAD_NORM and op.phase.value == "backward":
            gpu[op.micro_step] = gpu.get(op.micro_step, 0) + op.work.mem_bytes
    assert 0 not in gpu
    assert gpu[1] == pytest.approx(6 * shard)
    assert gpu[last] == pytest.approx((6 + 18 + 4 + 6) * shard)


def test_the_step_sums_the_backwards_norms_without_a_pass_over_the_gradients():
    _, schedule = build_schedule(_sc(False))
    step_norm = [op for op in schedule.ops if op.kind == OpKind.GRAD_NORM and op.phase.value == "step"]
    assert len(step_norm) == 1 and step_norm[0].work.mem_bytes == 0


def test_without_overlap_the_copies_lengthen_the_step_by_their_time():
    off, _ = run_scenario(_sc(False), steady=False)
    on, _ = run_scenario(_sc(True), steady=False)
    assert off.step_time_s > on.step_time_s


def _wl_params(sc):
    from zsim.schedule.build import workload_for
    return workload_for(sc).params
