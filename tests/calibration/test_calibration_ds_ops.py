"""DeepSpeed's ops built before the timed benchmarks (calibration/harness/ds_ops.py): stale
torch-extensions locks found and explained, a build past its timeout named with what it waited
on, the ranks told not to compile. Needs neither torch nor deepspeed except the last test."""
from __future__ import annotations

import os
import time

import pytest

from calibration.harness import ds_ops
from calibration.harness.launch import waiting_on


def _lock(root, age_s: float):
    lock = root / "py311_cpu" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    old = time.time() - age_s
    os.utime(lock, (old, old))
    return lock


def test_extensions_root_follows_torch(tmp_path):
    assert ds_ops.extensions_root({"TORCH_EXTENSIONS_DIR": str(tmp_path)}) == tmp_path
    assert ds_ops.extensions_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "torch_extensions"


def test_a_stale_lock_stops_the_run_before_any_benchmark_and_says_how_to_clear_it(tmp_path, monkeypatch):
    lock = _lock(tmp_path, 600)
    monkeypatch.setattr(ds_ops, "deepspeed_installed", lambda: True)
    with pytest.raises(ds_ops.OpBuildFailed, match=f"rm {lock}"):
        ds_ops.prepare({"TORCH_EXTENSIONS_DIR": str(tmp_path)})


def test_a_fresh_lock_is_a_build_in_progress_not_stale(tmp_path):
    _lock(tmp_path, 1)
    assert ds_ops.stale_locks(tmp_path) == []


def test_a_build_past_its_timeout_names_the_lock_it_waited_on(tmp_path, monkeypatch):
    lock = _lock(tmp_path, 1)
    monkeypatch.setattr(ds_ops, "deepspeed_installed", lambda: True)
    monkeypatch.setattr(ds_ops, "_BUILD", "import time; time.sleep(60)")
    with pytest.raises(ds_ops.OpBuildFailed, match=f"did not finish in 1 s; it was waiting on the lock {lock}"):
        ds_ops.prepare({**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}, timeout_s=1)


def test_a_failed_build_is_reported_to_the_ranks_not_retried_in_a_timed_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ds_ops, "deepspeed_installed", lambda: True)
    monkeypatch.setattr(ds_ops, "_BUILD", "print('no compiler'); raise SystemExit(1)")
    ready = ds_ops.prepare({**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert ready.startswith("not measured") and "no compiler" in ready
    assert "preparing DeepSpeed's cpu_adam op" in capsys.readouterr().err


def test_without_deepspeed_nothing_is_built(monkeypatch):
    monkeypatch.setattr(ds_ops, "deepspeed_installed", lambda: False)
    assert ds_ops.prepare({}) == "not measured: deepspeed is not installed"


def test_a_hang_says_what_the_rank_was_waiting_on(tmp_path):
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    assert "synchronisation" in waiting_on({"phase": "sync"}, env)
    assert "inside the benchmark" in waiting_on({"phase": "run"}, env)
    lock = _lock(tmp_path, 5)
    assert f"rm {lock}" in waiting_on({"phase": "run", "item": "adam"}, env)


def test_the_op_builds_with_deepspeed_installed(tmp_path):
    pytest.importorskip("deepspeed")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path))}
    env.setdefault("DS_ACCELERATOR", "cpu")
    assert ds_ops.prepare(env) == "built"
    assert ds_ops.prepare(env) == "built"      # the second time loads the cached build
