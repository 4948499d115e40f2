"""Arguments shared by the subcommands: the scenario (or a ds_config.json), --set, and the
flags that fill in what a ds_config lacks (zsim.config.source)."""
from __future__ import annotations

from pathlib import Path

from zsim.errors import ZsimInputError

DEFAULT_SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "default.yaml"


def add_scenario_args(p, optional: bool = True, cluster_flags: bool = True):
    """`cluster_flags=False` for a command that already has --nodes/--gpus-per-node of its own."""
    if optional:
        p.add_argument("scenario", nargs="?", default=str(DEFAULT_SCENARIO),
                       help="scenario YAML or a ds_config.json (default: the embedded small default scenario)")
    else:
        p.add_argument("scenario", help="scenario YAML or a ds_config.json")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override any scenario key, e.g. deepspeed.zero_optimization.stage=2 (repeatable)")
    p.add_argument("--model", metavar="NAME|config.json",
                   help="model preset or Hugging Face config.json (for a ds_config; on a scenario it replaces model:)")
    p.add_argument("--profile", metavar="P", help="hardware profile name or .yaml path (ds_config default: dgx-a100-80g)")
    if cluster_flags:
        p.add_argument("--gpus", type=int, metavar="N", help="GPUs per node (DeepSpeed launcher's --num_gpus)")
        p.add_argument("--nodes", type=int, metavar="K", help="nodes (ds_config default: 1)")


def _count(flag: str, value):
    if value is not None and value < 1:
        raise ZsimInputError(flag, value, "give 1 or more")
    return value


def scenario_overrides(args) -> tuple[str, ...]:
    """The flags as --set assignments, then the user's own --set (which win), then a
    re-derived train_batch_size when they move micro x GAS x world size (one note on stderr)."""
    import sys

    from zsim.config.derive import rederive_batch
    from zsim.config.scenario import source_is_ds_config
    from zsim.config.source import cluster_overrides

    gpus = _count("--gpus", getattr(args, "gpus", None) or getattr(args, "gpus_per_node", None))
    nodes = _count("--nodes", args.nodes)
    overrides = cluster_overrides(source_is_ds_config(args.scenario), args.scenario, args.model, gpus, nodes,
                                  args.profile) + tuple(args.set or ())
    derived, note = rederive_batch(args.scenario, overrides)
    if note:
        print(f"zsim: note: {note}", file=sys.stderr)
    return overrides + derived


def add_headroom_arg(p):
    p.add_argument("--headroom", metavar="PCT", default="0%",
                   help="safety margin on the fits verdict: the peak must stay under (100 - PCT)%% of HBM "
                        "(e.g. 10%%; default 0%%)")


def headroom_fraction(text: str) -> float:
    """`10%` or `0.1` -> 0.1; at most 90% (a larger margin leaves no memory to train in)."""
    import math
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ZsimInputError("--headroom", text, "give a percentage such as 10% (or a fraction such as 0.1)") from None
    if not math.isfinite(value) or not 0 <= value <= 0.9:
        raise ZsimInputError("--headroom", text, "give a margin from 0% to 90%")
    return value


def add_workers_arg(p, what: str):
    import os
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help=f"worker processes that {what} (default: CPU count; 1: none)")


def workers_count(value: int) -> int:
    """--workers checked: each worker is a forked process holding a copy of the scenario, so
    more than a few per core only costs memory."""
    import os
    max_workers = 4 * (os.cpu_count() or 1)
    if not 1 <= value <= max_workers:
        raise ZsimInputError("--workers", value, f"use 1 to {max_workers} worker processes (4 per CPU core)")
    return value
