"""A 1F1B pipeline's passes replayed once recorded (see [Note: pipeline pass replay]) give what
simulating every op gives: each op's start and end to 1e-12 of the step, every stage's memory
events in the same order with the same sizes, and so the same peaks; and the replay happens."""
from __future__ import annotations

import pytest

import zsim.engine.sim as sim
from tests.helpers import ZERO, scenario
from zsim.engine.ledger import peak_and_breakdown
from zsim.engine.pass_replay import PassReplay
from zsim.schedule.build import build_schedule

CASES = {
    "pp4-zero1-full": {"parallelism.pipeline": 4, "model.layers": 8, f"{ZERO}.stage": 1,
                       "training.activation_checkpointing": "full"},
    "pp2-zero0": {"parallelism.pipeline": 2, f"{ZERO}.stage": 0},
    "pp4-tied-selective": {"parallelism.pipeline": 4, "model.layers": 8, "model.tied_embeddings": True,
                           f"{ZERO}.stage": 1, "training.activation_checkpointing": "selective"},
    "pp2-tp4-sp": {"parallelism.pipeline": 2, "parallelism.tensor": 4, "parallelism.sequence_parallel": True,
                   f"{ZERO}.stage": 1, "training.activation_checkpointing": "full"},
    "pp2-tp2-overlap": {"parallelism.pipeline": 2, "parallelism.tensor": 2, f"{ZERO}.stage": 1,
                        f"{ZERO}.overlap_comm": True},
    "pp2-bf16-optimizer": {"parallelism.pipeline": 2, f"{ZERO}.stage": 1,
                           "deepspeed.data_types": {"grad_accum_dtype": "fp32"}},
    # a CPU rank runs every op in program order on one stream
    "pp2-cpu": {"parallelism.pipeline": 2, f"{ZERO}.stage": 1, "hardware.profile": "cpu-xeon-vm-2ranks",
                "hardware.gpus_per_node": 2, "model.layers": 4},
}


def _replays(monkeypatch) -> list:
    began = []
    real = PassReplay.begin

    def begin(self, block, run):
        replayed = real(self, block, run)
        began.append(replayed)
        return replayed

    monkeypatch.setattr(PassReplay, "begin", begin)
    return began


@pytest.mark.parametrize("name", sorted(CASES))
def test_replayed_passes_equal_simulated_ones(name, monkeypatch):
    sc = scenario(**CASES[name], **{"training.gradient_accumulation_steps": 12})
    _, schedule = build_schedule(sc)
    began = _replays(monkeypatch)
    timings, ledgers = sim._run_ops(schedule, sc.cluster, sc.precision, True)
    assert sum(began) >= len(began) // 2, "most passes are replayed"
    full_timings, full_ledgers = sim._run_ops(schedule, sc.cluster, sc.precision, False)
    step = max(t.end_s for t in full_timings)
    for a, b in zip(timings, full_timings):
        assert abs(a.start_s - b.start_s) <= 1e-12 * step and abs(a.end_s - b.end_s) <= 1e-12 * step
    for replayed, full in zip(ledgers, full_ledgers):
        a, b = replayed.events(), full.events()
        assert [e[1:] for e in a] == [e[1:] for e in b]
        assert peak_and_breakdown(a)[0] == peak_and_breakdown(b)[0]


def test_a_pass_touched_from_outside_is_simulated_again(monkeypatch):
    """Should an op from outside reach a stage during its replayed pass, the step is simulated
    again without replay (here forced: every replay reports a conflict)."""
    sc = scenario(**CASES["pp4-zero1-full"], **{"training.gradient_accumulation_steps": 8})
    _, schedule = build_schedule(sc)
    calls = []
    real = sim._run_ops

    def run(schedule, cluster, precision, replay):
        calls.append(replay)
        if replay:
            raise sim.ReplayConflict("forced")
        return real(schedule, cluster, precision, replay)

    monkeypatch.setattr(sim, "_run_ops", run)
    timings, _ = sim.run_ops(schedule, sc.cluster, sc.precision)
    assert calls == [True, False] and all(t is not None for t in timings)
