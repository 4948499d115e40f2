"""zsim's schedule for a scenario, ready for the training core to execute op by op.

Pure Python (no torch). The core runs the simulator's schedule itself, so the collectives it
issues are, by construction, the ones zsim predicts (and, through tests/fixtures/deepspeed,
the ones DeepSpeed 0.19.8 issues). The schedule's ops are typed (zsim/schedule/ir.py): each
kind says what the core must do and its payload carries the parameter ids, bucket and call,
so nothing here parses a label. What the plan adds is an index over the ops: the buckets with
their calls (and, for per-rank `reduce` calls, the pieces each carries, cut by zsim's own
partition rules) and the params each op releases. The core still has to move the right
tensors: every call's numel is checked against the tensors actually communicated.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zsim.schedule.ir import Buffer, Collective, MEASURED_PASS, Op, OpKind, Stream
from zsim.schedule.payloads import GradReduce
from zsim.schedule.moe import gathered_groups, moe_param_groups
from zsim.schedule.partition import FlatGroup, bucket_pieces, padded, persistent_params, shard_numel

# what the core executes; anything else (offload copies, the CPU optimizer) it cannot run here
EXECUTABLE = frozenset({OpKind.FORWARD, OpKind.BACKWARD, OpKind.PARAM_GATHER, OpKind.PERSISTENT_GATHER,
                        OpKind.UPDATED_GATHER, OpKind.BUCKET_REDUCE, OpKind.GRAD_ALLREDUCE, OpKind.GRAD_NORM,
                        OpKind.OVERFLOW_ALLREDUCE, OpKind.NORM_ALLREDUCE, OpKind.OPTIMIZER_STEP,
                        OpKind.EXPERT_ALL_TO_ALL})


class PlanError(Exception):
    """The schedule cannot be executed by the core (unsupported feature or inconsistent sizes)."""


@dataclass
class Bucket:
    id: int
    micro: int
    pids: tuple[int, ...]
    numel: int                       # raw (stage 1/2) or padded (stage 3) elements
    calls: list[GradReduce] = field(default_factory=list)
    # per call of a `reduce` bucket, or of any bucket over several flat groups: (rank, pid, start, elements)
    pieces: list[list[tuple[int, int, int, int]]] = field(default_factory=list)


@dataclass
class Plan:
    stage: int
    world: int
    numels: list[int]
    trainable: list[bool]            # requires_grad (see [Note: frozen parameters under ZeRO])
    names: list[str]
    ops: tuple[Op, ...]
    releases: dict[int, tuple[int, ...]]     # op id -> params released after it (ZeRO-3)
    buckets: dict[int, Bucket]
    persistent: tuple[int, ...]
    flat_padded: int                 # stage 1/2 flat 16-bit groups (padded, all), stage 3: 0
    partition: int                   # stage 1/2 partitions of all groups, stage 3: shard size
    expected: list[tuple[str, str, int]]   # (phase, collective, numel) of one step, in order
    groups: list[FlatGroup] = field(default_factory=list)   # stage 1/2: see [Note: MoE parameter groups]
    gather_group: dict[int, int] = field(default_factory=dict)   # UPDATED_GATHER op id -> its flat group


def unsupported(sc) -> str | None:
    """Why the core cannot run this scenario (None when it can)."""
    if sc.sequence_parallel_size > 1:
        return "parallelism.sequence (the core has no Ulysses exchanges; validate it with --engine deepspeed)"
    if sc.training.activation_checkpointing != "none":
        return "training.activation_checkpointing (the core runs without checkpointing; set none)"
    if sc.precision == "fp16":
        return "training.precision fp16 (no fp16 on CPU; use bf16 or fp32)"
    if sc.model.mamba is not None:
        return "model.mamba (the core has no Mamba mixer)"
    if sc.model.position not in ("learned",):
        return f"model.position {sc.model.position} (the core implements learned positions)"
    if sc.zero.offloaded:
        return "deepspeed.zero_optimization offload (no device/host split on CPU)"
    if sc.deepspeed.reduction_dtype != sc.precision:
        return "deepspeed.communication_data_type other than the model dtype (the core reduces in the model dtype)"
    if sc.deepspeed.uses_bf16_optimizer:
        return "data_types.grad_accum_dtype fp32 with stage 1 (BF16_Optimizer)"   # see [Note: BF16_Optimizer]
    if sc.training.dropout:
        return "training.dropout (the core is deterministic, no dropout)"
    if sc.training.gradient_accumulation_fusion:
        return "training.gradient_accumulation_fusion (Megatron-LM's fused wgrad accumulation; the core adds into .grad)"
    if sc.training.lora is not None and sc.training.lora.dropout > 0:
        return "training.lora.dropout (the core is deterministic, no dropout)"
    if sc.training.fp8 or sc.training.fused_linear_cross_entropy or sc.training.tiled_mlp:
        return "training.fp8, fused_linear_cross_entropy or tiled_mlp (the core runs plain linears and loss)"
    moe = sc.model.moe
    if moe is not None:
        if sc.zero.stage not in (1, 2):
            return "model.moe with ZeRO stage 0 or 3 (the core runs DeepSpeed-MoE under ZeRO-1/2)"
        if moe.dispatch != "capacity" or not moe.drop_tokens or moe.shared_experts or moe.use_residual:
            return "model.moe other than DeepSpeed-MoE's capacity dispatch with drop_tokens, no shared experts"
        if sc.training.lora is not None or sc.training.frozen:
            # not validated: the unsharded reference names experts globally where a rank's
            # workload names its local ones, and LoRA adapters on experts are not mirrored
            return "model.moe with training.lora or training.frozen (not validated on the core)"
    return None


def _call_pieces(bucket: Bucket, groups: list[FlatGroup], numels: list[int]):
    """The (rank, pid, start, elements) pieces each call carries: a per-rank `reduce` call the
    bucket's pieces for its destination in its flat group, an all-reduce its group's pieces, in
    bucket order, up to the call's size."""
    group_of = {pid: g for g, group in enumerate(groups) for pid in group.pids}
    by_key: dict[tuple[int, int], list] = {}
    reduce = bucket.calls[0].comm.collective == Collective.REDUCE
    for pid in bucket.pids:
        g = groups[group_of[pid]]
        for piece in bucket_pieces((pid,), g.starts, numels, g.partition):
            by_key.setdefault((group_of[pid], piece[0] if reduce else -1), []).append(piece)
    for call in bucket.calls:
        pieces, total = [], 0
        queue = by_key.get((call.flat_group, call.dst if reduce else -1), [])
        while queue and total < call.comm.numel:
            piece = queue.pop(0)
            pieces.append(piece)
            total += piece[3]
        if total != call.comm.numel:
            raise PlanError(f"reduce call of {call.comm.numel} to rank {call.dst} does not match its slices")
        bucket.pieces.append(pieces)


def build_plan(sc) -> Plan:
    from zsim.schedule.build import build_schedule

    why = unsupported(sc)
    if why:
        raise PlanError(why)
    wl, sched = build_schedule(sc)
    return plan_for(sc, wl, sched.ops, sc.cluster.world_size)


def plan_for(sc, wl, ops, world: int, executable=EXECUTABLE) -> Plan:
    """The plan of `ops` over `wl`'s params, partitioned over `world` ranks (a pipeline stage's
    ops over its slice of the model and its data-parallel group: calibration/core/pipe.py)."""
    stage = sc.zero.stage
    numels = [p.numel for p in wl.params]
    z = sc.zero
    groups = moe_param_groups(sc, wl, world) if stage < 3 else []
    if stage == 3:
        flat_pad, part = 0, shard_numel(numels, world)
        persistent = persistent_params(numels, z.param_persistence_threshold, z.model_persistence_threshold)
    else:   # the flat groups hold the trainable params only (see partition.flat_groups)
        flat_pad, part, persistent = sum(g.padded for g in groups), sum(g.partition for g in groups), ()
    gather_group = dict(zip((o.id for o in ops if o.kind == OpKind.UPDATED_GATHER), gathered_groups(groups)))
    buckets: dict[int, Bucket] = {}
    releases: dict[int, tuple[int, ...]] = {}
    bucketed: list[int] = []
    for op in ops:
        if op.kind not in executable or op.stream not in (Stream.COMPUTE, Stream.ALLGATHER, Stream.REDUCE):
            raise PlanError(f"op '{op.name}' ({op.kind.value}) is not executable by the core")
        gathered = tuple(t.key for t in op.free if t.buffer == Buffer.GATHERED)
        if gathered:
            releases[op.id] = gathered
        if op.kind == OpKind.BACKWARD:
            bucketed.extend(op.payload.bucketed)
        elif op.kind == OpKind.PARAM_GATHER:
            if sum(padded(numels[p], world) for p in op.payload.pids) != op.comm.numel:
                raise PlanError(f"gather '{op.name}': params do not add up to {op.comm.numel}")
        elif op.kind == OpKind.BUCKET_REDUCE:
            p = op.payload
            if p.bucket not in buckets:
                size = (lambda q: padded(numels[q], world)) if stage == 3 else (lambda q: numels[q])
                if tuple(bucketed[:len(p.pids)]) != p.pids:
                    raise PlanError(f"bucket {p.bucket} (micro {op.micro_step}): its params are not the next "
                                    f"gradients the hooks bucketed")
                del bucketed[:len(p.pids)]
                buckets[p.bucket] = Bucket(p.bucket, op.micro_step, p.pids, sum(size(q) for q in p.pids))
            buckets[p.bucket].calls.append(p)
    if bucketed:
        raise PlanError(f"{len(bucketed)} gradients never reduced")
    if stage == 3 and sum(op.kind == OpKind.OPTIMIZER_STEP for op in ops) > 1:
        # see [Note: ZeRO-3 optimizer sub-groups]: the core keeps one fp32 master of the shard
        # (ZeRO-1/2 step each flat group on its own, calibration/core/step.py)
        raise PlanError(f"deepspeed.zero_optimization.sub_group_size {z.sub_group_size:g} splits this rank's shard "
                        f"of {part} elements into optimizer sub-groups; the core steps the shard at once "
                        f"(set sub_group_size to at least {part})")
    for b in buckets.values():
        total = sum(c.comm.numel for c in b.calls)
        if total != b.numel:
            raise PlanError(f"bucket {b.id} (micro {b.micro}): grads add up to {b.numel}, calls to {total}")
        if b.calls[0].comm.collective == Collective.REDUCE or (len(groups) > 1 and z.reduce_scatter):
            _call_pieces(b, groups, numels)
    expected = [(MEASURED_PASS[op.phase], op.comm.collective.value, op.comm.numel) for op in ops if op.comm]
    return Plan(stage, world, numels, [p.trainable for p in wl.params], [p.name for p in wl.params], tuple(ops),
                releases, buckets, persistent, flat_pad, part, expected, groups, gather_group)
