"""The training core's Megatron tensor parallelism (calibration/core/tensor.py, run by
calibration/core/tensor_run.py): column/row-parallel linears with the f/g all-reduces, sequence
parallelism, the vocab-parallel embedding and cross-entropy, with data parallelism and with
DeepSpeed's 1F1B pipeline. The loss equals the unsharded AdamW run's within 1e-5; the TP calls
each rank logs are, once zsim schedules tensor parallelism (Group.TENSOR), zsim's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.helpers import free_port

MODEL = {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16, "ffn_hidden": 64, "tied_embeddings": False}
MICRO, SEQ, GAS = 2, 16, 2

CASES = {   # name: (world, tp, pp, sequence parallel)
    "tp2_sp": (2, 2, 1, True),
    "tp2xdp2": (4, 2, 1, False),
    "pp2xtp2_sp": (4, 2, 2, True),
    "pp2xtp2": (4, 2, 2, False),
    "pp2xtp2_whole_grads": (4, 2, 2, False),
}
# the ds_config's pipeline block of a case: the activations partitioned, the gradients sent whole
PIPELINE = {"pp2xtp2_whole_grads": {"grad_partitioned": False}}


def raw(name: str, world: int) -> dict:
    return {"name": name, "model": MODEL, "hardware": {"profile": "dgx-a100-80g", "nodes": 1, "gpus_per_node": world},
            "training": {"micro_batch_size": MICRO, "seq_len": SEQ, "precision": "fp32",
                         "gradient_accumulation_steps": GAS},
            "deepspeed": {"zero_optimization": {"stage": 0}, "gradient_clipping": 0.5,
                          **({"pipeline": PIPELINE[name]} if name in PIPELINE else {})}}


def run_tensor(tmp_path, name: str, steps: int = 3) -> tuple[dict, object]:
    import yaml

    from zsim.config.scenario import load_scenario

    world, tp, pp, sp = CASES[name]
    path = tmp_path / "sc.yaml"
    path.write_text(yaml.safe_dump(raw(name, world)))
    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
           str(free_port()), "-m", "calibration.core.tensor_run", "--scenario", str(path), "--tp", str(tp),
           "--pp", str(pp), "--steps", str(steps), "--no-memory", "--out", str(out)] + (["--sp"] if sp else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-2000:]
    return json.loads(out.read_text()), load_scenario(path)


def tp_calls(calls) -> list[tuple]:
    return [tuple(c[:3]) for c in calls if c[4] == "tensor"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_parallel_core_matches_unsharded_adamw(case, tmp_path):
    pytest.importorskip("torch")
    from calibration.core.reference import reference_losses

    world, tp, pp, sp = CASES[case]
    measured, sc = run_tensor(tmp_path, case)
    dp = world // (tp * pp)
    ref = reference_losses(sc, 3, world=dp)
    assert len(measured["losses"]) == len(ref) == 3 * GAS
    assert max(abs(a - b) for a, b in zip(measured["losses"], ref)) < 1e-5
    act = MICRO * SEQ * MODEL["hidden"]
    calls = measured["collectives_per_rank"]
    first = tp_calls(calls[0])
    # the embedding's all-reduce opens every micro-batch's forward on the first stage
    assert first[0] == ("forward", "all_reduce", act)
    per_layer = MODEL["layers"] // pp
    fwd = [c for c in first if c[0] == "forward"]
    if sp:   # each block: all-gather + reduce-scatter around attention and around the MLP
        assert sum(c[1] == "reduce_scatter" for c in fwd) == 2 * per_layer * GAS
        assert sum(c[1] == "all_gather" for c in fwd) == 2 * per_layer * GAS + (GAS if pp == 1 else 0)
    else:    # each block: one all-reduce after attention, one after the MLP; the loss's three (last stage)
        assert fwd.count(("forward", "all_reduce", act)) == (2 * per_layer + 1) * GAS
        assert fwd.count(("forward", "all_reduce", MICRO * SEQ)) == (3 * GAS if pp == 1 else 0)
        last = tp_calls(calls[-1])
        assert last.count(("forward", "all_reduce", MICRO * SEQ)) == 3 * GAS
        if pp > 1:   # the last stage all-gathers each received activation; the first stage its
            # own output and the received gradient in each backward
            assert last.count(("forward", "all_gather", act)) == GAS
            assert first.count(("backward", "all_gather", act)) == (1 if case in PIPELINE else 2) * GAS
    if pp > 1:   # 1F1B between the same TP rank of the two stages: sequence shards with SP; without,
        # DeepSpeed's PartitionedTensor meta (t + 7 int64) and the rank's 1/t part
        # (see [Note: partitioned pipeline sends])
        each = [act // tp] if sp else [tp + 7, act // tp]
        grads = [act] if case in PIPELINE else each
        assert [c[1:3] for c in calls[0] if c[4] == "pipe"] == ([["send", n] for n in each]
                                                                 + [["recv", n] for n in grads]) * GAS
    # the TP ranks of one stage and data-parallel index issue the same calls
    assert tp_calls(calls[0]) == tp_calls(calls[1])


def zsim_calls(sched, stage: int) -> list[tuple]:
    """A stage's tensor-parallel collectives, data-parallel gradient all-reduces and
    point-to-point sends in zsim's schedule, in order, as the core logs them: (pass, call,
    numel, bytes) (the comparison `zsim validate` makes)."""
    from calibration.validation import stage_calls

    return [tuple(c) for c in stage_calls(sched, stage, 4, tensor_and_pipe=True)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_parallel_calls_are_zsims(case, tmp_path):
    """Every stage's TP calls and sends (its first rank's) against zsim's schedule of the same
    scenario: the f/g collectives, the SP column-parallel backward's re-gather, the embedding's
    all-reduce before the learned positions, the cross-entropy's fp32 all-reduces, the one
    flattened all-reduce of the sequence-parallel gradients, the 1F1B sends of sequence shards,
    without SP DeepSpeed's partitioned sends and their all-gathers; with data parallelism
    ZeRO-0's gradient all-reduce over each TP rank's data-parallel group."""
    pytest.importorskip("torch")
    from calibration.validation import tensor_and_pipe_calls
    from zsim.config.scenario import scenario_from_mapping
    from zsim.schedule.build import build_schedule

    world, tp, pp, sp = CASES[case]
    measured, _ = run_tensor(tmp_path, case, steps=1)
    doc = raw(case, world)
    doc["parallelism"] = {"tensor": tp, "pipeline": pp, "sequence_parallel": sp}
    _, sched = build_schedule(scenario_from_mapping(doc, ROOT))
    dp = world // (tp * pp)
    for stage in range(pp):
        calls = measured["collectives_per_rank"][stage * dp * tp]
        logged = [tuple(c) for c in tensor_and_pipe_calls(calls)]
        assert logged == zsim_calls(sched, stage), f"stage {stage}"
        # ZeRO-0: one flattened all-reduce of the rank's gradients per step (a small model: one
        # chunk) on its data-parallel group, a one-rank group included (DeepSpeed issues it too)
        assert sum(c[4] == "data" for c in calls) == 1
    if sp:   # the sequence-parallel gradients: one call per stage, norms and row-parallel biases
        first = measured["collectives_per_rank"][0]
        assert sum(c[:2] == ["backward", "all_reduce"] and c[4] == "tensor" for c in first) == 1


def validate_tensor(tmp_path, name: str, world: int, steps: int) -> dict:
    """`zsim validate` of case `name` as TP2 on `world` ranks (the rest data parallel): its
    report, once its call list has been checked equal to zsim's."""
    import yaml

    from zsim.cli import main as cli_main

    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**raw(name, world), "parallelism": {"tensor": 2}}))
    report = tmp_path / "r.json"
    assert cli_main(["validate", str(path), "--steps", str(steps), "--warmup", "0", "--json", str(report)]) == 0
    r = json.loads(report.read_text())
    assert r["collectives_equal"], r["collectives_first_difference"]
    return r


def test_validate_runs_tensor_parallelism_on_the_core(tmp_path, capsys):
    """`zsim validate` of a TP2 scenario (no data parallelism, ZeRO-0) launches the core's
    tensor-parallel runner, times its steps, tracks its peak and compares its tensor-group calls
    with zsim's schedule of the same scenario."""
    pytest.importorskip("torch")
    r = validate_tensor(tmp_path, "tp2", 2, steps=2)
    m, p = r["measured"], r["predicted"]
    assert m["step_time_s"] > 0 and len(m["step_times_s"]) == 2 and m["peak_bytes"] > 0
    assert m["collectives"] == p["collectives"] and len(m["collectives"]) > 0
    assert {c[1] for c in m["collectives"]} == {"all_reduce"}      # TP2 without SP: f/g all-reduces only
    assert len(m["losses"]) == 3 * GAS    # two timed steps and the one under the memory tracker


def test_validate_runs_tensor_with_data_parallelism(tmp_path):
    """TP2 x DP2 (4 ranks): ZeRO-0's data-parallel all-reduce is compared with zsim's too."""
    pytest.importorskip("torch")
    r = validate_tensor(tmp_path, "tp2xdp2", 4, steps=1)
    data = [c for c in r["measured"]["collectives"] if c[0] == "backward" and c[2] > MICRO * SEQ * MODEL["hidden"]]
    assert len(data) == 1 and data == [c for c in r["predicted"]["collectives"] if c in data]

