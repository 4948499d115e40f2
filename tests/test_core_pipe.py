"""The training core's pipeline parallelism (calibration/core/pipe.py): DeepSpeed's 1F1B
TrainSchedule with real gloo send/recv, PipeDataParallelTopology's rank order, ZeRO-0/1 over
each stage's data-parallel group, ReduceTiedGrads and the loss all-reduce/broadcast. Its loss
equals the unsharded AdamW run's within 1e-5, and every rank's sends, recvs and collectives
are, in order, zsim's schedule of that rank's stage."""
from __future__ import annotations

import pytest

from tests.test_validate import _run_core

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
    measured = _run_core(tmp_path, path, steps, nproc=c["world"])
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
