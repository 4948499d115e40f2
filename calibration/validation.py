"""Measured vs predicted: the pure half of `zsim validate` (no torch).

The measured side comes from calibration/core/run.py (JSON); the predicted side from
zsim.api.run_scenario on the same scenario. Errors are signed, relative to the measurement:
(predicted - measured) / measured.
"""
from __future__ import annotations

from zsim.schedule.ir import MEASURED_PASS, Group, OpKind, Schedule

PHASES = ("forward", "backward", "step")

# What the comparison changes in the scenario: the measured peak counts tensors only (as
# torch.cuda.max_memory_allocated does), so the simulator's CUDA context and allocator reserve
# are set to zero on the predicted side.
TENSOR_ONLY_OVERRIDES = ("hardware.override.gpu.cuda_context_GiB=0",
                         "hardware.override.gpu.allocator_fragmentation_fraction=0")


def prediction_overrides(profile: str, nproc: int) -> tuple[str, ...]:
    """What `zsim validate` sets on the scenario it predicts: the measured profile, one node of
    the launched ranks, and the tensor-only memory of a torch run (no CUDA context, no
    allocator reserve)."""
    return (f"hardware.profile={profile}", "hardware.nodes=1", f"hardware.gpus_per_node={nproc}",
            *TENSOR_ONLY_OVERRIDES)


def rel_error(predicted: float, measured: float) -> float | None:
    if not measured:
        return None
    return (predicted - measured) / measured


def mape(errors) -> float | None:
    errs = [abs(e) for e in errors if e is not None]
    return sum(errs) / len(errs) if errs else None


def schedule_collectives(schedule: Schedule) -> list[tuple[str, str, int]]:
    """(phase, collective, numel) of one step, in issue order (the measured list's format)."""
    return [(MEASURED_PASS[op.phase], op.comm.collective.value, int(op.comm.numel)) for op in schedule.ops if op.comm]


# a pipeline's point-to-point transfers (DeepSpeed's pipe/p2p.py send / recv), as the core logs them
P2P_CALLS = {OpKind.SEND_ACTIVATION: "send", OpKind.SEND_GRAD: "send", OpKind.RECV_ACTIVATION: "recv",
             OpKind.RECV_GRAD: "recv"}


def stage_calls(schedule: Schedule, stage: int, element_bytes: int,
                tensor_and_pipe: bool = False) -> list[tuple[str, str, int, int]]:
    """(phase, collective or send/recv, numel, bytes) of one pipeline stage's rank, in issue
    order; a transfer's numel is its activation (or gradient) elements of `element_bytes` each
    (a PartitionedTensor meta's: int64). `tensor_and_pipe`: only the tensor-parallel group's
    calls, the data-parallel gradient all-reduce and the pipeline's transfers (what the core's
    tensor-parallel runner checks, see tensor_and_pipe_calls)."""
    out = []
    for op in schedule.ops:
        if op.pipe_stage != stage:
            continue
        if tensor_and_pipe and op.kind not in P2P_CALLS and op.kind != OpKind.GRAD_ALLREDUCE and not (
                op.comm and op.comm.group is not None and op.comm.group.kind == Group.TENSOR):
            continue
        if op.kind in P2P_CALLS:
            size = int(op.payload.size_bytes)   # DeepSpeed's PartitionedTensor meta is int64
            out.append((MEASURED_PASS[op.phase], P2P_CALLS[op.kind], size // (8 if op.payload.meta else element_bytes),
                        size))
        elif op.comm:
            out.append((MEASURED_PASS[op.phase], op.comm.collective.value, int(op.comm.numel), int(op.comm.size_bytes)))
    return out


def tensor_and_pipe_calls(calls) -> list[list]:
    """The core's tensor-parallel runner logs (phase, call, numel, bytes, group): the calls of its
    `tensor` group, its `data` group (ZeRO-0's gradient all-reduce) and its `pipe` transfers, as
    stage_calls(tensor_and_pipe=True) lists them. Its step's scalar calls (the gradient norm)
    are Megatron's, not the DeepSpeed engine's zsim schedules, so those are not compared."""
    return [list(c[:4]) for c in calls if c[4] in ("tensor", "data", "pipe")]


def collective_summary(calls, element_bytes: dict[int, int] | None = None) -> dict[str, dict]:
    """{collective: {count, numel}} from (phase, collective, numel[, bytes]) entries."""
    out: dict[str, dict] = {}
    for c in calls:
        kind, numel = c[1], int(c[2])
        e = out.setdefault(kind, {"count": 0, "numel": 0, "bytes": 0})
        e["count"] += 1
        e["numel"] += numel
        e["bytes"] += int(c[3]) if len(c) > 3 else 0
    return dict(sorted(out.items()))


def schedule_summary(schedule: Schedule) -> dict[str, dict]:
    return collective_summary([(MEASURED_PASS[op.phase], op.comm.collective.value, int(op.comm.numel),
                                int(op.comm.size_bytes)) for op in schedule.ops if op.comm])


def phase_times(schedule: Schedule, timings) -> dict[str, float]:
    """Busy time of each phase in the simulated step: length of the union of its ops' intervals."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for op, t in zip(schedule.ops, timings):
        spans.setdefault(MEASURED_PASS[op.phase], []).append((t.start_s, t.end_s))
    out = {}
    for ph, iv in spans.items():
        iv.sort()
        total, cur_s, cur_e = 0.0, None, None
        for s, e in iv:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
        out[ph] = total
    return out


def first_difference(a, b) -> dict | None:
    """Where two collective lists part (None when equal)."""
    a, b = [tuple(x[:3]) for x in a], [tuple(x[:3]) for x in b]
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return {"index": i, "measured": list(x), "predicted": list(y)}
    i = min(len(a), len(b))
    return {"index": i, "measured": list(a[i]) if i < len(a) else None,
            "predicted": list(b[i]) if i < len(b) else None}


def compare(measured: dict, predicted: dict) -> dict:
    """The validate report: both sides, and the error of every figure."""
    err = {"step_time": rel_error(predicted["step_time_s"], measured["step_time_s"]),
           "peak_bytes": rel_error(predicted["peak_bytes"], measured["peak_bytes"]) if measured.get("peak_bytes") else None,
           "phases": {p: rel_error(predicted["phases_s"].get(p, 0.0), measured["phases_s"].get(p, 0.0))
                      for p in PHASES if p in measured.get("phases_s", {})}}
    mc, pc = measured.get("collectives_summary", {}), predicted.get("collectives_summary", {})
    err["collectives"] = {k: {"count": rel_error(pc.get(k, {}).get("count", 0), mc.get(k, {}).get("count", 0)),
                              "bytes": rel_error(pc.get(k, {}).get("bytes", 0), mc.get(k, {}).get("bytes", 0))}
                          for k in sorted(set(mc) | set(pc))}
    diff = first_difference(measured.get("collectives", []), predicted.get("collectives", []))
    per_rank, per_stage = measured.get("collectives_per_rank"), predicted.get("collectives_per_stage")
    if per_rank and per_stage:   # a pipeline: every rank against its stage (rank = stage * dp + dp_rank)
        dp = len(per_rank) // len(per_stage)
        diff = next(({"rank": r, **d} for r, calls in enumerate(per_rank)
                     if (d := first_difference(calls, per_stage[r // dp]))), None)
    return {"measured": measured, "predicted": predicted, "error": err,
            "collectives_equal": diff is None, "collectives_first_difference": diff}


def _pct(e):
    return "-" if e is None else f"{100 * e:+.1f}%"


def _fmt_s(x):
    return f"{x * 1e3:.2f} ms"


def _fmt_b(x):
    return f"{x / 2**20:.2f} MiB"


def table_rows(report: dict) -> list[tuple[str, str, str, str]]:
    m, p, e = report["measured"], report["predicted"], report["error"]
    spread = m.get("step_time_spread")
    rows = [("step time", _fmt_s(m["step_time_s"]) + (f" (spread {100 * spread:.1f}%)" if spread is not None else ""),
             _fmt_s(p["step_time_s"]), _pct(e["step_time"]))]
    for ph in PHASES:
        if ph in m.get("phases_s", {}):
            rows.append((f"  {ph}", _fmt_s(m["phases_s"][ph]), _fmt_s(p["phases_s"].get(ph, 0.0)), _pct(e["phases"][ph])))
    rows.append(("peak memory (tensors)", _fmt_b(m["peak_bytes"]) if m.get("peak_bytes") else "-",
                 _fmt_b(p["peak_bytes"]), _pct(e["peak_bytes"])))
    mc, pc = m.get("collectives_summary", {}), p.get("collectives_summary", {})
    for k, v in e["collectives"].items():
        a, b = mc.get(k, {}), pc.get(k, {})
        rows.append((f"{k} calls", str(a.get("count", 0)), str(b.get("count", 0)), _pct(v["count"])))
        rows.append((f"{k} bytes", _fmt_b(a.get("bytes", 0)), _fmt_b(b.get("bytes", 0)), _pct(v["bytes"])))
    rows.append(("collective list", f"{len(m.get('collectives', []))} calls", f"{len(p.get('collectives', []))} calls",
                 "equal" if report["collectives_equal"] else _where(report["collectives_first_difference"])))
    return rows


def _where(diff: dict) -> str:
    return f"differs at #{diff['index']}" + (f" on rank {diff['rank']}" if "rank" in diff else "")


def render_text(report: dict) -> str:
    rows = [("", "measured", "predicted", "error")] + table_rows(report)
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
