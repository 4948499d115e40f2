"""zsim tune: the best ZeRO configuration that fits, at the scenario's global batch."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from zsim.commands.common import (add_headroom_arg, add_scenario_args, add_width_arg, add_workers_arg,
                                  headroom_fraction, scenario_overrides, table_width, workers_count)
from zsim.errors import ZsimInputError


def add_parser(sub):
    p = sub.add_parser("tune", help="search the TP x PP x DP layout, stage, micro-batch, checkpointing, offload and ZeRO knobs")
    add_scenario_args(p, optional=False)
    p.add_argument("--objective", default="tokens_per_s", choices=("tokens_per_s", "mfu", "step_time_s"))
    p.add_argument("--budget", default="60",
                   help="most configurations to simulate (default 60), or 'all': every candidate the memory "
                        "and step-time lower bounds leave, then the knob refinement")
    p.add_argument("--top", type=int, default=5, help="how many to print")
    p.add_argument("--out", metavar="DS_CONFIG.json", help="write the best configuration as a ds_config.json")
    p.add_argument("--scenario-out", metavar="SCENARIO.yaml",
                   help="write the best configuration as a scenario zsim run takes: the scenario with its "
                        "parallelism (TP, PP, sequence parallel) and training keys, and the tuned ds_config "
                        "(the --out file when given, else inline)")
    p.add_argument("--json", metavar="PATH", help="write the ranked candidates as JSON")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out or --scenario-out file")
    add_width_arg(p)
    add_headroom_arg(p)
    add_workers_arg(p, "simulate the configurations the search is about to try")
    p.set_defaults(func=main)


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def distinct(ranked) -> list:
    """The ranking with configurations that simulate identically merged (a knob that changes
    nothing, e.g. a prefetch size above every layer, gives the same step): the first, which sets
    the fewest knobs among its equals at the same rank, stays."""
    from zsim.search.tune import distinct_key

    out, seen = [], set()
    for c, r in ranked:
        key = distinct_key(c, r)
        if key not in seen:
            seen.add(key)
            out.append((c, r))
    return out


def tuned_scenario(base, assignments, deepspeed) -> dict:
    """The scenario mapping of a tuned configuration: the base's (its --set and cluster flags
    applied) with the configuration's assignments, so its `parallelism:` block carries the
    layout a ds_config cannot (sequence_parallel, a TP size agreeing with autotp_size), and
    `deepspeed` the tuned ds_config (a mapping, or the path of the --out file). Paths that were
    relative to the scenario's folder (a profile file; model.hf_config is absolute already) are
    made absolute, so the file runs from wherever it is written."""
    import copy

    from zsim.config.scenario import apply_set

    raw = copy.deepcopy(base.raw)
    for a in assignments:
        raw = apply_set(raw, a)
    raw["deepspeed"] = deepspeed
    hw = raw.get("hardware")
    profile = hw.get("profile") if isinstance(hw, dict) else None
    if isinstance(profile, str) and Path(profile).suffix in (".yaml", ".yml") and not Path(profile).is_absolute() \
            and (base.base_dir / profile).is_file():
        hw["profile"] = str((base.base_dir / profile).resolve())
    return raw


def main(args) -> int:
    import os

    import yaml

    from zsim.report.table import make_console, tune_table
    from zsim.report.writers import dumps, save
    from zsim.config.ds_writer import tuned_ds_config
    from zsim.search.tune import KNOBS, KNOBS_STAGE3, tune
    from zsim.search.variants import Base

    budget = None if args.budget == "all" else _int_or_none(args.budget)
    if args.budget != "all" and (budget is None or budget < 1):
        raise ZsimInputError("--budget", args.budget, "give a number of configurations (1 or more) or 'all'")
    if args.top < 0:
        raise ZsimInputError("--top", args.top, "give 0 or more")
    headroom = headroom_fraction(args.headroom)
    width = table_width(args.width)
    for flag, path in (("--out", args.out), ("--scenario-out", args.scenario_out)):
        if path and Path(path).exists() and not args.force:
            raise ZsimInputError(flag, path, "the file exists; pass --force to overwrite it or choose another path")
    if args.out and args.scenario_out and Path(args.out).resolve() == Path(args.scenario_out).resolve():
        raise ZsimInputError("--scenario-out", args.scenario_out, "is the --out file; give the scenario its own path")
    base = Base.load(args.scenario, scenario_overrides(args), workers=workers_count(args.workers))
    try:
        res = tune(base, args.objective, budget, keep=args.top, headroom=headroom)
    finally:
        base.close()
    res.ranked = distinct(r for r in res.ranked if r[1].fits_with(headroom))
    tune_table(res, args.top, make_console(width))
    print(f"simulated {res.simulated} configurations ({res.shared} of them sharing another's simulation, "
          f"{len(res.pruned)} pruned by the memory lower bound, "
          f"{len(res.bounded)} skipped by the step-time lower bound, "
          f"{res.rejected} rejected as invalid) in {res.wall_s:.1f} s", file=sys.stderr)
    if budget is None:
        print(f"every candidate structure was simulated or ruled out by a bound: none left out can enter the "
              f"best {max(args.top, 3)} (the knobs are refined from the best three)", file=sys.stderr)
    if args.json:
        rows = [{"rank": i + 1, "set": list(c.assignments()), "stage": c.stage,
                 "tensor_parallel_size": c.layout.tensor, "sequence_parallel": c.layout.sequence_parallel,
                 "expert_parallel_size": c.layout.expert,
                 "pipeline_stages": c.layout.pipeline, "data_parallel_size": r.world_size // c.layout.model_parallel,
                 "offload": c.offload,
                 "micro_batch_size": c.micro_batch, "gradient_accumulation_steps": c.gas,
                 "activation_checkpointing": c.checkpointing, "knobs": c.knobs,
                 "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu, "mfu": r.mfu, "step_time_s": r.step_time_s,
                 "peak_bytes": r.memory.peak_bytes} for i, (c, r) in enumerate(res.ranked)]
        save(args.json, dumps({"objective": res.objective, "simulated": res.simulated, "shared": res.shared,
                               "pruned": len(res.pruned), "bounded": len(res.bounded),
                               "rejected": res.rejected, "candidates": rows}))
    if not res.ranked:   # the JSON (an empty ranking, the counts) is written all the same
        margin = f" with {headroom:.0%} headroom" if headroom else ""
        print(f"zsim: no configuration fits{margin}; see zsim doctor for offload/NVMe options", file=sys.stderr)
        return 1
    best, _ = res.ranked[0]
    if best.checkpointing != "none":
        print(f"note: the best configuration uses {best.checkpointing} activation checkpointing; enable it in the "
              "model (e.g. model.gradient_checkpointing_enable() or deepspeed.checkpointing)", file=sys.stderr)
    if args.out or args.scenario_out:
        ds_args = (base.raw.get("deepspeed"), base.scenario(()), base.scenario(best.assignments()), [*KNOBS, *KNOBS_STAGE3])
        cfg, notes = tuned_ds_config(*ds_args)
        if args.out:
            save(args.out, json.dumps(cfg, indent=2) + "\n")
        if args.scenario_out:
            where = Path(args.scenario_out).resolve().parent
            # where the ds_config keeps an "auto" the tuned value differs from (for the HF Trainer to
            # fill), the scenario carries the tuned values inline, so zsim run reproduces the winner
            pinned, _ = tuned_ds_config(*ds_args, resolve_auto=True)
            ds = os.path.relpath(Path(args.out).resolve(), where) if args.out and pinned == cfg else pinned
            if args.out and pinned != cfg:
                notes.append(f"{args.scenario_out} carries the tuned values inline where {args.out} keeps \"auto\"")
            raw = tuned_scenario(base, best.assignments(), ds)
            save(args.scenario_out, f"# zsim tune's best configuration ({res.objective}): {best.variant.name}\n"
                 + yaml.safe_dump(raw, sort_keys=False))
        elif best.layout.sequence_parallel:
            notes.append("the ds_config cannot say sequence_parallel (Megatron's --sequence-parallel): "
                         "--scenario-out writes a scenario that zsim run takes with the whole layout")
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    return 0
