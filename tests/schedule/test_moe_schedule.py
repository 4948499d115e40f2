"""DeepSpeed-MoE in the schedule: the expert-parallel all-to-alls, the process groups they and
the gradient reductions run over (see [Note: MoE parameter groups]), ZeRO-3 leaf modules (see
[Note: ZeRO-3 leaf modules]), the parallelism block's rules and the result's MoE section."""
import math
import subprocess
import sys

import pytest

from tests.helpers import MOE, ROOT, scenario
from zsim.api import run_scenario
from zsim.errors import ZsimInputError
from zsim.hardware.collectives import Tier, all_to_all_cost, collective_cost
from zsim.hardware.placement import span
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Buffer, Collective, Group, OpKind, Phase
from zsim.schedule.moe import moe_param_groups
from zsim.schedule.partition import MOE_MAX_GROUP_NUMEL, flat_groups
from zsim.workload.moe import capacity

def moe_scenario(ep=2, **changes):
    return scenario(**{**MOE, "parallelism.expert": ep, **changes})


def comm_ops(sched, kind=None):
    return [op for op in sched.ops if op.comm is not None and (kind is None or op.kind == kind)]


def test_every_moe_layer_exchanges_tokens_around_its_experts_in_forward_and_mirrored_in_backward():
    sc = moe_scenario(ep=4)
    wl, sched = build_schedule(sc)
    ops = sched.ops
    a2a = [op for op in ops if op.kind == OpKind.EXPERT_ALL_TO_ALL]
    assert [(op.phase, op.payload.layer, op.payload.combine) for op in a2a] == [
        (Phase.FORWARD, 0, False), (Phase.FORWARD, 0, True), (Phase.FORWARD, 1, False), (Phase.FORWARD, 1, True),
        (Phase.BACKWARD, 1, True), (Phase.BACKWARD, 1, False), (Phase.BACKWARD, 0, True), (Phase.BACKWARD, 0, False)]
    # the dispatch sits between the layer's dispatch module and its first expert, the combine after the last
    names = [(op.kind, op.payload.module if op.kind == OpKind.FORWARD else None) for op in ops
             if op.phase == Phase.FORWARD and op.kind in (OpKind.FORWARD, OpKind.EXPERT_ALL_TO_ALL)]
    i = names.index((OpKind.EXPERT_ALL_TO_ALL, None))
    experts = [m.name for m in wl.layer_modules(0) if m.expert is not None]
    assert names[i - 1][1] == "layers.0.mlp.dispatch" and names[i + 1][1] == experts[0]
    assert names[i + 1 + len(experts)] == (OpKind.EXPERT_ALL_TO_ALL, None)
    # capacity buffer [experts, capacity, hidden] in the activation dtype, over the ep group
    comm = a2a[0].comm
    assert comm.collective == Collective.ALL_TO_ALL
    assert comm.numel == 8 * capacity(sc.model.moe, wl.tokens) * sc.model.hidden
    assert comm.size_bytes == comm.numel * 2
    assert (comm.group.kind, comm.group.size, comm.group.stride) == (Group.EXPERT, 4, 1)


def test_no_exchange_without_expert_parallelism_and_a_recompute_pair_under_checkpointing():
    _, sched = build_schedule(moe_scenario(ep=1))
    assert not [op for op in sched.ops if op.kind == OpKind.EXPERT_ALL_TO_ALL]
    _, sched = build_schedule(moe_scenario(ep=2, **{"training.activation_checkpointing": "full"}))
    phases = [op.phase for op in sched.ops if op.kind == OpKind.EXPERT_ALL_TO_ALL]
    assert phases.count(Phase.RECOMPUTE) == phases.count(Phase.FORWARD) == phases.count(Phase.BACKWARD) == 4


def test_without_drop_tokens_the_gate_agrees_on_the_capacity_over_the_expert_parallel_group():
    sc = moe_scenario(ep=2, **{"model.moe": dict(MOE["model.moe"], drop_tokens=False)})
    _, sched = build_schedule(sc)
    caps = [op for op in sched.ops if op.kind == OpKind.CAPACITY_ALLREDUCE]
    assert len(caps) == 2 and all(op.comm.group.kind == Group.EXPERT for op in caps)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_reduces_expert_gradients_over_the_expert_data_parallel_group(stage):
    sc = moe_scenario(ep=4, **{"deepspeed.zero_optimization.stage": stage,
                               "deepspeed.zero_optimization.reduce_bucket_size": 5e8})
    wl, sched = build_schedule(sc)
    reduces = comm_ops(sched, OpKind.BUCKET_REDUCE)
    dense = sum(p.numel for p in wl.params if not p.expert)
    experts = sum(p.numel for p in wl.params if p.expert)
    by_group = {}
    for op in reduces:
        key = op.comm.group.kind if op.comm.group else Group.DATA
        by_group[key] = by_group.get(key, 0) + op.comm.numel
    assert by_group == {Group.DATA: dense, Group.EXPERT_DATA: experts}
    edp = [op.comm.group for op in reduces if op.comm.group]
    assert {(g.size, g.stride) for g in edp} == {(2, 4)}      # 8 ranks / ep 4, strided by ep
    # one post-step all-gather per flat group, each over its own group, padded for its own ranks
    gathers = comm_ops(sched, OpKind.UPDATED_GATHER)
    assert [op.comm.group.kind if op.comm.group else None for op in gathers] == [None, Group.EXPERT_DATA]
    assert gathers[1].comm.numel == math.ceil(experts / 4) * 4
    # norms: one per group over the dp group, then the expert group's average over its own group
    norms = comm_ops(sched, OpKind.NORM_ALLREDUCE)
    assert [op.comm.group.kind if op.comm.group else None for op in norms] == [None, None, Group.EXPERT_DATA]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_zero12_steps_one_flat_group_at_a_time_freeing_its_temporaries(precision):
    # stage_1_and_2.py step: the flat 16-bit copy and the fp32 copy of one group's partition live
    # during that group's step only, so the peak holds the largest group's, not the sum
    sc = moe_scenario(ep=2, **{"deepspeed.zero_optimization.stage": 2, "training.precision": precision})
    wl, sched = build_schedule(sc)
    steps = [op for op in sched.ops if op.kind == OpKind.OPTIMIZER_STEP]
    groups = moe_param_groups(sc, wl, sc.data_parallel_size)
    assert [g.expert for g in groups] == [False, True]
    assert [op.payload.sub_group for op in steps] == [0, 1]
    assert [op.payload.shard_params for op in steps] == [g.partition for g in groups]
    assert groups[0].partition != groups[1].partition
    for op in steps:
        per_param = 4 + (2 if precision == "bf16" else 0)     # fp32 copy (+ the flat 16-bit copy)
        assert sum(a.size_bytes for a in op.alloc) == per_param * op.payload.shard_params
        assert {a.tag for a in op.alloc} <= set(op.free)
    # grads_in_partition is one buffer for every group: freed after the last group's step
    assert [Buffer.GRAD_PARTITION in {t.buffer for t in op.free} for op in steps] == [False, True]
    assert steps[1].deps == (steps[0].id,)


def test_stage0_allreduces_dense_then_expert_gradients():
    sc = moe_scenario(ep=2, **{"deepspeed.zero_optimization.stage": 0})
    wl, sched = build_schedule(sc)
    calls = comm_ops(sched, OpKind.GRAD_ALLREDUCE)
    assert [(op.comm.group.kind if op.comm.group else None, op.comm.numel) for op in calls] == [
        (None, sum(p.numel for p in wl.params if not p.expert)),
        (Group.EXPERT_DATA, sum(p.numel for p in wl.params if p.expert))]


def test_hugging_face_moe_is_a_dense_model_to_deepspeeds_engine():
    sc = scenario(**{"model.moe": {"experts": 4, "top_k": 2, "dispatch": "dropless"}})
    _, sched = build_schedule(sc)
    assert all(op.comm.group is None for op in comm_ops(sched))
    assert len(comm_ops(sched, OpKind.UPDATED_GATHER)) == 1


def test_moe_groups_split_at_deepspeeds_max_group_size():
    numels = [10, MOE_MAX_GROUP_NUMEL - 5, 4, 3, 2]
    groups = flat_groups(numels, [False, True, True, True, False], [True] * 5, world=8, expert_parallel_size=2)
    assert [(g.pids, g.ranks, g.expert) for g in groups] == [((0, 4), 8, False), ((1, 2), 4, True), ((3,), 4, True)]
    assert groups[1].starts == {1: 0, 2: MOE_MAX_GROUP_NUMEL - 5}


def _gathers(**changes):
    sc = scenario(**{"model.moe": {"experts": 4, "top_k": 2, "dispatch": "dropless"}, "model.glu": True,
                     "deepspeed.zero_optimization.stage": 3,
                     "deepspeed.zero_optimization.stage3_prefetch_bucket_size": 0,
                     "deepspeed.zero_optimization.stage3_param_persistence_threshold": 0}, **changes)
    _, sched = build_schedule(sc)
    return [op.payload for op in comm_ops(sched, OpKind.PARAM_GATHER) if op.phase == Phase.FORWARD]


V4 = {"training.experts_implementation": "modules"}
NOT_LEAF = {"training.z3_leaf_moe_block": False}


def test_zero3_leaf_moe_block_gathers_all_experts_at_once_else_per_expert_module():
    for layout in ({}, V4):
        leaf = [g.visit for g in _gathers(**layout)]
        assert leaf.count("layers.0.mlp") == 1 and not [v for v in leaf if ".experts" in v]
        block = next(g for g in _gathers(**layout) if g.visit == "layers.0.mlp")
        apart = [g for g in _gathers(**layout, **NOT_LEAF) if g.visit.startswith("layers.0.mlp.")]
        assert "layers.0.mlp.gate" in [g.visit for g in apart]
        assert block.comm.numel == sum(g.comm.numel for g in apart)
    # transformers 4: gate, up and down projection of each expert, each its own module's fetch
    experts = [g.visit for g in _gathers(**V4, **NOT_LEAF) if g.visit.startswith("layers.0.mlp.experts.")]
    assert len(experts) == 4 * 3
    # transformers 5: the experts module's own hooks fetch its two 3D parameters in one visit
    # (see [Note: transformers 5 MoE experts])
    experts5 = [g for g in _gathers(**NOT_LEAF) if g.visit.startswith("layers.0.mlp.experts")]
    assert [g.visit for g in experts5] == ["layers.0.mlp.experts"]
    # 4 experts' gate_up (2 x 1024 x 256) and down (256 x 1024) weights and their biases (2 x 1024, 256)
    assert experts5[0].comm.numel == 4 * (3 * 256 * 1024 + 2 * 1024 + 256)


def test_zero3_leaf_block_memory_balances_in_every_phase():
    # the ledger raises on a leaked or double-freed gathered param; checkpointing adds recompute visits
    sc = scenario(**{"model.moe": {"experts": 4, "top_k": 2, "dispatch": "dropless"},
                     "deepspeed.zero_optimization.stage": 3, "training.activation_checkpointing": "full",
                     "training.gradient_accumulation_steps": 2})
    assert run_scenario(sc, steady=False)[0].step_time_s > 0


def _refusal(**changes) -> str:
    with pytest.raises(ZsimInputError) as err:
        moe_scenario(**changes)
    return str(err.value)


def test_parallelism_rules_refuse_in_one_line():
    assert "divide the data-parallel size (8 = world / pipeline)" in _refusal(ep=3)
    # an MoE model under pipeline parallelism is not simulated: refused, not mis-simulated
    assert "not simulated" in _refusal(ep=1, **{"parallelism.pipeline": 2})
    assert "divide the experts" in _refusal(ep=8, **{"model.moe": {"experts": 4, "top_k": 2}})
    assert "needs an MoE model" in str(pytest.raises(ZsimInputError, scenario, **{"parallelism.expert": 2}).value)
    assert "DeepSpeed-MoE's" in _refusal(ep=2, **{"model.moe": {"experts": 8, "top_k": 2, "dispatch": "dropless"}})
    assert "ZeRO stage 3" in _refusal(ep=1, **{"deepspeed.zero_optimization.stage": 3})


def test_cli_refuses_bad_expert_parallel_size_with_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zsim.cli", "run", str(ROOT / "scenarios" / "default.yaml"),
                          "--set", "parallelism.expert=2"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1


def test_group_placement_and_all_to_all_tiers():
    assert span(0, 4, 1, 8) == (1, 4)        # ep group of 4 consecutive ranks: one node
    assert span(0, 16, 1, 8) == (2, 8)
    assert span(0, 4, 4, 8) == (2, 2)        # edp group strided by ep 4
    assert span(0, 2, 8, 8) == (2, 1)
    nvlink = Tier(400e9, 5e-6, ((1.0, 1.0),))
    ib = Tier(50e9, 10e-6, ((1.0, 1.0),))
    size = 1e9
    one_node = collective_cost("all_to_all", size, 1, 8, nvlink, ib)
    assert one_node.tier == "intra_node" and one_node.transfer_s == pytest.approx(size * 7 / 8 / 400e9)
    two_nodes = all_to_all_cost(size, 2, 8, nvlink, ib)
    # half of each rank's buffer leaves the node over its rail
    assert two_nodes.tier == "inter_node" and two_nodes.transfer_s == pytest.approx(size * 8 / 16 / 50e9)


def test_result_reports_moe_sizes_and_dense_json_has_no_moe_key():
    r, _ = run_scenario(moe_scenario(ep=4))
    assert r.moe.expert_parallel_size == 4 and r.moe.experts == 8
    assert r.moe.total_params > r.n_params > r.moe.active_params - r.moe.rank_expert_params
    assert r.n_params - r.moe.rank_expert_params == r.moe.total_params - 4 * r.moe.rank_expert_params
    assert "moe" in r.to_dict()
    assert "moe" not in run_scenario(scenario())[0].to_dict()
    assert r.comm.calls["all_to_all"] == 2 * 4


def test_expert_parallel_group_across_nodes_is_charged_on_the_network():
    def a2a_time(nodes, ep):
        sc = moe_scenario(ep=ep, **{"hardware.nodes": nodes, "model.moe": {"experts": 16, "top_k": 2}})
        return run_scenario(sc)[0].comm.time_s["all_to_all"]
    assert a2a_time(2, 16) > a2a_time(2, 8)


@pytest.mark.parametrize("changes", [
    {"training.gradient_accumulation_steps": 4},
    {"training.gradient_accumulation_steps": 3, "training.activation_checkpointing": "full"}])
def test_steady_state_reuse_is_exact_with_expert_parallelism(changes):
    sc = moe_scenario(ep=4, **changes)
    steady, _ = run_scenario(sc)
    full, _ = run_scenario(sc, steady=False)
    assert steady.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert steady.memory.peak_bytes == full.memory.peak_bytes and steady.comm.calls == full.comm.calls
