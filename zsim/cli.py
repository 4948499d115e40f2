"""zsim command line. Bad input: one line on stderr naming field, value and fix; exit 2.

Each subcommand is a module with add_parser(subparsers) and main(args); heavy imports happen
inside main so `zsim --help` stays fast. zsim's own subcommands live in zsim/commands/<name>.py
and are listed in COMMANDS. Packages layered above zsim contribute theirs through the
`zsim.commands` entry point group (pyproject.toml: `calibrate = "calibration.commands.calibrate"`),
so zsim never imports them by name: the layer contract in pyproject.toml forbids zsim -> calibration.

A command line naming a built-in command gets a parser holding that command alone: its parsing,
help and errors are those of its own subparser, so the other commands' modules and the entry
point scan (importlib.metadata reads every installed distribution's metadata) are left out of
`zsim run`'s start-up. Any other command line (a plugin's command, `--help`, a typo) gets them all.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from zsim.errors import ZsimInputError, one_line

COMMANDS = ("run", "compare", "sweep", "plot", "tune", "doctor", "memory")
PLUGIN_GROUP = "zsim.commands"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"zsim: error: {message} (see {self.prog} --help)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser, or, with `only` (a built-in command), that command's alone."""
    p = _Parser(prog="zsim", description="Simulate DeepSpeed ZeRO training steps before renting GPUs.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in (only,) if only else COMMANDS:
        importlib.import_module(f"zsim.commands.{name}").add_parser(sub)
    if only:
        return p
    from importlib.metadata import entry_points
    # sorted: the help lists them in the same order whatever order the installer recorded
    for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name):
        if ep.name in COMMANDS:
            raise RuntimeError(f"entry point {ep.value} redefines the built-in command {ep.name!r}")
        ep.load().add_parser(sub)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # the first word picks the command: zsim's top-level parser has no options besides --help
    # `zsim run [options] -- deepspeed ... train.py ...`: the words after the first -- are the
    # user's launch command (zsim.config.launch), read where a scenario file would be
    launch = None
    if argv and argv[0] in COMMANDS and "--" in argv:
        argv, launch = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        if args.command in COMMANDS:
            from zsim.commands.common import check_output_paths, resolve_source
            if hasattr(args, "scenario"):
                resolve_source(args, launch)
            elif launch is not None:
                raise ZsimInputError("--", " ".join(launch[:3]), f"zsim {args.command} takes no launch command")
            check_output_paths(args)
        return args.func(args)
    except BrokenPipeError:
        # the reader (e.g. `| head`) closed the pipe: stop quietly (Python docs, "Note on SIGPIPE")
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except ZsimInputError as err:
        print(f"zsim: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:   # Ctrl-C: one line, the shell's code for SIGINT, no traceback
        print("zsim: interrupted", file=sys.stderr)
        return 130
    except OSError as err:
        print(one_line(f"zsim: error: {err.filename or ''}: {err.strerror or err}"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
