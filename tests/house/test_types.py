"""zsim/ type-checks clean under mypy (its defaults; [tool.mypy] in pyproject.toml): issue 47's
type checker run by the tests. A new error fails here with mypy's own line for it."""
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def test_zsim_type_checks_clean():
    pytest.importorskip("mypy")
    out = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--cache-dir=/dev/null"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert out.returncode == 0 and not errors, "\n".join(errors[:20]) or out.stdout[-2000:] + out.stderr[-2000:]
