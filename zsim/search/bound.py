"""A lower bound on a configuration's step time that needs no schedule: its compute stream's
work alone (the modules' passes, the tensor-parallel calls they wait for, ZeRO-3's host time).

[Note: step-time lower bound]
A rank's compute stream runs its ops one after another, each its fixed time (at least its
kernels' launches) and then its work, and the engine serves that work at a rate of at most 1
(processor sharing, slowed further while NCCL kernels run: zsim/engine/fluid.py), so over any
stretch of time the stream cannot finish more than the stretch is long. Each micro-step runs
every module of the rank's workload forward and backward on it, and under full checkpointing
every transformer layer's modules forward once more before their backward
(zsim/schedule/passes.py); each is `kernel_overhead_s` of its kernels plus `compute_work_s`, of
`passes.forward_work` / `backward_work` (gradient adds into accumulated .grads left out: they
only add; a tensor-parallel backward split in two keeps its GEMMs and kernels). With f_s + b_s
that per micro-step on pipeline stage s and m micro-steps:
- without a pipeline, a step takes at least m (f + b);
- with one, stage s starts its first forward only after micro-step 0 has gone forward through
  stages 0..s-1, and after its last backward the gradient of micro-step m-1 still goes back
  through them, so the step takes at least max_s [sum_{i<s} (f_i + b_i) + m (f_s + b_s)]: for
  equal stages (m + p - 1)(f + b), the 1F1B bubble of Narayanan et al. 2021.
Megatron's tensor-parallel calls that the compute stream waits for are ops of that stream
(zsim/schedule/tensor.py: every call but the column-parallel backward's, which overlaps its
GEMMs), so each adds its buffer passes, latency and transfer (cost_model.collective_op_s; the
engine serves the transfer at a rate of at most 1 too) to its module's pass: forward, recompute
and backward. ZeRO-3's host time, its module hooks and the per-rank views of its
reduce-scatters, is the fixed time of the compute op whose hook runs it (cost_model
host_fixed_s): counted too (`zero3_host_s`). Other communication, the other ops' launches and
host time, the optimizer step and memory stalls only add to it. A configuration
whose bound is not below a simulated step time cannot beat that step; `zsim tune` skips it
(tests/search/test_bound.py checks the bound against simulations of a random sample).
"""
from __future__ import annotations

from zsim.hardware.collectives import nccl_topo_for, tiers_for
from zsim.hardware.compute import kernel_overhead_s
from zsim.hardware.host import hook_visit_us, hook_visits_time_s, rank_views_time_s
from zsim.hardware.cost_model import collective_op_cost, collective_op_s, compute_work_s, matmul_peak_flops
from zsim.schedule.build import workload_for
from zsim.schedule.ir import Phase
from zsim.schedule.moe import moe_blocks_are_leaves, zero3_leaves
from zsim.schedule.param_fetch import module_visits
from zsim.schedule.partition import grads_ready_at, scatter_views
from zsim.schedule.passes import backward_work, forward_work
from zsim.schedule.pipe_partition import LayerSpec, layer_specs, partition
from zsim.schedule.tensor import TensorCollectives
from zsim.workload.module import DTYPE_BYTES, Module, Workload


class ComputePricer:
    """A module's compute-stream time on one cluster and precision, each distinct module priced
    once per checkpointing mode and tensor-parallel layout."""

    def __init__(self, cluster, precision: str, tf32: bool = False):
        gpu = cluster.profile.gpu
        self.cluster = cluster
        self._args = (gpu.for_dtype(precision), gpu.for_dtype("fp32"), matmul_peak_flops(cluster, precision, tf32),
                      DTYPE_BYTES[precision], cluster.fp8_peak_flops())
        self._tiers = (*tiers_for(cluster), nccl_topo_for(cluster))
        self._cache: dict = {}

    def work_s(self, work) -> float:
        """The work's time on the compute stream: its kernels' launches (the op's fixed time,
        which its stream runs before the work: zsim/engine/sim.py _StreamRun) and its work."""
        return kernel_overhead_s(work.kernels, self._args[0]) + compute_work_s(work, *self._args)

    def comm_s(self, comm, tp_size: int) -> float:
        """A tensor-parallel call's time on the compute stream (no kernels or hooks of its own:
        cost_model.collective_op_s). A tensor-parallel group is tp_size consecutive ranks inside
        a node (parallel.py refuses a size not dividing the node's GPUs), placed alike on every
        stage: its shape does not read the data-parallel size (1 here)."""
        cost = collective_op_cost(comm, self.cluster, 0, 1, tp_size, *self._tiers)
        return sum(collective_op_s(comm, cost, self._args[0]))

    def module_s(self, module: Module, checkpointing: str, tensor: TensorCollectives | None = None) -> float:
        """`module`'s compute in one micro-step: forward, backward, and a full recompute's forward,
        each with the tensor-parallel calls it blocks on."""
        layout = None if tensor is None else (tensor.group.size, tensor.sp, tensor.tokens, tensor.a)
        key = (module, checkpointing, layout)
        t = self._cache.get(key)
        if t is None:
            fwd = self.work_s(forward_work(module))
            bwd = self.work_s(backward_work(module, checkpointing))
            if tensor is not None:
                size = tensor.group.size
                fwd += sum(self.comm_s(c, size) for c in tensor.blocking(module, Phase.FORWARD))
                bwd += sum(self.comm_s(c, size) for c in tensor.blocking(module, Phase.BACKWARD))
            t = fwd + bwd
            if checkpointing == "full" and module.layer >= 0:
                t += fwd
            self._cache[key] = t
        return t


def tensor_collectives(parallelism, wl: Workload, precision: str) -> TensorCollectives | None:
    """The tensor-parallel calls the bound counts: None where the run has none."""
    tensor = TensorCollectives(parallelism, wl, precision)
    return tensor if tensor.active else None


def zero3_hooks_s(wl: Workload, checkpointing: str, leaves: dict, cpu) -> float:
    """ZeRO-3's module hooks in one micro-step: every visit of param_fetch.module_visits, each
    charged before the compute op of its own phase (cost_model host_fixed_s)."""
    visits = module_visits(wl, checkpointing, leaves)
    backward = sum(1 for v in visits if v.phase == Phase.BACKWARD)
    return (hook_visits_time_s(len(visits) - backward, hook_visit_us(cpu, False))
            + hook_visits_time_s(backward, hook_visit_us(cpu, True)))


def zero3_views_s(wl: Workload, data_parallel: int, cpu) -> float:
    """At least the per-rank views of ZeRO-3's reduce-scatters in one micro-step: one per rank
    and gradient (partition.scatter_views: every trained param enters one bucket per
    micro-step; interleaving only doubles them, and the coalesced gathers' views add more). Each
    dense param is one gradient on every rank: ZeRO-3 runs neither expert parallelism (dropless
    MoE only) nor a pipeline."""
    grads = sum(len(pids) for pids in grads_ready_at(wl).values())
    return rank_views_time_s(scatter_views(data_parallel, grads, False), cpu.zero3_rank_view_us)


def zero3_host_s(sc, wl: Workload, checkpointing: str, stage: int, pipeline: int, data_parallel: int,
                 tensor: TensorCollectives | None) -> float:
    """ZeRO-3's host time on the compute stream in one micro-step of a configuration of `sc`'s
    model, cluster and ZeRO settings at `stage` (0 but at stage 3; DeepSpeed's pipeline refuses
    ZeRO-3): its hooks (`zero3_hooks_s`), and where gradients leave through
    reduce_scatter_coalesced (reduce_scatter true: its other path needs it false) its views
    (`zero3_views_s`). The last bucket's views run after the backward's last op, on the compute
    stream unless the first module is a column-parallel linear that overlaps its backward (then
    none are counted)."""
    if stage != 3 or pipeline > 1:
        return 0.0
    cpu = sc.cluster.profile.cpu
    t = zero3_hooks_s(wl, checkpointing, zero3_leaves(wl, moe_blocks_are_leaves(sc)), cpu)
    if sc.zero.reduce_scatter and not (tensor is not None and tensor.overlaps_backward(wl.modules[0])):
        t += zero3_views_s(wl, data_parallel, cpu)
    return t


def layer_compute_s(wl: Workload, checkpointing: str, pricer: ComputePricer,
                    tensor: TensorCollectives | None = None) -> tuple[list[LayerSpec], list[float]]:
    """The workload's PipelineModule layers (pipe_partition.layer_specs) and each one's compute
    in one micro-step (`tensor`: the blocking tensor-parallel calls, `tensor_collectives`)."""
    specs = layer_specs(wl)
    return specs, [sum(pricer.module_s(m, checkpointing, tensor) for m in spec.modules) for spec in specs]


def stage_compute_s(specs: list[LayerSpec], layer_s: list[float], stages: int, partition_method: str,
                    host_s: float = 0.0) -> list[float]:
    """f_s + b_s of every pipeline stage from `layer_compute_s`: the layers split as
    PipelineModule splits them (pipe_partition.partition); `host_s`: a run without a pipeline's
    host time per micro-step on the compute stream (`zero3_host_s`)."""
    if stages == 1:
        return [sum(layer_s) + host_s]
    bounds = partition(specs, stages, partition_method)
    return [sum(layer_s[bounds[s]:bounds[s + 1]]) for s in range(stages)]


def step_time_lower_bound_s(stage_s: list[float], micro_steps: int, interleaved: bool = False) -> float:
    """see [Note: step-time lower bound]: max_s [sum_{i<s} stage_s[i] + micro_steps x stage_s[s]].
    `interleaved` (Megatron's virtual stages: a rank runs chunks of layers from all over the model,
    so the stages' split is not these contiguous ones): the busiest rank runs at least the
    average, micro_steps x sum(stage_s) / stages."""
    if interleaved:
        return micro_steps * sum(stage_s) / len(stage_s)
    best, before = 0.0, 0.0
    for t in stage_s:
        best = max(best, before + micro_steps * t)
        before += t
    return best


def scenario_step_time_bound_s(sc, wl: Workload | None = None) -> float:
    """The bound of the scenario `sc` (`wl`: its workload when already built)."""
    pricer = ComputePricer(sc.cluster, sc.precision, sc.matmul_dtype == "tf32")
    wl = wl or workload_for(sc)
    tensor = tensor_collectives(sc.parallelism, wl, sc.precision)
    checkpointing = sc.training.activation_checkpointing
    specs, layer_s = layer_compute_s(wl, checkpointing, pricer, tensor)
    stages = stage_compute_s(specs, layer_s, sc.pipeline_stages, sc.parallelism.partition_method,
                             zero3_host_s(sc, wl, checkpointing, sc.zero.stage, sc.pipeline_stages,
                                          sc.seq_data_parallel_size, tensor))
    return step_time_lower_bound_s(stages, sc.gradient_accumulation_steps, sc.parallelism.virtual_stages > 1)
