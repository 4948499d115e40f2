"""zsim command line. Bad input: one line on stderr naming field, value and fix; exit 2.

Each subcommand is a module with add_parser(subparsers) and main(args); heavy imports happen
inside main so `zsim --help` stays fast. zsim's own subcommands live in zsim/commands/<name>.py
and are listed in COMMANDS. Packages layered above zsim contribute theirs through the
`zsim.commands` entry point group (pyproject.toml: `calibrate = "calibration.commands.calibrate"`),
so zsim never imports them by name: the layer contract in pyproject.toml forbids zsim -> calibration.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import entry_points

from zsim.errors import ZsimInputError, one_line

COMMANDS = ("run", "compare", "sweep", "plot", "tune", "doctor", "memory")
PLUGIN_GROUP = "zsim.commands"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"zsim: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zsim", description="Simulate DeepSpeed ZeRO training steps before renting GPUs.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"zsim.commands.{name}").add_parser(sub)
    # sorted: the help lists them in the same order whatever order the installer recorded
    for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name):
        if ep.name in COMMANDS:
            raise RuntimeError(f"entry point {ep.value} redefines the built-in command {ep.name!r}")
        ep.load().add_parser(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # the reader (e.g. `| head`) closed the pipe: stop quietly (Python docs, "Note on SIGPIPE")
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except ZsimInputError as err:
        print(f"zsim: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(one_line(f"zsim: error: {err.filename or ''}: {err.strerror or err}"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
