"""DeepSpeed 0.19.8's partitioning rules as pure functions: the one home of these rules for the
simulator and for the training core that executes its schedule (calibration/core)."""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

# [Note: frozen parameters under ZeRO] A parameter with requires_grad=False is not an optimized
# parameter (runtime/utils.py is_optimized_parameter), so DeepSpeed 0.19.8 leaves it out of every
# optimizer-side structure: ZeRO-1/2 build their flat 16-bit groups from the optimizer's param
# groups keeping only optimized params (stage_1_and_2.py:423-434, bit16_groups), and ZeRO-3 its
# sub-groups the same way (stage3.py:726-740 _get_trainable_parameter_groups); the engine's basic
# optimizer gets only trainable params too (engine.py _configure_basic_optimizer, and HF Trainer /
# PEFT pass only requires_grad params). So a frozen weight has no gradient, no bucket slot, no
# fp32 master and no Adam moments, and under ZeRO-1/2 it stays whole on every rank, outside
# the flat group that is partitioned, reduced and re-gathered. ZeRO-3 converts every module
# parameter to a partitioned one (parameter_offload.py:258-270 _convert_to_zero_parameters over
# module.parameters(), or zero.Init), so frozen weights are sharded, fetched before their
# module and released like trained ones, and counted by mark_persistent_parameters
# (parameter_offload.py:317, all named_parameters) for persistence and the post-step gathers.

# DeepSpeed pads the flat 16-bit group so each rank's partition is aligned
# (stage_1_and_2.py: nccl_start_alignment_factor = 2).
ALIGNMENT = 2


def flat_partition(numels: list[int], world: int) -> tuple[int, int]:
    """ZeRO-1/2: (padded flat size, partition size) of one parameter group."""
    total = sum(numels)
    unit = ALIGNMENT * world
    padded_total = int(math.ceil(total / unit) * unit)
    return padded_total, padded_total // world


# moe/utils.py split_params_into_different_moe_groups_for_optimizer's default max_group_size
MOE_MAX_GROUP_NUMEL = 178956971


@dataclass(frozen=True)
class FlatGroup:
    """One of ZeRO-1/2's flat 16-bit parameter groups (bit16_groups_flat), partitioned over
    `ranks` ranks (its real_dp_process_group)."""
    pids: tuple[int, ...]
    ranks: int
    padded: int                  # flat size with DeepSpeed's alignment padding
    partition: int               # elements of one rank's partition
    starts: dict[int, int]       # pid -> its first element in the flat group
    expert: bool = False


def flat_group(pids, numels: list[int], ranks: int, expert: bool = False) -> FlatGroup:
    sizes = [numels[p] for p in pids]
    padded_total, partition = flat_partition(sizes, ranks)
    return FlatGroup(tuple(pids), ranks, padded_total, partition, dict(zip(pids, offsets(sizes))), expert)


def flat_groups(numels: list[int], expert: list[bool], trainable: list[bool], world: int,
                expert_parallel_size: int) -> list[FlatGroup]:
    """ZeRO-1/2's flat 16-bit groups: the trainable params only (see [Note: frozen parameters under
    ZeRO]: the optimizer's param groups hold only requires_grad params, and stage_1_and_2.py
    keeps only those in bit16_groups), split into the dense group and the MoE groups (see
    [Note: MoE parameter groups]). A frozen weight, expert or not, is in no group; a set of
    experts all frozen gives no MoE group (split_params_into_different_moe_groups_for_optimizer
    only sees the params it is given), while the dense group always exists.

    [Note: MoE parameter groups] With DeepSpeed-MoE layers the engine splits the optimizer's
    params (engine.py _configure_optimizer -> moe/utils.py configure_moe_param_groups ->
    split_params_into_different_moe_groups_for_optimizer): the dense params stay one group,
    the expert params (is_moe_param: Experts sets allreduce=False) follow in groups of at most
    MOE_MAX_GROUP_NUMEL elements, in registration order. ZeRO-1/2 (stage_1_and_2.py
    _configure_moe_settings) partitions every MoE group over its expert-data-parallel group
    (real_dp_process_group[i], world / ep_size ranks) and the dense group over the whole
    data-parallel group. Each group is then flattened, all-gathered after the step and normed
    on its own (get_grad_norm_direct per group, all-reduced over the data-parallel group; a MoE
    group's norm once more over its expert-data-parallel group, _average_expert_grad_norms). In
    the IPG bucket each gradient slice is reduced over its own param's group, one reduction per
    process group in order of first appearance (average_tensor); every slice is pre-divided by
    the whole data-parallel world. The step runs one group at a time: each group's gradient
    partition is flattened, converted to fp32, stepped and dropped before the next group's
    (stage_1_and_2.py step, `for i, group in enumerate(self.bit16_groups)`), so the optimizer's
    temporaries at the peak are the largest group's, not all groups' (one OPTIMIZER_STEP op per
    group, payload sub_group = the group's index). Without MoE params: one group, as before."""
    optimized = [p for p in range(len(numels)) if trainable[p]]
    dense = [p for p in optimized if not expert[p]]
    groups = [flat_group(dense, numels, world)]
    chunk: list[int] = []
    size = 0
    for p in (p for p in optimized if expert[p]):
        if chunk and size + numels[p] > MOE_MAX_GROUP_NUMEL:
            groups.append(flat_group(chunk, numels, world // expert_parallel_size, expert=True))
            chunk, size = [], 0
        chunk.append(p)
        size += numels[p]
    if chunk:
        groups.append(flat_group(chunk, numels, world // expert_parallel_size, expert=True))
    return groups


def offsets(numels: list[int]) -> list[int]:
    """Start of each param in the flat group."""
    out, acc = [], 0
    for n in numels:
        out.append(acc)
        acc += n
    return out


def padded(numel: int, world: int) -> int:
    """ZeRO-3: gathered size of one partitioned param, ceil(numel / world) * world."""
    return int(math.ceil(numel / world)) * world


def shard_numel(numels: list[int], world: int) -> int:
    """ZeRO-3: elements one rank keeps, ceil(numel / world) of every param."""
    return sum(math.ceil(n / world) for n in numels)


def persistent_params(numels: list[int], param_threshold: float, model_threshold: float) -> tuple[int, ...]:
    """stage3.py _mark_persistent_parameters: params at or under param_persistence_threshold stay
    gathered, in registration order, while the total stays under model_persistence_threshold."""
    out, total = [], 0
    for pid, n in enumerate(numels):
        if n <= param_threshold and total + n <= model_threshold:
            out.append(pid)
            total += n
    return tuple(out)


def sub_group_sizes(numels: list[int], world: int, sub_group_size: int) -> list[int]:
    """ZeRO-3: elements of this rank's shard in each optimizer sub-group. stage3.py
    _create_fp16_sub_groups walks the params in registration order and closes a sub-group once its
    partition numel reaches sub_group_size (so a group may exceed it by its last param); one
    group when sub_group_size covers the whole shard, and one group per parameter when it is 0
    (every partial sum reaches 0: axolotl's ZeRO-3 default)."""
    parts = [math.ceil(n / world) for n in numels]
    if sub_group_size >= sum(parts):
        return [sum(parts)]
    groups, acc = [], 0
    for i, n in enumerate(parts):
        acc += n
        if acc >= sub_group_size or i == len(parts) - 1:
            groups.append(acc)
            acc = 0
    return groups


def bucket_pieces(pids, starts: list[int] | dict[int, int], numels: list[int],
                  partition: int) -> list[tuple[int, int, int, int]]:
    """ZeRO-1/2: (destination rank, pid, start within the param, elements) pieces of a bucket in
    bucket order, cut at partition boundaries."""
    out: list[tuple[int, int, int, int]] = []
    for pid in pids:
        start, end = starts[pid], starts[pid] + numels[pid]
        while start < end:
            rank = start // partition
            stop = min(end, (rank + 1) * partition)
            out.append((rank, pid, start - starts[pid], stop - start))
            start = stop
    return out


def bucket_slices(pids, groups: list[FlatGroup], group_of: dict[int, int], numels: list[int]) -> list[tuple[int, int, int]]:
    """ZeRO-1/2: (group index, destination rank in that group, elements) of a bucket's gradient
    slices in bucket order, each param cut at its own group's partition boundaries; consecutive
    slices for the same rank of the same group merge (average_tensor's rank_and_offsets, see
    [Note: MoE parameter groups])."""
    out: list[list[int]] = []
    for pid in pids:
        g = group_of[pid]
        group = groups[g]
        for rank, _, _, n in bucket_pieces((pid,), group.starts, numels, group.partition):
            if out and out[-1][0] == g and out[-1][1] == rank:
                out[-1][2] += n
            else:
                out.append([g, rank, n])
    return [(g, r, n) for g, r, n in out]


def call_sizes(sizes: list[int], bucket_size: float) -> list[int]:
    """allreduce_and_scatter / allreduce_no_retain: issue a call once the accumulated slices
    exceed reduce_bucket_size elements."""
    calls, acc = [], 0
    for n in sizes:
        acc += n
        if acc > bucket_size:
            calls.append(acc)
            acc = 0
    if acc:
        calls.append(acc)
    return calls


def in_rank_partition(group: FlatGroup, numels: list[int], pid: int, rank: int) -> bool:
    """is_param_in_current_partition of `rank`: some element of `pid` is in its partition."""
    lo, hi = rank * group.partition, (rank + 1) * group.partition
    return group.starts[pid] < hi and group.starts[pid] + numels[pid] > lo


def pieces_in_partition(group: FlatGroup, numels: list[int], rank: int) -> int:
    """ZeRO-1/2: params with elements in `rank`'s partition of a flat group (its
    averaged_gradients pieces)."""
    return sum(1 for p in group.pids if in_rank_partition(group, numels, p, rank))


def params_in_partition_numel(group: FlatGroup, numels: list[int], ranks=None) -> list[int]:
    """ZeRO-1/2: per rank (all of the group's, or `ranks`), the elements of the params with
    elements in its partition of a flat group, each param whole (a param straddling the
    partition's edge counts in full on both ranks): the size of that rank's grads_in_partition,
    which copy_grads_in_partition allocates as the sum of `param.numel()` over
    params_in_partition (stage_1_and_2.py:2184-2194)."""
    starts = [group.starts[p] for p in group.pids]     # registration order: increasing
    ends = [s + numels[p] for s, p in zip(starts, group.pids)]
    end = ends[-1] if ends else 0
    out = []
    for rank in range(group.ranks) if ranks is None else ranks:
        lo, hi = rank * group.partition, min((rank + 1) * group.partition, end)
        if lo >= hi:
            out.append(0)    # the partition holds only the alignment padding
            continue
        # the params holding its first and its last element, and every one between
        out.append(ends[bisect_right(starts, hi - 1) - 1] - starts[bisect_right(starts, lo) - 1])
    return out


def grads_in_partition_numel(groups: list[FlatGroup], numels: list[int]) -> int:
    """Elements of the largest rank's grads_in_partition over every flat group (per group, its
    largest rank's; one group without MoE). Ranks differ by the params straddling their edges,
    and whether a run fits is decided by the rank that holds the most."""
    return sum(max(params_in_partition_numel(g, numels), default=0) for g in groups)


def grads_ready_at(wl) -> dict[str, tuple[int, ...]]:
    """Trainable param ids whose gradient is final after each module's backward, in registration
    order. A tied weight's gradient is final only at its first module in forward order; a frozen
    weight has none (see [Note: frozen parameters under ZeRO])."""
    first_use: dict[int, int] = {}
    for i, m in enumerate(wl.modules):
        for pid in m.params:
            first_use.setdefault(pid, i)
    return {m.name: tuple(p for p in m.params if first_use[p] == i and wl.params[p].trainable)
            for i, m in enumerate(wl.modules)}


def trainable_numels(wl) -> list[int]:
    """numels of the optimized params in registration order (ZeRO-3's optimizer sub-groups)."""
    return [p.numel for p in wl.params if p.trainable]


# [Note: per-rank host loops] Three of ZeRO-3's host-side steps loop over every rank of the
# data-parallel group in Python, once per tensor, so their host time grows with the world size
# while the bytes each rank sends do not (DeepSpeed 0.19.8):
# - reduce_scatter_coalesced (runtime/comm/coalesced_collectives.py), per gradient bucket: a
#   slice view per rank of each gradient (partition_lst_for_each_tensor), then, unless the bucket
#   is one tensor that divides evenly, an interleaving pass over rank x tensor (append, numel,
#   padding check) whose list torch.cat consumes;
# - a coalesced all-gather of more than one param (partition_parameters.py _all_gather_dtype,
#   at launch): a narrow view per rank of the flat output buffer (`partitions`);
# - its handle's wait (AllGatherCoalescedHandle.wait, at the first use of any of its params):
#   per param, a narrow view per rank, list append and torch.cat of the pieces (plus, on a GPU,
#   record_stream of each piece).
# A single-param gather (the one-param path of all_gather_coalesced) and a divisible
# single-tensor bucket skip the second pass. The cost per view is the profile's
# (cpu.zero3_rank_view_us, measured by `zsim calibrate`: calibration/harness/bench_zero.py);
# the counts below are data. They run in the hooks, on the thread that launches the module's
# kernels, so they are charged before the compute op the hook belongs to.
def scatter_views(world: int, tensors: int, interleaved: bool) -> int:
    """Per-rank views of one reduce_scatter_coalesced call (see [Note: per-rank host loops])."""
    return world * tensors * (2 if interleaved else 1)


def coalesced_gather_views(world: int, params: int) -> tuple[int, int]:
    """(views at launch, views at the handle's wait) of a coalesced all-gather of `params` > 1
    params (see [Note: per-rank host loops])."""
    return world, world * params
