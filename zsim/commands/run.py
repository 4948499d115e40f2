"""zsim run: simulate one training step of a scenario (or a ds_config.json with --model/--gpus)."""
from __future__ import annotations

import argparse
import sys

from zsim.commands.common import (add_headroom_arg, add_scenario_args, add_width_arg, headroom_fraction,
                                  scenario_overrides, table_width)

# `--check`: the exit code a script can gate on when the step is predicted not to fit
EXIT_OOM = 3


def add_parser(sub):
    p = sub.add_parser("run", help="simulate one training step of a scenario")
    add_scenario_args(p)
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace of the step")
    p.add_argument("--quiet", action="store_true", help="no table on the terminal")
    p.add_argument("--check", action="store_true",
                   help=f"exit {EXIT_OOM} when the step does not fit (GPU or host memory, with --headroom)")
    add_headroom_arg(p)
    add_width_arg(p)
    # hidden: simulate every micro-step instead of reusing the steady state (zsim/engine/steady.py)
    p.add_argument("--full-simulation", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=main)


def main(args) -> int:
    from zsim.api import run_scenario
    from zsim.config.scenario import load_scenario
    from zsim.units import GiB

    headroom = headroom_fraction(args.headroom)
    table_width(args.width)
    sc = load_scenario(args.scenario, scenario_overrides(args))
    if sc.inference is not None:
        return _generation(sc, args, headroom)
    if sc.rlhf is not None:
        return _rlhf(sc, args, headroom)
    result, trace = run_scenario(sc, steady=not args.full_simulation)
    if not args.quiet:
        # rich (about 30 ms of imports) only when there is a table to draw
        from zsim.report.table import make_console, render
        render(result, make_console(args.width))
    fits = result.fits_with(headroom)
    if headroom and result.fits and not fits:
        mem = result.memory
        print(f"with {headroom:.0%} headroom: peak {mem.peak_bytes / GiB:.2f} GiB over the "
              f"{mem.capacity_bytes * (1 - headroom) / GiB:.2f} GiB allowed -> does not fit", file=sys.stderr)
    return _outputs(args, sc, result.to_dict(), lambda: _writers().trace_json(trace, sc.name), fits, headroom)


def _writers():
    """zsim.report.writers, imported when a file is written."""
    from zsim.report import writers
    return writers


def _outputs(args, sc, data: dict, trace_text, fits: bool, headroom: float) -> int:
    """--json (`data`), --trace (`trace_text()`, the trace's JSON) and --check (`fits`), alike for
    every kind of run; the exit code."""
    if args.json:
        _writers().save(args.json, _writers().dumps(data))
    if args.trace:
        _writers().save(args.trace, trace_text())
    if args.check and not fits:
        print(f"zsim: check failed: {sc.name} is predicted not to fit"
              f"{f' with {headroom:.0%} headroom' if headroom else ''} (exit {EXIT_OOM})", file=sys.stderr)
        return EXIT_OOM
    return 0


def _generation(sc, args, headroom: float) -> int:
    """`zsim run` on a scenario with an inference block: one generate() call."""
    from zsim.api import run_generation
    from zsim.result import fits_with_headroom

    gen, trace = run_generation(sc)
    if not args.quiet:
        from zsim.report.table import make_console, render_generation
        render_generation(gen, make_console(args.width))
    mem = gen.memory
    return _outputs(args, sc, gen.to_dict(), lambda: _writers().trace_json(trace, sc.name),
                    fits_with_headroom(mem.peak_bytes, mem.capacity_bytes, mem.host.fits, headroom), headroom)


def _rlhf(sc, args, headroom: float) -> int:
    """`zsim run` on a scenario with an rlhf block: one PPO iteration of DeepSpeed-Chat's step 3."""
    from zsim.api import run_rlhf
    from zsim.result import fits_with_headroom

    r, traces = run_rlhf(sc)
    if not args.quiet:
        from zsim.report.table import make_console, render_rlhf
        render_rlhf(r, make_console(args.width))
    fits = fits_with_headroom(r.peak_bytes, r.capacity_bytes, r.host_bytes_per_node <= r.host_capacity_bytes, headroom)
    return _outputs(args, sc, r.to_dict(), lambda: _writers().rlhf_trace_json(r, traces, sc.name), fits, headroom)
