"""One transformer layer against Korthikanti et al. 2022 Table 4 (the 22B model, h 6144, 64 heads,
s 2048, micro-batch 4, TP8 on one DGX A100): forward and backward milliseconds of one layer.

The rows are the "single transformer layer" rows of shared/reference/published-3d.csv, run as
published_3d.py maps them (its `scenario_mapping`), with 4 layers instead of 48 and GAS 1 (one
interior layer does not depend on how many follow it). zsim's figure for a pass is the wall time
its ops of `layers.1` cover in that pass (the union of their intervals in the trace: compute and
tensor-parallel collectives, a collective that overlaps a GEMM counted once); a recompute counts
in the backward, as Megatron's timing of the layer's backward includes it.
Usage: python benchmarks/korthikanti_layer.py [--csv PATH]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from published_3d import DEFAULT_CSV, ROOT, scenario_mapping  # noqa: E402  (the script's own folder is on sys.path)
from published_h100 import read_rows  # noqa: E402

LAYER = "layers.1."
PUBLISHED = {   # Table 4, ms: forward, backward (the csv keeps them in its note column)
    "k22-t4-22B-layer-baseline-no-recompute": (7.7, 11.9),
    "k22-t4-22B-layer-sequence-parallelism": (7.2, 11.8),
    "k22-t4-22B-layer-baseline-with-recompute": (7.7, 19.5),
    "k22-t4-22B-layer-selective-recompute": (7.7, 13.2),
    "k22-t4-22B-layer-selective-and-sequence": (7.2, 13.1),
}


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from zsim.api import run_scenario
    from zsim.config.scenario import scenario_from_mapping
    from zsim.specs.parallelism import ParallelismSpec

    if not args.csv.is_file():
        print(f"korthikanti_layer: error: --csv {args.csv}: file not found", file=sys.stderr)
        return 2
    fields = {f.name for f in dataclasses.fields(ParallelismSpec)}
    print(f"{'row':42} {'published fwd/bwd/total':>24} {'zsim fwd/bwd/total':>24} {'error':>7}")
    for row in read_rows(args.csv):
        if row["id"] not in PUBLISHED:
            continue
        mapping, _ = scenario_mapping({**row, "layers": "4"}, fields)
        _, trace = run_scenario(scenario_from_mapping(mapping, ROOT), steady=False)
        fwd, bwd = layer_passes_ms(trace)
        pf, pb = PUBLISHED[row["id"]]
        err = (fwd + bwd) / (pf + pb) - 1
        print(f"{row['id']:42} {f'{pf} / {pb} / {pf + pb:.1f}':>24} {f'{fwd:.2f} / {bwd:.2f} / {fwd + bwd:.2f}':>24} "
              f"{err * 100:>+6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
