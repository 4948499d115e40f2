"""Shared PCIe links (issue 3): GPUs under one switch share its uplink to the CPU; with
GPUDirect RDMA the NIC traffic crosses the GPU's own PCIe link; PCIe is full duplex."""
import pytest

from tests.helpers import add_copy, add_gather, build, scenario
from zsim.engine.sim import simulate
from zsim.hardware.host import host_link_Bps
from zsim.schedule.builder import Builder

GB = 1e9


def _cluster(**pcie):
    # slow rails so a 2-node all-gather is bound by InfiniBand, not NVLink
    return scenario(**{"hardware.nodes": 2,
                       "hardware.override": {"pcie": pcie, "inter_node": {"nic_bw_Gbps": 50}}}).cluster


def _duration(cluster, *ops):
    """Durations of (name, kind, size_bytes) ops run side by side; kind is a transfer or "ag"."""
    b = Builder()
    ids = {name: add_gather(b, size) if kind == "ag" else add_copy(b, kind, size) for name, kind, size in ops}
    trace = simulate(build(b, 2), cluster, "bf16")
    return {name: trace.timings[i].end_s - trace.timings[i].start_s for name, i in ids.items()}


def test_uplink_share_is_the_bottleneck_when_every_gpu_copies():
    assert host_link_Bps(24 * GB, 24 * GB, 2) == 12 * GB
    assert host_link_Bps(24 * GB, None, 2) == 24 * GB
    assert host_link_Bps(10 * GB, 48 * GB, 2) == 10 * GB
    shared = _cluster(bw_GBps_per_gpu=24, gpus_per_switch=2, switch_uplink_GBps=24, latency_us=0)
    own = _cluster(bw_GBps_per_gpu=24, gpus_per_switch=2, switch_uplink_GBps=None, latency_us=0)
    h2d = ("h2d", "h2d", 12 * GB)
    assert _duration(shared, h2d)["h2d"] == pytest.approx(1.0)
    assert _duration(own, h2d)["h2d"] == pytest.approx(0.5)


def test_ib_traffic_and_h2d_share_the_gpu_link_only_with_gpudirect():
    ag = ("ag", "ag", 8 * GB)
    h2d = ("h2d", "h2d", 1.2 * GB)
    for share in (True, False):
        cl = _cluster(bw_GBps_per_gpu=24, gpus_per_switch=1, latency_us=0, nics_share_gpu_link=share)
        alone = _duration(cl, h2d)["h2d"]
        together = _duration(cl, ag, h2d)["h2d"]
        assert (together > alone * 1.2) is share


def test_pcie_is_full_duplex_but_nvme_reads_and_d2h_share_the_uplink():
    cl = _cluster(bw_GBps_per_gpu=24, gpus_per_switch=2, switch_uplink_GBps=24, latency_us=0)
    d2h = ("d2h", "d2h", 12 * GB)
    h2d = ("h2d", "h2d", 12 * GB)
    read = ("read", "nvme_read", 2 * GB)
    assert _duration(cl, d2h, h2d)["d2h"] == pytest.approx(_duration(cl, d2h)["d2h"])   # opposite directions
    assert _duration(cl, d2h, read)["d2h"] > _duration(cl, d2h)["d2h"] * 1.05          # same direction


def test_partial_offload_ratio_splits_the_step_between_cpu_and_gpu():
    from zsim.api import run_scenario
    base = {"deepspeed.zero_optimization.stage": 3, "model.layers": 8, "model.hidden": 1024}
    full = run_scenario(scenario(**base, **{"deepspeed.zero_optimization.offload_optimizer":
                                            {"device": "cpu", "ratio": 1.0}}))[0]
    half = run_scenario(scenario(**base, **{"deepspeed.zero_optimization.offload_optimizer":
                                            {"device": "cpu", "ratio": 0.5}}))[0]
    assert half.host_time_s["cpu_adam"] == pytest.approx(full.host_time_s["cpu_adam"] / 2)
    assert half.memory.breakdown["optimizer states"] > 0
    assert "optimizer states" not in full.memory.breakdown


def test_loading_the_model_can_exhaust_host_memory_without_zero_init():
    from zsim.api import run_scenario
    common = {"model": {"preset": "llama2-70b"}, "training.seq_len": 512, "training.micro_batch_size": 1,
              "hardware.override": {"cpu": {"memory_GiB": 512}}}
    stage2 = run_scenario(scenario(**common, **{"deepspeed.zero_optimization.stage": 2}))[0].memory.host
    stage3 = run_scenario(scenario(**common, **{"deepspeed.zero_optimization.stage": 3}))[0].memory.host
    # 8 ranks x 69 B params x 2 bytes each, vs. one partition each with zero.Init
    assert stage2.load_bytes_per_node == pytest.approx(8 * 68_976_648_192 * 2)
    assert stage2.fits is False and stage3.fits is True
