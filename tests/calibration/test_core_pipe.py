"""The training core's pipeline parallelism (calibration/core/pipe.py): DeepSpeed's 1F1B
TrainSchedule with real gloo send/recv, PipeDataParallelTopology's rank order, ZeRO-0/1 over
each stage's data-parallel group, ReduceTiedGrads and the loss all-reduce/broadcast. Its loss
equals the unsharded AdamW run's within 1e-5, and every rank's sends, recvs and collectives
are, in order, zsim's schedule of that rank's stage."""
from __future__ import annotations

import pytest

from tests.helpers import run_core

PIPE_CASES = {
    # world 2: PP2, the head tied to the embedding (ReduceTiedGrads), clipped (the norm's pipe all-reduce)
    "pp2_tied_zero1": dict(world=2, stage=1, tied=True),
    # world 4: PP2 x DP2 (ZeRO-0's boundary all-reduce over each stage's data-parallel group)
    "pp2xdp2_zero0": dict(world=4, stage=0, tied=False),
    "pp2xdp2_tied_zero1": dict(world=4, stage=1, tied=True),
}


def pipe_raw(name: str, world: int, stage: int, tied: bool) -> dict:
    return {"name": name,
            "model": {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16, "ffn_hidden": 64,
                      "tied_embeddings": tied},
            "hardware": {"profile": "dgx-a100-80g", "nodes": 1, "gpus_per_node": world},
            "training": {"micro_batch_size": 2, "seq_len": 16, "precision": "fp32", "gradient_accumulation_steps": 3},
            "parallelism": {"pipeline": 2},
            "deepspeed": {"zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}, "gradient_clipping": 0.5}}


@pytest.mark.parametrize("case", sorted(PIPE_CASES))
def test_pipelined_core_matches_unsharded_adamw_and_zsims_calls(case, tmp_path):
    pytest.importorskip("torch")
    import yaml

    from calibration.core.pipe import stage_plan
    from calibration.core.reference import reference_losses
    from zsim.config.scenario import load_scenario

    c = PIPE_CASES[case]
    path = tmp_path / "sc.yaml"
    path.write_text(yaml.safe_dump(pipe_raw(case, **c)))
    steps = 3
    measured = run_core(tmp_path, path, steps, nproc=c["world"])
    sc = load_scenario(path)
    dp, gas = sc.data_parallel_size, sc.gradient_accumulation_steps
    assert dp == c["world"] // 2
    ref = reference_losses(sc, steps, world=dp)
    # every stage reports train_batch's loss: the mean over micro-batches and data-parallel ranks
    per_step = [sum(ref[i * gas:(i + 1) * gas]) / gas for i in range(steps)]
    assert len(measured["losses"]) == steps
    assert max(abs(a - b) for a, b in zip(measured["losses"], per_step)) < 1e-5
    calls = measured["collectives_per_rank"]
    for rank, rank_calls in enumerate(calls):
        stage = rank // dp   # PipeDataParallelTopology: rank = stage * dp + dp_rank
        expected = stage_plan(sc, stage)[1].expected
        assert [tuple(x[:3]) for x in rank_calls] == expected, f"rank {rank} (stage {stage})"
        kinds = [x[1] for x in expected]
        assert kinds.count("send") == kinds.count("recv") == gas
        assert ("all_reduce" in kinds) and ("broadcast" in kinds)
    if c["tied"]:   # ReduceTiedGrads: the tied weight (vocab x hidden) on the first and the last stage
        assert all(any(x[1] == "all_reduce" and x[2] == 64 * 32 for x in r) for r in calls)


def test_compare_checks_every_rank_against_its_stage():
    from calibration.validation import compare, render_text

    stage0 = [("forward", "send", 8), ("step", "broadcast", 2)]
    stage1 = [("forward", "recv", 8), ("step", "broadcast", 2)]
    base = {"step_time_s": 1.0, "peak_bytes": 10, "phases_s": {}}
    predicted = dict(base, collectives=stage0, collectives_per_stage=[stage0, stage1])
    # PP2 x DP2: ranks 0, 1 run stage 0 and ranks 2, 3 stage 1
    measured = dict(base, collectives=stage0, collectives_per_rank=[stage0, stage0, stage1, stage1])
    assert compare(measured, predicted)["collectives_equal"]
    # rank 3 misses its recv: the difference names the rank, though rank 0's list is equal
    measured["collectives_per_rank"] = [stage0, stage0, stage1, stage1[1:]]
    report = compare(measured, predicted)
    assert not report["collectives_equal"] and report["collectives_first_difference"]["rank"] == 3
    assert "differs at #0 on rank 3" in render_text(report)


def test_stage_calls_are_each_stages_sends_and_collectives():
    from calibration.validation import stage_calls
    from zsim.schedule.build import build_schedule
    from zsim.config.scenario import scenario_from_mapping
    from tests.helpers import ROOT

    sc = scenario_from_mapping(pipe_raw("s", 4, 1, True), ROOT)
    _, sched = build_schedule(sc)
    first, last = (stage_calls(sched, s, 4) for s in (0, 1))
    act = 2 * 16 * 32    # micro-batch x sequence x hidden
    assert [c[1:3] for c in first if c[1] in ("send", "recv")] == [("send", act), ("recv", act)] * 3
    assert [c[1:3] for c in last if c[1] in ("send", "recv")] == [("recv", act), ("send", act)] * 3
    assert all(c[3] == c[2] * 4 for c in first if c[1] == "send")
    # the loss: all-reduced over the last stage's data-parallel group, broadcast by every stage
    assert first[-1][:3] == last[-1][:3] == ("step", "broadcast", 2) and last[-2][:3] == ("step", "all_reduce", 1)


def test_validate_deepspeed_pipeline_refuses_a_tied_model_in_one_line(capsys):
    from zsim.cli import main as cli_main
    from tests.helpers import ROOT

    path = str(ROOT / "benchmarks/validate_scenarios/pipe.yaml")
    code = cli_main(["validate", path, "--engine", "deepspeed", "--set", "model.tied_embeddings=true"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "set model.tied_embeddings=false" in err
