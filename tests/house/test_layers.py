"""The import contract (pyproject.toml [tool.importlinter]) holds, and it catches a back edge.

import-linter runs in a subprocess so that it reads the pyproject.toml and the packages of the
directory it runs in: this checkout, or a copy with one forbidden import added.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from tests.helpers import ROOT

LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    # the tree under test first on the path, so a copy's packages shadow the installed checkout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-c", LINT, "--no-cache", "--no-logo"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_import_contract_holds():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def lint_with_added_module(tmp_path: Path, module: str, source: str) -> str:
    """Copy zsim and calibration with the contract, add `module` holding `source`, lint the
    copy and return the report of the broken contract."""
    root = tmp_path / "tree"
    for pkg in ("zsim", "calibration"):
        shutil.copytree(ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__", "runs"))
    shutil.copy(ROOT / "pyproject.toml", root)
    (root / (module.replace(".", "/") + ".py")).write_text(source)
    out = lint_imports(root)
    assert out.returncode == 1, out.stdout + out.stderr
    return out.stdout


def test_a_back_edge_breaks_the_layers(tmp_path):
    report = lint_with_added_module(tmp_path, "zsim.workload.back_edge", "import zsim.cli\n")
    assert "zsim.workload is not allowed to import zsim.cli" in report
    assert "zsim.workload.back_edge -> zsim.cli" in report


def test_zsim_importing_calibration_breaks_the_contract(tmp_path):
    report = lint_with_added_module(tmp_path, "zsim.commands.back_edge", "import calibration.validation\n")
    assert "zsim.commands.back_edge -> calibration.validation" in report


def test_a_module_outside_every_layer_breaks_the_contract(tmp_path):
    assert "- zsim.stray" in lint_with_added_module(tmp_path, "zsim.stray", "")


def test_simpy_outside_the_engine_breaks_the_contract(tmp_path):
    report = lint_with_added_module(tmp_path, "zsim.schedule.clock", "import simpy\n")
    assert "zsim.schedule.clock -> simpy" in report


def test_calibration_adds_its_commands_through_entry_points():
    """zsim lists no calibration command by name; `zsim --help` shows them because the
    installed distribution declares them in the zsim.commands group."""
    declared = {ep.name: ep.value for ep in entry_points(group="zsim.commands")}
    assert declared == {"calibrate": "calibration.commands.calibrate", "validate": "calibration.commands.validate"}
    out = subprocess.run([sys.executable, "-m", "zsim.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "{run,compare,sweep,plot,tune,doctor,memory,calibrate,validate}" in out.stdout
