"""deepspeed.communication_data_type: the dtype, hence the bytes, of every gradient reduction.

DeepSpeed 0.19.8 (engine.py:1719-1730 communication_data_type) reduces in the configured dtype,
else fp16 with fp16 weights, bf16 with bf16, fp32 otherwise, at every stage: stage 0 and
BF16_Optimizer through engine.allreduce_bucket (engine.py:3800 casts the flat bucket), ZeRO-1/2
through allreduce_bucket (stage_1_and_2.py:2376), ZeRO-3 through an IPG buffer allocated in that
dtype (stage3.py:780-784) and __avg_scatter_grads (stage3.py:1919). Parameter all-gathers stay in
the model dtype. Sequence-parallel and ZeRO++ variants (which force fp32 or quantize) are not
modelled. The fixtures *_comm_fp32 are real DeepSpeed runs on CPU/gloo with bf16 weights and
communication_data_type fp32."""
import pytest

from tests.helpers import fixture_names, load_fixture, scenario_for
from tests.helpers import scenario
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import MEASURED_PASS, Collective, OpKind
from zsim.schedule.payloads import GradReduce
from zsim.workload.module import DTYPE_BYTES

REDUCTIONS = (OpKind.BUCKET_REDUCE, OpKind.GRAD_ALLREDUCE)


def _steady(fx: dict) -> list[tuple[str, str, int, int, str]]:
    """(phase, op, numel, nbytes, dtype) of the last optimizer step's collectives."""
    last = max(c["opt_step"] for c in fx["collectives"] if c["opt_step"] is not None)
    return [(c["phase"], c["op"], c["numel"], c["nbytes"], c["dtype"]) for c in fx["collectives"]
            if c["opt_step"] == last and c["phase"] != "init" and "zero/utils.py" not in c.get("caller", "")]


def _sc(stage: int, precision: str, comm: str | None):
    changes = {"deepspeed.zero_optimization.stage": stage, "training.precision": precision,
               "hardware.gpus_per_node": 2}
    if comm is not None:
        changes["deepspeed.communication_data_type"] = comm
    return scenario(**changes)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("comm", [None, "fp32", "BF16", "fp16"])
def test_reductions_move_the_communication_dtype_all_gathers_the_model_dtype(stage, precision, comm):
    sc = _sc(stage, precision, comm)
    # DeepSpeed's default: the model's dtype (engine.py:1724-1730); any case accepted (runtime/config.py)
    assert sc.deepspeed.reduction_dtype == (comm.lower() if comm else precision)
    width = DTYPE_BYTES[sc.deepspeed.reduction_dtype]
    _, schedule = build_schedule(sc)
    reductions = [op.comm for op in schedule.ops if op.kind in REDUCTIONS]
    gathers = [op.comm for op in schedule.ops if op.comm and op.comm.collective == Collective.ALL_GATHER]
    assert reductions and all(c.size_bytes == c.numel * width for c in reductions)
    assert all(c.size_bytes == c.numel * DTYPE_BYTES[precision] for c in gathers)


def test_fp32_reduction_of_bf16_weights_doubles_the_reduced_bytes_and_the_zero3_ipg_buffer():
    for stage in (0, 1, 2, 3):
        base, fp32 = _sc(stage, "bf16", None), _sc(stage, "bf16", "fp32")
        (_, sb), (_, sf) = build_schedule(base), build_schedule(fp32)
        rb = sum(op.comm.size_bytes for op in sb.ops if op.kind in REDUCTIONS)
        rf = sum(op.comm.size_bytes for op in sf.ops if op.kind in REDUCTIONS)
        assert rf == 2 * rb
        # ZeRO-3's one IPG buffer holds reduce_bucket_size elements of the communication dtype
        # (stage3.py:780-784); ZeRO-1/2's stays in the model dtype (stage_1_and_2.py:3266, 1254)
        grow = sum(a.size_bytes for a in sf.static) - sum(a.size_bytes for a in sb.static)
        assert grow == (2 * base.zero.reduce_bucket_size if stage == 3 else 0)


@pytest.mark.parametrize("name", fixture_names())
def test_bytes_and_dtype_of_every_call_equal_deepspeeds(name):
    """Call for call, the bytes zsim moves equal what DeepSpeed moved (the scalar all-reduces
    aside: ZeRO-3 all-reduces its norm in fp64, 8 bytes, where zsim charges 4)."""
    fx = load_fixture(name)
    recorded = _steady(fx)
    _, schedule = build_schedule(scenario_for(fx))
    sim = [(MEASURED_PASS[op.phase], op.comm.collective.value, op.comm.numel, op.comm.size_bytes)
           for op in schedule.ops if op.comm]
    assert [r[:3] for r in recorded] == [s[:3] for s in sim]
    assert [r[3] for r in recorded if r[2] > 1] == [s[3] for s in sim if s[2] > 1]
    comm = fx["ds_config"].get("communication_data_type")
    if comm is not None:
        grads = [(r, op) for r, op in zip(recorded, [op for op in schedule.ops if op.comm])
                 if isinstance(op.payload, GradReduce)]
        assert grads and {r[4] for r, _ in grads} == {"float32"}
        assert all(r[3] == 4 * r[2] for r, _ in grads)
