"""zsim run: simulate one training step of a scenario."""
from __future__ import annotations

import argparse

from zsim.commands.common import add_scenario_args


def add_parser(sub):
    p = sub.add_parser("run", help="simulate one training step of a scenario")
    add_scenario_args(p)
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace of the step")
    p.add_argument("--quiet", action="store_true", help="no table on the terminal")
    # hidden: simulate every micro-step instead of reusing the steady state (zsim/engine/steady.py)
    p.add_argument("--full-simulation", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=main)


def main(args) -> int:
    from zsim.api import run_scenario
    from zsim.config.scenario import load_scenario
    from zsim.report.table import render
    from zsim.report.writers import dumps, save, trace_json

    sc = load_scenario(args.scenario, tuple(args.set or ()))
    result, trace = run_scenario(sc, steady=not args.full_simulation)
    if not args.quiet:
        render(result)
    if args.json:
        save(args.json, dumps(result.to_dict()))
    if args.trace:
        save(args.trace, trace_json(trace, sc.name))
    return 0

