"""The Python API: the same calls `zsim run` makes, in order."""
from __future__ import annotations

from pathlib import Path

from zsim.config.scenario import load_scenario
from zsim.engine.sim import Trace
from zsim.engine.steady import simulate_scenario
from zsim.result.summarize import summarize
from zsim.result import Result
from zsim.specs.scenario import Scenario


def run_scenario(sc: Scenario, steady: bool = True) -> tuple[Result, Trace]:
    """Simulate and summarize one step; `steady=False` simulates every micro-step instead of
    reusing the repeating ones (the result is the same; see zsim/engine/steady.py)."""
    wl, trace = simulate_scenario(sc, steady)
    return summarize(sc, wl, trace), trace


def run_file(path: str | Path, overrides: tuple[str, ...] = (), steady: bool = True) -> tuple[Result, Trace]:
    return run_scenario(load_scenario(path, overrides), steady)
