"""LoRA and frozen parameters on a DeepSpeed-MoE model: a ZeRO-1/2 flat group is dense or expert
(see [Note: MoE parameter groups]) and holds trainable params only
(see [Note: frozen parameters under ZeRO]); zsim/schedule/partition.py flat_groups is the one
home of both rules."""
from __future__ import annotations

import math

import pytest

from tests.helpers import scenario
from zsim.api import run_scenario
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Group, OpKind
from zsim.schedule.moe import moe_param_groups

MOE = {"model.moe": {"experts": 8, "top_k": 2, "capacity_factor": 1.25}, "model.glu": True, "parallelism.expert": 2}


def _comm(sched, kind):
    return [op.comm for op in sched.ops if op.kind == kind]


def _by_group(comms) -> dict:
    out: dict = {}
    for c in comms:
        key = c.group.kind if c.group else Group.DATA
        out[key] = out.get(key, 0) + c.numel
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_frozen_experts_are_in_no_flat_group(stage):
    # every rank's local expert 0 frozen: its weights stay whole, outside the expert group
    sc = scenario(**MOE, **{"training.frozen": ["experts.0"], "deepspeed.zero_optimization.stage": stage,
                            "deepspeed.zero_optimization.reduce_bucket_size": 5e8})
    wl, sched = build_schedule(sc)
    frozen = {pid for pid, p in enumerate(wl.params) if not p.trainable}
    assert frozen and all(wl.params[p].expert for p in frozen)
    groups = moe_param_groups(sc, wl, sc.cluster.world_size)
    assert [g.expert for g in groups] == [False, True]
    in_groups = {p for g in groups for p in g.pids}
    assert not in_groups & frozen and in_groups == set(range(len(wl.params))) - frozen
    experts = sum(p.numel for p in wl.params if p.expert and p.trainable)
    dense = sum(p.numel for p in wl.params if not p.expert)
    # the gradients reduced, each over its own group, are the trainable ones only
    assert _by_group(_comm(sched, OpKind.BUCKET_REDUCE)) == {Group.DATA: dense,
                                                             Group.EXPERT_DATA: experts}
    # the expert group (over world / ep = 4 ranks) is padded from the trainable experts only
    gathers = _comm(sched, OpKind.UPDATED_GATHER)
    assert gathers[1].group.kind == Group.EXPERT_DATA and gathers[1].numel == math.ceil(experts / 8) * 8
    r, _ = run_scenario(sc)
    assert r.trainable_params == dense + experts and r.moe.expert_parallel_size == 2


def test_all_experts_frozen_leave_the_dense_group_alone():
    sc = scenario(**MOE, **{"training.frozen": ["experts"], "deepspeed.zero_optimization.stage": 2})
    wl, sched = build_schedule(sc)
    groups = moe_param_groups(sc, wl, sc.cluster.world_size)
    assert len(groups) == 1 and not groups[0].expert
    assert all(c.group is None for c in _comm(sched, OpKind.BUCKET_REDUCE) + _comm(sched, OpKind.NORM_ALLREDUCE))
    # the experts still exchange tokens (forward and, for the gradient of the input, backward)
    assert len(_comm(sched, OpKind.EXPERT_ALL_TO_ALL)) == 4 * sc.model.layers


def test_lora_on_experts_adapters_are_dense_params_on_the_experts_rows():
    lora = {"training.lora": {"rank": 4, "target_modules": ["gate_proj"]}, "deepspeed.zero_optimization.stage": 2}
    sc = scenario(**MOE, **lora)
    wl, sched = build_schedule(sc)
    adapters = [m for m in wl.modules if ".lora_" in m.name]
    bases = {m.name: m for m in wl.modules}
    assert adapters and all(m.expert is not None for m in adapters)
    for m in adapters:
        base = bases[m.name.rsplit(".lora_", 1)[0] + ".base_layer"]
        assert m.expert == base.expert and m.gemm[0] == base.gemm[0]     # the expert's capacity rows
    # Experts marks only the params it was built with as MoE params: the adapters are dense
    trainable = [p for p in wl.params if p.trainable]
    assert trainable and not any(p.expert for p in trainable)
    groups = moe_param_groups(sc, wl, sc.cluster.world_size)
    assert len(groups) == 1 and {wl.params[p].name for p in groups[0].pids} == {p.name for p in trainable}
    # the exchanges still wrap every layer's experts, adapters included
    layer0 = [op for op in sched.ops if op.micro_step == 0 and op.phase.value == "forward"
              and (op.payload.layer == 0 if op.kind == OpKind.EXPERT_ALL_TO_ALL
                   else getattr(op.payload, "module", "").startswith("layers.0.mlp"))]
    names = ["<a2a>" if op.kind == OpKind.EXPERT_ALL_TO_ALL else op.payload.module for op in layer0]
    assert names.count("<a2a>") == 2
    first, last = names.index("<a2a>"), len(names) - 1 - names[::-1].index("<a2a>")
    assert all(".experts." in n for n in names[first + 1:last]) and any(".lora_" in n for n in names[first + 1:last])
    assert not any(".experts." in n for n in names[:first] + names[last + 1:])
    assert run_scenario(sc)[0].trainable_params == sum(p.numel for p in trainable)
