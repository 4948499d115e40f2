"""The simpy engine: FIFO streams, dependencies, bandwidth sharing, interference, ledger."""
import pytest

from tests.helpers import add_compute, add_gather, build, scenario
from zsim.engine.ledger import LedgerError, peak_and_breakdown
from zsim.engine.sim import simulate
from zsim.hardware.collectives import collective_cost, nccl_topo_for, tiers_for
from zsim.schedule.builder import Builder
from zsim.schedule.ir import Alloc, Buffer, Category, OpKind, Tag

SIZE = 1e9


def _cluster(slowdown=0.0):
    return scenario(**{"hardware.override": {"interference": {"compute_slowdown_during_comm": slowdown}}}).cluster


def _one_collective_s(cluster):
    intra, inter = tiers_for(cluster)
    return collective_cost("all_gather", SIZE, cluster.nodes, cluster.gpus_per_node, intra, inter,
                           nccl=nccl_topo_for(cluster))


def _reduce(b, size_bytes: float, group=None) -> int:
    from zsim.schedule.ir import Collective, OpKind, Phase, Stream
    from zsim.schedule.payloads import Comm, GradReduce
    comm = Comm(Collective.REDUCE_SCATTER, 0, size_bytes, group=group)
    return b.add(OpKind.BUCKET_REDUCE, Stream.REDUCE, Phase.BACKWARD, 0, GradReduce(comm, 0), (), ())


def test_collectives_over_one_process_group_queue_in_program_order():
    """see [Note: one NCCL stream per process group]: a reduce-scatter from the reduce stream and
    an all-gather from the allgather stream over the data-parallel group run one after the other."""
    cl = _cluster()
    b = Builder()
    rs = _reduce(b, SIZE)
    ag = add_gather(b, SIZE)
    t = simulate(build(b), cl, "bf16").timings
    assert t[ag].start_s == pytest.approx(t[rs].end_s)
    assert t[rs].start_s == 0.0


def test_collectives_over_different_process_groups_share_the_link():
    from zsim.schedule.ir import Group, ProcessGroup
    cl = _cluster()
    b = Builder()
    add_gather(b, SIZE)
    # the expert-data-parallel group has its own communicator, hence its own NCCL stream
    _reduce(b, SIZE, ProcessGroup(Group.EXPERT_DATA, cl.world_size))
    trace = simulate(build(b), cl, "bf16")
    ag = _one_collective_s(cl)
    # both run at once: the bandwidth parts share the link, so neither ends before the sum of
    # the transfers that overlap (the reduce-scatter's latency differs from the all-gather's)
    assert trace.step_time_s > ag.time_s * 1.5
    assert trace.timings[0].start_s == trace.timings[1].start_s == 0.0


def test_same_stream_is_fifo_and_deps_wait():
    cl = _cluster()
    b = Builder()
    ag = add_gather(b, SIZE)
    ag2 = add_gather(b, SIZE)
    gemm = add_compute(b, deps=[ag], gemms=((4096, 4096, 4096),))
    t = simulate(build(b), cl, "bf16").timings
    one = _one_collective_s(cl).time_s
    assert t[ag2].start_s == pytest.approx(t[ag].end_s)          # FIFO on the allgather stream
    assert t[gemm].start_s == pytest.approx(t[ag].end_s)         # waits for its dependency only
    assert t[ag].end_s == pytest.approx(one)


def test_compute_slows_while_a_collective_runs():
    quiet, busy = [], []
    for slowdown, out in ((0.0, quiet), (0.25, busy)):
        cl = _cluster(slowdown)
        b = Builder()
        add_gather(b, SIZE * 100)
        add_compute(b, gemms=((8192, 8192, 8192),))
        trace = simulate(build(b), cl, "bf16")
        out.append(trace.timings[1].end_s - trace.timings[1].start_s)
    # the slowdown applies while the collective moves data (after its alpha latency)
    lat = _one_collective_s(_cluster()).latency_s
    assert busy[0] == pytest.approx(lat + 1.25 * (quiet[0] - lat), rel=1e-9)


def _tag(name):
    return Tag(Buffer.ACTIVATION, 0, name)


def test_ledger_peak_and_breakdown():
    cl = _cluster()
    b = Builder()
    b.static_alloc(Category.PARAMETERS, 100.0)
    x = add_compute(b, gemms=((128, 128, 128),), alloc=(Alloc(_tag("a"), Category.ACTIVATIONS, 50.0),))
    y = add_compute(b, deps=[x], phase="backward", gemms=((128, 128, 128),),
                    alloc=(Alloc(_tag("g"), Category.ACTIVATION_GRADIENTS, 30.0),))
    b.add_free(y, _tag("a"), _tag("g"))
    trace = simulate(build(b, 0), cl, "bf16")
    peak, _, breakdown = peak_and_breakdown(trace.ledger_events)
    assert peak == 180.0
    assert breakdown == {"activation gradients": 30.0, "activations": 50.0, "parameters": 100.0}


@pytest.mark.parametrize("case", ["unknown", "twice", "leak"])
def test_ledger_refuses_inconsistent_memory_effects(case):
    """Freeing what was never allocated or was already freed, or leaving a step buffer alive at
    the end of the step, is a builder bug: the ledger raises instead of ignoring it."""
    b = Builder()
    x = add_compute(b, mem_bytes=1e6, alloc=(Alloc(_tag("a"), Category.ACTIVATIONS, 50.0),))
    y = add_compute(b, deps=[x], mem_bytes=1e6)
    if case == "unknown":
        b.add_free(y, _tag("b"))
    elif case == "twice":
        b.add_free(x, _tag("a"))
        b.add_free(y, _tag("a"))
    message = {"unknown": "never allocated", "twice": "already freed", "leak": "alive at the end"}[case]
    with pytest.raises(LedgerError, match=message):
        simulate(build(b, 0), _cluster(), "bf16")


def test_deadlock_is_reported():
    cl = _cluster()
    b = Builder()
    add_compute(b, deps=[1], gemms=((64, 64, 64),))
    add_compute(b, gemms=((64, 64, 64),))
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(build(b, 0), cl, "bf16")


def test_a_device_without_concurrent_streams_runs_in_program_order():
    """CPU ranks (torch/DeepSpeed CPU backends) have one stream: no comm/compute overlap."""
    times = {}
    for concurrent in (True, False):
        cl = scenario(**{"hardware.override": {"gpu": {"concurrent_streams": concurrent}}}).cluster
        b = Builder()
        add_gather(b, SIZE)
        add_compute(b, gemms=((8192, 8192, 8192),))
        times[concurrent] = simulate(build(b), cl, "bf16").timings
    assert times[True][1].start_s == 0.0                                         # overlaps the all-gather
    assert times[False][1].start_s == pytest.approx(times[False][0].end_s)       # waits for it


def _cpu_cluster(**gpu):
    return scenario(**{"hardware.override": {"gpu": gpu}}).cluster


def test_fresh_allocation_above_the_threshold_is_charged_once_per_buffer():
    # a gather's params live in one flat output: 40 MB > 32 MB pays first touch, while a
    # compute op's allocations are separate tensors, each under the threshold
    def step_s(cluster):
        b = Builder()
        gathered = tuple(Alloc(Tag(Buffer.GATHERED, 0, i), Category.GATHERED, 10e6) for i in range(4))
        acts = tuple(Alloc(_tag(str(i)), Category.ACTIVATIONS, 20e6) for i in range(3))
        g = add_gather(b, 40e6, alloc=gathered)
        f = add_compute(b, mem_bytes=1e6, alloc=acts)
        b.add_free(g, *(a.tag for a in gathered))
        b.add_free(f, *(a.tag for a in acts))
        return simulate(build(b), cluster, "bf16").step_time_s

    ref = step_s(_cpu_cluster(fresh_alloc_threshold_bytes=32e6, fresh_alloc_GBps=2.0))
    plain = step_s(_cpu_cluster())
    assert ref - plain == pytest.approx(40e6 / 2e9, rel=1e-9)


def test_optimizer_traffic_uses_its_own_efficiency():
    from zsim.hardware.compute import optimizer_time_s
    slow = _cpu_cluster(memory_bound_efficiency=0.2).profile.gpu
    fast = _cpu_cluster(memory_bound_efficiency=0.2, optimizer_efficiency=0.8).profile.gpu
    assert optimizer_time_s(1e9, slow) == pytest.approx(4 * optimizer_time_s(1e9, fast))
    b = Builder()
    add_compute(b, phase="step", optimizer_bytes=1e9)
    t_slow = simulate(build(b, 0), _cpu_cluster(memory_bound_efficiency=0.2), "bf16").step_time_s
    t_fast = simulate(build(b, 0), _cpu_cluster(memory_bound_efficiency=0.2, optimizer_efficiency=0.8),
                      "bf16").step_time_s
    assert t_slow == pytest.approx(4 * t_fast, rel=1e-9)


def test_zero3_hook_time_is_charged_per_module_visit():
    from zsim.api import run_scenario
    from zsim.schedule.build import build_schedule, workload_for
    from zsim.schedule.context import StepContext
    from zsim.schedule.param_fetch import visit_sequence

    def cpu(fwd_us, bwd_us, stage=3):
        # a serial device (one stream in program order): host time adds up exactly
        return scenario(**{"deepspeed.zero_optimization.stage": stage, "hardware.profile": "cpu-gloo-localhost",
                           "hardware.gpus_per_node": 2,
                           "hardware.override": {"cpu": {"zero3_hook_fwd_us": fwd_us, "zero3_hook_bwd_us": bwd_us}}})
    sc = cpu(0.0, 0.0)
    sched = build_schedule(sc)[1]
    fwd = sum(op.hook_visits for op in sched.ops if op.phase == "forward")
    bwd = sum(op.hook_visits for op in sched.ops if op.phase == "backward")
    n_visits = len(visit_sequence(StepContext(sc, workload_for(sc), None, 2, 2, 2)))
    # every visit's hooks land on a module's compute op, but for trailing param-less visits
    assert 0 < fwd and 0 < bwd and fwd + bwd <= n_visits
    base = run_scenario(sc)[0].step_time_s
    slow = run_scenario(cpu(100.0, 300.0))[0].step_time_s
    assert slow - base == pytest.approx(fwd * 100e-6 + bwd * 300e-6, rel=1e-6)
    assert all(op.hook_visits == 0 for op in build_schedule(cpu(100.0, 300.0, stage=2))[1].ops)


@pytest.mark.parametrize("stage,gas", [(0, 1), (1, 2), (2, 2)])
def test_zero012_gradient_handling_is_charged_per_parameter(stage, gas):
    """DeepSpeed's per-parameter host work in backward: every parameter once per step at stages
    0/1 (the boundary), once per micro-step at stage 2 (its hooks)."""
    from zsim.api import run_scenario
    from zsim.schedule.build import build_schedule, workload_for

    def cpu(us):
        fields = {f"zero{s}_grad_hook_us": (us if s == stage else 999.0) for s in range(3)}
        return scenario(**{"deepspeed.zero_optimization.stage": stage, "hardware.profile": "cpu-gloo-localhost",
                           "hardware.gpus_per_node": 2, "training.gradient_accumulation_steps": gas,
                           "hardware.override": {"cpu": fields}})
    sc = cpu(0.0)
    hooks = sum(op.grad_hooks for op in build_schedule(sc)[1].ops)
    n_params = len(workload_for(sc).params)
    assert hooks == n_params * (gas if stage == 2 else 1)
    slow = run_scenario(cpu(50.0))[0].step_time_s
    assert slow - run_scenario(sc)[0].step_time_s == pytest.approx(hooks * 50e-6, rel=1e-6)


def test_post_step_persistent_gathers_are_coalesced_and_priced_by_their_table():
    """See [Note: coalesced post-step gathers]."""
    from zsim.api import run_scenario
    from zsim.schedule.build import build_schedule

    def sc(coalesced_eff):
        tables = {"all_gather_coalesced": [[1024, coalesced_eff], [1e9, coalesced_eff]]} if coalesced_eff else {}
        return scenario(**{"deepspeed.zero_optimization.stage": 3, "hardware.profile": "cpu-gloo-localhost",
                           "hardware.gpus_per_node": 2,
                           "hardware.override": {"intra_node": {"efficiency_by_collective": tables}}})
    ops = build_schedule(sc(None))[1].ops
    post = [op for op in ops if op.kind == OpKind.PERSISTENT_GATHER]
    assert len(post) > 1 and all(op.comm.coalesced for op in post)
    assert not any(op.comm.coalesced for op in ops if op.comm and op not in post)
    # a slower batched curve slows exactly those calls
    fast, slow = (run_scenario(sc(e))[0].step_time_s for e in (1.0, 0.001))
    assert slow > fast


def test_zero3_reduce_scatter_charges_deepspeeds_bucket_passes():
    """See [Note: reduce-scatter buffer passes]."""
    from zsim.hardware.compute import memory_bound_time_s
    from zsim.schedule.build import build_schedule
    sc = scenario(**{"deepspeed.zero_optimization.stage": 3, "hardware.profile": "cpu-gloo-localhost",
                     "hardware.gpus_per_node": 2, "deepspeed.zero_optimization.reduce_bucket_size": 5e8})
    ops = build_schedule(sc)[1].ops
    rs = [op for op in ops if op.comm and op.comm.collective == "reduce_scatter"]
    assert len(rs) == 1   # every gradient in one bucket of many tensors
    for op in rs:   # interleave + pre-divide (read + write each) + copy of this rank's partition
        assert op.comm.buffer_bytes == pytest.approx(4 * op.comm.size_bytes + 2 * op.comm.size_bytes / 2)
        # the interleaved copy (and gloo's copy of the input, see [Note: gloo reduce-scatter
        # copy]) is allocated for the call and freed after it
        assert [(a.tag.buffer, a.size_bytes) for a in op.alloc] == [(Buffer.SCATTER_COPY, op.comm.size_bytes),
                                                                  (Buffer.COLLECTIVE_TEMP, op.comm.size_bytes)]
        assert op.free == tuple(a.tag for a in op.alloc)
    one = scenario(**{"deepspeed.zero_optimization.stage": 3, "hardware.profile": "cpu-gloo-localhost",
                      "hardware.gpus_per_node": 2, "deepspeed.zero_optimization.reduce_bucket_size": 1})
    for op in build_schedule(one)[1].ops:   # one tensor per bucket: no interleave when it divides evenly
        if op.comm and op.comm.collective == "reduce_scatter":
            assert op.comm.buffer_bytes in (pytest.approx(3 * op.comm.size_bytes), pytest.approx(5 * op.comm.size_bytes))
    gpu = sc.cluster.profile.gpu
    plain = scenario(**{"deepspeed.zero_optimization.stage": 3, "hardware.profile": "cpu-gloo-localhost",
                        "hardware.gpus_per_node": 2, "deepspeed.zero_optimization.reduce_scatter": False})
    assert all(op.comm.buffer_bytes == 0 for op in build_schedule(plain)[1].ops
               if op.comm and op.comm.collective == "all_reduce")
    # on a serial device the passes add up in the step time
    import dataclasses
    from zsim.engine.sim import simulate
    sched = build_schedule(sc)[1]
    bare = dataclasses.replace(sched, ops=tuple(
        dataclasses.replace(op, payload=dataclasses.replace(op.payload, comm=dataclasses.replace(op.comm, buffer_bytes=0.0)))
        if op.comm else op for op in sched.ops))
    t = simulate(sched, sc.cluster, "bf16").step_time_s
    t0 = simulate(bare, sc.cluster, "bf16").step_time_s
    assert t - t0 == pytest.approx(sum(memory_bound_time_s(op.comm.buffer_bytes, gpu) for op in rs), rel=1e-6)


def test_zero3_recompute_visits_the_modules_the_forward_visited():
    """A checkpointed block's recompute re-runs its forward: ZeRO-3's hooks visit the same
    nn.Modules (containers and modules with params) in the same order, and no functional piece
    (attention core, activation), which holds no params and is no module."""
    from zsim.schedule.build import workload_for
    from zsim.schedule.context import StepContext
    from zsim.schedule.ir import Phase
    from zsim.schedule.param_fetch import visit_sequence

    sc = scenario(**{"deepspeed.zero_optimization.stage": 3, "training.activation_checkpointing": "full"})
    wl = workload_for(sc)
    visits = visit_sequence(StepContext(sc, wl, None, 2, 8, 2))
    layer_of = {m.name: m.layer for m in wl.modules} | {c: m.layer for m in wl.modules for c in m.containers}

    def per_layer(phase):
        out = {}
        for v in visits:
            if v.phase == phase and layer_of.get(v.module, -1) >= 0:
                out.setdefault(layer_of[v.module], []).append(v.module)
        return out

    forward, recompute = per_layer(Phase.FORWARD), per_layer(Phase.RECOMPUTE)
    assert forward and recompute == forward


def test_zero3_per_rank_host_loops_are_charged_per_view():
    """See [Note: per-rank host loops]: reduce_scatter_coalesced makes a view per rank of each tensor
    of a bucket and, unless the bucket is one tensor dividing evenly, walks rank x tensor again to
    interleave; a coalesced gather makes one per rank at launch and one per rank and param at its
    wait. On a serial device the host time adds up exactly."""
    from zsim.api import run_scenario
    from zsim.schedule.build import build_schedule, workload_for
    from zsim.schedule.ir import Collective

    def cpu(us, world=2):
        return scenario(**{"deepspeed.zero_optimization.stage": 3, "hardware.profile": "cpu-gloo-localhost",
                           "hardware.gpus_per_node": world, "deepspeed.zero_optimization.reduce_bucket_size": 3e5,
                           "deepspeed.zero_optimization.stage3_prefetch_bucket_size": 2e5,
                           "hardware.override": {"cpu": {"zero3_rank_view_us": us}}})
    for world in (2, 4):
        sc = cpu(0.0, world)
        numels = [p.numel for p in workload_for(sc).params]
        ops = build_schedule(sc)[1].ops
        expected = 0
        for op in ops:
            pids = getattr(op.payload, "pids", ())
            if op.kind == OpKind.BUCKET_REDUCE and op.comm.collective == Collective.REDUCE_SCATTER:
                divisible = len(pids) == 1 and numels[pids[0]] % world == 0
                expected += world * len(pids) * (1 if divisible else 2)
            elif op.kind == OpKind.PARAM_GATHER and len(pids) > 1:
                expected += world * (1 + len(pids))
        views = sum(op.host_views for op in ops)
        assert views == expected and views > 0
        # the views sit on compute ops: the hooks run on the thread that launches the kernels
        assert all(op.kind in (OpKind.FORWARD, OpKind.BACKWARD) for op in ops if op.host_views)
        slow = run_scenario(cpu(40.0, world))[0].step_time_s
        assert slow - run_scenario(sc)[0].step_time_s == pytest.approx(views * 40e-6, rel=1e-6)


def test_zero3_reduce_scatter_false_all_reduces_only_contiguous_buckets_within_size():
    """stage3.py __reduce_and_partition_ipg_grads: with reduce_scatter false a bucket is
    all-reduced only with contiguous_gradients and at most reduce_bucket_size elements (a param
    larger than the bucket fills one alone); otherwise reduce_scatter_coalesced runs."""
    from zsim.schedule.build import build_schedule, workload_for
    from zsim.schedule.ir import Collective

    def kinds(**keys):
        sc = scenario(**{"deepspeed.zero_optimization.stage": 3, "deepspeed.zero_optimization.reduce_scatter": False,
                         **keys})
        numels = [p.numel for p in workload_for(sc).params]
        return [(op.comm.collective, sum(numels[p] for p in op.payload.pids))
                for op in build_schedule(sc)[1].ops if op.kind == OpKind.BUCKET_REDUCE]
    contiguous = kinds(**{"deepspeed.zero_optimization.reduce_bucket_size": 5e5})
    assert contiguous and all(c == Collective.ALL_REDUCE and n <= 5e5 for c, n in contiguous)
    assert {c for c, _ in kinds(**{"deepspeed.zero_optimization.contiguous_gradients": False})} == {
        Collective.REDUCE_SCATTER}
    small = kinds(**{"deepspeed.zero_optimization.reduce_bucket_size": 1e3})
    assert {c for c, n in small if n > 1e3} == {Collective.REDUCE_SCATTER}
    assert {c for c, n in small if n <= 1e3} <= {Collective.ALL_REDUCE}
