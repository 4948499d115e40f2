"""The offloaded optimizer step on the host, as DeepSpeed 0.19.8 runs it (see [Note: CPU step
traffic]): CPU Adam at its cores' rate or the host's bandwidth, whichever is slower; the
unscale/clip multiply and the 16-bit copy of the master streamed besides; ZeRO-3's converted
copy to the GPU pageable. And what one GPU measured (tests/fixtures/measured/gpu/)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import scenario
from zsim.hardware.host import CPU_ADAM_BYTES_PER_PARAM, cpu_adam_time_s, host_pass_time_s, pcie_time_s
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import OpKind, Transfer

Z = "deepspeed.zero_optimization."
MEASURED = Path(__file__).parents[1] / "fixtures" / "measured" / "gpu" / "h200-deepspeed"


def test_cpu_adam_is_the_slower_of_cores_and_host_bandwidth():
    n = 1e9
    # compute-bound: 10 cores at 1e8 params/s each -> 1 s; 28 GB at 1 TB/s -> 0.028 s
    assert cpu_adam_time_s(n, 1e8, 10, 1, 1.0, 1e12) == pytest.approx(1.0)
    # bandwidth-bound: 8 GPUs' ranks share 80 GB/s -> 10 GB/s each -> 2.8 s
    assert cpu_adam_time_s(n, 1e10, 80, 8, 1.0, 80e9) == pytest.approx(n * CPU_ADAM_BYTES_PER_PARAM / 10e9)
    assert host_pass_time_s(0.0, 1e9, 1) == 0.0
    assert host_pass_time_s(8e9, 80e9, 8) == pytest.approx(0.8)


def test_pageable_copies_run_at_the_profiles_share():
    assert pcie_time_s(1e9, 1e10, 0.0, True, 0.25)[1] == pytest.approx(0.1)
    assert pcie_time_s(1e9, 1e10, 0.0, False, 0.25)[1] == pytest.approx(0.4)
    assert pcie_time_s(1e9, 1e10, 0.0, False)[1] == pytest.approx(0.2)   # the default half


def _step_ops(**over):
    sc = scenario(**{"hardware.gpus_per_node": 1, **over})
    _, schedule = build_schedule(sc)
    adam = [op for op in schedule.ops if op.kind == OpKind.CPU_ADAM]
    upload = [op for op in schedule.ops if op.kind == OpKind.PARAM_UPLOAD]
    return sc, adam, upload


@pytest.mark.parametrize("stage,precision,clip,per_param", [
    (2, "bf16", 1.0, 8 + 4 + 2),    # clip multiply; fp32 master -> bf16 buffer
    (2, "bf16", 0.0, 4 + 2),        # no clipping, loss scale 1: unscale_and_clip_grads returns early
    (2, "fp16", 0.0, 8 + 4 + 2),    # the dynamic loss scale is divided out
    (2, "fp32", 0.0, 4 + 4),        # fp32 "bit16" buffer still copied
    (3, "bf16", 0.0, 8 + 4 + 2),    # ZeRO-3 always multiplies; converts on the CPU
    (3, "fp32", 0.0, 8),            # same dtype: no conversion
])
def test_step_host_passes_follow_deepspeed(stage, precision, clip, per_param):
    sc, adam, _ = _step_ops(**{f"{Z}stage": stage, "training.precision": precision,
                               "deepspeed.gradient_clipping": clip, f"{Z}offload_optimizer": {"device": "cpu"}})
    assert adam
    for op in adam:
        assert op.payload.pass_bytes == pytest.approx(per_param * op.payload.params)


@pytest.mark.parametrize("stage,pin,pinned", [(2, True, None), (2, False, None), (3, True, False)])
def test_updated_params_upload_pinned_as_deepspeed_copies_them(stage, pin, pinned):
    """ZeRO-1/2 upload the bit16 buffer (pinned with pin_memory: the schedule's setting, None);
    ZeRO-3's converting copy_ uploads a fresh pageable tensor."""
    _, _, upload = _step_ops(**{f"{Z}stage": stage, "training.precision": "bf16",
                                f"{Z}offload_optimizer": {"device": "cpu", "pin_memory": pin}})
    assert upload and {op.payload.pinned for op in upload} == {pinned}
    assert {op.payload.transfer for op in upload} == {Transfer.H2D}


def _measured(name):
    return json.loads((MEASURED / f"{name}.json").read_text())


def test_measured_gpu_runs_are_deepspeeds_on_one_h200():
    prov = json.loads((MEASURED / "provenance.json").read_text())
    assert prov["gpu"] == "NVIDIA H200" and prov["deepspeed"] == "0.19.8"
    names = sorted(p.stem for p in MEASURED.glob("z*.json"))
    assert len(names) == 9
    for n in names:
        m = _measured(n)
        # three timed steps each; z3's spread is the widest (267 / 322 / 284 ms)
        assert m["engine"] == "deepspeed" and m["world_size"] == 1 and m["step_time_spread"] < 0.25
        assert m["overrides"] and all(isinstance(o, str) for o in m["overrides"])


def test_offloaded_step_runs_on_the_hosts_threads():
    """The control run: the same ZeRO-2 offload case with OMP_NUM_THREADS=1 (as calibration/core/run.py
    forced before) spends 4.7x longer in DeepSpeedCPUAdam's step than with the launcher's threads,
    which is what zsim models (cores_per_node / gpus_per_node) and what a user's one-GPU run gets."""
    from calibration.core.run import rank_threads

    one, default = _measured("omp1-z2-off"), _measured("z2-off")
    assert one["overrides"] == default["overrides"]
    assert one["phases_s"]["step"] > 4 * default["phases_s"]["step"]
    assert rank_threads("deepspeed", True, {}) is None                      # a GPU rank keeps the launcher's
    assert rank_threads("deepspeed", True, {"OMP_NUM_THREADS": "1"}) is None
    assert rank_threads("deepspeed", False, {}) == 1                        # CPU ranks share the cores
    assert rank_threads("own", False, {"OMP_NUM_THREADS": "3"}) == 3


@pytest.mark.parametrize("name", ["z0", "z1", "z2", "z3", "z2-off", "z3-off", "z2-gas2", "z2-mb8", "z2-off-pageable"])
def test_peak_memory_of_measured_gpu_runs_within_3_percent(name):
    """zsim's peak (predicted as zsim validate predicts, on the calibrated profile) against
    torch.cuda.max_memory_allocated of DeepSpeed's run (within 1.3% today; docs/validation.md,
    "One GPU")."""
    from calibration.commands.validate import predict
    from calibration.validation import prediction_overrides
    from zsim.config.scenario import load_scenario

    m = _measured(name)
    sc = load_scenario(str(Path(__file__).resolve().parents[2] / "benchmarks" / "validate_scenarios" / "gpu-1b.yaml"),
                       (*m["overrides"], *prediction_overrides("h200-1gpu", 1)))
    predicted, _ = predict(sc)
    assert predicted["peak_bytes"] == pytest.approx(m["peak_bytes"], rel=0.03)


def test_deepspeed_peer_runs_the_scenarios_offload_with_deepspeeds_optimizer():
    """On a GPU the DeepSpeed peer (calibration/core/peers.py) offloads as the scenario says and
    lets DeepSpeed build its optimizer (DeepSpeedCPUAdam for an offloaded AdamW)."""
    from calibration.core.peers import ds_config

    cfg = ds_config(scenario(**{f"{Z}stage": 3, f"{Z}offload_optimizer": {"device": "cpu", "pin_memory": False},
                                f"{Z}offload_param": {"device": "cpu"}}))
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert cfg["optimizer"]["type"] == "AdamW"
    assert "optimizer" not in ds_config(scenario(**{f"{Z}stage": 2}))

