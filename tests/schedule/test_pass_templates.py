"""Stationary passes copied from a template (see [Note: pass templates]) add exactly the ops a
build of every pass adds: every field of every op, the static buffers and the host settings,
for data-parallel ZeRO-0/1/2, 1F1B and interleaved pipelines, tensor parallelism and MoE."""
from __future__ import annotations

import pytest

from tests.helpers import MOE, VARIANTS, scenario
from zsim.schedule.build import build_schedule

ZERO = "deepspeed.zero_optimization"
# every stage, offload and checkpointing variant of the steady-state test, and the parallel layouts
CASES = {
    **VARIANTS,
    "stage1-full": {f"{ZERO}.stage": 1, "training.activation_checkpointing": "full"},
    "tp2-stage1": {f"{ZERO}.stage": 1, "parallelism.tensor": 2},
    "tp2-sp-stage1": {f"{ZERO}.stage": 1, "parallelism.tensor": 2, "parallelism.sequence_parallel": True},
    "pp2-stage0": {"parallelism.pipeline": 2, f"{ZERO}.stage": 0},
    "pp2-stage1-full": {"parallelism.pipeline": 2, f"{ZERO}.stage": 1, "training.activation_checkpointing": "full"},
    "pp4-tied": {"parallelism.pipeline": 4, "model.layers": 4, "model.tied_embeddings": True, f"{ZERO}.stage": 1},
    "pp2-tp2-sp": {"parallelism.pipeline": 2, "parallelism.tensor": 2, "parallelism.sequence_parallel": True,
                   f"{ZERO}.stage": 1},
    "pp2-bf16-optimizer": {"parallelism.pipeline": 2, f"{ZERO}.stage": 1,
                           "deepspeed.data_types": {"grad_accum_dtype": "fp32"}},
    "moe-ep2-stage1": {**MOE, "parallelism.expert": 2, f"{ZERO}.stage": 1},
    "moe-ep2-stage2-nodrop": {**MOE, "parallelism.expert": 2, f"{ZERO}.stage": 2,
                              "model.moe": dict(MOE["model.moe"], drop_tokens=False)},
    "pp3-v2-interleaved": {"parallelism.pipeline": 3, "parallelism.virtual_stages": 2,
                           "parallelism.pipeline_schedule": "interleaved", "model.layers": 6, "hardware.gpus_per_node": 6,
                           f"{ZERO}.stage": 1},
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("gas", [1, 2, 6])
def test_templated_passes_add_the_ops_a_build_adds(name, gas):
    if "interleaved" in name and gas % 3:
        pytest.skip("Megatron's interleaved schedule needs GAS divisible by the pipeline size")
    sc = scenario(**CASES[name], **{"training.gradient_accumulation_steps": gas})
    _, templated = build_schedule(sc)
    _, built = build_schedule(sc, templates=False)
    assert len(templated.ops) == len(built.ops)
    for a, b in zip(templated.ops, built.ops):
        assert a == b, f"op {a.id}: {a.name} != {b.name}"
    assert templated == built


def test_a_stationary_pass_is_copied_not_built():
    """The templates are used: GAS 5 at ZeRO-1 copies forwards 2-4 and backwards 2-3 (a build
    calls the module walk once per pass)."""
    import zsim.schedule.passes as passes

    calls = {"forward": 0, "backward": 0}
    real_f, real_b = passes._forward, passes._backward_modules

    def count_f(*args):
        calls["forward"] += 1
        return real_f(*args)

    def count_b(*args):
        calls["backward"] += 1
        return real_b(*args)

    sc = scenario(**{f"{ZERO}.stage": 1, "training.gradient_accumulation_steps": 5})
    try:
        passes._forward, passes._backward_modules = count_f, count_b
        build_schedule(sc)
    finally:
        passes._forward, passes._backward_modules = real_f, real_b
    # forward: micro-step 0 (after nothing) and 1 (the template of those after an op);
    # backward: 0 (its allocations), 1 (the template), 4 (the boundary)
    assert calls == {"forward": 2, "backward": 3}


def test_fewer_than_three_micro_steps_record_no_template():
    """A pass is copied from the third micro-step on, so GAS 1 and 2 build every pass and keep
    no template (recording one cost a GAS-1 ZeRO-2 175B build about 15%)."""
    import zsim.schedule.builder as builder

    recorded = []
    real = builder.Builder.pass_template

    def count(self, *args):
        recorded.append(args)
        return real(self, *args)

    try:
        builder.Builder.pass_template = count
        for gas in (1, 2):
            build_schedule(scenario(**{f"{ZERO}.stage": 1, "training.gradient_accumulation_steps": gas}))
        assert recorded == []
        build_schedule(scenario(**{f"{ZERO}.stage": 1, "training.gradient_accumulation_steps": 3}))
        assert recorded
    finally:
        builder.Builder.pass_template = real
