"""Preference training (training.preference; see [Note: preference training]) and LLaMA-Factory's
freeze tuning (training.freeze): the workload, the schedule and the result of TRL's DPO step."""
from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, scenario
from zsim.api import run_scenario
from zsim.errors import ZsimInputError
from zsim.schedule.build import build_schedule, workload_for
from zsim.schedule.ir import Buffer, OpKind, Phase
from zsim.specs.scenario import FreezeSpec
from zsim.workload.lora import trainable_layer_ids, trainable_params
from zsim.workload.preference import REFERENCE

LORA = {"rank": 8, "target_modules": "all-linear"}
# ZeRO-3 fetching each module's weights at its hook and releasing them after (no prefetch, no
# persistence, no reuse distance: DeepSpeed's defaults would keep a model this small gathered)
EACH_MODULE = {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
               "stage3_param_persistence_threshold": 0}


def dpo(**changes):
    return scenario(**{"training.preference": {"method": "dpo"}, **changes})


def test_the_pair_goes_through_one_forward_and_the_reference_copy_is_frozen():
    sft, pref = workload_for(scenario()), workload_for(dpo())
    policy = [m for m in pref.modules if not m.no_grad]
    reference = [m for m in pref.modules if m.no_grad]
    assert pref.tokens == 2 * sft.tokens and len(policy) == len(reference) == len(sft.modules)
    assert all(r.name == f"{REFERENCE}.{p.name}" and r.layer == -2 for p, r in zip(policy, reference))
    # a frozen copy of every parameter: the model's count twice, only the first trained
    assert pref.n_params == 2 * sft.n_params and trainable_params(pref) == sft.n_params
    assert not {p for m in policy for p in m.params} & {p for m in reference for p in m.params}
    # no_grad: nothing kept, no backward GEMM
    assert all(r.act_bytes == 0 and not r.input_grad and not r.weight_grad and r.kernels_bwd == 0
               for r in reference)


def test_a_peft_reference_is_the_base_model_with_its_adapters_disabled():
    wl = workload_for(dpo(**{"training.lora": LORA}))
    policy = [m for m in wl.modules if not m.no_grad]
    reference = [m for m in wl.modules if m.no_grad]
    assert not any("lora_" in m.name for m in reference)          # the adapters are skipped
    assert any("lora_" in m.name for m in policy)
    base = {p for m in policy if "lora_" not in m.name for p in m.params}
    assert {p for m in reference for p in m.params} == base       # the same weights, no copy
    assert not any(wl.params[p].trainable for p in base)


@pytest.mark.parametrize("method", ["orpo", "simpo"])
def test_reference_free_methods_concatenate_the_pair_without_a_reference(method):
    wl = workload_for(scenario(**{"training.preference": {"method": method}}))
    assert wl.tokens == 2 * workload_for(scenario()).tokens and not any(m.no_grad for m in wl.modules)
    explicit = workload_for(dpo(**{"training.preference": {"method": "dpo", "reference": False}}))
    assert not any(m.no_grad for m in explicit.modules)          # precompute_ref_log_probs


@pytest.mark.parametrize("stage, checkpointing", [(2, "none"), (3, "none"), (3, "full")])
def test_the_reference_forward_runs_after_the_policy_forward_and_has_no_backward(stage, checkpointing):
    sc = dpo(**{"deepspeed.zero_optimization.stage": stage, "training.activation_checkpointing": checkpointing})
    wl, sched = build_schedule(sc)
    forward = [op for op in sched.ops if op.kind == OpKind.FORWARD]
    backward = [op for op in sched.ops if op.kind == OpKind.BACKWARD]
    names = [op.payload.module for op in forward if op.phase == Phase.FORWARD]
    first_ref = next(i for i, n in enumerate(names) if n.startswith(REFERENCE + "."))
    assert all(not n.startswith(REFERENCE) for n in names[:first_ref])
    assert all(n.startswith(REFERENCE) for n in names[first_ref:])
    assert not any(op.payload.module.startswith(REFERENCE) for op in backward)
    # nothing of the reference is kept for a backward
    kept = [a.tag for op in forward for a in op.alloc if a.tag.buffer == Buffer.ACTIVATION]
    assert kept and not any(str(t.key).startswith(REFERENCE) for t in kept)
    assert not any(op.payload.module.startswith(REFERENCE) for op in forward if op.phase == Phase.RECOMPUTE)
    assert not any(str(a.tag.key).startswith(REFERENCE) or a.tag.key == -2
                   for op in sched.ops for a in op.alloc if a.tag.buffer == Buffer.CHECKPOINT)


def test_zero3_gathers_a_peft_reference_s_base_weights_a_second_time():
    lora = {"training.lora": LORA, "deepspeed.zero_optimization": EACH_MODULE}
    base_sched = build_schedule(scenario(**lora))[1]
    pref_sched = build_schedule(dpo(**lora))[1]

    def forward_gathered(sched):
        return sum(op.payload.comm.size_bytes for op in sched.ops
                   if op.kind == OpKind.PARAM_GATHER and op.phase == Phase.FORWARD)
    assert forward_gathered(pref_sched) > 1.5 * forward_gathered(base_sched)


def test_step_time_and_memory_against_supervised_training_on_the_same_tokens():
    """DPO at micro-batch b against SFT at 2b (the same tokens through the trained model): one more
    forward (the reference), so slower by less than a half; a frozen copy adds its 16-bit weights."""
    pref, _ = run_scenario(dpo(**{"training.micro_batch_size": 1}))
    sft, _ = run_scenario(scenario(**{"training.micro_batch_size": 2}))
    assert sft.step_time_s < pref.step_time_s < 1.5 * sft.step_time_s
    assert pref.tokens_per_s == pytest.approx(sft.tokens_per_s * sft.step_time_s / pref.step_time_s)
    assert pref.samples_per_s == pytest.approx(sft.samples_per_s * sft.step_time_s / pref.step_time_s / 2)
    assert pref.n_params == sft.n_params and pref.reference_params == sft.n_params
    params = pref.memory.breakdown["parameters"] - sft.memory.breakdown["parameters"]
    assert params == pytest.approx(2 * sft.n_params, rel=0.01)   # the copy in bf16, whole (stage 2)
    assert "dpo: chosen and rejected sequences" in pref.implementation


def test_the_result_names_the_reference_copy_and_is_deterministic():
    a = run_scenario(dpo())[0].to_dict()
    assert a["reference_params"] == a["n_params"]
    assert json.dumps(a, sort_keys=True) == json.dumps(run_scenario(dpo())[0].to_dict(), sort_keys=True)
    assert "reference_params" not in run_scenario(dpo(**{"training.lora": LORA}))[0].to_dict()


def test_moe_reference_blocks_stay_zero3_leaves():
    """A reference MoE block gathers its experts at once, as the trained model's does."""
    moe = {"model.moe": {"experts": 4, "top_k": 2, "dispatch": "dropless"}, "deepspeed.zero_optimization": EACH_MODULE}
    sched = build_schedule(dpo(**moe))[1]
    visits = {op.payload.visit for op in sched.ops if op.kind == OpKind.PARAM_GATHER}
    assert "layers.0.mlp" in visits and f"{REFERENCE}.layers.0.mlp" in visits
    assert not any(".experts." in v for v in visits)


# --- LLaMA-Factory's freeze tuning ---------------------------------------------------------------

@pytest.mark.parametrize("n, llama_pro, expected", [
    (2, False, [30, 31]),                  # the last two (FinetuningArguments' default)
    (-3, False, [0, 1, 2]),                # the first three
    (8, True, [3, 7, 11, 15, 19, 23, 27, 31]),   # LLaMA-Pro: stride 32 // 8, the last of each group
])
def test_freeze_trains_llama_factory_s_blocks(n, llama_pro, expected):
    assert list(trainable_layer_ids(32, FreezeSpec(trainable_layers=n, llama_pro=llama_pro))) == expected


def test_freeze_counts_and_refusals():
    sc = scenario(**{"model.layers": 4, "training.freeze": {"trainable_layers": 1}})
    wl = workload_for(sc)
    last = sum(wl.params[p].numel for m in wl.modules if m.layer == 3 for p in m.params)
    assert trainable_params(wl) == last
    mlp = scenario(**{"model.layers": 4, "training.freeze": {"trainable_layers": 1, "trainable_modules": ["mlp"],
                                                             "extra_modules": ["lm_head"]}})
    wl = workload_for(mlp)
    expect = sum(wl.params[p].numel for m in wl.modules if m.name.startswith("layers.3.mlp.") or m.name == "lm_head"
                 for p in m.params)
    assert trainable_params(wl) == expect
    with pytest.raises(ZsimInputError, match="trainable_modules"):
        workload_for(scenario(**{"training.freeze": {"trainable_modules": ["mlpx"]}}))
    with pytest.raises(ZsimInputError, match="divisible"):
        workload_for(scenario(**{"model.layers": 4, "training.freeze": {"trainable_layers": 3, "llama_pro": True}}))


def test_recipes_map_onto_preference_and_freeze(tmp_path, capsys):
    from zsim.cli import main
    lf = tmp_path / "lf.yaml"
    lf.write_text("model_name_or_path: gpt3-1.3b\nstage: dpo\nfinetuning_type: lora\npref_loss: orpo\n"
                  "per_device_train_batch_size: 1\nbf16: true\n")
    out = tmp_path / "r.json"
    assert main(["run", str(lf), "--gpus", "8", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "orpo: chosen and rejected sequences per example, no reference model" in res["implementation"]
    lf.write_text("model_name_or_path: gpt3-1.3b\nstage: dpo\npref_loss: bco\nper_device_train_batch_size: 1\n")
    assert main(["run", str(lf), "--gpus", "8"]) == 2
    assert "pref_loss: 'bco' is invalid" in capsys.readouterr().err
    lf.write_text("model_name_or_path: gpt3-1.3b\nstage: sft\nfinetuning_type: freeze\n"
                  "per_device_train_batch_size: 1\n")
    assert main(["run", str(lf), "--gpus", "8", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert 0 < res["trainable_params"] < res["n_params"] / 10      # 2 of gpt3-1.3b's 24 blocks
    assert (ROOT / "docs" / "scenario.md").read_text().count("training.preference") >= 1


@pytest.mark.parametrize("stage", [2, 3])
def test_every_engine_path_gives_the_same_step(stage):
    """The steady-state and layer-repeat engines against every op simulated, for a PEFT DPO run at
    DeepSpeed's default persistence (ZeRO-3: its untraced coordinator releases and re-fetches
    persistent parameters; see [Note: a PEFT reference under ZeRO-3]) and a reference copy."""
    for extra in ({"training.lora": LORA}, {}):
        sc = dpo(**{"deepspeed.zero_optimization.stage": stage, "training.gradient_accumulation_steps": 4,
                    "model.hidden": 512, "model.heads": 8, "model.layers": 4}, **extra)
        fast, _ = run_scenario(sc)
        full, _ = run_scenario(sc, steady=False)
        assert fast.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
        assert fast.memory.peak_bytes == pytest.approx(full.memory.peak_bytes, rel=1e-9)


def test_the_doctor_offers_precomputed_reference_log_probs():
    from tests.helpers import mapping
    from zsim.search.doctor import playbook
    names = [v.name for v in playbook(mapping(**{"training.preference": {"method": "dpo"}}), dpo())]
    assert any(n.startswith("reference log-probs precomputed") for n in names)
    orpo = scenario(**{"training.preference": {"method": "orpo"}})
    assert not any(v.name.startswith("reference log-probs") for v in playbook(mapping(), orpo))


# -- reward models (see [Note: reward model heads]) -----------------------------------------------
def reward(head="score", **changes):
    return scenario(**{"training.preference": {"method": "reward", "reward_head": head}, **changes})


def test_a_score_head_replaces_lm_head_and_a_value_head_sits_beside_it():
    sft, score, value = workload_for(scenario()), workload_for(reward()), workload_for(reward("value_head"))
    h, V = 256, 1024
    assert score.tokens == value.tokens == 2 * sft.tokens     # chosen and rejected in one forward
    # AutoModelForSequenceClassification: no lm_head, `score` hidden -> 1 without bias
    assert score.n_params == sft.n_params - V * h + h
    assert "lm_head" not in {m.name for m in score.modules}
    # AutoModelForCausalLMWithValueHead: lm_head computed without backward, v_head.summary hidden -> 1 + bias
    assert value.n_params == sft.n_params + h + 1
    (lm,) = [m for m in value.modules if m.name == "lm_head"]
    assert lm.no_grad and lm.act_bytes == 0 and not lm.weight_grad
    t, a = value.tokens, 2
    assert lm.fwd_workspace_bytes == t * V * (a + 4)    # its bf16 logits and the wrapper's fp32 copy
    # the loss holds one score a sequence, nothing vocabulary-sized
    (loss,) = [m for m in score.modules if m.name == "loss"]
    assert loss.act_bytes < 100


def test_reward_heads_train_whole_under_lora():
    lora = {"training.lora": {"rank": 8, "target_modules": "all-linear"}}
    plain = trainable_params(workload_for(scenario(**lora)))
    assert trainable_params(workload_for(reward(**lora))) == plain + 256
    assert trainable_params(workload_for(reward("value_head", **lora))) == plain + 257


def test_a_reward_step_has_no_logits_to_keep_but_the_value_head_s_transient():
    long = {"training.seq_len": 1024, "model.seq_len": 1024, "model.vocab": 32768, "training.micro_batch_size": 2}
    sft = run_scenario(scenario(**long))[0]
    score = run_scenario(reward(**long))[0]
    value = run_scenario(reward("value_head", **long))[0]
    assert "logits/loss buffers" not in score.memory.breakdown or score.memory.breakdown["logits/loss buffers"] < 1e4
    assert score.memory.peak_bytes < sft.memory.peak_bytes < value.memory.peak_bytes
    assert "reward model, a score head in place of lm_head" in score.implementation


@pytest.mark.parametrize("stage", [2, 3])
def test_reward_steps_reused_equal_every_op_simulated(stage):
    for head in ("score", "value_head"):
        for gas in (1, 5):
            sc = reward(head, **{"deepspeed.zero_optimization": dict(EACH_MODULE, stage=stage),
                                 "training.gradient_accumulation_steps": gas})
            reused, _ = run_scenario(sc)
            full, _ = run_scenario(sc, steady=False)
            assert reused.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
            assert reused.memory.peak_bytes == full.memory.peak_bytes and reused.comm.calls == full.comm.calls


def test_reward_recipes(tmp_path, capsys):
    from zsim.cli import main
    out = tmp_path / "r.json"
    lf = tmp_path / "lf.yaml"
    lf.write_text("model_name_or_path: gpt3-1.3b\nstage: rm\nfinetuning_type: lora\nper_device_train_batch_size: 1\n")
    assert main(["run", str(lf), "--gpus", "8", "--json", str(out)]) == 0
    assert "reward model, a value head beside lm_head" in json.loads(out.read_text())["implementation"]
    axo = tmp_path / "axo.yaml"
    axo.write_text("base_model: gpt3-1.3b\nmodel_type: AutoModelForSequenceClassification\nnum_labels: 1\n"
                   "reward_model: true\nsequence_len: 512\nmicro_batch_size: 1\n")
    assert main(["run", str(axo), "--gpus", "8", "--json", str(out)]) == 0
    assert "reward model, a score head in place of lm_head" in json.loads(out.read_text())["implementation"]
    axo.write_text("base_model: gpt3-1.3b\nprocess_reward_model: true\nmicro_batch_size: 1\n")
    capsys.readouterr()
    assert main(["run", str(axo), "--gpus", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "process_reward_model" in err[0]
