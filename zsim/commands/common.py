"""Arguments shared by the subcommands."""
from __future__ import annotations

from pathlib import Path

DEFAULT_SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "default.yaml"


def add_scenario_args(p, optional: bool = True):
    if optional:
        p.add_argument("scenario", nargs="?", default=str(DEFAULT_SCENARIO),
                       help="scenario YAML (default: the embedded small default scenario)")
    else:
        p.add_argument("scenario", help="scenario YAML")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override any scenario key, e.g. deepspeed.zero_optimization.stage=2 (repeatable)")
