"""Predicted vs published Megatron-LM 3D-parallel throughput for the rows of
shared/reference/published-3d.csv (Narayanan et al. SC'21 Table 1, Korthikanti et al. 2022 Table 5, ...).

Each row with a measurement (measured_tflops_per_gpu or measured_iteration_s) and a full
configuration becomes a zsim scenario: a GPT (learned positions, LayerNorm, biases, fused QKV,
GeLU MLP, tied embeddings, dropout) on the shipped profile of its GPU (dgx-a100-80g, dgx-h100),
parallelism.tensor / pipeline / sequence_parallel from the row, data parallel = gpus / (tp x pp),
micro-batches per step = global batch / (micro batch x dp), recompute full or selective, ZeRO
stage 0 unless the row names one. Megatron of 2021-22 ran without FlashAttention, so the rows do.
Its fused kernels (FusedLayerNorm, bias-GeLU, bias-dropout-add, FusedScaleMaskSoftmax, gradient
accumulation fusion) need no setting: the workload's memory-bound passes are already theirs
(docs/validation.md, "Megatron's fused kernels against zsim's per-layer charges").
Per-layer timing rows and rows missing part of their configuration are skipped, saying why.

Each row is compared in its own convention: SC'21's TFLOP/s per GPU count the recompute forward
pass (the paper's eq. 3, F = 96 B s l h^2 (1 + s/6h + V/16lh)), applied to zsim's predicted
iteration time; rows that publish an iteration time are compared on it. No constant is fitted
to these rows: the profiles are the shipped ones.

--table4: Korthikanti et al. 2022 Table 4 instead, one transformer layer of the 22B model (h
6144, 64 heads, s 2048, micro-batch 4, TP8 on one DGX A100), forward and backward ms: its
"single transformer layer" rows run with 4 layers instead of 48 and GAS 1 (one interior layer
does not depend on how many follow it). zsim's figure for a pass is the wall time its ops of
`layers.1` cover in that pass (the union of their intervals in the trace: compute and
tensor-parallel collectives, a collective beside a GEMM counted once); a recompute counts in
the backward, as Megatron's timing of the layer's backward includes it.
Usage: python benchmarks/published_3d.py [--csv PATH] [--only ID_SUBSTRING] [--table4]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

from published_h100 import read_rows  # noqa: E402  (the script's own folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CSV = ROOT.parent / "shared" / "reference" / "published-3d.csv"
PROFILES = {"A100-80GB": "dgx-a100-80g", "H100": "dgx-h100"}
NEEDED = ("layers", "hidden", "heads", "vocab", "seq", "tp", "pp", "dp", "micro_batch", "global_batch", "recompute")


def profile_of(gpu: str) -> str | None:
    """The shipped profile of the row's GPU: exact type names only (an A100 of unstated memory
    or an A800 has none)."""
    for prefix, profile in PROFILES.items():
        if gpu == prefix or gpu.startswith(prefix + " "):
            return profile
    return None


def skip_reason(row: dict) -> str | None:
    if "single transformer layer" in row["model"]:
        return "a per-layer timing row (one transformer layer, not a training step)"
    if not (row["measured_tflops_per_gpu"] or row["measured_iteration_s"]):
        return "no published measurement"
    missing = [k for k in NEEDED if not row[k]]
    if missing:
        return f"configuration not published: {', '.join(missing)}"
    if profile_of(row["gpu"]) is None:
        return f"no shipped profile for {row['gpu']!r}"
    return None


def interleaving(row: dict, spec_fields: set[str]) -> tuple[dict, str]:
    """The row's virtual stages, passed only when zsim's ParallelismSpec models interleaving."""
    v = int(row["virtual_stages"] or 1)
    if v <= 1:
        return {}, ""
    if "virtual_stages" in spec_fields:
        return {"virtual_stages": v, "pipeline_schedule": "interleaved"}, ""
    return {}, f"published with {v} virtual stages (interleaved 1F1B); zsim runs it non-interleaved"


def scenario_mapping(row: dict, spec_fields: set[str]) -> tuple[dict, str]:
    gpus, gpn = int(row["gpus"]), int(row["gpus_per_node"] or 8)
    tp, pp, dp = int(row["tp"]), int(row["pp"]), int(row["dp"])
    assert tp * pp * dp == gpus, row["id"]
    mb = int(row["micro_batch"])
    gas = int(row["global_batch"]) // (mb * dp)
    hidden = int(row["hidden"])
    precision = "bf16" if "bf16" in row["precision"] else "fp16"
    par, note = interleaving(row, spec_fields)
    par.update(tensor=tp, pipeline=pp, sequence_parallel=row["sequence_parallel"] == "yes")
    return {
        "name": row["id"],
        "model": {"layers": int(row["layers"]), "hidden": hidden, "heads": int(row["heads"]),
                  "ffn_hidden": int(row["ffn_hidden"] or 4 * hidden), "vocab": int(row["vocab"]),
                  "seq_len": int(row["seq"]), "position": "learned", "tied_embeddings": True, "norm": "layernorm",
                  "bias": True, "glu": False, "fused_qkv": True},
        "hardware": {"profile": profile_of(row["gpu"]), "nodes": gpus // gpn, "gpus_per_node": gpn},
        "parallelism": par,
        "training": {"micro_batch_size": mb, "gradient_accumulation_steps": gas, "seq_len": int(row["seq"]),
                     "precision": precision, "flash_attention": False, "dropout": True,
                     "activation_checkpointing": row["recompute"],
                     # Megatron-LM's default: the wgrad GEMM accumulates into main_grad
                     "gradient_accumulation_fusion": True},
        "deepspeed": {"zero_optimization": {"stage": int(row["zero_stage"] or 0)}},
    }, note


TABLE4 = {   # Korthikanti et al. 2022 Table 4, ms: forward, backward (the csv keeps them in its notes)
    "k22-t4-22B-layer-baseline-no-recompute": (7.7, 11.9),
    "k22-t4-22B-layer-sequence-parallelism": (7.2, 11.8),
    "k22-t4-22B-layer-baseline-with-recompute": (7.7, 19.5),
    "k22-t4-22B-layer-selective-recompute": (7.7, 13.2),
    "k22-t4-22B-layer-selective-and-sequence": (7.2, 13.1),
}
LAYER = "layers.1."


def union_s(intervals) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def layer_passes_ms(trace) -> tuple[float, float]:
    """(forward, backward) ms that layer 1's ops cover in the trace."""
    from zsim.schedule.ir import MEASURED_PASS

    by_pass: dict[str, list] = {"forward": [], "backward": []}
    for op, t in zip(trace.schedule.ops, trace.timings):
        module = getattr(op.payload, "module", "")
        if isinstance(module, str) and module.startswith(LAYER):
            by_pass[MEASURED_PASS[op.phase]].append((t.start_s, t.end_s))
    return union_s(by_pass["forward"]) * 1e3, union_s(by_pass["backward"]) * 1e3


def table4(rows, spec_fields: set[str], run_scenario, scenario_from_mapping) -> None:
    print(f"{'row':42} {'published fwd/bwd/total':>24} {'zsim fwd/bwd/total':>24} {'error':>7}")
    for row in rows:
        if row["id"] not in TABLE4:
            continue
        mapping, _ = scenario_mapping({**row, "layers": "4"}, spec_fields)
        _, trace = run_scenario(scenario_from_mapping(mapping, ROOT), steady=False)
        fwd, bwd = layer_passes_ms(trace)
        pf, pb = TABLE4[row["id"]]
        err = (fwd + bwd) / (pf + pb) - 1
        print(f"{row['id']:42} {f'{pf} / {pb} / {pf + pb:.1f}':>24} {f'{fwd:.2f} / {bwd:.2f} / {fwd + bwd:.2f}':>24} "
              f"{err * 100:>+6.1f}%")


def sc21_flops(row: dict) -> float:
    """Narayanan et al. 2021 eq. 3: FLOPs of one iteration, the recompute forward included."""
    batch, s, n, h, vocab = (int(row[k]) for k in ("global_batch", "seq", "layers", "hidden", "vocab"))
    return 96.0 * batch * s * n * h * h * (1 + s / (6 * h) + vocab / (16 * n * h))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--only", default="", help="run only the rows whose id contains this")
    ap.add_argument("--table4", action="store_true", help="one layer against Korthikanti et al. 2022 Table 4 instead")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from zsim.api import run_scenario
    from zsim.config.scenario import scenario_from_mapping
    from zsim.specs.parallelism import ParallelismSpec
    from zsim.units import GiB

    if not args.csv.is_file():
        print(f"published_3d: error: --csv {args.csv}: file not found", file=sys.stderr)
        return 2
    spec_fields = {f.name for f in dataclasses.fields(ParallelismSpec)}
    if args.table4:
        table4(read_rows(args.csv), spec_fields, run_scenario, scenario_from_mapping)
        return 0
    errors, unfit, notes = [], [], []
    print(f"{'id':24} {'gpus':>5} {'tp':>2} {'pp':>3} {'dp':>3} {'gas':>4} {'ckpt':>9} {'metric':>10} "
          f"{'published':>10} {'predicted':>10} {'error':>7} {'peak GiB':>9}")
    for row in read_rows(args.csv):
        if args.only not in row["id"]:
            continue
        why = skip_reason(row)
        if why:
            print(f"{row['id']:24} skipped: {why}")
            continue
        mapping, note = scenario_mapping(row, spec_fields)
        if note:
            notes.append(f"{row['id']}: {note}")
        result, _ = run_scenario(scenario_from_mapping(mapping, ROOT))
        step = result.step_time_s
        if row["measured_tflops_per_gpu"]:
            metric, pub = "TFLOP/s", float(row["measured_tflops_per_gpu"])
            pred = sc21_flops(row) / (step * int(row["gpus"])) / 1e12
        else:
            metric, pub, pred = "iter s", float(row["measured_iteration_s"]), step
        err = (pred - pub) / pub
        errors.append(abs(err))
        if not result.fits:
            unfit.append(row["id"])
        tr = mapping["training"]
        print(f"{row['id']:24} {row['gpus']:>5} {row['tp']:>2} {row['pp']:>3} {row['dp']:>3} "
              f"{tr['gradient_accumulation_steps']:>4} {row['recompute']:>9} {metric:>10} {pub:>10.2f} {pred:>10.2f} "
              f"{err * 100:>6.1f}% {result.memory.peak_bytes / GiB:>8.1f}{'' if result.fits else ' OOM'}")
    for note in notes:
        print(f"note: {note}")
    if errors:
        print(f"\nrows: {len(errors)}  MAPE: {statistics.mean(errors) * 100:.1f}%  median APE: "
              f"{statistics.median(errors) * 100:.1f}%  max APE: {max(errors) * 100:.1f}%  "
              f"predicted not to fit: {len(unfit)}{' (' + ', '.join(unfit) + ')' if unfit else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
