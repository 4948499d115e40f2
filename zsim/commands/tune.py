"""zsim tune: the best ZeRO configuration that fits, at the scenario's global batch."""
from __future__ import annotations

import json
import sys

from zsim.commands.common import add_scenario_args
from zsim.errors import ZsimInputError


def add_parser(sub):
    p = sub.add_parser("tune", help="search stage, micro-batch, checkpointing, offload and ZeRO knobs")
    add_scenario_args(p, optional=False)
    p.add_argument("--objective", default="tokens_per_s", choices=("tokens_per_s", "mfu", "step_time_s"))
    p.add_argument("--budget", type=int, default=60, help="most configurations to simulate (default 60)")
    p.add_argument("--top", type=int, default=5, help="how many to print")
    p.add_argument("--out", metavar="DS_CONFIG.json", help="write the best configuration as a ds_config.json")
    p.add_argument("--json", metavar="PATH", help="write the ranked candidates as JSON")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    p.set_defaults(func=main)


def main(args) -> int:
    from pathlib import Path

    from zsim.report.table import tune_table
    from zsim.report.writers import dumps, save
    from zsim.search.tune import ds_config, tune
    from zsim.search.variants import Base

    if args.budget < 1:
        raise ZsimInputError("--budget", args.budget, "simulate at least 1 configuration")
    if args.out and Path(args.out).exists() and not args.force:
        raise ZsimInputError("--out", args.out, "the file exists; pass --force to overwrite it or choose another path")
    base = Base.load(args.scenario, tuple(args.set or ()))
    res = tune(base, args.objective, args.budget)
    tune_table(res, args.top)
    print(f"simulated {res.simulated} configurations ({len(res.pruned)} pruned by the memory lower bound, "
          f"{res.rejected} rejected as invalid) in {res.wall_s:.1f} s", file=sys.stderr)
    if not res.ranked:
        print("zsim: no configuration fits; see zsim doctor for offload/NVMe options", file=sys.stderr)
        return 1
    best, _ = res.ranked[0]
    if best.checkpointing != "none":
        print(f"note: the best configuration uses {best.checkpointing} activation checkpointing; enable it in the "
              "model (e.g. model.gradient_checkpointing_enable() or deepspeed.checkpointing)", file=sys.stderr)
    if args.out:
        save(args.out, json.dumps(ds_config(base, best), indent=2) + "\n")
    if args.json:
        rows = [{"rank": i + 1, "set": list(c.assignments()), "stage": c.stage, "offload": c.offload,
                 "micro_batch_size": c.micro_batch, "gradient_accumulation_steps": c.gas,
                 "activation_checkpointing": c.checkpointing, "knobs": c.knobs,
                 "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu, "mfu": r.mfu, "step_time_s": r.step_time_s,
                 "peak_bytes": r.memory.peak_bytes} for i, (c, r) in enumerate(res.ranked)]
        save(args.json, dumps({"objective": res.objective, "simulated": res.simulated, "pruned": len(res.pruned),
                               "rejected": res.rejected, "candidates": rows}))
    return 0
