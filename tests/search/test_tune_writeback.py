"""zsim tune --write answers in the user's own file: an accelerate config YAML (its DeepSpeed plugin
keys edited in place, or a deepspeed_config_file) and a launch script (the training script's flags
edited in place, every other byte kept). The axolotl / LLaMA-Factory writer is tested in
tests/config/test_real_input_rules.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from zsim.cli import main

ACCELERATE = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 4  # per optimizer step
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 2
distributed_type: DEEPSPEED
# precision for every process
mixed_precision: bf16
num_machines: 1
num_processes: 8
"""

SCRIPT = """#!/bin/bash
# fine-tune on one node
GPUS=8
MB=1
export NCCL_DEBUG=INFO

deepspeed --num_gpus $GPUS train.py \\
    --model_name_or_path gpt3-1.3b \\
    --per_device_train_batch_size $MB \\
    --gradient_accumulation_steps=4 \\
    --bf16 \\
    --gradient_checkpointing \\
    --deepspeed ds/zero2.json   # the ZeRO config
echo "done: $?"
"""
ZERO2 = {"zero_optimization": {"stage": 2}, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"}}


def _lines_kept(before: str, after: str, changed: set[int]):
    """Every line of `before` but those numbered in `changed` (0-based) is in `after`, byte for byte, in order."""
    old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
    assert len(old) == len(new)
    assert [i for i, (a, b) in enumerate(zip(old, new)) if a != b] == sorted(changed)


# -- the nested line editor ------------------------------------------------------------------------------------
def test_set_nested_edits_in_place_adds_at_the_block_end_and_keeps_comments():
    from zsim.config.recipe_writer import drop_nested, set_nested
    text = set_nested(ACCELERATE, "deepspeed_config", "gradient_accumulation_steps", 2)
    assert "  gradient_accumulation_steps: 2  # per optimizer step\n" in text
    text = set_nested(text, "deepspeed_config", "offload_optimizer_nvme_path", "/local_nvme")
    assert text.splitlines()[10] == "  offload_optimizer_nvme_path: /local_nvme"   # the block's last line
    assert text.splitlines()[11] == "distributed_type: DEEPSPEED"
    text = drop_nested(text, "deepspeed_config", "gradient_clipping")
    assert "gradient_clipping" not in text and "# precision for every process" in text
    assert yaml.safe_load(text)["deepspeed_config"]["zero_stage"] == 2
    # a missing block is added; an empty flow mapping becomes a block; a filled one is refused
    assert set_nested("a: 1\n", "deepspeed_config", "zero_stage", 3) == "a: 1\ndeepspeed_config:\n  zero_stage: 3\n"
    assert set_nested("deepspeed_config: {}  # x\nb: 2\n", "deepspeed_config", "zero_stage", 3) == \
        "deepspeed_config:  # x\n  zero_stage: 3\nb: 2\n"
    from zsim.errors import ZsimInputError
    with pytest.raises(ZsimInputError, match="deepspeed_config"):
        set_nested("deepspeed_config: {zero_stage: 2}\n", "deepspeed_config", "zero_stage", 3)


def test_plugin_changes_split_what_the_inline_plugin_can_say():
    from zsim.config.accelerate_writer import plugin_changes
    base = {"gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}}
    tuned = {"gradient_accumulation_steps": 2, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"pin_memory": True, "device": "cpu"}}}
    assert plugin_changes(base, tuned, False) == (
        {"gradient_accumulation_steps": 2, "offload_optimizer_device": "cpu", "zero_stage": 3}, [])
    tuned["zero_optimization"]["stage3_prefetch_bucket_size"] = 50_000_000
    tuned["optimizer"] = {"type": "AdamW", "params": {"lr": 0.001}}
    keys, other = plugin_changes(base, tuned, False)
    assert other == ["optimizer.params.lr", "optimizer.type", "zero_optimization.stage3_prefetch_bucket_size"]
    # an optimizer block for an optimizer the run already offloaded is not a reason for a file
    assert plugin_changes(base, tuned, True)[1] == ["zero_optimization.stage3_prefetch_bucket_size"]
    # "auto" kept for the Trainer to fill is not a plugin key
    assert plugin_changes({"gradient_accumulation_steps": "auto"}, {"gradient_accumulation_steps": "auto"}, False) \
        == ({}, [])


def test_the_switch_to_a_file_follows_accelerates_rules(tmp_path):
    """accelerate refuses the plugin's own keys and a mixed_precision beside deepspeed_config_file
    (see [Note: accelerate's plugin keys beside a deepspeed_config_file]): they move into the file."""
    from zsim.config.accelerate_writer import file_config, file_plugin
    data = yaml.safe_load(ACCELERATE)
    text, written, moved = file_plugin(ACCELERATE, data, "acc.ds_config.tuned.json")
    assert moved == ["gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                     "offload_param_device", "zero3_save_16bit_model"]
    out = yaml.safe_load(text)
    assert out["deepspeed_config"] == {"zero3_init_flag": True, "deepspeed_config_file": "acc.ds_config.tuned.json"}
    assert out["mixed_precision"] is None and "# precision for every process" in text
    assert written == ["deepspeed_config.deepspeed_config_file: acc.ds_config.tuned.json", "mixed_precision: null"]
    cfg = file_config({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}, data)
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def _tune(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)
    code = main(["tune", *argv, "--budget", "4", "--top", "1", "--workers", "1", "--json", "rank.json"])
    err = capsys.readouterr().err
    best = json.loads((tmp_path / "rank.json").read_text())["candidates"][0] if code == 0 else None
    (tmp_path / "rank.json").unlink(missing_ok=True)
    return code, err, best


def test_tune_write_on_an_accelerate_config_writes_it_beside(tmp_path, monkeypatch, capsys):
    (tmp_path / "acc.yaml").write_text(ACCELERATE)
    code, err, best = _tune(tmp_path, monkeypatch, capsys, ["acc.yaml", "--model", "gpt3-1.3b", "--global-batch",
                                                            "128", "--fix", "deepspeed.zero_optimization.stage=3",
                                                            "--write"])
    assert code == 0, err
    assert (tmp_path / "acc.yaml").read_text() == ACCELERATE                      # the user's file untouched
    tuned_text = (tmp_path / "acc.tuned.yaml").read_text()
    tuned = yaml.safe_load(tuned_text)
    assert "# per optimizer step" in tuned_text or "deepspeed_config_file" in tuned["deepspeed_config"]
    assert "# precision for every process" in tuned_text
    plugin = tuned["deepspeed_config"]
    if "deepspeed_config_file" in plugin:        # the winner needs a key the inline plugin cannot set
        ds = json.loads((tmp_path / plugin["deepspeed_config_file"]).read_text())
        assert "accelerate's inline DeepSpeed plugin cannot set" in err
        assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"] == {"enabled": True}
        assert not set(plugin) & {"zero_stage", "gradient_accumulation_steps", "gradient_clipping"}
    else:
        assert plugin["zero_stage"] == 3 and not (tmp_path / "acc.ds_config.tuned.json").exists()
    # the micro-batch is the training script's argument: said with the HF flag
    assert best["micro_batch_size"] * best["gradient_accumulation_steps"] * 8 == 128
    assert f"--per_device_train_batch_size {best['micro_batch_size']}" in err
    # the written file is what zsim reads as the winner's ZeRO stage
    monkeypatch.chdir(tmp_path)
    assert main(["run", "acc.tuned.yaml", "--model", "gpt3-1.3b", "--set",
                 f"training.micro_batch_size={best['micro_batch_size']}", "--json", "run.json"]) == 0
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["stage"] == 3 and run["precision"] == "bf16" and run["micro_batch_size"] == best["micro_batch_size"]
    # a second --write refuses to replace the first without --force, which replaces only the output
    assert main(["tune", "acc.yaml", "--model", "gpt3-1.3b", "--budget", "2", "--write"]) == 2
    assert "--force" in capsys.readouterr().err


def test_tune_write_repoints_a_deepspeed_config_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "zero2.json").write_text(json.dumps(ZERO2))
    text = ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds/zero2.json  # shared\n"
            "  zero3_init_flag: false\nnum_processes: 8\n")
    (tmp_path / "acc.yaml").write_text(text)
    code, err, best = _tune(tmp_path, monkeypatch, capsys, ["acc.yaml", "--model", "gpt3-1.3b", "--fix",
                                                            "deepspeed.zero_optimization.stage=3", "--write"])
    assert code == 0, err
    tuned = (tmp_path / "acc.tuned.yaml").read_text()
    assert tuned == text.replace("ds/zero2.json  # shared", "ds/zero2.tuned.json  # shared")
    ds = json.loads((tmp_path / "ds" / "zero2.tuned.json").read_text())
    assert ds["zero_optimization"]["stage"] == 3 and ds["train_micro_batch_size_per_gpu"] == "auto"
    assert json.loads((tmp_path / "ds" / "zero2.json").read_text()) == ZERO2


# -- launch scripts --------------------------------------------------------------------------------------------
def _launch(text: str, tmp_path: Path):
    from zsim.config.launch import find_launch, read_launch, read_script
    path = tmp_path / "train.sh"
    path.write_text(text)
    line, raw, _ = find_launch(text, path, {})
    words, env = read_script(path)
    return line, raw, words, read_launch(words, tmp_path, str(path), env).script_index


def test_the_launch_writer_edits_only_the_flags_byte_for_byte(tmp_path):
    from zsim.config.launch_writer import tuned_launch
    line, raw, words, script = _launch(SCRIPT, tmp_path)
    text, written, notes = tuned_launch(SCRIPT, line, raw, script, "train.sh", micro_batch=4, gas=2,
                                        checkpointing="none", deepspeed="ds/zero2.tuned.json", values=words)
    assert text == (SCRIPT.replace("--per_device_train_batch_size $MB", "--per_device_train_batch_size 4")
                    .replace("--gradient_accumulation_steps=4", "--gradient_accumulation_steps=2")
                    .replace("--gradient_checkpointing \\", "--gradient_checkpointing false \\")
                    .replace("ds/zero2.json   # the ZeRO config", "ds/zero2.tuned.json   # the ZeRO config"))
    assert written == ["--per_device_train_batch_size 4", "--gradient_accumulation_steps 2",
                       "--gradient_checkpointing false", "--deepspeed ds/zero2.tuned.json"]
    # see [Note: a shell variable the tuner changes]
    assert notes == ["--per_device_train_batch_size was $MB (= 1) in train.sh: written as the value 4"]
    # checkpointing on where the flag is bare: nothing to write; absent flags are appended after the last word
    one = "torchrun --nproc_per_node 8 train.py --deepspeed 'my ds.json' --gradient_checkpointing=False\n"
    line, raw, words, script = _launch(one, tmp_path)
    text, written, _ = tuned_launch(one, line, raw, script, "train.sh", micro_batch=2, checkpointing="full",
                                    deepspeed="my ds.tuned.json")
    assert text == ("torchrun --nproc_per_node 8 train.py --deepspeed 'my ds.tuned.json' --gradient_checkpointing=True"
                    " --per_device_train_batch_size 2\n")
    line, raw, words, script = _launch(SCRIPT, tmp_path)
    assert tuned_launch(SCRIPT, line, raw, script, "train.sh", checkpointing="full")[0] == SCRIPT


def test_tune_write_on_a_launch_script_writes_name_tuned_sh(tmp_path, monkeypatch, capsys):
    from zsim.config.launch import read_launch, read_script
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "zero2.json").write_text(json.dumps(ZERO2))
    (tmp_path / "train.sh").write_text(SCRIPT)
    code, err, best = _tune(tmp_path, monkeypatch, capsys, ["train.sh", "--fix", "deepspeed.zero_optimization.stage=3",
                                                            "--write"])
    assert code == 0, err
    assert (tmp_path / "train.sh").read_text() == SCRIPT
    tuned = (tmp_path / "train.tuned.sh").read_text()
    changed = {8, 9, 11, 12} if best["activation_checkpointing"] == "none" else {8, 9, 12}
    if best["micro_batch_size"] == 1:
        changed.discard(8)
    _lines_kept(SCRIPT, tuned, changed)
    assert "--deepspeed ds/zero2.tuned.json   # the ZeRO config" in tuned
    assert json.loads((tmp_path / "ds" / "zero2.tuned.json").read_text())["zero_optimization"]["stage"] == 3
    # zsim reads the tuned script back as the winner
    words, env = read_script(tmp_path / "train.tuned.sh")
    recipe = read_launch(words, tmp_path, "train.tuned.sh", env)
    assert recipe.training["micro_batch_size"] == best["micro_batch_size"]
    assert recipe.training["gradient_accumulation_steps"] == best["gradient_accumulation_steps"]
    assert recipe.training["activation_checkpointing"] == best["activation_checkpointing"]
    assert recipe.ds_config == tmp_path / "ds" / "zero2.tuned.json"
    assert best["micro_batch_size"] * best["gradient_accumulation_steps"] == 4       # the run's global batch kept
    if best["micro_batch_size"] != 1:
        assert "--per_device_train_batch_size was $MB (= 1)" in err
    # --force replaces the output, never the input
    assert main(["tune", "train.sh", "--budget", "2", "--workers", "1", "--write", "--force"]) == 0
    assert (tmp_path / "train.sh").read_text() == SCRIPT


def test_tune_write_refuses_what_it_cannot_write_back(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps(ZERO2))
    launch = ["deepspeed", "--num_gpus", "8", "train.py", "--model_name_or_path", "gpt3-1.3b", "--deepspeed", "ds.json"]
    assert main(["tune", "--write", "--budget", "2", "--", *launch]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no file to write beside" in err
    # the HF Trainer's arguments as an HfArgumentParser YAML
    (tmp_path / "args.yaml").write_text("model_name_or_path: gpt3-1.3b\ndeepspeed: ds.json\n")
    (tmp_path / "run.sh").write_text("torchrun --nproc_per_node 8 train.py args.yaml\n")
    assert main(["tune", "run.sh", "--write", "--budget", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write back" in err
    # an accelerate launch whose DeepSpeed settings are the accelerate config's plugin
    (tmp_path / "acc.yaml").write_text(ACCELERATE)
    (tmp_path / "acc.sh").write_text("accelerate launch --config_file acc.yaml train.py --model_name_or_path gpt3-1.3b\n")
    assert main(["tune", "acc.sh", "--write", "--budget", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "zsim tune ACCELERATE_CONFIG.yaml --write" in err
    assert not list(tmp_path.glob("*.tuned*"))


def test_the_search_starts_from_the_gas_an_accelerate_plugin_fixes(tmp_path):
    """accelerate's plugin writes gradient_accumulation_steps as a number beside an "auto"
    micro-batch: the global batch counts it and the search's start keeps it."""
    from zsim.commands.tune import batch_overrides
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}}))
    from zsim.config.source import cluster_overrides
    flags = cluster_overrides(True, str(path), "gpt3-1.3b", 8, None, None)
    sets, note = batch_overrides(str(path), flags, None)
    assert sets == ("training.micro_batch_size=8", "training.gradient_accumulation_steps=4")
    assert "global batch is 256" in note
    assert batch_overrides(str(path), flags, 64) == (("training.micro_batch_size=2",
                                                      "training.gradient_accumulation_steps=4"), "")
    from zsim.errors import ZsimInputError
    with pytest.raises(ZsimInputError, match="multiple of 32"):
        batch_overrides(str(path), flags, 16)


def test_a_ddp_accelerate_config_becomes_deepspeed_when_the_winner_shards(tmp_path, monkeypatch, capsys):
    text = "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU  # DDP\nmixed_precision: bf16\nnum_processes: 8\n"
    (tmp_path / "ddp.yaml").write_text(text)
    code, err, best = _tune(tmp_path, monkeypatch, capsys, ["ddp.yaml", "--model", "gpt3-1.3b", "--fix",
                                                            "deepspeed.zero_optimization.stage=2", "--write"])
    assert code == 0, err
    tuned = yaml.safe_load((tmp_path / "ddp.tuned.yaml").read_text())
    assert tuned["distributed_type"] == "DEEPSPEED" and tuned["compute_environment"] == "LOCAL_MACHINE"
    assert "# DDP" in (tmp_path / "ddp.tuned.yaml").read_text()
    assert main(["run", "ddp.tuned.yaml", "--model", "gpt3-1.3b", "--json", "run.json"]) == 0
    assert json.loads((tmp_path / "run.json").read_text())["stage"] == 2


def test_a_script_handing_on_a_recipe_points_at_the_tuned_recipe(tmp_path, monkeypatch, capsys):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "zero2.json").write_text(json.dumps(ZERO2))
    recipe = "base_model: gpt3-1.3b  # m\nsequence_len: 512\nmicro_batch_size: 1\ngradient_accumulation_steps: 4\n" \
             "bf16: true\ndeepspeed: ds/zero2.json\n"
    (tmp_path / "ax.yml").write_text(recipe)
    script = "#!/bin/bash\nCFG=ax.yml\naccelerate launch --num_processes 8 -m axolotl.cli.train $CFG  # go\n"
    (tmp_path / "ax.sh").write_text(script)
    code, err, best = _tune(tmp_path, monkeypatch, capsys, ["ax.sh", "--write"])
    assert code == 0, err
    assert (tmp_path / "ax.sh").read_text() == script and (tmp_path / "ax.yml").read_text() == recipe
    assert (tmp_path / "ax.tuned.sh").read_text() == script.replace("train $CFG", "train ax.tuned.yml")
    assert "$CFG (= ax.yml) in ax.sh: written as ax.tuned.yml" in err
    tuned = yaml.safe_load((tmp_path / "ax.tuned.yml").read_text())
    assert tuned["micro_batch_size"] == best["micro_batch_size"] and tuned["sequence_len"] == 512
