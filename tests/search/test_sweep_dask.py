"""`zsim sweep --executor dask` against a real Dask LocalCluster started here: the same rows as
the local run, failing points recorded in their rows; bad scheduler input is one line, exit 2."""
from __future__ import annotations

import pytest
import yaml

from tests.helpers import mapping
from tests.helpers import zsim_cli
from zsim.commands.sweep import parse_vary, run_sweep

VARY = ["deepspeed.zero_optimization.stage=1,2,3,7", "training.gradient_accumulation_steps=1,8"]


def _base(tmp_path):
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(mapping()))
    return path


def test_dask_executor_gives_the_local_rows(tmp_path):
    distributed = pytest.importorskip("distributed")
    path = _base(tmp_path)
    axes = parse_vary(VARY)
    local = run_sweep(str(path), (), axes, workers=1, progress=False)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  dashboard_address=None) as cluster:
        remote = run_sweep(str(path), (), axes, workers=1, progress=False, scheduler=cluster.scheduler_address)
    assert remote == local
    assert [r["ok"] for r in remote] == [True] * 6 + [False] * 2   # stage 7 is recorded, not raised
    assert "stage" in remote[-1]["error"]


def test_unreachable_scheduler_is_one_line_exit_2(tmp_path):
    path = _base(tmp_path)
    r = zsim_cli("sweep", str(path), "--vary", "training.micro_batch_size=1,2", "--executor", "dask",
                 "--scheduler", "tcp://127.0.0.1:9", "--quiet")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "tcp://127.0.0.1:9" in lines[0] and "Traceback" not in r.stderr


def test_a_sweep_whose_every_point_fails_exits_nonzero(tmp_path):
    path = _base(tmp_path)
    r = zsim_cli("sweep", str(path), "--vary", "deepspeed.zero_optimization.stage=5,7", "--workers", "1", "--quiet")
    assert r.returncode == 1
    assert "no point of the sweep could be simulated (all 2 failed)" in r.stderr.strip().splitlines()[-1]
