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


def test_the_tensor_parallel_block_takes_deepspeeds_training_keys_only(tmp_path, capsys):
    # TPTrainingConfig forbids other keys: the seeds' inference-style tp_size would not split the model
    for block, words in (({"tp_size": 4, "mpu": None, "tp_grain_size": 64}, "init_inference's key"),
                         ({"autotp_szie": 4}, "did you mean 'autotp_size'")):
        ds = tmp_path / "tp.json"
        ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": block}))
        assert main(["run", str(ds), "--model", "llama2-7b", "--gpus", "8", "--quiet"]) == 2
        assert words in _error(capsys)


def test_lora_hfu_counts_the_gemms_that_run():
    """A frozen base linear runs its dgrad only (its wgrad is skipped), so with no recompute the
    hardware FLOPs fall below the 3x-forward model FLOPs, while a full fine-tune's are equal."""
    base = {"model": {"preset": "llama2-7b"}, "training.micro_batch_size": 1, "deepspeed.zero_optimization.stage": 0}
    lora, _ = run_scenario(scenario(**base, **{"training.lora": {"r": 8}}))
    full, _ = run_scenario(scenario(**base))
    assert full.hfu == pytest.approx(full.mfu, rel=1e-12)
    assert lora.hfu < 0.75 * lora.mfu


def test_tune_simulates_the_scenarios_own_configuration_and_spends_no_budget_on_invalid_ones(tmp_path, capsys):
    out = tmp_path / "t.json"
    src = "scenarios/deepspeed-moe-ep8-zero2-32xh100.yaml"
    from tests.helpers import ROOT
    assert main(["tune", str(ROOT / src), "--budget", "4", "--workers", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    own = [c for c in rows["candidates"] if (c["stage"], c["micro_batch_size"], c["gradient_accumulation_steps"],
                                              c["pipeline_stages"], c["tensor_parallel_size"]) == (2, 4, 2, 1, 1)]
    assert own and own[0]["knobs"] == {}
    assert rows["simulated"] >= 4


def test_tune_json_is_written_when_nothing_fits(tmp_path, capsys):
    out = tmp_path / "t.json"
    src = tmp_path / "huge.yaml"
    src.write_text(yaml.safe_dump(mapping(**{"model": {"preset": "gpt3-175b"}, "hardware.nodes": 1,
                                             "hardware.gpus_per_node": 1})))
    assert main(["tune", str(src), "--budget", "2", "--workers", "1", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["candidates"] == []


def test_tune_scenario_out_reproduces_the_winner_where_the_ds_config_keeps_auto(tmp_path, capsys):
    from tests.helpers import ROOT
    ds = tmp_path / "user.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                              "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}))
    src = tmp_path / "s.yaml"
    raw = mapping(**{"deepspeed": str(ds)})
    src.write_text(yaml.safe_dump(raw))
    out, scen, tj = tmp_path / "ds.json", tmp_path / "best.yaml", tmp_path / "t.json"
    assert main(["tune", str(src), "--budget", "6", "--workers", "1", "--out", str(out), "--scenario-out", str(scen),
                 "--json", str(tj)]) == 0
    best = json.loads(tj.read_text())["candidates"][0]
    rerun = tmp_path / "r.json"
    assert main(["run", str(scen), "--quiet", "--json", str(rerun)]) == 0
    r = json.loads(rerun.read_text())
    assert r["step_time_s"] == pytest.approx(best["step_time_s"], rel=1e-12)
    assert r["memory"]["peak_bytes"] == pytest.approx(best["peak_bytes"], rel=1e-12)
    written = json.loads(out.read_text())
    assert "optimizer" not in written   # the user's config had none and nothing is offloaded
    del ROOT


def test_doctor_writes_bucket_sizes_as_integers():
    from zsim.search.doctor import ds_config_change
    change = ds_config_change(("deepspeed.zero_optimization.reduce_bucket_size=5e7", "training.micro_batch_size=2"))
    assert change == {"deepspeed": {"zero_optimization": {"reduce_bucket_size": 50_000_000}},
                      "training": {"micro_batch_size": 2}}


def test_the_tuned_ds_config_keeps_auto_and_the_scenario_pins_the_tuned_value():
    """tune --out keeps an "auto" for the HF Trainer (with a note), while --scenario-out carries the
    tuned value inline so `zsim run` reproduces the winner (resolve_auto)."""
    from zsim.config.ds_writer import tuned_ds_config
    user = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    base = scenario(**{"deepspeed": user})
    tuned = scenario(**{"deepspeed": {**user, "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7}}})
    kept, notes = tuned_ds_config(user, base, tuned, ["reduce_bucket_size"])
    assert kept["zero_optimization"]["reduce_bucket_size"] == "auto"
    assert any("write it in place of \"auto\"" in n for n in notes)
    pinned, _ = tuned_ds_config(user, base, tuned, ["reduce_bucket_size"], resolve_auto=True)
    assert pinned["zero_optimization"]["reduce_bucket_size"] == 50_000_000
    assert "optimizer" not in kept
    off = scenario(**{"deepspeed": {**user, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                                                   "offload_optimizer": {"device": "cpu"}}}})
    with_offload, notes = tuned_ds_config(user, base, off, ["reduce_bucket_size"])
    assert with_offload["optimizer"] == {"type": "AdamW", "params": {}}
    assert any("ZeRO-Offload needs DeepSpeed's own CPU optimizer" in n for n in notes)


def test_outputs_get_the_umask_mode_and_a_replaced_file_keeps_its_own(tmp_path):
    import os
    import stat
    old = os.umask(0o022)
    try:
        fresh, kept = tmp_path / "a.json", tmp_path / "b.json"
        kept.write_text("x")
        os.chmod(kept, 0o664)
        src = str(_scenario_file(tmp_path))
        assert main(["run", src, "--quiet", "--json", str(fresh)]) == 0
        assert main(["run", src, "--quiet", "--json", str(kept)]) == 0
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o644
        assert stat.S_IMODE(kept.stat().st_mode) == 0o664
    finally:
        os.umask(old)


def test_json_keeps_whole_numbers_exact_and_rounds_the_rest():
    from zsim.report.writers import dumps
    out = json.loads(dumps({"capacity_bytes": 2199023255552.0, "step_time_s": 0.12345678901234567}))
    assert out["capacity_bytes"] == 2199023255552.0          # 2 TiB, not 2199023255550
    assert out["step_time_s"] == 0.123456789012


def test_the_python_api_returns_result_and_trace_and_names_a_wrong_argument():
    from zsim.api import run_file
    from tests.helpers import ROOT
    result, trace = run_file(ROOT / "scenarios" / "default.yaml", ("training.micro_batch_size=4",))
    assert result.fits and result.micro_batch_size == 4 and trace.schedule.ops
    with pytest.raises(TypeError, match="run_scenario takes a Scenario"):
        run_scenario({"model": {}})
    with pytest.raises(TypeError, match="sequence of 'KEY=VALUE' strings"):
        run_file(ROOT / "scenarios" / "default.yaml", "training.micro_batch_size=4")


def test_tf32_runs_fp32_matmuls_on_tensor_cores_and_mfu_uses_the_datasheet_peak():
    base = {"training.precision": "fp32", "model": {"preset": "gpt2-xl"}, "training.micro_batch_size": 4}
    plain, _ = run_scenario(scenario(**base))
    tf32, _ = run_scenario(scenario(**base, **{"training.tf32": True}))
    assert tf32.step_time_s < plain.step_time_s / 2      # A100: 156 vs 19.5 TFLOP/s dense
    # MFU's denominator is the matmul dtype's peak: tf32's for a tf32 run
    assert tf32.mfu == pytest.approx(tf32.tflops_per_gpu / 156.0, rel=1e-9)
    h200 = {"hardware.profile": "h200-1gpu", "hardware.gpus_per_node": 1, "training.precision": "bf16",
            "model": {"preset": "gpt2-xl"}, "training.micro_batch_size": 4}
    r, _ = run_scenario(scenario(**h200))
    assert r.mfu == pytest.approx(r.tflops_per_gpu / 989.4, rel=1e-9)   # the datasheet, not the fitted 1752.4


def test_hardware_settings_the_simulation_does_not_read_are_said():
    sc = scenario(**{"hardware.override": {"inter_node": {"latency_us": 500}}, "hardware.gpus_per_node": 16})
    said = " ".join(sc.warnings)
    assert "inter_node.latency_us is not read" in said and "nccl=null" in said
    assert "exceeds the 8 GPUs of a dgx-a100-80g node" in said
    assert not scenario().warnings


def test_a_scenario_given_as_the_profile_is_named_as_such(capsys):
    from tests.helpers import ROOT
    assert main(["run", "--quiet", "--set", f"hardware.profile={ROOT / 'scenarios' / 'default.yaml'}"]) == 2
    assert "is a scenario, not a hardware profile" in _error(capsys)


def test_files_a_scenario_names_are_inputs_too_and_relative_hf_configs_resolve_once(tmp_path, capsys):
    from tests.helpers import ROOT
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    (sub / "config.json").write_bytes((ROOT / "scenarios" / "models" / "qwen2-7b.json").read_bytes())
    (tmp_path / "a" / "s.yaml").write_text("model: {hf_config: b/config.json}\nhardware: {profile: dgx-a100-80g, "
                                           "nodes: 1}\ntraining: {micro_batch_size: 1}\n")
    import os
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["run", "a/s.yaml", "--quiet"]) == 0          # a/b/config.json, not a/a/b/config.json
        capsys.readouterr()                                       # its notes (the seq_len default)
        before = (sub / "config.json").read_bytes()
        assert main(["run", "a/s.yaml", "--quiet", "--json", "a/b/config.json"]) == 2
        assert "scenario's model.hf_config input" in _error(capsys)
        assert (sub / "config.json").read_bytes() == before
    finally:
        os.chdir(cwd)


def test_doctor_prints_fixes_a_shell_takes_as_printed(tmp_path, capsys):
    import shlex
    src = _scenario_file(tmp_path, **{"model": {"preset": "gpt3-2.7b"}, "training.micro_batch_size": 16,
                                      "hardware.gpus_per_node": 1})
    main(["doctor", str(src), "--workers", "1"])
    lines = [ln.strip() for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("--set")]
    assert lines
    for ln in lines:
        words = shlex.split(ln)
        assert all(w == "--set" for w in words[::2]) and all("=" in w for w in words[1::2])


def test_a_moved_layout_refused_for_another_reason_names_that_reason(capsys):
    """A layout override re-derives the pinned batch; when the moved scenario is refused for
    another reason, that reason is the error, not the batch mismatch the re-derivation repairs."""
    from tests.helpers import ROOT
    src = str(ROOT / "scenarios" / "llama3-8b-zero3-8xh100.yaml")
    assert main(["run", src, "--quiet", "--set", "parallelism.tensor=2", "--set", "parallelism.sequence_parallel=true",
                 "--set", "training.seq_len=4095"]) == 2
    assert "the sequence length must divide by tensor=2" in _error(capsys)


def test_a_misspelt_sweep_key_is_bad_input_and_a_bad_value_stays_in_its_row(tmp_path, capsys):
    from zsim.errors import UnknownKeyError, unknown_key
    assert isinstance(unknown_key("deepspeed", "stagee", {"stage"}), UnknownKeyError)
    src = str(_scenario_file(tmp_path))
    assert main(["sweep", src, "--vary", "deepspeed.zero_optimization.stagee=1,2", "--workers", "1", "--quiet"]) == 2
    assert "--vary deepspeed.zero_optimization.stagee" in _error(capsys)
    out = tmp_path / "rows.json"
    assert main(["sweep", src, "--vary", "deepspeed.zero_optimization.stage=2,7", "--workers", "1", "--quiet",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["ok"] for r in rows] == [True, False] and "stage" in rows[1]["error"]
