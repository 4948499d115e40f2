"""Schedules are data: ops on streams with dependencies, work and memory effects.

An op starts when it reaches the head of its stream (streams are FIFO, like CUDA streams)
and every op in `deps` has finished (like waiting on a CUDA event). Its `alloc` entries are
allocated when it starts; the tags in `free` are released when it ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

STREAMS = ("compute", "allgather", "reduce", "h2d", "d2h", "cpu", "nvme")


@dataclass(frozen=True)
class Alloc:
    tag: str
    category: str
    size_bytes: float


@dataclass(frozen=True)
class Op:
    id: int
    name: str
    stream: str
    phase: str                      # forward | backward | recompute | step
    micro_step: int
    deps: tuple[int, ...] = ()
    # compute work
    gemms: tuple[tuple[float, float, float], ...] = ()   # (m, n, k) each
    attention_flops: float = 0.0
    attention_backward: bool = False
    mem_bytes: float = 0.0          # memory-bound kernel traffic
    optimizer_bytes: float = 0.0    # optimizer-step traffic (fp32 master, moments, grad conversion)
    kernels: int = 0
    model_flops: float = 0.0        # MFU convention (full attention); recompute included
    fixed_time_s: float = 0.0       # host-side time (hooks, launches) not tied to a resource
    hook_visits: int = 0            # ZeRO-3 module visits whose hooks run before this op (host time)
    grad_hooks: int = 0             # ZeRO-0/1/2 parameters whose gradients DeepSpeed handles after this op (host time)
    # communication work
    collective: str = ""            # all_gather | reduce_scatter | all_reduce | ...
    size_bytes: float = 0.0         # full buffer (nccl-tests convention)
    numel: int = 0
    # launched async together with its neighbours, then all waited (DeepSpeed's
    # _allgather_params_coalesced); its cost comes from the tier's "<collective>_coalesced" table
    coalesced: bool = False
    # host work: PCIe copies (h2d | d2h), NVMe I/O (nvme_read | nvme_write) of size_bytes;
    # CPU optimizer updates of cpu_adam_params parameters
    transfer: str = ""
    pinned: bool | None = None      # host buffer pinned? None: the schedule's pin_memory setting
    cpu_adam_params: float = 0.0
    # memory effects
    alloc: tuple[Alloc, ...] = ()
    free: tuple[str, ...] = ()


@dataclass(frozen=True)
class Schedule:
    stage: int
    ops: tuple[Op, ...]
    static: tuple[Alloc, ...]       # allocated for the whole step (model states, persistent buffers)
    meta: dict = field(default_factory=dict)
    host_static: tuple[Alloc, ...] = ()  # host (CPU) memory per GPU: offloaded states, pinned buffers


class Builder:
    """Appends ops in program order; remembers tags so frees can be attached later."""

    def __init__(self):
        self.ops: list[Op] = []
        self.static: list[Alloc] = []
        self.host_static: list[Alloc] = []

    def add(self, name: str, stream: str, phase: str, micro_step: int, deps=(), **work) -> int:
        deps = tuple(sorted({d for d in deps if d is not None}))
        op = Op(id=len(self.ops), name=name, stream=stream, phase=phase, micro_step=micro_step, deps=deps, **work)
        self.ops.append(op)
        return op.id

    def _replace(self, op_id: int, **changes):
        self.ops[op_id] = replace(self.ops[op_id], **changes)

    def add_free(self, op_id: int, *tags: str):
        self._replace(op_id, free=self.ops[op_id].free + tuple(tags))

    def add_hook_visits(self, op_id: int, visits: int):
        self._replace(op_id, hook_visits=self.ops[op_id].hook_visits + visits)

    def add_grad_hooks(self, op_id: int, params: int):
        self._replace(op_id, grad_hooks=self.ops[op_id].grad_hooks + params)

    def add_alloc(self, op_id: int, *allocs: Alloc):
        self._replace(op_id, alloc=self.ops[op_id].alloc + tuple(allocs))

    def static_alloc(self, category: str, size_bytes: float, tag: str | None = None):
        if size_bytes > 0:
            self.static.append(Alloc(tag or category, category, float(size_bytes)))

    def host_alloc(self, category: str, size_bytes: float):
        if size_bytes > 0:
            self.host_static.append(Alloc(category, category, float(size_bytes)))

    def build(self, stage: int, meta: dict) -> Schedule:
        return Schedule(stage=stage, ops=tuple(self.ops), static=tuple(self.static), meta=meta,
                        host_static=tuple(self.host_static))
