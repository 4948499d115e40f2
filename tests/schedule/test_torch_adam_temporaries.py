"""The optimizer step's own temporaries (see [Note: torch Adam step temporaries]): torch's Adam/AdamW
(a client optimizer, or "torch_adam": true) allocates beside the fp32 master while it updates, and
DeepSpeed 0.19.8's ZeRO-3 peak on CPU/gloo was there (tests/fixtures/deepspeed_zeropp)."""
import json
from pathlib import Path

import pytest

from tests.helpers import CLIENT_ADAMW_ON_CPU, scenario, zeropp_fixture_scenario
from zsim.api import run_scenario
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Buffer, OpKind
from zsim.schedule.optimizer import update_temp_bytes_per_param

ZEROPP = Path(__file__).parents[1] / "fixtures" / "deepspeed_zeropp"
FOUR_RANK = ["stage3_default_w4", "stage3_reduce_bucket_1e6_w4", "stage3_prefetch_0_reuse_0_w4",
             "stage3_prefetch_0_reuse_0_reduce_bucket_1e6_w4"]


@pytest.mark.parametrize("name", FOUR_RANK)
def test_zero3_peaks_against_deepspeed_with_the_client_optimizer(name):
    fx = json.loads((ZEROPP / f"{name}.json").read_text())
    assert fx["optimizer"]["client"] == "torch.optim.AdamW(lr=1e-3)" and "optimizer" not in fx["ds_config"]
    result, _ = run_scenario(zeropp_fixture_scenario(fx, CLIENT_ADAMW_ON_CPU))
    measured = fx["peak_bytes_per_rank"][0]
    assert result.memory.peak_bytes == pytest.approx(measured, rel=0.03)


def test_the_step_peak_is_the_for_loops_two_temporaries():
    """Prefetch 0, reuse 0 and a 1e6 bucket: the peak is the step's (traced: inside adam.py:544),
    the sub-group's fp32 gradient and two fp32 temporaries of it, where FusedAdam holds the fp32
    gradient and the conversion's flat bf16 copy (DeepSpeed's own optimizer for an AdamW block)."""
    fx = json.loads((ZEROPP / "stage3_prefetch_0_reuse_0_reduce_bucket_1e6_w4.json").read_text())
    torch_adam, _ = run_scenario(zeropp_fixture_scenario(fx, CLIENT_ADAMW_ON_CPU))
    fused, _ = run_scenario(zeropp_fixture_scenario(fx, None))
    shard = fx["model"]["total_params"] // fx["world_size"]
    temporaries = torch_adam.memory.breakdown["optimizer temporaries"]
    assert temporaries == 4 * shard + 2 * 4 * shard
    assert fused.memory.breakdown["optimizer temporaries"] == 4 * shard + 2 * shard
    assert torch_adam.memory.peak_bytes - fused.memory.peak_bytes == 2 * 4 * shard - 2 * shard
    assert fused.memory.peak_bytes < 0.8 * fx["peak_bytes_per_rank"][0]     # -21%: the gap this closes


@pytest.mark.parametrize("optimizer, params", [
    ("AdamW", {"foreach": False}),
    ("AdamW", {"foreach": False, "weight_decay": 0.0}),
    ("Adam", {"foreach": False, "adam_w_mode": False, "weight_decay": 0.01}),
    ("Adam", {"foreach": False, "adam_w_mode": False}),
    ("AdamW", {"foreach": True}),
    ("Adam", {"foreach": True, "adam_w_mode": False, "weight_decay": 0.01}),
    ("AdamW", {"fused": True}),
])
def test_update_temporaries_are_torchs(optimizer, params):
    """What zsim charges per fp32 element equals what torch 2.13's step allocates (measured here on
    CPU, calibration/core/memory.py's tracker, one flat tensor as the ZeRO optimizers step)."""
    torch = pytest.importorskip("torch")

    from calibration.core.memory import TensorMemoryTracker

    sc = scenario(**{"deepspeed.optimizer": {"type": optimizer, "params": {"torch_adam": True, **params}}})
    kwargs = {k: v for k, v in params.items() if k != "adam_w_mode"}
    cls = torch.optim.Adam if params.get("adam_w_mode") is False else torch.optim.AdamW
    n = 1 << 18
    p = torch.nn.Parameter(torch.randn(n))
    opt = cls([p], lr=1e-3, **kwargs)
    p.grad = torch.randn(n)
    opt.step()       # the moments exist from the first step on
    tracker = TensorMemoryTracker().start()
    before = tracker.current
    with tracker:
        opt.step()
    assert update_temp_bytes_per_param(sc.deepspeed) == (tracker.peak - before) / n


def test_deepspeeds_fused_adam_and_other_optimizers_add_nothing():
    for block in ({"type": "AdamW"}, {"type": "Adam", "params": {"torch_adam": False}},
                  {"type": "Lion"}, {"type": "Adagrad", "params": {"torch_adam": True}}):
        assert update_temp_bytes_per_param(scenario(**{"deepspeed.optimizer": block}).deepspeed) == 0


@pytest.mark.parametrize("foreach, expected", [(False, "largest"), (None, "all")])
def test_stage0_steps_separate_tensors(foreach, expected):
    """Stage 0 steps the params one tensor each: the for-loop's temporaries are the largest param's,
    foreach's span every tensor of the step."""
    params = {"torch_adam": True} | ({"foreach": foreach} if foreach is not None else {})
    sc = scenario(**{"deepspeed.zero_optimization.stage": 0, "deepspeed.optimizer": {"type": "AdamW",
                                                                                     "params": params}})
    wl, schedule = build_schedule(sc)
    step = next(op for op in schedule.ops if op.kind == OpKind.OPTIMIZER_STEP)
    update = [a.size_bytes for a in step.alloc if a.tag.buffer == Buffer.OPT_UPDATE]
    numels = [p.numel for p in wl.params]
    assert update == [8 * max(numels) if expected == "largest" else 4 * sum(numels)]
    assert max(numels) < sum(numels) / 4


def test_torch_adam_update_traffic_is_one_pass_per_operation():
    """OptimizerConfig.step_bytes_per_param: FusedAdam's 28 bytes a parameter against torch's
    unfused AdamW (torch/optim/adam.py: lerp 12, mul 8, addcmul 12, sqrt 8, div 8, add 8,
    addcdiv 16, decoupled weight decay 8), as the client torch.optim.AdamW of an HF/accelerate run."""
    from zsim.specs.deepspeed import OptimizerConfig
    assert OptimizerConfig(type="AdamW").step_bytes_per_param == 28.0
    assert OptimizerConfig(type="AdamW", params={"torch_adam": True}).step_bytes_per_param == 80.0   # wd 1e-2
    assert OptimizerConfig(type="AdamW", params={"torch_adam": True, "weight_decay": 0.0}).step_bytes_per_param == 72.0
    assert OptimizerConfig(type="Adam", params={"torch_adam": True, "adam_w_mode": False,
                                                "weight_decay": 0.1}).step_bytes_per_param == 84.0
    assert OptimizerConfig(type="AdamW", params={"torch_adam": True, "fused": True}).step_bytes_per_param == 28.0
