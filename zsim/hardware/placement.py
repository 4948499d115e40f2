"""Where a process group's ranks sit, the one home of that rule. Ranks fill nodes in order (rank r
on node r // gpus_per_node, as torchrun numbers them). DeepSpeed's PipeDataParallelTopology
(runtime/pipe/topology.py) orders the axes ['pipe', 'data'] with data innermost, so global rank =
stage * dp + dp_rank: a stage's data-parallel group is dp consecutive ranks; adjacent stages are
dp ranks apart, on another node once dp fills a node. Megatron-LM's tensor parallelism adds the
innermost axis (megatron/core/parallel_state.py, order tp-dp-pp; PipeModelDataParallelTopology's
['pipe', 'data', 'model']): global rank = (stage * dp + dp_rank) * tp + tp_rank, so a tensor-
parallel group is tp consecutive ranks inside a node (config/parallel.py refuses tp not dividing
the GPUs per node) and every other group's stride is in units of tp ranks. DeepSpeed-MoE's expert groups sit inside
the data-parallel group (groups.py _create_expert_and_data_parallel): the expert-parallel group
consecutive, the expert-data-parallel group strided by ep_size (ir.ProcessGroup).

Stages are simulated as one representative rank each (dp_rank 0): the links of stage s's rank
are named `<link>@s` (stage 0 keeps the plain names, so a one-stage run is unchanged).
"""
from __future__ import annotations

import functools
import math

from zsim.schedule.ir import STAGE_GROUPS, Group, ProcessGroup


def rank_of(stage: int, data_parallel: int, dp_rank: int = 0, tensor: int = 1, tp_rank: int = 0) -> int:
    return (stage * data_parallel + dp_rank) * tensor + tp_rank


def rank_map(stages: int, data_parallel: int, tensor: int, gpus_per_node: int) -> list[dict]:
    """Every rank's (global rank, node, stage, dp rank, tp rank): what a user reads to see the layout."""
    return [{"rank": r, "node": r // gpus_per_node, "stage": s, "dp_rank": d, "tp_rank": t}
            for s in range(stages) for d in range(data_parallel) for t in range(tensor)
            for r in (rank_of(s, data_parallel, d, tensor, t),)]


def same_node(rank_a: int, rank_b: int, gpus_per_node: int) -> bool:
    return rank_a // gpus_per_node == rank_b // gpus_per_node


def group_shape(group: ProcessGroup | None, stage: int, data_parallel: int, gpus_per_node: int,
                tensor: int = 1) -> tuple[int, int]:
    """(nodes, ranks per node) the process group of an op of `stage` spans (None: the stage's
    data-parallel group); the cost model prices the collective over that placement. Every group
    but the tensor-parallel one is laid over whole tensor-parallel groups (its stride times tp)."""
    if group is None:
        return span(rank_of(stage, data_parallel, tensor=tensor), data_parallel, tensor, gpus_per_node)
    global_ranks = group.kind in (Group.TENSOR, Group.HPZ, Group.QGZ_LOCAL, Group.QGZ_GLOBAL, Group.SEQUENCE)
    own_stage = group.kind in STAGE_GROUPS or global_ranks
    first = rank_of(stage if own_stage else 0, data_parallel, tensor=tensor)
    # the tensor-parallel group and ZeRO++'s groups of global ranks count single ranks
    stride = group.stride if global_ranks else group.stride * tensor
    return span(first, group.size, stride, gpus_per_node)


@functools.lru_cache(maxsize=1024)   # pure; a schedule asks for the same few groups
def span(first_rank: int, size: int, stride: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) of `size` ranks `stride` apart from `first_rank`."""
    if stride >= gpus_per_node:
        nodes = size        # every rank on a node of its own
    else:
        nodes = len({(first_rank + i * stride) // gpus_per_node for i in range(size)})
    return nodes, math.ceil(size / nodes)


def stage_links(links: tuple[str, ...], stage: int) -> tuple[str, ...]:
    """The representative rank of `stage`'s own copy of each link."""
    return links if stage == 0 else tuple(f"{link}@{stage}" for link in links)


def link_rank(link: str) -> int:
    """The stage whose rank a (stage-qualified) link belongs to."""
    _, _, stage = link.partition("@")
    return int(stage) if stage else 0


def base_link(link: str) -> str:
    return link.partition("@")[0]
