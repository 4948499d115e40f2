"""A 1,024-point sweep over Llama-2 7B and 70B on 8-1024 GPUs (stage, micro-batch, checkpointing,
overlap_comm); prints wall time and points/s. Target (issue 6): <= 60 s on this 2-core machine.
Usage: python benchmarks/sweep_speed.py [--workers N]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zsim.commands.sweep import parse_vary, run_sweep  # noqa: E402

BASE = {
    "name": "llama2-sweep",
    "model": {"preset": "llama2-7b"},
    "hardware": {"profile": "dgx-a100-80g", "nodes": 1},
    "training": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "seq_len": 4096, "precision": "bf16"},
    "deepspeed": {"zero_optimization": {"stage": 3}},
}
VARY = ["model.preset=llama2-7b,llama2-70b", "hardware.nodes=1,2,4,8,16,32,64,128",
        "deepspeed.zero_optimization.stage=0,1,2,3", "training.micro_batch_size=1,2,4,8",
        "training.activation_checkpointing=none,full", "deepspeed.zero_optimization.overlap_comm=true,false"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "base.yaml"
        path.write_text(yaml.safe_dump(BASE))
        axes = parse_vary(VARY)
        t0 = time.perf_counter()
        rows = run_sweep(str(path), (), axes, args.workers, progress=False)
        wall = time.perf_counter() - t0
    ok = sum(r["ok"] for r in rows)
    fits = sum(bool(r.get("memory.fits")) for r in rows)
    print(f"{len(rows)} points ({ok} simulated, {len(rows) - ok} rejected, {fits} fit) with {args.workers} workers: "
          f"wall {wall:.1f} s, {len(rows) / wall:.1f} points/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
