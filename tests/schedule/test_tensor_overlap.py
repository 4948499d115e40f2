"""The column-parallel linear's backward overlaps its tensor-parallel collectives with its GEMMs
(see [Note: tensor-parallel backward overlap]): Megatron's LinearWithGradAccumulationAndAsync
Communication, with and without sequence parallelism."""
from dataclasses import replace

import pytest

from tests.helpers import scenario
from zsim.api import run_scenario
from zsim.report.writers import chrome_trace
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import OpKind, Phase, Stream
from zsim.schedule.payloads import ModulePass, TensorComm
from zsim.schedule.tensor import TensorCollectives

# a layer big enough for its GEMMs to outlast its collectives (TP8 inside one DGX A100)
BIG = {"model.layers": 2, "model.hidden": 6144, "model.heads": 64, "model.seq_len": 2048,
       "training.seq_len": 2048, "training.micro_batch_size": 1, "parallelism.tensor": 8,
       "deepspeed.zero_optimization.stage": 1}
COLUMN = ("layers.1.attn.qkv", "layers.1.mlp.fc_in")


def _big(sp: bool):
    return scenario(**BIG, **{"parallelism.sequence_parallel": sp})


@pytest.fixture
def blocking(monkeypatch):
    """Build schedules as before the overlap: every column-parallel backward collective blocking."""
    def use():
        monkeypatch.setattr(TensorCollectives, "overlaps_backward", lambda self, module: False)
    return use


def _ops(trace, module, phase=Phase.BACKWARD):
    return [(op, t) for op, t in zip(trace.schedule.ops, trace.timings)
            if getattr(op.payload, "module", None) == module and op.phase == phase]


def _dur(t) -> float:
    return t.end_s - t.start_s


def _side_by_side(a, b) -> bool:
    """Two ops that start together and overlap for the shorter one's length."""
    return a.start_s == pytest.approx(b.start_s) and \
        min(a.end_s, b.end_s) - max(a.start_s, b.start_s) == pytest.approx(min(_dur(a), _dur(b)))


def _tp_calls(sched):
    return [(op.phase, op.kind, op.comm.numel, op.comm.size_bytes) for op in sched.ops
            if isinstance(op.payload, TensorComm)]


@pytest.mark.parametrize("sp", [True, False])
def test_collectives_run_beside_the_gemms_on_the_tensor_stream(sp):
    _, trace = run_scenario(_big(sp))
    for module in COLUMN:
        ops = _ops(trace, module)
        comm = [(op, t) for op, t in ops if isinstance(op.payload, TensorComm)]
        gemm = [(op, t) for op, t in ops if op.kind == OpKind.BACKWARD]
        assert [op.payload.part for op, _ in gemm] == ["dgrad", "wgrad"]
        (dgrad, t_dgrad), (wgrad, t_wgrad) = gemm
        assert all(op.stream == Stream.TENSOR for op, _ in comm)
        if sp:   # the re-gather beside the dgrad, the reduce-scatter beside the wgrad
            assert [op.kind for op, _ in comm] == [OpKind.TP_ALL_GATHER, OpKind.TP_REDUCE_SCATTER]
            (gather, t_gather), (reduce, t_reduce) = comm
            assert gather.id not in dgrad.deps and gather.id in wgrad.deps
            assert _side_by_side(t_gather, t_dgrad)
        else:    # allreduce_dgrad: the input gradient's all-reduce beside the wgrad
            assert [op.kind for op, _ in comm] == [OpKind.TP_ALL_REDUCE]
            (reduce, t_reduce), = comm
        assert dgrad.id in reduce.deps and reduce.id not in wgrad.deps
        assert _side_by_side(t_reduce, t_wgrad)
        # the module before it in forward waits for its input gradient
        nxt = next(op for op in trace.schedule.ops if op.id > wgrad.id and op.kind == OpKind.BACKWARD)
        assert reduce.id in nxt.deps


@pytest.mark.parametrize("sp", [True, False])
def test_calls_and_bytes_are_the_blocking_schedules(sp, blocking):
    sc = _big(sp)
    result, _ = run_scenario(sc)
    calls = _tp_calls(build_schedule(sc)[1])
    blocking()
    before, _ = run_scenario(sc)
    assert calls == _tp_calls(build_schedule(sc)[1])     # same calls, same order, same bytes
    assert result.comm.calls == before.comm.calls and result.comm.bytes_per_gpu == before.comm.bytes_per_gpu
    assert result.memory.peak_bytes == before.memory.peak_bytes
    assert result.step_time_s < before.step_time_s


@pytest.mark.parametrize("sp", [True, False])
def test_a_layers_backward_no_longer_pays_them_serially(sp, blocking):
    """Each column-parallel linear's backward spans the longer of each GEMM and the collective
    beside it, not GEMMs + collectives (with these shapes each GEMM outlasts its collective)."""
    _, trace = run_scenario(_big(sp))
    blocking()
    _, serial = run_scenario(_big(sp))
    for module in COLUMN:
        ops = _ops(trace, module)
        span = max(t.end_s for _, t in ops) - min(t.start_s for _, t in ops)
        gemms = [_dur(t) for op, t in ops if op.kind == OpKind.BACKWARD]
        comms = [_dur(t) for op, t in ops if isinstance(op.payload, TensorComm)]
        assert all(c < min(gemms) for c in comms)
        assert span == pytest.approx(sum(gemms))
        serial_ops = _ops(serial, module)
        serial_span = max(t.end_s for _, t in serial_ops) - min(t.start_s for _, t in serial_ops)
        assert serial_span == pytest.approx(sum(_dur(t) for _, t in serial_ops))
        # hidden, but for the GEMMs' slowdown while a collective runs (the profile's interference)
        assert span < serial_span - 0.8 * sum(comms)


def test_chrome_trace_shows_the_collective_on_its_own_thread_beside_the_gemm():
    _, trace = run_scenario(_big(True))
    events = chrome_trace(trace, "overlap")["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    gather = next(e for e in events if e.get("name") == "tp all-gather layers.1.attn.qkv"
                  and e["args"]["phase"] == "backward")
    dgrad = next(e for e in events if e.get("name") == "backward layers.1.attn.qkv (dgrad)")
    assert threads[gather["tid"]] == "tensor stream" and threads[dgrad["tid"]] == "compute stream"
    assert gather["ts"] == dgrad["ts"] and gather["dur"] < dgrad["dur"]


def test_a_linear_without_both_gemms_keeps_the_blocking_calls():
    """LinearWithFrozenWeight all-reduces its input gradient synchronously: no wgrad to hide it."""
    sc = _big(False)
    wl, sched = build_schedule(sc)
    tensor = TensorCollectives(sc.parallelism, wl, sc.precision)
    qkv = next(m for m in wl.modules if m.name == COLUMN[0])
    assert tensor.overlaps_backward(qkv)
    assert not tensor.overlaps_backward(replace(qkv, weight_grad=False))
    assert not tensor.overlaps_backward(replace(qkv, input_grad=False))
    assert not any(isinstance(op.payload, ModulePass) and op.payload.part
                   for op in build_schedule(scenario(**{**BIG, "parallelism.tensor": 1}))[1].ops)


@pytest.mark.parametrize("sp", [False, True])
def test_the_split_backward_adds_into_accumulated_grads_once(sp, blocking):
    """From the second micro-step ZeRO-1 adds each new gradient into the .grad kept from the first
    (see [Note: gradient accumulation add]): the split backward charges that add with its wgrad
    alone, so the step adds the same bytes as the blocking schedule's whole passes (it charged
    it with the dgrad as well)."""
    sc = scenario(**BIG, **{"parallelism.sequence_parallel": sp, "training.gradient_accumulation_steps": 2})

    def added(schedule):
        return sum(op.work.accumulate_bytes for op in schedule.ops
                   if op.micro_step == 1 and op.kind == OpKind.BACKWARD and op.work is not None)
    _, split = build_schedule(sc)
    blocking()
    _, whole = build_schedule(sc)
    assert any(op.payload.part == "dgrad" for op in split.ops if isinstance(op.payload, ModulePass))
    assert added(whole) > 0 and added(split) == added(whole)
