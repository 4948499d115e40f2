"""The cost model the engine calls: one op's fixed time, shared work and the links it crosses.

Fixed time (latencies, kernel launches, host-side hooks, first touch of fresh allocations) is
not shared; work is served by the engine's processor-sharing model over `links`: the GPU's
compute, the NVLink tier or the IB rails (a NIC may share the GPU's PCIe link), the GPU's PCIe
link per direction, its PCIe switch's uplink per direction, NVMe, and the CPU.
Every figure comes from the pure functions of compute.py, collectives.py and host.py.
"""
from __future__ import annotations

from zsim.record import record

from zsim.hardware.collectives import Tier, collective_cost, nccl_topo_for, ring_cost, tiers_for
from zsim.hardware.compute import (attention_time_s, copy_time_s, fresh_alloc_time_s, gemm_time_s, grad_accumulate_time_s,
                                   kernel_overhead_s, memory_bound_time_s, optimizer_time_s, step_passes_time_s)
from zsim.hardware.host import (CPU_ADAM_BYTES_PER_PARAM, aio_efficiency, cpu_adam_time_s, hook_visit_us,
                                hook_visits_time_s, host_link_Bps, host_pass_time_s, nvme_time_s, pcie_time_s, rank_views_time_s)
from zsim.hardware.placement import group_shape, rank_of, same_node, stage_links
from zsim.schedule.ir import Collective, HostSettings, Op, Phase, PipelineLayout, Transfer
from zsim.schedule.payloads import Comm, ComputeWork, Copy, CpuAdam, ModulePass, PipeTransfer, StepCompute, payload_shape
from zsim.workload.module import DTYPE_BYTES

COMPUTE = ("compute",)
# an NCCL transfer on these slows the compute stream; a point-to-point send crosses one direction
# of each tier (its "_out" side at the sender, its "_in" side at the receiver)
COMM_LINKS = ("intra_node", "inter_node", "intra_node_out", "intra_node_in", "inter_node_out", "inter_node_in")
CPU = ("cpu",)
_PATHS = {   # links each host transfer crosses
    Transfer.H2D: ("gpu_link_down", "uplink_down"),
    Transfer.D2H: ("gpu_link_up", "uplink_up"),
    Transfer.NVME_READ: ("nvme", "uplink_up"),     # drive -> host memory
    Transfer.NVME_WRITE: ("nvme", "uplink_down"),
}


def matmul_peak_flops(cluster, precision: str, tf32: bool = False) -> float:
    """The peak the GEMMs run at: fp32 matmuls with allow_tf32 run on tensor cores (schedule.tf32)."""
    return cluster.peak_flops("tf32" if tf32 and precision == "fp32" else precision)


def compute_work_s(work: ComputeWork, gpu, gpu_fp32, peak_flops: float, dtype_bytes: int,
                   fp8_peak_flops: float = 0.0) -> float:
    """The compute link's work of `work` (the engine serves it at rate <= 1: zsim/engine/fluid.py).
    `gpu`/`gpu_fp32`: the profile's figures for the run's dtype and for fp32 (gpu.for_dtype);
    `fp8_peak_flops`: the peak of its FP8 GEMMs (one byte an operand: see [Note: FP8 linears])."""
    t = sum(gemm_time_s(m, n, k, dtype_bytes, gpu, peak_flops) for m, n, k in work.gemms)
    if work.fp8_gemms:
        t += sum(gemm_time_s(m, n, k, 1, gpu, fp8_peak_flops) for m, n, k in work.fp8_gemms)
    if work.attention_flops:
        t += attention_time_s(work.attention_flops, work.attention_backward, gpu, peak_flops)
    if work.mem_bytes:
        t += memory_bound_time_s(work.mem_bytes, gpu)
    if work.fp32_mem_bytes:
        t += memory_bound_time_s(work.fp32_mem_bytes, gpu_fp32)
    if work.optimizer_bytes:
        t += optimizer_time_s(work.optimizer_bytes, gpu)
    if work.accumulate_bytes:
        t += grad_accumulate_time_s(work.accumulate_bytes, gpu)
    if work.copy_bytes:
        t += copy_time_s(work.copy_bytes, gpu)
    return t


def collective_op_cost(comm, cluster, pipe_stage: int, data_parallel: int, tensor: int, intra, inter, nccl):
    """A collective priced over the ranks its own process group spans (zsim.hardware.placement):
    collectives.collective_cost's latency, transfer and tier."""
    nodes, per_node = group_shape(comm.group, pipe_stage, data_parallel, cluster.gpus_per_node, tensor)
    return collective_cost(comm.collective.value, comm.size_bytes, nodes, per_node, intra, inter,
                           comm.coalesced, nccl, comm.dtype)


def collective_op_s(comm, cost, gpu) -> tuple[float, float, float]:
    """A collective op's time beyond the host's launch, in the order its stream runs it: its own
    buffer passes (packing, pre-division), its latency (both fixed), its transfer (work)."""
    return memory_bound_time_s(comm.buffer_bytes, gpu), cost.latency_s, cost.transfer_s


@record
class OpCost:
    fixed_s: float
    work_s: float
    links: tuple[str, ...]


class CostModel:
    def __init__(self, cluster, precision: str, zero_stage: int, host: HostSettings,
                 pipeline: PipelineLayout | None = None, tensor: int = 1, tf32: bool = False):
        prof = cluster.profile
        self.pipeline, self.tensor = pipeline, tensor
        self.cluster, self.zero_stage, self.host = cluster, zero_stage, host
        self.gpu = prof.gpu.for_dtype(precision)   # the run's dtype's compute figures (gpu.by_dtype)
        self.gpu_fp32 = prof.gpu.for_dtype("fp32")   # kernels in fp32 whatever the precision (the loss's)
        self.cpu = prof.cpu
        self.peak_flops = matmul_peak_flops(cluster, precision, tf32)
        self.fp8_peak_flops = cluster.fp8_peak_flops()
        self.dtype_bytes = DTYPE_BYTES[precision]
        self.compute_slowdown = prof.interference.compute_slowdown_during_comm
        self.intra, self.inter = tiers_for(cluster)
        self.nccl = nccl_topo_for(cluster)
        self.uplink_Bps = prof.pcie.switch_uplink_GBps * 1e9 if prof.pcie.switch_uplink_GBps else None
        # only the job's GPUs copy: a 1-GPU job has its switch's uplink to itself
        self.sharers = min(prof.pcie.gpus_per_switch, cluster.gpus_per_node)
        self.host_Bps = host_link_Bps(cluster.pcie_bw_Bps, self.uplink_Bps, self.sharers)
        self.nic_links = (("inter_node", "gpu_link_up", "gpu_link_down") if prof.pcie.nics_share_gpu_link
                          else ("inter_node",))
        self.aio_efficiency = aio_efficiency(host.aio_block_size, host.aio_queue_depth, host.aio_thread_count)
        nvme = prof.nvme
        self.nvme_node_Bps = {Transfer.NVME_READ: max(nvme.drives_per_node, 1) * nvme.read_GBps_per_drive * 1e9,
                              Transfer.NVME_WRITE: max(nvme.drives_per_node, 1) * nvme.write_GBps_per_drive * 1e9}
        if self.uplink_Bps is not None:   # drives sit under the switches: their traffic crosses the uplinks too
            cap = self.uplink_Bps * cluster.gpus_per_node / self.sharers
            self.nvme_node_Bps = {k: min(v, cap) for k, v in self.nvme_node_Bps.items()}
        self._cache: dict[tuple, OpCost] = {}
        self._by_pass: dict[tuple, OpCost] = {}   # see op_cost

    def _links(self, path: tuple[str, ...]) -> tuple[str, ...]:
        # without a shared switch uplink, host traffic has no uplink to contend for
        return path if self.uplink_Bps is not None else tuple(x for x in path if not x.startswith("uplink"))

    def host_fixed_s(self, op: Op) -> float:
        """Host-side time before the op's work: kernel launches, DeepSpeed's hooks, fresh mappings."""
        work = op.work
        fixed = kernel_overhead_s(work.kernels if work is not None else 0, self.gpu)
        if op.hook_visits:
            fixed += hook_visits_time_s(op.hook_visits, hook_visit_us(self.cpu, op.phase == Phase.BACKWARD))
        if op.grad_hooks:
            fixed += op.grad_hooks * 1e-6 * self.cpu.grad_hook_us(self.zero_stage)
        if op.host_views:
            fixed += rank_views_time_s(op.host_views, self.cpu.zero3_rank_view_us)
        if op.alloc and self.gpu.fresh_alloc_GBps:
            comm = op.comm
            # a gather's params are views of one flat output buffer; other ops' allocations are tensors
            sizes = ([(comm.size_bytes, comm.size_bytes)] if comm is not None and comm.collective == Collective.ALL_GATHER
                     else [(a.size_bytes, a.first_touch_bytes) for a in op.alloc])
            fixed += fresh_alloc_time_s(sizes, self.gpu)
        return fixed

    def compute_work_s(self, work: ComputeWork) -> float:
        return compute_work_s(work, self.gpu, self.gpu_fp32, self.peak_flops, self.dtype_bytes, self.fp8_peak_flops)

    def op_cost(self, op: Op) -> OpCost:
        """The op's cost, computed once per op shape: a cost depends only on the shape's fields
        (the work, call or copy, the hooks before it, the sizes it allocates), never on names.
        A module's pass is one payload object for the whole step (zsim/schedule/passes.py): its
        ops are looked up by that object first, without hashing its fields."""
        p = op.payload
        fast = None
        if type(p) is ModulePass and not (op.alloc and self.gpu.fresh_alloc_GBps):
            # the schedule holds the payload for the whole simulation, so its id is not reused
            fast = (id(p), op.phase if op.hook_visits else None, op.hook_visits, op.grad_hooks, op.host_views, op.pipe_stage)
            cost = self._by_pass.get(fast)
            if cost is not None:
                return cost
        shape = payload_shape(p)
        sizes = (tuple((a.size_bytes, a.touched_bytes) for a in op.alloc) if op.alloc and self.gpu.fresh_alloc_GBps
                 else ())
        key = (shape, op.phase if op.hook_visits else None, op.hook_visits, op.grad_hooks, op.host_views, sizes, op.pipe_stage)
        cost = self._cache.get(key)
        if cost is None:
            cost = self._cache[key] = self._op_cost(op)
        if fast is not None:
            self._by_pass[fast] = cost
        return cost

    def _op_cost(self, op: Op) -> OpCost:
        if isinstance(op.payload, PipeTransfer):
            return self._p2p_cost(op, op.payload)
        cost = self._rank_cost(op)
        return cost if op.pipe_stage == 0 else OpCost(cost.fixed_s, cost.work_s, stage_links(cost.links, op.pipe_stage))

    def _p2p_cost(self, op: Op, p: PipeTransfer) -> OpCost:
        fixed = self.host_fixed_s(op)
        if op.pipe_stage != p.src_stage:
            return OpCost(fixed, 0.0, stage_links(COMPUTE, op.pipe_stage))   # a recv: done when its send is
        # p2p.send: one message between two ranks, priced as a two-rank broadcast (what p2p.py
        # falls back to). Links are full duplex: it occupies the sender's outgoing side and the
        # receiver's incoming side, so a rank that sends to one peer while it receives from
        # another (Megatron's batched exchange) shares neither. A rank's sends never overlap its
        # own collectives (it blocks in its p2p call), so these sides need no share with them.
        name, tier = self._between(p.src_stage, p.dst_stage)
        cost = ring_cost("broadcast", p.size_bytes, 2, tier, name)
        return OpCost(fixed + cost.latency_s, cost.transfer_s,
                      stage_links(self._p2p_links(cost.tier, True), p.src_stage)
                      + stage_links(self._p2p_links(cost.tier, False), p.dst_stage))

    def _p2p_links(self, tier: str, sender: bool) -> tuple[str, ...]:
        """One direction of the tier (a NIC that shares the GPU's PCIe link also crosses it, up at
        the sender, down at the receiver)."""
        side: tuple[str, ...] = (f"{tier}_out",) if sender else (f"{tier}_in",)
        if tier == "inter_node" and len(self.nic_links) > 1:
            side += ("gpu_link_up",) if sender else ("gpu_link_down",)
        return side

    def _tier_links(self, tier: str) -> tuple[str, ...]:
        return self.nic_links if tier == "inter_node" else (tier,)

    def _between(self, stage_a: int, stage_b: int) -> tuple[str, Tier]:
        """The tier (name, Tier) between the representative ranks of two stages."""
        assert self.pipeline is not None   # only a pipeline's sends cross stages
        dp, g = self.pipeline.data_parallel, self.cluster.gpus_per_node
        if same_node(rank_of(stage_a, dp, tensor=self.tensor), rank_of(stage_b, dp, tensor=self.tensor), g):
            return "intra_node", self.intra
        return "inter_node", self.inter

    def _comm_cost(self, op: Op, comm: Comm):
        cl = self.cluster
        dp = cl.world_size // self.tensor if self.pipeline is None else self.pipeline.data_parallel
        return collective_op_cost(comm, cl, op.pipe_stage, dp, self.tensor, self.intra, self.inter, self.nccl)

    def _rank_cost(self, op: Op) -> OpCost:
        """The cost on the op's own rank, its links named as stage 0's."""
        fixed = self.host_fixed_s(op)
        comm, p = op.comm, op.payload
        cl = self.cluster
        if comm is not None:
            cost = self._comm_cost(op, comm)
            buffer_s, latency_s, transfer_s = collective_op_s(comm, cost, self.gpu)
            fixed += buffer_s
            return OpCost(fixed + latency_s, transfer_s, self._tier_links(cost.tier))
        if isinstance(p, Copy):
            if p.transfer in (Transfer.H2D, Transfer.D2H):
                pinned = self.host.pin_memory if p.pinned is None else p.pinned
                lat, xfer = pcie_time_s(p.size_bytes, self.host_Bps, cl.profile.pcie.latency_us * 1e-6, pinned,
                                        cl.profile.pcie.pageable_fraction)
                return OpCost(fixed + lat, xfer, self._links(_PATHS[p.transfer]))
            t = nvme_time_s(p.size_bytes, self.nvme_node_Bps[p.transfer], cl.gpus_per_node, self.aio_efficiency)
            return OpCost(fixed + 0.0, t, self._links(_PATHS[p.transfer]))
        if isinstance(p, CpuAdam):
            memory_Bps = self.cpu.memory_bw_GBps * 1e9
            # a lighter optimizer (Adagrad, Lion: one state) streams less per parameter than the
            # Adam the profile's rate was measured on; its time scales with its traffic
            scaled = p.params * p.update_bytes_per_param / CPU_ADAM_BYTES_PER_PARAM
            t = cpu_adam_time_s(scaled, self.cpu.adam_params_per_s_per_core, self.cpu.cores_per_node,
                                cl.gpus_per_node, self.host.cpu_cores_fraction, memory_Bps)
            t += host_pass_time_s(p.pass_bytes, memory_Bps, cl.gpus_per_node)
            return OpCost(fixed + t, 0.0, CPU)
        if isinstance(p, StepCompute):   # see [Note: launch-bound step passes]
            host_s, device_s = step_passes_time_s(p.work.kernels, self.compute_work_s(p.work), self.gpu)
            return OpCost(fixed - kernel_overhead_s(p.work.kernels, self.gpu) + host_s, device_s, COMPUTE)
        work = op.work
        assert work is not None, f"{op.kind} has no compute work"
        return OpCost(fixed, self.compute_work_s(work), COMPUTE)
