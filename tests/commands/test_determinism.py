"""The same input gives byte-identical output, across processes: two `zsim run` processes with
different hash seeds (set and dict iteration orders differ between them) write the same JSON
and the same trace."""
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

CASES = [
    ("default.yaml", ()),
    ("gpt3-175b-zero3.yaml", ("training.gradient_accumulation_steps=2", "training.activation_checkpointing=full")),
    ("seed003-case-study-20b-zero3-offload.yaml", ()),
    ("seed004-zero2-64gpu.yaml", ("deepspeed.zero_optimization.stage=1",
                                  "deepspeed.zero_optimization.overlap_comm=true")),
]


def _run(tmp_path, name, overrides, seed):
    out = tmp_path / f"{seed}"
    out.mkdir()
    sets = [a for o in overrides for a in ("--set", o)]
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    subprocess.run([sys.executable, "-m", "zsim.cli", "run", str(ROOT / "scenarios" / name), *sets,
                    "--json", str(out / "r.json"), "--trace", str(out / "t.json")],
                   check=True, capture_output=True, env=env, cwd=ROOT)
    return (out / "r.json").read_bytes(), (out / "t.json").read_bytes()


@pytest.mark.parametrize("name,overrides", CASES, ids=[c[0] for c in CASES])
def test_two_processes_with_different_hash_seeds_write_identical_bytes(tmp_path, name, overrides):
    assert _run(tmp_path, name, overrides, 1) == _run(tmp_path, name, overrides, 2)
