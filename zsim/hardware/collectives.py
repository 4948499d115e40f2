"""Collective cost model: pure alpha-beta functions per topology tier.

Conventions follow nccl-tests (doc/PERFORMANCE.md): for a buffer of `size_bytes` (the full
gathered / pre-reduction buffer), algbw = size/time and busbw = algbw * factor with
factor (n-1)/n for all-gather, reduce-scatter and all-to-all, 2(n-1)/n for all-reduce and
1 for broadcast/reduce. A tier is characterised by its peak bus bandwidth per GPU (what
nccl-tests reports for large messages), a size-dependent efficiency table and alpha, the
latency of one algorithm step (Hockney's alpha-beta model; Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005).

Within a node NCCL runs rings over NVLink/NVSwitch. Across nodes the cost is hierarchical:
an intra-node phase over NVLink plus an inter-node phase in which each GPU's rail carries
1/g of the data over its share of the node's NICs; NCCL pipelines the phases, so the
transfer term is the slower phase and the latency terms add. All-reduce across nodes may
use NCCL's double binary tree (Sanders, Speck & Traeff, Parallel Computing 2009), whose
latency grows with log2(nodes) instead of linearly; like NCCL's tuner we take the faster.
A tier may carry one efficiency table per collective (calibrated profiles: `zsim calibrate`
measures each), which replaces the tier's shared table for that collective.

This tier model prices collectives of profiles without an `nccl:` section (the gloo CPU
profile) and of calibrated profiles, whose measured tables win. A profile with an `nccl:`
section and no measured tables is priced by NCCL's own tuner model (zsim.hardware.nccl):
`nccl_topo_for` decides, `collective_cost` dispatches; all-to-all, which NCCL runs as grouped
send/recv outside its tuner, is priced by one rule for every profile (see [Note: all-to-all cost]).
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

from zsim.hardware.nccl import FUNC, NcclTopo, choose, topo_for
from zsim.specs.hardware import REDUCED_16BIT, REDUCING_COLLECTIVES, EffTable

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all")
# [Note: 16-bit reductions on the host] A reducing collective sums what it receives: gloo does it
# on the CPU, element by element in the tensor's dtype: ProcessGroupGloo's sum of c10::BFloat16
# or c10::Half elements uses their operator+, which converts both to float and the result back
# (c10/util/BFloat16-inl.h, Half-inl.h), slower per byte than an fp32 sum. Measured on the dev
# VM (gloo, 2 ranks, torch 2.13): a 46 MiB all-reduce took 61-63 ms in bf16 against 45-47 ms in
# fp32, 4 MiB 4.5-6.9 against 3.3-4.0. `zsim calibrate`
# times the reducing collectives in each 16-bit dtype it fits and writes their tables as
# "<collective>_<dtype>" (all_reduce_bf16, reduce_scatter_bf16) beside the fp32 ones; a call that
# reduces in that dtype (Comm.dtype) is priced on them. NCCL sums in the GPU's copy kernels at
# the link's rate whatever the dtype: profiles with NCCL's model carry no such tables.


@functools.lru_cache(maxsize=256)
def _log_sizes(table: EffTable) -> tuple[float, ...]:
    return tuple(math.log(max(s, 1.0)) for s, _ in table)


def efficiency_at(table: EffTable, size_bytes: float) -> float:
    """Piecewise-linear in log(size) between table points, flat beyond both ends."""
    if size_bytes <= 0:
        return table[0][1]
    xs = _log_sizes(table)
    x = math.log(max(size_bytes, 1.0))
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return table[0][1]
    if i >= len(xs):
        return table[-1][1]
    x0, x1 = xs[i - 1], xs[i]
    y0, y1 = table[i - 1][1], table[i][1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class Tier:
    busbw_Bps: float
    latency_s: float
    efficiency: EffTable
    # calibrated profiles measure each collective's own curve (gloo's broadcast and all-reduce,
    # for example, differ by 2x at the same size); kinds not listed use `efficiency`
    by_collective: tuple[tuple[str, EffTable], ...] = ()
    # paid once per collective, not per ring step: waiting for the last rank to arrive
    sync_s: float = 0.0

    def efficiency_for(self, kind: str, coalesced: bool = False, dtype: str = "") -> EffTable:
        tables = dict(self.by_collective)
        if coalesced and f"{kind}_coalesced" in tables:
            return tables[f"{kind}_coalesced"]
        # see [Note: 16-bit reductions on the host]
        if kind in REDUCING_COLLECTIVES and dtype in REDUCED_16BIT and f"{kind}_{dtype}" in tables:
            return tables[f"{kind}_{dtype}"]
        return tables.get(kind, self.efficiency)


@dataclass(frozen=True)
class CommCost:
    """latency_s is fixed time; transfer_s is the bandwidth part, which concurrent transfers on
    the same `tier` share."""
    latency_s: float
    transfer_s: float
    tier: str
    algorithm: str = ""     # NCCL's (Ring, Tree, PAT) or the tier model's (ring, hierarchical, tree)
    protocol: str = ""      # NCCL's (LL, LL128, Simple); "" for the tier model

    @property
    def time_s(self) -> float:
        return self.latency_s + self.transfer_s


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests busbw/algbw factor for `kind` over `n` ranks."""
    if n <= 1:
        return 0.0
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown collective {kind!r}")


def ring_steps(kind: str, n: int) -> int:
    """Sequential algorithm steps of a ring (each pays alpha once)."""
    if n <= 1:
        return 0
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def ring_cost(kind: str, size_bytes: float, n: int, tier: Tier, tier_name: str,
              coalesced: bool = False, dtype: str = "") -> CommCost:
    """One ring over `n` ranks on a single tier: alpha*steps + size*factor/(busbw*eff(size))."""
    if n <= 1 or size_bytes <= 0:
        return CommCost(0.0, 0.0, tier_name)
    bw = tier.busbw_Bps * efficiency_at(tier.efficiency_for(kind, coalesced, dtype), size_bytes)
    return CommCost(ring_steps(kind, n) * tier.latency_s, size_bytes * bus_factor(kind, n) / bw, tier_name, "ring")


def tree_allreduce_cost(size_bytes: float, nodes: int, gpus_per_node: int, intra: Tier, inter: Tier) -> CommCost:
    """NCCL double binary tree across nodes, chains inside nodes: reduce up then broadcast down,
    2*(log2(nodes) + g-1) steps; bandwidth bound as the hierarchical ring."""
    steps_inter = 2 * math.ceil(math.log2(nodes)) if nodes > 1 else 0
    steps_intra = 2 * (gpus_per_node - 1)
    hier = hierarchical_cost("all_reduce", size_bytes, nodes, gpus_per_node, intra, inter)
    return CommCost(steps_inter * inter.latency_s + steps_intra * intra.latency_s, hier.transfer_s, hier.tier, "tree")


def hierarchical_cost(kind: str, size_bytes: float, nodes: int, gpus_per_node: int,
                      intra: Tier, inter: Tier, coalesced: bool = False, dtype: str = "") -> CommCost:
    """Intra-node ring on the full buffer plus one inter-node ring per rail on 1/g of it.

    `inter.busbw_Bps` is the bandwidth one rail gets: the node's NIC bandwidth / g.
    """
    g = gpus_per_node
    intra_c = ring_cost(kind, size_bytes, g, intra, "intra_node", coalesced, dtype)
    inter_c = ring_cost(kind, size_bytes / g, nodes, inter, "inter_node", coalesced, dtype)
    slower = inter_c if inter_c.transfer_s >= intra_c.transfer_s else intra_c
    return CommCost(intra_c.latency_s + inter_c.latency_s, slower.transfer_s, slower.tier, "hierarchical")


# [Note: NCCL's estimate against nccl-tests across nodes]
# NCCL's tuner prices a call as latency + bytes / bandwidth (zsim.hardware.nccl), which a ring
# across nodes reaches only with large messages: each of its n-1 steps moves the per-rank
# share in chunks over every channel, and a share of a few MB leaves the NICs' pipelines short.
# nccl-tests all_gather_perf on 4 x 8 H100 80GB HBM3 with 8 x 400 Gb/s NDR per node (NCCL
# 2.24.3; ZiyanIshani/vpbenchmarking@e55fe749 results/nccl/nccl_multinode/
# nccl_allgather_20260224_225706.txt, out-of-place) measured 69.7 GB/s bus bandwidth at
# 512 KiB per rank, 173 at 4 MiB, 235 at 8 MiB and 321 at 32 MiB, where the tuner's estimate
# for the same 32 ranks is 127, 276, 301 and 343: a profile holds the measured share by bytes
# per rank (`nccl.net_ring_achieved`), and a Ring AllGather or ReduceScatter across nodes takes
# its estimate over that share (interpolated in log size, the ends held); the extra time is
# transfer, which concurrent calls share. ReduceScatter is the same ring with the reduction
# fused into its steps (prims_*: recvReduceSend), so it is given AllGather's measured share.
def nccl_cost(kind: str, size_bytes: float, nodes: int, gpus_per_node: int, topo: NcclTopo) -> CommCost:
    """NCCL's tuner: the chosen algorithm's latency is fixed time, bytes / its bandwidth the
    transfer (see [Note: NCCL's estimate against nccl-tests across nodes])."""
    c = choose(kind, size_bytes, nodes, gpus_per_node, topo)
    latency_s, transfer_s = c.latency_us * 1e-6, size_bytes / (c.bw_GBps * 1e9)
    if (nodes > 1 and topo.net_ring_achieved and c.algorithm == "Ring"
            and kind in ("all_gather", "reduce_scatter")):
        share = efficiency_at(topo.net_ring_achieved, size_bytes / (nodes * gpus_per_node))
        transfer_s = (latency_s + transfer_s) / share - latency_s
    return CommCost(latency_s, transfer_s, "intra_node" if nodes == 1 else "inter_node", c.algorithm, c.protocol)


def all_to_all_cost(size_bytes: float, nodes: int, ranks_per_node: int, intra: Tier, inter: Tier) -> CommCost:
    """[Note: all-to-all cost] NCCL runs all-to-all as n-1 concurrent point-to-point transfers
    (ncclSend/ncclRecv to every peer inside one ncclGroupStart/End: NCCL's "All-to-All" example,
    docs/usage/p2p; nccl-tests alltoall_perf counts busbw = algbw * (n-1)/n), not as rings and
    outside its tuner (which prices the collectives of zsim.hardware.nccl FUNC), so every profile prices it here, on the
    tiers: each rank sends size/n to every peer, (g-1)/n of its buffer over NVLink to the peers
    on its node and (n-g)/n over its rail to the others, both at once, so the slower tier bounds
    the transfer and each tier's steps pay their latency. On one tier this is a ring's cost."""
    n, g = nodes * ranks_per_node, ranks_per_node
    t_intra = 0.0
    if g > 1:
        t_intra = size_bytes * (g - 1) / n / (intra.busbw_Bps * efficiency_at(intra.efficiency_for("all_to_all"), size_bytes))
    t_inter = 0.0
    if nodes > 1:
        t_inter = size_bytes * (n - g) / n / (inter.busbw_Bps * efficiency_at(inter.efficiency_for("all_to_all"),
                                                                             size_bytes / g))
    latency = (g - 1) * intra.latency_s + (nodes - 1) * inter.latency_s
    if t_inter >= t_intra:
        return CommCost(latency, t_inter, "inter_node", "p2p")
    return CommCost(latency, t_intra, "intra_node", "p2p")


@functools.lru_cache(maxsize=4096)   # pure; schedules repeat the same sizes layer after layer
def collective_cost(kind: str, size_bytes: float, nodes: int, gpus_per_node: int,
                    intra: Tier, inter: Tier, coalesced: bool = False, nccl: NcclTopo | None = None,
                    dtype: str = "") -> CommCost:
    """Cost of one collective over a group of nodes x gpus_per_node ranks (the data-parallel
    group, or another group as zsim.hardware.placement places it);
    `coalesced`: launched async with its neighbours before any is waited (Comm.coalesced);
    `dtype`: the element type a reduction sums in (Comm.dtype);
    `nccl`: NCCL's tuner view of the cluster (nccl_topo_for), None for the tier model."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}")
    n = nodes * gpus_per_node
    if n <= 1 or size_bytes <= 0:
        return CommCost(0.0, 0.0, "intra_node")
    if kind == "all_to_all":
        # one rule wherever the group sits and whatever the profile: see all_to_all_cost
        c = all_to_all_cost(size_bytes, nodes, gpus_per_node, intra, inter)
        sync = intra.sync_s if nodes == 1 else inter.sync_s if gpus_per_node == 1 else max(intra.sync_s, inter.sync_s)
        return CommCost(c.latency_s + sync, c.transfer_s, c.tier, c.algorithm)
    if nccl is not None and kind in FUNC:
        c = nccl_cost(kind, size_bytes, nodes, gpus_per_node, nccl)
        sync = intra.sync_s if nodes == 1 else max(intra.sync_s, inter.sync_s)
        return CommCost(c.latency_s + sync, c.transfer_s, c.tier, c.algorithm, c.protocol)
    if nodes == 1:
        c = ring_cost(kind, size_bytes, n, intra, "intra_node", coalesced, dtype)
        return CommCost(c.latency_s + intra.sync_s, c.transfer_s, c.tier, c.algorithm)
    if gpus_per_node == 1:
        c = ring_cost(kind, size_bytes, n, inter, "inter_node", coalesced, dtype)
        return CommCost(c.latency_s + inter.sync_s, c.transfer_s, c.tier, c.algorithm)
    best = hierarchical_cost(kind, size_bytes, nodes, gpus_per_node, intra, inter, coalesced, dtype)
    if kind == "all_reduce":
        tree = tree_allreduce_cost(size_bytes, nodes, gpus_per_node, intra, inter)
        if tree.time_s < best.time_s:
            best = tree
    return CommCost(best.latency_s + max(intra.sync_s, inter.sync_s), best.transfer_s, best.tier, best.algorithm)


def tiers_for(cluster) -> tuple[Tier, Tier]:
    """The two tiers of a Cluster, in SI units; the inter tier is per rail (NICs / GPUs per node)."""
    p = cluster.profile
    intra = Tier(cluster.intra_busbw_Bps, p.intra_node.latency_us * 1e-6, p.intra_node.efficiency_by_size,
                 tuple(sorted(p.intra_node.efficiency_by_collective.items())), p.intra_node.sync_overhead_us * 1e-6)
    rail_Bps = cluster.inter_node_bw_Bps / cluster.gpus_per_node
    inter = Tier(rail_Bps, p.inter_node.latency_us * 1e-6, p.inter_node.efficiency_by_size,
                 tuple(sorted(p.inter_node.efficiency_by_collective.items())), p.inter_node.sync_overhead_us * 1e-6)
    return intra, inter


def nccl_topo_for(cluster) -> NcclTopo | None:
    """NCCL's tuner view of a Cluster, or None where the tier model prices collectives: a
    profile without an `nccl:` section, or one whose tiers carry measured per-collective
    tables (`zsim calibrate`): measured beats modelled."""
    p = cluster.profile
    if p.nccl is None or p.intra_node.efficiency_by_collective or p.inter_node.efficiency_by_collective:
        return None
    return topo_for(p.nccl, cluster.intra_busbw_Bps / 1e9, cluster.inter_node_bw_Bps / 1e9, cluster.gpus_per_node)


def link_busbw_Bps(cluster, nodes: int | None = None) -> float:
    """The peak bus bandwidth of the links a collective over `nodes` nodes (default: the whole
    cluster) crosses: NVLink in one node, else the slower of NVLink and the node's NICs (a ring
    leaves each node through them)."""
    if (cluster.nodes if nodes is None else nodes) == 1:
        return cluster.intra_busbw_Bps
    return min(cluster.intra_busbw_Bps, cluster.inter_node_bw_Bps)


def send_busbw_Bps(cluster, same_node: bool) -> float:
    """The peak of a point-to-point send: NVLink inside a node, one rail (the node's NICs / its
    GPUs, what the cost model prices a send across nodes on) between nodes."""
    intra, inter = tiers_for(cluster)
    return intra.busbw_Bps if same_node else inter.busbw_Bps
