"""Wall time of simulating one training step of GPT-3 175B, ZeRO-3, 128 nodes of dgx-a100-80g
(1024 GPUs), at GAS 1 and GAS 16, and simulated events per second.
Targets (issue 2): GAS 1 <= 0.5 s (goal 0.1 s). Prints median and spread over repetitions.
Usage: python benchmarks/sim_speed.py [--repeat N]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zsim.config.scenario import scenario_from_mapping  # noqa: E402
from zsim.engine.sim import simulate  # noqa: E402
from zsim.result.summarize import summarize  # noqa: E402
from zsim.schedule.build import build_schedule  # noqa: E402


def scenario(gas: int):
    return scenario_from_mapping({
        "name": f"gpt3-175b-zero3-1024-gas{gas}",
        "model": {"preset": "gpt3-175b"},
        "hardware": {"profile": "dgx-a100-80g", "nodes": 128},
        "training": {"micro_batch_size": 1, "gradient_accumulation_steps": gas, "seq_len": 2048,
                     "precision": "bf16", "activation_checkpointing": "full"},
        "deepspeed": {"zero_optimization": {"stage": 3, "overlap_comm": True}},
    }, ROOT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    for gas in (1, 16):
        sc = scenario(gas)
        walls, events = [], 0
        for _ in range(args.repeat if gas == 1 else max(3, args.repeat // 2)):
            t0 = time.perf_counter()
            wl, sched = build_schedule(sc)
            trace = simulate(sched, sc.cluster, sc.precision)
            summarize(sc, wl, trace)
            walls.append(time.perf_counter() - t0)
            events = trace.events_processed
        med = statistics.median(walls)
        print(f"GPT-3 175B ZeRO-3 1024 GPUs GAS {gas:>2}: wall median {med:.3f} s "
              f"(min {min(walls):.3f}, max {max(walls):.3f}, n={len(walls)}), {events} ops, "
              f"{events / med:,.0f} ops/s, simulated step {trace.step_time_s:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
