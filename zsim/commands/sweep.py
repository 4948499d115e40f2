"""zsim sweep: the cartesian product of --vary KEY=V1,V2,... over any scenario keys."""
from __future__ import annotations

import itertools
import sys

from zsim.commands.common import (add_scenario_args, add_width_arg, add_workers_arg, scenario_overrides, table_width,
                                  workers_count)
from zsim.errors import UnknownKeyError, ZsimInputError


def split_values(text: str) -> list[str]:
    """V1,V2,... with commas inside [] or {} kept (so `{device: cpu, pin_memory: true}` is one value)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return out


def parse_vary(items: list[str]) -> list[tuple[str, list[str]]]:
    axes: list[tuple[str, list[str]]] = []
    for item in items:
        if "=" not in item:
            raise ZsimInputError("--vary", item, "use --vary KEY=V1,V2,... (e.g. --vary hardware.nodes=1,2,4)")
        key, values = item.split("=", 1)
        vals = [v for v in split_values(values)]
        if not key.strip() or not vals or any(v == "" for v in vals):
            raise ZsimInputError("--vary", item, "give a key and at least one non-empty value: KEY=V1,V2")
        if any(k == key.strip() for k, _ in axes):
            raise ZsimInputError("--vary", key, "this key is varied twice; merge the values into one --vary")
        axes.append((key.strip(), vals))
    return axes


def points(axes) -> list[tuple[str, ...]]:
    keys = [k for k, _ in axes]
    return [tuple(f"{k}={v}" for k, v in zip(keys, combo)) for combo in itertools.product(*(v for _, v in axes))]


_BASE = None


def _init_worker(path, overrides):
    global _BASE
    from zsim.search.variants import Base
    _BASE = Base.load(path, overrides)


def point_row(base, index: int, assignments: tuple[str, ...]) -> dict:
    """One sweep point as a table row; a point that fails is a row with its error, never an abort."""
    from zsim.config.scenario import parse_value
    from zsim.report.writers import flatten
    from zsim.search.variants import Outcome, Variant
    variant = Variant(f"point {index}", assignments)
    try:
        out = base.run(variant)
    except Exception as err:   # a model error on one point (a builder bug) must not lose the others
        out = Outcome(variant, None, f"{type(err).__name__}: {err}")
    row = {"point": index, "varied": [a.split("=", 1)[0] for a in assignments]}
    for a in assignments:
        k, v = a.split("=", 1)
        row[k] = parse_value(v)
    row["ok"] = out.ok
    row["error"] = out.error
    if out.note:   # batch keys re-derived for this point (a layout or cluster change; zsim.config.derive)
        row["note"] = out.note
    if out.result is not None:
        row.update(flatten(out.result.to_dict()))
    return row


def _run_point(args):
    return point_row(_BASE, *args)


def run_sweep(path: str, overrides: tuple[str, ...], axes, workers: int, progress: bool = True,
              scheduler: str | None = None) -> list[dict]:
    """Rows of every point, in point order: on `workers` local processes, or on the Dask
    cluster whose scheduler listens at `scheduler` (zsim/commands/sweep_dask.py)."""
    todo = list(enumerate(points(axes)))
    rows: list[dict] = []
    pool = None
    if scheduler is not None:
        from zsim.commands.sweep_dask import dask_rows
        from zsim.search.variants import Base
        it = dask_rows(Base.load(path, overrides), todo, scheduler)
    elif workers <= 1:
        _init_worker(path, overrides)
        it = map(_run_point, todo)
    else:
        import multiprocessing as mp
        pool = mp.get_context("fork" if sys.platform != "win32" else "spawn").Pool(
            workers, initializer=_init_worker, initargs=(path, overrides))
        it = pool.imap(_run_point, todo, chunksize=max(1, min(16, len(todo) // (workers * 8) or 1)))
    try:
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
            with Progress("sweep", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                          transient=True) as bar:
                task = bar.add_task("points", total=len(todo))
                for row in it:
                    rows.append(row)
                    bar.advance(task)
        else:
            rows.extend(it)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return sorted(rows, key=lambda r: r["point"])


def _check_axis_keys(path: str, overrides: tuple[str, ...], axes):
    """A misspelt --vary key is bad input (exit 2), not a sweep of failed points: no value can
    make an unknown key valid. A value that fails only in some points stays in its row."""
    from zsim.config.scenario import load_scenario
    for key, values in axes:
        try:
            load_scenario(path, overrides + (f"{key}={values[0]}",))
        except UnknownKeyError as err:
            raise ZsimInputError(f"--vary {err.field}", err.value, err.fix) from None
        except ZsimInputError:
            pass   # a bad value: its points' rows say so


def add_parser(sub):
    p = sub.add_parser("sweep", help="simulate the cartesian product of varied scenario keys")
    add_scenario_args(p, optional=False)
    p.add_argument("--vary", action="append", required=True, metavar="KEY=V1,V2,...",
                   help="a scenario key and its values (repeatable; the product of all is run)")
    p.add_argument("--csv", metavar="PATH", help="one row per point, run JSON keys flattened")
    p.add_argument("--json", metavar="PATH", help="the same rows as a JSON list")
    add_workers_arg(p, "run the points")
    p.add_argument("--executor", choices=("local", "dask"), default="local",
                   help="local: a process pool on this machine (default); dask: the workers of a Dask "
                        "distributed cluster (pip install -e '.[distributed]')")
    p.add_argument("--scheduler", metavar="ADDRESS", help="the Dask scheduler, e.g. tcp://HOST:8786 (--executor dask)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table on the terminal")
    add_width_arg(p)
    p.set_defaults(func=main)


def main(args) -> int:
    from zsim.report.writers import dumps, rows_csv, save

    workers_count(args.workers)
    width = table_width(args.width)
    if (args.executor == "dask") != (args.scheduler is not None):
        raise ZsimInputError("--scheduler", args.scheduler,
                             "give --scheduler tcp://HOST:8786 with --executor dask, and only with it")
    axes = parse_vary(args.vary)
    from zsim.search.variants import Base
    overrides = scenario_overrides(args)
    Base.load(args.scenario, overrides)   # bad base input fails once, here
    _check_axis_keys(args.scenario, overrides, axes)
    import time
    t0 = time.perf_counter()
    rows = run_sweep(args.scenario, overrides, axes, args.workers, progress=not args.quiet,
                     scheduler=args.scheduler)
    wall = time.perf_counter() - t0
    failed = sum(not r["ok"] for r in rows)
    for note in dict.fromkeys(r["note"] for r in rows if "note" in r):
        print(f"zsim: note: {note}", file=sys.stderr)
    if not args.quiet:
        from zsim.report.table import make_console, sweep_table
        sweep_table(rows, [k for k, _ in axes], make_console(width))
    print(f"{len(rows)} points ({failed} failed) in {wall:.1f} s, {len(rows) / wall:.1f} points/s", file=sys.stderr)
    if args.csv:
        save(args.csv, rows_csv(rows))
    if args.json:
        save(args.json, dumps(rows))
    if rows and failed == len(rows):   # nothing to plot or compare: a script must see it
        print(f"zsim: error: no point of the sweep could be simulated (all {len(rows)} failed); "
              f"the first: {rows[0]['error']}", file=sys.stderr)
        return 1
    return 0
