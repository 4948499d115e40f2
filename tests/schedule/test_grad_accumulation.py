"""AccumulateGrad's add into .grads kept across micro-steps (see [Note: gradient accumulation add]):
which stages and micro-steps pay it, how many bytes, what it costs, and how calibration fits its rate."""
from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import scenario
from zsim.hardware.compute import grad_accumulate_time_s, memory_bound_time_s
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import OpKind
from zsim.specs.hardware import GpuProfile

ZERO = "deepspeed.zero_optimization"


def _accumulated_per_micro(sc) -> dict[int, float]:
    _, schedule = build_schedule(sc)
    out = {m: 0.0 for m in range(sc.gradient_accumulation_steps)}
    for op in schedule.ops:
        if op.kind == OpKind.BACKWARD:
            out[op.micro_step] += op.payload.work.accumulate_bytes
    return out


@pytest.mark.parametrize("precision,width", [("bf16", 2), ("fp32", 4)])
@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("overlap", [False, True])
def test_stages_0_and_1_add_every_trained_gradient_after_the_first_micro_step(stage, precision, width, overlap):
    sc = scenario(**{f"{ZERO}.stage": stage, f"{ZERO}.overlap_comm": overlap, "training.precision": precision,
                     "training.gradient_accumulation_steps": 4})
    trained = sum(p.numel for p in sc_workload(sc).params if p.trainable)
    # the first micro-step creates the .grads; each later one (the boundary's too) adds into all of them
    assert _accumulated_per_micro(sc) == {0: 0.0, 1: 3.0 * width * trained, 2: 3.0 * width * trained,
                                          3: 3.0 * width * trained}


@pytest.mark.parametrize("changes", [
    {f"{ZERO}.stage": 2},   # the hooks move each gradient out of its .grad
    {f"{ZERO}.stage": 3},   # no persistent .grad
    # the BF16_Optimizer accumulates into its own fp32 buffers
    {f"{ZERO}.stage": 1, "deepspeed.data_types": {"grad_accum_dtype": "fp32"}},
])
def test_no_add_where_deepspeed_keeps_no_grad_across_micro_steps(changes):
    sc = scenario(**changes, **{"training.gradient_accumulation_steps": 3})
    assert set(_accumulated_per_micro(sc).values()) == {0.0}


def test_one_micro_step_adds_nothing():
    assert _accumulated_per_micro(scenario(**{f"{ZERO}.stage": 1})) == {0: 0.0}


def test_a_tied_weight_is_added_once_where_its_gradient_is_final():
    """The lm_head's and the embedding's contributions are summed before the one AccumulateGrad
    (grads_ready_at): the untied model adds a vocab x hidden matrix more."""
    tied = scenario(**{f"{ZERO}.stage": 1, "model.tied_embeddings": True, "training.gradient_accumulation_steps": 2})
    untied = scenario(**{f"{ZERO}.stage": 1, "training.gradient_accumulation_steps": 2})
    v, h = untied.model.vocab, untied.model.hidden
    assert _accumulated_per_micro(untied)[1] - _accumulated_per_micro(tied)[1] == 3.0 * 2 * v * h


def test_priced_at_the_calibrated_rate_else_the_memory_bound_one():
    gpu = GpuProfile(model="x", peak_tflops_fp32=100.0, peak_tflops_tf32=100.0, peak_tflops_fp16=100.0,
                     peak_tflops_bf16=100.0, hbm_capacity_GiB=80.0, hbm_bw_GBps=1000.0, memory_bound_efficiency=0.5)
    assert grad_accumulate_time_s(3e9, gpu) == memory_bound_time_s(3e9, gpu) == pytest.approx(6e-3)
    calibrated = dataclasses.replace(gpu, grad_accumulate_efficiency=0.75)
    assert grad_accumulate_time_s(3e9, calibrated) == pytest.approx(4e-3)


def test_the_step_pays_the_adds_in_its_backward():
    """GAS 2 at stage 1: the second backward's adds cost bytes / (bandwidth x the profile's rate)."""
    from zsim.api import run_scenario

    def run(eff):
        sc = scenario(**{f"{ZERO}.stage": 1, "training.gradient_accumulation_steps": 2,
                         "hardware.override": {"gpu": {"grad_accumulate_efficiency": eff}}})
        return sc, run_scenario(sc)[0]

    sc, fast = run(1.0)
    _, slow = run(0.25)
    added = _accumulated_per_micro(sc)[1]
    extra = added / (sc.cluster.profile.gpu.hbm_bw_GBps * 1e9) * (1 / 0.25 - 1)
    assert extra > 0
    assert slow.compute_time_s - fast.compute_time_s == pytest.approx(extra, rel=1e-6)


def sc_workload(sc):
    from zsim.schedule.build import workload_for

    return workload_for(sc)


def test_calibration_fits_the_rate_from_its_benchmark():
    from calibration.harness.fit_compute import fit_compute
    from tests.helpers import compute_records

    recs = compute_records("fp32") + compute_records("bf16", 10.0)
    recs += [{"kind": "kernel_overhead", "time_s": 3e-6},
             {"kind": "memcpy", "where": "host", "GBps": 20.0, "time_s": 1e-3}]
    recs += [{"kind": "grad_accumulate", "dtype": d, "bytes": 3e6, "kernels": 2, "time_s": t}
             for d, t in (("fp32", 3e-4), ("bf16", 1.2e-3))]
    fields, by_dtype, _ = fit_compute(recs, ("fp32", "bf16"))
    over = 3e-6
    for d, t in (("fp32", 3e-4), ("bf16", 1.2e-3)):
        assert by_dtype[d]["grad_accumulate_efficiency"] == pytest.approx(3e6 / (t - 2 * over) / 20e9, rel=1e-6)
    assert fields["grad_accumulate_efficiency"] == by_dtype["fp32"]["grad_accumulate_efficiency"]


def test_megatron_gradient_accumulation_fusion_adds_nothing():
    """Megatron-LM's wgrad GEMM accumulates into main_grad itself (training.gradient_accumulation_fusion)."""
    sc = scenario(**{f"{ZERO}.stage": 1, "training.gradient_accumulation_steps": 3,
                     "training.gradient_accumulation_fusion": True})
    assert set(_accumulated_per_micro(sc).values()) == {0.0}


def test_the_engines_refuse_the_fusion_they_do_not_run():
    from calibration.core.peers import unsupported as peers_unsupported
    from calibration.core.plan import unsupported as core_unsupported

    sc = scenario(**{"training.gradient_accumulation_fusion": True})
    assert "gradient_accumulation_fusion" in core_unsupported(sc)
    assert "gradient_accumulation_fusion" in peers_unsupported(sc, cuda=False)
