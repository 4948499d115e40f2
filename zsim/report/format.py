"""Number formatting shared by the terminal report and the search tools (which print `--set`
assignments): one home, below both, so neither imports the other."""
from __future__ import annotations

import re

from zsim.units import GiB, MiB


def fmt_time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_bytes(b: float) -> str:
    if b >= GiB:
        return f"{b / GiB:.2f} GiB"
    return f"{b / MiB:.1f} MiB"


def fmt_setting(v) -> str:
    """5e7 rather than 5e+07: how DeepSpeed users write sizes, and valid YAML for --set."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return re.sub(r"e\+?0*(\d)", r"e\1", f"{v:g}") if isinstance(v, float) else str(v)
