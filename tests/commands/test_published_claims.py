"""Published ZeRO-Offload / ZeRO-Infinity claims, reproduced by the simulator.

- Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC '21), abstract and
  sec. 6: a 10B-parameter model (and up to 13B) trains on a single 32 GB V100 with ZeRO-Offload, which
  plain data parallelism / ZeRO without offload cannot fit; with offload the CPU Adam step and PCIe transfers
  are what limits the step (sec. 4-5: the CPU-side update and the gradient/parameter swaps).
- Rajbhandari et al. 2021, "ZeRO-Infinity: Breaking the GPU Memory Wall" (SC '21), sec. 1 and 7.1: with NVMe
  offload a single DGX-2 node trains models far beyond 100B parameters, which neither GPU memory nor the
  node's 1.5 TB of CPU memory can hold.
"""
import copy

from tests.helpers import ROOT
from zsim.api import run_file, run_scenario
from zsim.config.scenario import scenario_from_mapping

SEED002 = ROOT / "scenarios" / "seed002-zero2-offload-10b.yaml"


def _run(raw):
    return run_scenario(scenario_from_mapping(raw, ROOT))[0]


def test_zero_offload_10b_fits_one_32gb_v100_only_with_offload():
    with_off = run_file(SEED002)[0]
    assert with_off.n_params > 10e9
    assert with_off.fits
    without = run_file(SEED002, ("deepspeed.zero_optimization.offload_optimizer.device=none",))[0]
    assert not without.memory.fits


GPT3_13B_ONE_V100 = {
    "name": "gpt3-13b-1xv100",
    "model": {"preset": "gpt3-13b"},
    "hardware": {"profile": "dgx2-v100", "nodes": 1, "gpus_per_node": 1},
    "training": {"micro_batch_size": 4, "gradient_accumulation_steps": 1, "seq_len": 1024, "precision": "fp16",
                 "activation_checkpointing": "full"},
    "deepspeed": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 2e8}},
}


def test_zero_offload_13b_fits_one_v100_and_the_bottleneck_moves_to_cpu_and_pcie():
    r = _run(GPT3_13B_ONE_V100)
    assert 12e9 < r.n_params < 14e9
    assert r.fits
    raw = copy.deepcopy(GPT3_13B_ONE_V100)
    del raw["deepspeed"]["zero_optimization"]["offload_optimizer"]
    plain = _run(raw)
    assert not plain.memory.fits
    host = r.host_time_s
    offload_s = host["cpu_adam"] + host["d2h"] + host["h2d"]
    # CPU Adam + PCIe take longer than the GPU's compute: they, not the GPU, set the step time
    assert offload_s > r.compute_time_s
    assert r.step_time_s > 1.5 * plain.step_time_s


# ~101B parameters (80 layers x 10240, GPT-style), one DGX-2 (16 x V100 32 GB, 1.5 TB DDR4, 8 NVMe drives)
INFINITY_100B = {
    "name": "100b-1xdgx2",
    "model": {"layers": 80, "hidden": 10240, "heads": 80, "vocab": 50257, "seq_len": 1024},
    "hardware": {"profile": "dgx2-v100", "nodes": 1},
    "training": {"micro_batch_size": 1, "gradient_accumulation_steps": 1, "seq_len": 1024, "precision": "fp16",
                 "activation_checkpointing": "full"},
    "deepspeed": {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"},
                                        "offload_param": {"device": "nvme"}}},
}


def test_zero_infinity_100b_fits_one_dgx2_with_nvme_but_not_in_gpu_or_cpu_memory():
    r = _run(INFINITY_100B)
    assert r.n_params > 100e9
    assert r.fits
    assert r.host_time_s["nvme_read"] > 0 and r.host_time_s["nvme_write"] > 0
    gpu_only = copy.deepcopy(INFINITY_100B)
    gpu_only["deepspeed"]["zero_optimization"] = {"stage": 3}
    assert not _run(gpu_only).memory.fits
    cpu = copy.deepcopy(INFINITY_100B)
    cpu["deepspeed"]["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                             "offload_param": {"device": "cpu"}}
    r_cpu = _run(cpu)
    assert r_cpu.memory.fits and not r_cpu.memory.host.fits   # a CPU OOM is an OOM too


def test_cpu_checkpointing_moves_checkpoints_to_host_over_pcie():
    raw = copy.deepcopy(GPT3_13B_ONE_V100)
    raw["deepspeed"]["activation_checkpointing"] = {"cpu_checkpointing": True}
    r = _run(raw)
    base = _run(GPT3_13B_ONE_V100)
    assert "activation checkpoints (cpu_checkpointing)" in r.memory.host.breakdown
    assert r.memory.peak_bytes < base.memory.peak_bytes
    assert r.host_time_s["d2h"] > base.host_time_s["d2h"]
    assert r.host_time_s["h2d"] > base.host_time_s["h2d"]
    assert not any("cpu_checkpointing" in w for w in r.warnings)


def test_cpu_checkpointing_without_full_checkpointing_warns_and_changes_nothing():
    raw = copy.deepcopy(GPT3_13B_ONE_V100)
    raw["training"]["activation_checkpointing"] = "selective"
    plain = _run(raw)
    raw["deepspeed"]["activation_checkpointing"] = {"cpu_checkpointing": True}
    r = _run(raw)
    assert any("cpu_checkpointing" in w for w in r.warnings)
    assert r.step_time_s == plain.step_time_s
