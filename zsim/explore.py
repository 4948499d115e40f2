"""Running many variants of one scenario: the shared machinery of compare, sweep and tune.

A variant is a list of `--set` style assignments applied to the scenario's raw mapping, so
every variant is reproducible with `zsim run scenario.yaml --set ...`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from zsim.config.scenario import apply_set, load_raw, scenario_from_mapping
from zsim.errors import ZsimInputError


@dataclass(frozen=True)
class Base:
    """A scenario file read once; variants are built from copies of its raw mapping."""
    raw: dict
    base_dir: Path
    name: str

    @classmethod
    def load(cls, path: str | Path, overrides: tuple[str, ...] = ()) -> "Base":
        path = Path(path)
        raw = load_raw(path)
        for a in overrides:
            raw = apply_set(raw, a)
        base = cls(raw, path.parent, raw.get("name", path.stem) if isinstance(raw.get("name"), str) else path.stem)
        base.scenario(())   # validate the base once, so bad input fails before any variant runs
        return base

    def scenario(self, assignments):
        raw = copy.deepcopy(self.raw)
        for a in assignments:
            raw = apply_set(raw, a)
        return scenario_from_mapping(raw, self.base_dir, name_default=self.name)


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested result -> one level with dotted keys (CSV columns)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, list):
            out[key] = "; ".join(map(str, v))
        else:
            out[key] = v
    return out


def run_assignments(base: Base, assignments) -> dict:
    """Simulate one variant; bad combinations become an error row instead of an exception."""
    from zsim.api import run_scenario
    try:
        sc = base.scenario(assignments)
        result, _ = run_scenario(sc)
        return {"ok": True, "error": "", "result": result}
    except ZsimInputError as err:
        return {"ok": False, "error": str(err), "result": None}


def total_comm_bytes(result: dict) -> float:
    return sum(result["comm"]["bytes_per_gpu"].values())


def fits(result: dict) -> bool:
    return bool(result["memory"]["fits"] and result["memory"]["host"]["fits"])
