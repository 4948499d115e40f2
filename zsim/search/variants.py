"""Running many variants of one scenario: the one runner behind compare, sweep, doctor and tune.

A variant is a named list of `--set` style assignments applied to the scenario's raw mapping,
so every variant is reproducible with `zsim run scenario.yaml --set ...`.
"""
from __future__ import annotations

import copy
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


@dataclass(frozen=True)
class Base:
    """A scenario file read once; variants are built from copies of its raw mapping."""
    raw: dict
    base_dir: Path
    name: str
    # resolved scenario (its repr) -> Result: variants that resolve to the same scenario (a knob
    # set to the value it has, a fix already applied) are simulated once
    _results: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def load(cls, path: str | Path, overrides: tuple[str, ...] = ()) -> "Base":
        path = Path(path)
        raw = load_raw(path)
        for a in overrides:
            raw = apply_set(raw, a)
        base = cls(raw, path.parent, raw.get("name", path.stem) if isinstance(raw.get("name"), str) else path.stem)
        base.scenario(())   # validate the base once, so bad input fails before any variant runs
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

    def run(self, variant: Variant, scenario: Scenario | None = None) -> Outcome:
        """Simulate one variant (once per distinct scenario); an invalid combination becomes an
        Outcome with its error."""
        note = ""
        try:
            if scenario is None:
                try:
                    scenario = self.scenario(variant.assignments)
                except ZsimInputError:
                    # re-derived batch keys only where the variant as given is refused: a
                    # variant that loads is simulated as written
                    assignments, note = self.derived(variant.assignments)
                    if not note:
                        raise
                    scenario = self.scenario(assignments)
            key = repr(scenario)
            shared = key in self._results
            if not shared:
                self._results[key] = self.simulate(scenario=scenario)[1]
        except ZsimInputError as err:
            return Outcome(variant, None, str(err), note)
        return Outcome(variant, self._results[key], note=note, shared=shared)
