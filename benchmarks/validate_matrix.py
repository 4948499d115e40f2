"""zsim validate over a matrix of configs (stages 0-3, bucket and prefetch sizes, two model sizes,
2 ranks) on each engine: per-case error of step time and peak memory, MAPE of both, and whether
the measured collective list equals zsim's schedule.

    python benchmarks/validate_matrix.py [--engines own,deepspeed,fsdp] [--steps 12] [--repeats 3]
                                         [--cases S-z0,M-z3] [--json out.json] [--profile P]

Each case runs --repeats times as separate launches, in interleaved passes (every case and
engine once per pass), and the measured step time is the median of the runs' medians: on a
shared 2-core VM a whole run can land in a slow minute (the same config's median moved by
10-50% between launches), which one launch cannot tell from a model error. "run spread" is
(max - min) / median of the runs' medians.

DeepSpeed runs in the python named by ZSIM_DS_PYTHON (e.g. /work/venv-ds/bin/python) with
DS_ACCELERATOR=cpu. Timing-sensitive: run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _validate_common import CASES, combine, run_case  # noqa: E402

from calibration.validation import mape  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", default="own,deepspeed,fsdp")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None,
                    help="hardware profile to predict with (default: each scenario's own, cpu-gloo-localhost)")
    a = ap.parse_args()
    cases = [c for c in CASES if not a.cases or c[0] in a.cases.split(",")]
    engines = a.engines.split(",")
    runs: dict[str, list[dict]] = {}
    for rep in range(a.repeats):
        print(f"pass {rep + 1}/{a.repeats}", file=sys.stderr, flush=True)
        for name, scen, ov in cases:
            for engine in engines:
                runs.setdefault(f"{engine}/{name}", []).append(run_case(scen, ov, engine, a.steps, profile=a.profile))
    results = {k: combine(v) for k, v in runs.items()}
    for engine in engines:
        print(f"\n== engine {engine}: {a.repeats} runs x {a.steps} steps per case ==")
        print(f"{'case':18s} {'meas ms':>9s} {'run spread':>10s} {'pred ms':>9s} {'err':>7s}  "
              f"{'meas MiB':>9s} {'pred MiB':>9s} {'err':>7s}  colls")
        st, pk = [], []
        for name, _, _ in cases:
            r = results[f"{engine}/{name}"]
            if "failed" in r:
                print(f"{name:18s} FAILED: {r['failed']}")
                continue
            m, p, e = r["measured"], r["predicted"], r["error"]
            st.append(e["step_time"])
            pk.append(e["peak_bytes"])
            print(f"{name:18s} {m['step_time_s'] * 1e3:9.1f} {100 * m['run_spread']:9.1f}% {p['step_time_s'] * 1e3:9.1f} "
                  f"{100 * e['step_time']:+6.1f}%  {m['peak_bytes'] / 2**20:9.1f} {p['peak_bytes'] / 2**20:9.1f} "
                  f"{100 * e['peak_bytes']:+6.1f}%  {'equal' if r['collectives_equal'] else 'differ'}", flush=True)
        ms, mp = mape(st), mape(pk)
        print(f"{engine}: step-time MAPE {100 * ms:.1f}%, peak-memory MAPE {100 * mp:.1f}% over {len(st)} cases"
              if st else f"{engine}: no successful case")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
