"""The collectives zsim schedules for stages 0-3 equal those real DeepSpeed 0.19.8 issued on
CPU/gloo (world size 2) for the same model and ds_config, recorded by wrapping
torch.distributed (calibration/deepspeed_record/, tests/fixtures/deepspeed/)."""
import pytest

from calibration.deepspeed_record.cases import MODEL
from tests.helpers import fixture_names, load_fixture, recorded_steady_state, scenario_for, simulated
from zsim.schedule.build import workload_for

NAMES = fixture_names()


def test_fixtures_cover_every_stage_and_knob():
    stages = {load_fixture(n)["ds_config"]["zero_optimization"]["stage"] for n in NAMES}
    assert stages == {0, 1, 2, 3}
    knobs = {k for n in NAMES for k in load_fixture(n)["ds_config"]["zero_optimization"]}
    for knob in ("reduce_bucket_size", "overlap_comm", "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                 "stage3_max_reuse_distance", "stage3_param_persistence_threshold", "reduce_scatter",
                 "use_multi_rank_bucket_allreduce", "contiguous_gradients"):
        assert knob in knobs


@pytest.mark.parametrize("name", NAMES)
def test_fixture_model_is_the_recorders_and_the_workloads(name):
    """The fixture was recorded on the model the recorder builds today (calibration's GPT of
    cases.MODEL) and the simulator rebuilds; DeepSpeed's parameters came in zsim's order."""
    fx = load_fixture(name)
    sc = scenario_for(fx)
    assert sc.model == MODEL
    wl = workload_for(sc)
    assert [p["numel"] for p in fx["params"]] == [p.numel for p in wl.params]


@pytest.mark.parametrize("name", NAMES)
def test_collective_sequence_matches_deepspeed(name):
    fx = load_fixture(name)
    recorded = recorded_steady_state(fx)
    assert recorded, "fixture has no steady-state collectives"
    assert simulated(fx) == recorded


def test_knobs_change_the_sequence():
    """Guard against a fixture set where every case looks alike."""
    seqs = {n: tuple(recorded_steady_state(load_fixture(n))) for n in NAMES}
    assert seqs["stage2_reduce_bucket_1e6"] != seqs["stage2_default"]
    assert seqs["stage3_prefetch_0"] != seqs["stage3_default"]
    assert seqs["stage3_max_live_1e6"] != seqs["stage3_default"]
    assert seqs["stage3_prefetch_0_reuse_0"] != seqs["stage3_prefetch_0"]
    # see [Note: release sets frozen at the first complete trace]: with accumulation lm_head is released
    # after its forward and gathered again for its backward, one gather more per micro-step
    g1 = [c for c in seqs["stage3_max_live_3e6_reuse_0"] if c[:2] == ("backward", "all_gather")]
    g2 = [c for c in seqs["stage3_gas2_max_live_3e6_reuse_0"] if c[:2] == ("backward", "all_gather")]
    assert len(g2) == 2 * (len(g1) + 1)
    # stage 1 reduces once per optimizer step, stage 2 every micro-step
    s1 = [c for c in seqs["stage1_gas2"] if c[1] == "all_reduce" and c[2] > 1]
    s2 = [c for c in seqs["stage2_gas2"] if c[1] == "all_reduce" and c[2] > 1]
    assert len(s2) == 2 * len(s1)
