"""Exact values of the collective cost functions (alpha-beta, nccl-tests bus bandwidth)."""
import math

import pytest

from zsim.hardware.collectives import (CommCost, Tier, bus_factor, collective_cost, hierarchical_cost, ring_cost,
                                       tree_allreduce_cost)

FLAT = ((1.0, 1.0),)
INTRA = Tier(busbw_Bps=200e9, latency_s=2e-6, efficiency=FLAT)
INTER = Tier(busbw_Bps=25e9, latency_s=5e-6, efficiency=FLAT)


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_gather", 8) == 7 / 8
    assert bus_factor("reduce_scatter", 8) == 7 / 8
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert bus_factor("broadcast", 8) == 1.0
    assert bus_factor("all_to_all", 4) == 3 / 4
    assert bus_factor("all_gather", 1) == 0.0


def test_ring_all_gather_exact():
    c = ring_cost("all_gather", 1e9, 8, INTRA, "intra_node")
    assert c.latency_s == pytest.approx(7 * 2e-6)
    assert c.transfer_s == pytest.approx(1e9 * 7 / 8 / 200e9)


def test_ring_all_reduce_is_twice_the_steps_and_bytes():
    ag = ring_cost("all_gather", 1e8, 8, INTRA, "intra_node")
    ar = ring_cost("all_reduce", 1e8, 8, INTRA, "intra_node")
    assert ar.latency_s == pytest.approx(2 * ag.latency_s)
    assert ar.transfer_s == pytest.approx(2 * ag.transfer_s)


def test_efficiency_table_interpolates_in_log_size():
    tier = Tier(100e9, 0.0, ((1e3, 0.1), (1e9, 1.0)))
    c = ring_cost("broadcast", 1e6, 2, tier, "t")   # halfway in log space -> 0.55
    assert c.transfer_s == pytest.approx(1e6 / (100e9 * 0.55))


def test_hierarchical_all_gather_takes_the_slower_phase_and_adds_latencies():
    c = hierarchical_cost("all_gather", 8e9, 4, 8, INTRA, INTER)
    intra_t = 8e9 * 7 / 8 / 200e9
    inter_t = (8e9 / 8) * 3 / 4 / 25e9
    assert c.transfer_s == pytest.approx(max(intra_t, inter_t))
    assert c.latency_s == pytest.approx(7 * 2e-6 + 3 * 5e-6)
    assert c.tier == "intra_node"   # 35 ms on NVLink vs 30 ms per rail
    slow_rails = Tier(busbw_Bps=10e9, latency_s=5e-6, efficiency=FLAT)
    c2 = hierarchical_cost("all_gather", 8e9, 4, 8, INTRA, slow_rails)
    assert c2.tier == "inter_node"
    assert c2.transfer_s == pytest.approx((8e9 / 8) * 3 / 4 / 10e9)


def test_tree_allreduce_latency_is_logarithmic_in_nodes():
    t = tree_allreduce_cost(1e3, 128, 8, INTRA, INTER)
    assert t.latency_s == pytest.approx(2 * math.ceil(math.log2(128)) * 5e-6 + 2 * 7 * 2e-6)
    # small all-reduce across 128 nodes: the tree wins over the ring
    c = collective_cost("all_reduce", 1e3, 128, 8, INTRA, INTER)
    assert c == t


def test_single_rank_costs_nothing():
    assert collective_cost("all_gather", 1e9, 1, 1, INTRA, INTER) == CommCost(0.0, 0.0, "intra_node")


def test_unknown_collective_is_rejected():
    with pytest.raises(ValueError):
        collective_cost("gather", 1.0, 1, 8, INTRA, INTER)


def test_coalesced_falls_back_to_the_collectives_own_table():
    tables = (("all_gather", ((1.0, 0.5),)), ("all_gather_coalesced", ((1.0, 0.25),)))
    tier = Tier(busbw_Bps=200e9, latency_s=2e-6, efficiency=FLAT, by_collective=tables)
    one = collective_cost("all_gather", 1e6, 1, 8, tier, INTER)
    batch = collective_cost("all_gather", 1e6, 1, 8, tier, INTER, coalesced=True)
    assert batch.transfer_s == pytest.approx(2 * one.transfer_s)
    # reduce_scatter has no coalesced table: its own curve (the shared one here) applies
    assert collective_cost("reduce_scatter", 1e6, 1, 8, tier, INTER, coalesced=True) == \
        collective_cost("reduce_scatter", 1e6, 1, 8, tier, INTER)


def test_sync_overhead_is_paid_once_per_collective():
    synced = Tier(busbw_Bps=200e9, latency_s=2e-6, efficiency=FLAT, sync_s=300e-6)
    plain = collective_cost("all_gather", 1e6, 1, 8, INTRA, INTER)
    with_sync = collective_cost("all_gather", 1e6, 1, 8, synced, INTER)
    assert with_sync.latency_s == pytest.approx(plain.latency_s + 300e-6)
    assert with_sync.transfer_s == plain.transfer_s
    across = collective_cost("all_reduce", 1e6, 4, 8, synced, INTER)
    no_sync = collective_cost("all_reduce", 1e6, 4, 8, INTRA, INTER)
    assert across.latency_s == pytest.approx(no_sync.latency_s + 300e-6)
