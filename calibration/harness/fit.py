"""Raw calibration records -> a zsim hardware profile. Pure functions: no torch, no I/O.

Methods
- Collectives: t(size) = alpha + size/beta per (collective, tier, dtype), fitted by
  iteratively reweighted least squares with Huber weights on relative residuals (Huber 1964,
  "Robust Estimation of a Location Parameter"; Holland & Welsch 1977, "Robust regression
  using iteratively reweighted least-squares"): relative, because sizes span 5 decades and a
  fit in absolute time would ignore every small message. The profile then stores what
  zsim's cost function (zsim/hardware/collectives.py) needs to reproduce each measurement:
  a per-step latency, a peak bus bandwidth (nccl-tests convention) and, per collective, the
  fraction of that peak reached at each measured size.
- GEMMs: zsim's efficiency law eff = max_eff * prod(d / (d + d_half)) with max_eff = 1 and
  the peak per dtype as the law's asymptote; d_half by grid search, the peaks in closed form
  (least squares in relative time error).
- Attention, memory-bound kernels: measured time minus zsim's per-kernel overhead, against
  the FLOPs and bytes zsim's workload charges (zsim/workload/transformer.py), so the fitted
  efficiencies reproduce what the simulator predicts for exactly these ops.
- Layer closure: the real layer also runs work zsim does not cost per op (reshapes,
  autograd bookkeeping, bias-gradient reductions); scales of the GEMM and attention times
  close the gap to the measured layers (fit_layer.py).
- Each training precision listed (`--dtype fp32,bf16`) gets its own kernel fits and closure
  from its own records (fit_compute.py); the device's figures (launch overhead, bandwidth,
  d_half, fresh allocations) are one fit.
"""
from __future__ import annotations

import math

from calibration.harness.fit_comm import fit_collectives, fit_reductions_16bit
from calibration.harness.fit_common import fit_rate, usable
from calibration.harness.fit_compute import fit_compute
from calibration.harness.fit_host import fit_adam, fit_interference, fit_io, fit_rank_views, fit_zero3_hooks
from zsim.errors import ZsimInputError
from zsim.hardware.host import CPU_ADAM_BYTES_PER_PARAM
from zsim.specs.hardware import REDUCED_16BIT


# Vendor dense peaks (TFLOP/s, no sparsity) of the GPUs calibration has met, by a substring of the
# device name: NVIDIA's H100/H200 SXM and A100 SXM datasheets. They are MFU's denominator
# (gpu.datasheet_tflops) and, for a dtype the run did not measure, the ratio its peak keeps to the
# measured one's (fp32 without tensor cores, tf32 and 16-bit on them).
DATASHEET_TFLOPS = {
    "H200": {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    "H100": {"fp32": 67.0, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4},
    "A100": {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
}


def datasheet_of(gpu_name: str) -> dict[str, float]:
    return next((peaks for key, peaks in DATASHEET_TFLOPS.items() if key in gpu_name), {})


def build_profile(name: str, records: list[dict], prov: dict, dtypes: tuple[str, ...],
                  interconnect: tuple[str, dict] | None = None) -> tuple[dict, dict]:
    """The profile mapping (same keys as hardware_profiles/*.yaml) and the fit report. The
    compute figures are fitted for each of `dtypes`: the first gives the top-level gpu fields, and
    two or more also give gpu.by_dtype one entry each (zsim.specs.hardware.GpuProfile.for_dtype).
    `interconnect` (a profile's name and mapping) gives the tiers a one-rank run cannot measure
    (no collective has a peer): its intra_node, inter_node and nccl sections are copied, and the
    provenance says so."""
    dtype = dtypes[0]
    measured = {r["dtype"] for r in usable(records, "layer")}
    # a dtype the run did not measure would only repeat another dtype's fit (its peak, its
    # efficiencies' placeholders): refused, one dtype or a list
    missing = [d for d in dtypes if (len(dtypes) > 1 or measured) and d not in measured]
    if missing:
        raise ZsimInputError("--dtype", ",".join(dtypes), f"the run measured no {missing[0]} layer (it measured "
                             f"{', '.join(sorted(measured)) or 'none'}); "
                             "list only measured dtypes or measure again with this --dtype")
    world = int(prov.get("world_size", 1))
    per_node = int(prov.get("ranks_per_node", world))
    # the copies are timed in fp32 (a plan's first collective dtype), the reducing collectives again
    # in each 16-bit dtype (see [Note: 16-bit reductions on the host] in zsim/hardware/collectives.py)
    coll_dtypes = {r.get("dtype") for r in usable(records, "collective")}
    coll = fit_collectives(records, "fp32" if "fp32" in coll_dtypes or dtype not in coll_dtypes else dtype)
    if not coll:   # the profile dtype was not measured for collectives: fall back to fp32
        coll = fit_collectives(records, "fp32")
    for d in REDUCED_16BIT:
        if d in coll_dtypes and "fp32" in coll_dtypes:
            fit_reductions_16bit(records, coll, d)
    fields, by_dtype, comp = fit_compute(records, tuple(dtypes), concurrent=prov.get("backend") == "nccl",
                                         datasheet_tflops=datasheet_of(prov.get("gpu", "")),
                                         d_half_prior=(interconnect[1].get("gpu") or {}).get("gemm_half_efficiency_dim")
                                         if interconnect else None)
    peak = comp["gemm"]["peak_tflops"]
    v = peak.get(dtype, max(peak.values()))
    adam_rate, adam_impl = fit_adam(records)
    io = fit_io(records)
    interf = fit_interference(records)
    views, views_prov = fit_rank_views(records)
    cuda = prov.get("backend") == "nccl"
    host_GiB = float(prov.get("host_memory_GiB", 16))
    intra = coll.get("intra_node") or coll.get("world")
    inter = coll.get("inter_node")
    if not intra and interconnect is None:
        raise ZsimInputError("--base", "none", "this run measured no collective (one rank has no peer): pass "
                             "--base PROFILE (e.g. dgx-h100) for its interconnect, or launch 2+ ranks")

    def tier_map(t, fabric):
        if not t:
            return None
        eff_default = t["efficiency_by_collective"].get("all_reduce") or next(iter(t["efficiency_by_collective"].values()))
        return {"fabric": fabric, "busbw_GBps": t["busbw_GBps"], "latency_us": t["latency_us"],
                "efficiency_by_size": eff_default, "efficiency_by_collective": t["efficiency_by_collective"]}

    backend = prov.get("backend", "gloo")
    intra_m = tier_map(intra, f"{backend}-intra-node" if cuda else "gloo-loopback (shared memory / TCP)")
    if not intra:   # a one-rank run: the interconnect is the base profile's, as measured there
        intra_m, inter_m = interconnect[1]["intra_node"], interconnect[1]["inter_node"]
    elif inter:
        inter_m = {"fabric": f"{backend}-inter-node", "nics_per_node": 1,
                   # one rank per node drives the node's NIC(s): its busbw is the node's bandwidth
                   "nic_bw_Gbps": inter["busbw_GBps"] * 8, "latency_us": inter["latency_us"],
                   "efficiency_by_size": inter["efficiency_by_collective"].get("all_reduce")
                   or next(iter(inter["efficiency_by_collective"].values())),
                   "efficiency_by_collective": inter["efficiency_by_collective"]}
    else:   # single node: nothing to measure; mirror the intra tier so multi-node what-ifs stay finite
        inter_m = {"fabric": "not measured (single-node calibration; copy of intra_node)", "nics_per_node": 1,
                   "nic_bw_Gbps": intra["busbw_GBps"] * 8 * per_node, "latency_us": intra["latency_us"],
                   "efficiency_by_size": intra_m["efficiency_by_size"],
                   "efficiency_by_collective": intra["efficiency_by_collective"]}
    pcie = [r for r in records if r.get("kind") == "pcie" and r.get("pinned") and "error" not in r]
    memcpy = usable(records, "memcpy")
    # the host's bandwidth: the best streaming rate a rank reached on it, its largest copy (a GPU
    # run's 1 GiB one; a CPU rank's device copy) or DeepSpeedCPUAdam out of cache at its 28 bytes
    # per parameter (see [Note: CPU step traffic]; on an H200's host the kernel streamed 108 GB/s
    # where torch's copy reached 65), times the ranks that ran it at once
    host_copy = max((r for r in memcpy if r.get("where") == "host"), key=lambda r: r.get("size_bytes", 0), default=None)
    big_adam = next((r for r in usable(records, "adam") if r.get("regime") == "out of cache"), None)
    host_rates = {"memcpy": fit_rate(host_copy, "GBps") if host_copy else None,
                  "cpu_adam": fit_rate(big_adam, "params_per_s") * CPU_ADAM_BYTES_PER_PARAM / 1e9 if big_adam else None}
    host_GBps = max((v for v in host_rates.values() if v), default=None)
    pageable = [r for r in records if r.get("kind") == "pcie" and r.get("pinned") is False and "error" not in r]
    pageable_fraction = None   # not measured: the profile's default (zsim/specs/hardware.py)
    if pcie:
        pcie_GBps = min(fit_rate(r, "GBps") for r in pcie)
        if pageable:
            pageable_fraction = min(1.0, min(fit_rate(r, "GBps") for r in pageable) / pcie_GBps)
    else:   # no device: an "offload copy" is a host memcpy of one direction
        pcie_GBps = fit_rate(memcpy[0], "GBps") / 2 if memcpy else 1.0
    sheet = datasheet_of(prov.get("gpu", ""))

    def unmeasured(d: str, fallback: float) -> float:
        # a known GPU keeps the datasheet's ratio to the measured dtype (fp32 runs at 1/15 of bf16
        # on an H100, not at its rate); otherwise the fallback (a CPU rank measures its dtypes)
        return v * sheet[d] / sheet[dtype] if sheet and dtype in sheet else fallback
    gpu = {"model": prov.get("gpu", "unknown"),
           "peak_tflops_fp32": peak.get("fp32", unmeasured("fp32", v)),
           "peak_tflops_tf32": peak.get("tf32", unmeasured("tf32", peak.get("fp32", v))),
           "peak_tflops_fp16": peak.get("fp16", unmeasured("fp16", v)),
           "peak_tflops_bf16": peak.get("bf16", unmeasured("bf16", v)),
           "hbm_capacity_GiB": float(prov.get("gpu_memory_GiB", host_GiB / max(per_node, 1))),
           "hbm_bw_GBps": comp["hbm_bw_GBps"],
           "cuda_context_GiB": 0.75 if cuda else 0.3,
           "allocator_fragmentation_fraction": 0.02,
           # torch's and DeepSpeed's CPU backends run collectives and copies in program order
           "concurrent_streams": bool(cuda), **fields}
    if sheet:
        gpu["datasheet_tflops"] = dict(sheet)
    if by_dtype:
        gpu["by_dtype"] = by_dtype
    profile = {
        "name": name,
        "description": f"calibrated by zsim calibrate ({prov.get('mode', '?')} mode) on {prov.get('hosts', '?')}: "
                       f"{world} ranks, {backend}",
        "gpus_per_node": per_node,
        "gpu": gpu,
        "intra_node": intra_m,
        "inter_node": inter_m,
        "pcie": {"generation": 4, "bw_GBps_per_gpu": pcie_GBps, "gpus_per_switch": 1,
                 "latency_us": 10.0 if cuda else fields["kernel_overhead_us"],
                 **({"pageable_fraction": pageable_fraction} if pageable_fraction is not None else {})},
        "nvme": {"drives_per_node": 1,
                 "read_GBps_per_drive": io["read_GBps"] or 1.0, "write_GBps_per_drive": io["write_GBps"] or 1.0},
        "cpu": {"model": prov.get("cpu", "unknown"), "cores_per_node": int(prov.get("cpu_cores", 1)),
                "memory_GiB": host_GiB, "memory_bw_GBps": host_GBps * per_node if host_GBps else 10.0,
                "adam_params_per_s_per_core": adam_rate, **fit_zero3_hooks(records), **views},
        "interference": {"compute_slowdown_during_comm": min(1.0, interf["compute_slowdown_during_comm"])},
        # sorted: a fresh run and a refit of its records.json (written with sorted keys) give
        # byte-identical profiles
        "provenance": {**{k: str(v) for k, v in sorted(prov.items())}, "adam_implementation": adam_impl,
                       "file_io_o_direct": str(io["o_direct"]),
                       "comm_slowdown_during_compute": f"{interf['comm_slowdown_during_compute']:.3f}",
                       "compute_dtype": dtype, **views_prov},
    }
    if not intra:
        profile["provenance"]["interconnect"] = (f"{interconnect[0]}'s intra_node, inter_node, nccl and interference (a one-rank "
                                                 "run measures no collective)")
        profile["gpus_per_node"] = int(interconnect[1].get("gpus_per_node", per_node))
        if "nccl" in interconnect[1]:
            profile["nccl"] = interconnect[1]["nccl"]
        if "interference" in interconnect[1]:   # measured against a collective, which had no peer here
            profile["interference"] = interconnect[1]["interference"]
    if by_dtype:   # which dtypes have their own figures, and on which layers each closure was fitted
        layers = {d: sorted({r["layer"] for r in usable(records, "layer") if r["dtype"] == d}) for d in dtypes}
        profile["provenance"]["compute_dtypes"] = ",".join(dtypes)
        profile["provenance"]["layer_closure"] = "; ".join(f"{d}: {', '.join(ls)}" for d, ls in layers.items())
    hooks = usable(records, "zero3_hooks")
    if hooks:
        profile["provenance"]["zero3_hooks_deepspeed"] = hooks[0]["deepspeed"]
    report = {"collectives": coll, "compute": comp, "adam": {"params_per_s_per_core": adam_rate, "impl": adam_impl},
              "io": io, "interference": interf}
    report["host_streaming_GBps"] = host_rates
    return _round(profile), report


def _round(x):
    """Round floats to 6 significant digits so the YAML stays readable and diffs stay small."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x
