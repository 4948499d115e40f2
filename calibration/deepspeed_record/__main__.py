"""python -m calibration.deepspeed_record: record one case (under torchrun), all cases, list
them, or summarize fixtures (see __init__.py)."""
from __future__ import annotations

import argparse
import os

from calibration.deepspeed_record.cases import CASES
from calibration.deepspeed_record.summary import summarize


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--summarize", nargs="+", metavar="JSON")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                  "tests", "fixtures", "deepspeed"))
    a = ap.parse_args()
    if a.summarize:
        for p in a.summarize:
            print(summarize(p))
        return
    if a.list:
        print("\n".join(CASES))
        return
    # torch is imported only to record (summarizing and listing need none)
    from calibration.deepspeed_record.record import run_all, run_case

    if a.all:
        run_all(list(CASES), os.path.abspath(a.out))
        return
    if a.case not in CASES:
        ap.error(f"unknown case {a.case!r}; use --list")
    run_case(a.case, os.path.abspath(a.out))


if __name__ == "__main__":
    main()
