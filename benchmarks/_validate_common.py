"""Shared by validate_matrix.py, validate_random.py and core_vs_peers.py: the case matrix, one
`zsim validate` run, and the report of a case run several times."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from calibration.validation import rel_error

ROOT = Path(__file__).resolve().parents[1]
SCEN = Path(__file__).parent / "validate_scenarios"
Z = "deepspeed.zero_optimization."

# (case name, scenario, overrides): stages 0-3, reduce bucket and prefetch sizes varied, two model sizes
CASES = [
    ("S-z0", "small", [f"{Z}stage=0"]),
    ("S-z1", "small", [f"{Z}stage=1"]),
    ("S-z1-b5e5", "small", [f"{Z}stage=1", f"{Z}reduce_bucket_size=5e5"]),
    ("S-z2", "small", [f"{Z}stage=2"]),
    ("S-z2-b5e5", "small", [f"{Z}stage=2", f"{Z}reduce_bucket_size=5e5"]),
    ("S-z3", "small", [f"{Z}stage=3"]),
    ("S-z3-pf2e5", "small", [f"{Z}stage=3", f"{Z}stage3_prefetch_bucket_size=2e5"]),
    ("S-z3-pf0-reuse0", "small", [f"{Z}stage=3", f"{Z}stage3_prefetch_bucket_size=0", f"{Z}stage3_max_reuse_distance=0"]),
    ("M-z0", "medium", [f"{Z}stage=0"]),
    ("M-z1", "medium", [f"{Z}stage=1"]),
    ("M-z2-b2e6", "medium", [f"{Z}stage=2", f"{Z}reduce_bucket_size=2e6"]),
    ("M-z3", "medium", [f"{Z}stage=3"]),
    ("M-z3-pf1e6-b2e6", "medium", [f"{Z}stage=3", f"{Z}stage3_prefetch_bucket_size=1e6", f"{Z}reduce_bucket_size=2e6"]),
]


def engine_python(engine: str) -> str:
    if engine == "deepspeed":
        return os.environ.get("ZSIM_DS_PYTHON", sys.executable)
    return sys.executable


def run_case(scenario: str, overrides, engine: str, steps: int, warmup: int = 2, profile: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "zsim.cli", "validate", str(SCEN / f"{scenario}.yaml"), "--engine", engine,
               "--steps", str(steps), "--warmup", str(warmup), "--json", str(out), "--python", engine_python(engine)]
        if profile:
            cmd += ["--profile", profile]
        for o in overrides:
            cmd += ["--set", o]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0 or not out.exists():
            return {"failed": (p.stderr.strip().splitlines() or ["?"])[-1]}
        return json.loads(out.read_text())


def combine(runs: list[dict]) -> dict:
    """One report from repeated runs of a case: median of the runs' step-time medians. "run
    spread" is (max - min) / median of the runs' medians."""
    ok = [r for r in runs if "failed" not in r]
    if not ok:
        return runs[-1]
    meds = [r["measured"]["step_time_s"] for r in ok]
    med = statistics.median(meds)
    out = dict(ok[0])
    out["measured"] = {**ok[0]["measured"], "step_time_s": med, "run_medians_s": meds,
                       "run_spread": (max(meds) - min(meds)) / med if med else 0.0,
                       "peak_bytes": max(r["measured"]["peak_bytes"] for r in ok)}
    out["error"] = {**ok[0]["error"], "step_time": rel_error(out["predicted"]["step_time_s"], med),
                    "peak_bytes": rel_error(out["predicted"]["peak_bytes"], out["measured"]["peak_bytes"])}
    out["collectives_equal"] = all(r["collectives_equal"] for r in ok)
    out["runs"] = len(ok)
    return out
