"""Predicted vs measured tokens/s/GPU on the dev set of issue 45: the DeepCompile benchmark
suite's eager DeepSpeed ZeRO-3 baselines, Llama-3-70B on 32 H100 (4 x 8), gradient
accumulation 1 (shared/reference/deepcompile-llama3-70b-zero3.csv).

Each row is mapped onto a scenario from what the source states and nothing else: the
llama3-70b preset (80 layers, hidden 8192, GQA 64/8, ffn 28672, vocab 128256), dgx-h100
(the network is not stated: the profile's 8 x NDR), bf16, HF gradient checkpointing (every
decoder layer re-run: activation_checkpointing full), ZeRO-3 with sub_group_size 1e8 and
DeepSpeed's defaults otherwise (the suite's ds_config.json.template sets no other ZeRO key),
run through accelerate (training.framework hf_trainer) with its client torch.optim.AdamW and
the batch padded to max_length (run_bench_lm.py: training.padding_mask). No figure is fitted to
these rows.
Usage: python benchmarks/deepcompile_dev.py [--csv PATH]
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CSV = ROOT.parent / "shared" / "reference" / "deepcompile-llama3-70b-zero3.csv"


def scenario_mapping(row: dict) -> dict:
    gpus, per_node = int(row["gpus"]), int(row["gpus_per_node"])
    return {
        "name": row["id"],
        "model": {"preset": "llama3-70b"},
        "hardware": {"profile": "dgx-h100", "nodes": gpus // per_node},
        "training": {"micro_batch_size": int(row["micro_batch"]),
                     "gradient_accumulation_steps": int(row["grad_accum"]), "seq_len": int(row["seq_len"]),
                     "precision": "bf16", "activation_checkpointing": "full", "framework": "hf_trainer",
                     "padding_mask": True},
        # the suite's client torch.optim.AdamW(lr=2e-5) (run_bench_lm.py), torch's defaults otherwise
        # (foreach on CUDA, weight_decay 1e-2): the block DeepSpeed turns into that optimizer
        "deepspeed": {"bf16": {"enabled": True},
                      "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "torch_adam": True}},
                      "zero_optimization": {"stage": int(row["zero_stage"]), "sub_group_size": 100_000_000}},
    }


def measured_tokens_per_gpu(row: dict) -> float:
    return float(re.match(r"\s*([0-9.]+)\s*tokens/s/GPU", row["measured"]).group(1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).parent))
    from published_h100 import read_rows
    from zsim.api import run_scenario
    from zsim.config.scenario import scenario_from_mapping

    if not args.csv.is_file():
        print(f"no dev set at {args.csv}", file=sys.stderr)
        return 2
    errors = []
    print(f"{'id':7} {'seq':>5} {'mb':>3} {'measured':>9} {'predicted':>9} {'error':>7} {'step_s':>7} {'exposed_s':>9}")
    for row in read_rows(args.csv):
        sc = scenario_from_mapping(scenario_mapping(row), ROOT)
        result, _ = run_scenario(sc)
        meas = measured_tokens_per_gpu(row)
        err = result.tokens_per_s_per_gpu / meas - 1
        errors.append(abs(err))
        print(f"{row['id']:7} {row['seq_len']:>5} {row['micro_batch']:>3} {meas:9.1f} {result.tokens_per_s_per_gpu:9.1f} "
              f"{100 * err:+6.1f}% {result.step_time_s:7.3f} {result.comm.exposed_time_s:9.3f}")
    print(f"\nrows: {len(errors)}  MAPE: {100 * statistics.mean(errors):.1f}%  "
          f"median APE: {100 * statistics.median(errors):.1f}%  max APE: {100 * max(errors):.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
