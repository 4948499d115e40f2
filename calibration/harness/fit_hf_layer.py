"""Fit a profile's compute figures to a measured Hugging Face decoder layer (`zsim calibrate
--hf-layer`; the records are calibration/harness/hf_layer.py's). Pure functions: no torch.

Measured per module kind (GROUPS), from the raw unit timings:
  attn_proj       q/k/v/o projections (each nn.Linear of the attention module, timed alone)
  attention_core  the attention module less its projections: RoPE, reshapes, the SDPA/eager/FA call
  mlp_proj        a dense MLP's nn.Linears (gate/up/down)
  mlp_act         the dense MLP less its projections: act_fn(gate) * up
  router, experts a MoE block's router (its `gate`) and the rest of the block
  norm            the layer's norms; residual: its two residual adds
  layer           the whole layer
each for the forward (fwd), the backward (bwd) and the recompute (bwd_ckpt - bwd: what gradient
checkpointing re-runs inside the backward).

zsim's side is its own workload for the model (zsim.workload.transformer.build_workload at the
same shapes, precision and attention implementation), each module of the layer priced by the cost
model's own functions (zsim.schedule.passes.forward_work/backward_work, zsim.hardware.cost_model.
compute_work_s, zsim.hardware.compute.kernel_overhead_s): a recompute is priced as its forward, as
zsim's full checkpointing charges it. A module's time is split into the parts those functions
price (GEMMs, attention, memory-bound bytes, launches; any other part the cost model adds stays
fixed), each part counted in the module's kind, except a Linear's memory-bound bytes: in zsim those
are the residual add fused after it (Megatron's bias_dropout_add), counted as `residual`.

The fit: one non-negative scale per part (GEMM time, attention forward, attention backward,
memory-bound time, launch overhead) by least squares in relative error over every (shape, kind,
fwd/bwd) and the layer's fwd/bwd/recompute (weighted LAYER_WEIGHT: the layer is the target, the
kinds identify the parts), for each GEMM half-efficiency dimension on a grid; the scales become the
profile's gemm_max_efficiency (the peak stays the base profile's), flash_attention_{fwd,bwd}_efficiency and overheads, memory_bound_efficiency and kernel_overhead_us.
Efficiencies stay <= 1. Residuals are then recomputed by pricing the fitted profile in full.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from calibration.harness.fit_layer import nnls_relative
from zsim.hardware.compute import kernel_overhead_s
from zsim.hardware.cost_model import compute_work_s
from zsim.schedule.passes import backward_work, forward_work
from zsim.schedule.payloads import ComputeWork
from zsim.workload.module import DTYPE_BYTES, ModuleKind

GROUPS = ("attn_proj", "attention_core", "mlp_proj", "mlp_act", "router", "experts", "norm", "residual")
PASSES = ("fwd", "bwd", "recompute")
PARTS = ("gemm", "attention_fwd", "attention_bwd", "memory", "launch")
# the layer's rows count this many times a kind's in the least squares
LAYER_WEIGHT = 3.0
D_HALF_GRID = [float(v) for v in np.geomspace(1, 4096, 25)]


def measured_groups(records: list[dict]) -> dict[tuple, float]:
    """(seq_len, micro_batch, group, pass) -> seconds, from the raw unit records (see the module
    docstring). A derived kind (a container less its parts) may come out <= 0 on a noisy machine:
    it is kept, and the fit leaves such rows out."""
    by_group: dict[tuple, float] = {}
    for r in records:
        if r.get("kind") == "hf_module":
            k = (r["seq_len"], r["micro_batch"], r["group"], r["pass"])
            by_group[k] = by_group.get(k, 0.0) + r["time_s"] * r.get("count", 1)
    out: dict[tuple, float] = {}
    shapes = sorted({(s, b) for s, b, _, _ in by_group})
    for s, b in shapes:
        for pas in ("fwd", "bwd", "bwd_ckpt"):
            g = {grp: by_group.get((s, b, grp, pas)) for grp in ("layer", "attention", "attn_proj", "mlp", "mlp_proj",
                                                                   "router", "norm", "residual")}
            row = {"layer": g["layer"], "attn_proj": g["attn_proj"], "norm": g["norm"], "residual": g["residual"]}
            if g["attention"] is not None and g["attn_proj"] is not None:
                row["attention_core"] = g["attention"] - g["attn_proj"]
            if g["router"] is not None:
                row["router"] = g["router"]
                row["experts"] = g["mlp"] - g["router"]
            elif g["mlp_proj"] is not None:
                row["mlp_proj"] = g["mlp_proj"]
                row["mlp_act"] = g["mlp"] - g["mlp_proj"]
            for grp, v in row.items():
                if v is not None:
                    out[(s, b, grp, pas)] = v
    # the recompute: the checkpointed backward's excess over the plain one
    for (s, b, grp, pas), v in list(out.items()):
        if pas == "bwd" and (s, b, grp, "bwd_ckpt") in out:
            out[(s, b, grp, "recompute")] = out.pop((s, b, grp, "bwd_ckpt")) - v
    return {k: v for k, v in out.items() if k[3] in PASSES}


def zsim_group(module, moe_layer: bool) -> str:
    """The measured kind a zsim module of the layer belongs to (names: zsim/workload/)."""
    local = module.name.split(".", 2)[2]   # layers.<i>.<local>
    if module.kind == ModuleKind.ATTENTION:
        return "attention_core"
    if local.startswith("attn."):
        return "attn_proj" if module.kind == ModuleKind.LINEAR else "attention_core"
    if local.startswith("mlp."):
        if moe_layer:
            return "router" if local == "mlp.gate" else "experts"
        return "mlp_proj" if module.kind == ModuleKind.LINEAR else "mlp_act"
    if module.kind == ModuleKind.NORM:
        return "norm"
    return "other"


@dataclasses.dataclass(frozen=True)
class Pricing:
    """The layer's zsim modules at one shape, and how a profile prices them."""
    modules: tuple
    moe_layer: bool
    dtype: str

    def works(self, pas: str):
        for m in self.modules:
            w = backward_work(m, "none") if pas == "bwd" else forward_work(m)
            yield m, w

    def parts(self, gpu, gpu_fp32, peak_flops: float, pas: str) -> dict[str, np.ndarray]:
        """group -> seconds per part (PARTS, then the unsplit rest) of pass `pas` under the profile."""
        nb = DTYPE_BYTES[self.dtype]
        out: dict[str, np.ndarray] = {}

        def price(w):
            return compute_work_s(w, gpu, gpu_fp32, peak_flops, nb)
        for m, w in self.works(pas):
            grp = zsim_group(m, self.moe_layer)
            gemm = price(ComputeWork(gemms=w.gemms))
            attn = price(ComputeWork(attention_flops=w.attention_flops, attention_backward=w.attention_backward))
            mem = price(ComputeWork(mem_bytes=w.mem_bytes, fp32_mem_bytes=w.fp32_mem_bytes))
            rest = price(w) - gemm - attn - mem
            launch = kernel_overhead_s(w.kernels, gpu)
            row = out.setdefault(grp, np.zeros(len(PARTS) + 1))
            row += [gemm, attn if pas != "bwd" else 0.0, attn if pas == "bwd" else 0.0,
                    0.0 if m.kind == ModuleKind.LINEAR else mem, launch, rest]
            if m.kind == ModuleKind.LINEAR and mem:
                out.setdefault("residual", np.zeros(len(PARTS) + 1))[3] += mem
        out["layer"] = sum(out.values())
        return out


def predicted_groups(pricings: dict, gpu, gpu_fp32, peak_flops: float) -> dict[tuple, float]:
    """(seq_len, micro_batch, group, pass) -> zsim's seconds under the profile."""
    out = {}
    for (s, b), pr in pricings.items():
        for pas in PASSES:
            for grp, row in pr.parts(gpu, gpu_fp32, peak_flops, pas).items():
                out[(s, b, grp, pas)] = float(row.sum())
    return out


def _fit_rows(measured: dict, pricings: dict, gpu, gpu_fp32, peak_flops: float):
    X, fixed, y, w, keys = [], [], [], [], []
    for (s, b), pr in sorted(pricings.items()):
        for pas in PASSES:
            parts = pr.parts(gpu, gpu_fp32, peak_flops, pas)
            for grp, row in parts.items():
                key = (s, b, grp, pas)
                v = measured.get(key)
                if v is None or v <= 0 or (pas == "recompute" and grp != "layer") or grp == "other":
                    continue
                X.append(row[:len(PARTS)])
                fixed.append(row[len(PARTS)])
                y.append(v)
                w.append(v / (LAYER_WEIGHT if grp == "layer" else 1.0))
                keys.append(key)
    return np.array(X), np.array(fixed), np.array(y), np.array(w), keys


def apply_scales(gpu, scales: dict) -> dict:
    """Profile fields that turn `gpu`'s part times into scaled ones (each scale is at least the
    efficiency it divides, so efficiencies stay <= 1 and the GEMM peak stays the base profile's:
    a layer's GEMMs cannot run above the device's peak, and letting them would let the launch
    overhead of a small layer's many calls price its GEMMs as free)."""
    f = {"gemm_max_efficiency": min(1.0, gpu.gemm_max_efficiency / scales["gemm"])}
    for pas in ("fwd", "bwd"):
        s = scales[f"attention_{pas}"]
        f[f"flash_attention_{pas}_efficiency"] = min(1.0, getattr(gpu, f"flash_attention_{pas}_efficiency") / s)
        f[f"flash_attention_{pas}_overhead_us"] = getattr(gpu, f"flash_attention_{pas}_overhead_us") * s
    f["memory_bound_efficiency"] = min(1.0, gpu.memory_bound_efficiency / scales["memory"])
    f["kernel_overhead_us"] = gpu.kernel_overhead_us * scales["launch"]
    return f


def fit(measured: dict, pricings: dict, gpu, gpu_fp32, peak_tflops: float) -> dict:
    """The fitted fields (d_half included), with residuals before and after (see the module docstring)."""
    best = None
    for d_half in [gpu.gemm_half_efficiency_dim] + D_HALF_GRID:
        g = dataclasses.replace(gpu, gemm_half_efficiency_dim=d_half)
        X, fixed, y, w, _ = _fit_rows(measured, pricings, g, gpu_fp32, peak_tflops * 1e12)
        if not len(y):
            raise ValueError("no measured kind to fit (every derived time was <= 0)")
        # efficiencies stay <= 1: a part's scale is at least its current efficiency
        lower = np.array([g.gemm_max_efficiency, g.flash_attention_fwd_efficiency, g.flash_attention_bwd_efficiency,
                          g.memory_bound_efficiency, 0.0])
        used = X.any(axis=0)   # a part no row prices (no attention backward in ...) keeps scale 1
        b = np.ones(len(PARTS))
        b[used] = nnls_relative(X[:, used], y - fixed, lower[used], w)
        err = float((((X @ b + fixed) - y) / w) ** 2 @ np.ones(len(y)))
        if best is None or err < best[0] - 1e-15:
            best = (err, d_half, b)
    _, d_half, b = best
    g = dataclasses.replace(gpu, gemm_half_efficiency_dim=d_half)
    scales = dict(zip(PARTS, (float(v) for v in b)))
    fields = apply_scales(g, scales)
    fields["gemm_half_efficiency_dim"] = d_half
    fitted = dataclasses.replace(g, **fields)
    before = residuals(measured, predicted_groups(pricings, gpu, gpu_fp32, peak_tflops * 1e12))
    after = residuals(measured, predicted_groups(pricings, fitted, gpu_fp32, peak_tflops * 1e12))
    return {"fields": fields, "scales": scales, "residuals_before": before,
            "residuals": after, "rms_error_before": rms(before), "rms_error": rms(after)}


def residuals(measured: dict, predicted: dict) -> list[dict]:
    out = []
    for key in sorted(measured):
        if key in predicted:
            s, b, grp, pas = key
            m, p = measured[key], predicted[key]
            out.append({"seq_len": s, "micro_batch": b, "group": grp, "pass": pas, "measured_s": m,
                        "predicted_s": p, "error": (p - m) / m if m > 0 else None, "fitted": m > 0 and (
                            pas != "recompute" or grp == "layer")})
    return out


def rms(res: list[dict]) -> float:
    """Root mean square relative error over the fitted rows, a layer row counting LAYER_WEIGHT
    times a kind's (the fit's own objective)."""
    e = [r["error"] * (LAYER_WEIGHT if r["group"] == "layer" else 1.0) for r in res
         if r["fitted"] and r["error"] is not None]
    return float(np.sqrt(np.mean(np.square(e)))) if e else 0.0
