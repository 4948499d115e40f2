"""What a user's files and output paths get: an output never replaces an input or another output,
a key written twice is refused as DeepSpeed refuses it, and the DeepSpeed rules a user's
ds_config.json runs into (optimizer offload below ZeRO-1, the batch assertion)."""
import json

import pytest
import yaml

from tests.helpers import mapping, scenario
from zsim.api import run_scenario
from zsim.cli import main
from zsim.units import GiB


def _scenario_file(tmp_path, **changes):
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(mapping(**changes)))
    return p


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zsim: error: "), err
    return err[0]


def test_an_output_onto_the_scenario_is_refused_and_the_scenario_kept(tmp_path, capsys):
    src = _scenario_file(tmp_path)
    before = src.read_bytes()
    assert main(["run", str(src), "--quiet", "--json", str(src)]) == 2
    assert "--json" in _error(capsys)
    assert src.read_bytes() == before


def test_an_output_onto_a_ds_config_given_as_its_hf_model_is_refused(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}))
    before = ds.read_bytes()
    assert main(["run", str(ds), "--model", "gpt2", "--gpus", "2", "--quiet", "--trace", str(ds)]) == 2
    assert "SCENARIO input" in _error(capsys)
    assert ds.read_bytes() == before


def test_two_outputs_on_one_path_are_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["run", str(_scenario_file(tmp_path)), "--quiet", "--json", str(out), "--trace", str(out)]) == 2
    assert "also the --json output" in _error(capsys)
    assert not out.exists()


def test_an_output_that_is_a_directory_is_named_as_such(tmp_path, capsys):
    assert main(["run", str(_scenario_file(tmp_path)), "--quiet", "--json", str(tmp_path)]) == 2
    assert "is a directory" in _error(capsys)


def test_replacing_an_earlier_output_is_allowed_and_said(tmp_path, capsys):
    out = tmp_path / "r.json"
    out.write_text("old")
    assert main(["run", str(_scenario_file(tmp_path)), "--quiet", "--json", str(out)]) == 0
    assert "replaced existing" in capsys.readouterr().err
    assert json.loads(out.read_text())["step_time_s"] > 0


def test_a_directory_given_as_the_scenario_is_named_as_such(tmp_path, capsys):
    assert main(["run", str(tmp_path), "--quiet"]) == 2
    assert "is a directory" in _error(capsys)


def test_a_yaml_key_written_twice_is_refused_with_both_lines(tmp_path, capsys):
    p = tmp_path / "dup.yaml"
    p.write_text("model: {preset: gpt2}\nhardware: {profile: dgx-a100-80g, nodes: 1}\ntraining: {micro_batch_size: 1}\n"
                 "deepspeed:\n  zero_optimization: {stage: 3}\n  zero_optimization: {stage: 1}\n")
    assert main(["run", str(p), "--quiet"]) == 2
    line = _error(capsys)
    assert "'zero_optimization' twice (lines 5 and 6)" in line


def test_a_yaml_merge_key_may_still_be_overridden(tmp_path):
    p = tmp_path / "merge.yaml"
    p.write_text("base: &b {micro_batch_size: 1, seq_len: 512}\nmodel: {preset: gpt2}\n"
                 "hardware: {profile: dgx-a100-80g, nodes: 1}\ntraining: {<<: *b, seq_len: 256}\n")
    from zsim.config.scenario import load_raw
    assert load_raw(p)["training"] == {"micro_batch_size": 1, "seq_len": 256}


def test_a_json_key_written_twice_is_refused_as_deepspeed_refuses_it(tmp_path, capsys):
    # runtime/config.py loads the file with object_pairs_hook=dict_raise_error_on_duplicate_keys
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_micro_batch_size_per_gpu": 1, "train_micro_batch_size_per_gpu": 4}')
    assert main(["run", str(ds), "--model", "gpt2", "--gpus", "2", "--quiet"]) == 2
    assert "'train_micro_batch_size_per_gpu' twice" in _error(capsys)


def test_optimizer_offload_at_stage_0_is_refused(capsys):
    # DeepSpeed builds DeepSpeedCPUAdam for the GPU parameters and fails at its first step
    with pytest.raises(Exception) as exc:
        scenario(**{"deepspeed.zero_optimization.stage": 0,
                    "deepspeed.zero_optimization.offload_optimizer": {"device": "cpu"}})
    assert "offload_optimizer.device" in str(exc.value) and "stage 1, 2 or 3" in str(exc.value)


def test_a_ds_config_batch_that_disagrees_with_the_gpus_is_refused_not_rewritten(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 1000, "train_micro_batch_size_per_gpu": 1,
                              "gradient_accumulation_steps": 1}))
    assert main(["run", str(ds), "--model", "gpt2", "--gpus", "8", "--quiet"]) == 2
    assert "train_batch_size: 1000" in _error(capsys)


def test_a_ds_config_batch_that_agrees_runs_and_a_moved_layout_rederives_it(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
                              "gradient_accumulation_steps": 4}))
    out = tmp_path / "r.json"
    assert main(["run", str(ds), "--model", "gpt2", "--gpus", "8", "--quiet", "--json", str(out)]) == 0
    assert "note" not in capsys.readouterr().err
    # --set hardware.nodes moves the layout the flags gave: the rule re-derives the global batch
    assert main(["run", str(ds), "--model", "gpt2", "--gpus", "8", "--set", "hardware.nodes=2", "--quiet"]) == 0
    assert "train_batch_size -> 128" in capsys.readouterr().err


@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_offload_lowers_the_gpu_peak(stage):
    """ZeRO-1 with an offloaded optimizer keeps autograd's .grads until the boundary walk as
    without offload (the hooks contiguous_gradients forces on only set up the IPG buffer), so
    moving the optimizer states to the host lowers the GPU peak by their size less the offload's
    GPU staging buffer (one gradient of the largest param, 16-bit), all it adds."""
    base = {"model": {"preset": "llama2-7b"}, "hardware.nodes": 8, "training.micro_batch_size": 1,
            "training.gradient_accumulation_steps": 2, "deepspeed.zero_optimization.stage": stage}
    plain, _ = run_scenario(scenario(**base))
    off, _ = run_scenario(scenario(**base, **{"deepspeed.zero_optimization.offload_optimizer": {"device": "cpu"}}))
    assert off.memory.peak_bytes < plain.memory.peak_bytes
    saved = plain.memory.breakdown["optimizer states"]
    largest = 32000 * 4096 * 2   # llama2-7b's embedding (and lm_head) gradient, bf16
    if stage == 1:
        assert plain.memory.peak_bytes - off.memory.peak_bytes == pytest.approx(saved - largest, rel=1e-9)
    else:   # stage 2 also sends its reduced gradient partition to the host
        assert plain.memory.peak_bytes - off.memory.peak_bytes > saved - largest + GiB / 2
    host = off.to_dict()["memory"]["host"]["breakdown"]
    assert host["gradient staging buffer (16-bit)"] == pytest.approx(8 * largest)   # per node: 8 ranks
    assert off.memory.peak_bytes < 40 * GiB


def _optimizer_states(optimizer: dict, stage: int = 1, **more) -> float:
    sc = scenario(**{"deepspeed.optimizer": optimizer, "deepspeed.zero_optimization.stage": stage, **more})
    result, _ = run_scenario(sc)
    return result.memory.breakdown.get("optimizer states", 0.0)


def test_the_optimizer_type_sets_its_states():
    """See [Note: optimizer states by type]: fp32 master + Adam's two moments (12 bytes a param),
    Lion's and Adagrad's one state (8), SGD's momentum buffer only with momentum."""
    adam = _optimizer_states({"type": "AdamW"})
    assert _optimizer_states({"type": "Lion"}) == pytest.approx(adam * 8 / 12)
    assert _optimizer_states({"type": "adagrad"}) == pytest.approx(adam * 8 / 12)
    allow = {"deepspeed.zero_allow_untested_optimizer": True}
    assert _optimizer_states({"type": "SGD", "params": {"momentum": 0.9}}, **allow) == pytest.approx(adam * 8 / 12)
    assert _optimizer_states({"type": "SGD", "params": {"lr": 0.1}}, **allow) == pytest.approx(adam * 4 / 12)
    assert _optimizer_states({"type": "RMSprop", "params": {"momentum": 0.9, "centered": True}},
                             **allow) == pytest.approx(adam * 16 / 12)


@pytest.mark.parametrize("optimizer, stage, more, words", [
    # engine.py _do_optimizer_sanity_check: ZeRO asserts on an untested optimizer
    ({"type": "SGD"}, 2, {}, "zero_allow_untested_optimizer"),
    ({"type": "Lamb"}, 3, {}, "zero_allow_untested_optimizer"),
    # torch.optim is looked up as written
    ({"type": "sgd"}, 0, {}, "write SGD"),
    ({"type": "Adadelta"}, 0, {}, "zsim models Adam"),
    # no CPU kernel for Lamb: DeepSpeed's FusedLamb cannot step host tensors
    ({"type": "Lamb"}, 2, {"deepspeed.zero_allow_untested_optimizer": True,
                           "deepspeed.zero_optimization.offload_optimizer": {"device": "cpu"}}, "CPU optimizers"),
])
def test_optimizers_deepspeed_refuses_are_refused(optimizer, stage, more, words):
    with pytest.raises(Exception) as exc:
        scenario(**{"deepspeed.optimizer": optimizer, "deepspeed.zero_optimization.stage": stage, **more})
    assert "deepspeed.optimizer.type" in str(exc.value) and words in str(exc.value)


def test_a_lighter_cpu_optimizer_steps_faster_on_the_host():
    off = {"deepspeed.zero_optimization.offload_optimizer": {"device": "cpu"}, "deepspeed.zero_optimization.stage": 2,
           "model": {"preset": "gpt2-xl"}}
    adam, _ = run_scenario(scenario(**off))
    lion, _ = run_scenario(scenario(**off, **{"deepspeed.optimizer": {"type": "Lion"}}))
    assert lion.step_time_s < adam.step_time_s
    host = lambda r: r.to_dict()["memory"]["host"]["breakdown"]["optimizer states"]   # noqa: E731
    assert host(lion) == pytest.approx(host(adam) * 8 / 12)
