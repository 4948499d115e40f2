"""16-bit reductions priced on their own calibrated tables (see [Note: 16-bit reductions on the
host]): the calls that sum carry their dtype, the cost model picks the table, calibration times
and fits it."""
from __future__ import annotations

import pytest

from tests.helpers import SIZES, coll_records
from tests.helpers import scenario
from zsim.hardware.collectives import Tier, collective_cost, ring_cost
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Collective

ZERO = "deepspeed.zero_optimization"
FP32_TABLE = ((1024, 0.05), (1 << 24, 1.0))
BF16_TABLE = ((1024, 0.04), (1 << 24, 0.5))   # slower than fp32, its times rising with size


def _tier() -> Tier:
    return Tier(4e9, 30e-6, FP32_TABLE, (("all_reduce", FP32_TABLE), ("all_reduce_bf16", BF16_TABLE),
                                         ("all_gather", FP32_TABLE)))


def test_a_16bit_reduction_uses_its_table_and_nothing_else_does():
    t = _tier()
    size = float(1 << 24)
    fp32 = collective_cost("all_reduce", size, 1, 2, t, t, dtype="fp32")
    bf16 = collective_cost("all_reduce", size, 1, 2, t, t, dtype="bf16")
    assert fp32.transfer_s == pytest.approx(size / 4e9)            # bus factor 1 at 2 ranks, efficiency 1
    assert bf16.transfer_s == pytest.approx(size / (0.5 * 4e9))
    assert collective_cost("all_reduce", size, 1, 2, t, t).time_s == fp32.time_s   # no dtype: the base table
    # a copy sums nothing: an all-gather of bf16 elements is priced as any other
    assert (collective_cost("all_gather", size, 1, 2, t, t, dtype="bf16").time_s
            == collective_cost("all_gather", size, 1, 2, t, t).time_s)
    # fp16 without its own table falls back to the base
    assert collective_cost("all_reduce", size, 1, 2, t, t, dtype="fp16").time_s == fp32.time_s


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("changes,dtype", [
    ({}, "bf16"),
    ({"deepspeed.communication_data_type": "fp32"}, "fp32"),
    ({"training.precision": "fp32"}, "fp32"),
])
def test_gradient_reductions_sum_in_the_reduction_dtype(stage, changes, dtype):
    sc = scenario(**{f"{ZERO}.stage": stage, "training.gradient_accumulation_steps": 2}, **changes)
    _, schedule = build_schedule(sc)
    reductions = [op.comm for op in schedule.ops if op.comm is not None and op.comm.numel > 1
                  and op.comm.collective in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER)]
    assert reductions and {c.dtype for c in reductions} == {dtype}


def test_tensor_parallel_activation_reductions_sum_in_the_training_precision():
    sc = scenario(**{"parallelism.tensor": 2, f"{ZERO}.stage": 1})
    _, schedule = build_schedule(sc)
    dtypes = {op.comm.dtype for op in schedule.ops if op.comm is not None and op.comm.numel > 1
              and op.comm.collective == Collective.ALL_REDUCE and op.comm.group is not None
              and op.comm.group.kind.value == "tensor"}
    assert "bf16" in dtypes


def test_calibration_fits_the_16bit_tables_against_the_fp32_tier():
    """Records timed as zsim prices them on a known tier (fp32 base, slower bf16 reductions) give
    back tables that reproduce every bf16 time."""
    from calibration.harness.fit_comm import fit_collectives, fit_reductions_16bit

    truth = _tier()
    recs = coll_records(truth, ops=("all_gather", "all_reduce"))
    recs += [{"kind": "collective", "op": "all_reduce", "group": "world", "tier": "intra_node", "ranks": 2,
              "dtype": "bf16", "size_bytes": s,
              "time_s": ring_cost("all_reduce", s, 2, truth, "intra_node", dtype="bf16").time_s} for s in SIZES]
    fit = fit_collectives(recs, "fp32")
    fit_reductions_16bit(recs, fit, "bf16")
    t = fit["intra_node"]
    assert set(t["efficiency_by_collective"]) == {"all_gather", "all_reduce", "all_reduce_bf16"}
    tier = Tier(t["busbw_GBps"] * 1e9, t["latency_us"] * 1e-6, ((1.0, 1.0),),
                tuple((k, tuple(map(tuple, v))) for k, v in t["efficiency_by_collective"].items()))
    for r in recs:
        assert (collective_cost(r["op"], r["size_bytes"], 1, 2, tier, tier, dtype=r["dtype"]).time_s
                == pytest.approx(r["time_s"], rel=1e-9))


def test_quick_plan_times_the_reductions_again_in_each_16bit_dtype():
    from calibration.harness.plan import default_plan, items
    from zsim.specs.hardware import REDUCING_COLLECTIVES

    names = items(default_plan("quick", dtypes=("fp32", "bf16")), 2, 1)
    bf16 = {n.split("/")[1] for n in names if n.startswith("collective/") and n.split("/")[3] == "bf16"}
    fp32 = {n.split("/")[1] for n in names if n.startswith("collective/") and n.split("/")[3] == "fp32"}
    assert bf16 == set(REDUCING_COLLECTIVES) and set(REDUCING_COLLECTIVES) < fp32
    # an fp32-only calibration times fp32 alone
    assert not any("/bf16/" in n for n in items(default_plan("quick", dtypes=("fp32",)), 2, 1))
