"""What a DeepSpeed user already has, read where a scenario belongs (zsim/config/launch.py,
recipes.py, trainer_args.py, hub.py; zsim/commands/common.py resolve_source): a launch command
after `--`, a launch script, accelerate / axolotl / LLaMA-Factory recipes (the public files of
tests/fixtures/real_inputs/, sources in its SOURCES.csv) and Hugging Face Hub ids (a temporary
cache; no network: HF_HUB_OFFLINE=1)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import types
from pathlib import Path

import pytest

from tests.helpers import ROOT
from zsim.cli import main
from zsim.config import hub
from zsim.config.hf_config import model_from_hf

REAL = ROOT / "tests" / "fixtures" / "real_inputs"
MODELS = REAL / "models"
DS_AUTO = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 1024, "max_position_embeddings": 512}


@pytest.fixture(autouse=True)
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache, and huggingface_hub told to stay offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.chdir(tmp_path)


def run(capsys, *argv) -> tuple[int, dict | None, str]:
    out = Path("result.json")
    out.unlink(missing_ok=True)
    rc = main(["run", "--quiet", "--json", str(out), *argv])
    err = capsys.readouterr().err
    return rc, (json.loads(out.read_text()) if rc == 0 else None), err


def one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("zsim: error: "), lines
    assert "Traceback" not in err
    return lines[0]


def write_ds(path="ds.json", config=None) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(config or DS_AUTO))
    return p


# --- launch commands -------------------------------------------------------------------------

def test_a_deepspeed_launch_command_runs_with_the_trainers_arguments(capsys):
    write_ds()
    rc, res, err = run(capsys, "--", "deepspeed", "--num_gpus", "4", "--num_nodes=2", "train.py", "--deepspeed",
                       "ds.json", "--model_name_or_path", "gpt2", "--per_device_train_batch_size", "2",
                       "--gradient_accumulation_steps", "3", "--bf16", "--max_seq_length", "512",
                       "--learning_rate", "2e-5", "--output_dir", "out", "--my_custom_flag", "7")
    assert rc == 0, err
    assert (res["gpus_per_node"], res["nodes"], res["world_size"]) == (4, 2, 8)
    assert (res["micro_batch_size"], res["gradient_accumulation_steps"], res["global_batch_size"]) == (2, 3, 48)
    assert (res["precision"], res["seq_len"], res["stage"], res["scenario"]) == ("bf16", 512, 2, "train")
    notes = [line for line in err.splitlines() if line.startswith("zsim: note: ignored")]
    assert notes == ["zsim: note: ignored (no effect zsim models): my_custom_flag"]


@pytest.mark.parametrize("launcher", [
    ["torchrun", "--nproc-per-node", "4", "--nnodes", "2", "--master_port", "29500"],
    ["python", "-m", "torch.distributed.run", "--nproc_per_node=4", "--nnodes=2"],
    ["accelerate", "launch", "--num_processes", "8", "--num_machines", "2", "--mixed_precision", "bf16"],
])
def test_torchrun_and_accelerate_give_the_same_world(capsys, launcher):
    write_ds()
    rc, res, err = run(capsys, "--", *launcher, "train.py", "--deepspeed", "ds.json", "--model_name_or_path",
                       "gpt2", "--per_device_train_batch_size", "1", "--bf16", "True", "--block_size", "256")
    assert rc == 0, err
    assert (res["gpus_per_node"], res["nodes"], res["precision"]) == (4, 2, "bf16")


def test_accelerate_deepspeed_flags_build_the_plugins_config(capsys):
    rc, res, err = run(capsys, "--", "accelerate", "launch", "--use_deepspeed", "--zero_stage", "3",
                       "--offload_optimizer_device", "cpu", "--num_processes", "2", "train.py",
                       "--model_name_or_path", "gpt2", "--per_device_train_batch_size", "1", "--fp16",
                       "--max_length", "256")
    assert rc == 0, err
    assert (res["stage"], res["precision"], res["world_size"]) == (3, "fp16", 2)
    assert res["memory"]["host"]["bytes_per_node"] > 0, "the optimizer offloaded to the CPU holds host memory"


def test_a_launch_script_is_read_like_the_shell_runs_it(tmp_path, capsys):
    """Continuations, a variable set in the script, an env-var prefix, comments, and the
    --deepspeed path relative to the script's folder."""
    folder = tmp_path / "job"
    write_ds(folder / "configs" / "ds.json")
    script = folder / "train.sh"
    script.write_text("#!/bin/bash\n# fine-tune\nGPUS=4\nexport WANDB_MODE=offline\n"
                      "CUDA_VISIBLE_DEVICES=0,1,2,3 deepspeed --num_gpus $GPUS train.py \\\n"
                      "    --deepspeed configs/ds.json \\\n    --model_name_or_path gpt2 \\\n"
                      "    --per_device_train_batch_size 2 --bf16 --block_size 256  # the run\n")
    rc, res, err = run(capsys, str(script))
    assert rc == 0, err
    assert (res["world_size"], res["micro_batch_size"], res["seq_len"]) == (4, 2, 256)
    same_rc, same, _ = run(capsys, "--", "deepspeed", "--num_gpus", "4", "train.py", "--deepspeed",
                           str(folder / "configs" / "ds.json"), "--model_name_or_path", "gpt2",
                           "--per_device_train_batch_size", "2", "--bf16", "--block_size", "256")
    assert same_rc == 0 and same == res


def test_a_script_with_two_launches_is_refused_in_one_line(capsys):
    Path("two.sh").write_text("deepspeed --num_gpus 2 a.py --model_name_or_path gpt2\n"
                              "torchrun --nproc_per_node 2 b.py --model_name_or_path gpt2\n")
    rc, _, err = run(capsys, "two.sh")
    assert rc == 2 and "2 launch commands (lines 1, 2)" in one_error(err)


def test_a_hostfile_gives_nodes_and_slots(capsys):
    write_ds()
    Path("hostfile").write_text("worker-1 slots=8\nworker-2 slots=8  # second\n")
    rc, res, err = run(capsys, "--", "deepspeed", "--hostfile", "hostfile", "train.py", "--deepspeed", "ds.json",
                       "--model_name_or_path", "gpt2", "--per_device_train_batch_size", "1", "--bf16",
                       "--block_size", "128")
    assert rc == 0, err
    assert (res["nodes"], res["gpus_per_node"]) == (2, 8)


@pytest.mark.parametrize("argv, field", [
    (["deepspeed", "train.py", "--model_name_or_path", "gpt2"], "--gpus"),
    (["torchrun", "--nproc_per_node", "2", "train.py", "--bf16", "--fp16", "--model_name_or_path", "gpt2"], "bf16"),
    (["torchrun", "--nnodes", "1:4", "train.py", "--model_name_or_path", "gpt2"], "--nnodes"),
    (["deepspeed", "--num_gpus", "two", "train.py"], "--num_gpus"),
    (["srun", "python", "train.py"], "launch command"),
    (["deepspeed", "--num_gpus", "2"], "launch command"),
    (["torchrun", "--nproc_per_node", "2", "train.py", "--deepspeed", "missing.json", "--model_name_or_path",
      "gpt2"], "scenario"),
])
def test_bad_launch_commands_get_one_line(capsys, argv, field):
    rc, _, err = run(capsys, "--", *argv)
    assert rc == 2 and field in one_error(err)


def test_without_a_deepspeed_config_the_run_is_ddp_as_zero_0(capsys):
    rc, res, err = run(capsys, "--", "torchrun", "--nproc_per_node", "2", "train.py", "--model_name_or_path", "gpt2",
                       "--per_device_train_batch_size", "1", "--bf16", "--block_size", "128")
    assert rc == 0, err
    assert (res["stage"], res["precision"], res["world_size"]) == (0, "bf16", 2)
    assert "names no DeepSpeed config" in err


# --- recipes (the public files of tests/fixtures/real_inputs/) ----------------------------------

def resolved(path: str, *flags: str) -> argparse.Namespace:
    """The args a command loads after resolve_source read `path` (no simulation)."""
    from zsim.commands.common import resolve_source
    ns = argparse.Namespace(scenario=path, model=None, gpus=None, nodes=None, profile=None, set=None)
    it = iter(flags)
    for flag in it:
        setattr(ns, flag.lstrip("-"), next(it))
    resolve_source(ns)
    return ns


def test_an_accelerate_deepspeed_config_gives_zero_3_on_its_processes(capsys):
    ns = resolved(str(REAL / "accelerate" / "deepspeed_zero3.yaml"), "--model", "gpt2")
    assert (ns.gpus, ns.nodes) == (8, 1)         # num_processes 8 is the total over 1 machine
    assert "deepspeed.zero_optimization.stage=3" in ns.recipe_set
    assert 'training.precision="bf16"' in ns.recipe_set
    rc, res, err = run(capsys, str(REAL / "accelerate" / "deepspeed_zero3.yaml"), "--model", "gpt2",
                       "--set", "training.seq_len=256", "--set", "training.micro_batch_size=1")
    assert rc == 0, err
    assert (res["stage"], res["world_size"], res["precision"]) == (3, 8, "bf16")


@pytest.mark.parametrize("name", ["fsdp.yaml", "fsdp2.yaml", "fsdp_config.yaml"])
def test_an_fsdp_accelerate_config_is_answered_with_the_nearest_zero_stage(capsys, name):
    rc, _, err = run(capsys, str(REAL / "accelerate" / name), "--model", "gpt2")
    line = one_error(err)
    assert rc == 2 and "FSDP is not modelled" in line and "--zero_stage 3" in line
    assert "deepspeed.zero_optimization.stage=3" in line


def test_an_axolotl_recipe_reads_its_lora_batch_and_length(capsys):
    ns = resolved(str(REAL / "axolotl" / "lora-1b.yml"), "--gpus", "2", "--model", "gpt2")
    sets = dict(s.split("=", 1) for s in ns.recipe_set)
    assert json.loads(sets["training.lora"]) == {"rank": 16, "alpha": 32.0, "dropout": 0.05, "target_modules": [
        "gate_proj", "down_proj", "up_proj", "q_proj", "v_proj", "k_proj", "o_proj"]}
    assert (sets["training.seq_len"], sets["training.micro_batch_size"], sets["training.gradient_accumulation_steps"],
            sets["training.precision"], sets["training.activation_checkpointing"],
            sets["training.framework"]) == ("2048", "2", "2", '"bf16"', '"full"', "hf_trainer")
    assert Path(ns.scenario).name == "no-deepspeed.json"      # no deepspeed: in this recipe


def test_an_axolotl_recipe_finds_its_deepspeed_file_from_the_repository_root(tmp_path, capsys):
    shutil.copy(REAL / "axolotl" / "lora-1b-ray.yml", tmp_path / "lora.yml")
    (tmp_path / "deepspeed_configs").mkdir()
    shutil.copy(REAL / "deepspeed" / "zero3.json", tmp_path / "deepspeed_configs" / "zero3.json")
    rc, res, err = run(capsys, "lora.yml", "--model", "meta-llama/Llama-3.2-1B-Instruct", "--gpus", "2",
                       "--set", "training.seq_len=256")
    assert rc == 0, err
    assert (res["stage"], res["world_size"]) == (3, 2)


def test_a_recipe_without_a_gpu_count_names_the_flag(capsys):
    rc, _, err = run(capsys, str(REAL / "axolotl" / "lora-1b.yml"), "--model", "gpt2")
    assert rc == 2 and "--gpus" in one_error(err)


def test_a_llama_factory_recipe_applies_its_own_defaults(capsys):
    ns = resolved(str(REAL / "llama_factory" / "qwen3_lora_sft.yaml"), "--gpus", "8", "--model", "gpt2")
    sets = dict(s.split("=", 1) for s in ns.recipe_set)
    # LLaMA-Factory: lora_target all, lora_alpha 2 x rank, gradient checkpointing on unless disabled
    assert json.loads(sets["training.lora"]) == {"rank": 8, "alpha": 16.0, "target_modules": "all-linear"}
    assert sets["training.activation_checkpointing"] == '"full"'
    assert (sets["training.seq_len"], sets["training.precision"]) == ("2048", '"bf16"')


def test_llama_factory_refuses_what_it_cannot_model_in_one_line(capsys):
    Path("kto.yaml").write_text("model_name_or_path: gpt2\nstage: kto\nfinetuning_type: lora\n")
    rc, _, err = run(capsys, "kto.yaml", "--gpus", "2")
    assert rc == 2 and "stage" in one_error(err)


def test_a_yaml_that_is_no_input_zsim_reads_says_what_it_accepts(capsys):
    Path("notes.yaml").write_text("foo: 1\nbar: [2, 3]\n")
    rc, _, err = run(capsys, "notes.yaml")
    line = one_error(err)
    assert rc == 2 and "accelerate config YAML" in line and "launch command after --" in line


# --- Hub ids ---------------------------------------------------------------------------------

def cached(root: Path, repo_id: str, config: dict, commit: str = "0123abcd") -> Path:
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(config))
    return snap / "config.json"


@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME"])
def test_a_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch, capsys, env):
    root = tmp_path / "somewhere"
    monkeypatch.setenv(env, str(root))
    if env == "HF_HOME":
        monkeypatch.delenv("HF_HUB_CACHE")
    path = cached(root if env == "HF_HUB_CACHE" else root / "hub", "acme/tiny-llama", TINY_LLAMA)
    write_ds()
    rc, res, err = run(capsys, "ds.json", "--model", "acme/tiny-llama", "--gpus", "2",
                       "--set", "training.micro_batch_size=1", "--set", "training.seq_len=128")
    assert rc == 0, err
    assert f"config.json from the Hugging Face cache ({path})" in err
    assert res["n_params"] == 2 * 1024 * 256 + 2 * (256 * (256 + 2 * 128 + 256) + 3 * 256 * 512 + 2 * 256) + 256


def test_a_hub_id_resolves_from_the_catalogue_when_not_cached(capsys):
    write_ds()
    rc, res, err = run(capsys, "ds.json", "--model", "meta-llama/Llama-3.2-1B-Instruct", "--gpus", "2",
                       "--set", "training.micro_batch_size=1", "--set", "training.seq_len=256")
    assert rc == 0, err
    assert "zsim's catalogue (scenarios/hub/meta-llama--Llama-3.2-1B-Instruct.json" in err
    assert res["n_params"] == 1_235_814_400      # Llama-3.2-1B's published 1.24B (tied embeddings)


def test_an_unknown_hub_id_says_how_to_give_the_file(capsys):
    write_ds()
    rc, _, err = run(capsys, "ds.json", "--model", "acme/never-published", "--gpus", "2")
    line = one_error(err)
    assert rc == 2 and "huggingface-cli download acme/never-published config.json" in line


def test_huggingface_hub_downloads_only_when_online(tmp_path, monkeypatch):
    calls = []
    downloaded = tmp_path / "dl" / "config.json"
    downloaded.parent.mkdir()
    downloaded.write_text(json.dumps(TINY_LLAMA))

    def hf_hub_download(repo_id, filename):
        calls.append((repo_id, filename))
        if repo_id == "acme/broken":
            raise OSError("no network")
        return str(downloaded)
    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=hf_hub_download))
    assert hub.from_hub("acme/tiny") is None and calls == []          # HF_HUB_OFFLINE=1
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)          # online (the sandbox has no network)
    assert hub.resolve("acme/tiny")[0] == downloaded
    assert calls == [("acme/tiny", "config.json")]
    assert hub.from_hub("acme/broken") is None                        # a failure falls through quietly


def test_a_local_path_or_preset_is_not_a_hub_id(tmp_path):
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    assert not hub.is_repo_id("org/model")           # a folder here wins, as in from_pretrained
    assert hub.is_repo_id("meta-llama/Llama-3.1-8B")
    assert not hub.is_repo_id("config.json") and not hub.is_repo_id("models/config.json")


def sources() -> dict[str, list[str]]:
    rows = [line.split("\t") for line in (MODELS / "SOURCES").read_text().splitlines() if not line.startswith("#")]
    return {r[0]: r for r in rows}


def test_the_model_fixtures_are_published_configs_with_their_sources():
    rows = sources()
    files = sorted(p.name for p in MODELS.glob("*.json"))
    assert len(files) >= 15 and sorted(rows) == files
    for name, (_, repo_id, where) in rows.items():
        assert repo_id.replace("/", "--") + ".json" == name
        assert "@" in where and ":" in where, where      # repo@commit:path


def test_the_catalogue_keeps_each_fixtures_architecture_fields():
    """scenarios/hub/ holds, per repo id, fields of its published config.json unchanged, and
    zsim reads the same model from either (the fp8 DeepSeek-R1 is refused alike)."""
    catalogue = hub.catalogue()
    assert sorted(catalogue) == sorted(r[1] for r in sources().values())
    for repo_id, path in catalogue.items():
        kept = json.loads(path.read_text())
        full = json.loads((MODELS / path.name).read_text())
        assert kept.pop("_source").startswith(repo_id)
        assert all(full[k] == v for k, v in kept.items()), repo_id
        try:
            expected = model_from_hf(full, "config.json")
        except Exception as err:                 # noqa: BLE001 - the catalogue must fail the same way
            with pytest.raises(type(err)):
                model_from_hf(kept, "config.json")
            continue
        assert model_from_hf(kept, "config.json") == expected, repo_id


def test_an_unreachable_hub_is_not_waited_for(monkeypatch):
    """See [Note: no network, no wait]: with huggingface_hub installed and no network, the download
    (which would retry for 23 s) is never called; the catalogue answers at once."""
    import socket
    import sys
    import types

    from zsim.config import hub
    calls = []
    fake = types.ModuleType("huggingface_hub")
    fake.hf_hub_download = lambda **kw: calls.append(kw)
    monkeypatch.setitem(sys.modules, "huggingface_hub", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def refuse(*args, **kwargs):
        raise OSError("no route")
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert hub.hub_reachable() is False
    assert hub.from_hub("google/gemma-3-1b-it") is None and calls == []
    path, where = hub.resolve("google/gemma-3-1b-it")
    assert where.startswith("zsim's catalogue") and path.name == "google--gemma-3-1b-it.json"
