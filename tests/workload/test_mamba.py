"""Mamba mixers in a hybrid model (zsim/workload/mamba.py; Jamba, transformers models/jamba): which
blocks mix by attention and which by Mamba, the mixer's parameters, what it keeps for backward,
the config.json reader, and the step simulated like any other (the shortcuts give what every
op simulated gives)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import ROOT, equal_results, scenario
from zsim.api import run_scenario
from zsim.config.hf_config import model_from_hf, read_hf_config
from zsim.errors import ZsimInputError
from zsim.schema import build
from zsim.specs.model import ModelSpec
from zsim.workload.module import ModuleKind
from zsim.workload.transformer import build_workload

JAMBA = ROOT / "scenarios/hub/ai21labs--Jamba-v0.1.json"
# a 16-block Jamba-like model, 256 wide: attention in blocks 4 and 12, MoE in the odd ones
TINY_JAMBA = dict(model_type="jamba", architectures=["JambaForCausalLM"], hidden_size=256, intermediate_size=512,
                  num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                  max_position_embeddings=512, num_experts=4, num_experts_per_tok=2)


def _jamba():
    return build(ModelSpec, read_hf_config(Path(JAMBA)), "model")


def test_jamba_blocks_mix_by_attention_every_eighth_and_route_every_second():
    m = _jamba()
    assert [i for i in range(32) if m.is_attention_layer(i)] == [4, 12, 20, 28]
    assert [i for i in range(32) if m.is_moe_layer(i)] == list(range(1, 32, 2))
    assert (m.mamba.dt_rank, m.mamba.d_state, m.mamba.expand, m.position) == (256, 16, 2, "none")


def test_a_mixer_holds_the_parameters_transformers_builds_and_keeps_its_activations():
    m = _jamba()
    wl = build_workload(m, 1, 1024, "bf16", flash_attention=True, dropout=False)
    mixer = [x for x in wl.modules if x.name.startswith("layers.0.mamba.")]
    numels = sorted(wl.params[p].numel for x in mixer for p in x.params)
    # modeling_jamba.JambaMambaMixer: A_log, D, conv1d weight and bias, in_proj, x_proj, dt_proj
    # weight and bias, out_proj, dt/b/c layernorms (transformers 5.25 on the meta device)
    assert numels == sorted([8192 * 16, 8192, 8192 * 4, 8192, 16384 * 4096, 288 * 8192, 8192 * 256, 8192,
                             4096 * 8192, 256, 16, 16])
    # kept for backward: in_proj's input, x and z, u, delta, the scan's output and y, dt twice
    # (its norm's input and dt_proj's), B and C twice (their norms' inputs and the scan's)
    t, h, e = 1024, 4096, 8192
    assert sum(x.act_bytes for x in mixer) == 2 * t * (h + 6 * e + 2 * 256 + 4 * 16)
    assert {x.kind for x in mixer} == {ModuleKind.LINEAR, ModuleKind.SSM, ModuleKind.NORM}
    assert not [x for x in wl.modules if x.name.startswith("layers.0.attn")]


def test_jamba_config_offsets_are_checked_in_one_line():
    with pytest.raises(ZsimInputError, match="attn_layer_offset"):
        model_from_hf(dict(TINY_JAMBA, attn_layer_offset=8), "config.json")
    with pytest.raises(ZsimInputError, match="parallelism.tensor"):
        scenario(**{"model": model_from_hf(TINY_JAMBA, "config.json"), "parallelism.tensor": 2})


@pytest.mark.parametrize("stage", [2, 3])
def test_a_hybrid_step_reused_equals_every_op_simulated(stage):
    for gas in (1, 5):
        sc = scenario(**{"model": model_from_hf(TINY_JAMBA, "config.json"), "training.seq_len": 256,
                         "deepspeed.zero_optimization.stage": stage, "training.gradient_accumulation_steps": gas})
        reused, _ = run_scenario(sc)
        full, _ = run_scenario(sc, steady=False)
        equal_results(reused, full)
        assert reused.fits and reused.step_time_s > 0
