"""Megatron's selective recompute (Korthikanti et al. 2022 sec. 5) re-runs the whole attention
core forward inside the backward (megatron/model/transformer.py _checkpointed_attention_forward):
its FLOPs, its memory passes (scores, softmax, dropout) and its kernels."""
from __future__ import annotations

from zsim.schedule.build import build_schedule
from zsim.schedule.ir import OpKind

from tests.helpers import scenario


def _core_backward(checkpointing: str):
    sc = scenario(**{"training.activation_checkpointing": checkpointing, "training.flash_attention": False,
                     "training.dropout": True, "deepspeed.zero_optimization.stage": 1})
    wl, s = build_schedule(sc)
    core = next(m for m in wl.modules if m.kind == "attention")
    op = next(o for o in s.ops if o.kind == OpKind.BACKWARD and o.payload.module == core.name)
    return core, op.payload.work


def test_selective_recompute_pays_the_core_forward_memory_passes_and_kernels():
    core, plain = _core_backward("none")
    _, selective = _core_backward("selective")
    assert core.fwd_mem_bytes > 0
    assert plain.mem_bytes == core.bwd_mem_bytes
    assert selective.mem_bytes == core.bwd_mem_bytes + core.fwd_mem_bytes
    assert selective.kernels == plain.kernels + core.kernels_fwd
    assert selective.attention_flops == plain.attention_flops + core.fwd_flops
