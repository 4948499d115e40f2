"""The `nccl:` section of a hardware profile: what NCCL's tuner reads of a cluster, and the
user's NCCL_ALGO / NCCL_PROTO / NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS settings.

A profile with this section has its collectives priced by NCCL's own cost model
(zsim.hardware.nccl); see docs/model.md, "Collectives". Names and list syntax are NCCL
2.27.5's (src/init.cc ncclFuncStr/ncclAlgoStr/ncclProtoStr, src/graph/tuning.cc parseList).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from zsim.schema import spec

# NCCL's own order (src/include/nccl_common.h, src/init.cc); names compare case-insensitively
NCCL_FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")
NCCL_ALGOS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
NCCL_PROTOS = ("LL", "LL128", "Simple")


def parse_nccl_list(text: str, elems: tuple[str, ...]) -> dict[str, frozenset[str]]:
    """NCCL's parseList (src/graph/tuning.cc): "ring,tree;allreduce:^LL" -> function -> enabled
    elements. The first entry may lack a function prefix and then applies to every function;
    a leading '^' enables everything but the listed elements. Raises ValueError(message)."""
    enabled = {f: frozenset(elems) for f in NCCL_FUNCS}
    lower = {e.lower(): e for e in elems}
    funcs = {f.lower(): f for f in NCCL_FUNCS}
    for i, entry in enumerate(text.split(";")):
        if not entry:
            continue
        prefix, sep, items = entry.partition(":")
        if not sep:
            if i:
                raise ValueError(f"all entries except the first must have a function prefix: {text!r}")
            prefix, items = "", entry
        if prefix and prefix.lower() not in funcs:
            raise ValueError(f"unknown function {prefix!r}; use one of {', '.join(NCCL_FUNCS)}")
        negate = items.startswith("^")
        names = set()
        for name in (items[1:] if negate else items).split(","):
            if name.lower() not in lower:
                raise ValueError(f"unknown element {name!r}; use one of {', '.join(elems)}")
            names.add(lower[name.lower()])
        chosen = frozenset(set(elems) - names if negate else names)
        for f in ([funcs[prefix.lower()]] if prefix else NCCL_FUNCS):
            enabled[f] = chosen
    return enabled


@dataclass(frozen=True, kw_only=True)
class NcclProfile:
    arch: Literal["volta", "ampere", "hopper", "blackwell"] = spec(
        doc="GPU generation: picks NCCL's per-architecture LL/LL128/Tree bandwidth caps")
    cpu_vendor: Literal["intel", "amd"] = spec("intel", doc="NCCL's network post overhead (1 us Intel, 2 us AMD) "
                                                           "and LL bandwidth cap across nodes depend on it")
    intra_link: Literal["nvlink", "pci"] = spec("nvlink", doc="the link type of NCCL's intra-node graph")
    ring_channels: int = spec(16, ge=1, le=64, doc="channels of NCCL's ring/tree graph (NCCL_DEBUG=INFO prints "
                                                   "'nChannels' in 'Pattern ..., nChannels N, bw ...')")
    net_bw_fraction: float = spec(0.96, gt=0, le=1, doc="NCCL's usable share of a NIC: its graph search caps a "
                                                       "channel at the speed array's step below the NIC rate "
                                                       "(24 GB/s of HDR's 25, 48 of NDR's 50)")
    net_latency_us: float = spec(0.0, ge=0, doc="the net plugin's extra latency per inter-node step "
                                                "(graph latencyInter; NCCL's IB transport reports 0)")
    algo: Optional[str] = spec(None, doc="NCCL_ALGO as set for the job (e.g. 'ring', '^tree', "
                                         "'ring;allreduce:tree'); unset: NCCL's default")
    proto: Optional[str] = spec(None, doc="NCCL_PROTO as set for the job (e.g. '^LL128'); unset: NCCL's default")
    # NCCL's NVLS graph (NVLink SHARP: an NVSwitch with multicast, Hopper or later): src/graph/search.cc
    # pattern 5 on a node of the profile's GPUs; see [Note: NVLS in NCCL's tuner]
    nvls_channels: int = spec(0, ge=0, le=32, doc="channels of NCCL's NVLS graph on a node of this profile's GPUs "
                                                  "(NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=GRAPH prints 'Pattern 5, "
                                                  "crossNic 0, nChannels N, bw X/Y'); 0: no NVLS (no NVSwitch "
                                                  "multicast, before Hopper, or NCCL_NVLS_ENABLE=0)")
    nvls_bw_intra_GBps: float = spec(0.0, ge=0, doc="that graph's per-channel bandwidth X in a node, GB/s")
    nvls_bw_inter_GBps: float = spec(0.0, ge=0, doc="a multi-node job's NVLS graph's per-channel bandwidth Y "
                                                    "across nodes, GB/s (its NIC path)")
    net_ring_achieved: tuple[tuple[float, float], ...] = spec(
        # see [Note: NCCL's estimate against nccl-tests across nodes]
        (), doc="measured share of the tuner's estimate that a Ring AllGather / ReduceScatter across nodes "
                "reaches, as [bytes per rank, fraction] pairs from nccl-tests on this fabric; empty: the "
                "tuner's estimate as it is")
    min_nchannels: Optional[int] = spec(None, ge=1, le=64, doc="NCCL_MIN_NCHANNELS")
    max_nchannels: Optional[int] = spec(None, ge=1, le=64, doc="NCCL_MAX_NCHANNELS")

    def __post_init__(self):
        for key, text, elems in (("algo", self.algo, NCCL_ALGOS), ("proto", self.proto, NCCL_PROTOS)):
            if text is not None:
                try:
                    parse_nccl_list(text, elems)
                except ValueError as err:
                    raise ValueError(key, text, str(err)) from None
        if self.nvls_channels and self.intra_link != "nvlink":
            raise ValueError("nvls_channels", self.nvls_channels, "NVLS runs on an NVSwitch (intra_link: nvlink); set 0")
        if self.nvls_channels and (self.arch not in ("hopper", "blackwell")):
            # search.cc: no NVLS graph below compute capability 9.0
            raise ValueError("nvls_channels", self.nvls_channels, f"NCCL builds no NVLS graph on {self.arch} "
                             "(Hopper or later only); set 0")
        if self.nvls_channels and not (self.nvls_bw_intra_GBps > 0 and self.nvls_bw_inter_GBps > 0):
            raise ValueError("nvls_bw_intra_GBps", self.nvls_bw_intra_GBps, "an NVLS graph needs both its "
                             "bandwidths (nvls_bw_intra_GBps, nvls_bw_inter_GBps > 0), as NCCL_DEBUG prints them")
        for pair in self.net_ring_achieved:
            if len(pair) != 2 or not pair[0] > 0 or not 0 < pair[1] <= 1:
                raise ValueError("net_ring_achieved", list(pair), "each entry is [bytes per rank > 0, fraction in (0, 1]]")
        if self.min_nchannels and self.max_nchannels and self.min_nchannels > self.max_nchannels:
            raise ValueError("min_nchannels", self.min_nchannels, "must not exceed max_nchannels")

    def enabled(self) -> tuple[dict[str, frozenset[str]], dict[str, frozenset[str]]]:
        """(function -> algorithms, function -> protocols) the user's settings leave on."""
        algos = parse_nccl_list(self.algo or "", NCCL_ALGOS)
        protos = parse_nccl_list(self.proto or "", NCCL_PROTOS)
        return algos, protos
