"""The communication table's "busbw X of Y": Y is the peak of the tier each collective's process
group crosses (zsim/hardware/placement.py), not one figure for the cluster."""
import io
import re

import pytest
from rich.console import Console

from tests.helpers import scenario
from zsim.api import run_scenario
from zsim.report.table import render

GB = 1e9
# two DGX A100 nodes: NVLink busbw 235 GB/s, 8 x 200 Gb/s NICs = 200 GB/s a node, 25 GB/s a rail
TWO_NODES = {"hardware.nodes": 2, "deepspeed.zero_optimization.stage": 1}


def _table_peaks(result) -> dict[str, float]:
    """collective -> the "of" figure of its row in the rendered table."""
    console = Console(file=io.StringIO(), width=250)
    render(result, console)
    rows = {}
    for line in console.file.getvalue().splitlines():
        m = re.match(r"│ (\S+(?: \S+)?)\s+│.*│\s+[\d.]+ of (\d+) │$", line)
        if m:
            rows[m.group(1)] = float(m.group(2))
    return rows


def test_tp_collectives_inside_a_node_are_measured_against_nvlink():
    result, _ = run_scenario(scenario(**TWO_NODES, **{"parallelism.tensor": 2}))
    c = result.comm
    assert c.link_busbw_Bps == pytest.approx(200 * GB)     # the cluster's: NICs across the nodes
    assert c.tier_busbw_Bps["tp all_reduce"] == pytest.approx(235 * GB)   # a TP pair inside a node
    assert c.tier_busbw_Bps["all_reduce"] == pytest.approx(200 * GB)      # ZeRO's DP 8 spans both nodes
    peaks = _table_peaks(result)
    assert peaks["tp all_reduce"] == 235 and peaks["all_reduce"] == 200
    assert c.achieved_busbw_Bps["tp all_reduce"] <= c.tier_busbw_Bps["tp all_reduce"]


def test_a_send_across_nodes_is_measured_against_one_rail():
    # PP 2 x DP 8 on two nodes: stage 1's ranks are the second node's, every send crosses
    result, _ = run_scenario(scenario(**TWO_NODES, **{"parallelism.pipeline": 2,
                                                     "training.gradient_accumulation_steps": 2}))
    assert result.comm.tier_busbw_Bps["send_recv"] == pytest.approx(25 * GB)
    assert _table_peaks(result)["send_recv"] == 25
    # inside one node (PP 2 x DP 4): NVLink
    inside, _ = run_scenario(scenario(**{"parallelism.pipeline": 2, "deepspeed.zero_optimization.stage": 1,
                                         "training.gradient_accumulation_steps": 2}))
    assert inside.comm.tier_busbw_Bps["send_recv"] == pytest.approx(235 * GB)


def test_one_node_data_parallel_is_the_cluster_figure_and_the_json_keeps_its_schema():
    result, _ = run_scenario(scenario())
    peaks = result.comm.tier_busbw_Bps
    assert peaks and all(v == pytest.approx(result.comm.link_busbw_Bps) for v in peaks.values())
    assert "tier_busbw_Bps" not in result.to_dict()["comm"]
