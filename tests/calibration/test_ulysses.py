"""DeepSpeed-Ulysses sequence parallelism (see [Note: DeepSpeed-Ulysses]) held to DeepSpeed 0.19.8's
recorded runs of UlyssesSPAttentionHF on CPU/gloo (tests/fixtures/deepspeed_ulysses/): every
collective of the steady step, its size and its process group; the peak tensor memory. And what a
user does with it: the ds_config key read, the batch rule, DeepSpeed's refusals, the reused steps
equal to every op simulated, tune choosing a size for a long sequence, the doctor offering it."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.helpers import FIXTURES, equal_results, scenario, zeropp_fixture_scenario
from zsim.api import run_file, run_scenario
from zsim.errors import ZsimInputError
from zsim.schedule.build import build_schedule, workload_for
from zsim.schedule.ir import MEASURED_PASS, Group, OpKind
from zsim.workload.module import ModuleKind

ULYSSES = FIXTURES / "deepspeed_ulysses"
CASES = sorted(p.stem for p in ULYSSES.glob("*.json"))


def _load(name):
    return json.loads((ULYSSES / f"{name}.json").read_text())


def _recorded(fx):
    """(phase, op, numel, dtype, group ranks) of rank 0's last optimizer step (the once-per-run
    trace-consistency broadcasts left out, as for the plain fixtures)."""
    last = max(c["opt_step"] for c in fx["collectives"] if c["opt_step"] is not None)
    return [(c["phase"], c["op"], c["numel"], c["group_ranks"]) for c in fx["collectives"]
            if c["opt_step"] == last and c["phase"] != "init" and "zero/utils.py" not in (c["caller"] or "")]


def _scenario(fx):
    """The recorded run as zsim predicts it (zsim validate's CPU profile), its MLPs tiled where
    the recording tiled them (see [Note: tiled MLP])."""
    sc = zeropp_fixture_scenario(fx)
    if fx.get("tiled_mlp_shards"):
        sc = replace(sc, training=replace(sc.training, tiled_mlp=True, tiled_mlp_shards=fx["tiled_mlp_shards"]))
    return sc


def _simulated(fx):
    """zsim's calls for rank 0: the sequence group is ranks [0, sp), ZeRO's the whole world."""
    sc = _scenario(fx)
    _, sched = build_schedule(sc)
    world, sp = fx["world_size"], fx["sequence_parallel_size"]

    def ranks(group):
        if group is None:
            return list(range(world))
        assert group.kind is Group.SEQUENCE
        return list(range(sp))
    return [(MEASURED_PASS[op.phase], op.comm.collective.value, op.comm.numel, ranks(op.comm.group))
            for op in sched.ops if op.comm]


def test_the_cases_cover_the_stages_group_sizes_and_baselines():
    fxs = [_load(n) for n in CASES]
    assert {fx["ds_config"]["zero_optimization"]["stage"] for fx in fxs} == {1, 2, 3}
    assert {(fx["world_size"], fx["sequence_parallel_size"]) for fx in fxs} == {(2, 1), (2, 2), (4, 2), (4, 4)}
    assert all(fx["ranks_identical_trace"] for fx in fxs)


@pytest.mark.parametrize("name", CASES)
def test_every_call_equals_deepspeeds_in_order_size_and_group(name):
    fx = _load(name)
    recorded = _recorded(fx)
    assert _simulated(fx) == recorded
    if fx["sequence_parallel_size"] > 1:
        # per layer and micro-step: the position_ids all-gather and 4 all-to-alls forward, 4 backward
        gas, layers = fx["gradient_accumulation_steps"], fx["model"]["layers"]
        last = [c for c in fx["collectives"] if c["opt_step"] == fx["optimizer_steps"] - 1]
        callers = [(c["op"], (c["caller"] or "").split("/")[-1].split(":")[0]) for c in last]
        assert callers.count(("all_to_all", "layer.py")) == 8 * layers * gas          # sequence/layer.py
        assert callers.count(("all_gather", "ulysses_sp.py")) == layers * gas


@pytest.mark.parametrize("name", CASES)
def test_the_reduction_dtype_and_batch_are_deepspeeds(name):
    fx = _load(name)
    sc = zeropp_fixture_scenario(fx)
    dtype = {"torch.float32": "fp32", "torch.bfloat16": "bf16"}[fx["engine"]["communication_data_type"]]
    assert sc.deepspeed.reduction_dtype == dtype
    assert sc.global_batch_size == fx["engine"]["train_batch_size"]
    assert sc.seq_data_parallel_size == fx["engine"]["seq_dp_world_size"] == fx["world_size"]


def _peak(name):
    """(zsim's peak, DeepSpeed's largest rank's): zsim sizes a rank's gradient partition by the
    largest rank's (partition.py grads_in_partition_numel), and ZeRO-2's ranks differ by the
    params straddling their edges (ZeRO-3's recorded ranks peak alike)."""
    fx = _load(name)
    return run_scenario(_scenario(fx))[0].memory.peak_bytes, max(fx["peak_bytes_per_rank"])


@pytest.mark.parametrize("name", CASES)
def test_peak_within_3_percent_of_deepspeeds(name):
    zsim, deepspeed = _peak(name)
    assert zsim == pytest.approx(deepspeed, rel=0.03)


def test_zero12s_optimizer_step_peak_is_deepspeeds():
    """Where ZeRO-1/2's peak is a torch AdamW's for-loop step, DeepSpeed's order (see [Note: the
    16-bit partition before the update]) gives its peak within kilobytes: it was 7.7% over before."""
    for name in ("stage2_sp1_w2_bucket_1e6", "stage2_sp2_w2_bucket_1e6", "stage1_sp2_w4_gas2_bucket_1e6"):
        zsim, deepspeed = _peak(name)
        assert zsim == pytest.approx(deepspeed, rel=1e-4), name


def test_ulysses_saves_the_activation_memory_deepspeed_measured():
    """Micro-batch 16, activations at the peak: what sequence parallelism 2 takes off ZeRO-3's
    peak, against the same run without it (its gradients reduced in fp32 as Ulysses makes them)."""
    (z2, d2), (z1, d1) = _peak("stage3_sp2_w2_mb16_bucket_1e6"), _peak("stage3_sp1_w2_mb16_bucket_1e6")
    assert d1 - d2 > 0.2 * d1
    assert (z1 - z2) == pytest.approx(d1 - d2, rel=0.1)


@pytest.mark.parametrize("sp", [1, 2])
def test_the_tiled_mlp_saves_what_deepspeeds_tiledmlp_saved(sp):
    """ALST's TiledMLP over 4 shards against the same run untiled: see [Note: tiled MLP]."""
    (zt, dt), (z, d) = _peak(f"stage3_sp{sp}_w2_mb16_bucket_1e6_tiled4"), _peak(f"stage3_sp{sp}_w2_mb16_bucket_1e6")
    assert d - dt > 0.1 * d
    assert (z - zt) == pytest.approx(d - dt, rel=0.15)


# -- the user's side ----------------------------------------------------------------------------
LONG = {"model.layers": 4, "model.hidden": 512, "model.heads": 8, "model.seq_len": 8192, "training.seq_len": 8192,
        "training.micro_batch_size": 1, "deepspeed.zero_optimization.stage": 3}


def test_the_ds_config_key_sets_the_size_and_the_batch_divides_by_world_over_it():
    sc = scenario(**LONG, **{"deepspeed.sequence_parallel_size": 4, "training.gradient_accumulation_steps": 2})
    assert sc.sequence_parallel_size == 4 and sc.seq_data_parallel_size == 8 and sc.data_parallel_size == 2
    assert sc.global_batch_size == 1 * 2 * 2      # runtime/config.py: world_size / sequence_parallel_size
    assert sc.deepspeed.reduction_dtype == "fp32"
    assert any("seq_parallel_communication_data_type" in n for n in sc.notes)
    bf16 = scenario(**LONG, **{"parallelism.sequence": 4, "deepspeed.seq_parallel_communication_data_type": "bf16"})
    assert bf16.deepspeed.reduction_dtype == "bf16"


def test_each_rank_runs_its_shard_and_the_core_the_whole_sequence_for_its_heads():
    plain, sp = (workload_for(scenario(**LONG, **{"parallelism.sequence": u})) for u in (1, 4))
    assert sp.tokens * 4 == plain.tokens
    core = [m for m in sp.modules if m.kind == ModuleKind.ATTENTION]
    core0 = [m for m in plain.modules if m.kind == ModuleKind.ATTENTION]
    out_bytes = sp.tokens * 512 * 2       # the kernel's output O, kept apart from o_proj's input under Ulysses
    for a, b in zip(core, core0):
        assert a.fwd_flops * 4 == pytest.approx(b.fwd_flops)
        assert a.act_bytes == pytest.approx(b.act_bytes / 4 + out_bytes)
    for a, b in zip(sp.modules, plain.modules):
        if a.kind != ModuleKind.ATTENTION:
            assert a.act_bytes * 4 == pytest.approx(b.act_bytes)


def test_fewer_key_value_heads_than_ranks_are_repeated_to_one_a_rank():
    sc = scenario(**LONG, **{"model.kv_heads": 2, "parallelism.sequence": 8})
    _, sched = build_schedule(sc)
    sizes = {op.payload.tensor: op.comm.numel for op in sched.ops if op.kind is OpKind.SEQUENCE_ALL_TO_ALL}
    tokens = 8192 // 8
    assert sizes == {"q": tokens * 512, "k": tokens * 8 * 64, "v": tokens * 8 * 64, "context": tokens * 512}


@pytest.mark.parametrize("changes, field", [
    ({"parallelism.sequence": 3}, "parallelism.sequence"),                      # the world of 8
    ({"parallelism.sequence": 16, "hardware.nodes": 2}, "parallelism.sequence"),   # 8 heads
    ({"parallelism.sequence": 4, "model.kv_heads": 3, "model.heads": 12, "model.hidden": 768}, "parallelism.sequence"),
    ({"parallelism.sequence": 4, "training.seq_len": 8190}, "training.seq_len"),
    ({"parallelism.sequence": 2, "training.attn_implementation": "eager"}, "training.attn_implementation"),
    ({"parallelism.sequence": 2, "parallelism.tensor": 2}, "parallelism.sequence"),
    ({"parallelism.sequence": 2, "deepspeed.sequence_parallel_size": 4}, "deepspeed.sequence_parallel_size"),
])
def test_deepspeeds_refusals_name_the_field(changes, field):
    with pytest.raises(ZsimInputError) as e:
        scenario(**{**LONG, **changes})
    assert e.value.field == field


@pytest.mark.parametrize("stage, gas, ckpt", [(3, 1, "none"), (3, 5, "full"), (2, 2, "full"), (1, 3, "none")])
def test_steps_reused_equal_every_op_simulated(stage, gas, ckpt):
    sc = scenario(**{**LONG, "deepspeed.zero_optimization.stage": stage, "parallelism.sequence": 4,
                     "training.gradient_accumulation_steps": gas, "training.activation_checkpointing": ckpt,
                     "model.layers": 8})
    reused, _ = run_scenario(sc)
    full, _ = run_scenario(sc, steady=False)
    equal_results(reused, full)
    assert reused.comm.calls["sp all_to_all"] == 8 * gas * (12 if ckpt == "full" else 8)


LONG_RUN = """name: long
model: {preset: llama3-8b}
hardware: {profile: dgx-h100, nodes: 1}
training: {seq_len: 65536, activation_checkpointing: full, framework: hf_trainer}
deepspeed:
  train_micro_batch_size_per_gpu: 1
  gradient_accumulation_steps: 1
  bf16: {enabled: true}
  zero_optimization: {stage: 3}
"""


def test_tune_chooses_a_sequence_parallel_size_for_a_long_sequence(tmp_path):
    from zsim.cli import main
    path, out = tmp_path / "long.yaml", tmp_path / "tune.json"
    path.write_text(LONG_RUN)
    assert main(["tune", str(path), "--json", str(out)]) == 0
    best = json.loads(out.read_text())["candidates"][0]
    size = best["ulysses_sequence_parallel_size"]
    assert size > 1 and f"deepspeed.sequence_parallel_size={size}" in best["set"]
    # the point as written runs, and fits
    assert run_file(str(path), tuple(best["set"]))[0].memory.fits


def test_the_doctor_offers_ulysses_when_a_long_sequence_does_not_fit(tmp_path):
    from zsim.search.doctor import doctor_file
    path = tmp_path / "long.yaml"
    path.write_text(LONG_RUN)
    report = doctor_file(path)
    names = [f["name"] for f in report["fixes"]]
    assert any(n.startswith("Ulysses sequence parallel") for n in names)
    # 64k tokens x 128k vocabulary: the loss's logits weigh, and Liger's kernel is offered too
    assert any(n.startswith("Liger's fused linear cross-entropy") for n in names)


ACCELERATE_SP = """distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
  gradient_accumulation_steps: 1
mixed_precision: bf16
num_machines: 1
num_processes: 8
parallelism_config:
  parallelism_config_sp_size: 4
  parallelism_config_sp_backend: deepspeed
  parallelism_config_sp_attn_implementation: flash_attention_2
"""


def test_accelerates_parallelism_config_is_read_as_ulysses(tmp_path):
    from zsim.cli import main
    path, out = tmp_path / "accelerate.yaml", tmp_path / "result.json"
    path.write_text(ACCELERATE_SP)
    sets = ["--set", "training.seq_len=32768", "--set", "training.micro_batch_size=1",
            "--set", "training.activation_checkpointing=full"]
    assert main(["run", str(path), "--model", "llama3-8b", *sets, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # 8 GPUs in sequence groups of 4: 2 samples a micro-step, each rank a quarter of each
    assert result["global_batch_size"] == 2
    assert result["comm"]["calls"]["sp all_to_all"] == 32 * 12
    path.write_text(ACCELERATE_SP.replace("flash_attention_2", "eager"))
    assert main(["run", str(path), "--model", "llama3-8b"]) == 2


def test_zsim_validate_runs_deepspeed_with_ulysses_as_zsim_predicts_it():
    """`zsim validate --engine deepspeed` (calibration/core/peers.py) runs a Ulysses scenario through
    calibration/core/ulysses.py, the wiring the recordings above used: its ds_config names the size
    and the reduction dtype DeepSpeed then uses; the own core and FSDP refuse it in one line."""
    from calibration.core.peers import ds_config
    from calibration.core.plan import unsupported
    sc = scenario(**{**LONG, "parallelism.sequence": 4})
    cfg = ds_config(sc)
    assert cfg["sequence_parallel_size"] == 4 and cfg["seq_parallel_communication_data_type"] == "fp32"
    assert "communication_data_type" not in cfg
    assert "--engine deepspeed" in unsupported(sc)


def test_tune_writes_the_ulysses_size_back_into_accelerates_config(tmp_path, monkeypatch):
    from zsim.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "accelerate.yaml").write_text(ACCELERATE_SP.replace("parallelism_config_sp_size: 4",
                                                                    "parallelism_config_sp_size: 8"))
    sets = ["--set", "training.seq_len=65536", "--set", "training.activation_checkpointing=full"]
    assert main(["tune", "accelerate.yaml", "--model", "llama3-8b", "--profile", "dgx-h100", *sets,
                 "--json", "tune.json", "--write"]) == 0
    best = json.loads((tmp_path / "tune.json").read_text())["candidates"][0]["ulysses_sequence_parallel_size"]
    tuned = (tmp_path / "accelerate.tuned.yaml").read_text()
    assert best != 8      # the base's size loses here (the write-back is what is tested)
    assert f"parallelism_config_sp_size: {best}" in tuned
    # the written file runs as the point tune chose: world / sp samples a micro-step
    out = tmp_path / "r.json"
    assert main(["run", "accelerate.tuned.yaml", "--model", "llama3-8b", "--profile", "dgx-h100", *sets,
                 "--set", "training.micro_batch_size=1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["global_batch_size"] == 8 // best * r["gradient_accumulation_steps"]


def test_accelerate_launchs_parallelism_flags_beside_the_trainers_ds_config(tmp_path, monkeypatch):
    """accelerate launch --parallelism_config_sp_size: Ulysses whichever ds_config the Trainer passes."""
    from zsim.cli import main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"},
                                                  "train_micro_batch_size_per_gpu": "auto"}))
    (tmp_path / "run.sh").write_text(
        "accelerate launch --use_deepspeed --deepspeed_config_file ds.json --num_processes 8 \\\n"
        "    --parallelism_config_sp_size 4 --parallelism_config_sp_backend deepspeed \\\n"
        "    train.py --model_name_or_path llama3-8b --per_device_train_batch_size 1 --bf16 \\\n"
        "    --gradient_checkpointing --max_seq_length 32768\n")
    assert main(["run", "run.sh", "--profile", "dgx-h100", "--json", "r.json"]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["global_batch_size"] == 2 and r["comm"]["calls"]["sp all_to_all"] > 0
