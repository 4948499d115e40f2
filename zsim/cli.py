"""zsim command line. Bad input: one line on stderr naming field, value and fix; exit 2."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from zsim.errors import ZsimInputError

DEFAULT_SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "default.yaml"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"zsim: error: {message} (see zsim {self.prog.split()[-1]} --help)\n")


def _cmd_run(args) -> int:
    from zsim.api import run_scenario
    from zsim.config.scenario import load_scenario
    from zsim.report.table import render
    from zsim.report.writers import dumps, trace_json, write_atomic

    sc = load_scenario(args.scenario, tuple(args.set or ()))
    result, trace = run_scenario(sc)
    if not args.quiet:
        render(result)
    if args.json:
        write_atomic(args.json, dumps(result))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.trace:
        write_atomic(args.trace, trace_json(trace, sc.name))
        print(f"wrote {args.trace}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zsim", description="Simulate DeepSpeed ZeRO training steps before renting GPUs.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="simulate one training step of a scenario")
    run.add_argument("scenario", nargs="?", default=str(DEFAULT_SCENARIO),
                     help="scenario YAML (default: the embedded small default scenario)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="override any scenario key, e.g. deepspeed.zero_optimization.stage=2 (repeatable)")
    run.add_argument("--json", metavar="PATH", help="write the result as JSON")
    run.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace of the step")
    run.add_argument("--quiet", action="store_true", help="no table on the terminal")
    run.set_defaults(func=_cmd_run)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ZsimInputError as err:
        print(f"zsim: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"zsim: error: {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
