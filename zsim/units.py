"""Unit constants, defined once. Binary sizes (KiB/MiB/GiB) are what allocators and DeepSpeed's
memory estimators print; decimal ones (GB) are what link and disk bandwidths are quoted in."""
from __future__ import annotations

KiB = 1024
MiB = 1024**2
GiB = 1024**3
KB = 1000
MB = 1000**2
GB = 1000**3
TFLOP = 1e12
