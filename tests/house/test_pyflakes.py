"""Every module is pyflakes-clean: an undefined name in code that runs only in a subprocess
(the DeepSpeed peer under torchrun, which CI has no DeepSpeed to launch) fails here, not on a
user's first `zsim validate --engine deepspeed` (61e77b0 shipped one: calibration/core/peers.py)."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_no_pyflakes_messages():
    api = pytest.importorskip("pyflakes.api")
    from pyflakes.reporter import Reporter

    out, err = io.StringIO(), io.StringIO()
    paths = [str(ROOT / d) for d in ("zsim", "calibration", "benchmarks", "tests")]
    count = api.checkRecursive(paths, Reporter(out, err))
    assert count == 0 and not err.getvalue(), out.getvalue() + err.getvalue()
