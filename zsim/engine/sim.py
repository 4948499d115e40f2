"""The simpy engine: runs a Schedule on one representative data-parallel rank.

Data-parallel ranks are symmetric, so one rank is simulated and its collectives are
costed for the whole group; 1024 GPUs cost what 8 do. Streams are FIFO processes. Time
that competes for a resource is "work" served by a fluid (processor-sharing) model. A job
crosses one or more links (NVLink tier, IB rails, the GPU's PCIe link per direction, the
PCIe switch uplink per direction, NVMe); while jobs overlap, each progresses at the
smallest share it gets on any link it crosses (1/jobs on that link), and the compute stream
slows by the profile's interference factor while an NCCL transfer is active.
Fixed latencies (alpha, launch overheads) are not shared. Memory effects of every op go to
the ledger in simulated time.
"""
from __future__ import annotations

from dataclasses import dataclass

import simpy

from zsim.hardware.collectives import collective_cost, tiers_for
from zsim.hardware.compute import (attention_time_s, fresh_alloc_time_s, gemm_time_s, kernel_overhead_s,
                                   memory_bound_time_s, optimizer_time_s)
from zsim.hardware.host import cpu_adam_time_s, host_link_Bps, nvme_time_s, pcie_time_s
from zsim.engine.ledger import Ledger
from zsim.schedule.ops import STREAMS, Op, Schedule
from zsim.workload.transformer import DTYPE_BYTES

_EPS_S = 1e-15
COMPUTE = ("compute",)
# links each transfer direction crosses (see module doc)
H2D_LINKS = ("gpu_link_down", "uplink_down")
D2H_LINKS = ("gpu_link_up", "uplink_up")
NVME_READ_LINKS = ("nvme", "uplink_up")      # drive -> host memory
NVME_WRITE_LINKS = ("nvme", "uplink_down")


@dataclass(frozen=True)
class OpTiming:
    op_id: int
    start_s: float
    end_s: float
    exposed_s: float = 0.0


@dataclass(frozen=True)
class Trace:
    schedule: Schedule
    timings: tuple[OpTiming, ...]
    ledger_events: tuple[tuple[float, float, str, str], ...]   # (time_s, delta_bytes, category, tag)
    step_time_s: float
    events_processed: int


class _Fluid:
    """Processor sharing over all resource-bound work in flight. Driven by timer callbacks
    rather than a process: each change of the job set reschedules one timer for the next
    completion, and timers made stale by a later change are ignored (cheaper than waiting on
    a condition of two events)."""

    def __init__(self, env: simpy.Environment, compute_slowdown: float):
        self.env = env
        self.slowdown = compute_slowdown
        self.jobs: dict[int, list] = {}       # id -> [remaining_work_s, rate, event, links]
        self.next_id = 0
        self.last_s = 0.0
        self.version = 0

    def submit(self, links: tuple[str, ...], work_s: float) -> simpy.Event:
        ev = self.env.event()
        if work_s <= 0:
            ev.succeed()
            return ev
        self._advance()
        self.jobs[self.next_id] = [work_s, 1.0, ev, links]
        self.next_id += 1
        self._rerate()
        self._reschedule()
        return ev

    def _advance(self):
        dt = self.env.now - self.last_s
        if dt > 0:
            for job in self.jobs.values():
                job[0] -= dt * job[1]
        self.last_s = self.env.now

    def _rerate(self):
        count: dict[str, int] = {}
        for job in self.jobs.values():
            for link in job[3]:
                count[link] = count.get(link, 0) + 1
        # NCCL kernels occupy SMs; copy engines (PCIe), NVMe and the host do not slow the GPU
        comm_active = bool(count.get("intra_node") or count.get("inter_node"))
        for job in self.jobs.values():
            if job[3] == COMPUTE:
                job[1] = 1.0 / (1.0 + self.slowdown) if comm_active else 1.0
            else:
                job[1] = 1.0 / max(count[link] for link in job[3])

    def _reschedule(self):
        self.version += 1
        if not self.jobs:
            return
        dt = min(j[0] / j[1] for j in self.jobs.values())
        version = self.version
        timer = self.env.timeout(max(dt, 0.0))
        timer.callbacks.append(lambda _ev: self._fire(version))

    def _fire(self, version: int):
        if version != self.version:
            return
        self._advance()
        limit = _EPS_S * max(1.0, self.env.now)
        done = [k for k, j in self.jobs.items() if j[0] <= limit]
        for k in done:
            self.jobs.pop(k)[2].succeed()
        self._rerate()
        self._reschedule()


def compute_work_s(op: Op, cluster, precision: str) -> float:
    gpu = cluster.profile.gpu
    peak = cluster.peak_flops(precision)
    dtype_bytes = DTYPE_BYTES[precision]
    t = sum(gemm_time_s(m, n, k, dtype_bytes, gpu, peak) for m, n, k in op.gemms)
    if op.attention_flops:
        t += attention_time_s(op.attention_flops, op.attention_backward, gpu, peak)
    if op.mem_bytes:
        t += memory_bound_time_s(op.mem_bytes, gpu)
    if op.optimizer_bytes:
        t += optimizer_time_s(op.optimizer_bytes, gpu)
    return t


def simulate(schedule: Schedule, cluster, precision: str) -> Trace:
    env = simpy.Environment()
    fluid = _Fluid(env, cluster.profile.interference.compute_slowdown_during_comm)
    intra, inter = tiers_for(cluster)
    gpu = cluster.profile.gpu
    ledger = Ledger()
    for a in schedule.static:
        ledger.alloc(0.0, a)
    done = [env.event() for _ in schedule.ops]
    timings: list[OpTiming | None] = [None] * len(schedule.ops)
    by_stream: dict[str, list[Op]] = {s: [] for s in STREAMS}
    # a device without concurrent streams (a CPU rank) runs every op in program order
    serial = not cluster.profile.gpu.concurrent_streams
    for op in schedule.ops:
        by_stream["compute" if serial else op.stream].append(op)

    meta = schedule.meta
    prof = cluster.profile

    uplink_Bps = prof.pcie.switch_uplink_GBps * 1e9 if prof.pcie.switch_uplink_GBps else None
    # only the job's GPUs copy: a 1-GPU job has its switch's uplink to itself
    sharers = min(prof.pcie.gpus_per_switch, cluster.gpus_per_node)
    host_Bps = host_link_Bps(cluster.pcie_bw_Bps, uplink_Bps, sharers)
    nic_links = ("inter_node", "gpu_link_up", "gpu_link_down") if prof.pcie.nics_share_gpu_link else ("inter_node",)

    def links(path: tuple[str, ...]) -> tuple[str, ...]:
        # without a shared switch uplink, host traffic has no uplink to contend for
        return path if uplink_Bps is not None else tuple(x for x in path if not x.startswith("uplink"))

    def host_work(op: Op) -> tuple[float, float, tuple[str, ...]]:
        """(fixed_s, shared work_s, links) of a copy, NVMe or CPU op."""
        if op.transfer in ("h2d", "d2h"):
            pinned = meta.get("pin_memory", True) if op.pinned is None else op.pinned
            lat, xfer = pcie_time_s(op.size_bytes, host_Bps, prof.pcie.latency_us * 1e-6, pinned)
            return lat, xfer, links(H2D_LINKS if op.transfer == "h2d" else D2H_LINKS)
        if op.transfer in ("nvme_read", "nvme_write"):
            read = op.transfer == "nvme_read"
            per_drive = prof.nvme.read_GBps_per_drive if read else prof.nvme.write_GBps_per_drive
            node_bw = max(prof.nvme.drives_per_node, 1) * per_drive * 1e9
            if uplink_Bps is not None:   # drives sit under the switches: their traffic crosses the uplinks too
                node_bw = min(node_bw, uplink_Bps * cluster.gpus_per_node / sharers)
            t = nvme_time_s(op.size_bytes, node_bw, cluster.gpus_per_node, meta.get("aio_efficiency", 1.0))
            return 0.0, t, links(NVME_READ_LINKS if read else NVME_WRITE_LINKS)
        if op.cpu_adam_params:
            t = cpu_adam_time_s(op.cpu_adam_params, prof.cpu.adam_params_per_s_per_core, prof.cpu.cores_per_node,
                                cluster.gpus_per_node, meta.get("cpu_cores_fraction", 1.0))
            return t, 0.0, ("cpu",)
        return 0.0, 0.0, ("cpu",)

    def run_stream(ops: list[Op]):
        for op in ops:
            for d in op.deps:
                if not done[d].processed:
                    yield done[d]
            start = env.now
            for a in op.alloc:
                ledger.alloc(start, a)
            fixed = op.fixed_time_s + kernel_overhead_s(op.kernels, gpu)
            if op.hook_visits:
                fixed += op.hook_visits * 1e-6 * (prof.cpu.zero3_hook_bwd_us if op.phase == "backward"
                                                  else prof.cpu.zero3_hook_fwd_us)
            if op.grad_hooks:
                fixed += op.grad_hooks * 1e-6 * prof.cpu.grad_hook_us(schedule.stage)
            if op.alloc and gpu.fresh_alloc_GBps:
                # a gather's params are views of one flat output buffer; other ops' allocations are tensors
                fixed += fresh_alloc_time_s([op.size_bytes] if op.collective == "all_gather"
                                            else [a.size_bytes for a in op.alloc], gpu)
            if op.collective:
                # the collective's own buffer passes (packing, pre-division) run on its stream first
                fixed += memory_bound_time_s(op.mem_bytes, gpu)
                cost = collective_cost(op.collective, op.size_bytes, cluster.nodes, cluster.gpus_per_node, intra, inter,
                                       op.coalesced)
                fixed += cost.latency_s
                if fixed > 0:
                    yield env.timeout(fixed)
                yield fluid.submit(nic_links if cost.tier == "inter_node" else (cost.tier,), cost.transfer_s)
            elif op.transfer or op.cpu_adam_params:
                lat, work, path = host_work(op)
                if fixed + lat > 0:
                    yield env.timeout(fixed + lat)
                yield fluid.submit(path, work)
            else:
                if fixed > 0:
                    yield env.timeout(fixed)
                work = compute_work_s(op, cluster, precision)
                if work > 0:
                    yield fluid.submit(COMPUTE, work)
            for tag in op.free:
                ledger.free(env.now, tag)
            timings[op.id] = OpTiming(op.id, start, env.now)
            done[op.id].succeed()

    for stream in STREAMS:
        if by_stream[stream]:
            env.process(run_stream(by_stream[stream]))
    env.run()
    missing = [op.name for op, t in zip(schedule.ops, timings) if t is None]
    if missing:
        raise RuntimeError(f"schedule deadlock: {len(missing)} ops never ran, first {missing[0]!r}")
    step = max((t.end_s for t in timings), default=0.0)
    return Trace(schedule, tuple(timings), ledger.events(), step, len(schedule.ops))
