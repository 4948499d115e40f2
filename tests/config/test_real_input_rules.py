"""Issue 46: odd but real inputs read as DeepSpeed 0.19.8, the HF Trainer and their launchers read them
(1-bit optimizers, trailing commas, QLoRA, reward models, bf16 defaults, tune's answer in the user's format)."""
from __future__ import annotations

import json

import pytest

from tests.helpers import scenario


@pytest.mark.parametrize("name, instead", [("OneBitAdam", "use Adam"), ("zerooneadam", "use Adam"),
                                           ("OneBitLamb", "use Lamb")])
def test_the_1bit_optimizers_deepspeed_removed_are_refused_as_its_engine_refuses_them(name, instead):
    """DeepSpeed 0.19.7 removed them (deepspeedai/DeepSpeed#8490); 0.19.8's deepspeed.initialize
    asserts '<name> is not a supported DeepSpeed Optimizer' (measured: engine.py _do_sanity_check)."""
    with pytest.raises(Exception) as exc:
        scenario(**{"deepspeed.optimizer": {"type": name, "params": {"freeze_step": 400}},
                    "deepspeed.zero_optimization.stage": 0})
    text = str(exc.value)
    assert "deepspeed.optimizer.type" in text and "0.19.7 removed" in text and instead in text


# -- trailing commas: the run's reader decides (see [Note: trailing commas in a ds_config]) ------------------
TRAILING = '{\n  "train_micro_batch_size_per_gpu": 1,\n  "zero_optimization": {"stage": 2,},\n  "bf16": {"enabled": true},\n}\n'


@pytest.mark.parametrize("text, kept, first", [
    ('{"a": 1,}', '{"a": 1}', (1, 8)),
    ('{\n  "a": [1, 2 ,\n ],\n}', '{\n  "a": [1, 2 \n ]\n}', (2, 14)),
    ('{"a": "x,}", "b": "\\\\",}', '{"a": "x,}", "b": "\\\\"}', (1, 23)),   # commas inside strings stay
    ('{"a": 1}', '{"a": 1}', None),
    # hjson 3.1.0 refuses these (measured): they are left for json to refuse
    ('{"a": 1,,}', '{"a": 1,,}', None), ('{,}', '{,}', None), ('{"a": [,]}', '{"a": [,]}', None),
])
def test_drop_trailing_commas_follows_hjson(text, kept, first):
    from zsim.inputs import drop_trailing_commas
    assert drop_trailing_commas(text) == (kept, first)


def _run_ds(tmp_path, capsys, text, *args):
    from zsim.cli import main
    ds = tmp_path / "ds.json"
    ds.write_text(text)
    code = main(["run", str(ds), "--model", "gpt3-1.3b", "--gpus", "8", "--quiet", *args])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_a_trailing_comma_deepspeed_reads_itself_is_accepted_with_a_note(tmp_path, capsys):
    """A bare ds_config (DeepSpeed's launcher hands the path to DeepSpeedConfig: hjson.load)."""
    code, err = _run_ds(tmp_path, capsys, TRAILING)
    assert code == 0
    notes = [line for line in err if "trailing comma" in line]
    assert len(notes) == 1 and "line 3, column 35" in notes[0] and "hjson" in notes[0] and "json.load" in notes[0]
    # the same values as without the commas
    from zsim.config.scenario import load_scenario
    from zsim.config.source import cluster_overrides
    clean = tmp_path / "clean.json"
    clean.write_text(TRAILING.replace(",}", "}").replace(",\n}", "\n}"))
    sets = cluster_overrides(True, "x", "gpt3-1.3b", 8, 1, None)
    assert load_scenario(tmp_path / "ds.json", sets).deepspeed == load_scenario(clean, sets).deepspeed


def test_a_trailing_comma_under_the_hf_trainer_is_refused_in_one_line(tmp_path, capsys):
    code, err = _run_ds(tmp_path, capsys, TRAILING, "--set", "training.framework=hf_trainer")
    assert code == 2 and len(err) == 1 and err[0].startswith("zsim: error:")
    assert "ds.json" in err[0] and "line 3, column 35" in err[0] and "json.load" in err[0] and "HF Trainer" in err[0]


def test_a_recipe_naming_a_ds_config_with_a_trailing_comma_is_refused(tmp_path, capsys, monkeypatch):
    """axolotl/LLaMA-Factory run the HF Trainer, which json.loads the file."""
    from zsim.cli import main
    (tmp_path / "ds.json").write_text(TRAILING)
    (tmp_path / "lf.yaml").write_text("model_name_or_path: gpt3-1.3b\nstage: sft\nfinetuning_type: full\n"
                                      "deepspeed: ds.json\nper_device_train_batch_size: 1\nbf16: true\ncutoff_len: 512\n")
    monkeypatch.chdir(tmp_path)
    code = main(["run", "lf.yaml", "--gpus", "8", "--quiet"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("zsim: error:")]
    assert code == 2 and len(err) == 1 and "trailing comma" in err[0] and "line 3, column 35" in err[0]


def test_other_json_files_keep_refusing_a_trailing_comma(tmp_path):
    from zsim.config.hf_config import read_hf_config
    from zsim.errors import ZsimInputError
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama",}')
    with pytest.raises(ZsimInputError, match="trailing comma"):
        read_hf_config(cfg)


# -- the bf16 block and the host buffers' labels -------------------------------------------------------------
def test_the_bf16_block_defaults_are_deepspeeds():
    """DeepSpeed 0.19.8 runtime/precision_config.py DeepSpeedBF16Config: immediate_grad_update False,
    check_grad_overflow True (PR #6976: bf16 checks overflow as fp16 does)."""
    from dataclasses import asdict
    from zsim.schema import build
    from zsim.specs.deepspeed import Bf16Config
    assert asdict(build(Bf16Config, {}, "deepspeed.bf16")) == {
        "enabled": False, "immediate_grad_update": False, "check_grad_overflow": True,
        "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}


@pytest.mark.parametrize("precision, width", [("bf16", "16-bit"), ("fp32", "fp32")])
def test_host_buffers_are_labelled_by_the_model_dtype(precision, width):
    """ZeRO-3 with optimizer and parameter offload: the host's gradient accumulation buffer and
    parameters are in the model dtype (stage3.py grad_partitions_flat_buffer, the offloaded
    partitions), 16-bit under bf16, fp32 under fp32 training."""
    from zsim.api import run_scenario
    sc = scenario(**{"training.precision": precision, "deepspeed.zero_optimization.stage": 3,
                     "deepspeed.zero_optimization.offload_optimizer": {"device": "cpu"},
                     "deepspeed.zero_optimization.offload_param": {"device": "cpu"}})
    host = run_scenario(sc)[0].to_dict()["memory"]["host"]["breakdown"]
    labels = {k for k in host if "(" in k and "pinned" not in k and "NVMe" not in k}
    assert labels == {f"gradient accumulation buffer ({width})", f"parameters ({width})"}
    assert host[f"parameters ({width})"] / host[f"gradient accumulation buffer ({width})"] == pytest.approx(1.0)
    assert host[f"parameters ({width})"] > 0


# -- zsim tune --write answers in the user's own recipe format ----------------------------------------------
AXOLOTL = """base_model: gpt3-1.3b  # the model
sequence_len: 512
micro_batch_size: 1   # per GPU
gradient_accumulation_steps: 4
gradient_checkpointing: true
lora_target_modules:
  - q_proj
  - v_proj
deepspeed: deepspeed_configs/zero3.json
"""


def test_the_recipe_writer_edits_only_the_changed_lines():
    from zsim.config.recipe_writer import tuned_recipe
    text, written = tuned_recipe(AXOLOTL, "axolotl", micro_batch=2, gas=2, checkpointing="none",
                                 deepspeed="deepspeed_configs/zero3.tuned.json")
    assert written == ["micro_batch_size: 2", "gradient_accumulation_steps: 2", "gradient_checkpointing: false",
                       "deepspeed: deepspeed_configs/zero3.tuned.json"]
    expected = (AXOLOTL.replace("micro_batch_size: 1   # per GPU", "micro_batch_size: 2   # per GPU")
                .replace("gradient_accumulation_steps: 4", "gradient_accumulation_steps: 2")
                .replace("gradient_checkpointing: true", "gradient_checkpointing: false")
                .replace("zero3.json", "zero3.tuned.json"))
    assert text == expected
    # LLaMA-Factory: its own names, checkpointing inverted, a missing key appended, a block value replaced
    lf = "model_name_or_path: x\nper_device_train_batch_size: 1\ndeepspeed:\n  - old\nbf16: true\n"
    text, _ = tuned_recipe(lf, "llama_factory", micro_batch=4, checkpointing="full", deepspeed="ds.json")
    assert text == ("model_name_or_path: x\nper_device_train_batch_size: 4\ndeepspeed: ds.json\nbf16: true\n"
                    "disable_gradient_checkpointing: false\n")


def test_tune_write_on_a_recipe_writes_the_recipe_beside_it(tmp_path, monkeypatch, capsys):
    import yaml
    from zsim.cli import main
    (tmp_path / "deepspeed_configs").mkdir()
    ds = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"},
          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    (tmp_path / "deepspeed_configs" / "zero3.json").write_text(json.dumps(ds))
    (tmp_path / "recipe.yml").write_text(AXOLOTL + "bf16: true\n")
    monkeypatch.chdir(tmp_path)
    code = main(["tune", "recipe.yml", "--gpus", "8", "--budget", "3", "--top", "1", "--write"])
    err = capsys.readouterr().err
    assert code == 0
    assert (tmp_path / "recipe.yml").read_text() == AXOLOTL + "bf16: true\n"        # the user's file untouched
    tuned = (tmp_path / "recipe.tuned.yml").read_text()
    assert "# the model" in tuned and "# per GPU" in tuned                           # comments kept
    data = yaml.safe_load(tuned)
    assert data["lora_target_modules"] == ["q_proj", "v_proj"] and data["sequence_len"] == 512
    assert data["micro_batch_size"] * data["gradient_accumulation_steps"] == 4       # the global batch kept
    assert "recipe.tuned.yml" in err
    if data["deepspeed"] != "deepspeed_configs/zero3.json":
        assert data["deepspeed"] == "deepspeed_configs/zero3.tuned.json"
        assert (tmp_path / "deepspeed_configs" / "zero3.tuned.json").is_file()
    # a second --write refuses to replace the first without --force
    assert main(["tune", "recipe.yml", "--gpus", "8", "--budget", "3", "--write"]) == 2


def test_zero_plus_plus_keys_outside_stage_3_are_ignored_as_deepspeed_ignores_them():
    """DeepSpeed 0.19.8 applies ZeRO++ at stage 3 only (tests/fixtures/deepspeed_zeropp/
    stage2_hpz2_w2.json: stage 2's calls unchanged): zsim accepts the keys there with a warning;
    at stage 3 it models them (tests/calibration/test_zeropp.py)."""
    from zsim.config.scenario import scenario_from_mapping
    from zsim.errors import ZsimInputError

    def load(stage, **zero):
        return scenario_from_mapping({
            "name": "t", "model": {"preset": "gpt2"}, "hardware": {"profile": "dgx-a100-80g", "nodes": 1},
            "training": {"micro_batch_size": 1, "seq_len": 128},
            "deepspeed": {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage, **zero}}}, None)
    sc = load(2, zero_hpz_partition_size=8, zero_quantized_gradients=True)
    assert [w.split(":")[0] for w in sc.warnings] == ["deepspeed.zero_optimization.zero_hpz_partition_size",
                                                      "deepspeed.zero_optimization.zero_quantized_gradients"]
    assert "ignores it at stage 2" in sc.warnings[0]
    assert load(3, zero_hpz_partition_size=8).deepspeed.zero_optimization.zero_hpz_partition_size == 8
    assert load(3, zero_quantized_gradients=True).deepspeed.zero_optimization.zero_quantized_gradients
    with pytest.raises(ZsimInputError, match="zero_quantized_gradients"):
        load(3, zero_quantized_gradients=True, reduce_scatter=False)     # DeepSpeed's assert
    assert load(3, zero_quantized_nontrainable_weights=True).warnings == ()   # nothing frozen: no effect
