"""The calibration's transformer-layer benchmark (calibration/harness/bench_compute.py bench_layer:
forward and backward alternating, per repetition the slowest rank, median of the quick plan's
repetitions), run alone: how fast the machine runs one layer now, beside what the profile's
calibration measured (validate_random.py --probe).

    torchrun --standalone --nproc-per-node W benchmarks/_layer_probe.py --layer H,HEADS,SEQ,MB --dtype fp32 --out p.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from calibration.harness.bench_compute import bench_layer  # noqa: E402
from calibration.harness.context import Ctx  # noqa: E402
from calibration.harness.plan import LayerShape, default_plan  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layer", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    layer = LayerShape(*(int(x) for x in a.layer.split(",")))
    plan = default_plan("quick", layers=(layer,), dtypes=(a.dtype,))
    dist.init_process_group("gloo")
    with tempfile.TemporaryDirectory() as tmp:
        records = bench_layer(Ctx(plan, tmp), a.dtype, layer)
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps({r["pass"]: r["time_s"] for r in records}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
