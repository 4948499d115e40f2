"""Turn zsim's schedule for a scenario into the program the real training core executes.

Pure Python (no torch): the training core runs the simulator's schedule op by op, so the
collectives it issues are, by construction of this plan, the ones zsim predicts (and, through
tests/fixtures/deepspeed, the ones DeepSpeed 0.19.8 issues). The core still has to move the
right tensors: every call's numel is checked against the tensors actually communicated.

What the plan adds to the schedule:
- for every gradient-reduction call, the parameters of its IPG bucket (the schedule keeps only
  sizes), recovered by replaying the order in which gradients become ready (grads_ready_at,
  stage 2 hooks bias-before-weight, stage 3 weight-before-bias, stage 1 registration order at
  the boundary) and taking the prefix whose size equals the bucket's;
- for stage 1/2 `reduce` calls, the (param, start, length) pieces of each destination slice;
- for stage 3 gathers and releases, the param ids (from the ops' memory tags).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

ALIGNMENT = 2   # stage_1_and_2.py nccl_start_alignment_factor (as zsim/schedule/stage012.py)


class PlanError(Exception):
    """The schedule cannot be executed by the core (unsupported feature or inconsistent sizes)."""


@dataclass
class Bucket:
    id: int
    micro: int
    pids: list[int]
    numel: int                       # raw (stage 1/2) or padded (stage 3) elements
    calls: list[dict] = field(default_factory=list)   # {"op": index, "collective", "numel", "dst", "pieces"}


@dataclass
class Action:
    index: int                       # op index in the schedule
    name: str
    kind: str                        # fwd | bwd | gather | release-only | reduce | grads_allreduce |
    #                                  norm_local | overflow | norm_allreduce | adam | gather_updated | gather_persistent
    phase: str
    micro: int
    stream: str
    module: str = ""
    collective: str = ""
    numel: int = 0
    pids: tuple[int, ...] = ()       # gather: params; bwd: grads ready after it (in add order)
    releases: tuple[int, ...] = ()   # stage 3: params released after the op
    bucket: int = -1
    call: int = -1


@dataclass
class Plan:
    stage: int
    world: int
    numels: list[int]
    names: list[str]
    actions: list[Action]
    buckets: list[Bucket]
    persistent: tuple[int, ...]
    flat_padded: int                 # stage 1/2 flat 16-bit group (padded), stage 3: 0
    partition: int                   # stage 1/2 partition size, stage 3: shard size
    expected: list[tuple[str, str, int]]   # (phase, collective, numel) of one step, in order


def padded(numel: int, world: int) -> int:
    return int(math.ceil(numel / world)) * world


def flat_partition(numels: list[int], world: int) -> tuple[int, int]:
    total = sum(numels)
    unit = ALIGNMENT * world
    pad = int(math.ceil(total / unit) * unit)
    return pad, pad // world


def _slices(pids, offsets, numels, partition):
    """(rank, pid, start within param, length) pieces of a stage 1/2 bucket, bucket order."""
    out = []
    for pid in pids:
        start, end = offsets[pid], offsets[pid] + numels[pid]
        while start < end:
            rank = start // partition
            stop = min(end, (rank + 1) * partition)
            out.append((rank, pid, start - offsets[pid], stop - start))
            start = stop
    return out


def _grads_ready_at(wl) -> dict[str, tuple[int, ...]]:
    first_use: dict[int, int] = {}
    for i, m in enumerate(wl.modules):
        for pid in m.params:
            first_use.setdefault(pid, i)
    return {m.name: tuple(p for p in m.params if first_use[p] == i) for i, m in enumerate(wl.modules)}


def _tag_pid(tag: str) -> int | None:
    if tag.startswith("gathered/"):
        return int(tag.rsplit("/", 1)[1])
    return None


def unsupported(sc) -> str | None:
    """Why the core cannot run this scenario (None when it can)."""
    if sc.training.activation_checkpointing != "none":
        return "training.activation_checkpointing (the core runs without checkpointing; set none)"
    if sc.precision == "fp16":
        return "training.precision fp16 (no fp16 on CPU; use bf16 or fp32)"
    if sc.model.position not in ("learned",):
        return f"model.position {sc.model.position} (the core implements learned positions)"
    if sc.zero.optimizer_offload_device != "none" or getattr(sc.zero, "param_offload_device", "none") != "none":
        return "deepspeed.zero_optimization offload (no device/host split on CPU)"
    if sc.deepspeed.uses_bf16_optimizer:
        return "data_types.grad_accum_dtype fp32 with stage 1 (BF16_Optimizer)"
    if sc.training.dropout:
        return "training.dropout (the core is deterministic, no dropout)"
    return None


def build_plan(sc) -> Plan:
    from zsim.schedule.build import build_schedule

    why = unsupported(sc)
    if why:
        raise PlanError(why)
    wl, sched = build_schedule(sc)
    stage, world = sc.zero.stage, sc.cluster.world_size
    numels = [p.numel for p in wl.params]
    names = [p.name for p in wl.params]
    offsets, acc = [], 0
    for n in numels:
        offsets.append(acc)
        acc += n
    ready = _grads_ready_at(wl)
    modules = {m.name: m for m in wl.modules}
    z = sc.zero
    if stage == 3:
        flat_pad, part = 0, sum(math.ceil(n / world) for n in numels)
    else:
        flat_pad, part = flat_partition(numels, world)
    persistent = ()
    if stage == 3:
        total, pers = 0, []
        for pid, n in enumerate(numels):
            if n <= z.param_persistence_threshold and total + n <= z.model_persistence_threshold:
                pers.append(pid)
                total += n
        persistent = tuple(pers)
    # when gradients enter buckets
    hooks = stage in (2, 3) or (stage == 1 and z.overlap)
    last_bwd = {}
    for op in sched.ops:
        if op.stream == "compute" and op.phase == "backward" and op.name.startswith("backward "):
            last_bwd[op.micro_step] = op.id
    gas = sc.gradient_accumulation_steps

    actions: list[Action] = []
    buckets: list[Bucket] = []
    pending: list[int] = []
    group_key = None
    name_to_pid = {n: i for i, n in enumerate(names)}
    for op in sched.ops:
        if op.transfer or op.cpu_adam_params:
            raise PlanError(f"op '{op.name}' (offload) is not executable on this machine")
        releases = tuple(p for p in (_tag_pid(t) for t in op.free) if p is not None)
        a = Action(op.id, op.name, "", op.phase, op.micro_step, op.stream, collective=op.collective,
                   numel=op.numel, releases=releases)
        if not op.collective:
            if op.name.startswith(("forward ", "backward ")):
                kind, _, mod = op.name.partition(" ")
                a.kind, a.module = ("fwd" if kind == "forward" else "bwd"), mod
                if mod not in modules:
                    raise PlanError(f"unknown module in op '{op.name}'")
                if a.kind == "bwd":
                    r = ready[mod]
                    if stage == 3:
                        add = r
                    elif hooks and (stage == 2 or op.micro_step == gas - 1):
                        add = tuple(reversed(r))
                    else:
                        add = ()
                    if stage == 1 and not hooks and op.micro_step == gas - 1 and op.id == last_bwd[op.micro_step]:
                        add = tuple(range(len(numels)))      # reduce_gradients: registration order
                    a.pids = add
                    if stage != 0:
                        pending.extend(add)
            elif op.name == "grad norm (local)":
                a.kind = "norm_local"
            elif op.name.startswith("optimizer step"):
                a.kind = "adam"
            else:
                raise PlanError(f"op '{op.name}' is not executable by the core")
            group_key = None
        else:
            nm = op.name
            if nm == "overflow check":
                a.kind = "overflow"
            elif nm == "grad norm all-reduce":
                a.kind = "norm_allreduce"
            elif nm == "all-gather updated params":
                a.kind = "gather_updated"
            elif nm.startswith("all-gather persistent "):
                a.kind = "gather_persistent"
                a.pids = (name_to_pid[nm[len("all-gather persistent "):]],)
            elif nm.startswith("all-gather "):
                a.kind = "gather"
                a.pids = tuple(p for p in (_tag_pid(al.tag) for al in op.alloc) if p is not None)
                if sum(padded(numels[p], world) for p in a.pids) != op.numel:
                    raise PlanError(f"gather '{nm}': params do not add up to {op.numel}")
            elif nm.startswith("allreduce gradients"):
                a.kind = "grads_allreduce"
            elif " bucket " in nm:
                a.kind = "reduce"
                key = (op.micro_step, nm.split(" -> ")[0])
                if key != group_key:
                    # a new bucket: take the pending prefix whose size equals the group's total
                    group = [o for o in sched.ops[op.id:] if o.collective and o.micro_step == op.micro_step
                             and o.name.split(" -> ")[0] == key[1]]
                    total = sum(o.numel for o in group)
                    size = (lambda p: padded(numels[p], world)) if stage == 3 else (lambda p: numels[p])
                    take, s = [], 0
                    while pending and s < total:
                        p = pending.pop(0)
                        take.append(p)
                        s += size(p)
                    if s != total:
                        raise PlanError(f"bucket '{nm}' (micro {op.micro_step}): grads add up to {s}, "
                                        f"schedule says {total}")
                    buckets.append(Bucket(len(buckets), op.micro_step, take, total))
                    group_key = key
                    if stage in (1, 2) and op.collective == "reduce":
                        sl = _slices(take, offsets, numels, part)
                        b = buckets[-1]
                        b.slices = sl
                b = buckets[-1]
                call = {"op": op.id, "collective": op.collective, "numel": op.numel, "dst": None}
                if op.collective == "reduce":
                    call["dst"] = int(nm.rsplit(" ", 1)[1])
                b.calls.append(call)
                a.bucket, a.call = b.id, len(b.calls) - 1
            else:
                raise PlanError(f"collective op '{nm}' is not executable by the core")
            if a.kind != "reduce":
                group_key = None
        actions.append(a)
    # pieces of per-destination reduce calls (consecutive slices of one rank, chunked by size)
    for b in buckets:
        if not any(c["collective"] == "reduce" for c in b.calls):
            continue
        by_rank: dict[int, list] = {}
        for piece in b.slices:
            by_rank.setdefault(piece[0], []).append(piece)
        for c in b.calls:
            pieces, s = [], 0
            lst = by_rank[c["dst"]]
            while lst and s < c["numel"]:
                piece = lst.pop(0)
                pieces.append(piece)
                s += piece[3]
            if s != c["numel"]:
                raise PlanError(f"reduce call of {c['numel']} to rank {c['dst']} does not match its slices")
            c["pieces"] = pieces
    if pending:
        raise PlanError(f"{len(pending)} gradients never reduced")
    phase = {"forward": "forward", "recompute": "backward", "backward": "backward", "step": "step"}
    expected = [(phase[op.phase], op.collective, op.numel) for op in sched.ops if op.collective]
    return Plan(stage, world, numels, names, actions, buckets, persistent, flat_pad, part, expected)
