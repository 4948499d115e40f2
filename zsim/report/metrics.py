"""Trace -> Result: throughput, FLOP rates, memory verdict and communication figures."""
from __future__ import annotations

from zsim.specs.scenario import Scenario
from zsim.engine.ledger import peak_and_breakdown
from zsim.engine.sim import Trace
from zsim.hardware.collectives import bus_factor
from zsim.workload.transformer import Workload

RESERVED = "CUDA context + allocator reserve"


def _union_length(intervals) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _exposed(comm, compute) -> float:
    """Length of the union of comm intervals not covered by any compute interval."""
    compute = sorted(compute)
    merged: list[list[float]] = []
    for s, e in compute:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    comm_union: list[list[float]] = []
    for s, e in sorted(comm):
        if comm_union and s <= comm_union[-1][1]:
            comm_union[-1][1] = max(comm_union[-1][1], e)
        else:
            comm_union.append([s, e])
    exposed = 0.0
    j = 0
    for s, e in comm_union:
        covered = 0.0
        while j < len(merged) and merged[j][1] <= s:
            j += 1
        k = j
        while k < len(merged) and merged[k][0] < e:
            covered += min(e, merged[k][1]) - max(s, merged[k][0])
            k += 1
        exposed += (e - s) - covered
    return exposed


def summarize(sc: Scenario, wl: Workload, trace: Trace) -> dict:
    cl = sc.cluster
    world = cl.world_size
    step = trace.step_time_s
    ops = trace.schedule.ops
    samples = sc.global_batch_size
    tokens = samples * sc.seq_len
    model_flops_gpu = wl.model_flops * sc.gradient_accumulation_steps
    hw_flops_gpu = 0.0
    compute_iv, comm_iv = [], []
    comm_bytes: dict[str, float] = {}
    comm_count: dict[str, int] = {}
    comm_time: dict[str, float] = {}
    host_time: dict[str, float] = {}
    for op, t in zip(ops, trace.timings):
        if op.transfer or op.cpu_adam_params:
            key = op.transfer or "cpu_adam"
            host_time[key] = host_time.get(key, 0.0) + (t.end_s - t.start_s)
        if op.collective:
            comm_iv.append((t.start_s, t.end_s))
            sent = op.size_bytes * bus_factor(op.collective, world)
            comm_bytes[op.collective] = comm_bytes.get(op.collective, 0.0) + sent
            comm_count[op.collective] = comm_count.get(op.collective, 0) + 1
            comm_time[op.collective] = comm_time.get(op.collective, 0.0) + (t.end_s - t.start_s)
        elif op.stream == "compute":
            compute_iv.append((t.start_s, t.end_s))
            hw_flops_gpu += op.model_flops
    peak_alloc, peak_t, breakdown = peak_and_breakdown(trace.ledger_events)
    reserved = cl.reserved_bytes
    peak = peak_alloc + reserved
    breakdown = dict(breakdown)
    breakdown[RESERVED] = reserved
    capacity = cl.hbm_capacity_bytes
    host_breakdown: dict[str, float] = {}
    for a in trace.schedule.host_static:
        host_breakdown[a.category] = host_breakdown.get(a.category, 0.0) + a.size_bytes * cl.gpus_per_node
    host_need = sum(host_breakdown.values())
    host_load = trace.schedule.meta.get("host_load_bytes_per_gpu", 0.0) * cl.gpus_per_node
    peak_flops = cl.peak_flops(sc.precision)
    tflops = model_flops_gpu / step / 1e12 if step > 0 else 0.0
    return {
        "scenario": sc.name,
        "stage": sc.zero.stage,
        "world_size": world,
        "nodes": cl.nodes,
        "gpus_per_node": cl.gpus_per_node,
        "hardware_profile": cl.profile.name,
        "precision": sc.precision,
        "n_params": wl.n_params,
        "micro_batch_size": sc.micro_batch_size,
        "gradient_accumulation_steps": sc.gradient_accumulation_steps,
        "global_batch_size": samples,
        "seq_len": sc.seq_len,
        "step_time_s": step,
        "samples_per_s": samples / step,
        "tokens_per_s": tokens / step,
        "tokens_per_s_per_gpu": tokens / step / world,
        "tflops_per_gpu": tflops,
        "mfu": model_flops_gpu / step / peak_flops,
        "hfu": hw_flops_gpu / step / peak_flops,
        "compute_time_s": _union_length(compute_iv),
        "model_flops_per_gpu": model_flops_gpu,
        "memory": {
            "peak_bytes": peak,
            "capacity_bytes": capacity,
            "fits": peak <= capacity,
            "headroom_bytes": capacity - peak,
            "peak_time_s": peak_t,
            "breakdown": breakdown,
            "host": {
                "bytes_per_node": host_need,
                "load_bytes_per_node": host_load,
                "capacity_bytes": cl.host_memory_bytes,
                "fits": max(host_need, host_load) <= cl.host_memory_bytes,
                "breakdown": dict(sorted(host_breakdown.items())),
            },
        },
        "comm": {
            "bytes_per_gpu": comm_bytes,
            "calls": comm_count,
            "time_s": comm_time,
            "exposed_time_s": _exposed(comm_iv, compute_iv),
        },
        "host_time_s": dict(sorted(host_time.items())),
        "events": len(ops),
        "warnings": list(sc.warnings),
    }
