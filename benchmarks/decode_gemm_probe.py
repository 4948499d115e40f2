"""The calibration's decode-GEMM benchmark (calibration/harness/bench_compute.py bench_decode_gemms)
run alone, to add gemm_decode_efficiency to a profile calibrated before the benchmark existed:
it fits the figure as `zsim calibrate` does (fit_compute.fit_gemm_decode) against the profile's
own device bandwidth and launch overhead, and writes the records beside its run.

    torchrun --standalone --nproc-per-node W benchmarks/decode_gemm_probe.py --profile P --dtypes fp32,bf16 --out R.json

Run it as the profile was calibrated (the same ranks on the same machine).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from calibration.harness.bench_compute import bench_decode_gemms  # noqa: E402
from calibration.harness.context import Ctx  # noqa: E402
from calibration.harness.fit_compute import fit_gemm_decode  # noqa: E402
from calibration.harness.plan import default_plan  # noqa: E402
from zsim.config.profile import load_profile  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dtypes = tuple(a.dtypes.split(","))
    plan = default_plan("quick", dtypes=dtypes)
    prof = load_profile(a.profile, None, Path.cwd())
    dist.init_process_group("gloo")
    out = {"profile": a.profile, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "world_size": dist.get_world_size(), "records": [], "gemm_decode_efficiency": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Ctx(plan, tmp)
        for d in dtypes:
            recs = bench_decode_gemms(ctx, d, plan.layers[0])
            gpu = prof.gpu.for_dtype(d)
            out["records"] += recs
            out["gemm_decode_efficiency"][d] = fit_gemm_decode(recs, gpu.kernel_overhead_us * 1e-6, gpu.hbm_bw_GBps)
    if dist.get_rank() == 0:
        for r in out["records"]:
            r.pop("times_s", None)
        Path(a.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        print(json.dumps(out["gemm_decode_efficiency"]))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
