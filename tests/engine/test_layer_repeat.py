"""Identical layers reused (zsim/engine/layer_repeat.py) give the result of simulating every op:
step time to 1e-9, peak memory and its breakdown exactly, collective counts and bytes exactly,
for every ZeRO-3 variant (the layers its builder leaves out) at GAS 1..4 and a few models; the
other stages, built whole, are held to the same result."""
from __future__ import annotations

import pytest

from tests.helpers import LAYER_MODELS as MODELS, VARIANTS, ZERO, equal_results, scenario
from zsim.api import run_scenario
from zsim.engine.ledger import timeline

# ZeRO-3's builder leaves layers out (see [Note: layers the builder skips]) in every ZeRO-3
# variant but CPU checkpointing (its copies per layer are outside the hooks' state); the stages
# below 3 build every layer
SKIPPING = {name for name, v in VARIANTS.items() if v.get(f"{ZERO}.stage") == 3}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_layers_reused_equal_full_simulation(name, model):
    for gas in range(1, 5):
        sc = scenario(**VARIANTS[name], **MODELS[model], **{"training.gradient_accumulation_steps": gas})
        reused, trace = run_scenario(sc)
        full, full_trace = run_scenario(sc, steady=False)
        assert full_trace.repeat is None
        equal_results(reused, full)
        if name in SKIPPING:
            # (nested in a micro-step repeat where the step is longer than its shortened one)
            assert trace.repeat is not None and trace.repeat.layers, f"GAS {gas}: layers not reused"
            assert len(trace.schedule.ops) < len(full_trace.schedule.ops)


NESTED = ("stage3", "stage3-full", "stage3-offload-nvme")


@pytest.mark.parametrize("name", NESTED)
def test_layers_reused_inside_a_repeated_micro_step(name):
    """Past the shortened step's micro-steps, steady.py's micro-step repeat and the layer repeat
    nest: still the full simulation's result."""
    for gas in (7, 9):
        sc = scenario(**VARIANTS[name], **MODELS["gpt-32"], **{"training.gradient_accumulation_steps": gas})
        reused, trace = run_scenario(sc)
        full, _ = run_scenario(sc, steady=False)
        equal_results(reused, full)
        assert trace.repeat.period is not None and trace.repeat.layers
        assert reused.events == full.events
        _trace_on_the_full_clock(reused, trace)


def _trace_on_the_full_clock(result, trace):
    """The trace's last op ends with the step and its memory track reaches the peak."""
    from zsim.report.writers import chrome_trace
    from zsim.units import GiB
    events = chrome_trace(trace, "t")["traceEvents"]
    ops = [e for e in events if e["ph"] == "X" and e["cat"] != "steady state"]
    assert max(e["ts"] + e["dur"] for e in ops) == pytest.approx(result.step_time_s * 1e6, abs=1e-2)
    reserved = result.memory.breakdown["CUDA context + allocator reserve"]
    top = max(e["args"]["GiB"] for e in events if e["ph"] == "C")
    assert top == pytest.approx((result.memory.peak_bytes - reserved) / GiB, abs=1e-5)


def test_the_trace_shows_the_simulated_layers_and_marks_the_repeated_ones():
    from zsim.report.writers import chrome_trace
    sc = scenario(**VARIANTS["stage3"], **MODELS["gpt-32"])
    result, trace = run_scenario(sc)
    windows = trace.repeat.layers
    events = chrome_trace(trace, "t")["traceEvents"]
    ops = [e for e in events if e["ph"] == "X" and e["cat"] != "steady state"]
    marked = [e for e in ops if "repeated_layers" in e["args"]]
    assert len(marked) == sum(len(w.ops) for w in windows)
    assert {e["args"]["repeated_layers"] for e in marked} == {w.copies for w in windows}
    skipped = [e for e in events if e.get("cat") == "steady state"]
    assert [e["dur"] for e in skipped] == pytest.approx([w.skipped_s * 1e6 for w in windows], abs=1e-3)
    _trace_on_the_full_clock(result, trace)


def test_the_forward_keeps_growing_through_the_copies_not_simulated():
    """Without checkpointing every forward block keeps its activations: the peak, at the end of
    the forward, holds every layer's, though the simulation ran a few of them."""
    sc = scenario(**VARIANTS["stage3"], **MODELS["gpt-32"])
    _, trace = run_scenario(sc)
    forward = [w for w in trace.repeat.layers if w.name.startswith("forward")]
    assert forward and dict(forward[0].delta_bytes)["activations"] > 0
    simulated_top = max(used for _, used in timeline(trace.ledger_events))
    assert trace.repeat.peak_and_breakdown(trace.ledger_events)[0] > simulated_top


@pytest.mark.parametrize("name", ("stage3", "stage3-full"))
def test_buckets_that_span_layers_repeat_every_few_layers(name):
    """An IPG bucket of about 1.6 layers' gradients flushes at the same place every 3 layers:
    3 backward layers make one copy (ZeRO-3's builder drops the forward's one at a time, see
    tests/schedule/test_layer_skip.py)."""
    model = {**MODELS["gpt-32"], "model.layers": 48, f"{ZERO}.reduce_bucket_size": 20_000_000}
    for gas in (1, 2):
        sc = scenario(**VARIANTS[name], **model, **{"training.gradient_accumulation_steps": gas})
        reused, trace = run_scenario(sc)
        full, _ = run_scenario(sc, steady=False)
        equal_results(reused, full)
        assert {w.layers for w in trace.repeat.layers if w.name.startswith("backward")} == {3}


@pytest.mark.parametrize("name", ("stage3", "stage3-full"))
def test_prefetch_several_layers_ahead_still_reused(name):
    """Under tensor parallelism a rank's share of a layer is small, so ZeRO-3 prefetches several
    layers ahead: a block waits on a gather issued more blocks back than the settling blocks
    cover. The blocks built before each gap grow to that reach, and the layers are still
    reused. (At GAS 3 this small model's first backward does not repeat, so its step is built
    whole: still the full simulation's result.)"""
    from zsim.schedule.layer_skip import SETTLE
    model = {**MODELS["gpt-32"], "model.layers": 48}
    for gas in (1, 3):
        sc = scenario(**VARIANTS[name], **model, **{"parallelism.tensor": 2, "parallelism.sequence_parallel": True,
                                                    "training.gradient_accumulation_steps": gas})
        reused, trace = run_scenario(sc)
        full, full_trace = run_scenario(sc, steady=False)
        equal_results(reused, full)
        if gas == 1:
            assert max(k.settle for k in trace.schedule.skipped) > SETTLE
            windows = [w for w in trace.repeat.layers if w.name.startswith("forward")]
            assert windows and len(trace.schedule.ops) < len(full_trace.schedule.ops)


def test_a_pass_whose_copies_fall_behind_gets_every_op_simulated():
    """ZeRO-3 with the optimizer offloaded: the boundary backward copies every bucket's gradient
    to the host (and the running sum back), which on a narrow host link fall further behind
    every layer, so that pass's window never runs alike. The builder left its layers out; the
    engine finds the window does not repeat, the step is built whole and every op simulated:
    the full simulation's result."""
    narrow = {"pcie": {"bw_GBps_per_gpu": 4, "switch_uplink_GBps": 4}}
    model = {**MODELS["gpt-32"], f"{ZERO}.offload_optimizer": {"device": "cpu"}, "hardware.override": narrow,
             "training.gradient_accumulation_steps": 3}
    sc = scenario(**VARIANTS["stage3"], **model)
    from zsim.schedule.build import build_schedule
    assert build_schedule(sc, skip_layers=True)[1].skipped    # the builder did leave layers out
    reused, trace = run_scenario(sc)
    full, _ = run_scenario(sc, steady=False)
    assert not trace.schedule.skipped and trace.repeat is None
    equal_results(reused, full)
