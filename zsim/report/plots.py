"""Plots (matplotlib, Agg). They read result rows / run JSON / traces only, never the simulator."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from zsim.errors import ZsimInputError  # noqa: E402
from zsim.inputs import parse_json, read_text  # noqa: E402
from zsim.result import ZERO3_RANK_LOOPS, row_fits  # noqa: E402
from zsim.units import GiB  # noqa: E402

FORMATS = (".png", ".svg")
# tab20 is a ListedColormap: its 20 RGB tuples (matplotlib's stubs type Colormap without them)
PALETTE = plt.get_cmap("tab20").colors   # type: ignore[attr-defined]


def check_image_path(path: str, field: str):
    if Path(path).suffix.lower() not in FORMATS:
        raise ZsimInputError(field, path, "give a .png or .svg path")


def _save(fig, path: str):
    """Atomic image write; says on stderr whether it replaced an existing file."""
    import sys
    out = Path(path)
    print(f"{'replaced existing' if out.exists() else 'wrote'} {path}", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{out.suffix}")
    fig.savefig(tmp, dpi=130, bbox_inches="tight", metadata={"Software": "zsim"} if out.suffix == ".png" else None)
    plt.close(fig)
    tmp.replace(out)


def _failed(r: dict) -> bool:
    return not r.get("ok", True) or bool(r.get("error"))


def failed_points(rows: list[dict]) -> list[dict]:
    """[{label, error}] of the rows that could not be simulated (a sweep's failed points, a
    compare's invalid variants): every plot of rows marks them instead of dropping them."""
    if not isinstance(rows, list):
        return []
    keys = varied_keys(rows)
    return [{"label": _label(r, keys), "error": str(r.get("error") or "failed")} for r in rows
            if isinstance(r, dict) and _failed(r)]


def _note_failed(fig, failed: list[dict]):
    """The failed points and their reasons under the figure, in red (bbox_inches="tight" keeps it)."""
    import textwrap
    if not failed:
        return
    lines = [f"{len(failed)} point{'s' if len(failed) > 1 else ''} failed (not simulated):"]
    lines += [line for f in failed[:8] for line in textwrap.wrap(f"{f['label']}: {f['error']}", 110,
                                                                   subsequent_indent="    ")]
    if len(failed) > 8:
        lines.append(f"... and {len(failed) - 8} more (the sweep's JSON/CSV 'error' column has each reason)")
    fig.text(0.01, -0.02, "\n".join(lines), fontsize=7, color="red", va="top", ha="left")


def _category_colors(categories):
    return {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(categories)}


def compare_data(rows: list[dict]) -> dict:
    """The numbers behind the compare figure: throughput per (stage, offload mode) and the
    memory breakdown per variant."""
    modes = list(dict.fromkeys(r["offload"] for r in rows))
    stages = sorted({r["stage"] for r in rows})
    bars = {m: [next((r.get("tokens_per_s_per_gpu", 0.0) if not r.get("error") else 0.0
                      for r in rows if r["stage"] == s and r["offload"] == m), None) for s in stages] for m in modes}
    return {"stages": stages, "modes": modes, "throughput": bars,
            "memory": [(r["variant"], r.get("breakdown", {}), r.get("capacity_bytes"), r.get("fits", False))
                       for r in rows if not r.get("error")]}


def compare_plot(rows: list[dict], title: str, path: str):
    data = compare_data(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1, 1.4]})
    n = len(data["modes"])
    width = 0.8 / n
    for i, mode in enumerate(data["modes"]):
        xs = [s + (i - (n - 1) / 2) * width for s in data["stages"]]
        vals = data["throughput"][mode]
        ax1.bar([x for x, v in zip(xs, vals) if v is not None], [v for v in vals if v is not None],
                width, label=f"offload: {mode}", color=PALETTE[2 * i])
    for r in rows:
        if not r.get("error") and not r.get("fits"):
            i = data["modes"].index(r["offload"])
            ax1.annotate("OOM", (r["stage"] + (i - (n - 1) / 2) * width, r["tokens_per_s_per_gpu"]),
                         ha="center", va="bottom", fontsize=7, color="red")
        if r.get("winner"):
            i = data["modes"].index(r["offload"])
            ax1.annotate("best", (r["stage"] + (i - (n - 1) / 2) * width, r["tokens_per_s_per_gpu"]),
                         ha="center", va="bottom", fontsize=8, fontweight="bold", color="green")
    ax1.set_xticks(data["stages"], [f"ZeRO-{s}" for s in data["stages"]])
    ax1.set_ylabel("tokens/s per GPU")
    ax1.set_title("Throughput by stage and offload")
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)
    cats = sorted({c for _, b, _, _ in data["memory"] for c in b})
    colors = _category_colors(cats)
    labels = [v for v, _, _, _ in data["memory"]]
    bottoms = [0.0] * len(labels)
    for c in cats:
        vals = [b.get(c, 0.0) / GiB for _, b, _, _ in data["memory"]]
        ax2.bar(range(len(labels)), vals, bottom=bottoms, color=colors[c], label=c)
        bottoms = [x + y for x, y in zip(bottoms, vals)]
    caps = [cap for _, _, cap, _ in data["memory"] if cap]
    if caps:
        ax2.axhline(caps[0] / GiB, color="black", linestyle="--", linewidth=1.2, label="HBM capacity")
    ax2.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax2.set_ylabel("GiB per GPU at peak")
    ax2.set_title("Memory breakdown vs capacity")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    _save(fig, path)


# ---- zsim plot: inputs -----------------------------------------------------------------

def _num(v):
    if isinstance(v, str):
        if v in ("True", "False"):
            return v == "True"
        try:
            f = float(v)
            return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
        except ValueError:
            return v
    return v


def load_results(path: str):
    """('rows', [flat dicts]) for sweep CSV/JSON or compare JSON, ('run', dict) for a run
    JSON, ('trace', dict) for a Chrome trace written by zsim run --trace."""
    import csv
    p = Path(path)
    text = read_text(p, "RESULTS", "a sweep CSV/JSON, a compare or run JSON or a trace")
    if p.suffix.lower() == ".csv":
        rows = [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(text.splitlines())]
        return "rows", rows
    data = parse_json(text, "RESULTS", path)
    if isinstance(data, list):
        if not all(isinstance(r, dict) for r in data):
            raise ZsimInputError("RESULTS", path, "a results list holds one mapping per row; give a zsim sweep or "
                                 "compare JSON")
        from zsim.report.writers import flatten
        return "rows", [flatten(r) if "memory" in r else r for r in data]
    if isinstance(data, dict) and "traceEvents" in data:
        return "trace", data
    if isinstance(data, dict) and "step_time_s" in data:
        return "run", data
    raise ZsimInputError("RESULTS", path, "not a zsim sweep, compare, run or trace file")


def _need(kind: str, have: str, want: tuple[str, ...]):
    if have not in want:
        raise ZsimInputError("--kind", kind, f"needs {' or '.join(want)} results, got a {have} file")


# ---- scaling ---------------------------------------------------------------------------

HPZ_KEY = "deepspeed.zero_optimization.zero_hpz_partition_size"


def _curve(r: dict) -> int | str:
    """A scaling curve's key: the ZeRO stage, or at stage 3 with ZeRO++ hpZ swept "3 + hpZ h"
    (drawn as ZeRO-<key>)."""
    stage, hpz = int(r["stage"]), r.get(HPZ_KEY)
    if stage == 3 and isinstance(hpz, (int, float)) and hpz > 1:
        return f"3 + hpZ {int(hpz)}"
    return stage


def scaling_data(rows: list[dict]) -> dict:
    """Per stage (ZeRO-3 with and without hpZ apart, where a sweep varies it): the best
    configuration at each GPU count (the fitting one with the most tokens/s; if none fits, the
    fastest, flagged OOM)."""
    curves: dict[int | str, list[dict]] = {}
    for r in rows:
        if not r.get("ok", True) or "world_size" not in r:
            continue
        curves.setdefault(_curve(r), []).append(r)
    out = {}
    for stage, rs in sorted(curves.items(), key=lambda kv: str(kv[0])):
        pts = []
        for ws in sorted({int(r["world_size"]) for r in rs}):
            at = [r for r in rs if int(r["world_size"]) == ws]
            ok = [r for r in at if row_fits(r)]
            best = max(ok or at, key=lambda r: r["tokens_per_s"])
            comm_s = sum(v for k, v in best.items() if k.startswith("comm.time_s.") and isinstance(v, (int, float)))
            pts.append({"gpus": ws, "tokens_per_s": best["tokens_per_s"],
                        "tokens_per_s_per_gpu": best["tokens_per_s_per_gpu"], "oom": not ok,
                        "compute_s": best.get("compute_time_s"), "comm_s": comm_s,
                        "exposed_s": best.get("comm.exposed_time_s"),
                        "host_loops_s": best.get(f"host_time_s.{ZERO3_RANK_LOOPS}")})
        out[stage] = pts
    if not out:
        raise ZsimInputError("RESULTS", "rows", "no successful points with world_size; sweep hardware.nodes")
    return out


def _hiding_panel(ax, data: dict):
    """Compute vs communication busy time per GPU per step: communication stops hiding where
    its busy time passes the compute (marked), and the exposed part starts to grow."""
    for i, (stage, pts) in enumerate(data.items()):
        pts = [p for p in pts if p["compute_s"] is not None]
        g = [p["gpus"] for p in pts]
        color = PALETTE[2 * i]
        ax.plot(g, [p["compute_s"] for p in pts], "o-", color=color, label=f"ZeRO-{stage} compute")
        ax.plot(g, [p["comm_s"] for p in pts], "s--", color=color, alpha=0.8, label=f"ZeRO-{stage} comm busy")
        ax.plot(g, [max(p["exposed_s"] or 0.0, 1e-6) for p in pts], ":", color=color, alpha=0.6,
                label=f"ZeRO-{stage} comm exposed")
        if any(p.get("host_loops_s") for p in pts):   # inside compute: see [Note: per-rank host loops]
            ax.plot(g, [max(p.get("host_loops_s") or 0.0, 1e-6) for p in pts], "^-.", color=PALETTE[2 * i + 1],
                    alpha=0.8, label=f"ZeRO-{stage} host loops over ranks (in compute)")
        cross = next((p for p in pts if p["comm_s"] >= p["compute_s"]), None)
        if cross is not None:
            ax.axvline(cross["gpus"], color=color, alpha=0.4, linewidth=1)
            ax.annotate(f"comm > compute\nfrom {cross['gpus']} GPUs", (cross["gpus"], cross["comm_s"]),
                        fontsize=8, color=color, xytext=(-100, -40), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("seconds per step per GPU")
    ax.set_title("Where communication stops hiding")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def scaling_plot(data: dict, title: str, path: str, failed: tuple[dict, ...] | list[dict] = ()):
    """`failed`: `failed_points` of the rows, listed under the figure (they have no GPU count)."""
    timed = all(p.get("compute_s") is not None for pts in data.values() for p in pts)
    fig, axes = plt.subplots(1, 3 if timed else 2, figsize=(19 if timed else 13, 5))
    ax1, ax2 = axes[0], axes[1]
    if timed:
        _hiding_panel(axes[2], data)
    markers = ("o-", "s--", "^-.", "D:")   # distinct, so coinciding curves stay visible
    for i, (stage, pts) in enumerate(data.items()):
        color = PALETTE[2 * i]
        g = [p["gpus"] for p in pts]
        style = markers[i % len(markers)]
        fit = [p for p in pts if not p["oom"]]
        for ax, key in ((ax1, "tokens_per_s"), (ax2, "tokens_per_s_per_gpu")):
            # the whole curve faint and thin, the fitting points bold on top: an all-OOM stage
            # (often the fastest, ZeRO-0) no longer paints over the curves that fit
            ax.plot(g, [p[key] for p in pts], ":", color=color, alpha=0.45, linewidth=1, zorder=2)
            if fit:
                ax.plot([p["gpus"] for p in fit], [p[key] for p in fit], style, color=color, label=f"ZeRO-{stage}",
                        markersize=7 - i, zorder=3)
            else:
                ax.plot([], [], ":", color=color, label=f"ZeRO-{stage} (OOM everywhere)")
            oom = [p for p in pts if p["oom"]]
            ax.plot([p["gpus"] for p in oom], [p[key] for p in oom], "x", color="red", markersize=8,
                    markeredgewidth=1.8, alpha=0.8, zorder=4)
        if fit:   # ideal scaling from the first point that fits, above the curves (zorder 5)
            first = fit[0]
            ax1.plot(g, [first["tokens_per_s"] * x / first["gpus"] for x in g], "--", color=color, alpha=0.6,
                     linewidth=1, zorder=5)
    ax1.plot([], [], "--", color="gray", label="ideal linear scaling")
    ax1.plot([], [], "x", color="red", markeredgewidth=2.5, label="OOM (best config does not fit)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    top = max(p["tokens_per_s_per_gpu"] for pts in data.values() for p in pts)
    ax2.set_ylim(0, top * 1.15)   # from zero: small differences are not blown up
    ax1.set_ylabel("tokens/s (whole job)")
    ax2.set_ylabel("tokens/s per GPU")
    ax1.set_title("Throughput vs GPUs")
    ax2.set_title("Per-GPU throughput vs GPUs")
    ax1.legend(fontsize=8)
    fig.suptitle(title)
    _note_failed(fig, list(failed))
    _save(fig, path)


# ---- throughput ------------------------------------------------------------------------

def _label(r: dict, keys: list[str]) -> str:
    if "variant" in r:
        return str(r["variant"])
    return ", ".join(f"{k.split('.')[-1]}={r[k]}" for k in keys) or f"point {r.get('point', '?')}"


def varied_keys(rows: list[dict]) -> list[str]:
    """The swept keys that take more than one value (a sweep row names them in 'varied')."""
    if not rows or "varied" not in rows[0]:
        return []
    varied = rows[0]["varied"]
    keys = varied.split("; ") if isinstance(varied, str) else list(varied)
    return [k for k in keys if len({str(r.get(k)) for r in rows}) > 1]


def throughput_data(rows: list[dict]) -> list[dict]:
    keys = varied_keys(rows)
    out = []
    for r in rows:
        if _failed(r):   # a slot marked failed, in its place among the points
            out.append({"label": _label(r, keys), "tokens_per_s_per_gpu": 0.0, "fits": False,
                        "error": str(r.get("error") or "failed")})
            continue
        out.append({"label": _label(r, keys), "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"], "fits": row_fits(r)})
    return out


def throughput_plot(data: list[dict], title: str, path: str):
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(data) + 2), 5))
    colors = [PALETTE[4] if d["fits"] else PALETTE[6] for d in data]
    ax.bar(range(len(data)), [d["tokens_per_s_per_gpu"] for d in data], color=colors)
    ax.set_xticks(range(len(data)), [d["label"] for d in data], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("tokens/s per GPU")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    handles: list[Patch | Line2D] = [Patch(color=PALETTE[4], label="fits"), Patch(color=PALETTE[6], label="OOM")]
    failed = [i for i, d in enumerate(data) if "error" in d]
    if failed:
        ax.plot(failed, [0.0] * len(failed), "X", color="red", markersize=10, clip_on=False, zorder=5)
        handles.append(Line2D([], [], marker="X", color="red", linestyle="", label="failed (reason below)"))
        _note_failed(fig, [{"label": data[i]["label"], "error": data[i]["error"]} for i in failed])
    ax.legend(handles=handles, fontsize=8)
    ax.set_title(title)
    _save(fig, path)


# ---- curves over one swept key ----------------------------------------------------------

def curves_data(rows: list[dict], x: str) -> dict:
    """tokens/s per GPU against the swept key `x` (numeric), one curve per combination of the
    other swept keys (e.g. ZeRO-3 with and without ZeRO++ across inter-node bandwidth)."""
    keys = varied_keys(rows)
    if x not in keys:
        raise ZsimInputError("--x", x, "is not a key the sweep varies; choose one of " + (", ".join(keys) or
                             "its --vary keys (this file varies none)"))
    others = [k for k in keys if k != x]
    curves: dict[str, list[dict]] = {}
    for r in rows:
        if _failed(r):
            continue
        value = r[x]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ZsimInputError("--x", x, f"takes {value!r}; a curve needs a number on its x axis")
        curves.setdefault(_label(r, others) if others else "tokens/s per GPU", []).append(
            {"x": float(value), "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"], "fits": row_fits(r)})
    return {"x": x, "curves": {k: sorted(v, key=lambda pt: pt["x"]) for k, v in curves.items()}}


def curves_plot(data: dict, title: str, path: str):
    fig, ax = plt.subplots(figsize=(9, 5))
    markers = ("o-", "s--", "^-.", "D:")
    for i, (label, pts) in enumerate(data["curves"].items()):
        ax.plot([p["x"] for p in pts], [p["tokens_per_s_per_gpu"] for p in pts], markers[i % len(markers)],
                color=PALETTE[(2 * i) % len(PALETTE)], label=label)
        oom = [p for p in pts if not p["fits"]]
        ax.plot([p["x"] for p in oom], [p["tokens_per_s_per_gpu"] for p in oom], "x", color="red", markersize=8)
    ax.set_xlabel(data["x"])
    ax.set_ylabel("tokens/s per GPU")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title)
    _save(fig, path)


# ---- memory ----------------------------------------------------------------------------

def memory_data(kind: str, results) -> list[dict]:
    """[{label, breakdown {category: bytes}, capacity_bytes}] per configuration."""
    if kind == "run":
        r = results
        return [{"label": r["scenario"], "breakdown": r["memory"]["breakdown"],
                 "capacity_bytes": r["memory"]["capacity_bytes"]}]
    keys = varied_keys(results)
    out: list[dict] = []
    for r in results:
        if _failed(r):   # a slot marked failed, in its place among the points
            out.append({"label": _label(r, keys), "breakdown": {}, "capacity_bytes": None,
                        "error": str(r.get("error") or "failed")})
            continue
        if "breakdown" in r:
            bd = r["breakdown"]
        else:
            bd = {k[len("memory.breakdown."):]: v for k, v in r.items() if k.startswith("memory.breakdown.") and v != ""}
        out.append({"label": _label(r, keys), "breakdown": {k: float(v) for k, v in bd.items()},
                    "capacity_bytes": float(r.get("memory.capacity_bytes", r.get("capacity_bytes")))})
    return out


def memory_plot(data: list[dict], title: str, path: str):
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(data) + 4), 5.5))
    cats = sorted({c for d in data for c in d["breakdown"]})
    colors = _category_colors(cats)
    bottoms = [0.0] * len(data)
    for c in cats:
        vals = [d["breakdown"].get(c, 0.0) / GiB for d in data]
        ax.bar(range(len(data)), vals, bottom=bottoms, color=colors[c], label=c)
        bottoms = [x + y for x, y in zip(bottoms, vals)]
    capacity = next((d["capacity_bytes"] for d in data if d.get("capacity_bytes") is not None), None)
    if capacity is not None:
        ax.axhline(capacity / GiB, color="black", linestyle="--", label="HBM capacity")
    failed = [i for i, d in enumerate(data) if "error" in d]
    if failed:
        ax.plot(failed, [0.0] * len(failed), "X", color="red", markersize=10, linestyle="", clip_on=False, zorder=5,
                label="failed (reason below)")
        _note_failed(fig, [{"label": data[i]["label"], "error": data[i]["error"]} for i in failed])
    ax.set_xticks(range(len(data)), [d["label"] for d in data], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("GiB per GPU at the peak")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title)
    _save(fig, path)


# ---- timeline / memory-timeline (from a trace) -------------------------------------------

def _process_labels(trace: dict) -> dict:
    """pid -> a short label for a trace with several processes (a pipeline's stages: "pipeline
    stage 1"), {} for one; from the process names zsim writes ("zsim: NAME (pipeline stage 1, rank 8)")."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    pids = {e.get("pid", 1) for e in trace["traceEvents"] if e["ph"] in ("X", "C")}
    if len(pids) < 2:
        return {}
    out = {}
    for pid in sorted(pids):
        name = names.get(pid, f"process {pid}")
        inner = name[name.find("(") + 1:].split(",")[0].rstrip(")") if "(" in name else name
        out[pid] = inner
    return out


def timeline_data(trace: dict) -> dict:
    """One lane per stream; a trace of several processes (a pipeline's stages) gets each stage's
    lanes, labelled with the stage, in stage order."""
    procs = _process_labels(trace)
    names = {(e.get("pid", 1), e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}

    def label(pid, tid) -> str:
        lane = names.get((pid, tid), str(tid))
        return f"{procs[pid]}: {lane}" if pid in procs else lane
    lanes: dict[str, list[tuple[float, float, str]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            lanes.setdefault(label(e.get("pid", 1), e["tid"]), []).append((e["ts"] / 1e6, e["dur"] / 1e6, e["cat"]))
    order = [label(*key) for key in sorted(names) if label(*key) in lanes]
    return {"lanes": {k: lanes[k] for k in order}}


def timeline_plot(data: dict, title: str, path: str):
    lanes = data["lanes"]
    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.7 * len(lanes)))
    cats = sorted({c for spans in lanes.values() for _, _, c in spans})
    colors = _category_colors(cats)
    for i, (lane, spans) in enumerate(lanes.items()):
        for cat in cats:
            bars = [(s, d) for s, d, c in spans if c == cat]
            if bars:
                ax.broken_barh(bars, (i - 0.35, 0.7), color=colors[cat])
    from matplotlib.patches import Patch
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.invert_yaxis()
    ax.set_xlabel("time in the step (s)")
    ax.legend(handles=[Patch(color=colors[c], label=c) for c in cats], fontsize=8, ncol=len(cats),
              loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.set_title(title)
    _save(fig, path)


def memory_timeline_data(trace: dict) -> dict:
    """The memory counter, one series per process (a pipeline's stages), and the peak: its time,
    size and, with several series, whose it is."""
    procs = _process_labels(trace)
    series: dict[str, list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "C" and e["name"] == "memory allocated":
            key = procs.get(e.get("pid", 1), "")
            series.setdefault(key, []).append((e["ts"] / 1e6, e["args"]["GiB"]))
    if not series:
        raise ZsimInputError("RESULTS", "trace", "the trace has no memory counter track")
    who, peak = max(((k, p) for k, pts in series.items() for p in pts), key=lambda kp: kp[1][1])
    return {"series": series, "peak_time_s": peak[0], "peak_GiB": peak[1], "peak_of": who}


def memory_timeline_plot(data: dict, title: str, path: str):
    fig, ax = plt.subplots(figsize=(12, 4.5))
    several = len(data["series"]) > 1
    for i, (label, pts) in enumerate(data["series"].items()):
        ts = [t for t, _ in pts]
        gb = [g for _, g in pts]
        color = PALETTE[(2 * i) % len(PALETTE)]
        ax.step(ts, gb, where="post", color=color, label=label or None)
        if not several:
            ax.fill_between(ts, gb, step="post", alpha=0.2, color=color)
    of = f" ({data['peak_of']})" if several else ""
    ax.annotate(f"peak {data['peak_GiB']:.2f} GiB at {data['peak_time_s'] * 1e3:.1f} ms{of}",
                (data["peak_time_s"], data["peak_GiB"]), xytext=(10, -20), textcoords="offset points",
                arrowprops={"arrowstyle": "->"}, fontsize=9)
    if several:
        ax.legend(fontsize=8)
    ax.set_xlabel("time in the step (s)")
    ax.set_ylabel("GiB allocated (excl. CUDA context)")
    ax.grid(alpha=0.3)
    ax.set_title(title)
    _save(fig, path)
