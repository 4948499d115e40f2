"""Golden results: the figures a user reads for every shipped scenario, rounded to 6
significant digits so a deliberate model change shows up as a reviewable diff."""
from __future__ import annotations

from pathlib import Path

from zsim.api import run_file
from zsim.result import Result

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "scenarios"
GOLDEN = Path(__file__).parent / "golden"


def _r(x):
    return float(f"{x:.6g}") if isinstance(x, float) else x


def golden_view(result: Result) -> dict:
    mem, comm = result.memory, result.comm
    return {
        "n_params": result.n_params,
        "world_size": result.world_size,
        "step_time_s": _r(result.step_time_s),
        "tokens_per_s_per_gpu": _r(result.tokens_per_s_per_gpu),
        "mfu": _r(result.mfu),
        "peak_bytes": _r(mem.peak_bytes),
        "fits": mem.fits,
        "host_fits": mem.host.fits,
        "breakdown": {k: _r(v) for k, v in mem.breakdown.items()},
        "calls": comm.calls,
        "bytes_per_gpu": {k: _r(v) for k, v in comm.bytes_per_gpu.items()},
        "exposed_time_s": _r(comm.exposed_time_s),
    }


def scenario_files() -> list[Path]:
    return sorted(SCENARIOS.glob("*.yaml"))


def compute(path: Path) -> dict:
    return golden_view(run_file(path)[0])
