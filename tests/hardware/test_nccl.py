"""NCCL's tuner model (zsim.hardware.nccl): its constants, its per-call choice, the user's
NCCL_ALGO/NCCL_PROTO/channel settings, and how it composes with the tier model."""
import pytest

from zsim.config.profile import load_profile
from zsim.errors import ZsimInputError
from zsim.hardware.collectives import all_to_all_cost, bus_factor, collective_cost, nccl_topo_for, tiers_for
from zsim.hardware.nccl import choose
from zsim.specs.hardware import Cluster
from zsim.specs.nccl import NCCL_PROTOS, parse_nccl_list


def _cluster(nodes=1, gpus=8, profile="dgx-h100", **nccl):
    p = load_profile(profile, {"nccl": nccl} if nccl else None)
    return Cluster(profile=p, nodes=nodes, gpus_per_node=gpus)


def _cost(kind, size, cl):
    intra, inter = tiers_for(cl)
    return collective_cost(kind, float(size), cl.nodes, cl.gpus_per_node, intra, inter, False, nccl_topo_for(cl))


def _busbw_GBps(kind, size, cl):
    return size * bus_factor(kind, cl.world_size) / _cost(kind, size, cl).time_s / 1e9


def test_parse_list_follows_nccl_syntax():
    on = parse_nccl_list("ring,tree;allreduce:tree", ("Tree", "Ring", "PAT"))
    assert on["AllGather"] == {"Ring", "Tree"} and on["AllReduce"] == {"Tree"}
    assert parse_nccl_list("^LL128", NCCL_PROTOS)["ReduceScatter"] == {"LL", "Simple"}
    assert parse_nccl_list("", NCCL_PROTOS)["AllReduce"] == set(NCCL_PROTOS)
    with pytest.raises(ValueError):
        parse_nccl_list("ring;tree", ("Tree", "Ring"))      # only the first entry may lack a prefix
    with pytest.raises(ValueError):
        parse_nccl_list("rings", ("Tree", "Ring"))


def test_large_all_gather_in_a_node_is_ring_simple_at_the_links_bus_bandwidth():
    cl = _cluster()
    c = _cost("all_gather", 1 << 30, cl)
    assert (c.algorithm, c.protocol, c.tier) == ("Ring", "Simple", "intra_node")
    # tuning.cc: baseLat 8.4 + (n-1) * hwLat[NVLINK][Ring][Simple] 3.4; bw 16 x 22.5 GB/s x n/(n-1)
    assert c.latency_s == pytest.approx((8.4 + 7 * 3.4) * 1e-6)
    assert c.transfer_s == pytest.approx((1 << 30) / (360e9 * 8 / 7))


def test_protocol_follows_the_size():
    cl = _cluster()
    protos = [_cost("all_gather", s, cl).protocol for s in (4096, 1 << 24, 1 << 30)]
    assert protos == ["LL", "LL128", "Simple"]


def test_ring_latency_grows_with_ranks_not_nodes():
    """Same 16 nodes, 2 vs 8 GPUs each: the 128-rank ring pays 96 more intra-node steps (LL:
    max(hwLat 0.6, Intel net overhead 1.0) us each), the network steps stay 15; then 16 -> 512 nodes."""
    small = 8.0
    two, eight = (_cost("all_gather", small, _cluster(nodes=16, gpus=g)) for g in (2, 8))
    assert (two.protocol, eight.protocol) == ("LL", "LL")
    assert eight.latency_s - two.latency_s == pytest.approx((127 - 31) * 1.0e-6)
    lat = [_cost("all_gather", small, _cluster(nodes=n)).latency_s for n in (16, 128, 512)]
    assert lat[0] < lat[1] < lat[2]
    assert lat[2] / lat[1] == pytest.approx(4, rel=0.1)    # linear in ranks


def test_small_per_rank_shares_starve_the_bus_bandwidth():
    """A 16 MiB all-gather (a module's gather) reaches most of NVLink in a node, a few % over 4096 GPUs."""
    one = _busbw_GBps("all_gather", 1 << 24, _cluster())
    big = _busbw_GBps("all_gather", 1 << 24, _cluster(nodes=512))
    assert one > 150 and big < 0.05 * 360


def test_tree_wins_small_all_reduce_across_nodes_and_ring_the_huge_one():
    assert _cost("all_reduce", 1 << 20, _cluster(nodes=16)).algorithm == "Tree"
    # (two H100 nodes run NVLSTree; on A100, without NVLS, the huge one is Ring)
    assert _cost("all_reduce", 1 << 33, _cluster(nodes=2, profile="dgx-a100-80g")).algorithm == "Ring"
    assert _cost("all_reduce", 1 << 33, _cluster(nodes=16)).algorithm == "Ring"
    # Tree latency is logarithmic in nodes: 16 -> 512 nodes adds far less than the ring would
    t16, t512 = (_cost("all_reduce", 64.0, _cluster(nodes=n)) for n in (16, 512))
    assert t512.latency_s < 2 * t16.latency_s


def test_pat_runs_only_with_one_gpu_per_node():
    assert _cost("all_gather", 4096, _cluster(nodes=64, gpus=1)).algorithm == "PAT"
    assert _cost("all_gather", 4096, _cluster(nodes=64, gpus=8)).algorithm == "Ring"


def test_user_settings_restrict_the_choice():
    assert _cost("all_reduce", 1 << 20, _cluster(nodes=16, algo="ring")).algorithm == "Ring"
    assert _cost("all_gather", 4096, _cluster(proto="Simple")).protocol == "Simple"
    assert _cost("all_reduce", 1 << 20, _cluster(nodes=16, algo="ring;allreduce:tree")).algorithm == "Tree"
    full = _cost("all_gather", 1 << 33, _cluster(algo="ring"))
    quarter = _cost("all_gather", 1 << 33, _cluster(max_nchannels=4, algo="ring"))
    assert quarter.transfer_s == pytest.approx(4 * full.transfer_s)
    # duplicated channels share the same links: no more than the link's bandwidth
    assert _cost("all_gather", 1 << 33, _cluster(min_nchannels=32)).transfer_s == pytest.approx(full.transfer_s)
    # the channel limits are the ring graph's: NVLS keeps its graph (its CTAs are NCCL_NVLS_NCHANNELS'),
    # so a ring of four channels loses a node's gather to NVLS
    assert _cost("all_gather", 1 << 33, _cluster(max_nchannels=4)).algorithm == "NVLS"


def test_bad_nccl_settings_are_one_line_errors():
    with pytest.raises(ZsimInputError, match="nccl.algo"):
        load_profile("dgx-h100", {"nccl": {"algo": "ringg"}})
    with pytest.raises(ZsimInputError):
        load_profile("dgx-h100", {"nccl": {"min_nchannels": 8, "max_nchannels": 4}})


def test_measured_tables_and_gloo_keep_the_tier_model():
    assert nccl_topo_for(_cluster(profile="cpu-gloo-localhost", gpus=2)) is None
    assert nccl_topo_for(_cluster()) is not None
    calibrated = load_profile("dgx-h100", {"intra_node": {"efficiency_by_collective": {"all_gather": [[1.0, 0.5]]}}})
    assert nccl_topo_for(Cluster(profile=calibrated, nodes=1, gpus_per_node=8)) is None
    off = load_profile("dgx-h100", {"nccl": None})
    assert nccl_topo_for(Cluster(profile=off, nodes=1, gpus_per_node=8)) is None


def test_all_to_all_is_concurrent_sends_on_the_tiers_for_every_profile():
    # see [Note: all-to-all cost]: outside NCCL's tuner, one rule with or without an nccl: section
    cl = _cluster(nodes=2)
    intra, inter = tiers_for(cl)
    c = _cost("all_to_all", 1 << 20, cl)
    sends = all_to_all_cost(float(1 << 20), 2, 8, intra, inter)
    assert c.protocol == "" and c.algorithm == "p2p"
    assert (c.transfer_s, c.latency_s) == (sends.transfer_s, sends.latency_s + max(intra.sync_s, inter.sync_s))
    assert c == collective_cost("all_to_all", float(1 << 20), 2, 8, intra, inter)   # no nccl topology


def test_choice_is_the_minimum_of_ncclTopoGetAlgoTime():
    cl = _cluster(nodes=4)
    topo = nccl_topo_for(cl)
    best = choose("all_reduce", 1e6, 4, 8, topo)
    for algo in ("ring", "tree"):
        for proto in NCCL_PROTOS:
            forced = choose("all_reduce", 1e6, 4, 8, nccl_topo_for(_cluster(nodes=4, algo=algo, proto=proto)))
            assert best.latency_us + 1e6 / (1000 * best.bw_GBps) <= forced.latency_us + 1e6 / (1000 * forced.bw_GBps)


@pytest.mark.parametrize("setting", ["hardware.override.nccl.algo=tree", "hardware.override.nccl.algo=PAT",
                                     "hardware.override.nccl.proto=^LL,LL128,Simple"])
def test_an_nccl_setting_that_leaves_a_collective_no_algorithm_is_refused_in_one_line(setting, capsys):
    from zsim.cli import main
    assert main(["run", "--quiet", "--set", setting]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no algorithm NCCL can run" in err[0]


def test_nvls_runs_a_nodes_all_reduce_and_nvls_tree_across_two_nodes():
    """See [Note: NVLS in NCCL's tuner]: DGX H100's NVLS graph (8 channels, 40/48 GB/s): one
    node's large AllReduce is NVLS at 8 x 40 x 5/6 GB/s after 25 us, two nodes' NVLSTree at the
    same bandwidth after 25 + 2 x 14 us; from four nodes NVLSTree halves bwInter."""
    size = 1 << 33
    one = _cost("all_reduce", size, _cluster())
    assert (one.algorithm, one.protocol) == ("NVLS", "Simple")
    assert one.latency_s == pytest.approx(25e-6)
    assert one.transfer_s == pytest.approx(size / (8 * 40 * 5 / 6 * 1e9))
    assert _busbw_GBps("all_reduce", size, _cluster()) == pytest.approx(466.7, abs=1.0)
    two = _cost("all_reduce", size, _cluster(nodes=2))
    assert (two.algorithm, two.latency_s) == ("NVLSTree", pytest.approx(53e-6))
    assert two.transfer_s == pytest.approx(size / (8 * 40 * 5 / 6 * 1e9))
    four = choose("all_reduce", 64e6, 4, 8, nccl_topo_for(_cluster(nodes=4)))
    assert four.algorithm == "NVLSTree" and four.bw_GBps == pytest.approx(8 * 24 * 5 / 6)
    assert four.latency_us == pytest.approx(25 + 2 * 2 * 14)


def test_nvls_leaves_gathers_on_ring_and_needs_a_node_of_more_than_two_gpus():
    # AllGather/ReduceScatter over NVLS: 8 x min(40 x 7/8, 0.9 x 48) = 280 GB/s for the whole
    # buffer, below Ring's 360 x 8/7; across nodes NVLS needs CollNet: Ring either way
    topo = nccl_topo_for(_cluster())
    assert choose("all_gather", 1 << 30, 1, 8, topo).algorithm == "Ring"
    forced = choose("reduce_scatter", 1 << 30, 1, 8, nccl_topo_for(_cluster(algo="nvls")))
    assert (forced.algorithm, forced.bw_GBps) == ("NVLS", pytest.approx(280.0))
    assert _cost("all_gather", 1 << 30, _cluster(nodes=4)).algorithm == "Ring"
    # two GPUs of a node (a TP2 group) or a group on part of a node: no NVLS graph (nvls.cc:160)
    assert _cost("all_reduce", 1 << 30, _cluster(gpus=2)).algorithm == "Ring"
    assert _cost("all_reduce", 1 << 30, _cluster(algo="^nvls,nvlstree")).algorithm == "Ring"
    assert _cost("all_reduce", 1 << 30, _cluster(nvls_channels=0)).algorithm == "Ring"
    # A100 has no NVLS graph, and a profile saying otherwise is refused
    assert _cost("all_reduce", 1 << 30, _cluster(profile="dgx-a100-80g")).algorithm == "Ring"
    with pytest.raises(ZsimInputError, match="nvls_channels"):
        load_profile("dgx-a100-80g", {"nccl": {"nvls_channels": 8, "nvls_bw_intra_GBps": 40, "nvls_bw_inter_GBps": 48}})
    with pytest.raises(ZsimInputError, match="nvls_bw_intra_GBps"):
        load_profile("dgx-h100", {"nccl": {"nvls_bw_intra_GBps": 0}})
