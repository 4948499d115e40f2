"""Predicted nccl-tests bus bandwidth (busbw, GB/s) of the shipped DGX profiles, 8 B .. 8 GB, one
node and 2..128 nodes, beside the published figures zsim bundles. Only simulates (pure functions).

What zsim prices is NCCL 2.27.5's own tuner model (zsim/hardware/nccl.py), so below ~1 MB the
curve is NCCL's latency model and the column "algo" is what NCCL's tuner would pick. Published
figures (the large-message plateaus the profiles cite, hardware_profiles/*.yaml [NCCL]):
  DGX A100, 8 GPUs:        all_reduce busbw ~230 GB/s at >= 256 MB (nccl-tests on NVSwitch/NVLink3)
  DGX A100, 2+ nodes:      all_reduce busbw ~190 GB/s with 8 HDR rails (NVIDIA, "Doubling all2all
                           performance with NCCL 2.12"; MLPerf HPC notes)
  DGX H100, 8 GPUs:        all_gather / reduce_scatter busbw ~350-370 GB/s at >= 256 MB
  DGX H100, 2+ nodes:      ~45 GB/s per 400 Gb/s rail, i.e. ~360 GB/s per 8-rail node (NCCL 2.18+
                           release notes, MLPerf Training v3.0 notes)
  HGX H200, 8 GPUs:        DGX H100's band: the same NVLink4/NVSwitch (hardware_profiles/hgx-h200.yaml)
  MI300X, 8 GPUs:          RCCL all_reduce busbw 313.7 at 1 GiB, 315.7 at 8 GiB (rccl-tests; hardware_profiles/
                           mi300x-8.yaml [RCCLT], the measurement its tier table is derived from)
The sources do not state the node count of their multi-node figures: the bands are checked from 2
to 16 nodes. A row is flagged when a prediction at >= 1 GB leaves the band by more than 10%.
Beyond 16 nodes NCCL's model keeps even GB-sized ring calls below the plateau (1000+ step latencies).
Usage: python benchmarks/nccl_busbw.py [--kinds all_reduce,all_gather] [--nodes 1,2,8,32,128]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (profile, kind, one node?) -> published busbw band, GB/s (see the docstring for sources)
PUBLISHED = {
    ("dgx-a100-80g", "all_reduce", True): (220, 240),
    ("dgx-a100-80g", "all_reduce", False): (180, 200),
    ("dgx-h100", "all_gather", True): (350, 370),
    ("dgx-h100", "reduce_scatter", True): (350, 370),
    ("dgx-h100", "all_gather", False): (340, 370),
    ("dgx-h100", "reduce_scatter", False): (340, 370),
    ("hgx-h200", "all_gather", True): (350, 370),
    ("hgx-h200", "reduce_scatter", True): (350, 370),
    ("mi300x-8", "all_reduce", True): (313, 316),
}
SIZES = [8 * 4 ** i for i in range(16)]   # 8 B .. 8 GiB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="all_reduce,all_gather,reduce_scatter")
    ap.add_argument("--nodes", default="1,2,8,32,128")
    ap.add_argument("--profiles", default="dgx-a100-80g,dgx-h100")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from zsim.config.profile import load_profile
    from zsim.hardware.collectives import bus_factor, collective_cost, nccl_topo_for, tiers_for
    from zsim.specs.hardware import Cluster

    try:
        nodes_list = [int(n) for n in args.nodes.split(",")]
        if any(n < 1 for n in nodes_list):
            raise ValueError
    except ValueError:
        print(f"nccl_busbw: error: --nodes {args.nodes}: give node counts >= 1, e.g. 1,2,8", file=sys.stderr)
        return 2
    flagged = 0
    for prof in args.profiles.split(","):
        profile = load_profile(prof)
        for kind in args.kinds.split(","):
            for nodes in nodes_list:
                cl = Cluster(profile=profile, nodes=nodes, gpus_per_node=profile.gpus_per_node)
                intra, inter = tiers_for(cl)
                topo = nccl_topo_for(cl)
                band = PUBLISHED.get((prof, kind, nodes == 1)) if nodes <= 16 else None
                print(f"\n{prof} {kind}: {nodes} node(s) x {cl.gpus_per_node} GPUs"
                      + (f"  (published plateau {band[0]}-{band[1]} GB/s)" if band else ""))
                print(f"{'bytes':>12} {'time us':>11} {'busbw GB/s':>11}  algo")
                for size in SIZES:
                    c = collective_cost(kind, float(size), nodes, cl.gpus_per_node, intra, inter, False, topo)
                    bw = size * bus_factor(kind, cl.world_size) / c.time_s / 1e9
                    flag = ""
                    if band and size >= 1 << 30 and not band[0] * 0.9 <= bw <= band[1] * 1.1:
                        flag, flagged = "  <- outside the published band", flagged + 1
                    print(f"{size:>12} {c.time_s * 1e6:>11.1f} {bw:>11.1f}  {c.algorithm}/{c.protocol}{flag}")
    print(f"\n{flagged} large-message prediction(s) outside the published bands")
    return 0


if __name__ == "__main__":
    sys.exit(main())
