"""The Python API: the same calls `zsim run` makes, in order."""
from __future__ import annotations

from pathlib import Path

from zsim.config.scenario import load_scenario
from zsim.engine.sim import Trace, simulate
from zsim.result.summarize import summarize
from zsim.result import Result
from zsim.schedule.build import build_schedule
from zsim.specs.scenario import Scenario


def run_scenario(sc: Scenario) -> tuple[Result, Trace]:
    wl, schedule = build_schedule(sc)
    trace = simulate(schedule, sc.cluster, sc.precision)
    return summarize(sc, wl, trace), trace


def run_file(path: str | Path, overrides: tuple[str, ...] = ()) -> tuple[Result, Trace]:
    return run_scenario(load_scenario(path, overrides))
