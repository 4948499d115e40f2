"""FP8 linears (training.fp8, accelerate's mixed_precision fp8; see [Note: FP8 linears]): which
modules Transformer Engine converts, what they keep and move, their GEMMs priced at the FP8 peak,
the reused steps exact, and the refusals."""
from __future__ import annotations

import pytest

from tests.helpers import equal_results, scenario
from zsim.api import run_scenario
from zsim.errors import ZsimInputError
from zsim.hardware.compute import gemm_time_s
from zsim.schedule.build import build_schedule, workload_for
from zsim.schedule.ir import OpKind
from zsim.workload.module import ModuleKind

H100 = {"hardware.profile": "dgx-h100", "model.layers": 4, "model.hidden": 1024, "model.heads": 16,
        "model.seq_len": 2048, "training.seq_len": 2048, "deepspeed.zero_optimization.stage": 3}


def test_every_aligned_nn_linear_converts_and_keeps_fp8_copies():
    plain, fp8 = (workload_for(scenario(**H100, **{"training.fp8": on})) for on in (False, True))
    a = 2
    for p, m in zip(plain.modules, fp8.modules):
        assert m.fp8 == (m.kind == ModuleKind.LINEAR)     # every linear of this GPT divides by 16
        if not m.fp8:
            assert m == p
            continue
        t, n_out, n_in = m.gemm
        kept = t * n_in * a if p.act_bytes >= t * n_in * a else 0.0
        assert m.act_bytes == p.act_bytes - kept + t * n_in + n_in * n_out      # fp8 input and weight copies
        assert m.fwd_mem_bytes == p.fwd_mem_bytes + t * n_in * 3 + n_in * n_out * 4
        assert m.bwd_mem_bytes == p.bwd_mem_bytes + t * n_out * 4


def test_a_linear_off_the_16_grid_and_moe_experts_stay_16_bit():
    odd = workload_for(scenario(**{**H100, "model.vocab": 1001, "training.fp8": True}))
    assert not next(m for m in odd.modules if m.name == "lm_head").fp8
    moe = workload_for(scenario(**{**H100, "model.moe": {"experts": 4, "top_k": 2, "dispatch": "dropless"},
                                   "model.glu": True, "training.fp8": True}))
    assert not any(m.fp8 for m in moe.modules if m.expert is not None)
    assert any(m.fp8 for m in moe.modules if m.name.endswith("o_proj"))


def test_the_linears_gemms_run_at_the_fp8_peak():
    _, sched = build_schedule(scenario(**H100, **{"training.fp8": True}))
    for op in sched.ops:
        if op.kind in (OpKind.FORWARD, OpKind.BACKWARD) and op.payload.module.endswith("o_proj"):
            assert op.payload.work.gemms == () and op.payload.work.fp8_gemms
    sc = scenario(**H100)
    gpu = sc.cluster.profile.gpu
    big = (8192, 8192, 8192)
    ratio = gemm_time_s(*big, 1, gpu, sc.cluster.fp8_peak_flops()) / gemm_time_s(*big, 2, gpu, sc.cluster.peak_flops("bf16"))
    assert ratio == pytest.approx(989.4 / 1978.9)


def test_fp8_pays_off_on_large_gemms_only_and_the_reused_steps_are_exact():
    # hidden 4096 and 16k tokens a micro-batch: the GEMMs dominate and FP8 halves them
    big = {**H100, "model.hidden": 4096, "model.heads": 32, "model.layers": 2, "training.micro_batch_size": 8}
    plain, _ = run_scenario(scenario(**big))
    fp8, _ = run_scenario(scenario(**big, **{"training.fp8": True}))
    assert fp8.step_time_s < 0.8 * plain.step_time_s
    # hidden 1024, 4k tokens: the casts and their launches cost what the GEMMs save
    small_plain, _ = run_scenario(scenario(**H100))
    small_fp8, _ = run_scenario(scenario(**H100, **{"training.fp8": True}))
    assert small_fp8.step_time_s > 0.95 * small_plain.step_time_s
    sc = scenario(**H100, **{"training.fp8": True, "training.gradient_accumulation_steps": 3})
    reused, _ = run_scenario(sc)
    full, _ = run_scenario(sc, steady=False)
    equal_results(reused, full)


@pytest.mark.parametrize("changes, field", [
    ({"hardware.profile": "dgx-a100-80g"}, "training.fp8"),
    ({"training.precision": "fp16"}, "training.precision"),
    ({"training.lora": {"r": 8}}, "training.fp8"),
    ({"parallelism.tensor": 2}, "training.fp8"),
])
def test_refusals_name_the_field(changes, field):
    with pytest.raises(ZsimInputError) as e:
        scenario(**{**H100, "training.fp8": True, **changes})
    assert e.value.field == field


ACCELERATE_FP8 = """distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
mixed_precision: fp8
num_machines: 1
num_processes: 8
"""


def test_accelerates_mixed_precision_fp8_runs_the_linears_in_fp8(tmp_path):
    from zsim.cli import main
    import json
    path, out = tmp_path / "accelerate.yaml", tmp_path / "result.json"
    path.write_text(ACCELERATE_FP8)
    assert main(["run", str(path), "--model", "llama3-8b", "--profile", "dgx-h100", "--set",
                 "training.micro_batch_size=1", "--json", str(out)]) == 0
    assert "linears in FP8" in json.loads(out.read_text())["implementation"]
    path.write_text(ACCELERATE_FP8 + "fp8_config:\n  backend: MSAMP\n")
    assert main(["run", str(path), "--model", "llama3-8b", "--profile", "dgx-h100"]) == 2
