"""Liger's fused linear cross-entropy (training.fused_linear_cross_entropy; see [Note: fused linear
cross-entropy]): lm_head's three GEMMs in the forward, its gradients kept instead of the logits,
chunks of Liger's size; the exactness of the reused steps; what the loaders and the doctor do."""
from __future__ import annotations

import pytest

from tests.helpers import equal_results, scenario
from zsim.api import run_scenario
from zsim.errors import ZsimInputError
from zsim.schedule.build import build_schedule, workload_for
from zsim.schedule.ir import OpKind
from zsim.workload.transformer import liger_chunk_rows

LONG = {"model.layers": 4, "model.hidden": 512, "model.heads": 8, "model.vocab": 32768, "model.seq_len": 8192,
        "training.seq_len": 8192, "training.micro_batch_size": 2, "deepspeed.zero_optimization.stage": 3}


def test_the_chunk_is_livers():
    # liger_kernel/ops/fused_linear_cross_entropy.py's own example: BT 16384, V 32000, H 4096 -> 2048
    assert liger_chunk_rows(4096 * 4, 32000, 4096) == 2048
    assert liger_chunk_rows(100, 32000, 4096) == 16          # next_power_of_2(ceil(100 / 8))
    assert liger_chunk_rows(3, 1000, 4096) == 3              # never above BT


def _head(wl):
    return {m.name: m for m in wl.modules if m.name in ("lm_head", "loss")}


def test_lm_head_keeps_its_gradients_and_the_loss_only_a_chunk_of_logits():
    plain = _head(workload_for(scenario(**LONG)))
    fused = _head(workload_for(scenario(**LONG, **{"training.fused_linear_cross_entropy": True})))
    t, v, h, a = 2 * 8192, 32768, 512, 2
    assert fused["lm_head"].act_bytes == t * h * a + v * h * a
    assert fused["loss"].act_bytes == 0 and plain["loss"].act_bytes == 4 * t * v
    assert fused["loss"].fwd_workspace_bytes == liger_chunk_rows(t, v, h) * v * a
    _, sched = build_schedule(scenario(**LONG, **{"training.fused_linear_cross_entropy": True}))
    passes = {(op.kind, op.payload.module): op.payload.work for op in sched.ops
              if op.kind in (OpKind.FORWARD, OpKind.BACKWARD) and op.payload.module == "lm_head"}
    forward, backward = passes[OpKind.FORWARD, "lm_head"], passes[OpKind.BACKWARD, "lm_head"]
    assert forward.gemms == ((t, v, h), (t, h, v), (v, h, t)) and backward.gemms == ()
    # the MFU convention's three passes, all in the forward
    assert forward.model_flops == 3 * 2.0 * t * v * h and backward.model_flops == 0.0


def test_under_lora_the_frozen_lm_head_keeps_only_the_input_gradient():
    sc = scenario(**LONG, **{"training.fused_linear_cross_entropy": True, "training.lora": {"r": 8}})
    head = _head(workload_for(sc))["lm_head"]
    assert not head.weight_grad and head.act_bytes == 2 * 8192 * 512 * 2


def test_it_lowers_the_peak_by_about_the_logits():
    plain, _ = run_scenario(scenario(**LONG))
    fused, _ = run_scenario(scenario(**LONG, **{"training.fused_linear_cross_entropy": True}))
    logits_fp32 = 2 * 8192 * 32768 * 4
    assert plain.memory.peak_bytes - fused.memory.peak_bytes > 0.5 * logits_fp32
    assert fused.model_flops_per_gpu == pytest.approx(plain.model_flops_per_gpu, rel=1e-12)


@pytest.mark.parametrize("stage, gas", [(3, 3), (2, 2)])
def test_steps_reused_equal_every_op_simulated(stage, gas):
    sc = scenario(**{**LONG, "deepspeed.zero_optimization.stage": stage, "training.gradient_accumulation_steps": gas,
                     "training.fused_linear_cross_entropy": True, "training.activation_checkpointing": "full"})
    reused, _ = run_scenario(sc)
    full, _ = run_scenario(sc, steady=False)
    equal_results(reused, full)


def test_refusals_and_notes():
    with pytest.raises(ZsimInputError) as e:
        scenario(**LONG, **{"training.fused_linear_cross_entropy": True, "parallelism.tensor": 2})
    assert e.value.field == "training.fused_linear_cross_entropy"
    with pytest.raises(ZsimInputError) as e:
        scenario(**LONG, **{"training.fused_linear_cross_entropy": True, "training.fused_cross_entropy": True})
    assert e.value.field == "training.fused_cross_entropy"
    dpo = scenario(**LONG, **{"training.fused_linear_cross_entropy": True, "training.preference": {"method": "dpo"}})
    assert not dpo.training.fused_linear_cross_entropy
    assert any("preference loss needs the logits" in n for n in dpo.notes)
