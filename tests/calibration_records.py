"""Synthetic calibration records and runs, and the zsim CLI as a subprocess, shared by the
calibration tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from calibration.harness.plan import LayerShape, layer_gemms
from zsim.hardware.collectives import Tier, ring_cost

ROOT = Path(__file__).resolve().parents[1]
SIZES = [1024 * 4**i for i in range(8)]


def coll_records(tier: Tier, n=2, ops=("all_gather", "all_reduce", "broadcast")):
    return [{"kind": "collective", "op": op, "group": "world", "tier": "intra_node", "ranks": n, "dtype": "fp32",
             "size_bytes": s, "time_s": ring_cost(op.removesuffix("_coalesced"), s, n, tier, "intra_node",
                                                  op.endswith("_coalesced")).time_s}
            for op in ops for s in SIZES]


def compute_records(dtype: str, slowdown: float = 1.0) -> list[dict]:
    """One layer's GEMM, attention, memory-bound and layer records in `dtype`, every kernel
    `slowdown` times slower than the bf16 reference (an emulated dtype)."""
    L = {"hidden": 128, "heads": 2, "seq_len": 64, "micro_batch": 1}
    recs = [{"kind": "gemm", "dtype": dtype, "module": name, "pass": pas, "m": m, "n": n, "k": k,
             "flops": 2.0 * m * n * k, "time_s": slowdown * 2.0 * m * n * k / 1e11}
            for name, pas, m, n, k in layer_gemms(LayerShape(**L))]
    return recs + [{"kind": "attention", "dtype": dtype, "pass": "fwd", "flops": 1e6, "time_s": slowdown * 1e-4},
                   {"kind": "attention", "dtype": dtype, "pass": "bwd", "flops": 2.5e6, "time_s": slowdown * 5e-4},
                   {"kind": "membound", "dtype": dtype, "pass": "fwd", "bytes": 1e5, "time_s": slowdown * 1e-5},
                   {"kind": "layer", "dtype": dtype, "layer": "x", "pass": "fwd", **L, "time_s": slowdown * 1e-3},
                   {"kind": "layer", "dtype": dtype, "layer": "x", "pass": "bwd", **L, "time_s": slowdown * 2e-3}]


def synthetic_run():
    recs = coll_records(Tier(4e9, 30e-6, ((1024, 0.05), (1 << 24, 1.0)))) + compute_records("bf16")
    recs += [{"kind": "kernel_overhead", "time_s": 3e-6}, {"kind": "autograd_overhead", "time_s": 13e-6},
             {"kind": "memcpy", "where": "host", "GBps": 20.0, "time_s": 1e-3},
             {"kind": "adam", "impl": "torch.optim.Adam(fused)", "device": "cpu", "params": 100, "threads": 2,
              "params_per_s": 4e8, "time_s": 1e-3},
             {"kind": "file_io", "op": "read", "node_GBps": 2.0, "o_direct": True, "time_s": 1.0},
             {"kind": "file_io", "op": "write", "node_GBps": 1.0, "o_direct": True, "time_s": 1.0},
             {"kind": "interference", "gemm_alone_s": 1.0, "gemm_during_comm_s": 1.25, "comm_alone_s": 1.0,
              "comm_during_gemm_s": 2.0}]
    prov = {"world_size": "2", "ranks_per_node": "2", "nodes": "1", "backend": "gloo", "cpu_cores": "2",
            "host_memory_GiB": "16", "mode": "quick", "date": "2026-01-01T00:00:00Z", "hosts": "h"}
    return recs, prov


def zsim_cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "zsim.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout)


def run_doc(tmp_path, name, factor, date, **prov_changes):
    """A complete run whose all-reduce calls take factor * k ms at the k-th size."""
    recs, prov = synthetic_run()
    recs = [r for r in recs if r["kind"] != "collective"]
    recs += [{"kind": "collective", "op": "all_reduce", "group": "world", "tier": "intra_node", "ranks": 2,
              "dtype": "bf16", "size_bytes": s, "time_s": factor * 1e-3 * k, "times_s": [factor * 1e-3 * k] * 4}
             for k, s in enumerate(SIZES, start=1)]
    prov = {**prov, "date": date, **prov_changes}
    d = tmp_path / "calibration" / "runs" / name
    d.mkdir(parents=True)
    (d / "records.json").write_text(json.dumps({"format": 1, "status": "complete", "error": "", "provenance": prov,
                                                "plan": {}, "records": recs}))
    return d, recs, prov
