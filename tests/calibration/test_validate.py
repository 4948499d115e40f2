"""zsim validate: the pure comparison logic (no torch), the core's execution plan against zsim's
schedule, and (with torch) the sharded core's loss equality with an unsharded AdamW run."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import fixture_names, load_fixture, run_core, scenario_for, simulated
from zsim.cli import main as cli_main
from calibration.validation import collective_summary, compare, first_difference, mape, rel_error, render_text

ROOT = Path(__file__).resolve().parents[2]


def test_errors_and_mape():
    assert rel_error(110, 100) == pytest.approx(0.1)
    assert rel_error(1, 0) is None
    assert mape([0.1, -0.3, None]) == pytest.approx(0.2)


def test_collective_summary_and_difference():
    calls = [("backward", "all_reduce", 10, 20), ("step", "all_gather", 8, 16), ("backward", "all_reduce", 2, 4)]
    s = collective_summary(calls)
    assert s == {"all_gather": {"count": 1, "numel": 8, "bytes": 16}, "all_reduce": {"count": 2, "numel": 12, "bytes": 24}}
    assert first_difference(calls, [c[:3] for c in calls]) is None
    d = first_difference(calls, calls[:1])
    assert d["index"] == 1 and d["predicted"] is None


def test_compare_report_renders():
    m = {"step_time_s": 0.1, "step_time_spread": 0.05, "phases_s": {"forward": 0.03}, "peak_bytes": 100,
         "collectives": [("step", "all_gather", 4)], "collectives_summary": {"all_gather": {"count": 1, "bytes": 8}}}
    p = {"step_time_s": 0.09, "phases_s": {"forward": 0.033}, "peak_bytes": 105,
         "collectives": [("step", "all_gather", 4)], "collectives_summary": {"all_gather": {"count": 1, "bytes": 8}}}
    r = compare(m, p)
    assert r["error"]["step_time"] == pytest.approx(-0.1)
    assert r["error"]["peak_bytes"] == pytest.approx(0.05)
    assert r["collectives_equal"]
    text = render_text(r)
    assert "step time" in text and "-10.0%" in text and "equal" in text


# the core runs neither BF16_Optimizer nor a reduction dtype other than the model's (plan.unsupported)
@pytest.mark.parametrize("name", [n for n in fixture_names()
                                  if n != "stage1_grad_accum_fp32" and not n.endswith("_comm_fp32")])
def test_core_plan_executes_deepspeed_schedule(name):
    """The core's plan covers every op of zsim's schedule for each recorded DeepSpeed config,
    assigns every gradient to exactly one bucket per micro-step, and expects the same calls."""
    from calibration.core.plan import build_plan

    fx = load_fixture(name)
    sc = scenario_for(fx)
    plan = build_plan(sc)
    assert plan.expected == simulated(fx)
    for micro in range(sc.gradient_accumulation_steps):
        pids = [p for b in plan.buckets.values() if b.micro == micro for p in b.pids]
        if pids:
            assert sorted(pids) == list(range(len(plan.numels)))


def test_validate_bad_engine_is_one_line(capsys):
    assert cli_main(["validate", str(ROOT / "scenarios/default.yaml"), "--engine", "megatron"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--engine" in err[0]


def test_validate_unsupported_scenario_is_one_line(capsys):
    rc = cli_main(["validate", str(ROOT / "scenarios/default.yaml"), "--set", "training.activation_checkpointing=full"])
    assert rc == 2
    assert "activation_checkpointing" in capsys.readouterr().err


LOSS_CASES = {
    "stage0": dict(stage=0),
    "stage1": dict(stage=1, reduce_bucket_size=3000),
    "stage1_gas2": dict(stage=1, reduce_bucket_size=3000, gas=2),
    "stage1_reduce_per_rank": dict(stage=1, reduce_bucket_size=3000, use_multi_rank_bucket_allreduce=False),
    "stage2_gas2": dict(stage=2, reduce_bucket_size=3000, gas=2),
    "stage2_noncontiguous": dict(stage=2, reduce_bucket_size=3000, contiguous_gradients=False),
    "stage3": dict(stage=3, reduce_bucket_size=3000, stage3_prefetch_bucket_size=2000,
                   stage3_param_persistence_threshold=64, stage3_max_reuse_distance=0),
    "stage3_gas2_allreduce": dict(stage=3, reduce_bucket_size=5000, reduce_scatter=False, gas=2,
                                  stage3_prefetch_bucket_size=0),
    # world size 4 (tiny model, 4 ranks on the 2 cores)
    "ws4_stage2": dict(stage=2, reduce_bucket_size=3000, world=4),
    "ws4_stage3": dict(stage=3, reduce_bucket_size=3000, stage3_prefetch_bucket_size=2000,
                       stage3_param_persistence_threshold=64, world=4),
}


@pytest.mark.parametrize("case", sorted(LOSS_CASES))
def test_sharded_core_matches_unsharded_adamw(case, tmp_path):
    pytest.importorskip("torch")
    zero = dict(LOSS_CASES[case])
    gas = zero.pop("gas", 1)
    world = zero.pop("world", 2)
    raw = {"name": case,
           "model": {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16, "ffn_hidden": 64,
                     "tied_embeddings": False},
           "hardware": {"profile": "dgx-a100-80g", "nodes": 1, "gpus_per_node": world},
           "training": {"micro_batch_size": 2, "seq_len": 16, "precision": "fp32", "gradient_accumulation_steps": gas},
           "deepspeed": {"zero_optimization": zero, "gradient_clipping": 0.5}}
    _matches_reference(tmp_path, raw, world, gas)


def _matches_reference(tmp_path, raw: dict, world: int, gas: int) -> list:
    """Run the scenario on the core for 3 steps: its losses equal the unsharded AdamW run's to
    1e-5 and its collectives zsim's schedule, call for call. Returns the expected calls."""
    import yaml

    from calibration.core.plan import build_plan
    from calibration.core.reference import reference_losses
    from zsim.config.scenario import load_scenario

    path = tmp_path / "sc.yaml"
    path.write_text(yaml.safe_dump(raw))
    steps = 3
    measured = run_core(tmp_path, path, steps, nproc=world)
    sc = load_scenario(path)
    ref = reference_losses(sc, steps, world=world)
    assert len(measured["losses"]) == len(ref) == steps * gas
    assert max(abs(a - b) for a, b in zip(measured["losses"], ref)) < 1e-5
    expected = build_plan(sc).expected
    assert [tuple(c[:3]) for c in measured["collectives"]] == expected
    return expected


def test_validate_missing_engine_names_install_command(capsys):
    import importlib.util

    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed here")
    rc = cli_main(["validate", str(ROOT / "scenarios/default.yaml"), "--engine", "deepspeed"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install" in err[0] and "deepspeed" in err[0]


# DeepSpeed-MoE on the core (calibration/core/moe.py): expert parallelism exchanges the capacity
# buffers over gloo (all_to_all_single), expert gradients are reduced over the expert-data-parallel
# group (see [Note: MoE parameter groups]); capacity_factor 0.5 drops routes
MOE_LOSS_CASES = {
    "moe_ep2_stage2": dict(world=2, ep=2, zero=dict(stage=2, reduce_bucket_size=3000)),
    "moe_ep1_stage1": dict(world=2, ep=1, zero=dict(stage=1, reduce_bucket_size=3000)),
    "moe_ep2_stage1_gas2_per_rank": dict(world=2, ep=2, gas=2, zero=dict(stage=1, reduce_bucket_size=3000,
                                                                        use_multi_rank_bucket_allreduce=False)),
    "moe_ws4_ep2_stage2": dict(world=4, ep=2, zero=dict(stage=2, reduce_bucket_size=3000)),
    "moe_ws4_ep4_stage1": dict(world=4, ep=4, zero=dict(stage=1, reduce_bucket_size=3000)),
}


@pytest.mark.parametrize("case", sorted(MOE_LOSS_CASES))
def test_sharded_core_with_expert_parallelism_matches_unsharded_adamw(case, tmp_path):
    pytest.importorskip("torch")
    c = MOE_LOSS_CASES[case]
    world = c["world"]
    raw = {"name": case,
           "model": {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16, "ffn_hidden": 48,
                     "tied_embeddings": False, "glu": True,
                     "moe": {"experts": 4, "top_k": 2, "capacity_factor": 0.5, "min_capacity": 2}},
           "hardware": {"profile": "dgx-a100-80g", "nodes": 1, "gpus_per_node": world},
           "training": {"micro_batch_size": 2, "seq_len": 16, "precision": "fp32",
                        "gradient_accumulation_steps": c.get("gas", 1)},
           "parallelism": {"expert": c["ep"]},
           "deepspeed": {"zero_optimization": c["zero"], "gradient_clipping": 0.5}}
    expected = _matches_reference(tmp_path, raw, world, c.get("gas", 1))
    assert sum(k == "all_to_all" for _, k, _ in expected) == (8 * c.get("gas", 1) if c["ep"] > 1 else 0)


def test_overlap_comm_double_ipg_buffer(tmp_path):
    """overlap_comm allocates a second reduce_bucket_size IPG buffer (stage_1_and_2.py:3271-3277):
    the core's peak grows by it, as zsim's does (a bucket far larger than the model keeps the peak
    in the backward, where both buffers live). Stage 2: overlap_comm changes nothing else there
    (stage 1 also moves its reduction into the hooks)."""
    pytest.importorskip("torch")
    import yaml

    from zsim.api import run_scenario
    from zsim.config.scenario import load_scenario

    bucket = 2_000_000
    peaks = {}
    for overlap in (False, True):
        raw = {"name": f"overlap{overlap}",
               "model": {"layers": 1, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16, "ffn_hidden": 64,
                         "tied_embeddings": False},
               "hardware": {"profile": "dgx-a100-80g", "nodes": 1, "gpus_per_node": 2},
               "training": {"micro_batch_size": 2, "seq_len": 16, "precision": "fp32"},
               "deepspeed": {"zero_optimization": {"stage": 2, "overlap_comm": overlap,
                                                   "reduce_bucket_size": bucket}}}
        path = tmp_path / f"o{overlap}.yaml"
        path.write_text(yaml.safe_dump(raw))
        measured = run_core(tmp_path, path, 1, memory=True)["peak_bytes"]
        peaks[overlap] = (measured, run_scenario(load_scenario(path))[0].memory.peak_bytes)
    assert peaks[True][0] - peaks[False][0] == bucket * 4
    assert peaks[True][1] - peaks[False][1] == bucket * 4


def test_a_failed_run_is_reported_by_the_ranks_own_line():
    """torchrun wraps a rank's failure in its own report; the line zsim validate prints is the
    rank's message (here the peers' refusal of offload on a CPU device), not the report's banner."""
    from calibration.commands.validate import failure_line
    stderr = "\n".join([
        "W1127 05:06:31.389000 30391 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 30396",
        "ZeRO-Offload needs a GPU: on a CPU device there is no host/device split to measure",
        "Traceback (most recent call last):",
        '  File "<frozen runpy>", line 198, in _run_module_as_main',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
        "calibration.core.run FAILED",
        "------------------------------------------------------------",
        "Failures:",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "============================================================",
    ])
    assert failure_line(stderr) == "ZeRO-Offload needs a GPU: on a CPU device there is no host/device split to measure"
    assert failure_line("") == "no output"
    # an uncaught exception in the ranks: torchrun prefixes its lines with the rank
    raised = "\n".join([
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "/work/main/calibration/core/peers.py", line 198, in main',
        "[rank1]: NameError: name 'offloaded' is not defined",
        "E1127 08:24:44.582000 23029 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
    ])
    assert failure_line(raised) == "NameError: name 'offloaded' is not defined"


def test_validate_says_what_fsdp_runs_for_zero_1_and_2():
    """FSDP2 has no ZeRO-1 or ZeRO-2 of DeepSpeed's kind: the peer runs reshard_after_forward=False
    (calibration/core/peers.py), and validate says so instead of comparing silently."""
    from pathlib import Path
    from calibration.commands.validate import peer_note
    from zsim.config.scenario import load_scenario
    path = str(Path(__file__).parents[2] / "benchmarks/validate_scenarios/small.yaml")
    notes = {stage: peer_note("fsdp", load_scenario(path, (f"deepspeed.zero_optimization.stage={stage}",)))
             for stage in (0, 1, 2, 3)}
    assert notes[0] == notes[3] == ""
    assert "reshard_after_forward=False" in notes[1] and "at the accumulation boundary only" in notes[1]
    assert "reshard_after_forward=False" in notes[2] and "boundary" not in notes[2]
    assert peer_note("deepspeed", load_scenario(path, ("deepspeed.zero_optimization.stage=1",))) == ""
