"""ZeRO-3 at fixed global batch from 8 to 4096 GPUs (the micro-batch shrinks as GPUs grow):
per-GPU throughput holds while communication hides under compute and falls once it does
not; the crossover moves with link bandwidth and model size as NCCL's cost model says."""
from functools import lru_cache

import pytest

from tests.helpers import ROOT
from zsim.api import run_scenario
from zsim.config.scenario import scenario_from_mapping
from zsim.result import ZERO3_RANK_LOOPS

GPUS = (8, 32, 128, 256, 512, 1024, 2048, 4096)
BATCH = 4096   # sequences per step: micro-batch 512 on 8 GPUs, 1 on 4096


def _run(model: str, gpus: int, nic_Gbps: float | None, view_us: float | None):
    m = {"name": f"{model}-{gpus}", "model": {"preset": model},
         "hardware": {"profile": "dgx-a100-80g", "nodes": gpus // 8, "gpus_per_node": 8, "override": {}},
         "training": {"micro_batch_size": BATCH // gpus, "gradient_accumulation_steps": 1, "seq_len": 2048,
                      "precision": "bf16", "activation_checkpointing": "full", "flash_attention": True},
         "deepspeed": {"zero_optimization": {"stage": 3, "overlap_comm": True}}}
    if nic_Gbps:
        m["hardware"]["override"]["inter_node"] = {"nic_bw_Gbps": nic_Gbps}
    if view_us is not None:
        m["hardware"]["override"]["cpu"] = {"zero3_rank_view_us": view_us}
    return run_scenario(scenario_from_mapping(m, ROOT))[0]


@lru_cache(maxsize=None)
def _point(model: str, gpus: int, nic_Gbps: float | None = None):
    """The communication side alone: DeepSpeed's host loops over ranks (priced by the next
    tests) off, so the crossover is NCCL's."""
    r = _run(model, gpus, nic_Gbps, 0.0)
    return r.tokens_per_s_per_gpu, r.compute_time_s, sum(r.comm.time_s.values())


def _crossover(model: str, nic_Gbps: float | None = None) -> int:
    """The first GPU count whose communication busy time per step passes its compute."""
    return next((g for g in GPUS if _point(model, g, nic_Gbps)[2] >= _point(model, g, nic_Gbps)[1]), 10 ** 9)


def test_per_gpu_throughput_falls_once_communication_exceeds_compute():
    pts = [_point("gpt3-6.7b", g) for g in GPUS]
    best = max(tok for tok, _, _ in pts)
    hidden = [tok for tok, compute, comm in pts if comm < 0.25 * compute]
    exposed = [tok for tok, compute, comm in pts if comm > compute]
    assert len(hidden) >= 3 and len(exposed) >= 2
    assert min(hidden) > 0.9 * best
    assert max(exposed) < 0.6 * best
    assert exposed == sorted(exposed, reverse=True)      # and keeps falling


def test_communication_per_gpu_grows_with_the_rank_count():
    """At fixed global batch ZeRO-3 gathers the whole model once per micro-step on every GPU
    count; its time still grows, because each ring pays one step latency per rank."""
    comm = [_point("gpt3-6.7b", g)[2] for g in GPUS]
    assert comm == sorted(comm)
    assert comm[-1] > 5 * comm[2]


@pytest.mark.parametrize("slow, fast", [(25, 200), (50, 800)])
def test_faster_nics_move_the_crossover_out(slow, fast):
    assert _crossover("gpt3-6.7b", slow) <= _crossover("gpt3-6.7b", fast)
    assert all(_point("gpt3-6.7b", g, fast)[2] < _point("gpt3-6.7b", g, slow)[2] for g in (256, 1024))


def test_bigger_models_cross_later():
    """Compute per micro-step grows with the parameters like the bytes gathered do, but a bigger
    model's gathers are bigger messages, which reach more of the link's bandwidth."""
    small, big = _crossover("gpt3-6.7b"), _crossover("gpt3-175b")
    assert small < big
    assert _crossover("gpt3-6.7b", 25) < small     # slow Ethernet-class NICs cross earlier


def test_scaling_plot_marks_where_communication_stops_hiding(monkeypatch, tmp_path):
    from zsim.report import plots
    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figs.append(fig))
    rows = [{"stage": 3, "world_size": g, "tokens_per_s": 1.0 * g, "tokens_per_s_per_gpu": 1.0, "fits": True,
             "compute_time_s": 64.0 / g, "comm.time_s.all_gather": 0.5, "comm.time_s.reduce_scatter": 0.25,
             "comm.exposed_time_s": 0.01} for g in (8, 16, 32, 64, 128)]
    plots.scaling_plot(plots.scaling_data(rows), "t", str(tmp_path / "s.png"))
    panel = figs[0].axes[2]
    crossing = [ln for ln in panel.lines if list(ln.get_xdata()) == [128, 128]]
    assert len(figs[0].axes) == 3 and len(crossing) == 1     # 0.75 s comm >= 0.5 s compute first at 128


@lru_cache(maxsize=None)
def _loops(model: str, gpus: int, view_us: float | None = None):
    r = _run(model, gpus, None, view_us)
    return r.tokens_per_s_per_gpu, r.host_time_s.get(ZERO3_RANK_LOOPS, 0.0)


def test_zero3_host_loops_grow_with_the_rank_count_and_cost_throughput():
    """See [Note: per-rank host loops]: at fixed global batch the views per step grow in
    proportion to the data-parallel size (same buckets, one view per rank per tensor), so the
    loops' host time doubles with the GPUs while the compute per GPU halves; with them the
    per-GPU throughput falls earlier and further than NCCL alone makes it."""
    loops = [_loops("gpt3-6.7b", g)[1] for g in GPUS]
    assert all(b == pytest.approx(2 * a, rel=0.02) for a, b in zip(loops[3:], loops[4:]))   # 256 GPUs on
    assert loops[0] > 0
    with_loops = [_loops("gpt3-6.7b", g)[0] for g in GPUS]
    without = [_point("gpt3-6.7b", g)[0] for g in GPUS]
    assert all(a < b for a, b in zip(with_loops, without))
    assert with_loops[-1] / with_loops[2] < 0.8 * without[-1] / without[2]
    # a slower host (2x the view cost) loses more at 4096 GPUs
    assert _loops("gpt3-6.7b", 4096, 5.0)[0] < with_loops[-1]
