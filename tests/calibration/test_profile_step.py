"""calibration/core/run.py --profile-step: where a peer's optimizer-step phase spends its time
(torch.profiler's ops, then cProfile's Python functions), written by rank 0."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "benchmarks" / "validate_scenarios" / "small.yaml"


def test_profile_step_is_refused_where_there_is_no_step_phase_to_wrap(tmp_path):
    """The own core and pipelines are refused in one line before any process group starts."""
    pytest.importorskip("torch")
    from calibration.core.run import main

    with pytest.raises(SystemExit, match="--profile-step: profiles a DeepSpeed or FSDP run"):
        main(["--scenario", str(SMALL), "--engine", "own", "--out", str(tmp_path / "m.json"),
              "--profile-step", str(tmp_path / "p.txt")])


def test_profile_step_tables_name_the_optimizers_work(tmp_path):
    """A one-rank FSDP peer (DDP at stage 0, fused AdamW) on the CPU: the table holds the step
    phase's time, the fused AdamW kernel among torch.profiler's ops and torch's optimizer step
    among cProfile's functions; the measurement is still written."""
    pytest.importorskip("torch")
    out, prof = tmp_path / "m.json", tmp_path / "p.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
           "-m", "calibration.core.run", "--engine", "fsdp", "--scenario", str(SMALL),
           "--set", "hardware.gpus_per_node=1", "--steps", "1", "--warmup", "0", "--no-memory",
           "--out", str(out), "--profile-step", str(prof)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-2000:]
    text = prof.read_text()
    assert text.startswith("step phase: ")
    profiler = text[text.index("torch.profiler, by self_cpu_time_total"):text.index("cProfile, by cumulative")]
    assert "aten::_fused_adamw_" in profiler
    cprofile = text[text.index("cProfile, by cumulative"):]
    assert "torch/optim/optimizer.py" in cprofile and "peers.py" in cprofile
