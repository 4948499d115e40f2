"""Predicted vs published tokens/s/GPU for every row of shared/reference/published-h100-bf16.csv
(MosaicML llm-foundry MPT benchmarks, PyTorch FSDP FULL_SHARD, bf16, H100 80GB SXM).

FSDP FULL_SHARD is modelled as ZeRO-3 (zsim has no FSDP schedule yet) with FSDP's unit of
communication: one transformer block, so the prefetch and reduce buckets are one block's
parameters. One profile (hardware_profiles/dgx-h100.yaml) and one code path serve every row.
Usage: python benchmarks/published_h100.py [--csv PATH]
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CSV = ROOT.parent / "shared" / "reference" / "published-h100-bf16.csv"


def scenario_mapping(row: dict) -> dict:
    layers, hidden = int(row["layers"]), int(row["hidden"])
    block_params = 12 * hidden * hidden
    seq = int(row["seq_len"])
    return {
        "name": f"{row['model']}-s{seq}-g{row['gpus']}",
        "model": {"preset": row["model"], "layers": layers, "hidden": hidden, "heads": int(row["heads"]),
                  "vocab": int(row["vocab"]), "seq_len": seq},
        # FSDP gathers and reduce-scatters one flat parameter per unit (all_gather_into_tensor,
        # reduce_scatter_tensor): none of DeepSpeed ZeRO-3's per-rank Python loops
        # (see [Note: per-rank host loops]) and none of its per-module hooks
        "hardware": {"profile": "dgx-h100", "nodes": int(row["gpus"]) // 8,
                     "override": {"cpu": {"zero3_rank_view_us": 0.0, "zero3_hook_fwd_us": 0.0,
                                          "zero3_hook_bwd_us": 0.0}}},
        "training": {"micro_batch_size": int(row["micro_batch"]), "gradient_accumulation_steps": int(row["grad_accum"]),
                     "seq_len": seq, "precision": "bf16", "flash_attention": True,
                     "fused_cross_entropy": True,  # llm-foundry uses flash-attn's fused CrossEntropyLoss
                     "activation_checkpointing": "full" if row["act_ckpt"] == "true" else "none"},
        "deepspeed": {"zero_optimization": {"stage": 3, "overlap_comm": True,
                                            "stage3_prefetch_bucket_size": block_params,
                                            "reduce_bucket_size": block_params}},
    }


def read_rows(path: Path) -> list[dict]:
    lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    return list(csv.DictReader(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from zsim.api import run_scenario
    from zsim.config.scenario import scenario_from_mapping
    from zsim.units import GiB

    if not args.csv.is_file():
        print(f"published_h100: error: --csv {args.csv}: file not found", file=sys.stderr)
        return 2
    rows = read_rows(args.csv)
    errors, ooms = [], 0
    t0 = time.perf_counter()
    print(f"{'model':9} {'seq':>6} {'gpus':>4} {'mb':>3} {'gas':>3} {'ckpt':>5} {'published':>10} {'predicted':>10} "
          f"{'error':>8} {'MFU pub':>8} {'MFU sim':>8} {'peak GiB':>9}")
    for row in rows:
        sc = scenario_from_mapping(scenario_mapping(row), ROOT)
        result, _ = run_scenario(sc)
        pub = float(row["tokens_per_s_per_gpu"])
        pred = result.tokens_per_s_per_gpu
        err = (pred - pub) / pub
        errors.append(abs(err))
        fits = result.memory.fits
        ooms += not fits
        print(f"{row['model']:9} {row['seq_len']:>6} {row['gpus']:>4} {row['micro_batch']:>3} {row['grad_accum']:>3} "
              f"{row['act_ckpt']:>5} {pub:>10.0f} {pred:>10.0f} {err * 100:>7.1f}% {float(row['mfu_pct']):>7.1f}% "
              f"{result.mfu * 100:>7.1f}% {result.memory.peak_bytes / GiB:>8.1f}{'' if fits else ' OOM'}")
    wall = time.perf_counter() - t0
    print(f"\nrows: {len(rows)}  MAPE: {statistics.mean(errors) * 100:.1f}%  median APE: "
          f"{statistics.median(errors) * 100:.1f}%  max APE: {max(errors) * 100:.1f}%  predicted OOM: {ooms}  "
          f"wall: {wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
