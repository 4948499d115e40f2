"""The Python API: the same calls `zsim run` makes, in order."""
from __future__ import annotations

from pathlib import Path

from zsim.config.scenario import load_scenario
from zsim.engine.sim import Trace
from zsim.result.generation import Generation, summarize_generation
from zsim.result.rlhf import Rlhf
from zsim.rlhf import simulate_rlhf
from zsim.simulate import simulate_generation, simulate_scenario
from zsim.result.summarize import summarize
from zsim.result import Result
from zsim.specs.scenario import Scenario


def run_scenario(sc: Scenario, steady: bool = True) -> tuple[Result, Trace]:
    """Simulate and summarize one step; `steady=False` simulates every micro-step instead of
    reusing the repeating ones (the result is the same; see zsim/simulate.py)."""
    if not isinstance(sc, Scenario):
        raise TypeError(f"run_scenario takes a Scenario (zsim.config.scenario.load_scenario), not "
                        f"{type(sc).__name__}; for a file use zsim.api.run_file(path)")
    if sc.inference is not None or sc.rlhf is not None:
        raise TypeError("run_scenario simulates a training step; this scenario's "
                        f"{'inference' if sc.inference is not None else 'rlhf'} block is run_generation's or run_rlhf's")
    wl, trace = simulate_scenario(sc, steady)
    return summarize(sc, wl, trace), trace


def run_file(path: str | Path, overrides: tuple[str, ...] = (), steady: bool = True) -> tuple[Result, Trace]:
    """(result, trace) of the scenario file (or of a ds_config with the model and hardware as
    overrides: `("model.preset=gpt2", "hardware.profile=dgx-a100-80g", "hardware.nodes=1",
    "hardware.gpus_per_node=8")`), `overrides` as `--set` takes them."""
    if not isinstance(path, (str, Path)):
        raise TypeError(f"run_file takes the path of a scenario YAML or ds_config.json, not {type(path).__name__}")
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise TypeError("overrides is a sequence of 'KEY=VALUE' strings, e.g. ('training.micro_batch_size=4',)")
    return run_scenario(load_scenario(path, tuple(overrides)), steady)


def run_generation(sc: Scenario) -> tuple[Generation, Trace]:
    """Simulate and summarize the scenario's generate() call (its `inference:` block)."""
    if not isinstance(sc, Scenario) or sc.inference is None:
        raise TypeError("run_generation takes a Scenario with an inference block (zsim.config.scenario.load_scenario)")
    _, trace, forwards = simulate_generation(sc)
    return summarize_generation(sc, trace, forwards), trace


def run_rlhf(sc: Scenario) -> tuple[Rlhf, list[tuple[str, Trace]]]:
    """Simulate one PPO iteration of the scenario's DeepSpeed-Chat step 3 (its `rlhf:` block): the
    result and each phase's (name, trace) of one run."""
    if not isinstance(sc, Scenario) or sc.rlhf is None:
        raise TypeError("run_rlhf takes a Scenario with an rlhf block (zsim.config.scenario.load_scenario)")
    traces: list[tuple[str, Trace]] = []
    return simulate_rlhf(sc, traces=traces), traces
