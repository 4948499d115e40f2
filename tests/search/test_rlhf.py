"""DeepSpeed-Chat's PPO iteration (the scenario's rlhf block; see [Note: DeepSpeed-Chat's PPO
iteration]): its phases are the training steps and generate() calls zsim simulates on their own,
its memory adds every engine's resident states, and the doctor's variants are real ones."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import ROOT, run_cli
from zsim.api import run_rlhf
from zsim.config.scenario import scenario_from_mapping
from zsim.errors import ZsimInputError
from zsim.rlhf import simulate_rlhf
from zsim.simulate import simulate_scenario

ACTOR = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 8, "ffn_hidden": 1408, "vocab": 4096, "seq_len": 2048,
         "position": "rope", "norm": "rmsnorm", "glu": True, "fused_qkv": False, "tied_embeddings": False,
         "bias": False}
CRITIC = {**ACTOR, "layers": 2, "hidden": 256, "heads": 4, "kv_heads": 4, "ffn_hidden": 704}


def raw(stage: int = 3, **rlhf) -> dict:
    return {"name": "ppo", "model": dict(ACTOR), "hardware": {"profile": "dgx-a100-80g", "nodes": 1, "gpus_per_node": 8},
            "training": {"precision": "bf16"},
            "deepspeed": {"bf16": {"enabled": True}, "zero_optimization": {"stage": stage}},
            "rlhf": {"critic_model": dict(CRITIC), "per_device_generation_batch_size": 8,
                     "per_device_training_batch_size": 4, "max_prompt_seq_len": 128, "max_answer_seq_len": 64, **rlhf}}


def ppo(stage: int = 3, **rlhf):
    return scenario_from_mapping(raw(stage, **rlhf), ROOT)


def test_phases_are_the_training_steps_and_generation_zsim_simulates():
    sc = ppo(generation_batches=2, ppo_epochs=3)
    r = simulate_rlhf(sc, suggest=False)
    names = [p.name for p in r.phases]
    assert names == ["generation", "actor forward", "reference forward", "reward forward", "critic forward",
                     "actor training", "critic training"]
    by = {p.name: p for p in r.phases}
    # 2 batches of 8 prompts, 3 epochs over them in micro-batches of 4: 12 micro-steps, GAS 1
    assert by["actor training"].runs == 12 and by["generation"].runs == 2
    # the actor's training step is the scenario's own, at the PPO micro-batch and prompt + answer
    actor = sc.__class__(**{**sc.__dict__, "rlhf": None})
    _, trace = simulate_scenario(actor)
    assert by["actor training"].time_s == trace.step_time_s
    assert actor.micro_batch_size == 4 and actor.seq_len == 192
    assert r.iteration_time_s == pytest.approx(sum(p.total_s for p in r.phases))
    assert r.samples_per_s == pytest.approx(2 * 8 * 8 / r.iteration_time_s)


def test_every_phase_holds_every_engine():
    r = simulate_rlhf(ppo(), suggest=False)
    held = sum(r.resident_bytes.values())
    assert set(r.resident_bytes) >= {"actor", "critic", "reference", "reward"}
    assert all(p.peak_bytes > held for p in r.phases)
    assert r.peak_bytes == max(p.peak_bytes for p in r.phases)
    # the reference holds the actor's parameters, partitioned over 8 GPUs under ZeRO-3, 2 bytes each
    from zsim.workload.transformer import count_params
    assert r.resident_bytes["reference"] == pytest.approx(2 * count_params(ppo().model) / 8, rel=0.01)


def test_reference_offloaded_leaves_the_gpu():
    on = simulate_rlhf(ppo(offload_reference_model=True), suggest=False)
    off = simulate_rlhf(ppo(), suggest=False)
    # only its persistent parameters (the norms) stay on the GPU
    assert on.resident_bytes["reference"] < 0.01 * off.resident_bytes["reference"]
    assert on.host_bytes_per_node > off.host_bytes_per_node


def test_hybrid_engine_generates_faster_than_zero3s_per_forward_gathers():
    slow = simulate_rlhf(ppo(), suggest=False)
    fast = simulate_rlhf(ppo(enable_hybrid_engine=True), suggest=False)
    assert fast.phases[0].time_s < slow.phases[0].time_s
    # pinned under ZeRO-3: the whole model gathered (2 bytes a parameter) on top of every engine's states
    from zsim.workload.transformer import count_params
    assert fast.phases[0].peak_bytes - sum(fast.resident_bytes.values()) > 2 * count_params(ppo().model)
    assert "hybrid engine inference cache" in fast.resident_bytes
    released = simulate_rlhf(ppo(enable_hybrid_engine=True, release_inference_cache=True), suggest=False)
    assert "hybrid engine inference cache" not in released.resident_bytes


def test_doctor_suggestions_are_runnable_settings(tmp_path):
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(raw(enable_hybrid_engine=True)))
    r, traces = run_rlhf(scenario_from_mapping(raw(enable_hybrid_engine=True), ROOT))
    assert [name for name, _ in traces] == [p.name for p in r.phases]
    for s in r.suggestions:
        setting = s.split(":", 1)[0].removeprefix("--set ")
        out = run_cli(["run", str(path), "--set", setting, "--json", str(tmp_path / "v.json")])
        assert out.code == 0, out.stderr
        assert json.loads((tmp_path / "v.json").read_text())["iteration_time_s"] < r.iteration_time_s


def test_cli_runs_the_iteration(tmp_path):
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(raw()))
    out = run_cli(["run", str(path), "--json", str(tmp_path / "r.json"), "--trace", str(tmp_path / "t.json")])
    assert out.code == 0, out.stderr
    assert "One PPO iteration" in out.stdout
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    phases = [e for e in events if e.get("cat") == "phase"]
    assert [e["name"] for e in phases][0] == "generation" and len({e["pid"] for e in events}) == 1 + 7
    r = json.loads((tmp_path / "r.json").read_text())
    assert [p["name"] for p in r["phases"]][0] == "generation" and r["fits"] is True


@pytest.mark.parametrize("rlhf, field", [
    ({"per_device_training_batch_size": 3}, "rlhf.per_device_training_batch_size"),
    ({"inference_tp_size": 2}, "rlhf.inference_tp_size"),
    ({"enable_hybrid_engine": True, "inference_tp_size": 3}, "rlhf.inference_tp_size"),
    ({"ppo_epochs": 0}, "rlhf.ppo_epochs"),
    ({"critic_model": "opt-350m"}, "rlhf.critic_model"),
])
def test_refusals_name_the_field(rlhf, field):
    with pytest.raises(ZsimInputError) as err:
        ppo(**rlhf)
    assert field in str(err.value)


def test_training_batch_must_agree():
    bad = raw()
    bad["training"]["micro_batch_size"] = 2
    with pytest.raises(ZsimInputError, match="training.micro_batch_size"):
        scenario_from_mapping(bad, ROOT)


def test_the_actor_ds_configs_hybrid_engine_block_is_read():
    r = raw()
    r["deepspeed"]["hybrid_engine"] = {"enabled": True, "inference_tp_size": 2, "max_out_tokens": 192,
                                       "pin_parameters": False, "release_inference_cache": True}
    sc = scenario_from_mapping(r, ROOT)
    s = sc.rlhf
    assert (s.enable_hybrid_engine, s.inference_tp_size, s.unpin_actor_parameters, s.release_inference_cache) == \
        (True, 2, True, True)
    assert not any("hybrid_engine" in w for w in sc.warnings)
    r["deepspeed"]["hybrid_engine"]["max_out_tokens"] = 128
    with pytest.raises(ZsimInputError, match="max_out_tokens"):
        scenario_from_mapping(r, ROOT)


def test_pipeline_adds_steps_one_and_two_over_their_data_share():
    r = simulate_rlhf(ppo(pipeline=True, dataset_samples=10000, data_split="2,3,5", sft_micro_batch_size=8,
                          reward_micro_batch_size=4), suggest=False)
    s1, s2, s3 = r.pipeline
    assert (s1.samples, s2.samples, s3.samples) == (2000, 3000, 5000)
    # 8 GPUs, GAS 1: step 1 at micro-batch 8, step 2 at 4 pairs, step 3 at 8 prompts a GPU an iteration
    assert s1.steps == pytest.approx(2000 / 64) and s2.steps == pytest.approx(3000 / 32)
    assert s3.steps == pytest.approx(5000 / 64) and s3.step_time_s == r.iteration_time_s
    assert r.pipeline_time_s == pytest.approx(s1.total_s + s2.total_s + s3.total_s)
    # step 2 trains the critic's model on chosen and rejected rows: slower per pair than a plain sequence
    assert s2.step_time_s > 0 and s1.step_time_s > 0
    with pytest.raises(ZsimInputError, match="data_split"):
        ppo(data_split="2,4")


@pytest.mark.parametrize("command", [["doctor"], ["tune"], ["memory"], ["compare", "--set", "deepspeed.zero_optimization.stage=2"]])
def test_training_searches_refuse_an_rlhf_scenario(tmp_path, command):
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(raw()))
    out = run_cli([command[0], str(path), *command[1:]])
    assert out.code == 2 and "zsim run" in out.stderr and out.stderr.count("\n") == 1
    with pytest.raises(TypeError):
        from zsim.api import run_scenario
        run_scenario(ppo())


def test_one_block_says_what_to_simulate_and_the_critic_is_named():
    both = raw()
    both["inference"] = {"new_tokens": 4}
    with pytest.raises(ZsimInputError, match="^rlhf: .*and inference both"):
        scenario_from_mapping(both, ROOT)
    with pytest.raises(ZsimInputError, match="rlhf.critic_model.preset"):
        ppo(critic_model={"preset": "nope"})
