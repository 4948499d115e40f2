"""Rules found by running public files zsim had not seen (tests/fixtures/real_inputs/, the second
batch of SOURCES.csv): each as DeepSpeed, accelerate, axolotl or LLaMA-Factory reads it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zsim.cli import main

DS_BF16_AUTOCAST = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                    "zero_optimization": {"stage": 3}, "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}}


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.chdir(tmp_path)


def run(capsys, *argv) -> tuple[int, list[str], dict | None]:
    out = Path("result.json")
    out.unlink(missing_ok=True)
    rc = main(["run", *argv, "--quiet", "--json", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return rc, err, json.loads(out.read_text()) if rc == 0 else None


def write(name: str, text: str) -> str:
    Path(name).write_text(text)
    return name


def test_torch_autocast_beside_bf16_is_a_warning_not_a_refusal(capsys):
    # DeepSpeedExamples training/bf16_master_weight/configs/bf16_full.json: DeepSpeed casts the
    # weights to bf16 whatever torch_autocast says (engine.py _cast_module_mixed_precision)
    rc, err, res = run(capsys, write("ds.json", json.dumps(DS_BF16_AUTOCAST)), "--model", "gpt3-1.3b", "--gpus", "8")
    assert rc == 0 and res["precision"] == "bf16"
    assert any(w.startswith("deepspeed.torch_autocast: ") for w in res["warnings"]), res["warnings"]
    # without a 16-bit block the weights stay fp32: still refused (the verdict would change)
    fp32 = {k: v for k, v in DS_BF16_AUTOCAST.items() if k != "bf16"}
    rc, err, _ = run(capsys, write("ds32.json", json.dumps(fp32)), "--model", "gpt3-1.3b", "--gpus", "8")
    assert rc == 2 and len(err) == 1 and "deepspeed.torch_autocast" in err[0]


def test_an_hf_trainer_ds_config_without_zero_optimization_is_refused_as_accelerate_refuses_it(capsys):
    # DeepSpeedExamples training/autotuning/hf/dsconfigs/ds_config_tune.json: "auto" makes it the
    # HF Trainer's, whose accelerate DeepSpeedPlugin raises "Please specify the ZeRO optimization config"
    auto = {"train_micro_batch_size_per_gpu": "auto", "autotuning": {"enabled": True}}
    rc, err, _ = run(capsys, write("hf.json", json.dumps(auto)), "--model", "gpt3-1.3b", "--gpus", "8")
    assert rc == 2 and len(err) == 1 and err[0].startswith("zsim: error: deepspeed.zero_optimization:")
    # DeepSpeed's own launcher runs the same settings without the block at stage 0
    rc, err, res = run(capsys, write("ds.json", json.dumps({"train_micro_batch_size_per_gpu": 1})),
                       "--model", "gpt3-1.3b", "--gpus", "8")
    assert rc == 0 and res["stage"] == 0


def test_a_recipe_without_deepspeed_still_runs_as_ddp(capsys):
    rc, err, res = run(capsys, write("r.yaml", "model_name_or_path: gpt3-1.3b\nstage: sft\nfinetuning_type: full\n"
                                               "per_device_train_batch_size: 1\nbf16: true\n"), "--gpus", "8")
    assert rc == 0 and res["stage"] == 0, err


def test_axolotl_rl_is_simulated_as_preference_training_or_refused(capsys):
    # axolotl examples/qwen2/dpo.yaml (rl: dpo) had simulated as plain SFT without a word; it is
    # now TRL's DPO step (see [Note: preference training]), and what zsim does not model is refused
    recipe = write("dpo.yaml", "base_model: gpt3-1.3b\nrl: dpo\nmicro_batch_size: 1\nsequence_len: 512\n")
    rc, err, res = run(capsys, recipe, "--gpus", "8")
    assert rc == 0 and "dpo: chosen and rejected sequences" in res["implementation"], err
    assert res["reference_params"] == res["n_params"]          # full fine-tuning: a frozen copy
    assert any("rl dpo: each example's chosen and rejected sequences" in line for line in err)
    recipe = write("kto.yaml", "base_model: gpt3-1.3b\nrl: kto\nmicro_batch_size: 1\nsequence_len: 512\n")
    rc, err, _ = run(capsys, recipe, "--gpus", "8")
    assert rc == 2 and len(err) == 1 and err[0].startswith("zsim: error: kto.yaml: rl: 'kto' is invalid")


def test_llama_factory_pure_bf16_and_galore_are_said_not_dropped(capsys):
    # LLaMA-Factory examples/extras/galore/llama3_full_sft.yaml: pure_bf16 loads bf16 weights (it had
    # been priced as fp32, neither bf16 nor fp16 being set); GaLore's states are named as left out
    recipe = write("galore.yaml", "model_name_or_path: gpt3-1.3b\nstage: sft\nfinetuning_type: full\n"
                                  "use_galore: true\ngalore_rank: 128\npure_bf16: true\n"
                                  "per_device_train_batch_size: 1\n")
    rc, err, res = run(capsys, recipe, "--gpus", "8")
    assert rc == 0 and res["precision"] == "bf16", err
    text = "\n".join(err)
    assert "pure_bf16" in text and "use_galore True (GaLore's low-rank optimizer states are not modelled" in text
    assert "galore_rank" not in text      # read with its switch, not listed as unknown


def test_axolotl_attn_implementation_and_cut_cross_entropy_are_read(capsys):
    # axolotl examples/gpt-oss/*.yaml: attn_implementation names a Hub kernel, the CCE plugin
    # computes the loss without materialising the logits
    recipe = write("oss.yaml", "base_model: gpt3-1.3b\nmicro_batch_size: 1\nsequence_len: 512\n"
                               "attn_implementation: kernels-community/vllm-flash-attn3\n"
                               "plugins:\n  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin\n")
    rc, err, res = run(capsys, recipe, "--gpus", "8")
    assert rc == 0 and res["implementation"].startswith("implementation: attention flash_attention_3"), err
    assert any("CutCrossEntropyPlugin: the loss priced as a fused" in line for line in err)
    assert not any("plugins" in line and "not modelled" in line for line in err)
    recipe = write("bad.yaml", "base_model: gpt3-1.3b\nmicro_batch_size: 1\nattn_implementation: paged_attention\n")
    rc, err, _ = run(capsys, recipe, "--gpus", "8")
    assert rc == 2 and err[-1].startswith("zsim: error: bad.yaml: attn_implementation: 'paged_attention' is invalid")


def test_axolotl_canonical_attention_names_and_offloaded_checkpointing(capsys):
    # axolotl schemas/enums.py CANONICAL_ATTN_IMPLS (xformers, sage, ...), its short forms refused;
    # gradient_checkpointing: offload (examples/llama-4, examples/qwen3/32b-qlora.yaml)
    recipe = write("x.yaml", "base_model: gpt3-1.3b\nmicro_batch_size: 1\nsequence_len: 512\n"
                             "attn_implementation: xformers\ngradient_checkpointing: offload\n")
    rc, err, res = run(capsys, recipe, "--gpus", "8")
    assert rc == 0 and "attention flash_attention_2" in res["implementation"], err
    assert any("gradient_checkpointing offload (the checkpoints' offload is not modelled" in line for line in err)
    recipe = write("y.yaml", "base_model: gpt3-1.3b\nmicro_batch_size: 1\nattn_implementation: flash\n")
    rc, err, _ = run(capsys, recipe, "--gpus", "8")
    assert rc == 2 and "use the canonical name flash_attention_2" in err[-1]


LF_V1_DS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 2}}


def test_llama_factory_v1_recipes(capsys):
    # LLaMA-Factory examples/v1/ (src/llamafactory/v1/config/): model, plugin blocks, the batch from
    # global_batch_size / (dp x micro_batch_size)
    write("ds_z2.json", json.dumps(LF_V1_DS))
    recipe = write("v1.yaml", "model: gpt3-1.3b\nmodel_class: llm\nmicro_batch_size: 2\nglobal_batch_size: 64\n"
                              "cutoff_len: 1024\npeft_config: {name: lora, r: 16, target_modules: all}\n"
                              "quant_config: {name: bnb, quantization_bit: 4}\n"
                              "dist_config: {name: deepspeed, config_file: ds_z2.json}\n")
    rc, err, res = run(capsys, recipe, "--gpus", "8")
    assert rc == 0, err
    assert (res["micro_batch_size"], res["gradient_accumulation_steps"], res["seq_len"], res["stage"]) == (2, 4, 1024, 2)
    assert "4-bit nf4 with double quant" in res["implementation"] and res["trainable_params"] < res["n_params"]
    assert any("takes the trainer from its command" in line for line in err)
    recipe = write("v1f.yaml", "model: gpt3-1.3b\nmodel_class: llm\npeft_config: {name: freeze}\n"
                               "dist_config: {name: deepspeed, config_file: ds_z2.json}\n")
    rc, err, res = run(capsys, recipe, "--gpus", "8")
    assert rc == 0 and 0 < res["trainable_params"] < res["n_params"] / 10, err
    recipe = write("v1s.yaml", "model: gpt3-1.3b\nmodel_class: llm\ndist_config: {name: fsdp2}\n")
    rc, err, _ = run(capsys, recipe, "--gpus", "8")
    assert rc == 2 and len(err) == 1 and "dist_config.name: 'fsdp2' is invalid" in err[0]
    recipe = write("v1g.yaml", "model: gpt3-1.3b\nmodel_class: llm\nmicro_batch_size: 3\nglobal_batch_size: 64\n")
    rc, err, _ = run(capsys, recipe, "--gpus", "8")
    assert rc == 2 and "global_batch_size: 64 is invalid; must be divisible" in err[-1]


def launched(capsys, *words) -> tuple[int, list[str], dict | None]:
    """`zsim run --gpus 8 --quiet --json result.json -- <words>`."""
    out = Path("result.json")
    out.unlink(missing_ok=True)
    rc = main(["run", "--gpus", "8", "--quiet", "--json", str(out), "--", *words])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return rc, err, json.loads(out.read_text()) if rc == 0 else None


def test_llama_factory_v1_dpo_command(capsys):
    # `llamafactory-cli dpo` on a v1 recipe (v1/launcher.py, trainers/dpo_trainer.py): the pair in
    # one row (no doubled batch), the reference the adapters disabled under lora
    write("ds_z2.json", json.dumps(LF_V1_DS))
    write("v1.yaml", "model: gpt3-1.3b\nmodel_class: llm\ncutoff_len: 1024\npeft_config: {name: lora}\n"
                     "dist_config: {name: deepspeed, config_file: ds_z2.json}\n")
    rc, err, sft = run(capsys, "v1.yaml", "--gpus", "8")
    assert rc == 0, err
    rc, err, dpo = launched(capsys, "llamafactory-cli", "dpo", "v1.yaml")
    assert rc == 0 and "dpo: chosen and rejected completions in one sequence" in dpo["implementation"], err
    assert dpo["tokens_per_s"] * dpo["step_time_s"] == pytest.approx(sft["tokens_per_s"] * sft["step_time_s"])
    assert dpo["step_time_s"] > sft["step_time_s"]          # the reference forward
    assert not any("takes the trainer from its command" in line for line in err)
    rc, err, _ = launched(capsys, "llamafactory-cli", "dpo", write("v0.yaml", "model_name_or_path: gpt3-1.3b\n"
                                                                      "stage: sft\n"))
    assert rc == 2 and "take a v1 recipe" in err[-1]


def test_axolotl_experts_implementation_is_read(capsys):
    # axolotl examples/expert_parallel/*.yaml (grouped_mm), examples/gemma4 (scattermoe,
    # quantize_moe_experts): see [Note: transformers 5 MoE experts]
    hub = str(Path(__file__).resolve().parents[2] / "scenarios/hub/Qwen--Qwen3-30B-A3B.json")
    base = f"base_model: {hub}\nmicro_batch_size: 1\nsequence_len: 512\n"
    rc, err, res = run(capsys, write("g.yaml", base + "experts_implementation: grouped_mm\n"), "--gpus", "8")
    assert rc == 0 and res["implementation"].endswith("experts grouped_mm (transformers 5: one grouped GEMM per "
                                                       "projection)"), err
    rc, err, res = run(capsys, write("e.yaml", base + "experts_implementation: eager\n"), "--gpus", "8")
    assert rc == 0 and "experts eager" in res["implementation"]
    rc, err, res = run(capsys, write("s.yaml", base + "experts_implementation: scattermoe\n"
                                     "quantize_moe_experts: true\n"), "--gpus", "8")
    assert rc == 0 and "experts grouped_mm" in res["implementation"]
    assert any("scattermoe: priced as grouped_mm" in line for line in err)
    assert any("quantize_moe_experts" in line and "not modelled" in line for line in err)
    rc, err, _ = run(capsys, write("b.yaml", base + "experts_implementation: batched_mm\n"), "--gpus", "8")
    assert rc == 2 and err[-1].startswith("zsim: error: b.yaml: experts_implementation: 'batched_mm' is invalid")
