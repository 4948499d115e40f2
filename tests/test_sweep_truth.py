"""zsim sweep and doctor tell the truth: failed points keep their one-line reason (table, JSON,
CSV, plots), a global batch too small for the GPUs says so, and the doctor names the op the
ledger shows at the peak."""
from __future__ import annotations

import csv
import json

import yaml

from tests.fuzz import run_cli
from tests.helpers import mapping


def _pinned_batch(tmp_path) -> str:
    # train_batch_size 16 and micro-batch 2 pinned, GAS free: DeepSpeed derives GAS = 16 // (2 x DP)
    raw = mapping(**{"deepspeed.train_batch_size": 16})
    del raw["training"]["gradient_accumulation_steps"]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_global_batch_below_one_sample_per_rank_says_so(tmp_path):
    out = run_cli(["run", _pinned_batch(tmp_path), "--quiet", "--set", "hardware.nodes=2"])
    assert out.code == 2
    line = out.stderr.strip()
    assert "\n" not in line and "gradient_accumulation_steps (0)" not in line
    assert ("deepspeed.train_batch_size: 16" in line and "train_micro_batch_size_per_gpu (2) x data-parallel size (16)"
            " = 32" in line and "DeepSpeed derives gradient_accumulation_steps = 0" in line
            and "multiple of 32" in line)
