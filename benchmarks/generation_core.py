"""zsim's generation model against the own core's decode loop (calibration/core/generate.py) on
this CPU: per case the prefill and the decode steps measured (median of --repeat runs, one
thread) beside zsim's prediction on the profile given, and whether the op lists and the KV cache
agree (see [Note: generation]).

    OMP_NUM_THREADS=1 python benchmarks/generation_core.py --profile cpu-xeon-vm-2ranks [--repeat 3]

The profile should describe this machine (`zsim calibrate`); the cases were not used to fit it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from calibration.core.generate import generate  # noqa: E402
from zsim.api import run_generation  # noqa: E402
from zsim.config.scenario import scenario_from_mapping  # noqa: E402
from zsim.schedule.ir import OpKind  # noqa: E402
from zsim.workload.generation import kv_cache_bytes, kv_shapes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# two blocks of a 7B-class model (Llama-2-7B's widths, GQA as Llama-3's), a short vocabulary: the
# weight matrices a user's decode streams, on a CPU in minutes
MODEL = {"layers": 2, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn_hidden": 11008, "vocab": 8192, "seq_len": 4096,
         "position": "rope", "norm": "rmsnorm", "glu": True, "fused_qkv": False, "tied_embeddings": False,
         "bias": False}
# (precision, batch, prompt, new tokens)
CASES = [("fp32", 1, 128, 16), ("fp32", 4, 256, 16), ("fp32", 16, 64, 16), ("fp32", 1, 1024, 12),
         ("bf16", 1, 128, 16), ("bf16", 4, 256, 16)]


def scenario(profile: str, precision: str, batch: int, prompt: int, new: int):
    return scenario_from_mapping({
        "name": f"{precision}-b{batch}-p{prompt}-n{new}", "model": MODEL,
        "hardware": {"profile": profile, "nodes": 1, "gpus_per_node": 1},
        "training": {"precision": precision},
        "deepspeed": {"zero_optimization": {"stage": 0}, **({"bf16": {"enabled": True}} if precision == "bf16" else {})},
        "inference": {"batch_size": batch, "prompt_len": prompt, "new_tokens": new}}, ROOT)


def measure(profile: str, case: str, repeat: int) -> list[list[dict]]:
    """The core's runs of one case, in a fresh process (the allocator's state, glibc's mmap
    threshold among it, is then every case's own): per run, per forward, its modules, cache bytes
    and time."""
    out = subprocess.run([sys.executable, __file__, "--profile", profile, "--measure", case, "--repeat", str(repeat)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu-xeon-vm-2ranks")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--measure", help=argparse.SUPPRESS)   # one case's core runs, as JSON (a subprocess)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.measure:
        precision, batch, prompt, new = a.measure.split(",")
        sc = scenario(a.profile, precision, int(batch), int(prompt), int(new))
        runs = [generate(sc) for _ in range(a.repeat)]
        print(json.dumps([[{"modules": f.modules, "kv": f.kv_cache_bytes, "time_s": f.time_s} for f in r] for r in runs]))
        return 0
    print(f"profile {a.profile}; median of {a.repeat} runs, one fresh process a case; ratio = zsim / measured")
    print(f"{'case':24} {'prefill ms':>22} {'ratio':>6} {'decode ms':>22} {'ratio':>6}  ops  kv")
    for precision, batch, prompt, new in CASES:
        sc = scenario(a.profile, precision, batch, prompt, new)
        g, trace = run_generation(sc)
        runs = measure(a.profile, f"{precision},{batch},{prompt},{new}", a.repeat)
        pre = statistics.median(r[0]["time_s"] for r in runs)
        dec = statistics.median(sum(f["time_s"] for f in r[1:]) for r in runs)
        ops = all(tuple(op.payload.module for op in trace.schedule.ops if op.micro_step == f
                        and op.kind == OpKind.FORWARD) == tuple(fwd["modules"]) for f, fwd in enumerate(runs[0])
                  if any(op.micro_step == f for op in trace.schedule.ops))
        shapes = kv_shapes(sc.model, 1).values()
        kv = all(fwd["kv"] == sum(kv_cache_bytes(s, batch, prompt + f, fwd_bytes(precision)) for s in shapes)
                 for f, fwd in enumerate(runs[0]))
        print(f"{sc.name:24} {pre * 1e3:9.1f} vs {g.prefill_time_s * 1e3:9.1f} {g.prefill_time_s / pre:6.3f} "
              f"{dec * 1e3:9.1f} vs {g.decode_time_s * 1e3:9.1f} {g.decode_time_s / dec:6.3f}  "
              f"{'=' if ops else 'DIFF'}  {'=' if kv else 'DIFF'}", flush=True)
    return 0


def fwd_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


if __name__ == "__main__":
    raise SystemExit(main())
