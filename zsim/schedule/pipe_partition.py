"""DeepSpeed's PipelineModule partition (runtime/pipe/module.py _partition_layers, with
runtime/utils.py partition_uniform and partition_balanced), over the workload's layer specs,
and the slice of the workload each stage holds.

The layer specs are those of a GPT PipelineModule (Megatron-DeepSpeed's GPTModelPipe, the
seeds' GPT2PipelineModel): the embedding (a TiedLayerSpec when the head shares its weight),
one spec per transformer block, the final norm, and the head, with the loss as loss_fn on the
last stage. A tied head holds its own copy of the embedding's weight, whose gradients
ReduceTiedGrads all-reduces between the first and the last stage.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from itertools import accumulate

from zsim.errors import ZsimInputError
from zsim.workload.module import Module, ModuleKind, Workload


@dataclass(frozen=True)
class LayerSpec:
    typename: str                 # the class name partition_method type:<regex> matches
    modules: tuple[Module, ...]
    params: int                   # parameters it builds (a tied head counts the shared weight, as DeepSpeed does)


def layer_specs(wl: Workload) -> list[LayerSpec]:
    def spec(typename, modules):
        pids = {pid for m in modules for pid in m.params}
        return LayerSpec(typename, tuple(modules), sum(wl.params[pid].numel for pid in pids))

    head = [m for m in wl.modules if m.layer == -2]
    norm = [m for m in head if m.kind == ModuleKind.NORM]
    rest = [m for m in head if m.kind != ModuleKind.NORM]
    tied = bool(set(rest[0].params) & {pid for m in wl.layer_modules(-1) for pid in m.params}) if rest else False
    specs = [spec("EmbeddingPipe", wl.layer_modules(-1))]
    specs += [spec("TransformerLayer", wl.layer_modules(i)) for i in range(wl.layers)]
    specs += [spec("LayerNorm", norm), spec("EmbeddingPipe" if tied else "LMHead", rest)]
    return specs


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """runtime/utils.py partition_uniform."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        parts[i + 1:] = [x + 1 for x in parts[i + 1:]]
    return parts


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """runtime/utils.py partition_balanced: the linear partition that minimises the spread
    (max - min) of the parts' sums, ties broken toward the later split as DeepSpeed's >=.
    DeepSpeed's dynamic programme over (items i, parts j, last split k), with the k loop of
    each j done for every i at once: the same float operations, so the same choice."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    import numpy as np   # here, not at import: only a pipeline needs it, and it costs a run's start-up 0.1 s
    inf = float("inf")
    p = np.array(list(accumulate(weights, initial=0.0)))   # DeepSpeed's prefix sums, added in its order
    part = p[:, None] - p[None, :]                    # [i, k]: the sum of items k..i-1
    valid = np.tril(np.ones((n + 1, n + 1), dtype=bool), -1)   # k < i
    dp_max = np.full((n + 1, m + 1), inf)
    dp_min = np.full((n + 1, m + 1), inf)
    dp_cost = np.full((n + 1, m + 1), inf)
    position = np.zeros((n + 1, m + 1), dtype=np.int64)
    dp_max[0, 0] = dp_cost[0, 0] = 0.0
    rows = np.arange(n + 1)
    for j in range(1, m + 1):
        max_sum = np.maximum(dp_max[None, :, j - 1], part)
        min_sum = np.minimum(dp_min[None, :, j - 1], part)
        cost = np.where(valid, max_sum - min_sum, np.nan)
        best = np.nanmin(cost[1:], axis=1)            # every i >= 1 has a k < i
        # the last k reaching the minimum (DeepSpeed updates on >=); inf == inf counts
        hit = cost[1:] == best[:, None]
        k = n - np.argmax(hit[:, ::-1], axis=1)
        i = rows[1:]
        done = i >= j                                 # DeepSpeed fills j <= i only
        i, k, best = i[done], k[done], best[done]
        dp_cost[i, j], dp_max[i, j], dp_min[i, j], position[i, j] = best, max_sum[i, k], min_sum[i, k], k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], j]))
    return parts[::-1]


def partition(specs: list[LayerSpec], stages: int, method: str) -> list[int]:
    """PipelineModule._partition_layers: the spec index each stage starts at (stages + 1 bounds)."""
    method = method.lower()
    if method == "uniform":
        return partition_uniform(len(specs), stages)
    if method == "parameters":
        return partition_balanced([s.params for s in specs], stages)
    # type:<regex>: module.py _find_layer_type matches the spec's class name, case-insensitive
    regex = re.compile(method.split(":", 1)[1], re.IGNORECASE)
    return partition_balanced([1 if regex.search(s.typename) else 0 for s in specs], stages)


def stage_workload(wl: Workload, specs: list[LayerSpec]) -> Workload:
    """The workload of one stage: its modules, with its own params re-indexed (a tied head's
    weight is the stage's own copy)."""
    modules = [m for s in specs for m in s.modules]
    index: dict[int, int] = {}
    for m in modules:
        for pid in m.params:
            index.setdefault(pid, len(index))
    params = tuple(wl.params[pid] for pid in index)
    modules = tuple(replace(m, params=tuple(index[p] for p in m.params)) for m in modules)
    layers = sum(1 for s in specs if s.typename == "TransformerLayer")
    return replace(wl, params=params, modules=modules, layers=layers)


def stage_slices(wl: Workload, stages: int, method: str) -> list[tuple[Workload, tuple[int, int]]]:
    """Each stage's workload and its [first, end) transformer layers; a stage without a
    transformer layer is refused (it would hold only the embedding or the head)."""
    specs = layer_specs(wl)
    parts = partition(specs, stages, method)
    out = []
    for s in range(stages):
        mine = specs[parts[s]:parts[s + 1]]
        blocks = [i - 1 for i in range(parts[s], parts[s + 1]) if specs[i].typename == "TransformerLayer"]
        if not blocks:
            held = ", ".join(x.typename for x in mine) or "nothing"
            raise ZsimInputError("parallelism.partition_method", method,
                                 f"gives pipeline stage {s} no transformer layer (it holds {held}); "
                                 "use partition_method uniform or type:transformer, or fewer stages")
        out.append((stage_workload(wl, mine), (blocks[0], blocks[-1] + 1)))
    return out


def chunk_slices(wl: Workload, stages: int,
                 chunks: int) -> list[tuple[Workload, list[tuple[Workload, tuple[int, int]]]]]:
    """Megatron-LM's placement for the interleaved schedule: the layers split evenly into
    stages x chunks virtual stages (the caller checked they divide), chunk j of rank i holding
    virtual stage j * stages + i (transformer_block.py get_num_layers_to_build,
    get_transformer_layer_offset: "Stage 0: [0, 1] [4, 5]; Stage 1: [2, 3] [6, 7]"); the
    embedding sits on rank 0's chunk 0, the final norm and the head on the last rank's last
    chunk. Per rank: its workload (every chunk's params, re-indexed) and, per chunk, the chunk's
    modules over those params, with its [first, end) layers."""
    specs = layer_specs(wl)
    per = wl.layers // (stages * chunks)
    # virtual stage k: specs [1 + k * per, 1 + (k + 1) * per), plus the embedding / the head
    bounds = [0] + [1 + k * per for k in range(1, stages * chunks)] + [len(specs)]
    out = []
    for rank in range(stages):
        mine = [specs[bounds[j * stages + rank]:bounds[j * stages + rank + 1]] for j in range(chunks)]
        rank_wl = stage_workload(wl, [s for chunk in mine for s in chunk])
        names = [{m.name for s in chunk for m in s.modules} for chunk in mine]
        out.append((rank_wl, [(replace(rank_wl, modules=tuple(m for m in rank_wl.modules if m.name in names[j]),
                                       layers=per), ((j * stages + rank) * per, (j * stages + rank + 1) * per))
                              for j in range(chunks)]))
    return out
