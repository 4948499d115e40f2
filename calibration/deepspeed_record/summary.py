"""A compact, run-length compressed view of one fixture (no torch needed)."""
from __future__ import annotations

import json


def summarize(path, min_fold=4):
    """Compact, run-length compressed view of one fixture (no torch needed)."""
    with open(path) as fh:
        d = json.load(fh)
    lines = [f"== {d['case']}  ({len(d['collectives'])} collectives, optimizer={d['optimizer']['class']}, "
             f"final_loss={d['final_loss']:.4f}, ranks_identical={d['ranks_identical_trace']})"]
    recs = d["collectives"]
    i = 0
    while i < len(recs):
        r = recs[i]
        where = f"{r['phase']}" + ("" if r["opt_step"] is None else f"[s{r['opt_step']}m{r['micro_step']}]")
        # fold a run of same (phase, step, op, fn, caller) into one line
        j = i
        while (j + 1 < len(recs) and all(recs[j + 1].get(k) == r.get(k) for k in
                                         ("phase", "opt_step", "micro_step", "op", "fn", "caller", "dtype", "gather"))):
            j += 1
        run = recs[i:j + 1]
        sizes = [x["numel"] for x in run]
        if len(set(sizes)) == 1:
            sz = f"{sizes[0]} x{len(run)}" if len(run) > 1 else f"{sizes[0]}"
        elif len(run) <= min_fold:
            sz = ",".join(map(str, sizes))
        else:
            # run-length encode the sizes themselves
            parts, k = [], 0
            while k < len(sizes):
                m = k
                while m + 1 < len(sizes) and sizes[m + 1] == sizes[k]:
                    m += 1
                parts.append(f"{sizes[k]}" + (f"x{m - k + 1}" if m > k else ""))
                k = m + 1
            sz = f"n={len(run)} sum={sum(sizes)} [" + ",".join(parts) + "]"
        flags = ("async " if r["async_op"] else "") + (f"coal{r['coalesced']} " if "coalesced" in r else "")
        if r.get("gather"):
            flags += r["gather"] + " "
        lines.append(f"  {where:12s} {r['op']:14s} {r['dtype'] or '-':8s} {flags}{sz}   <{r['caller']}>")
        i = j + 1
    return "\n".join(lines)
