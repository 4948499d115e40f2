"""Writers: run JSON (deterministic) and Chrome/Perfetto trace. Files are written atomically
and never overwrite a file the user did not name."""
from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

from zsim.engine.ledger import timeline
from zsim.engine.sim import Trace
from zsim.hardware.placement import rank_of
from zsim.schedule.ir import STREAMS
from zsim.units import GiB


def _round(obj):
    """12 significant digits: stable across platforms' last-bit float differences. A whole
    number (a byte count, a capacity) stays exact: rounding 2 TiB to 12 digits would write a
    size no one allocated."""
    if isinstance(obj, float):
        if obj.is_integer() and abs(obj) < 2.0 ** 53:
            return obj
        return float(f"{obj:.12g}")
    if isinstance(obj, dict):
        return {k: _round(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_round(v) for v in obj]
    return obj


def dumps(obj: dict | list) -> str:
    """Deterministic JSON of plain data (a Result goes through Result.to_dict() first)."""
    return json.dumps(_round(obj), indent=2, sort_keys=True) + "\n"


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested result -> one level with dotted keys (CSV columns)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, list):
            out[key] = "; ".join(map(str, v))
        else:
            out[key] = v
    return out


def rows_csv(rows: list[dict]) -> str:
    """CSV with the union of the rows' keys as columns, in first-seen order."""
    import csv
    import io
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.12g}" if isinstance(v, float) else "; ".join(map(str, v)) if isinstance(v, list) else v)
                    for k, v in r.items()})
    return buf.getvalue()


def write_atomic(path: str | Path, text: str):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        # mkstemp makes the file 0600: give it the mode a plain open() would (the umask's), or the
        # replaced file's, so results stay readable where the user's files are
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode) if path.exists() else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)   # the only way to read it is to set it: put it back at once
    os.umask(mask)
    return mask


def save(path: str | Path, text: str):
    """Write an output the user named, atomically, and say so on stderr, including when an
    existing file is replaced (never silently). "-" is standard output, as Unix tools read it
    (with `zsim run --quiet --json -` the JSON alone)."""
    import sys
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    existed = Path(path).exists()
    write_atomic(path, text)
    print(f"{'replaced existing' if existed else 'wrote'} {path}", file=sys.stderr)


def chrome_trace(trace: Trace, name: str) -> dict:
    """Chrome trace-event format (also read by Perfetto): one thread per stream, a memory
    counter track from the ledger. Times in microseconds. A steady-state trace shows the
    micro-steps simulated, on the full step's clock: the ops of the repeated micro-step (or
    window from one micro-step's backward; a pipeline: of the repeated 1F1B period) are marked with the number of copies they stand for, and a "steady state" track spans
    the time of the copies not simulated. A pipeline has one process (track group) per stage,
    named after the stage's representative rank (and its model chunks under Megatron's
    interleaved schedule, whose sends name the chunk), each with its own memory counter."""
    repeat = trace.repeat
    shift = (lambda t: t) if repeat is None else repeat.shift_s
    layout = trace.schedule.pipeline
    stages = trace.schedule.stages
    events = []
    for stage in range(stages):
        rank = rank_of(stage, layout.data_parallel, tensor=trace.schedule.tensor) if layout else 0
        label = f"pipeline stage {stage}, rank {rank}" if layout else "rank 0"
        if layout and layout.virtual_stages > 1:   # Megatron's interleaved schedule: the stage's model chunks
            spans = layout.layers[stage::layout.stages]
            label += ", chunks " + ", ".join(f"{j}: layers {a}-{b - 1}" for j, (a, b) in enumerate(spans))
        events.append({"ph": "M", "pid": stage + 1, "tid": 0, "name": "process_name",
                       "args": {"name": f"zsim: {name} ({label})"}})
    tids = {s: i + 1 for i, s in enumerate(STREAMS)}
    used = {(op.pipe_stage, op.stream) for op in trace.schedule.ops}
    for stage in range(stages):
        for s in STREAMS:
            if (stage, s) in used:
                pid = stage + 1
                events.append({"ph": "M", "pid": pid, "tid": tids[s], "name": "thread_name",
                               "args": {"name": f"{s} stream"}})
                events.append({"ph": "M", "pid": pid, "tid": tids[s], "name": "thread_sort_index",
                               "args": {"sort_index": tids[s]}})
    for op, t in zip(trace.schedule.ops, trace.timings):
        args: dict[str, object] = {"phase": op.phase.value, "micro_step": op.micro_step}
        comm = op.comm
        if comm is not None:
            args.update(collective=comm.collective.value, numel=comm.numel, bytes=comm.size_bytes)
        if repeat is not None:
            args.update(repeat.marks(op))
        start, end = shift(t.start_s), shift(t.end_s)
        events.append({"ph": "X", "pid": op.pipe_stage + 1, "tid": tids[op.stream], "name": op.name,
                       "cat": "comm" if comm is not None else op.phase.value,
                       "ts": round(start * 1e6, 3), "dur": round((end - start) * 1e6, 3), "args": args})
    if repeat is not None:
        tid = len(STREAMS) + 1
        events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": "steady state"}})
        for what, start_s, length_s, period_s, copies in repeat.spans():
            events.append({"ph": "X", "pid": 1, "tid": tid, "cat": "steady state",
                           "name": f"{what} repeated {copies - 1} more times (not simulated)",
                           "ts": round(start_s * 1e6, 3), "dur": round(length_s * 1e6, 3),
                           "args": {"period_s": period_s, "copies": copies}})
    for stage, ledger_events in enumerate(trace.stage_ledger_events or (trace.ledger_events,)):
        # a repeated layer keeps its activations: the memory of the copies not simulated is added
        points = timeline(ledger_events) if repeat is None else repeat.timeline(ledger_events)
        for time_s, used_bytes in points:
            events.append({"ph": "C", "pid": stage + 1, "tid": 0, "name": "memory allocated",
                           "ts": round(time_s * 1e6, 3), "args": {"GiB": round(used_bytes / GiB, 6)}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def rlhf_trace_json(r, traces, name: str) -> str:
    """A PPO iteration's Chrome trace: an "iteration" process with its phases back to back (each
    its runs x its time), then one process per phase holding one run of it, op by op, placed where
    the phase starts."""
    events: list[dict] = [{"ph": "M", "pid": 1, "tid": 0, "name": "process_name",
                           "args": {"name": f"zsim: {name} (one PPO iteration, per GPU)"}},
                          {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "phases"}}]
    start = 0.0
    starts = {}
    for p in r.phases:
        starts[p.name] = start
        events.append({"ph": "X", "pid": 1, "tid": 1, "name": p.name, "cat": "phase", "ts": round(start * 1e6, 3),
                       "dur": round(p.total_s * 1e6, 3), "args": {"engine": p.engine, "runs": p.runs, "each_s": p.time_s,
                                                                  "peak_bytes": p.peak_bytes}})
        start += p.total_s
    for k, (phase, trace) in enumerate(traces):
        shift_us = starts[phase] * 1e6
        for e in chrome_trace(trace, f"{name}: {phase}, one run")["traceEvents"]:
            e = dict(e, pid=k + 2)
            if "ts" in e:
                e["ts"] = round(e["ts"] + shift_us, 3)
            events.append(e)
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, separators=(",", ":")) + "\n"


def trace_json(trace: Trace, name: str) -> str:
    return json.dumps(chrome_trace(trace, name), separators=(",", ":")) + "\n"
