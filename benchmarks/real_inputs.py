"""Issue 46's figure: of the real public files in tests/fixtures/real_inputs/, how many simulate as
shipped (with only launch arguments added: the GPU count, the model of a bare ds_config, and for a
recipe whose Hub model has no public config.json copy, its architecture: test_real_inputs.MODEL_ARGS),
how many are refused correctly (one line, exit 2, naming the field, where DeepSpeed
rejects them), and how many fail wrongly, each with its reason. The cases and the judgement are
tests/config/test_real_inputs.py's (run_case, judge); PENDING marks are ignored here.

    python benchmarks/real_inputs.py [--verbose]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.config.test_real_inputs import expectation, judge, rows, run_case  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true", help="also list the files that pass")
    a = ap.parse_args()
    all_rows = rows()
    tally: Counter = Counter()
    wrong = []
    start = time.perf_counter()
    for row in all_rows:
        out, err = io.StringIO(), io.StringIO()

        def capture():
            got = out.getvalue(), err.getvalue()
            out.seek(0), out.truncate(), err.seek(0), err.truncate()
            return got
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            outcome = run_case(row, all_rows, Path(tmp), capture)
        reason = judge(row, all_rows, outcome)
        want = expectation(row)
        if reason is not None:
            tally["fail wrongly"] += 1
            wrong.append((row["file"], reason))
        elif outcome.rc == 0:
            tally["simulate as shipped"] += 1
            if a.verbose:
                print(f"  ok  {row['file']}: step {outcome.result['step_time_s']:.3f} s")
        else:
            tally["refused correctly"] += 1
            if a.verbose:
                print(f"  ok  {row['file']} ({want}): {outcome.err.strip()[:160]}")
    total = len(all_rows)
    accepted = sum(expectation(r) == "simulates" for r in all_rows)
    rejected = sum(expectation(r) == "refused" for r in all_rows)
    print(f"{total} files ({accepted} DeepSpeed runs, {rejected} DeepSpeed rejects, "
          f"{total - accepted - rejected} accelerate FSDP/DDP configs) in {time.perf_counter() - start:.1f} s:")
    for key in ("simulate as shipped", "refused correctly", "fail wrongly"):
        print(f"  {key:20s} {tally[key]:3d}")
    for file, reason in wrong:
        print(f"  FAIL {file}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
