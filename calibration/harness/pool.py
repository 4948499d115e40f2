"""Collective timings pooled over several calibration runs of one cluster.

A collective's in-step time drifts with the machine over tens of minutes (on the 2-vCPU VM
this project validates on, the mean 1 MiB gloo all-reduce of five full runs on one day ranged
from 1.8 to 2.8 ms), and one run samples one window of it. `zsim calibrate --pool-collectives
RUN` adds another run's collective records; fit.pool_passes then merges every call of a size
across runs, so the profile's collective tables average over all the windows. Compute figures
come from the run being fitted only.

The pooled records are kept beside the run (calibration/runs/NAME/pooled_collectives.json),
with each source run's provenance, so that refitting the run reproduces the profile.
"""
from __future__ import annotations

import json
from pathlib import Path

from zsim.errors import ZsimInputError

POOL_FILE = "pooled_collectives.json"
# provenance that must match for two runs' collectives to be the same measurement
SAME_CLUSTER = ("backend", "world_size", "nodes", "ranks_per_node", "hosts")


def read_json(path: Path, field: str, value: str) -> dict:
    """A run's JSON file, or one line naming it when it is not JSON (a copy cut short)."""
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ZsimInputError(field, value, f"{path.name} is not valid JSON ({exc}); measure the run again") from None
    if not isinstance(doc, dict):
        raise ZsimInputError(field, value, f"{path.name} is not a calibration record (a JSON object)")
    return doc


def read_pool(run_dir: Path) -> list[dict]:
    path = run_dir / POOL_FILE
    if not path.is_file():
        return []
    return read_json(path, "--from-run", str(run_dir)).get("runs", [])


def _identity(prov: dict) -> tuple:
    return (str(prov.get("date")), str(prov.get("hosts")))


def load_source(src: str) -> dict:
    """A source run's records.json, checked: complete and holding collective timings."""
    path = Path(src) / "records.json"
    if not path.is_file():
        raise ZsimInputError("--pool-collectives", src, "expected a calibration/runs/NAME directory with "
                                                        "records.json from `zsim calibrate`")
    doc = read_json(path, "--pool-collectives", src)
    if doc.get("status") != "complete":
        raise ZsimInputError("--pool-collectives", src, f"the run is {doc.get('status')!r}, not complete; "
                                                        "pool complete runs only")
    doc["collectives"] = [r for r in doc.get("records", [])
                          if r.get("kind") == "collective" and "error" not in r and r.get("times_s")]
    if not doc["collectives"]:
        raise ZsimInputError("--pool-collectives", src, "it holds no collective timings; pool a full "
                                                        "`zsim calibrate` run")
    return doc


def precheck(sources: list[str], run_dir: Path, expected: dict | None = None) -> None:
    """Before minutes of measuring: every source is a complete run, none is the run that the
    new measurement overwrites, and each measured the cluster the new run will (`expected`: the
    provenance keys known before the launch, e.g. world_size and backend)."""
    for src in sources:
        if Path(src).resolve() == run_dir.resolve():
            raise ZsimInputError("--pool-collectives", src, "that is the run this calibration overwrites; "
                                                            "copy it under another name and pool the copy")
        sprov = load_source(src).get("provenance", {})
        for k, v in (expected or {}).items():
            if str(sprov.get(k)) != str(v):
                raise ZsimInputError("--pool-collectives", src, f"it measured {k}={sprov.get(k)!r}, this run will "
                                                                f"have {k}={v!r}; pool runs of the same cluster")


def add_sources(pool: list[dict], sources: list[str], prov: dict) -> list[dict]:
    """The pool with each source run's collective records added; one-line errors for a source
    that is not a complete run, measured another cluster, or is already in."""
    pool = list(pool)
    seen = {_identity(prov)} | {_identity(p["provenance"]) for p in pool}
    for src in sources:
        doc = load_source(src)
        sprov = doc.get("provenance", {})
        diff = [k for k in SAME_CLUSTER if str(sprov.get(k)) != str(prov.get(k))]
        if diff:
            k = diff[0]
            raise ZsimInputError("--pool-collectives", src, f"it measured {k}={sprov.get(k)!r}, the fitted run "
                                                            f"{k}={prov.get(k)!r}; pool runs of the same cluster")
        if _identity(sprov) in seen:
            raise ZsimInputError("--pool-collectives", src, f"the run of {sprov.get('date')} is already pooled "
                                                            "(or is the run being fitted); drop it")
        pool.append({"source": str(src), "provenance": sprov, "records": doc["collectives"]})
        seen.add(_identity(sprov))
    return pool


def write_pool(run_dir: Path, pool: list[dict], write_atomic) -> None:
    if pool:
        write_atomic(run_dir / POOL_FILE, json.dumps({"format": 1, "runs": pool}, indent=1, sort_keys=True) + "\n")


def pooled(records: list[dict], prov: dict, pool: list[dict]) -> tuple[list[dict], dict]:
    """(records to fit, provenance) with the pool's collective records appended and named in the
    provenance."""
    if not pool:
        return records, prov
    extra = [r for p in pool for r in p["records"]]
    runs = ", ".join(f"{p['provenance'].get('date')} ({len(p['records'])} records)" for p in pool)
    return records + extra, {**prov, "pooled_collectives": f"{len(pool)} more runs: {runs}"}
