"""The steady-state engine (zsim/engine/steady.py) gives the result of simulating every
micro-step: step time to 1e-9, peak memory and its breakdown exactly, collective counts
exactly, for every ZeRO stage, offload and checkpointing variant at GAS 1..8."""
from __future__ import annotations

import pytest

from tests.helpers import NEVER_SETTLES, VARIANTS, ZERO, same_result, scenario
from zsim.api import run_scenario

@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_steady_state_equals_full_simulation(name):
    reused = []
    for gas in range(1, 9):
        sc = scenario(**VARIANTS[name], **{"training.gradient_accumulation_steps": gas})
        steady, trace = run_scenario(sc)
        full, full_trace = run_scenario(sc, steady=False)
        assert full_trace.repeat is None
        same_result(steady, full)
        if trace.repeat is not None:
            reused.append(gas)
    # a step longer than the longest shortened one (six micro-steps) reuses the steady state
    assert set(reused) >= (set() if name in NEVER_SETTLES else {7, 8})


@pytest.mark.parametrize("stage, simulated", [(3, 4), (2, 3)])
def test_a_long_accumulation_simulates_a_few_micro_steps(stage, simulated):
    """ZeRO-3 four (its window opened at a backward, steady.find_repeat), ZeRO-2 with its
    optimizer on the GPU three (SHORT_SIMULATED_MICRO_STEPS)."""
    sc = scenario(**{f"{ZERO}.stage": stage, "training.gradient_accumulation_steps": 10_000})
    result, trace = run_scenario(sc)
    assert trace.repeat is not None and trace.repeat.period.copies == 10_000 - trace.repeat.period.micro - 1
    assert {op.micro_step for op in trace.schedule.ops} == set(range(simulated))
    assert trace.repeat.period.micro == simulated - 2
    assert result.events == len(trace.schedule.ops) + (trace.repeat.period.copies - 1) * len(trace.repeat.period.ops)


def test_the_trace_shows_the_simulated_micro_steps_and_marks_the_repeated_one():
    from zsim.report.writers import chrome_trace
    sc = scenario(**{f"{ZERO}.stage": 3, "training.gradient_accumulation_steps": 12})
    result, trace = run_scenario(sc)
    events = chrome_trace(trace, "t")["traceEvents"]
    ops = [e for e in events if e["ph"] == "X" and e["cat"] != "steady state"]
    repeated = [e for e in ops if "repeated_micro_steps" in e["args"]]
    # the window opens at a middle micro-step's forward, or under ZeRO-3 where the first
    # micro-step's reductions run into the second's forward at its backward, holding the next
    # micro-step's forward too (steady.find_repeat); either way it holds the ops that
    # start in it: a forward's window also the next micro-step's first prefetched gathers
    m = trace.repeat.period.micro
    from_backward = "backward" in trace.repeat.period.name
    marked = {e["args"]["micro_step"] for e in repeated}
    assert repeated and m in marked and marked <= {m, m + 1}
    if from_backward:
        assert marked == {m, m + 1}
    assert all(e["args"]["repeated_micro_steps"] == 12 - trace.repeat.period.micro - 1 for e in repeated)
    [skipped] = [e for e in events if e.get("cat") == "steady state"]
    assert skipped["dur"] == pytest.approx((trace.repeat.period.copies - 1) * trace.repeat.period_s * 1e6, abs=1e-3)
    # on the full step's clock: the last op ends with the step
    assert max(e["ts"] + e["dur"] for e in ops) == pytest.approx(result.step_time_s * 1e6, abs=1e-2)


PIPELINES = {
    "pp2-zero0": {"parallelism.pipeline": 2, f"{ZERO}.stage": 0},
    "pp2-zero1-full": {"parallelism.pipeline": 2, f"{ZERO}.stage": 1, "training.activation_checkpointing": "full"},
    "pp4-zero1-tied": {"parallelism.pipeline": 4, "model.layers": 4, "model.tied_embeddings": True, f"{ZERO}.stage": 1},
}


def _same_pipeline(sc):
    """The steady-state run of pipeline `sc` gives the full simulation's result, per-stage peaks
    and the bubble included; returns its trace."""
    steady, trace = run_scenario(sc)
    full, full_trace = run_scenario(sc, steady=False)
    assert full_trace.repeat is None
    same_result(steady, full)
    assert steady.pipeline.peak_bytes == full.pipeline.peak_bytes
    assert steady.pipeline.worst_stage == full.pipeline.worst_stage
    assert steady.pipeline.bubble_fraction == pytest.approx(full.pipeline.bubble_fraction, rel=1e-9)
    return trace


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_pipeline_steady_state_equals_full_simulation(name):
    """A pipeline's 1F1B period, reused, gives the result of simulating every micro-step,
    per-stage peaks and the bubble included."""
    stages = PIPELINES[name]["parallelism.pipeline"]
    reused = []
    for gas in range(1, stages + 9):
        trace = _same_pipeline(scenario(**PIPELINES[name], **{"training.gradient_accumulation_steps": gas}))
        if trace.repeat is not None:
            assert "1F1B" in trace.repeat.period.name and trace.repeat.period.copies == gas - stages - 3
            reused.append(gas)
    # longer than the shortened step (stages + 4 micro-steps): the period is reused
    assert set(reused) == set(range(stages + 5, stages + 9))


def test_a_long_pipeline_simulates_a_few_periods_past_the_warm_up():
    sc = scenario(**PIPELINES["pp2-zero0"], **{"training.gradient_accumulation_steps": 10_000})
    result, trace = run_scenario(sc)
    assert trace.repeat is not None and trace.repeat.period.copies == 10_000 - 2 - 3
    assert {op.micro_step for op in trace.schedule.ops} == set(range(2 + 4))
    assert result.events == len(trace.schedule.ops) + (trace.repeat.period.copies - 1) * len(trace.repeat.period.ops)
    # one period holds one forward and one backward of every layer of every stage
    forwards = [op for op in trace.schedule.ops if op.id in trace.repeat.period.ops and op.kind.name == "FORWARD"]
    backwards = [op for op in trace.schedule.ops if op.id in trace.repeat.period.ops and op.kind.name == "BACKWARD"]
    assert forwards and len(forwards) == len(backwards)


INTERLEAVED = {
    "pp3-v2": {"parallelism.pipeline": 3, "parallelism.virtual_stages": 2, "model.layers": 6,
               "hardware.gpus_per_node": 6},
    # TP2 without sequence parallelism: scatter/gather's pieces and all-gathers; every stage on a
    # node of its own, so the batched sends cross InfiniBand
    "pp4-v3-tp2-ib": {"parallelism.pipeline": 4, "parallelism.virtual_stages": 3, "model.layers": 12,
                      "parallelism.tensor": 2, "hardware.gpus_per_node": 2, "hardware.nodes": 4},
    "pp4-v2-tied-full": {"parallelism.pipeline": 4, "parallelism.virtual_stages": 2, "model.layers": 8,
                         "model.tied_embeddings": True, "training.activation_checkpointing": "full"},
}


@pytest.mark.parametrize("name", sorted(INTERLEAVED))
def test_interleaved_steady_state_equals_full_simulation(name):
    """Megatron's interleaved schedule, its period of a group of `pipeline` micro-steps reused:
    the result of simulating every micro-step. GAS is a multiple of the pipeline size (Megatron
    v2.x-v3.0 and zsim refuse others), so every extra micro-step is in a whole extra group."""
    p = INTERLEAVED[name]["parallelism.pipeline"]
    reused = []
    for groups in range(1, 9):
        trace = _same_pipeline(scenario(**{"parallelism.pipeline_schedule": "interleaved", f"{ZERO}.stage": 1,
                                           **INTERLEAVED[name], "training.gradient_accumulation_steps": groups * p}))
        if trace.repeat is not None:
            # five groups simulated, the window one group: one copy per group past the fifth
            assert f"({p} micro-steps)" in trace.repeat.period.name and trace.repeat.period.copies == groups - 4
            assert {op.micro_step for op in trace.schedule.ops} == set(range(5 * p))
            reused.append(groups)
    assert reused == [6, 7, 8]
