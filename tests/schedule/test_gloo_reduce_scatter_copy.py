"""See [Note: gloo reduce-scatter copy]: gloo's reduce_scatter_tensor works on a copy of its
input, which the CPU profiles carry as gpu.reduce_scatter_temp_fraction (measured by zsim
calibrate) and zsim charges at ZeRO-3's gradient reduce-scatter; checked against every ZeRO-3
peak DeepSpeed measured in the random validations (tests/fixtures/measured/zero3_peaks.json)."""
import json

import pytest

from tests.helpers import ROOT, scenario
from zsim.api import run_scenario
from zsim.config.scenario import load_scenario
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Buffer, Collective

FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "measured" / "zero3_peaks.json").read_text())
VALIDATE = ("hardware.profile=cpu-xeon-vm-2ranks", "hardware.nodes=1", "hardware.override.gpu.cuda_context_GiB=0",
            "hardware.override.gpu.allocator_fragmentation_fraction=0")
Z = "deepspeed.zero_optimization."


@pytest.mark.parametrize("c", FIXTURE["cases"], ids=lambda c: c["case"])
def test_zero3_peak_against_deepspeed(c):
    """Before the copy was charged, the ZeRO-3 cases without contiguous_gradients on 2 ranks (a
    bucket as large as the peak's other parts) were 6.2% to 13.9% under; the rest are exact
    either way. s422533424-01 keeps -3.4% (its early-backward peak holds 2.3 MiB more
    activations and gathered params than zsim; not modelled)."""
    sc = load_scenario(str(ROOT / "benchmarks" / "validate_scenarios" / f"{c['scenario']}.yaml"), (*c["set"], *VALIDATE))
    peak = run_scenario(sc)[0].memory.peak_bytes
    assert abs(peak / c["peak_bytes"] - 1) < (0.035 if c["case"] == "s422533424-01" else 0.015), c["what"]


def _reduce_scatters(profile: str):
    sc = scenario(**{"hardware.profile": profile, "hardware.gpus_per_node": 2, f"{Z}stage": 3,
                     f"{Z}reduce_bucket_size": 2e6})
    return build_schedule(sc)[1], sc


@pytest.mark.parametrize("profile, fraction", [("cpu-xeon-vm-2ranks", 1.0), ("dgx-a100-80g", 0.0)])
def test_the_backend_copy_lives_for_the_call(profile, fraction):
    s, sc = _reduce_scatters(profile)
    assert sc.cluster.profile.gpu.reduce_scatter_temp_fraction == fraction
    ops = [op for op in s.ops if getattr(op.payload, "comm", None) is not None
           and op.payload.comm.collective == Collective.REDUCE_SCATTER]
    assert ops
    for op in ops:
        copies = [a for a in op.alloc if a.tag.buffer == Buffer.COLLECTIVE_TEMP]
        if fraction == 0:
            assert not copies
            continue
        (a,) = copies
        assert a.size_bytes == fraction * op.payload.comm.size_bytes and a.tag in op.free


def test_fit_reads_the_largest_ranks_copy():
    from calibration.harness.fit_compute import fit_collective_memory
    recs = [{"kind": "collective_memory", "op": "reduce_scatter", "input_bytes": 1 << 24, "temp_bytes": float(1 << 24)},
            {"kind": "collective_memory", "op": "all_gather", "input_bytes": 1 << 23, "temp_bytes": 0.0}]
    assert fit_collective_memory(recs) == {"reduce_scatter_temp_fraction": 1.0}
    assert fit_collective_memory([]) == {}
    assert fit_collective_memory([dict(recs[0], temp_bytes=0.0)]) == {"reduce_scatter_temp_fraction": 0.0}
