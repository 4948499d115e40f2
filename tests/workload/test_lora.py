"""LoRA and frozen parameters (zsim/workload/lora.py; see [Note: frozen parameters under ZeRO])."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT, scenario
from zsim.api import run_scenario
from zsim.config.scenario import load_scenario
from zsim.errors import ZsimInputError
from zsim.schedule.build import build_schedule, workload_for
from zsim.schedule.ir import Category, OpKind
from zsim.workload.lora import trainable_params

LLAMA = {"model": {"preset": "llama2-7b"}}
LORA = {"training.lora": {"rank": 16, "target_modules": ["q_proj", "v_proj"]}}
TINY_LLAMA = {"model": {"layers": 2, "hidden": 256, "heads": 4, "vocab": 1024, "seq_len": 256,
                        "tied_embeddings": False, "glu": True, "norm": "rmsnorm", "position": "rope",
                        "ffn_hidden": 512, "fused_qkv": False, "bias": False}}


def _tiny(**changes):
    return scenario(**{**TINY_LLAMA, **changes})


def test_peft_names_and_counts():
    wl = workload_for(_tiny(**LORA))
    names = [p.name for p in wl.params]
    # PEFT's lora.Linear: base_layer, then lora_A, lora_B, in registration order
    i = names.index("layers.0.attn.q_proj.base_layer.weight")
    assert names[i + 1:i + 3] == ["layers.0.attn.q_proj.lora_A.default.weight",
                                  "layers.0.attn.q_proj.lora_B.default.weight"]
    assert "layers.0.attn.k_proj.weight" in names          # not a target: unchanged
    assert trainable_params(wl) == 2 * 2 * (256 * 16 + 16 * 256)   # 2 layers x (q, v) x (A + B)
    base = workload_for(_tiny())
    assert wl.n_params == base.n_params + trainable_params(wl)
    assert all(not p.trainable for p in wl.params if "lora_" not in p.name)


def test_llama2_7b_lora_trainable_count_is_pefts():
    # PEFT prints "trainable params: 4,194,304" for Llama-2 7B with r=8 on q_proj, v_proj
    wl = workload_for(scenario(**LLAMA, **{"training.lora": {"rank": 8}}))
    assert trainable_params(wl) == 4_194_304


def test_gpt2_c_attn_maps_to_fused_qkv():
    sc = scenario(**{"model": {"preset": "gpt2"}, "training.lora": {"target_modules": ["c_attn"]}})
    wl = workload_for(sc)
    a = [m for m in wl.modules if m.name.endswith("attn.qkv.lora_A.default")]
    assert len(a) == sc.model.layers and a[0].gemm[1:] == (8, 768)
    assert [m.name for m in workload_for(scenario(**{"model": {"preset": "gpt2"}, "training.lora": {}})).modules
            if "lora_A" in m.name][0] == "layers.0.attn.qkv.lora_A.default"   # PEFT's default: c_attn


def test_all_linear_skips_lm_head():
    wl = workload_for(_tiny(**{"training.lora": {"target_modules": "all-linear"}}))
    adapted = {m.name.rsplit(".lora_A", 1)[0] for m in wl.modules if ".lora_A." in m.name}
    assert len(adapted) == 2 * 7 and not any(n.startswith("lm_head") for n in adapted)


def test_frozen_backward_skips_weight_gradients():
    base, lora = workload_for(_tiny()), workload_for(_tiny(**LORA))
    k0 = next(m for m in lora.modules if m.name == "layers.0.attn.k_proj")
    k1 = next(m for m in lora.modules if m.name == "layers.1.attn.k_proj")
    # layer 0's k_proj reads an input no gradient flows to and has a frozen weight: no backward
    assert (k0.bwd_flops, k0.input_grad, k0.weight_grad) == (0.0, False, False)
    # layer 1's input carries the gradient of layer 0's adapters: dgrad only (1x forward)
    assert k1.bwd_flops == k1.fwd_flops and k1.input_grad and not k1.weight_grad
    assert next(m for m in lora.modules if m.name == "wte").kernels_bwd == 0
    assert sum(m.bwd_flops for m in lora.modules) < sum(m.bwd_flops for m in base.modules)
    # full checkpointing: PEFT's enable_input_require_grads gives every block an input gradient
    ck = workload_for(_tiny(**LORA, **{"training.activation_checkpointing": "full"}))
    assert next(m for m in ck.modules if m.name == "layers.0.attn.k_proj").input_grad


def test_zero3_partitions_frozen_but_reduces_only_adapters():
    sc = _tiny(**LORA, **{"deepspeed.zero_optimization.stage": 3})
    wl, s = build_schedule(sc)
    reduced = {p for op in s.ops if op.kind == OpKind.BUCKET_REDUCE for p in op.payload.pids}
    assert {wl.params[p].name for p in reduced} == {p.name for p in wl.params if p.trainable}
    gathered = {p for op in s.ops if op.kind == OpKind.PARAM_GATHER for p in op.payload.pids}
    assert any(not wl.params[p].trainable for p in gathered)     # frozen weights are still fetched


@pytest.mark.parametrize("stage, efficient, keeps", [(2, True, False), (3, True, True), (3, False, False)])
def test_zero3_linear_wrap_keeps_frozen_inputs(stage, efficient, keeps):
    """see [Note: ZeRO-3 linear saves its input]: under ZeRO-3 a frozen MLP that a gradient
    reaches keeps its inputs (zero3_linear_wrap), unless memory_efficient_linear is off."""
    sc = _tiny(**LORA, **{"deepspeed.zero_optimization.stage": stage,
                          "deepspeed.zero_optimization.memory_efficient_linear": efficient})
    mods = {m.name: m for m in workload_for(sc).modules}
    tokens = 2 * 256
    gate, down, o = mods["layers.1.mlp.gate_proj"], mods["layers.1.mlp.fc_out"], mods["layers.1.attn.o_proj"]
    assert gate.input_grad and not gate.weight_grad
    assert (gate.act_bytes >= tokens * 256 * 2) == keeps       # the norm's output (gate/up share it), bf16
    assert (down.act_bytes >= tokens * 512 * 2) == keeps
    assert (o.act_bytes >= tokens * 256 * 2) == keeps
    assert mods["layers.1.mlp.up_proj"].act_bytes == 0.0       # reads gate_proj's saved input


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_flat_group_holds_trainable_only(stage):
    sc = _tiny(**LORA, **{"deepspeed.zero_optimization.stage": stage})
    wl, s = build_schedule(sc)
    gather = next(op for op in s.ops if op.kind == OpKind.UPDATED_GATHER)
    world = sc.cluster.world_size
    assert gather.payload.comm.numel == -(-trainable_params(wl) // (2 * world)) * 2 * world


def test_llama2_7b_lora_model_states_fraction_of_full():
    """The issue's target: LoRA r=16 on Llama-2 7B, ZeRO-3 over 8 GPUs: model states per GPU a
    fraction of the full fine-tune's (16-bit params sharded either way; no grads/Adam for the base)."""
    path = ROOT / "scenarios" / "llama2-7b-lora-zero3-8xa100.yaml"
    lora = run_scenario(load_scenario(path))[0]
    full = run_scenario(load_scenario(path, ["training.lora=null"]))[0]
    states = lambda r: sum(r.memory.breakdown.get(c, 0.0) for c in (Category.PARAMETERS, Category.GRADIENTS,
                                                                     Category.OPTIMIZER_STATES))
    assert states(lora) < 0.15 * states(full)
    assert lora.trainable_params == 16_777_216 and full.trainable_params is None
    assert "trainable_params" not in full.to_dict() and lora.to_dict()["trainable_params"] == 16_777_216


@pytest.mark.parametrize("changes, field", [
    ({"training.lora": {"target_modules": ["qproj"]}}, "training.lora.target_modules"),
    ({"training.lora": {"modules_to_save": ["nothing"]}}, "training.lora.modules_to_save"),
    ({"training.frozen": ["nope"]}, "training.frozen"),
    ({"training.lora": {"target_modules": 3}}, "training.lora.target_modules"),
])
def test_bad_names_are_one_line_errors(changes, field):
    with pytest.raises(ZsimInputError) as e:
        workload_for(_tiny(**changes))
    assert str(e.value).startswith(field)


def test_target_modules_are_refused_only_when_none_matches():
    # PEFT's inject_adapter: "Target modules ... not found in the base model" only when no module
    # matched; the usual seven-projection list on a transformers 5 MoE matches no expert
    # (see [Note: transformers 5 MoE experts]) and still trains the attention's adapters
    some = workload_for(_tiny(**{"training.lora": {"target_modules": ["q_proj", "nothing"]}}))
    alone = workload_for(_tiny(**{"training.lora": {"target_modules": ["q_proj"]}}))
    assert [p.name for p in some.params if p.trainable] == [p.name for p in alone.params if p.trainable]
    with pytest.raises(ZsimInputError, match="nothing, nope"):
        workload_for(_tiny(**{"training.lora": {"target_modules": ["nothing", "nope"]}}))


def test_frozen_patterns_and_modules_to_save():
    wl = workload_for(_tiny(**{"training.frozen": ["wte", "layers.0"]}))
    frozen = {p.name for p in wl.params if not p.trainable}
    assert "wte.weight" in frozen and "layers.0.mlp.fc_out.weight" in frozen
    assert "layers.1.ln_1.weight" not in frozen
    saved = workload_for(_tiny(**LORA, **{"training.lora.modules_to_save": ["lm_head"]}))
    names = {p.name: p.trainable for p in saved.params}
    assert names["lm_head.original_module.weight"] is False and names["lm_head.modules_to_save.default.weight"]


def test_cli_unknown_target_exits_2():
    path = ROOT / "scenarios" / "llama2-7b-lora-zero3-8xa100.yaml"
    out = subprocess.run([sys.executable, "-m", "zsim.cli", "run", str(path), "--set",
                          "training.lora.target_modules=[foo]"], capture_output=True, text=True)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "'foo'" in out.stderr
