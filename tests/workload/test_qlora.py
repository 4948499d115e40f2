"""bitsandbytes-quantized frozen base weights (QLoRA; see [Note: bitsandbytes quantized base weights]):
bytes per weight, ZeRO-3's gathered size, the dequantization charged at each use, refusals, and
each input path (scenario key, axolotl, LLaMA-Factory, HF/TRL launch flags, config.json)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import ROOT, scenario
from zsim.cli import main
from zsim.config.quantization import quantization_notes
from zsim.config.recipes import read_recipe_file
from zsim.config.trainer_args import Recipe, read_trainer_args
from zsim.errors import ZsimInputError
from zsim.schedule.build import build_schedule, workload_for
from zsim.schedule.ir import OpKind, Phase
from zsim.schedule.payloads import ModulePass, ParamGather
from zsim.workload import quant

TINY_LLAMA = {"model": {"layers": 2, "hidden": 256, "heads": 4, "vocab": 1024, "seq_len": 256,
                        "tied_embeddings": False, "glu": True, "norm": "rmsnorm", "position": "rope",
                        "ffn_hidden": 512, "fused_qkv": False, "bias": False}}
QLORA = {"training.lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}, "training.quantization": "nf4"}
W = 4096 * 1024   # the weight measured with bitsandbytes 0.50.2 on CPU (4096 rows x 1024)


def _tiny(**changes):
    return scenario(**{**TINY_LLAMA, **QLORA, **changes})


def test_bytes_per_weight_match_bitsandbytes():
    # measured: packed 2,097,152 B; absmax fp32 262,144 B (0.5625 B a weight); double quant: absmax
    # uint8 65,536 B + nested absmax 1,024 B + offset 4 B (+ the 1 KiB nested code table zsim leaves out)
    assert quant.packed_bytes(W, "nf4") == 2_097_152
    assert (quant.packed_bytes(W, "nf4") + quant.quant_state_bytes(W, 4096, "nf4", False)) / W == 0.5625
    assert quant.quant_state_bytes(W, 4096, "fp4", True) == 65_536 + 1_024 + 4
    assert quant.packed_bytes(W, "int8") == W and quant.quant_state_bytes(W, 4096, "int8", False) == 16_384
    # one dequantization: read packed + absmax, write the bf16 weight
    assert quant.dequant_bytes(W, 4096, "nf4", False, 2) == 2_097_152 + 262_144 + 2 * W


def test_which_weights_are_quantized():
    wl = workload_for(_tiny())
    by_name = {p.name: p for p in wl.params}
    base = by_name["layers.0.attn.q_proj.base_layer.weight"]
    assert base.packed_bytes == 256 * 256 / 2 and not base.trainable
    assert by_name["layers.0.mlp.fc_out.weight"].packed_bytes == 512 * 256 / 2     # not a target: quantized too
    for name in ("wte.weight", "lm_head.weight", "layers.0.attn.q_proj.lora_A.default.weight"):
        assert by_name[name].packed_bytes is None, name                            # stays 16-bit
    assert all(p.packed_bytes is None for p in wl.params if "norm" in p.name)
    # stored in bf16 elements: a 4-bit weight is numel / 4 of them
    assert base.stored_numel(2) == 256 * 256 // 4
    assert wl.quant_state_bytes == sum(4 * p.numel / 64 for p in wl.params if p.packed_bytes is not None)


def test_double_quant_and_int8_storage():
    dq = {p.name: p for p in workload_for(_tiny(**{"training.double_quant": True})).params}
    q = dq["layers.0.mlp.fc_out.weight"]
    assert q.quant_state_bytes == 2048 + 4 * 8 + 4    # 2048 blocks: uint8 each, fp32 per 256, offset
    i8 = {p.name: p for p in workload_for(_tiny(**{"training.quantization": "int8"})).params}
    w = i8["layers.0.mlp.fc_out.weight"]
    assert w.packed_bytes == 512 * 256 and w.quant_state_bytes == 4 * 256   # SCB: one fp32 per output row


def _passes(sc, name):
    _, sched = build_schedule(sc)
    return [op for op in sched.ops if isinstance(op.payload, ModulePass) and op.payload.module == name]


def test_dequantization_is_charged_in_forward_recompute_and_backward():
    name = "layers.0.mlp.fc_out"
    plain = {op.phase: op.payload.work for op in _passes(_tiny(**{"training.quantization": "none"}), name)}
    deq = quant.dequant_bytes(256 * 512, 256, "nf4", False, 2)
    for phase, work in {op.phase: op.payload.work for op in _passes(_tiny(), name)}.items():
        assert work.mem_bytes == pytest.approx(plain[phase].mem_bytes + deq), phase
        assert work.kernels == plain[phase].kernels + 1
    ckpt = _passes(_tiny(**{"training.activation_checkpointing": "full"}), name)
    forwards = [op for op in ckpt if op.kind == OpKind.FORWARD]
    assert len(forwards) == 2                          # the forward and its recompute, each dequantizing
    assert all(op.payload.work.mem_bytes >= deq for op in ckpt)
    assert any(op.phase == Phase.BACKWARD for op in ckpt)


def test_zero3_gathers_the_packed_bytes():
    z3 = {"deepspeed.zero_optimization.stage": 3, "deepspeed.zero_optimization.stage3_param_persistence_threshold": 0}

    def gathered(sc):
        wl, sched = build_schedule(sc)
        return wl, sum(op.payload.comm.size_bytes for op in sched.ops
                       if isinstance(op.payload, ParamGather) and op.kind == OpKind.PARAM_GATHER and op.micro_step == 0)
    wl, q = gathered(_tiny(**z3))
    _, plain = gathered(_tiny(**z3, **{"training.quantization": "none"}))
    quantized = [p for p in wl.params if p.packed_bytes is not None]
    assert quantized and all(p.stored_numel(2) == p.numel // 4 for p in quantized)   # bf16 elements of packed bytes
    # every quantized weight moves numel / 2 bytes instead of 2 * numel
    assert plain - q == pytest.approx(sum(2 * p.numel - p.numel / 2 for p in quantized))


def test_mixtral_qlora_base_weights_one_gpu():
    # Mixtral-8x7B (46.7 B) on one GPU, ZeRO-0: under transformers 4 (experts as nn.Linear modules)
    # the QLoRA base weights hold 24.5 GB (22.8 GiB) against 93.4 GB (87.0 GiB) in bf16
    base = {"model": {"hf_config": str(ROOT / "scenarios/hub/mistralai--Mixtral-8x7B-v0.1.json")}, "hardware.gpus_per_node": 1, "training.seq_len": 512,
            "training.micro_batch_size": 1, "deepspeed.zero_optimization.stage": 0,
            "training.lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}}
    nf4 = {"training.quantization": "nf4", "training.double_quant": True}
    wl = workload_for(scenario(**base, **nf4, **{"training.experts_implementation": "modules"}))
    stored = sum(wl.stored_numels(2)) * 2 + wl.quant_state_bytes
    assert 22.5 * 2**30 < stored < 23 * 2**30
    wl16 = workload_for(scenario(**base))
    assert 86 * 2**30 < wl16.n_params * 2 < 88 * 2**30
    # transformers 5: bitsandbytes replaces nn.Linear modules only, and the experts are 3D
    # parameters (see [Note: transformers 5 MoE experts]): 45.1 B of the 46.7 B stay bf16
    wl5 = workload_for(scenario(**base, **nf4))
    experts = sum(p.numel for p in wl5.params if p.expert)
    assert experts == 32 * 8 * 3 * 4096 * 14336      # layers x experts x (w1, w3, w2) x hidden x ffn
    assert all(p.packed_bytes is None for p in wl5.params if p.expert)
    # 84.0 GiB of bf16 experts, and the attention's nf4 weights, the embeddings and norms (1.14 GiB)
    stored5 = sum(wl5.stored_numels(2)) * 2 + wl5.quant_state_bytes
    assert 85 * 2**30 < stored5 < 85.5 * 2**30


def test_refusals_are_one_line(tmp_path, capsys):
    with pytest.raises(ZsimInputError, match="training.quantization"):
        workload_for(scenario(**TINY_LLAMA, **{"training.quantization": "nf4"}))     # no adapters
    with pytest.raises(ZsimInputError, match="tensor or pipeline"):
        quantization_notes("nf4", 2, 1, 2)
    lf = tmp_path / "lf.yaml"
    ds = tmp_path / "z3.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}}))
    lf.write_text(f"model_name_or_path: llama2-7b\nstage: sft\nfinetuning_type: lora\nquantization_bit: 8\n"
                  f"deepspeed: {ds}\n")
    assert main(["run", str(lf), "--gpus", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quantization_bit" in err[0] and "ZeRO-3" in err[0]
    with pytest.raises(ZsimInputError, match="quantization_method"):
        read_recipe_file(_write(tmp_path, "q.yaml", "model_name_or_path: x\nstage: sft\nquantization_bit: 4\n"
                                "quantization_method: gptq\n"), tmp_path, Recipe(origin="t"))
    with pytest.raises(ZsimInputError, match="load_in_4bit"):
        read_recipe_file(_write(tmp_path, "a.yaml", "base_model: x\nadapter: qlora\n"), tmp_path, Recipe(origin="t"))


def _write(d: Path, name: str, text: str) -> Path:
    (d / name).write_text(text)
    return d / name


def test_zero3_int8_is_noted():
    sc = _tiny(**{"training.quantization": "int8", "deepspeed.zero_optimization.stage": 3})
    assert any("bitsandbytes#1451" in n for n in sc.notes)


def test_input_paths(tmp_path):
    ax = read_recipe_file(ROOT / "tests/fixtures/real_inputs/axolotl/mixtral.yml", tmp_path, Recipe(origin="t"),
                          {"deepspeed": None})
    assert ax.training["quantization"] == "nf4" and ax.training["double_quant"] is True
    assert "lora" in ax.training
    ax8 = read_recipe_file(_write(tmp_path, "a8.yaml", "base_model: x\nadapter: lora\nload_in_8bit: true\n"),
                           tmp_path, Recipe(origin="t"))
    assert ax8.training["quantization"] == "int8"
    ax4 = read_recipe_file(_write(tmp_path, "a4.yaml", "base_model: x\nadapter: lora\nload_in_4bit: true\n"),
                           tmp_path, Recipe(origin="t"))
    assert "quantization" not in ax4.training and any("qlora only" in n for n in ax4.notes)
    lf = read_recipe_file(_write(tmp_path, "lf.yaml", "model_name_or_path: x\nstage: sft\nquantization_bit: 4\n"
                                 "quantization_type: fp4\n"), tmp_path, Recipe(origin="t"))
    assert lf.training["quantization"] == "fp4" and lf.training["double_quant"] is True
    trl = read_trainer_args({"use_peft": True, "load_in_4bit": True}, Recipe(origin="t"))
    assert trl.training["quantization"] == "nf4" and trl.training["double_quant"] is False   # ModelConfig's defaults
    nested = read_trainer_args({"use_peft": True, "load_in_4bit": True, "use_bnb_nested_quant": "true",
                                "bnb_4bit_quant_type": "fp4"}, Recipe(origin="t"))
    assert nested.training == {"lora": {}, "quantization": "fp4", "double_quant": True}
    with pytest.raises(ZsimInputError, match="load_in_4bit"):
        read_trainer_args({"load_in_4bit": True, "load_in_8bit": True}, Recipe(origin="t"))


def test_launch_command_and_config_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["run", "--json", str(out), "--model", "llama2-7b", "--", "torchrun", "--nproc_per_node", "8",
               "sft.py", "--use_peft", "--load_in_4bit", "--per_device_train_batch_size", "1", "--bf16",
               "--max_seq_length", "512"])
    assert rc == 0, capsys.readouterr().err
    assert "base linears 4-bit nf4" in json.loads(out.read_text())["implementation"]
    cfg = json.loads((ROOT / "scenarios/hub/mistralai--Mixtral-8x7B-v0.1.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                  "bnb_4bit_use_double_quant": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from zsim.config.hf_config import read_hf_config
    notes: list = []
    read_hf_config(tmp_path / "config.json", notes=notes)
    assert any("training.quantization=nf4 training.double_quant=true" in n for n in notes)


def test_tune_memory_bound_counts_the_packed_weights():
    """tune's and the doctor's memory lower bound (search/tune.py workload_terms) reads a QLoRA
    weight at its stored size: it stays under the simulated peak, and under the 16-bit run's bound
    by the bytes the packing saves (it used to count 16-bit weights, ruling out runs that fit)."""
    from zsim.api import run_scenario
    from zsim.search.tune import memory_lower_bound
    q = _tiny(**{"training.lora": {"rank": 8, "target_modules": "all-linear"}})
    plain = _tiny(**{"training.lora": {"rank": 8, "target_modules": "all-linear"}, "training.quantization": "none"})
    bound_q, bound_16 = memory_lower_bound(q), memory_lower_bound(plain)
    wl = workload_for(q)
    saved = sum(2 * p.numel - 2 * p.stored_numel(2) for p in wl.params) - wl.quant_state_bytes
    assert bound_16 - bound_q == pytest.approx(saved, rel=1e-9)
    result, _ = run_scenario(q)
    assert bound_q <= result.memory.peak_bytes
