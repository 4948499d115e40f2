"""Pipeline parallelism (DeepSpeed's PipelineEngine): the ported TrainSchedule and partition
rules against DeepSpeed 0.19.8's own output (tests/fixtures/pipeline/deepspeed_pipe.json,
recorded from deepspeed.runtime.pipe.schedule.TrainSchedule and runtime.utils.partition_*),
the refusals, and what the simulation of the stages must show: the 1F1B order, in-flight
micro-batches per stage, the bubble, the tied-embedding all-reduce and the batch rule."""
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import ROOT, mapping, scenario
from zsim.api import run_scenario
from zsim.config.scenario import scenario_from_mapping
from zsim.errors import ZsimInputError
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Buffer, Group, OpKind, ProcessGroup
from zsim.schedule.payloads import PipeTransfer
from zsim.schedule.pipe_partition import partition_balanced, partition_uniform
from zsim.schedule.pipeline import train_schedule

FIXTURE = json.loads((ROOT / "tests/fixtures/pipeline/deepspeed_pipe.json").read_text())
_BOUNDARY = ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]


def pipe(stages=2, **changes):
    base = {"model.layers": 4, "parallelism.pipeline": stages, "deepspeed.zero_optimization.stage": 1,
            "training.gradient_accumulation_steps": 4}
    base.update(changes)
    return scenario(**base)


@pytest.mark.parametrize("key", sorted(FIXTURE["train_schedule"]))
def test_train_schedule_is_deepspeeds(key):
    shape, stage = key.split("/")
    stages, micro = map(int, shape.split("x"))
    ours = [cmd.value for cmd, _ in train_schedule(stages, int(stage), micro)]
    assert ours + _BOUNDARY == FIXTURE["train_schedule"][key]


def test_partition_rules_are_deepspeeds():
    for weights, parts, expected in FIXTURE["partition_balanced"]:
        assert partition_balanced(weights, parts) == expected
    for items, parts, expected in FIXTURE["partition_uniform"]:
        assert partition_uniform(items, parts) == expected


def _deepspeed_partition_balanced(weights, num_parts):
    """runtime/utils.py partition_balanced, loop for loop (the reference zsim's array form must equal)."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], part)
                min_sum = min(dp_min[k][j - 1], part)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = cost, max_sum, min_sum, k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([0, 1, 5, 12, 100, 12582912, 1.8e9]),
                          st.floats(0, 1e10, allow_nan=False)), min_size=1, max_size=40),
       st.integers(1, 18))
def test_partition_balanced_equals_deepspeeds_loops(weights, parts):
    assert partition_balanced(weights, parts) == _deepspeed_partition_balanced(weights, parts)


def test_1f1b_micro_batches_in_order():
    # stage 0 of 4 runs 4 forwards before its first backward; the last stage alternates
    prog = [(cmd.value, m) for cmd, m in train_schedule(4, 0, 8) if cmd.value in ("ForwardPass", "BackwardPass")]
    assert [c for c, _ in prog[:5]] == ["ForwardPass"] * 4 + ["BackwardPass"]
    assert [m for c, m in prog if c == "ForwardPass"] == list(range(8))
    last = [c for c, _ in train_schedule(4, 3, 8) if c.value in ("ForwardPass", "BackwardPass")]
    assert [c.value for c in last[:4]] == ["ForwardPass", "BackwardPass"] * 2


@pytest.mark.parametrize("change, field, fix", [
    ({"deepspeed.zero_optimization.stage": 2}, "deepspeed.zero_optimization.stage", "use ZeRO-1 or drop pipeline"),
    ({"deepspeed.zero_optimization.stage": 3}, "deepspeed.zero_optimization.stage", "use ZeRO-1 or drop pipeline"),
    ({"parallelism.pipeline": 3}, "parallelism.pipeline", "must divide the world size"),
    ({"parallelism.pipeline": 8}, "parallelism.pipeline", "exceeds the model's 4 transformer layers"),
    ({"parallelism.partition_method": "best"}, "parallelism.partition_method", "choose one of"),
    ({"deepspeed.pipeline": {"stages": 4}}, "deepspeed.pipeline.stages", "disagrees with parallelism.pipeline"),
    ({"deepspeed.pipeline": {"activation_checkpoint_interval": 2}}, "deepspeed.pipeline.activation_checkpoint_interval",
     "use 0 or 1"),
    ({"parallelism.tensor": 2, "deepspeed.pipeline": {"pipe_partitioned": False}}, "deepspeed.pipeline.grad_partitioned",
     "set grad_partitioned false too, or pipe_partitioned true"),
])
def test_refusals(change, field, fix):
    with pytest.raises(ZsimInputError) as err:
        pipe(**change)
    assert err.value.field == field and fix in str(err.value)


def test_a_stage_without_a_transformer_layer_is_refused():
    # type:embedding weighs only the embedding and the tied head: the middle stages get no layer
    sc = pipe(4, **{"model.tied_embeddings": True, "parallelism.partition_method": "type:embedding"})
    with pytest.raises(ZsimInputError, match="no transformer layer"):
        build_schedule(sc)


def test_zero3_with_pipeline_exits_2_with_the_fix(tmp_path):
    path = tmp_path / "s.yaml"
    raw = mapping(**{"parallelism.pipeline": 2, "deepspeed.zero_optimization.stage": 3})
    path.write_text(json.dumps(raw))
    proc = subprocess.run([sys.executable, "-m", "zsim.cli", "run", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "use ZeRO-1 or drop pipeline" in proc.stderr


def test_ds_config_pipeline_block_maps_onto_parallelism():
    sc = scenario(**{"model.layers": 4, "deepspeed.zero_optimization.stage": 1, "deepspeed.pipeline": {"stages": 2, "partition": "uniform",
                                                              "activation_checkpoint_interval": 1}})
    assert (sc.pipeline_stages, sc.parallelism.partition_method) == (2, "uniform")
    assert sc.training.activation_checkpointing == "full"
    assert not any("pipeline" in w for w in sc.warnings)


def test_batch_divides_by_data_parallel_only():
    sc = pipe(2)   # 8 GPUs, 2 stages -> 4 data-parallel ranks
    assert sc.data_parallel_size == 4
    assert sc.global_batch_size == sc.micro_batch_size * sc.gradient_accumulation_steps * 4
    with pytest.raises(ZsimInputError, match="data-parallel size"):
        pipe(2, **{"deepspeed.train_batch_size": 2 * 4 * 8})


def _stage_ops(sched, stage, kind):
    return [op for op in sched.ops if op.pipe_stage == stage and op.kind == kind]


def test_sends_pair_with_recvs_and_tied_grads_are_reduced():
    sc = pipe(4, **{"model.tied_embeddings": True})
    _, sched = build_schedule(sc)
    gas = sc.gradient_accumulation_steps
    for s in range(3):
        sends = _stage_ops(sched, s, OpKind.SEND_ACTIVATION)
        recvs = _stage_ops(sched, s + 1, OpKind.RECV_ACTIVATION)
        assert [op.micro_step for op in sends] == [op.micro_step for op in recvs] == list(range(gas))
        assert all(r.deps and any(d == x.id for x in sends for d in r.deps) for r in recvs)
        assert sends[0].payload == PipeTransfer(sc.micro_batch_size * sc.seq_len * 256 * 2, s, s + 1)
        assert len(_stage_ops(sched, s + 1, OpKind.SEND_GRAD)) == gas
    tied = [op for op in sched.ops if op.kind == OpKind.TIED_ALLREDUCE]
    assert sorted(op.pipe_stage for op in tied) == [0, 3]
    assert all(op.comm.group == ProcessGroup(Group.TIED, 2, 3 * sched.pipeline.data_parallel)
               and op.comm.numel == 1024 * 256 for op in tied)


def _tp_calls(sched, stage: int) -> list[tuple]:
    """A stage's sends, recvs and tensor-parallel all-gathers, in order: (kind, micro, bytes)."""
    keep = (OpKind.SEND_ACTIVATION, OpKind.RECV_ACTIVATION, OpKind.SEND_GRAD, OpKind.RECV_GRAD, OpKind.TP_ALL_GATHER,
            OpKind.FORWARD, OpKind.BACKWARD)
    out = []
    for op in sched.ops:
        if op.pipe_stage == stage and op.kind in keep:
            size = op.comm.size_bytes if op.kind == OpKind.TP_ALL_GATHER else getattr(op.payload, "size_bytes", 0)
            entry = (op.kind, op.micro_step, size)
            if not (out and op.kind in (OpKind.FORWARD, OpKind.BACKWARD) and out[-1] == entry):
                out.append(entry)   # one entry per pass (its modules' ops)
    return out


def test_tensor_parallel_ranks_send_their_part_and_all_gather_it():
    """pipe/engine.py with a model-parallel grid (pipe_partitioned / grad_partitioned on by
    default): each TP rank sends the PartitionedTensor's meta and its 1/t part; ForwardPass
    all-gathers the received activation (not on the first stage), BackwardPass the stage's own
    output and then the received gradient (not on the last stage); see
    [Note: partitioned pipeline sends]."""
    t, p, gas = 2, 4, 4
    sc = pipe(p, **{"parallelism.tensor": t, "training.gradient_accumulation_steps": gas})
    _, sched = build_schedule(sc)
    act = sc.micro_batch_size * sc.seq_len * 256 * 2
    part, meta = act / t, 8 * (3 + 4 + t)       # to_meta: ndims, shape (3), num_parts, rank, t + 1 offsets
    F, B, G = OpKind.FORWARD, OpKind.BACKWARD, OpKind.TP_ALL_GATHER
    for s in range(p):
        calls = _tp_calls(sched, s)
        for m in range(gas):
            fwd = calls.index((F, m, 0))
            if s > 0:   # meta, part, then the gather just before the forward
                assert calls[fwd - 3:fwd] == [(OpKind.RECV_ACTIVATION, m, meta), (OpKind.RECV_ACTIVATION, m, part),
                                              (G, m, act)]
            else:
                assert calls[fwd - 1][0] != G
            if s < p - 1:   # after the forward: the meta, then the part
                send = calls.index((OpKind.SEND_ACTIVATION, m, meta))
                assert send > fwd and calls[send + 1] == (OpKind.SEND_ACTIVATION, m, part)
            bwd = calls.index((B, m, 0))
            if s < p - 1:   # its two recvs (RecvGrad), then in BackwardPass the output rebuilt, then the gradient
                recv = calls.index((OpKind.RECV_GRAD, m, meta))
                assert calls[recv + 1] == (OpKind.RECV_GRAD, m, part) and recv < bwd - 2
                assert calls[bwd - 2:bwd] == [(G, m, act), (G, m, act)]
                assert [op.payload.module for op in sched.ops if op.pipe_stage == s and op.kind == G
                        and op.micro_step == m][-2:] == ["pipe output", "p2p recv grad"]
            if s > 0:
                send = calls.index((OpKind.SEND_GRAD, m, meta))
                assert send > bwd and calls[send + 1] == (OpKind.SEND_GRAD, m, part)
        gathers = [op for op in sched.ops if op.pipe_stage == s and op.kind == G]
        assert len(gathers) == gas * ((s > 0) + 2 * (s < p - 1))
        assert all(op.comm.group.kind == Group.TENSOR and op.comm.group.size == t for op in gathers)
    # a stage keeps only its part of each in-flight output (the output's data is dropped)
    pipe_out = [a for op in sched.ops if op.pipe_stage == 0 for a in op.alloc if a.tag.buffer == Buffer.PIPE_OUTPUT]
    assert pipe_out and all(a.size_bytes == part for a in pipe_out)


def test_partitioned_sends_follow_the_ds_config_keys():
    t, p, gas = 2, 4, 4
    keys = {"parallelism.tensor": t, "training.gradient_accumulation_steps": gas}
    act = 4 * 128 * 256 * 2
    full = pipe(p, **keys, **{"deepspeed.pipeline": {"pipe_partitioned": False, "grad_partitioned": False}})
    _, sched = build_schedule(full)
    assert not [op for op in sched.ops if op.kind == OpKind.TP_ALL_GATHER]
    assert {op.payload.size_bytes for op in sched.ops if isinstance(op.payload, PipeTransfer)} == {act}
    # pipe_partitioned only: RecvGrad rebuilds the output, then takes the whole gradient in one recv
    _, sched = build_schedule(pipe(p, **keys, **{"deepspeed.pipeline": {"grad_partitioned": False}}))
    calls = _tp_calls(sched, 1)
    recv = calls.index((OpKind.RECV_GRAD, 0, act))
    assert calls[recv - 1] == (OpKind.TP_ALL_GATHER, 0, act)
    assert not [c for c in calls[recv:calls.index((OpKind.BACKWARD, 0, 0))] if c[0] == OpKind.TP_ALL_GATHER]
    assert [c[2] for c in calls if c[0] == OpKind.SEND_GRAD][:1] == [act]
    # a stage per node, TP8 inside it: the parts over InfiniBand and the all-gathers over NVLink
    # cost less than the whole tensor from every rank (on one node a tiny tensor's extra meta
    # send and gathers cost more than they save: latency)
    big = {"model.hidden": 2048, "model.heads": 16, "model.seq_len": 1024, "training.seq_len": 1024,
           "hardware.nodes": 2, "parallelism.tensor": 8, "training.gradient_accumulation_steps": gas}
    whole = {"deepspeed.pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
    assert run_scenario(pipe(2, **big))[0].step_time_s < 0.9 * run_scenario(pipe(2, **big, **whole))[0].step_time_s
    # with sequence parallelism the tensor is already the rank's shard: sent as it is, whatever the keys
    _, sched = build_schedule(pipe(p, **keys, **{"parallelism.sequence_parallel": True}))
    assert not [op for op in sched.ops if op.kind == OpKind.TP_ALL_GATHER
                and op.payload.module in ("p2p recv activation", "pipe output", "p2p recv grad")]
    assert {op.payload.size_bytes for op in sched.ops if isinstance(op.payload, PipeTransfer)} == {act / t}


def test_stage_i_holds_up_to_p_minus_i_micro_batches():
    sc = pipe(4, **{"training.gradient_accumulation_steps": 8})
    result, trace = run_scenario(sc)
    for stage, events in enumerate(trace.stage_ledger_events):
        alive: dict[int, int] = {}     # micro-batch -> its saved activations still alive
        most = 0
        for _, delta, _, tag in events:
            if tag.buffer == Buffer.ACTIVATION:
                alive[tag.micro] = alive.get(tag.micro, 0) + (1 if delta > 0 else -1)
                most = max(most, sum(1 for n in alive.values() if n > 0))
        assert most == 4 - stage
    # the first stage holds the most in-flight activations
    assert result.pipeline.peak_bytes[0] > result.pipeline.peak_bytes[2]


@pytest.mark.parametrize("gas", [2, 8, 32])
def test_bubble_comes_out_of_the_simulation(gas):
    # a model whose layers dominate the step (no formula in the simulator: the stages' idle time)
    sc = pipe(4, **{"model.layers": 8, "model.hidden": 2048, "model.heads": 16, "model.seq_len": 1024,
                    "training.seq_len": 1024, "training.gradient_accumulation_steps": gas})
    r = run_scenario(sc)[0]
    ideal = 3 / (gas + 3)       # 1F1B with p = 4 stages and m micro-batches: (p - 1) / (m + p - 1)
    assert r.pipeline.bubble_fraction == pytest.approx(ideal, abs=0.08)


def test_one_stage_is_data_parallel_unchanged():
    plain = run_scenario(scenario(**{"deepspeed.zero_optimization.stage": 1}))[0]
    one = run_scenario(scenario(**{"deepspeed.zero_optimization.stage": 1, "parallelism.pipeline": 1}))[0]
    assert one.to_dict() == plain.to_dict() and "pipeline" not in one.to_dict()


def test_result_shows_stages_and_worst_stage_decides():
    r = run_scenario(pipe(4, **{"training.gradient_accumulation_steps": 8}))[0]
    pp = r.pipeline
    assert (pp.stages, pp.data_parallel) == (4, 2)
    assert pp.layers == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert r.memory.peak_bytes == pytest.approx(max(pp.peak_bytes)) and pp.worst_stage == pp.peak_bytes.index(
        max(pp.peak_bytes))
    assert r.to_dict()["pipeline"]["stages"] == 4
    assert "send_recv" in r.comm.calls


def test_seed_pipeline_scenarios_run_without_warning():
    for name in ("seed004-pipeline-batch64", "seed004-pipeline-zero1-fp16-v100"):
        sc = scenario_from_mapping(__import__("yaml").safe_load((ROOT / f"scenarios/{name}.yaml").read_text()), ROOT)
        assert sc.pipeline_stages == 4 and not sc.warnings


def test_tune_and_doctor_stay_within_what_the_pipeline_engine_accepts():
    from zsim.search.doctor import playbook
    from zsim.search.tune import memory_lower_bound, structural_candidates

    sc = pipe(2, **{"training.gradient_accumulation_steps": 2})
    cands = structural_candidates(sc)
    # the layouts: the divisors of the 8 GPUs up to the model's 4 layers (one layer per stage at least)
    assert {c.layout.pipeline for c in cands} == {1, 2, 4}
    assert {c.stage for c in cands if c.layout.pipeline > 1} == {0, 1}
    assert {c.stage for c in cands if c.layout.pipeline == 1} == {0, 1, 2, 3}
    # the batch per data-parallel rank (global 16 over 8 GPUs / PP data-parallel ranks): PP 2 -> micro 2 x GAS 2
    for c in cands:
        assert c.micro_batch * c.gas == sc.global_batch_size // (8 // c.layout.model_parallel)
        assert sc.global_batch_size % (8 // c.layout.model_parallel) == 0
    one = scenario(**{"model.layers": 4, "deepspeed.zero_optimization.stage": 1,
                      "training.gradient_accumulation_steps": 2})
    assert memory_lower_bound(sc) < memory_lower_bound(one)
    # the lower bound stays below what the simulation finds for the worst stage
    assert memory_lower_bound(sc) <= run_scenario(sc)[0].memory.peak_bytes
    names = [v.name for v in playbook(mapping(), sc)]
    assert "4 pipeline stages" in names and not any("stage 2" in n or "stage 3" in n for n in names)


_P2P = {OpKind.SEND_ACTIVATION: "send", OpKind.SEND_GRAD: "send", OpKind.RECV_ACTIVATION: "recv",
        OpKind.RECV_GRAD: "recv"}


def _zsim_calls(sched, stage: int, world: int) -> list[tuple]:
    """zsim's sends, recvs and collectives of one stage's rank, as the recorder logs them:
    (op, numel, group size); a point-to-point call's group is the default (world) group."""
    out = []
    for op in sched.ops:
        if op.pipe_stage != stage:
            continue
        if op.kind in _P2P:
            out.append((_P2P[op.kind], op.payload.size_bytes // 2, world))   # bf16 activations
        elif op.comm is not None:
            g = op.comm.group   # None: the stage's data-parallel group
            group = sched.pipeline.data_parallel if g is None else g.size
            assert g is None or g.kind in (Group.PIPE, Group.TIED)
            out.append((op.comm.collective.value, op.comm.numel, group))
    return out


@pytest.mark.parametrize("case", ["pp2_world2", "pp2_world4", "pp2_world4_tied"])
def test_calls_are_deepspeed_pipeline_engines(case):
    """DeepSpeed 0.19.8's PipelineEngine on CPU/gloo (calibration/deepspeed_record/pipeline.py:
    PP2 at world 2, PP2 x DP2 at world 4, with the head tied to the embedding through
    TiedLayerSpec; ZeRO-1, bf16): every send, recv and collective of the second train_batch (the
    first adds the tensor-meta handshake) of every rank, in order, is zsim's for that rank's
    stage. Calls over a group of one rank cost nothing and are left out."""
    doc = json.loads((ROOT / f"tests/fixtures/pipeline/{case}.json").read_text())
    world = doc["world_size"]
    raw = {"model": doc["model"], "hardware": {"profile": "dgx-a100-80g", "nodes": 1, "gpus_per_node": world},
           "training": {"seq_len": doc["model"]["seq_len"]}, "parallelism": {"pipeline": doc["stages"]},
           "deepspeed": doc["ds_config"]}
    _, sched = build_schedule(scenario_from_mapping(raw, ROOT))
    stages_seen = set()
    for rank in doc["ranks"]:
        recorded = [(c["op"], c["numel"], c["group_size"]) for c in rank["calls"]
                    if c["opt_step"] == 1 and c["group_size"] > 1]
        ours = [c for c in _zsim_calls(sched, rank["stage"], world) if c[2] > 1]
        assert recorded == ours, f"stage {rank['stage']}"
        stages_seen.add(rank["stage"])
    assert stages_seen == {0, 1}


@pytest.mark.parametrize("case", ["pp2_tp2_world4", "pp2_tp2_world4_whole_grads"])
def test_partitioned_sends_are_deepspeed_pipeline_engines(case):
    """DeepSpeed 0.19.8's PipelineEngine on a model-parallel grid (calibration/deepspeed_record/
    pipeline.py --tensor 2: PipeModelDataParallelTopology, PP2 x TP2 at world 4, ZeRO-1, bf16;
    `--whole-grads`: pipeline.grad_partitioned false): every send and recv and every
    PartitionedTensor.full() all-gather over the slice group of the second train_batch, of every
    rank, in order, is zsim's for that rank's stage (the meta of t + 7 int64, then the part; see
    [Note: partitioned pipeline sends])."""
    doc = json.loads((ROOT / f"tests/fixtures/pipeline/{case}.json").read_text())
    world, t = doc["world_size"], doc["tensor"]
    raw = {"model": doc["model"], "hardware": {"profile": "dgx-a100-80g", "nodes": 1, "gpus_per_node": world},
           "training": {"seq_len": doc["model"]["seq_len"]},
           "parallelism": {"pipeline": doc["stages"], "tensor": t}, "deepspeed": doc["ds_config"]}
    _, sched = build_schedule(scenario_from_mapping(raw, ROOT))
    pipe_gathers = ("p2p recv activation", "pipe output", "p2p recv grad")
    seen = set()
    for rank in doc["ranks"]:
        recorded = [(c["op"], c["numel"]) for c in rank["calls"] if c["opt_step"] == 1
                    and (c["op"] in ("send", "recv") or c["op"] == "all_gather" and c["caller"].endswith(":full"))]
        ours = []
        for op in sched.ops:
            if op.pipe_stage != rank["stage"]:
                continue
            if op.kind in _P2P:
                ours.append((_P2P[op.kind], int(op.payload.size_bytes) // (8 if op.payload.meta else 2)))
            elif op.kind == OpKind.TP_ALL_GATHER and op.payload.module in pipe_gathers:
                assert op.comm.group.size == t
                ours.append(("all_gather", op.comm.numel))
        assert recorded == ours, f"stage {rank['stage']}"
        act = doc["ds_config"]["train_micro_batch_size_per_gpu"] * doc["model"]["seq_len"] * doc["model"]["hidden"]
        assert {t + 7, act // t} <= {n for op, n in recorded if op in ("send", "recv")}
        assert ("all_gather", act) in recorded
        seen.add((rank["stage"], rank["model_parallel_rank"]))
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_memory_command_estimates_the_worst_stage(tmp_path):
    from zsim.cli import main as cli_main

    out = tmp_path / "m.json"
    scenario_file = ROOT / "scenarios/seed004-pipeline-zero1-fp16-v100.yaml"
    assert cli_main(["memory", str(scenario_file), "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    full = run_scenario(scenario_from_mapping(__import__("yaml").safe_load(scenario_file.read_text()), ROOT))[0]
    # the estimator sees one stage's slice (about a quarter of GPT-2 XL), not the whole model
    assert full.n_params / 5 < rep["n_params"] < full.n_params / 3
    assert any("worst stage" in n for n in rep["notes"])


def test_validate_refuses_a_pipeline_on_fsdp_in_one_line(capsys):
    from zsim.cli import main as cli_main

    path = str(ROOT / "benchmarks/validate_scenarios/pipe.yaml")
    assert cli_main(["validate", path, "--engine", "fsdp"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "parallelism.pipeline" in err and "--engine own or deepspeed" in err
