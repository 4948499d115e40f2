"""Running many variants of one scenario: the one runner behind compare, sweep, doctor and tune.

A variant is a named list of `--set` style assignments applied to the scenario's raw mapping,
so every variant is reproducible with `zsim run scenario.yaml --set ...`.

Searches (doctor, tune) decide what to simulate next from what they simulated so far, one
variant at a time. With more than one worker, `Base.prefetch` simulates the variants a search
is about to ask for on forked worker processes ahead of it; `run` then takes the worker's
Result for the same resolved scenario instead of simulating it again. The search itself is
unchanged and the engine is deterministic, so its answer is the same with any number of
workers; a prefetched variant the search never asks for is only wasted work.
"""
from __future__ import annotations

import copy
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from zsim.api import run_scenario
from zsim.config.derive import rederive_raw
from zsim.config.scenario import apply_set, load_raw, scenario_from_mapping
from zsim.specs.scenario import Scenario
from zsim.engine.sim import Trace
from zsim.errors import ZsimInputError
from zsim.result import Result


@dataclass(frozen=True)
class Variant:
    name: str
    assignments: tuple[str, ...]     # dotted --set assignments

    def __add__(self, other: "Variant") -> "Variant":
        """Both changes; where both set a key, this variant's value wins."""
        keys = {a.split("=", 1)[0] for a in self.assignments}
        extra = tuple(a for a in other.assignments if a.split("=", 1)[0] not in keys)
        return Variant(f"{self.name} + {other.name}", self.assignments + extra)


@dataclass(frozen=True)
class Outcome:
    """A simulated variant, or the one-line reason its configuration is invalid."""
    variant: Variant
    result: Result | None
    error: str = ""
    note: str = ""      # batch keys re-derived for the variant (zsim.config.derive), if any
    shared: bool = False   # the result is another variant's simulation (the same resolved scenario)

    @property
    def ok(self) -> bool:
        return self.result is not None

    @property
    def fits(self) -> bool:
        return self.result is not None and self.result.fits


def training_only(sc: Scenario, what: str) -> None:
    """Refuse a scenario whose inference or rlhf block makes it something other than a training step."""
    for block, instead in (("inference", "a generate() call"), ("rlhf", "a PPO iteration and its doctor's variants")):
        if getattr(sc, block) is not None:
            raise ZsimInputError(block, "given", f"{what}; `zsim run` simulates this scenario ({instead}); drop the "
                                 f"{block} block to search its training step")


@dataclass(frozen=True)
class Base:
    """A scenario file read once; variants are built from copies of its raw mapping."""
    raw: dict
    base_dir: Path
    name: str
    # resolved scenario (its repr) -> Result: variants that resolve to the same scenario (a knob
    # set to the value it has, a fix already applied) are simulated once
    _results: dict = field(default_factory=dict, compare=False, repr=False)
    # worker processes for `prefetch` (1: none)
    workers: int = field(default=1, compare=False, repr=False)
    _ahead: _Prefetch = field(default_factory=lambda: _Prefetch(), compare=False, repr=False)

    @classmethod
    def load(cls, path: str | Path, overrides: tuple[str, ...] = (), workers: int = 1) -> "Base":
        path = Path(path)
        raw = load_raw(path)
        for a in overrides:
            raw = apply_set(raw, a)
        base = cls(raw, path.parent, raw.get("name", path.stem) if isinstance(raw.get("name"), str) else path.stem,
                   workers=workers)
        sc = base.scenario(())   # validate the base once, so bad input fails before any variant runs
        training_only(sc, "compare, sweep, tune and doctor search training steps")
        return base

    def scenario(self, assignments) -> Scenario:
        raw = copy.deepcopy(self.raw)
        for a in assignments:
            raw = apply_set(raw, a)
        return scenario_from_mapping(raw, self.base_dir, name_default=self.name)

    def derived(self, assignments) -> tuple[tuple[str, ...], str]:
        """(assignments, note): `assignments` plus the batch keys re-derived when they move the
        batch product (a layout or cluster change on a mapping that pins train_batch_size), as
        `--set` on the command line does (zsim.config.derive); the note is "" when none were."""
        extra, note = rederive_raw(self.raw, tuple(assignments), self.base_dir, self.name)
        return tuple(assignments) + extra, note or ""

    def simulate(self, assignments=(), scenario: Scenario | None = None) -> tuple[Scenario, Result, Trace]:
        """Simulate one variant (or its already built `scenario`); bad input raises ZsimInputError."""
        sc = scenario or self.scenario(assignments)
        result, trace = run_scenario(sc)
        return sc, result, trace

    def resolve(self, variant: Variant) -> tuple[Scenario, str]:
        """The variant's scenario and the note of any batch keys re-derived for it."""
        try:
            return self.scenario(variant.assignments), ""
        except ZsimInputError:
            # re-derived batch keys only where the variant as given is refused: a
            # variant that loads is simulated as written
            assignments, note = self.derived(variant.assignments)
            if not note:
                raise
            return self.scenario(assignments), note

    def run(self, variant: Variant, scenario: Scenario | None = None) -> Outcome:
        """Simulate one variant (once per distinct scenario); an invalid combination becomes an
        Outcome with its error."""
        note = ""
        try:
            if scenario is None:
                resolved = self._ahead.resolved.pop(variant.assignments, None)   # prefetch's, if any
                scenario, note = resolved if resolved is not None else self.resolve(variant)
            key = repr(scenario)
            shared = key in self._results
            if not shared:
                result = self._prefetched(key)
                self._results[key] = result if result is not None else self.simulate(scenario=scenario)[1]
        except ZsimInputError as err:
            return Outcome(variant, None, str(err), note)
        return Outcome(variant, self._results[key], note=note, shared=shared)

    def prefetch(self, variants) -> None:
        """Start simulating `variants` on the worker processes (with workers > 1), those not
        simulated or started yet; invalid ones are left to `run` to report."""
        if self.workers <= 1 or self._ahead.broken:
            return
        ahead = self._ahead
        for variant in variants:
            try:
                resolved = self.resolve(variant)
            except ZsimInputError:
                continue
            ahead.resolved[variant.assignments] = resolved
            key = repr(resolved[0])
            if key in self._results or key in ahead.pending:
                continue
            if ahead.pool is None:
                # each forked worker starts with this Base (fork passes it without pickling),
                # whenever the pool forks it
                ahead.pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("fork"),
                                                 initializer=_set_worker_base, initargs=(self,))
            try:
                ahead.pending[key] = ahead.pool.submit(_simulate_variant, variant.assignments)
            except RuntimeError:   # a worker died (BrokenProcessPool): simulate here from now on
                ahead.broken = True
                return

    def _prefetched(self, key: str) -> Result | None:
        """A worker's Result for `key`, waiting for it if it is still running; None when nothing
        was prefetched or the worker failed, a dead worker included (then `run` simulates here,
        and reports any error)."""
        pending = self._ahead.pending.pop(key, None)
        if pending is None:
            return None
        try:
            return pending.result()
        except Exception:   # noqa: BLE001 - the simulation is repeated here, where its error surfaces
            return None

    def close(self) -> None:
        """Stop the worker processes (prefetched simulations not yet taken are dropped)."""
        ahead = self._ahead
        if ahead.pool is not None:
            # a prefetch still running is not waited for: its worker is stopped
            workers = list((getattr(ahead.pool, "_processes", None) or {}).values())
            ahead.pool.shutdown(wait=False, cancel_futures=True)
            for proc in workers:
                proc.terminate()
            for proc in workers:
                proc.join()
            ahead.pool = None
        ahead.pending.clear()
        ahead.resolved.clear()


class _Prefetch:
    """A Base's worker pool, once started, the prefetched simulations `run` has not taken yet
    (the resolved scenario's repr -> Future), and the scenarios prefetch resolved (a variant's
    assignments -> (scenario, note)) for `run` to take instead of resolving them again."""

    def __init__(self):
        self.pool = None
        self.pending: dict = {}
        self.resolved: dict = {}
        self.broken = False


_WORKER_BASE: Base | None = None


def _set_worker_base(base: Base):
    global _WORKER_BASE
    _WORKER_BASE = base


def _simulate_variant(assignments: tuple[str, ...]) -> Result | None:
    """In a worker: the variant's Result (None when it is invalid: `run` says why in the parent)."""
    assert _WORKER_BASE is not None    # set by the pool's initializer
    try:
        scenario = _WORKER_BASE.resolve(Variant("", assignments))[0]
        return _WORKER_BASE.simulate(scenario=scenario)[1]
    except ZsimInputError:
        return None

