"""Regenerate tests/golden/*.json from scenarios/ (`python -m tests.update_goldens`). Existing
files are kept unless --force."""
import argparse
import json
import sys

from tests.helpers import GOLDEN, compute, scenario_files
from zsim.report.writers import write_atomic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--force", action="store_true", help="overwrite existing golden files")
    args = ap.parse_args()
    for path in scenario_files():
        out = GOLDEN / f"{path.stem}.json"
        if out.exists() and not args.force:
            print(f"kept {out} (exists; use --force to overwrite)")
            continue
        write_atomic(out, json.dumps(compute(path), indent=1, sort_keys=True) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
