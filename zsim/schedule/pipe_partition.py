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
from functools import lru_cache
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
    Memoised: a search's pipeline variants share their model's partition."""
    return list(_partition_balanced(tuple(weights), num_parts))


@lru_cache(maxsize=64)
def _partition_balanced(weights: tuple[float, ...], num_parts: int) -> tuple[int, ...]:
    """DeepSpeed's dynamic programme over (items i, parts j, last split k), its tables stored
    by column (j) and each (i, j) cell kept in locals while k runs: the same comparisons in
    the same order (max/min as Python's: the first argument unless the second is larger/smaller)."""
    n, m = len(weights), num_parts
    if n <= m:
        return tuple(partition_uniform(n, m))
    inf = float("inf")
    prefix = list(accumulate(weights, initial=0.0))   # DeepSpeed's prefix sums, added in its order
    dp_max = [[inf] * (n + 1) for _ in range(m + 1)]    # dp_max[j][i]: DeepSpeed's dp_max[i][j]
    dp_min = [[inf] * (n + 1) for _ in range(m + 1)]
    position = [[0] * (n + 1) for _ in range(m + 1)]
    dp_max[0][0] = 0.0
    for i in range(1, n + 1):
        top = prefix[i]
        for j in range(1, min(i, m) + 1):
            prev_max, prev_min = dp_max[j - 1], dp_min[j - 1]
            best, best_max, best_min, best_k = inf, inf, inf, 0
            for k in range(i):
                part = top - prefix[k]
                a, b = prev_max[k], prev_min[k]
                max_sum = part if part > a else a
                min_sum = part if part < b else b
                cost = max_sum - min_sum
                if best >= cost:
                    best, best_max, best_min, best_k = cost, max_sum, min_sum, k
            dp_max[j][i], dp_min[j][i], position[j][i] = best_max, best_min, best_k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(position[j][parts[-1]])
    return tuple(parts[::-1])


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
    picked = [m for s in specs for m in s.modules]
    index: dict[int, int] = {}
    for m in picked:
        for pid in m.params:
            index.setdefault(pid, len(index))
    params = tuple(wl.params[pid] for pid in index)
    modules = tuple(replace(m, params=tuple(index[p] for p in m.params)) for m in picked)
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
