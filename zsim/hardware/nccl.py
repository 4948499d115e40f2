"""NCCL's own cost model and per-call choice of algorithm and protocol, as pure functions.

Every constant is NCCL 2.27.5's (tag v2.27.5-1, the 2.27 series torch 2.x wheels ship):
`ncclTopoTuneModel` (src/graph/tuning.cc) gives each (collective, algorithm, protocol) a
latency and a bandwidth from the topology; `ncclTopoGetAlgoTime` (same file) prices one call
as latency + bytes / bandwidth; `topoGetAlgoInfo` (src/enqueue.cc) runs the fastest enabled
pair. nBytes is the full buffer (enqueue.cc getAlgoInfo: ncclFuncMaxSendRecvCount), zsim's
`size_bytes` convention too.

The ring spans every rank, so an all-gather over n ranks pays n-1 step latencies (n-nodes of
them on NVLink, nodes-1 on the network), growing with GPUs, not nodes; a small per-rank share
leaves each step latency-bound and the achieved bus bandwidth far below the link's. LL (8-byte
lines with flags) halves the bandwidth for a small step latency, LL128 keeps 120/128 of it,
Simple has the full bandwidth and the largest latency. Tree (all-reduce only) pays log2(nodes)
network steps. PAT (all-gather/reduce-scatter) runs only with one GPU per node.

[Note: NVLS in NCCL's tuner]
On an NVSwitch node with multicast (Hopper or later) NCCL also prices NVLS (the switch reduces
and multicasts: AllReduce, AllGather, ReduceScatter) and NVLSTree (NVLS in the node, a tree
across nodes: AllReduce only), Simple protocol only, for a communicator with more than two GPUs
on a node (transport/nvls.cc:160). NVLS proper is off across nodes unless a CollNet plugin is
enabled (tuning.cc:444-448), NVLSTree is off in one node (:443). Their bandwidth comes from the
NVLS graph (search.cc pattern 5, a profile's nvls_* keys): NVLS AllReduce ch x min(bwIntra,
bwInter) x 5/6, AllGather/ReduceScatter ch x min(bwIntra (ppn-1)/ppn, 0.9 bwInter) for the whole
buffer (no conversion), NVLSTree ch x min(bwIntra, bwInter, halved beyond two nodes) x 5/6
(tuning.cc:266-276, 321-327); latency a flat 25 us in the node, NVLSTree 2 log2(nodes) network
steps of 14 us more (:137-155, 367-371). On a DGX H100 that makes a large one-node AllReduce
467 GB/s bus bandwidth against Ring's 360, two nodes' 500; AllGather and ReduceScatter stay on
Ring (NVLS gives them 245). The graph is searched for the job's GPUs per node; zsim has the
profile's full-node graph, so a group on fewer GPUs of a node is priced without NVLS.
Not modelled: CollNet (in-network reduction needs a CollNet plugin and NCCL_COLLNET_ENABLE),
the tuner's per-call channel reduction (it does not change NCCL's time estimate), and tuner plugins.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from zsim.errors import ZsimInputError
from zsim.specs.nccl import NCCL_PROTOS

FUNC = {"broadcast": "Broadcast", "reduce": "Reduce", "all_gather": "AllGather",
        "reduce_scatter": "ReduceScatter", "all_reduce": "AllReduce"}
ARCHS = ("volta", "ampere", "hopper", "blackwell")   # tuning.cc compCapIndex order

# tuning.cc baseLat [algo][proto], us: Tree, Ring, NVLS, NVLSTree (CollNet zero, not modelled; PAT sets its own)
BASE_LAT_US = {"Tree": (6.8, 14.0, 8.4), "Ring": (6.6, 14.0, 8.4), "PAT": (0.0, 0.0, 0.0),
               "NVLS": (0.0, 0.0, 0.0), "NVLSTree": (0.0, 0.0, 0.0)}
# tuning.cc hwLat [NVLINK|PCI|NET][algo][proto], us
HW_LAT_US = {
    "nvlink": {"Tree": (0.6, 1.25, 4.0), "Ring": (0.6, 1.9, 3.4), "PAT": (0.0, 0.0, 0.0),
               "NVLS": (0.0, 0.0, 25.0), "NVLSTree": (0.0, 0.0, 25.0)},
    "pci": {"Tree": (1.0, 1.9, 4.0), "Ring": (1.0, 2.5, 5.7), "PAT": (0.0, 0.0, 0.0),
            "NVLS": (0.0, 0.0, 0.0), "NVLSTree": (0.0, 0.0, 0.0)},
    "net": {"Tree": (5.0, 8.5, 14.0), "Ring": (2.7, 4.0, 14.0), "PAT": (0.0, 0.0, 0.0),
            "NVLS": (0.0, 0.0, 18.0), "NVLSTree": (0.0, 0.0, 14.0)},
}
# tuning.cc llMaxBws [arch for 1 node | Intel, AMD across nodes][nodes 1, 2, >2], GB/s
LL_MAX_BW_1NODE = {"volta": 39.0, "ampere": 87.7, "hopper": 141.0, "blackwell": 2 * 141.0}
LL_MAX_BW_NET = {"intel": (39.0, 20.4), "amd": (22.5, 19.0)}   # (2 nodes, >2 nodes): rows 0 and 1
# tuning.cc perChMaxRingLL128Bws / perChMaxTreeLL128Bws / perChMaxTreeBws [arch][nodes 1, 2, >2]
PER_CH_RING_LL128 = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7,) * 3,
                     "blackwell": (2 * 36.7,) * 3}
PER_CH_TREE_LL128 = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7, 36.7, 29.0),
                     "blackwell": (2 * 36.7, 2 * 36.7, 2 * 29.0)}
PER_CH_TREE = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0),
               "blackwell": (2 * 38.7, 2 * 41.4, 2 * 36.0)}
# tuning.cc treeCorrectionFactor [proto][log2(nBytes/64)], 64 B .. 256 MB
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
)
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0}   # tuning.cc getNetOverhead (NCCL_NET_OVERHEAD unset)


@dataclass(frozen=True)
class NcclTopo:
    """What ncclTopoTuneModel reads of the communicator besides its size (hashable: calls are cached)."""
    arch: str
    cpu_vendor: str
    intra_link: str                  # "nvlink" or "pci"
    channels: int                    # graph nChannels after NCCL_MAX_NCHANNELS / NCCL_MIN_NCHANNELS
    bw_intra_GBps: float             # per channel, one node
    bw_inter_GBps: float             # per channel, across nodes (the ring leaves each node once per channel)
    peak_intra_GBps: float           # the link's bus bandwidth: extra channels share it
    peak_inter_GBps: float
    latency_inter_us: float
    algos: tuple[tuple[str, frozenset[str]], ...]    # function -> enabled algorithms (NCCL_ALGO)
    protos: tuple[tuple[str, frozenset[str]], ...]   # function -> enabled protocols (NCCL_PROTO)
    # the NVLS graph of a full node (see [Note: NVLS in NCCL's tuner]); 0 channels: no NVLS
    nvls_channels: int = 0
    nvls_bw_intra_GBps: float = 0.0
    nvls_bw_inter_GBps: float = 0.0
    node_gpus: int = 0                # the node the NVLS graph was searched on
    # measured share of the estimate across nodes, by bytes per rank (NcclProfile.net_ring_achieved)
    net_ring_achieved: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class NcclChoice:
    algorithm: str
    protocol: str
    latency_us: float
    bw_GBps: float                   # NCCL's algorithm bandwidth: time = latency + bytes / bw


def _nvls_lat_bw(func: str, algo: str, ppn: float, n_nodes: int, topo: NcclTopo) -> tuple[float, float]:
    """NVLS / NVLSTree's cell of ncclTopoTuneModel (Simple): see [Note: NVLS in NCCL's tuner]."""
    intra, inter = topo.nvls_bw_intra_GBps, topo.nvls_bw_inter_GBps
    if algo == "NVLS":
        bw = min(intra, inter) if func == "AllReduce" else min(intra * (ppn - 1) / ppn, inter * 0.9)
    else:
        bw = min(intra, inter if n_nodes <= 2 else inter / 2)
    bus = topo.nvls_channels * bw
    if func == "AllReduce":     # AllGather/ReduceScatter: the whole buffer at busBw, no conversion
        bus *= 5.0 / 6.0
    intra_lat = HW_LAT_US["nvlink"][algo][2]
    inter_lat = HW_LAT_US["net"][algo][2] + 2 * topo.latency_inter_us   # the flush's extra latency (Simple)
    if algo == "NVLS":
        return intra_lat + (inter_lat if n_nodes > 1 else 0.0), bus
    return BASE_LAT_US[algo][2] + intra_lat + 2 * int(math.log2(n_nodes)) * inter_lat, bus


def _lat_bw(func: str, algo: str, p: int, n_ranks: int, n_nodes: int, topo: NcclTopo) -> tuple[float, float]:
    """One cell of ncclTopoTuneModel: (latency us, algorithm bandwidth GB/s), None when unused."""
    if algo in ("NVLS", "NVLSTree"):
        return _nvls_lat_bw(func, algo, n_ranks / n_nodes, n_nodes, topo)
    nsteps = 2 * (n_ranks - 1) if func == "AllReduce" else n_ranks - 1 if func in ("AllGather", "ReduceScatter") \
        else n_ranks
    node_idx = min(n_nodes, 3) - 1
    ppn = n_ranks / n_nodes
    peak = topo.peak_intra_GBps if n_nodes == 1 else topo.peak_inter_GBps
    ch = topo.channels
    bw = topo.bw_intra_GBps if n_nodes == 1 else topo.bw_inter_GBps
    bus = min(ch * bw, peak)
    ll_max = LL_MAX_BW_1NODE[topo.arch] if n_nodes == 1 else LL_MAX_BW_NET[topo.cpu_vendor][min(n_nodes, 3) - 2]
    if algo == "Ring" and p == 0:
        bus = min(ll_max, bus * .5)
    if algo == "Ring" and p == 1:
        bus = min(bus * .92, ch * PER_CH_RING_LL128[topo.arch][node_idx])
    if algo == "Tree" and func == "AllReduce":
        bus = min(bus * .92, ch * PER_CH_TREE[topo.arch][node_idx])
    if algo == "Tree" and p == 0:
        bus = min(bus / 3.8, ll_max)
    if algo == "Tree" and p == 1:
        bus = min(bus * (7.0 / 9.0 if n_nodes == 1 else 120.0 / 128.0), ch * PER_CH_TREE_LL128[topo.arch][node_idx])
    if algo == "PAT":
        bus *= .75
    if algo == "Ring":                         # bus -> algorithm bandwidth
        bus *= n_ranks / nsteps
    elif func == "AllReduce":                  # Tree
        bus *= .5
    intra_lat = HW_LAT_US[topo.intra_link][algo][p]
    # ppn == 1: latencies fully exposed, NCCL charges the tree's network latency
    inter_lat = HW_LAT_US["net"]["Tree" if ppn == 1 else algo][p] + topo.latency_inter_us
    if p == 2:                                 # Simple: the flush's extra network latency
        inter_lat += topo.latency_inter_us
    lat = BASE_LAT_US[algo][p]
    if algo == "Ring":
        hw = HW_LAT_US[topo.intra_link if n_nodes == 1 else "net"]
        if func in ("Reduce", "Broadcast"):
            # chain per channel; not sameChannels: NCCL charges nsteps hops (Simple at the tree's rate)
            lat += nsteps * hw["Tree" if p == 2 else "Ring"][p]
        else:
            # each intra-node step still posts to the network proxy (3x for Simple)
            net_overhead = NET_OVERHEAD_US[topo.cpu_vendor] * (3 if p == 2 else 1) if n_nodes > 1 else 0.0
            intra_lat = max(intra_lat, net_overhead)
            inter_steps = 0 if n_nodes == 1 else 2 * (n_nodes - 1) if func == "AllReduce" else n_nodes - 1
            lat += (nsteps - inter_steps) * intra_lat + inter_steps * inter_lat
    elif algo == "Tree":
        lat += 2 * ((n_ranks // n_nodes - 1) * intra_lat + int(math.log2(n_nodes)) * inter_lat)
    elif algo == "PAT":
        lat = 8 + int(math.log2(n_nodes)) * (inter_lat / 3.5) + n_ranks * 2.8
    return lat, bus


def _candidates(func: str, n_ranks: int, n_nodes: int, topo: NcclTopo) -> Iterator[tuple[str, int]]:
    """The (algorithm, protocol index) pairs ncclTopoTuneModel prices for `func` and NCCL_ALGO/PROTO leave on."""
    algos, protos = dict(topo.algos)[func], dict(topo.protos)[func]
    ppn = n_ranks // n_nodes
    for algo in ("Tree", "Ring", "PAT", "NVLS", "NVLSTree"):
        if algo not in algos:
            continue
        if algo in ("NVLS", "NVLSTree"):
            # nvls.cc:160 more than two GPUs of the node; the graph zsim has is the full node's;
            # NVLS across nodes needs CollNet (tuning.cc:444-448), NVLSTree more than one node
            # (:443) and runs AllReduce only (:256-258); Simple only (:262)
            if (not topo.nvls_channels or ppn <= 2 or ppn != topo.node_gpus or "Simple" not in protos
                    or (algo == "NVLS" and (n_nodes > 1 or func not in ("AllReduce", "AllGather", "ReduceScatter")))
                    or (algo == "NVLSTree" and (n_nodes == 1 or func != "AllReduce"))):
                continue
            yield algo, 2
            continue
        if func in ("Broadcast", "Reduce") and algo != "Ring":
            continue
        if func in ("AllGather", "ReduceScatter") and algo == "Tree":
            continue
        if func == "AllReduce" and algo == "PAT":
            continue
        for p, proto in enumerate(NCCL_PROTOS):
            if proto not in protos:
                continue
            # ncclPatEnable: Simple only, one GPU per node (SM60+)
            if algo == "PAT" and (p != 2 or n_nodes != n_ranks):
                continue
            yield algo, p


@functools.lru_cache(maxsize=8192)   # pure; schedules repeat the same sizes layer after layer
def choose(kind: str, size_bytes: float, n_nodes: int, gpus_per_node: int, topo: NcclTopo) -> NcclChoice:
    """topoGetAlgoInfo: the enabled (algorithm, protocol) with the least ncclTopoGetAlgoTime."""
    func = FUNC[kind]
    n_ranks = n_nodes * gpus_per_node
    best: NcclChoice | None = None
    best_us = math.inf
    for algo, p in _candidates(func, n_ranks, n_nodes, topo):
        lat, bw = _lat_bw(func, algo, p, n_ranks, n_nodes, topo)
        if bw <= 0:
            continue
        log_size = int(math.log2(size_bytes / 64)) if size_bytes >= 64 else -1
        if algo == "Tree" and func == "AllReduce" and 0 <= log_size < 23:
            bw *= TREE_CORRECTION[p][log_size]
        if (algo == "Ring" and p == 2 and n_nodes > 1 and func == "AllReduce"
                and size_bytes / (topo.channels * n_ranks) >= 64):
            lat *= 1.9 if topo.arch == "volta" else 1.4     # "plateau effect of ring"
        t_us = lat + size_bytes / (1000 * bw)
        if t_us < best_us:
            best_us, best = t_us, NcclChoice(algo, NCCL_PROTOS[p], lat, bw)
    if best is None:
        # NCCL fails the job the same way ("no algorithm/protocol available for function ...")
        algos = sorted(dict(topo.algos).get(func, ()))
        protos = sorted(dict(topo.protos).get(func, ()))
        raise ZsimInputError("hardware nccl.algo / nccl.proto", f"{'/'.join(algos) or 'none'} x {'/'.join(protos) or 'none'}",
                             f"leaves {func} no algorithm NCCL can run on {n_nodes} node(s) x {gpus_per_node} GPU(s) "
                             "(NCCL refuses the job too); leave it Ring and Simple, which every collective can run "
                             "(e.g. nccl.algo: ring, nccl.proto: ^LL128)")
    return best


def topo_for(nccl, intra_busbw_GBps: float, node_net_GBps: float, gpus_per_node: int) -> NcclTopo:
    """The tuner's view of a profile: `nccl` is its NcclProfile; bandwidths are the tier's
    nccl-tests bus bandwidth in a node and the node's NIC bandwidth (one direction)."""
    ch = min(nccl.ring_channels, nccl.max_nchannels or 64)
    # NCCL_MIN_NCHANNELS duplicates rings over the same links (connect.cc copyChannels):
    # per-channel caps rise with the count, the link's bandwidth does not
    ch_total = max(ch, nccl.min_nchannels or 0)
    inter_peak = min(intra_busbw_GBps, node_net_GBps * nccl.net_bw_fraction)
    algos, protos = nccl.enabled()
    return NcclTopo(arch=nccl.arch, cpu_vendor=nccl.cpu_vendor, intra_link=nccl.intra_link, channels=ch_total,
                    bw_intra_GBps=intra_busbw_GBps / nccl.ring_channels, bw_inter_GBps=inter_peak / nccl.ring_channels,
                    peak_intra_GBps=intra_busbw_GBps * ch / nccl.ring_channels,
                    peak_inter_GBps=inter_peak * ch / nccl.ring_channels, latency_inter_us=nccl.net_latency_us,
                    algos=tuple(sorted(algos.items())), protos=tuple(sorted(protos.items())),
                    nvls_channels=nccl.nvls_channels, nvls_bw_intra_GBps=nccl.nvls_bw_intra_GBps,
                    nvls_bw_inter_GBps=nccl.nvls_bw_inter_GBps, node_gpus=gpus_per_node,
                    net_ring_achieved=tuple(sorted((float(b), float(f)) for b, f in nccl.net_ring_achieved)))

