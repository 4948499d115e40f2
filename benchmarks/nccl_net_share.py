"""Derive hardware_profiles/dgx-h100.yaml's `nccl.net_ring_achieved`: the share of NCCL's own
estimate (zsim.hardware.nccl, the tuner's latency + bytes / bandwidth) that a measured Ring
AllGather across nodes reaches, by bytes per rank. See [Note: NCCL's estimate against
nccl-tests across nodes].

Measurement: nccl-tests 2.17.9 all_gather_perf, 4 nodes x 8 H100 80GB HBM3, 8 x 400 Gb/s NDR
per node, NCCL 2.24.3, out-of-place busbw (ZiyanIshani/vpbenchmarking@e55fe749,
results/nccl/nccl_multinode/nccl_allgather_20260224_225706.txt).
Usage: python benchmarks/nccl_net_share.py   (prints the table and the YAML line)
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODES, GPUS = 4, 8
# (total bytes, measured out-of-place busbw GB/s)
MEASURED = ((1048576, 9.27), (2097152, 18.34), (4194304, 21.03), (8388608, 39.20), (16777216, 69.74),
            (33554432, 105.21), (67108864, 166.39), (134217728, 173.43), (268435456, 235.32),
            (536870912, 286.20), (1073741824, 320.55), (2147483648, 322.43), (4294967296, 323.76))


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from zsim.config.profile import load_profile
    from zsim.hardware.collectives import nccl_topo_for
    from zsim.hardware.nccl import choose
    from zsim.specs.hardware import Cluster
    import dataclasses
    cluster = Cluster(profile=load_profile("dgx-h100"), nodes=NODES, gpus_per_node=GPUS)
    topo = dataclasses.replace(nccl_topo_for(cluster), net_ring_achieved=())   # the tuner alone
    n = NODES * GPUS
    rows = []
    print(f"{'bytes/rank':>12} {'measured':>9} {'tuner':>7} {'share':>6}  algo/proto")
    for total, busbw in MEASURED:
        c = choose("all_gather", total, NODES, GPUS, topo)
        t = c.latency_us * 1e-6 + total / (c.bw_GBps * 1e9)
        tuner = total * (n - 1) / n / t / 1e9
        share = min(1.0, busbw / tuner)
        rows.append((total // n, round(share, 3)))
        print(f"{total // n:12d} {busbw:9.1f} {tuner:7.1f} {share:6.3f}  {c.algorithm}/{c.protocol}")
    print("net_ring_achieved: [" + ", ".join(f"[{b}, {s}]" for b, s in rows) + "]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
