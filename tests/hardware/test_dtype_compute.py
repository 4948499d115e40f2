"""Per-dtype compute figures (gpu.by_dtype): a run is priced with its own dtype's fields, a
profile without them prices as before, and bad entries are one-line errors (exit 2)."""
from __future__ import annotations

import pytest

from tests.helpers import mapping, scenario
from zsim.api import run_scenario
from zsim.cli import main
from zsim.schedule.ir import OpKind

# one GPU, stage 0: no collective overlaps the compute stream, so each forward/backward op
# lasts exactly its price
ONE_GPU = {"hardware.gpus_per_node": 1, "deepspeed.zero_optimization.stage": 0}
TOP = {"memory_bound_efficiency": 0.5, "flash_attention_fwd_efficiency": 0.5,
       "flash_attention_bwd_efficiency": 0.4, "kernel_overhead_us": 5.0, "gemm_max_efficiency": 0.7,
       "gemm_half_efficiency_dim": 64.0}
BY_DTYPE = {"fp32": {"memory_bound_efficiency": 0.2, "flash_attention_fwd_efficiency": 0.1,
                     "flash_attention_bwd_efficiency": 0.05, "kernel_overhead_us": 40.0, "gemm_max_efficiency": 0.3},
            "bf16": {"memory_bound_efficiency": 0.6, "flash_attention_fwd_efficiency": 0.7,
                     "flash_attention_bwd_efficiency": 0.6, "kernel_overhead_us": 3.0}}


def _module_pass_times(precision: str, by_dtype: dict | None):
    gpu = {**TOP, **({"by_dtype": by_dtype} if by_dtype is not None else {})}
    sc = scenario(**ONE_GPU, **{"training.precision": precision, "hardware.override": {"gpu": gpu}})
    _, trace = run_scenario(sc)
    ops = [(op, t.end_s - t.start_s) for op, t in zip(trace.schedule.ops, trace.timings)
           if op.kind in (OpKind.FORWARD, OpKind.BACKWARD)]
    return sc, ops


def _formula_s(work, f: dict, peak_flops: float, hbm_Bps: float, dtype_bytes: int, f32: dict | None = None) -> float:
    """zsim's roofline written out (zsim/hardware/compute.py) with the fields `f` (`f32`: fp32's,
    for the kernels that run in fp32 whatever the precision: the loss after its upcast)."""
    t = work.kernels * f["kernel_overhead_us"] * 1e-6
    for m, n, k in work.gemms:
        eff = f["gemm_max_efficiency"]
        for d in (m, n, k):
            eff *= d / (d + f["gemm_half_efficiency_dim"])
        t += max(2 * m * n * k / (peak_flops * eff),
                 (m * k + k * n + m * n) * dtype_bytes / (hbm_Bps * f["memory_bound_efficiency"]))
    if work.attention_flops:
        eff = f["flash_attention_bwd_efficiency"] if work.attention_backward else f["flash_attention_fwd_efficiency"]
        t += work.attention_flops / (peak_flops * eff)
    t += work.fp32_mem_bytes / (hbm_Bps * (f32 or f)["memory_bound_efficiency"])
    return t + work.mem_bytes / (hbm_Bps * f["memory_bound_efficiency"])


@pytest.mark.parametrize("precision, dtype_bytes", [("fp32", 4), ("bf16", 2)])
def test_each_dtype_is_priced_with_its_own_fields(precision, dtype_bytes):
    sc, ops = _module_pass_times(precision, BY_DTYPE)
    fields = {**TOP, **BY_DTYPE[precision]}
    peak, hbm = sc.cluster.peak_flops(precision), sc.cluster.hbm_bw_Bps
    assert any(op.work.attention_flops for op, _ in ops) and any(op.work.gemms for op, _ in ops)
    for op, dur in ops:
        assert dur == pytest.approx(_formula_s(op.work, fields, peak, hbm, dtype_bytes, {**TOP, **BY_DTYPE["fp32"]}),
                                    rel=1e-9), op.name
    # and not with the top-level fields, which differ in every term
    op, dur = next((op, d) for op, d in ops if op.work.attention_flops)
    assert dur != pytest.approx(_formula_s(op.work, TOP, peak, hbm, dtype_bytes), rel=1e-3)


def test_a_dtype_without_an_entry_and_a_profile_without_by_dtype_use_the_top_level():
    sc, ops = _module_pass_times("bf16", {"fp32": BY_DTYPE["fp32"]})
    _, plain = _module_pass_times("bf16", None)
    # only the loss's fp32 kernels (after its upcast) read the fp32 entry
    assert ([d for op, d in ops if not op.work.fp32_mem_bytes]
            == pytest.approx([d for op, d in plain if not op.work.fp32_mem_bytes], rel=1e-9))
    peak, hbm = sc.cluster.peak_flops("bf16"), sc.cluster.hbm_bw_Bps
    for op, dur in plain:
        assert dur == pytest.approx(_formula_s(op.work, TOP, peak, hbm, 2), rel=1e-9)
    for op, dur in ops:
        assert dur == pytest.approx(_formula_s(op.work, TOP, peak, hbm, 2, {**TOP, **BY_DTYPE["fp32"]}), rel=1e-9)
    gpu = sc.cluster.profile.gpu
    assert gpu.for_dtype("bf16") is gpu and scenario().cluster.profile.gpu.for_dtype("fp32").by_dtype == {}


def test_unset_fields_of_an_entry_keep_the_top_level():
    sc = scenario(**{"hardware.override": {"gpu": {**TOP, "by_dtype": {"fp32": {"kernel_overhead_us": 9.0}}}}})
    g = sc.cluster.profile.gpu.for_dtype("fp32")
    assert g.kernel_overhead_us == 9.0 and g.memory_bound_efficiency == 0.5 and g.gemm_max_efficiency == 0.7


@pytest.mark.parametrize("entry, field, fix", [
    ({"fp33": {"memory_bound_efficiency": 0.5}}, "gpu.by_dtype.fp33", "did you mean 'fp32'"),
    ({"fp32": {"memory_bound_efficiency": 1.5}}, "gpu.by_dtype.fp32.memory_bound_efficiency", "at most 1"),
    ({"bf16": {"kernel_overhead_us": -1}}, "gpu.by_dtype.bf16.kernel_overhead_us", "at least 0"),
    ({"bf16": {"peak_tflops_bf16": 1}}, "gpu.by_dtype.bf16.peak_tflops_bf16", "unknown key"),
    ({"bf16": 0.5}, "gpu.by_dtype.bf16", "expected a mapping"),
])
def test_bad_by_dtype_is_one_line_exit_2(tmp_path, capsys, entry, field, fix):
    import yaml
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(mapping(**{"hardware.override": {"gpu": {"by_dtype": entry}}})))
    assert main(["run", str(p), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert field in err and fix in err
