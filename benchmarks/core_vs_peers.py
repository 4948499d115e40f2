"""Own core's step time against DeepSpeed 0.19.8's and FSDP2's on the same configs, run
alternately (own, deepspeed, fsdp, own, ...) so machine drift hits all three alike. Prints the
median step time of each engine per config and the ratios own/DeepSpeed and own/FSDP2 with
the spread over rounds.

    ZSIM_DS_PYTHON=/work/venv-ds/bin/python python benchmarks/core_vs_peers.py [--rounds 3] [--steps 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _validate_common import CASES, run_case  # noqa: E402

DEFAULT = "S-z1,S-z2,S-z3,M-z1,M-z2-b2e6,M-z3"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cases", default=DEFAULT)
    a = ap.parse_args()
    engines = ("own", "deepspeed", "fsdp")
    cases = [c for c in CASES if c[0] in a.cases.split(",")]
    print(f"{'case':18s} {'own ms':>8s} {'ds ms':>8s} {'fsdp ms':>8s} {'own/ds':>14s} {'own/fsdp':>14s}")
    all_ds, all_fs = [], []
    for name, scen, ov in cases:
        t = {e: [] for e in engines}
        for _ in range(a.rounds):
            for e in engines:
                r = run_case(scen, ov, e, a.steps)
                if "failed" not in r:
                    t[e].append(r["measured"]["step_time_s"])
                else:
                    print(f"  {name} {e}: {r['failed']}", file=sys.stderr)
        med = {e: statistics.median(v) if v else float("nan") for e, v in t.items()}

        def ratio(other):
            rs = [o / x for o, x in zip(t["own"], t[other])]
            if not rs:
                return float("nan"), "n/a"
            return statistics.median(rs), f"{statistics.median(rs):.2f} [{min(rs):.2f}-{max(rs):.2f}]"
        rd, sd = ratio("deepspeed")
        rf, sf = ratio("fsdp")
        all_ds.append(rd)
        all_fs.append(rf)
        print(f"{name:18s} {med['own'] * 1e3:8.1f} {med['deepspeed'] * 1e3:8.1f} {med['fsdp'] * 1e3:8.1f} {sd:>14s} {sf:>14s}",
              flush=True)
    print(f"median own/DeepSpeed {statistics.median(all_ds):.2f}, own/FSDP2 {statistics.median(all_fs):.2f} "
          f"(ratios per round in brackets: min-max)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
