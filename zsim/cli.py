"""zsim command line. Bad input: one line on stderr naming field, value and fix; exit 2.

Each subcommand lives in zsim/commands/<name>.py with add_parser(subparsers) and main(args);
heavy imports happen inside main so `zsim --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from zsim.errors import ZsimInputError

COMMANDS = ("run", "compare", "sweep", "plot", "tune", "doctor", "memory", "calibrate", "validate")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"zsim: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zsim", description="Simulate DeepSpeed ZeRO training steps before renting GPUs.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"zsim.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"zsim.commands.{name}":
                continue   # command not built yet
            raise
        module.add_parser(sub)
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
