"""Where a pipeline's ranks sit: DeepSpeed's PipeDataParallelTopology (runtime/pipe/topology.py)
orders the axes ['pipe', 'data'] with data innermost, so global rank = stage * dp + dp_rank and
ranks fill nodes in order. A stage's data-parallel group is dp consecutive ranks; adjacent
stages are dp ranks apart, on another node once dp fills a node.

Stages are simulated as one representative rank each (dp_rank 0): the links of stage s's rank
are named `<link>@s` (stage 0 keeps the plain names, so a one-stage run is unchanged).
"""
from __future__ import annotations

import math


def rank_of(stage: int, data_parallel: int, dp_rank: int = 0) -> int:
    return stage * data_parallel + dp_rank


def same_node(rank_a: int, rank_b: int, gpus_per_node: int) -> bool:
    return rank_a // gpus_per_node == rank_b // gpus_per_node


def data_group_shape(stage: int, data_parallel: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) the stage's data-parallel group spans."""
    first = rank_of(stage, data_parallel)
    last = first + data_parallel - 1
    nodes = last // gpus_per_node - first // gpus_per_node + 1
    return nodes, math.ceil(data_parallel / nodes)


def pipe_group_shape(stages: int, data_parallel: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) of the group of one data-parallel index across the stages
    (ranks dp_rank, dp_rank + dp, ...)."""
    nodes = len({rank_of(s, data_parallel) // gpus_per_node for s in range(stages)})
    return nodes, math.ceil(stages / nodes)


def stage_links(links: tuple[str, ...], stage: int) -> tuple[str, ...]:
    """The representative rank of `stage`'s own copy of each link."""
    return links if stage == 0 else tuple(f"{link}@{stage}" for link in links)


def link_rank(link: str) -> int:
    """The stage whose rank a (stage-qualified) link belongs to."""
    _, _, stage = link.partition("@")
    return int(stage) if stage else 0


def base_link(link: str) -> str:
    return link.partition("@")[0]
