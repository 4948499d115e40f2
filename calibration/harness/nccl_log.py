"""What NCCL reported about its own tuning during a calibration run.

The launcher sets NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=INIT,TUNING (unless the user set
them); on the NCCL backend rank 0 then prints, per communicator, the tuner's table: for each
collective, algorithm and protocol, "latency us/bandwidth GB/s" (NCCL 2.27.5
src/graph/tuning.cc, the NCCL_TUNING block at the end of ncclTopoTuneModel), after an INIT
line "comm 0x.. rank R nRanks N nNodes M ..." (src/init.cc). `parse_tuning` reads those
tables back and `reported_choice` applies topoGetAlgoInfo's rule (src/enqueue.cc: the least
latency + bytes / (1000 x bandwidth)) to name the algorithm NCCL ran for each measured
size. On gloo nothing is printed and nothing is recorded.
"""
from __future__ import annotations

import re

NCCL_TUNING_FILE = "nccl_tuning.json"   # in the run directory, beside records.json
_COMM = re.compile(r"NCCL INFO comm (0x[0-9a-f]+) rank (\d+) nRanks (\d+) nNodes (\d+)")
_INFO = re.compile(r"NCCL INFO (.*)$")
_CELL = re.compile(r"(-?[\d.]+)/\s*(-?[\d.]+)")
FUNCS = {"Broadcast": "broadcast", "Reduce": "reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
         "AllReduce": "all_reduce"}


def parse_tuning(text: str) -> list[dict]:
    """[{"comm", "nranks", "nnodes", "table": {collective: {"Ring/LL": [latency_us, bw_GBps], ...}}}]."""
    out: list[dict] = []
    comm: dict | None = None
    algos: list[str] = []
    protos: list[str] = []
    for line in text.splitlines():
        m = _COMM.search(line)
        if m:
            comm = {"comm": m.group(1), "nranks": int(m.group(3)), "nnodes": int(m.group(4)), "table": {}}
            out.append(comm)
            continue
        m = _INFO.search(line)
        if m is None or comm is None or "|" not in m.group(1):
            continue
        head, *cells = [c.strip() for c in m.group(1).split("|")]
        if head == "Algorithm":
            algos = [c for c in cells if c]
        elif head == "Protocol":
            protos = [c for c in cells if c][:3]
        elif head in FUNCS and algos and protos:
            values = [_CELL.search(c) for c in cells if _CELL.search(c)]
            row = comm["table"].setdefault(FUNCS[head], {})
            for i, v in enumerate(values[:len(algos) * len(protos)]):
                row[f"{algos[i // len(protos)]}/{protos[i % len(protos)]}"] = [float(v.group(1)), float(v.group(2))]
    return [c for c in out if c["table"]]


def reported_choice(table: dict[str, list[float]], size_bytes: float) -> str | None:
    """The (algorithm/protocol) NCCL's tuner picks for a call of `size_bytes` from its table;
    a bandwidth of 0 marks a pair NCCL disabled."""
    best, best_us = None, float("inf")
    for name, (lat_us, bw_GBps) in table.items():
        if bw_GBps <= 0:
            continue
        t_us = lat_us + size_bytes / (1000 * bw_GBps)
        if t_us < best_us:
            best, best_us = name, t_us
    return best


def choices_for(records: list[dict], tunings: list[dict]) -> list[dict]:
    """For each measured collective record, the algorithm NCCL's table for a communicator of the
    record's size names (records without a matching table are skipped)."""
    by_ranks = {t["nranks"]: t["table"] for t in tunings}
    out = []
    for r in records:
        if r.get("kind") != "collective":
            continue
        table = by_ranks.get(r["ranks"], {}).get(r["op"])
        if table:
            out.append({"op": r["op"], "size_bytes": r["size_bytes"], "ranks": r["ranks"],
                        "nccl_choice": reported_choice(table, r["size_bytes"])})
    return out
