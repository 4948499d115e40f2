"""Trace -> Result: throughput, FLOP rates, memory verdict and communication figures."""
from __future__ import annotations

from dataclasses import dataclass

from zsim.specs.scenario import Scenario
from zsim.engine.ledger import peak_and_breakdown
from zsim.engine.sim import Trace, collector_paused
from zsim.hardware.collectives import (bus_factor, collective_cost, link_busbw_Bps, nccl_topo_for, send_busbw_Bps,
                                      tiers_for)
from zsim.hardware.host import rank_views_time_s
from zsim.hardware.placement import group_shape, rank_map, rank_of, same_node
from zsim.result import ZERO3_RANK_LOOPS, Comm, HostMemory, Memory, MoE, Pipeline, Result, TensorParallel
from zsim.schedule.ir import Stream
from zsim.schedule.payloads import Copy, CpuAdam, PipeTransfer, SequenceExchange, TensorComm
from zsim.units import TFLOP
from zsim.workload.lora import trainable_params
from zsim.workload.module import Workload
from zsim.workload.preference import is_reference, reference_params, sequences_per_example
from zsim.workload.transformer import count_active_params, count_params

RESERVED = "CUDA context + allocator reserve"
P2P = "send_recv"       # the comm key of a pipeline's point-to-point transfers


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


@dataclass(frozen=True)
class _OpTotals:
    """What summarize needs from the ops of one step, gathered in one pass: intervals per
    pipeline stage, the other figures summed over the stages' ranks."""
    compute_iv: list[list[tuple[float, float]]]
    comm_iv: list[list[tuple[float, float]]]
    hw_flops: float
    comm_bytes: dict[str, float]
    comm_count: dict[str, int]
    comm_time_s: dict[str, float]
    comm_calls: dict[tuple, int]        # (kind, collective, size_bytes, coalesced, (nodes, ranks per node)) -> calls
    host_time_s: dict[str, float]
    comm_peak_s: dict[str, float]       # per kind: the time its bytes take at the peak of the tier each call crosses


def _group_placement(comm, op, sched, gpus_per_node: int) -> tuple[int, int, int]:
    """(ranks, nodes, ranks per node) of the process group a collective runs over: the op's
    stage's data-parallel group unless the call names its own (CostModel's rule)."""
    dp = sched.data_parallel
    size = dp if comm.group is None else comm.group.size
    return (size, *group_shape(comm.group, op.pipe_stage, dp, gpus_per_node, sched.tensor))


def _comm_facts(op, sched, cl) -> tuple[str, float, tuple | None, float]:
    """(comm kind, bytes sent, the call's key for _algorithms or None for a send, the peak bus
    bandwidth of the tier it crosses) of an op that communicates."""
    p, comm = op.payload, op.comm
    if isinstance(p, PipeTransfer):
        src, dst = (rank_of(s, sched.data_parallel, tensor=sched.tensor) for s in (p.src_stage, p.dst_stage))
        return P2P, p.size_bytes, None, send_busbw_Bps(cl, same_node(src, dst, cl.gpus_per_node))
    assert comm is not None
    collective = comm.collective.value
    ranks, nodes, per_node = _group_placement(comm, op, sched, cl.gpus_per_node)
    # the tensor-parallel and Ulysses activations' collectives are shown apart from ZeRO's
    kind = f"tp {collective}" if isinstance(p, TensorComm) else \
        f"sp {collective}" if isinstance(p, SequenceExchange) else collective
    return (kind, comm.size_bytes * bus_factor(collective, ranks),
            (kind, collective, comm.size_bytes, comm.coalesced, (nodes, per_node)), link_busbw_Bps(cl, nodes))


def _op_totals(trace: Trace, cl) -> _OpTotals:
    """The only reader of the schedule's op fields here (transfer, cpu_adam_params, collective,
    size_bytes, stream, model_flops): one pass over the ops and their timings. An op of a
    repeated micro-step counts once per micro-step it stands for. Sums accumulate in op order."""
    repeat = trace.repeat
    weight = None if repeat is None else repeat.weight
    sched = trace.schedule
    compute_iv: list[list] = [[] for _ in range(sched.stages)]
    comm_iv: list[list] = [[] for _ in range(sched.stages)]
    hw_flops = 0.0
    comm_bytes: dict[str, float] = {}
    comm_count: dict[str, int] = {}
    comm_time: dict[str, float] = {}
    comm_calls: dict[tuple, int] = {}
    host_time: dict[str, float] = {}
    peak_s: dict[str, float] = {}
    # a call's figures depend on its collective, size, group and stage only (a send's on its
    # stages and size): worked out once each
    facts: dict[tuple, tuple] = {}
    by_payload: dict[tuple, tuple] = {}     # (payload id, stage) -> its facts (the schedule holds every payload)
    compute = Stream.COMPUTE
    view_us = cl.profile.cpu.zero3_rank_view_us
    for op, t in zip(sched.ops, trace.timings):
        p = op.payload
        cls = type(p)
        n = 1 if weight is None else weight(op)
        if type(p) is Copy or type(p) is CpuAdam:
            key = p.transfer.value if type(p) is Copy else "cpu_adam"
            host_time[key] = host_time.get(key, 0.0) + n * (t.end_s - t.start_s)
        if op.host_views and view_us:
            host_time[ZERO3_RANK_LOOPS] = (host_time.get(ZERO3_RANK_LOOPS, 0.0)
                                           + n * rank_views_time_s(op.host_views, view_us))
        comm = getattr(p, "comm", None)
        if comm is not None or type(p) is PipeTransfer:
            if type(p) is PipeTransfer and op.pipe_stage != p.src_stage:
                continue            # the recv's side of a send counted once, at the send
            f = by_payload.get((id(p), op.pipe_stage))    # a payload is often one object for the step
            if f is None:
                fkey: tuple
                if type(p) is PipeTransfer:
                    fkey = (cls, p.src_stage, p.dst_stage, p.size_bytes)
                else:
                    assert comm is not None
                    fkey = (cls, comm.collective, comm.size_bytes, comm.coalesced, comm.group, op.pipe_stage)
                f = facts.get(fkey)
                if f is None:
                    f = facts[fkey] = _comm_facts(op, sched, cl)
                by_payload[(id(p), op.pipe_stage)] = f
            kind, sent, call, peak = f
            if call is not None:
                comm_calls[call] = comm_calls.get(call, 0) + n
            start, end = t.start_s, t.end_s
            peak_s[kind] = peak_s.get(kind, 0.0) + n * sent / peak
            comm_iv[op.pipe_stage].append((start, end))
            comm_bytes[kind] = comm_bytes.get(kind, 0.0) + n * sent
            comm_count[kind] = comm_count.get(kind, 0) + n
            comm_time[kind] = comm_time.get(kind, 0.0) + n * (end - start)
        elif op.stream == compute and cls is not Copy:
            # a copy issued on the compute stream (ZeRO-Offload without overlap_comm) holds
            # the stream but is host traffic, counted above
            compute_iv[op.pipe_stage].append((t.start_s, t.end_s))
            work = getattr(p, "work")    # op.work, without the property call: every compute op has one
            hw_flops += n * work.model_flops
    return _OpTotals(compute_iv, comm_iv, hw_flops, comm_bytes, comm_count, comm_time, comm_calls, host_time, peak_s)


def _tier_busbw(ops: _OpTotals) -> dict[str, float]:
    """Per collective kind, the peak bus bandwidth of the tiers its calls cross: its bytes over
    the time they take at each call's tier peak (NVLink for a group inside a node, e.g. tensor
    parallel, the NICs for one across nodes)."""
    return {k: b / ops.comm_peak_s[k] for k, b in ops.comm_bytes.items() if ops.comm_peak_s.get(k, 0.0) > 0}


def _algorithms(cl, calls: dict[tuple, int], stages: int) -> dict[str, dict[str, int]]:
    """Per collective kind, the calls each algorithm/protocol served on one rank (the cost
    model's own choice over the ranks each call's process group spans; a pipeline's calls
    averaged over its stages' ranks, as Comm.calls are)."""
    intra, inter = tiers_for(cl)
    nccl = nccl_topo_for(cl)
    out: dict[str, dict[str, int]] = {}
    for (kind, collective, size, coalesced, (nodes, per_node)), n in sorted(calls.items()):
        c = collective_cost(collective, size, nodes, per_node, intra, inter, coalesced, nccl)
        label = f"{c.algorithm}/{c.protocol}" if c.protocol else c.algorithm
        per = out.setdefault(kind, {})
        per[label] = per.get(label, 0) + n
    return {k: {label: round(n / stages) for label, n in sorted(v.items())} for k, v in sorted(out.items())}


def _windows(trace: Trace) -> tuple[tuple[float, float, int], ...]:
    """(start_s, end_s, copies): the simulated time split so that each window stands for
    `copies` windows of the full step (a measure over the step is their weighted sum)."""
    r = trace.repeat
    if r is None:
        return ((float("-inf"), float("inf"), 1),)
    return r.segments()


def _clipped(ops: _OpTotals, trace: Trace) -> list[list[tuple[list, list, int]]]:
    """Per stage, per window of `_windows`: (compute intervals, comm intervals, copies), clipped to the window."""
    return [[(_clip(c, lo, hi), _clip(m, lo, hi), n) for lo, hi, n in _windows(trace)]
            for c, m in zip(ops.compute_iv, ops.comm_iv)]


def _clip(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    if lo == float("-inf") and hi == float("inf"):
        return intervals
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def _host_memory(sc: Scenario, trace: Trace) -> HostMemory:
    cl = sc.cluster
    breakdown: dict[str, float] = {}
    sched = trace.schedule
    # a pipeline: a node full of the stage with the most host memory
    host_static = sched.host_static if sched.pipeline is None else max(
        sched.pipeline.host_static, key=lambda allocs: sum(a.size_bytes for a in allocs))
    for a in host_static:
        breakdown[a.category] = breakdown.get(a.category, 0.0) + a.size_bytes * cl.gpus_per_node
    need = sum(breakdown.values())
    load = trace.schedule.host.host_load_bytes_per_gpu * cl.gpus_per_node
    return HostMemory(bytes_per_node=need, load_bytes_per_node=load, capacity_bytes=cl.host_memory_bytes,
                      fits=max(need, load) <= cl.host_memory_bytes, breakdown=dict(sorted(breakdown.items())))


def memory_at_peak(sc: Scenario, trace: Trace) -> Memory:
    """GPU memory at the trace's peak (on the full step's clock) and the host's, per GPU and per node."""
    cl = sc.cluster
    # on the full step's clock, the copies not simulated included
    peak_alloc, peak_t, breakdown = (peak_and_breakdown(trace.ledger_events) if trace.repeat is None
                                     else trace.repeat.peak_and_breakdown(trace.ledger_events))
    reserved = cl.reserved_bytes
    peak = peak_alloc + reserved
    breakdown = dict(breakdown)
    breakdown[RESERVED] = reserved
    capacity = cl.hbm_capacity_bytes
    return Memory(peak_bytes=peak, capacity_bytes=capacity, fits=peak <= capacity, headroom_bytes=capacity - peak,
                  peak_time_s=peak_t, breakdown=breakdown, host=_host_memory(sc, trace))


def _pipeline(sc: Scenario, trace: Trace, clipped) -> Pipeline | None:
    layout = trace.schedule.pipeline
    if layout is None:
        return None
    step = trace.step_time_s
    busy = [sum(n * _union_length(c + m) for c, m, n in stage) for stage in clipped]
    reserved = sc.cluster.reserved_bytes
    return Pipeline(stages=layout.stages, data_parallel=layout.data_parallel,
                    partition_method=sc.parallelism.partition_method,
                    layers=[list(r) for r in layout.layers],
                    peak_bytes=[peak + reserved for peak in trace.stage_peaks_bytes],
                    worst_stage=trace.worst_stage,
                    bubble_fraction=1.0 - sum(busy) / (len(busy) * step) if step > 0 else 0.0,
                    schedule=None if layout.virtual_stages == 1 else sc.parallelism.pipeline_schedule,
                    virtual_stages=None if layout.virtual_stages == 1 else layout.virtual_stages)


def summarize(sc: Scenario, wl: Workload, trace: Trace) -> Result:
    with collector_paused():
        return _summarize(sc, wl, trace)


def model_flops_per_gpu(micro_step_flops: float, micro_steps: int, stages: int) -> float:
    """MFU's FLOPs per GPU per step from the rank's workload's per micro-step: a pipeline's stages
    split the model (and its FLOPs); figures of the stages' ranks are averaged over them."""
    return micro_step_flops * micro_steps / stages


def _summarize(sc: Scenario, wl: Workload, trace: Trace) -> Result:
    cl = sc.cluster
    world = cl.world_size
    step = trace.step_time_s
    samples = sc.global_batch_size
    # every sequence a forward takes counts: a preference example's chosen and rejected both
    tokens = samples * sc.seq_len * sequences_per_example(sc.training)
    reference = reference_params(wl)
    n_params = wl.n_params - reference
    stages = trace.schedule.stages
    model_flops_gpu = model_flops_per_gpu(wl.model_flops, sc.gradient_accumulation_steps, stages)
    ops = _op_totals(trace, cl)
    clipped = _clipped(ops, trace)
    peak_flops = cl.datasheet_flops(sc.matmul_dtype)   # MFU's convention: the vendor's dense peak
    tflops = model_flops_gpu / step / TFLOP if step > 0 else 0.0
    trained = trainable_params(wl)
    compute_s = sum(sum(n * _union_length(c) for c, _, n in stage) for stage in clipped)
    exposed_s = sum(sum(n * _exposed(m, c) for c, m, n in stage) for stage in clipped)
    return Result(
        scenario=sc.name,
        stage=sc.zero.stage,
        world_size=world,
        nodes=cl.nodes,
        gpus_per_node=cl.gpus_per_node,
        hardware_profile=cl.profile.name,
        precision=sc.precision,
        n_params=n_params,
        micro_batch_size=sc.micro_batch_size,
        gradient_accumulation_steps=sc.gradient_accumulation_steps,
        global_batch_size=samples,
        seq_len=sc.seq_len,
        step_time_s=step,
        samples_per_s=samples / step,
        tokens_per_s=tokens / step,
        tokens_per_s_per_gpu=tokens / step / world,
        tflops_per_gpu=tflops,
        mfu=model_flops_gpu / step / peak_flops,
        hfu=ops.hw_flops / stages / step / peak_flops,
        compute_time_s=compute_s / stages,
        model_flops_per_gpu=model_flops_gpu,
        memory=memory_at_peak(sc, trace),
        comm=Comm(bytes_per_gpu={k: v / stages for k, v in ops.comm_bytes.items()},
                  calls={k: round(v / stages) for k, v in ops.comm_count.items()},
                  time_s={k: v / stages for k, v in ops.comm_time_s.items()},
                  exposed_time_s=exposed_s / stages,
                  algorithms=_algorithms(cl, ops.comm_calls, stages),
                  achieved_busbw_Bps={k: b / ops.comm_time_s[k] for k, b in ops.comm_bytes.items()
                                      if ops.comm_time_s.get(k, 0.0) > 0},
                  link_busbw_Bps=link_busbw_Bps(cl), tier_busbw_Bps=_tier_busbw(ops)),
        host_time_s=dict(sorted(ops.host_time_s.items())),
        events=trace.events_processed,
        warnings=tuple(sc.warnings),
        implementation=sc.implementation,
        trainable_params=None if trained == n_params else trained,
        reference_params=reference or None,
        moe=_moe(sc, wl),
        pipeline=_pipeline(sc, trace, clipped),
        tensor_parallel=_tensor_parallel(sc),
    )


def _tensor_parallel(sc: Scenario) -> TensorParallel | None:
    par = sc.parallelism
    if par.tensor == 1:
        return None
    dp = sc.data_parallel_size
    return TensorParallel(tensor=par.tensor, sequence_parallel=par.sequence_parallel, data_parallel=dp,
                          pipeline=par.pipeline,
                          rank_map=rank_map(par.pipeline, dp, par.tensor, sc.cluster.gpus_per_node),
                          model_params=count_params(sc.model, sc.seq_len))


def _moe(sc: Scenario, wl: Workload) -> MoE | None:
    moe = sc.model.moe
    if moe is None:
        return None
    return MoE(experts=moe.experts, top_k=moe.top_k, expert_parallel_size=sc.expert_parallel_size,
               total_params=count_params(sc.model, sc.seq_len), active_params=count_active_params(sc.model, sc.seq_len),
               rank_expert_params=sum(p.numel for p in wl.params if p.expert and not is_reference(p)))
