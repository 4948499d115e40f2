"""ZeRO-3 on one rank gathers nothing: a fetched parameter is a view of its partition, so
there is no all-gather, no flat buffer and no gathered copy, unless the partition is offloaded
and its `.to(device)` copies it to the GPU (see [Note: one-rank ZeRO-3 fetch]). On two ranks
the gathers are there as before."""

from tests.helpers import scenario
from zsim.api import run_scenario
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Category, Collective, OpKind

Z = "deepspeed.zero_optimization."


def _sc(gpus: int, offload: bool = False):
    over = {"hardware.gpus_per_node": gpus, f"{Z}stage": 3, f"{Z}stage3_param_persistence_threshold": 1e4}
    if offload:
        over[f"{Z}offload_param"] = {"device": "cpu"}
        over[f"{Z}offload_optimizer"] = {"device": "cpu"}
    return scenario(**over)


def _gathered_allocs(schedule):
    return [a for op in schedule.ops for a in op.alloc if a.category == Category.GATHERED]


def test_one_rank_issues_no_all_gather_and_holds_no_gathered_copy():
    _, schedule = build_schedule(_sc(1))
    assert not [op for op in schedule.ops if op.comm and op.comm.collective == Collective.ALL_GATHER]
    assert not [op for op in schedule.ops if op.kind in (OpKind.PARAM_GATHER, OpKind.PERSISTENT_GATHER)]
    assert not _gathered_allocs(schedule)
    result, _ = run_scenario(_sc(1))
    assert result.memory.breakdown.get("gathered params", 0.0) == 0.0
    assert result.memory.breakdown.get("persistent params", 0.0) == 0.0


def test_one_rank_offloaded_params_are_copied_to_the_gpu_and_freed():
    _, schedule = build_schedule(_sc(1, offload=True))
    fetches = [op for op in schedule.ops if op.kind == OpKind.PARAM_FETCH]
    assert fetches and not [op for op in schedule.ops if op.kind == OpKind.PARAM_GATHER]
    allocs = _gathered_allocs(schedule)
    assert allocs and all(op.alloc for op in fetches if op.stream.value == "h2d")
    result, _ = run_scenario(_sc(1, offload=True))
    assert result.memory.breakdown.get("gathered params", 0.0) > 0


def test_two_ranks_still_gather():
    _, schedule = build_schedule(_sc(2))
    assert [op for op in schedule.ops if op.kind == OpKind.PARAM_GATHER]
    assert _gathered_allocs(schedule)
