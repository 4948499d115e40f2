"""Issue 47's MoE speed changes keep the result: a many-expert step's micro-step repeat equals
simulating every micro-step. (The small model here
repeats within the plain 1e-12 too; the rounding tolerance, steady.tolerance_s, matters at full size:
Qwen3-30B-A3B's ~51,000-op micro-step, too slow for the suite, measured in the commit that added it.)"""
from __future__ import annotations

import pytest

from tests.helpers import scenario
from tests.helpers import equal_results
from zsim.api import run_scenario
from zsim.engine.steady import _REL_TOL, tolerance_s
from zsim.engine.sim import OpTiming

ZERO = "deepspeed.zero_optimization"
# a dropless many-expert model (Qwen3-MoE-like, small) as transformers 4 builds it: every expert
# is four modules, so a micro-step holds thousands of ops; its gradient bucket flushes at another
# expert in each layer (transformers 5's grouped experts are two modules a layer:
# see [Note: transformers 5 MoE experts])
MANY_EXPERTS = {"training.experts_implementation": "modules", "model.layers": 6, "model.hidden": 256, "model.heads": 4, "model.glu": True, "model.norm": "rmsnorm",
                "model.position": "rope", "model.bias": False,
                "model.moe": {"experts": 64, "top_k": 8, "dispatch": "dropless", "expert_ffn_hidden": 128},
                f"{ZERO}.stage": 3, f"{ZERO}.reduce_bucket_size": 1_000_000,
                f"{ZERO}.stage3_prefetch_bucket_size": 200_000, f"{ZERO}.stage3_param_persistence_threshold": 1000}


def test_the_tolerance_is_the_plain_one_below_thousands_of_ops_and_grows_with_the_window():
    timings = [OpTiming(0, 0.0, 10.0)]
    assert tolerance_s(timings, 100) == _REL_TOL * 10.0
    assert tolerance_s(timings, 4000) == _REL_TOL * 10.0
    assert tolerance_s(timings, 50_000) > 10 * _REL_TOL * 10.0
    assert tolerance_s(timings, 50_000) < 1e-10 * 10.0     # far inside the exactness tests' 1e-9


@pytest.mark.parametrize("gas", [7, 9])
def test_a_many_expert_step_reuses_its_micro_steps_and_equals_every_micro_step_simulated(gas):
    sc = scenario(**MANY_EXPERTS, **{"training.gradient_accumulation_steps": gas})
    reused, trace = run_scenario(sc)
    full, full_trace = run_scenario(sc, steady=False)
    assert full_trace.repeat is None
    assert trace.repeat is not None and trace.repeat.period is not None, "the micro-step repeat was refused"
    equal_results(reused, full)
    assert reused.events == full.events
