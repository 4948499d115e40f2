"""A user's ds_config.json read by DeepSpeed's own rules (issue 46): lenient where DeepSpeed is
(top-level keys it does not read: one note), strict where it is (removed keys, its pydantic
blocks), "auto" as the HF Trainer, accelerate and DeepSpeed fill it
(see [Note: HF Trainer auto values]), and the odd but valid values (sub_group_size 0, quantization_config, trailing commas,
a config.json's 131,072-token context)."""
import json

import pytest

from tests.helpers import ROOT
from zsim.cli import main
from zsim.config.scenario import load_scenario
from zsim.config.source import cluster_overrides
from zsim.schedule.partition import sub_group_sizes

HF_ZERO3 = {  # transformers tests/deepspeed/ds_config_zero3.json, abridged
    "fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def _write(tmp_path, ds, name="ds.json"):
    p = tmp_path / name
    p.write_text(json.dumps(ds) if isinstance(ds, dict) else ds)
    return p


def _load(path, *sets, model="llama2-7b"):
    return load_scenario(path, cluster_overrides(True, str(path), model, 8, 1, None) + sets)


def _run(tmp_path, capsys, ds, *args, model="llama2-7b"):
    """`zsim run ds.json --model M --gpus 8`: (exit code, stderr lines, the JSON result)."""
    out = tmp_path / "out.json"
    code = main(["run", str(_write(tmp_path, ds)), "--model", model, "--gpus", "8", "--quiet", "--json", str(out),
                 *args])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith(("wrote ", "replaced "))]
    return code, err, json.loads(out.read_text()) if code == 0 else None


def _refused(tmp_path, capsys, ds, *args, model="llama2-7b") -> str:
    code, err, _ = _run(tmp_path, capsys, ds, *args, model=model)
    assert code == 2 and len(err) == 1 and err[0].startswith("zsim: error: "), (code, err)
    return err[0]


def test_keys_deepspeed_does_not_read_are_ignored_in_one_note(tmp_path, capsys):
    ds = {"_comment": "x", "comms_config": {"verbose": False}, "monitor_config": {}, "zero_optimisation": {"stage": 3},
          "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}
    code, err, res = _run(tmp_path, capsys, ds)
    assert code == 0 and res["stage"] == 0          # DeepSpeed too runs the misspelt block's absence: stage 0
    assert err == ["zsim: note: deepspeed: ignored keys DeepSpeed does not read: _comment, comms_config, "
                   "monitor_config, zero_optimisation (did you mean 'zero_optimization'?)"]


@pytest.mark.parametrize("ds,where", [
    ({"elasticity": {"enabled": False}}, "deepspeed.elasticity"),            # runtime/config.py removed keys
    ({"sparse_gradients": False}, "deepspeed.sparse_gradients"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 8}}, "deepspeed.zero_optimization.mics_shard_size"),
    ({"zero_optimization": {"stage": 2, "stage3_prefetch": 5}}, "deepspeed.zero_optimization.stage3_prefetch"),
    ({"compile": {"disable": False, "backend": "inductor"}}, "deepspeed.compile.disable"),   # CompileConfig forbids
    ({"wandb": {"enabled": False, "entity": "me"}}, "deepspeed.wandb.entity"),
    ({"torch_autocast": {"enabled": True}}, "deepspeed.torch_autocast"),     # would price fp32: verdict changes
    ({"communication_data_type": "auto"}, "deepspeed.communication_data_type"),
    # ("auto" makes it an HF Trainer file, which accelerate refuses without a zero_optimization block)
    ({"activation_checkpointing": {"partition_activations": "auto"}, "zero_optimization": {"stage": 2}},
     "activation_checkpointing.partition_activations"),
])
def test_what_deepspeed_refuses_is_refused_in_one_line(tmp_path, capsys, ds, where):
    line = _refused(tmp_path, capsys, {"train_micro_batch_size_per_gpu": 1, **ds})
    assert where in line
    if "removed" in str(ds) or "elasticity" in ds or "sparse_gradients" in ds:
        assert "removed" in line


def test_a_known_key_zsim_does_not_model_is_a_warning(tmp_path, capsys):
    code, _, res = _run(tmp_path, capsys, {"train_micro_batch_size_per_gpu": 1, "wall_clock_breakdown": True})
    assert code == 0 and any(w.startswith("deepspeed.wall_clock_breakdown: its timers") for w in res["warnings"])
    code, _, res = _run(tmp_path, capsys, {"train_micro_batch_size_per_gpu": 1, "wall_clock_breakdown": False})
    assert code == 0 and res["warnings"] == []


def test_an_all_auto_file_runs_with_the_trainers_defaults_and_names_them(tmp_path, capsys):
    code, err, res = _run(tmp_path, capsys, HF_ZERO3)
    assert code == 0
    assert (res["micro_batch_size"], res["gradient_accumulation_steps"], res["global_batch_size"], res["precision"]) \
        == (8, 1, 64, "fp32")
    assert err == ['zsim: note: training.framework: hf_trainer, as the ds_config\'s "auto" values say (the HF '
                   'Trainer or accelerate fills them): HF\'s kernels and sdpa attention, tune\'s HF search space; '
                   '--set training.framework=deepspeed to change it',
                   'zsim: note: "auto" filled with the HF Trainer\'s defaults: per_device_train_batch_size 8 '
                   '(--set training.micro_batch_size=N), gradient_accumulation_steps 1 '
                   '(--set training.gradient_accumulation_steps=N), max_grad_norm 1 (--set training.max_grad_norm=X), '
                   'precision fp32 (neither --bf16 nor --fp16; --set training.precision=bf16)']
    # the keys it names set them, and then nothing is a default (the framework stated too)
    code, err, res = _run(tmp_path, capsys, HF_ZERO3, "--set", "training.micro_batch_size=4", "--set",
                          "training.gradient_accumulation_steps=2", "--set", "training.precision=bf16",
                          "--set", "training.max_grad_norm=0.5", "--set", "training.framework=hf_trainer")
    assert code == 0 and err == []
    assert (res["micro_batch_size"], res["gradient_accumulation_steps"], res["global_batch_size"], res["precision"]) \
        == (4, 2, 64, "bf16")


def test_auto_bucket_sizes_follow_the_hidden_size_at_zero3_and_take_deepspeeds_default_under_aliases(tmp_path):
    h = 4096                                                       # llama2-7b
    sc = _load(_write(tmp_path, HF_ZERO3))
    z = sc.zero
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == \
        (h * h, int(0.9 * h * h), 10 * h)                          # trainer_config_finalize
    assert sc.deepspeed.gradient_clipping == 1.0
    aliased = json.loads(json.dumps(HF_ZERO3))
    zo = aliased["zero_optimization"]
    zo["prefetch_bucket_size"] = zo.pop("stage3_prefetch_bucket_size")
    zo["param_persistence_threshold"] = zo.pop("stage3_param_persistence_threshold")
    sc = _load(_write(tmp_path, aliased))
    assert (sc.zero.prefetch_bucket_size, sc.zero.param_persistence_threshold) == (int(5e7), int(1e5))
    assert any("zero_optimization.prefetch_bucket_size=50000000" in n for n in sc.notes)
    # numbers under the aliases and the deprecated spellings are DeepSpeed's keys too
    zo.update(prefetch_bucket_size=123, param_persistence_threshold=45, max_live_parameters=6e8,
              max_reuse_distance=7e8, stage3_gather_fp16_weights_on_model_save=True)
    del zo["stage3_gather_16bit_weights_on_model_save"]
    z = _load(_write(tmp_path, aliased)).zero
    assert (z.prefetch_bucket_size, z.param_persistence_threshold, z.max_live_parameters, z.max_reuse_distance) == \
        (123, 45, int(6e8), int(7e8))


def test_stage_auto_is_accelerates_default_and_zero_true_is_the_old_stage_1(tmp_path):
    sc = _load(_write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": "auto"}}))
    assert sc.zero.stage == 2 and any("accelerate's DeepSpeedPlugin default" in n for n in sc.notes)
    sc = _load(_write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": True, "allgather_size": 3e8}))
    assert sc.zero.stage == 1 and sc.zero.allgather_bucket_size == int(3e8)


def test_train_batch_size_auto_is_derived_from_numeric_micro_batch_and_gas(tmp_path):
    sc = _load(_write(tmp_path, {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
                                 "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 2}}))
    assert (sc.global_batch_size, sc.micro_batch_size, sc.gradient_accumulation_steps) == (2 * 4 * 8, 2, 4)
    # the "auto" is the HF Trainer's (its run), and nothing else is a default
    assert len(sc.notes) == 1 and sc.notes[0].startswith("training.framework: hf_trainer")


def test_json_deepspeeds_loaders_refuse_is_refused_naming_file_line_and_column(tmp_path, capsys):
    # a trailing comma: json.load (the HF Trainer's reader) refuses it, see [Note: trailing commas in a ds_config]
    line = _refused(tmp_path, capsys, '{\n  "train_micro_batch_size_per_gpu": 1,\n  "bf16": {"enabled": true},\n}\n',
                    "--set", "training.framework=hf_trainer")
    assert "ds.json" in line and "line 3, column 28" in line and "trailing comma" in line
    line = _refused(tmp_path, capsys, '{"train_micro_batch_size_per_gpu": 1, "train_micro_batch_size_per_gpu": 2}')
    assert "twice" in line


def test_bfp16_suggests_bf16(tmp_path, capsys):
    line = _refused(tmp_path, capsys, {"train_micro_batch_size_per_gpu": 1}, "--set", "training.precision=bfp16")
    assert "did you mean 'bf16'" in line
    line = _refused(tmp_path, capsys, {"train_micro_batch_size_per_gpu": 1, "communication_data_type": "bfp16"})
    assert "did you mean 'bf16'" in line


def test_sub_group_size_0_is_one_group_per_parameter():
    # stage3.py _create_fp16_sub_groups: every partial sum reaches 0, so each param closes a group
    assert sub_group_sizes([10, 20, 30], 2, 0) == [5, 10, 15]
    assert sub_group_sizes([10, 20, 30], 2, 10**9) == [30]
    assert sub_group_sizes([10, 20, 30], 2, 12) == [15, 15]


def test_sub_group_size_0_keeps_the_optimizer_temporaries_per_parameter(tmp_path):
    from zsim.schedule.build import build_schedule
    from zsim.schedule.ir import OpKind
    from zsim.schedule.partition import trainable_numels
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    steps = {}
    for size in (0, 10**12):
        ds["zero_optimization"]["sub_group_size"] = size
        sc = _load(_write(tmp_path, ds), "training.seq_len=256", model="gpt2")
        wl, schedule = build_schedule(sc)
        steps[size] = [op for op in schedule.ops if op.kind == OpKind.OPTIMIZER_STEP]
    assert len(steps[10**12]) == 1
    assert len(steps[0]) == len(trainable_numels(wl)) > 100


def test_a_quantization_config_trains_in_the_runs_precision_with_a_note(tmp_path):
    r1 = ROOT / "tests" / "fixtures" / "real_inputs" / "models" / "deepseek-ai--DeepSeek-R1.json"
    data = json.loads(r1.read_text())
    assert data["quantization_config"]["quant_method"] == "fp8"
    sc = _load(_write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}}), model=str(r1))
    assert sc.precision == "bf16"
    assert any("quantization_config (fp8" in n and "trains in its own precision" in n for n in sc.notes)


def test_a_long_context_config_json_trains_at_trls_default_length(tmp_path, capsys):
    llama31 = ROOT / "tests" / "fixtures" / "real_inputs" / "models" / "meta-llama--Llama-3.1-8B.json"
    assert json.loads(llama31.read_text())["max_position_embeddings"] == 131072
    code, err, res = _run(tmp_path, capsys, {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}},
                          model=str(llama31))
    assert code == 0 and res["seq_len"] == 1024
    assert err == ["zsim: note: seq_len 1024, not the config.json's context of 131,072 (TRL SFTConfig's max_length "
                   "default; --set training.seq_len=N)"]
    code, err, res = _run(tmp_path, capsys, {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}},
                          "--set", "training.seq_len=4096", model=str(llama31))
    assert code == 0 and res["seq_len"] == 4096 and err == []


def test_tensor_parallel_results_give_the_models_count_and_each_slices(tmp_path, capsys):
    from zsim.workload.transformer import count_params
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    code, _, res = _run(tmp_path, capsys, ds, "--set", "parallelism.tensor=2", "--set", "training.seq_len=512",
                        model="gpt2")
    assert code == 0
    sc = _load(_write(tmp_path, ds), "parallelism.tensor=2", "training.seq_len=512", model="gpt2")
    total = count_params(sc.model, sc.seq_len)
    assert res["tensor_parallel"]["model_params"] == total and res["n_params"] < total < 2 * res["n_params"]
    main(["run", str(tmp_path / "ds.json"), "--model", "gpt2", "--gpus", "8", "--set", "parallelism.tensor=2",
          "--set", "training.seq_len=512", "--width", "400"])
    head = capsys.readouterr().out.splitlines()[0]
    assert f"{total / 1e9:.2f} B params ({res['n_params'] / 1e9:.2f} B in each of the 2 tensor-parallel slices)" in head


def test_zsim_memory_reads_an_all_auto_file(tmp_path, capsys):
    path = _write(tmp_path, HF_ZERO3)
    assert main(["memory", str(path), "--model", "llama2-7b", "--gpus", "8"]) == 0
    captured = capsys.readouterr()
    assert "DeepSpeed's estimator" in captured.out
    assert any("per_device_train_batch_size 8" in line for line in captured.err.splitlines())
