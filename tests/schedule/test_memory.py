"""Model-state memory from the ledger equals the ZeRO paper's closed forms (Rajbhandari et al.
2020, fig. 1): 16P; 4P + 12P/N; 2P + 14P/N; 16P/N, with buffers (buckets, gathered and
persistent params) counted separately; stage 2's gradient partition holds whole params (see
[Note: a grads_in_partition per backward])."""
import pytest

from tests.helpers import model_states_held, scenario
from zsim.api import run_scenario
from zsim.engine.ledger import timeline
from zsim.schedule.build import build_schedule
from zsim.schedule.partition import flat_group, params_in_partition_numel


@pytest.mark.parametrize("stage,formula", [
    (0, lambda P, N: 16 * P),
    (1, lambda P, N: 4 * P + 12 * P / N),
    # stage 2's gradient partition is DeepSpeed's grads_in_partition: every param with elements
    # in the rank's partition, whole (2P/N plus the params straddling its edges; the largest rank's)
    (2, lambda P, N, gip: 2 * P + 12 * P / N + 2 * gip),
    (3, lambda P, N: 16 * P / N),
])
def test_closed_forms(stage, formula):
    # one bucket holds every gradient: stage 1's full 16-bit gradients all go into the IPG
    # buffer before its partition is written (with smaller buckets the partition appears while
    # the later buckets' gradients still exist, above the paper's figure by up to 2P/N)
    sc = scenario(**{"deepspeed.zero_optimization.stage": stage, "deepspeed.zero_optimization.reduce_bucket_size": 1e9})
    wl, _ = build_schedule(sc)
    P, N = wl.n_params, sc.cluster.world_size
    assert P % (2 * N) == 0, "pick a model whose flat buffer needs no padding"
    if stage == 2:
        numels = [p.numel for p in wl.params]
        gip = max(params_in_partition_numel(flat_group(range(len(numels)), numels, N), numels))
        assert P / N < gip < 2 * P / N      # the test model has params straddling the edges
        assert model_states_held(sc) == pytest.approx(formula(P, N, gip), rel=1e-12)
        return
    assert model_states_held(sc) == pytest.approx(formula(P, N), rel=1e-12)


def test_peak_includes_activations_and_reserve_and_is_reached_in_the_ledger():
    result, trace = run_scenario(scenario())
    mem = result.memory
    # the reported peak is the ledger's highest level (plus the reserve), not a sum of categories
    reserve = mem.breakdown["CUDA context + allocator reserve"]
    assert mem.peak_bytes == pytest.approx(max(used for _, used in timeline(trace.ledger_events)) + reserve)
    assert mem.breakdown["activations"] > 0
    assert mem.breakdown["CUDA context + allocator reserve"] > 0
    # every allocation is freed or static: the ledger ends at the static model states
    _, sched = build_schedule(scenario())
    end = sum(d for _, d, _, _ in trace.ledger_events)
    assert end == pytest.approx(sum(a.size_bytes for a in sched.static))


def test_full_checkpointing_lowers_the_peak_and_costs_time():
    base, _ = run_scenario(scenario(**{"training.micro_batch_size": 8}))
    ckpt, _ = run_scenario(scenario(**{"training.micro_batch_size": 8, "training.activation_checkpointing": "full"}))
    assert ckpt.memory.peak_bytes < base.memory.peak_bytes
    assert ckpt.step_time_s > base.step_time_s
    assert ckpt.hfu > ckpt.mfu        # recompute counts as hardware FLOPs only


def test_oom_verdict_against_capacity():
    big = scenario(**{"model": {"preset": "gpt3-13b"}, "training.micro_batch_size": 16,
                      "training.seq_len": 2048, "deepspeed.zero_optimization.stage": 0})
    result, _ = run_scenario(big)
    assert result.memory.fits is False
    assert result.memory.peak_bytes > result.memory.capacity_bytes


def test_optimizer_offload_moves_states_to_host():
    on_gpu, _ = run_scenario(scenario())
    off, _ = run_scenario(scenario(**{"deepspeed.zero_optimization.offload_optimizer": {"device": "cpu"}}))
    assert "optimizer states" not in off.memory.breakdown
    assert off.memory.host.breakdown["optimizer states"] > 0
    assert off.memory.peak_bytes < on_gpu.memory.peak_bytes
    assert off.host_time_s["cpu_adam"] > 0 and off.host_time_s["d2h"] > 0


@pytest.mark.parametrize("changes", [
    {"deepspeed.zero_optimization.stage": 1, "deepspeed.zero_optimization.overlap_comm": True,
     "training.activation_checkpointing": "full"},
    {"deepspeed.zero_optimization.stage": 1, "training.gradient_accumulation_steps": 3},
    {"deepspeed.zero_optimization.stage": 1, "deepspeed.zero_optimization.overlap_comm": True,
     "training.gradient_accumulation_steps": 3, "deepspeed.zero_optimization.use_multi_rank_bucket_allreduce": False},
    {"deepspeed.zero_optimization.stage": 2, "deepspeed.zero_optimization.contiguous_gradients": False,
     "training.gradient_accumulation_steps": 2, "training.activation_checkpointing": "selective"},
    {"deepspeed.zero_optimization.stage": 2, "deepspeed.zero_optimization.offload_optimizer": {"device": "cpu"}},
    {"deepspeed.zero_optimization.stage": 1, "deepspeed.data_types": {"grad_accum_dtype": "fp32"}},
])
def test_every_step_allocation_is_freed_by_the_end_of_the_step(changes):
    # a free ordered before its allocation is dropped by the ledger and the tag stays live
    sc = scenario(**changes)
    _, trace = run_scenario(sc)
    _, sched = build_schedule(sc)
    live: dict[str, float] = {}
    for _, delta, _, tag in trace.ledger_events:
        live[tag] = live.get(tag, 0.0) + delta
    static = {a.tag for a in sched.static}
    assert {t: v for t, v in live.items() if v and t not in static} == {}


def test_zero3_sub_groups_follow_deepspeeds_param_boundaries():
    from zsim.schedule.partition import sub_group_sizes
    # partition numels 3, 3, 2, 5 on 2 ranks (6, 5, 3, 9 elements): a group closes once it reaches 4
    assert sub_group_sizes([6, 5, 3, 9], 2, 4) == [6, 7]
    # 0: one group per parameter (stage3.py _create_fp16_sub_groups: a group closes once its
    # numel reaches sub_group_size, which any parameter does at 0)
    assert sub_group_sizes([6, 5, 3, 9], 2, 0) == [3, 3, 2, 5]
    assert sub_group_sizes([6, 5, 3, 9], 2, 10**12) == [13]


def test_zero3_optimizer_temporaries_peak_at_the_largest_sub_group():
    """See [Note: ZeRO-3 optimizer sub-groups]: DeepSpeed converts and frees one sub-group's
    gradients at a time, so sub_group_size bounds the step's fp32 (4 B) and flat 16-bit (2 B)
    copies; with one group they cover the whole shard."""
    from zsim.api import run_scenario
    from zsim.schedule.build import build_schedule
    from zsim.schedule.ir import OpKind
    from zsim.schedule.partition import sub_group_sizes

    peaks = {}
    for size in (50_000, 100_000, 10**12):
        sc = scenario(**{"deepspeed.zero_optimization.stage": 3, "deepspeed.zero_optimization.sub_group_size": size})
        wl, sched = build_schedule(sc)
        groups = sub_group_sizes([p.numel for p in wl.params], sc.cluster.world_size, size)
        steps = [op for op in sched.ops if op.kind == OpKind.OPTIMIZER_STEP]
        assert [op.payload.shard_params for op in steps] == groups
        live = peak = 0.0
        for _, delta, category, _ in run_scenario(sc)[1].ledger_events:
            if category == "optimizer temporaries":
                live += delta
                peak = max(peak, live)
        assert peak == 6 * max(groups)      # bf16: 4 B fp32 copy + 2 B flat copy per element
        peaks[size] = peak
    assert peaks[50_000] < peaks[100_000] < peaks[10**12]


@pytest.mark.parametrize("prefetch", [5e7, 0])
def test_zero3_coalesced_gather_holds_its_flat_buffer_until_its_last_param_is_waited(prefetch):
    """see [Note: all-gather flat buffer]: a gather of several params allocates a flat buffer of
    their padded partitions x world besides the params; it is freed at the start of the module
    whose visit waits for the gather's last param. A one-param gather has none."""
    from zsim.schedule.ir import Buffer, OpKind
    from zsim.schedule.partition import padded

    sc = scenario(**{"deepspeed.zero_optimization.stage": 3,
                     "deepspeed.zero_optimization.stage3_prefetch_bucket_size": prefetch,
                     "deepspeed.zero_optimization.stage3_param_persistence_threshold": 0})
    wl, s = build_schedule(sc)
    world = sc.cluster.world_size
    freed_before = {t.key: op for op in s.ops for t in op.free_before}
    params_of = {m.name: m.params for m in wl.modules}
    flats = 0
    for op in s.ops:
        if op.kind != OpKind.PARAM_GATHER:
            continue
        flat = [a for a in op.alloc if a.tag.buffer == Buffer.GATHER_FLAT]
        pids = op.payload.pids
        if len(pids) == 1:
            assert not flat
            continue
        flats += 1
        assert [a.size_bytes for a in flat] == [sum(padded(wl.params[p].numel, world) for p in pids) * 2]
        user = freed_before[op.id]
        assert user.kind in (OpKind.FORWARD, OpKind.BACKWARD) and op.id in user.deps
        # every param of the gather is used by a module no later than the one that frees it
        assert all(any(p in params_of[o.payload.module] for o in s.ops[op.id:user.id + 1]
                       if o.kind in (OpKind.FORWARD, OpKind.BACKWARD)) for p in pids)
    assert flats > 0
