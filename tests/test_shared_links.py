"""Shared PCIe links (issue 3): GPUs under one switch share its uplink to the CPU; with
GPUDirect RDMA the NIC traffic crosses the GPU's own PCIe link; PCIe is full duplex."""
import pytest

from helpers import scenario
from zsim.engine.sim import simulate
from zsim.hardware.host import host_link_Bps
from zsim.schedule.ops import Builder

GB = 1e9


def _cluster(**pcie):
    # slow rails so a 2-node all-gather is bound by InfiniBand, not NVLink
    return scenario(**{"hardware.nodes": 2,
                       "hardware.override": {"pcie": pcie, "inter_node": {"nic_bw_Gbps": 50}}}).cluster


def _duration(cluster, *ops):
    b = Builder()
    for name, stream, work in ops:
        b.add(name, stream, "step", 0, **work)
    trace = simulate(b.build(2, {}), cluster, "bf16")
    return {op.name: t.end_s - t.start_s for op, t in zip(trace.schedule.ops, trace.timings)}


def test_uplink_share_is_the_bottleneck_when_every_gpu_copies():
    assert host_link_Bps(24 * GB, 24 * GB, 2) == 12 * GB
    assert host_link_Bps(24 * GB, None, 2) == 24 * GB
    assert host_link_Bps(10 * GB, 48 * GB, 2) == 10 * GB
    shared = _cluster(bw_GBps_per_gpu=24, gpus_per_switch=2, switch_uplink_GBps=24, latency_us=0)
    own = _cluster(bw_GBps_per_gpu=24, gpus_per_switch=2, switch_uplink_GBps=None, latency_us=0)
    h2d = ("h2d", "h2d", {"transfer": "h2d", "size_bytes": 12 * GB})
    assert _duration(shared, h2d)["h2d"] == pytest.approx(1.0)
    assert _duration(own, h2d)["h2d"] == pytest.approx(0.5)


def test_ib_traffic_and_h2d_share_the_gpu_link_only_with_gpudirect():
    ag = ("ag", "allgather", {"collective": "all_gather", "size_bytes": 8 * GB})
    h2d = ("h2d", "h2d", {"transfer": "h2d", "size_bytes": 1.2 * GB})
    for share in (True, False):
        cl = _cluster(bw_GBps_per_gpu=24, gpus_per_switch=1, latency_us=0, nics_share_gpu_link=share)
        alone = _duration(cl, h2d)["h2d"]
        together = _duration(cl, ag, h2d)["h2d"]
        assert (together > alone * 1.2) is share


def test_pcie_is_full_duplex_but_nvme_reads_and_d2h_share_the_uplink():
    cl = _cluster(bw_GBps_per_gpu=24, gpus_per_switch=2, switch_uplink_GBps=24, latency_us=0)
    d2h = ("d2h", "d2h", {"transfer": "d2h", "size_bytes": 12 * GB})
    h2d = ("h2d", "h2d", {"transfer": "h2d", "size_bytes": 12 * GB})
    read = ("read", "nvme", {"transfer": "nvme_read", "size_bytes": 2 * GB})
    assert _duration(cl, d2h, h2d)["d2h"] == pytest.approx(_duration(cl, d2h)["d2h"])   # opposite directions
    assert _duration(cl, d2h, read)["d2h"] > _duration(cl, d2h)["d2h"] * 1.05          # same direction
