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

from helpers import ROOT

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


def copy_tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    skip = shutil.ignore_patterns("__pycache__", "runs")
    for pkg in ("zsim", "calibration"):
        shutil.copytree(ROOT / pkg, root / pkg, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", root)
    return root


def test_a_back_edge_breaks_the_layers(tmp_path):
    root = copy_tree(tmp_path)
    (root / "zsim" / "workload" / "back_edge.py").write_text("import zsim.cli\n")
    out = lint_imports(root)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "zsim.workload is not allowed to import zsim.cli" in out.stdout
    assert "zsim.workload.back_edge -> zsim.cli" in out.stdout


def test_zsim_importing_calibration_breaks_the_contract(tmp_path):
    root = copy_tree(tmp_path)
    (root / "zsim" / "commands" / "back_edge.py").write_text("import calibration.validation\n")
    out = lint_imports(root)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "zsim.commands.back_edge -> calibration.validation" in out.stdout


def test_a_module_outside_every_layer_breaks_the_contract(tmp_path):
    root = copy_tree(tmp_path)
    (root / "zsim" / "stray.py").write_text("")
    out = lint_imports(root)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "zsim.stray" in out.stdout


def test_calibration_adds_its_commands_through_entry_points():
    """zsim lists no calibration command by name; `zsim --help` shows them because the
    installed distribution declares them in the zsim.commands group."""
    declared = {ep.name: ep.value for ep in entry_points(group="zsim.commands")}
    assert declared == {"calibrate": "calibration.commands.calibrate", "validate": "calibration.commands.validate"}
    out = subprocess.run([sys.executable, "-m", "zsim.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "{run,compare,sweep,plot,tune,doctor,memory,calibrate,validate}" in out.stdout
