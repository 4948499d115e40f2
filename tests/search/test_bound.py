"""The step-time lower bound `zsim tune` skips configurations with (zsim/search/bound.py; see
[Note: step-time lower bound]): below every simulated step, equal to the compute the schedule
charges, and a search that uses it keeps the ranking it bounds exact."""
from __future__ import annotations

import random

import pytest

from tests.helpers import ROOT, mapping, scenario
from zsim.api import run_scenario
from zsim.hardware.compute import kernel_overhead_s
from zsim.hardware.host import hook_visit_us, hook_visits_time_s, rank_views_time_s
from zsim.hardware.cost_model import CostModel
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import OpKind, Phase, Stream
from zsim.schedule.moe import moe_blocks_are_leaves, zero3_leaves
from zsim.search.bound import scenario_step_time_bound_s, step_time_lower_bound_s, zero3_hooks_s
from zsim.search.tune import score, tune
from zsim.search.variants import Base

LLAMA = {"model.layers": 6, "model.hidden": 512, "model.heads": 8, "model.kv_heads": 4, "model.glu": True,
         "model.norm": "rmsnorm", "model.position": "rope", "model.bias": False, "model.fused_qkv": False}
MOE = {"model.layers": 4, "model.moe": {"experts": 4, "top_k": 2}}
LORA = {**LLAMA, "training.lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}}


def _draw(rng: random.Random) -> dict:
    """One configuration of the space tune searches (and a few it does not: interleaving, MoE)."""
    kw = dict(rng.choice([{}, LLAMA, MOE, LORA]))
    kw["hardware.profile"] = rng.choice(["dgx-a100-80g", "dgx-h100"])
    kw["hardware.nodes"] = rng.choice([1, 2])
    kw["training.micro_batch_size"] = rng.choice([1, 2, 4])
    kw["training.gradient_accumulation_steps"] = rng.choice([1, 2, 3, 8])
    kw["training.activation_checkpointing"] = rng.choice(["none", "selective", "full"])
    kw["training.flash_attention"] = rng.choice([True, False])
    kw["training.precision"] = rng.choice(["bf16", "fp16"])
    moe, lora = "model.moe" in kw, "training.lora" in kw
    pipeline = 1 if moe or lora else rng.choice([1, 1, 2])
    tensor = 1 if moe or lora else rng.choice([1, 2])
    stage = rng.choice([0, 1]) if pipeline > 1 else rng.choice([0, 1, 2, 3])
    kw["parallelism"] = {"pipeline": pipeline, "tensor": tensor, "sequence_parallel": tensor > 1 and rng.random() < 0.5}
    if pipeline > 1 and rng.random() < 0.4:   # Megatron's interleaving: micro-steps in groups of `pipeline`
        kw["training.gradient_accumulation_steps"], kw["model.layers"] = 8, 8
        kw["parallelism"].update(pipeline=4, pipeline_schedule="interleaved", virtual_stages=2)
    if moe and stage == 3:   # DeepSpeed-MoE's layer refuses ZeRO-3: Hugging Face's dropless MoE
        kw["model.moe"] = {**MOE["model.moe"], "dispatch": "dropless"}
    elif moe:
        kw["parallelism"]["expert"] = rng.choice([1, 2])
    kw["deepspeed.zero_optimization.stage"] = stage
    kw["deepspeed.zero_optimization.overlap_comm"] = rng.choice([True, False])
    if stage >= 1 and rng.random() < 0.3:
        kw["deepspeed.zero_optimization.offload_optimizer"] = {"device": "cpu"}
        if stage == 3 and rng.random() < 0.5:
            kw["deepspeed.zero_optimization.offload_param"] = {"device": "cpu"}
    return kw


SAMPLE = [_draw(random.Random(f"bound-{i}")) for i in range(32)]
TP_KINDS = (OpKind.TP_ALL_REDUCE, OpKind.TP_REDUCE_SCATTER, OpKind.TP_ALL_GATHER)


# tensor parallelism and ZeRO-3 at GAS 1 without a pipeline (the random sample has none): the
# calls and the host time the bound adds are checked against the schedule's too
GAS1 = [{**model, "parallelism": {"tensor": tp, "sequence_parallel": sp}, "training.gradient_accumulation_steps": 1,
           "training.activation_checkpointing": ck, "deepspeed.zero_optimization.stage": stage}
          for model, tp, sp, ck, stage in ((LLAMA, 2, True, "full", 3), (LLAMA, 4, False, "selective", 1),
                                           ({}, 2, False, "none", 2), ({"model.heads": 8, "model.hidden": 512}, 8, True, "none", 0),
                                           ({"model.tied_embeddings": False}, 4, True, "full", 2), ({}, 1, False, "full", 3),
                                           (LORA, 1, False, "none", 3),
                                           ({"model.layers": 4, "model.moe": {"experts": 4, "top_k": 2, "dispatch": "dropless"}}, 1, False,
                                            "selective", 3))]


@pytest.mark.parametrize("kw", SAMPLE + GAS1, ids=[f"case{i}" for i in range(len(SAMPLE))]
                         + [f"gas1-{i}" for i in range(len(GAS1))])
def test_the_bound_is_below_the_simulated_step_and_equals_the_compute_the_schedule_charges(kw):
    sc = scenario(**kw)
    result, _ = run_scenario(sc)
    bound = scenario_step_time_bound_s(sc)
    assert 0.0 < bound <= result.step_time_s
    # the bound prices the forward, backward and recompute ops the builder adds, and the
    # tensor-parallel calls around them on the compute stream, op for op: each stage's compute
    # of one micro-step is the schedule's (gradient adds into .grads left out, and the TP
    # all-reduce of partly computed gradients after the step's last backward)
    if sc.pipeline_stages == 1 and sc.gradient_accumulation_steps == 1:
        wl, schedule = build_schedule(sc)
        cm = CostModel(sc.cluster, sc.precision, sc.zero.stage, schedule.host, schedule.pipeline,
                       sc.tensor_parallel_size, schedule.tf32)
        modules = {m.name for m in wl.modules}
        charged = sum(kernel_overhead_s(op.work.kernels, cm.gpu) + cm.compute_work_s(op.work) for op in schedule.ops
                      if op.kind in (OpKind.FORWARD, OpKind.BACKWARD) and op.work is not None
                      and not op.work.accumulate_bytes)
        costs = [cm.op_cost(op) for op in schedule.ops
                 if op.kind in TP_KINDS and op.stream == Stream.COMPUTE and op.payload.module in modules]
        assert bool(costs) == (sc.tensor_parallel_size > 1)
        charged += sum(c.fixed_s + c.work_s for c in costs)
        if sc.zero.stage != 3:
            assert charged == pytest.approx(bound, rel=1e-9)
            return
        # ZeRO-3's hooks as charged, and at most the per-rank views charged (the bound counts one
        # per rank and gradient: no interleaving, no gathers)
        compute = [op for op in schedule.ops if op.stream == Stream.COMPUTE]
        cpu = sc.cluster.profile.cpu
        hooks = sum(hook_visits_time_s(op.hook_visits, hook_visit_us(cpu, op.phase == Phase.BACKWARD)) for op in compute)
        views = sum(rank_views_time_s(op.host_views, cpu.zero3_rank_view_us) for op in compute)
        assert hooks > 0 and views > 0
        leaves = zero3_leaves(wl, moe_blocks_are_leaves(sc))
        assert zero3_hooks_s(wl, sc.training.activation_checkpointing, leaves, cpu) == pytest.approx(hooks, rel=1e-9)
        assert charged + hooks < bound <= (charged + hooks + views) * (1 + 1e-9)


def test_a_pipeline_bound_counts_the_fill_and_the_drain():
    # stage s waits for micro-step 0's forward through the stages before it and, after its last
    # backward, for that gradient to go back through them: 1 x 4 at stage 0, 1 + 2 x 4, 1 + 2 + 3 x 4
    assert step_time_lower_bound_s([1.0, 2.0, 3.0], 4) == 15.0
    assert step_time_lower_bound_s([3.0, 1.0], 4) == 12.0
    assert step_time_lower_bound_s([2.0, 2.0, 2.0, 2.0], 8) == (8 + 4 - 1) * 2.0   # (m + p - 1)(f + b)
    assert step_time_lower_bound_s([1.0, 2.0, 3.0], 4, interleaved=True) == 8.0
    assert step_time_lower_bound_s([5.0], 3) == 15.0


@pytest.mark.parametrize("objective", ["tokens_per_s", "mfu"])
def test_an_exhaustive_search_with_the_bound_ranks_its_best_as_one_without_it(objective):
    """Every candidate the bound skipped is simulated afresh: none would have entered the best
    `keep` (a search that never skips, keep above the candidate count, ranks the same best)."""
    raw = mapping(**{"training.micro_batch_size": 8, "model.layers": 2})
    base, keep = Base(raw, ROOT, "bounded"), 3
    res = tune(base, objective, budget=None, keep=keep)
    assert res.bounded, "the bound skipped nothing: the test checks nothing"
    ranked = [(score(r, objective), c.key()) for c, r in res.ranked]
    for c, lb in res.bounded:
        again = base.run(c.variant).result
        if again is not None:
            assert lb <= again.step_time_s
            assert not again.fits or score(again, objective) <= ranked[keep - 1][0]
    full = tune(base, objective, budget=None, keep=10**6)
    assert not full.bounded
    assert [(score(r, objective), c.key()) for c, r in full.ranked][:keep] == ranked[:keep]
