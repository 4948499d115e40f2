"""The own core's decode loop (calibration/core/generate.py) against zsim's generation schedule:
the same modules in every forward, and the KV cache zsim holds is the bytes torch's cache holds
after each forward (see [Note: generation]). Timings: benchmarks/generation_core.py."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from calibration.core.generate import check_model, generate  # noqa: E402
from tests.helpers import ROOT  # noqa: E402
from zsim.config.scenario import scenario_from_mapping  # noqa: E402
from zsim.engine.sim import simulate  # noqa: E402
from zsim.schedule.generate import build_generation  # noqa: E402
from zsim.schedule.ir import Category, OpKind  # noqa: E402
from zsim.specs.generation import generation_kernels  # noqa: E402
from zsim.workload.generation import decode_workload, prefill_workload  # noqa: E402

MODEL = {"layers": 3, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn_hidden": 352, "vocab": 512, "seq_len": 1024,
         "position": "rope", "norm": "rmsnorm", "glu": True, "fused_qkv": False, "tied_embeddings": False,
         "bias": False}


def _scenario(precision: str, **model):
    return scenario_from_mapping({
        "name": "core-decode", "model": {**MODEL, **model},
        "hardware": {"profile": "cpu-xeon-vm-2ranks", "nodes": 1, "gpus_per_node": 1},
        "training": {"precision": precision},
        "deepspeed": {"zero_optimization": {"stage": 0}, **({"bf16": {"enabled": True}} if precision == "bf16" else {})},
        "inference": {"batch_size": 3, "prompt_len": 40, "new_tokens": 6}}, ROOT)


@pytest.mark.parametrize("precision, model", [("fp32", {}), ("bf16", {"fused_qkv": True, "qk_norm": False})],
                         ids=["fp32-gqa", "bf16-fused-qkv"])
def test_decode_ops_and_kv_cache_equal_the_core(precision, model):
    sc = _scenario(precision, **model)
    gen = sc.inference
    attn, kernels = generation_kernels(gen, sc.training)
    prefill = prefill_workload(sc.model, gen.batch_size, gen.prompt_len, precision, attn, kernels, 1)
    decode = decode_workload(sc.model, gen.batch_size, precision, attn, kernels, 1)
    forwards = tuple(range(gen.new_tokens))
    trace = simulate(build_generation(sc, prefill, decode, forwards), sc.cluster, sc.precision)
    measured = generate(sc)
    assert len(measured) == len(forwards)
    for f, fwd in enumerate(measured):
        ops = [op for op in trace.schedule.ops if op.micro_step == f]
        assert tuple(op.payload.module for op in ops if op.kind == OpKind.FORWARD) == fwd.modules
        # the cache zsim holds once the forward's last attention layer ran
        held = sum(a.size_bytes for op in ops for a in op.alloc if a.category == Category.KV_CACHE)
        freed = sum(a.size_bytes for op in trace.schedule.ops if op.micro_step == f - 1 for a in op.alloc
                    if a.category == Category.KV_CACHE) if f else 0.0
        assert held == fwd.kv_cache_bytes, f
        assert held > freed


def test_core_refuses_what_its_loop_does_not_run():
    with pytest.raises(ValueError):
        check_model(_scenario("fp32", position="learned").model)
