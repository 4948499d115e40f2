"""Megatron-LM's interleaved 1F1B schedule (zsim/schedule/interleaved.py): the port of
schedules.py's tables against Megatron's own documented examples, Megatron's refusals, and what
the simulation of the ranks must show: the bubble shrinking by the number of model chunks, the
point-to-point sends between chunk boundaries, each rank's in-flight (micro-batch, chunk)
activations and the chunk placement."""
import json
import subprocess
import sys

import pytest

from tests.helpers import mapping, scenario
from zsim.api import run_scenario
from zsim.errors import ZsimInputError
from zsim.schedule.build import build_schedule, workload_for
from zsim.schedule.interleaved import Step, programs, schedule_table, warmup_micro_batches
from zsim.schedule.ir import Buffer, Group, OpKind, ProcessGroup, Stream

_BIG = {"model.hidden": 2048, "model.heads": 16, "model.seq_len": 1024, "training.seq_len": 1024}


def interleaved(stages=4, chunks=2, gas=8, layers=8, **changes):
    base = {"model.layers": layers, "parallelism.pipeline": stages, "parallelism.virtual_stages": chunks,
            "parallelism.pipeline_schedule": "interleaved", "deepspeed.zero_optimization.stage": 1,
            "training.gradient_accumulation_steps": gas, "hardware.gpus_per_node": 2 * stages}
    base.update(changes)
    return scenario(**base)


def test_schedule_table_is_megatrons():
    # schedules.py's own example: "PP2 N3M5 with VP2": micro-batch 0 1 2 0 1 2 3 4 3 4, chunk 0 0 0 1 1 1 0 0 1 1
    table = schedule_table(5, 2, 3)
    assert [m for m, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("stages, rank, chunks, micro, expected", [
    (4, 0, 2, 8, 10), (4, 3, 2, 8, 4), (4, 1, 3, 8, 12), (4, 0, 4, 2, 8), (3, 0, 2, 3, 6)])
def test_warmup_is_get_pp_rank_microbatches(stages, rank, chunks, micro, expected):
    # (p - rank - 1) * 2 + (v - 1) * p, capped at m * v
    assert warmup_micro_batches(stages, rank, chunks, micro) == expected


@pytest.mark.parametrize("stages, chunks, micro", [(3, 2, 3), (3, 4, 6), (4, 2, 4), (4, 3, 8), (5, 2, 10), (6, 2, 6)])
def test_every_rank_runs_every_chunk_once_per_micro_batch_in_order(stages, chunks, micro):
    for rank, prog in enumerate(programs(stages, chunks, micro)):   # raises if sends and receives do not pair
        steps = [x for x in prog if isinstance(x, Step)]
        for fwd in (True, False):
            for c in range(chunks):
                assert [s.micro for s in steps if s.forward == fwd and s.chunk == c] == list(range(micro))
        # the warm-up: Megatron's count of forwards before the first backward
        first_bwd = next(i for i, s in enumerate(steps) if not s.forward)
        assert first_bwd == min(warmup_micro_batches(stages, rank, chunks, micro) + 1, micro * chunks)


@pytest.mark.parametrize("stages, chunks, groups", [(3, 2, 1), (3, 4, 2), (6, 2, 1), (6, 4, 2), (4, 3, 3)])
def test_every_rank_reaches_its_sends(stages, chunks, groups):
    # each send waits for its receiver's call: the builder finds an order for all of them (a
    # false deadlock raises), and every forward and backward of every chunk is emitted
    gas = stages * groups
    _, sched = build_schedule(interleaved(stages, chunks, gas, stages * chunks, **{"hardware.gpus_per_node": 12}))
    for r in range(stages):
        assert len({(op.micro_step, op.payload.module) for op in _ops(sched, r, OpKind.BACKWARD)}) == len(
            _ops(sched, r, OpKind.BACKWARD))
        assert len(_ops(sched, r, OpKind.SEND_ACTIVATION)) == chunks * gas - (gas if r == stages - 1 else 0)


@pytest.mark.parametrize("change, field, fix", [
    ({"parallelism.pipeline_schedule": "1f1b"}, "parallelism.virtual_stages", "set it or use virtual_stages 1"),
    ({"parallelism.pipeline": 2, "hardware.gpus_per_node": 8}, "parallelism.pipeline", "pipeline >= 3"),
    ({"parallelism.pipeline": 1, "hardware.gpus_per_node": 8}, "parallelism.pipeline", "pipeline >= 3"),
    ({"model.layers": 12}, "parallelism.virtual_stages", "interleaving without enough layers"),
    ({"training.gradient_accumulation_steps": 6}, "training.gradient_accumulation_steps", "divisible by the pipeline"),
    ({"parallelism.pipeline_schedule": "zb"}, "parallelism.pipeline_schedule", ""),
])
def test_megatrons_refusals(change, field, fix):
    with pytest.raises(ZsimInputError) as err:
        interleaved(**change)
    assert err.value.field == field and fix in str(err.value)


def test_refusal_exits_2_in_one_line(tmp_path):
    path = tmp_path / "s.yaml"
    raw = mapping(**{"model.layers": 6, "parallelism.pipeline": 4, "parallelism.virtual_stages": 2,
                     "parallelism.pipeline_schedule": "interleaved", "deepspeed.zero_optimization.stage": 1})
    path.write_text(json.dumps(raw))
    proc = subprocess.run([sys.executable, "-m", "zsim.cli", "run", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "interleaving without enough layers" in proc.stderr


def test_one_chunk_is_plain_1f1b_as_in_megatron():
    # arguments.py: a virtual pipeline size of 1 becomes None, i.e. the non-interleaved schedule,
    # over Megatron's equal split of the transformer layers (DeepSpeed's type:transformer)
    one = run_scenario(interleaved(chunks=1, gas=4))[0]
    plain = run_scenario(scenario(**{"model.layers": 8, "parallelism.pipeline": 4, "hardware.gpus_per_node": 8,
                                     "deepspeed.zero_optimization.stage": 1,
                                     "parallelism.partition_method": "type:transformer",
                                     "training.gradient_accumulation_steps": 4}))[0]
    assert one.to_dict() == plain.to_dict() and "schedule" not in one.to_dict()["pipeline"]
    assert one.to_dict()["pipeline"]["layers"] == [[0, 2], [2, 4], [4, 6], [6, 8]]


@pytest.mark.parametrize("stages, chunks, gas", [(4, 2, 8), (4, 4, 8), (4, 2, 16), (3, 2, 6)])
def test_bubble_falls_by_the_number_of_chunks(stages, chunks, gas):
    # Narayanan et al. 2.2.2: the bubble is (p - 1) / (v m) of the compute, i.e. (p - 1) / (v m + p - 1)
    # of the step; it comes out of the simulation (a model whose layers dominate the step)
    layers = 12 if stages == 3 else 16
    changes = {**_BIG, "model.layers": layers, "training.gradient_accumulation_steps": gas}
    r = run_scenario(interleaved(stages, chunks, gas, layers, **_BIG))[0]
    plain = run_scenario(scenario(**{**changes, "parallelism.pipeline": stages,
                                     "deepspeed.zero_optimization.stage": 1,
                                     "hardware.gpus_per_node": 2 * stages}))[0]
    ideal = (stages - 1) / (chunks * gas + stages - 1)
    assert r.pipeline.bubble_fraction == pytest.approx(ideal, abs=0.02)
    assert plain.pipeline.bubble_fraction == pytest.approx((stages - 1) / (gas + stages - 1), abs=0.08)
    assert r.pipeline.bubble_fraction < plain.pipeline.bubble_fraction and r.step_time_s < plain.step_time_s


def _tp8(chunks: int, gas: int, **changes):
    """Korthikanti et al.'s full-recompute rows in small: TP8 inside a node, each of the 4 pipeline
    stages on a node of its own (the sends cross InfiniBand), no sequence parallelism."""
    base = {"model.layers": 12, "model.hidden": 4096, "model.heads": 32, "model.seq_len": 2048,
            "training.seq_len": 2048, "training.micro_batch_size": 1, "training.activation_checkpointing": "full",
            "parallelism.pipeline": 4, "parallelism.tensor": 8, "deepspeed.zero_optimization.stage": 1,
            "training.gradient_accumulation_steps": gas, "hardware.nodes": 4}
    if chunks > 1:
        base.update({"parallelism.pipeline_schedule": "interleaved", "parallelism.virtual_stages": chunks})
    base.update(changes)
    return scenario(**base)


def test_interleaving_beats_1f1b_when_the_bubble_dominates():
    # Narayanan et al. SC'21 fig. 12/13: at a small batch the interleaved schedule wins, its bubble
    # (p - 1) / (v m) against (p - 1) / m paying for its v times as many sends. Megatron's
    # batched call sends both ways at once over full-duplex links, and with tensor parallelism each
    # rank sends its 1/t of the tensor (scatter/gather), as DeepSpeed's 1F1B does (pipe_partitioned /
    # grad_partitioned); zsim charged every rank the whole tensor, one send after the other on
    # half-duplex links, and had this run 20% slower than 1F1B.
    p, v, m, t = 4, 3, 8, 8
    plain, inter = run_scenario(_tp8(1, m))[0], run_scenario(_tp8(v, m))[0]
    assert inter.step_time_s < 0.9 * plain.step_time_s
    assert inter.pipeline.bubble_fraction < 0.5 * plain.pipeline.bubble_fraction
    # the extra volume is charged: 2 m (p - 1) tensors per 1F1B step (each 1/t and DeepSpeed's
    # PartitionedTensor meta of t + 7 int64) against 2 v m p - 2 m pieces of 1/t, each all-gathered
    # over the tensor-parallel group at its receiver (per rank)
    act = 2048 * 4096 * 2
    assert plain.comm.bytes_per_gpu["send_recv"] == pytest.approx(2 * m * (p - 1) / p * (act / t + 8 * (t + 7)))
    # 1F1B: the received activation in forward, the output and the received gradient in backward
    assert plain.comm.calls["tp all_gather"] == 3 * m * (p - 1) / p
    assert inter.comm.bytes_per_gpu["send_recv"] == pytest.approx((2 * v * m * p - 2 * m) / p * act / t)
    assert inter.comm.calls["send_recv"] == inter.comm.calls["tp all_gather"] == (2 * v * m * p - 2 * m) / p
    assert inter.comm.time_s["tp all_gather"] > 0


def test_sequence_parallel_sends_the_sequence_shard_without_a_gather():
    # with sequence parallelism the tensor between stages is already the rank's 1/t of the
    # sequence: Megatron v3.0 sends it as it is (no scatter/gather)
    p, v, m, t = 4, 3, 4, 8
    r, trace = run_scenario(_tp8(v, m, **{"parallelism.sequence_parallel": True}))
    assert r.comm.bytes_per_gpu["send_recv"] == pytest.approx((2 * v * m * p - 2 * m) / p * 2048 * 4096 * 2 / t)
    assert not [op for op in trace.schedule.ops if op.kind == OpKind.TP_ALL_GATHER and "p2p" in op.payload.module]
    _, trace = run_scenario(_tp8(v, m))
    gathers = [op for op in trace.schedule.ops if op.kind == OpKind.TP_ALL_GATHER]
    recvs = [op for op in trace.schedule.ops if op.kind in (OpKind.RECV_ACTIVATION, OpKind.RECV_GRAD)]
    assert len(gathers) == len(recvs) and all("p2p recv" in op.payload.module for op in gathers)


def test_a_batched_call_sends_both_ways_at_once():
    # send_forward_backward_recv_forward_backward: one batch_isend_irecv, its requests all waited.
    # A steady-state call's two sends go out together (the second on the P2P stream, each once its
    # receiver has posted its call), and the compute stream goes on only after both: the first
    # receive waits for the rank's own sends.
    sc = interleaved(4, 2, 8, **{"hardware.gpus_per_node": 1, "hardware.nodes": 4})
    _, trace = run_scenario(sc)
    ops, timings = trace.schedule.ops, trace.timings
    second = [op for op in ops if op.stream == Stream.P2P]
    assert second and all(op.kind in (OpKind.SEND_ACTIVATION, OpKind.SEND_GRAD) for op in second)
    together = 0
    for op in second:
        first = ops[op.id - 1]    # the call's first send, on the compute stream
        assert first.pipe_stage == op.pipe_stage and first.stream == Stream.COMPUTE and first.kind != op.kind
        # both wait for the rank's last op before the call
        assert any(ops[d].pipe_stage == op.pipe_stage for d in set(first.deps) & set(op.deps))
        together += timings[op.id].start_s < timings[first.id].end_s
        waits = [o for o in ops if op.id in o.deps and o.pipe_stage == op.pipe_stage]
        assert len(waits) == 1 and waits[0].kind in (OpKind.RECV_ACTIVATION, OpKind.RECV_GRAD)
        assert timings[waits[0].id].start_s >= timings[op.id].end_s
    assert together > len(second) / 2
    # full-duplex links: a send takes the sender's outgoing and the receiver's incoming side
    from zsim.hardware.cost_model import CostModel
    cost = CostModel(sc.cluster, sc.precision, 1, trace.schedule.host, trace.schedule.pipeline)
    assert cost.op_cost(second[0]).links[0].startswith("inter_node_out")
    assert any(link.startswith("inter_node_in@") for link in cost.op_cost(second[0]).links)


def _ops(sched, stage, kind):
    return [op for op in sched.ops if op.pipe_stage == stage and op.kind == kind]


def test_sends_cross_chunk_boundaries():
    p, v, m = 4, 2, 8
    sc = interleaved(p, v, m)
    _, sched = build_schedule(sc)
    act = sc.micro_batch_size * sc.seq_len * 256 * 2
    for r in range(p):
        # 2 v m sends per rank, one per direction for each (micro-batch, chunk), less the ends of
        # the model: the last rank's last chunk sends no activation, rank 0's first chunk no gradient
        acts, grads = _ops(sched, r, OpKind.SEND_ACTIVATION), _ops(sched, r, OpKind.SEND_GRAD)
        assert len(acts) == v * m - (m if r == p - 1 else 0)
        assert len(grads) == v * m - (m if r == 0 else 0)
        assert len(_ops(sched, r, OpKind.RECV_ACTIVATION)) == v * m - (m if r == 0 else 0)
        assert len(_ops(sched, r, OpKind.RECV_GRAD)) == v * m - (m if r == p - 1 else 0)
        for op in acts:
            src, dst = op.payload.chunks
            assert op.payload.size_bytes == act and op.payload.dst_stage == (r + 1) % p
            assert dst == src + (1 if r == p - 1 else 0)   # the last rank's chunk j feeds rank 0's chunk j + 1
        for op in grads:
            src, dst = op.payload.chunks
            assert op.payload.dst_stage == (r - 1) % p and dst == src - (1 if r == 0 else 0)
    # every receive waits for its send
    sends = {op.id: op for op in sched.ops if op.kind in (OpKind.SEND_ACTIVATION, OpKind.SEND_GRAD)}
    for op in sched.ops:
        if op.kind in (OpKind.RECV_ACTIVATION, OpKind.RECV_GRAD):
            assert any(sends.get(d) is not None and sends[d].payload == op.payload and sends[d].micro_step == op.micro_step
                       for d in op.deps)
    assert "chunk" in next(op.name for op in sched.ops if op.kind == OpKind.SEND_ACTIVATION)


def test_in_flight_chunks_follow_the_schedule():
    # the ledger's saved activations: rank r holds at most Megatron's warm-up count + 1
    # (micro-batch, chunk) pairs in flight, rank 0 the most
    p, v, m = 4, 2, 8
    sc = interleaved(p, v, m)
    result, trace = run_scenario(sc)
    layout = trace.schedule.pipeline
    assert layout.virtual_stages == v
    chunk_of_layer = {layer: k // p for k, (a, b) in enumerate(layout.layers) for layer in range(a, b)}
    chunk_of_layer.update({-1: 0, -2: v - 1})
    chunk_of = {mod.name: chunk_of_layer[mod.layer] for mod in workload_for(sc).modules}
    most = []
    for events in trace.stage_ledger_events:
        alive: dict[tuple[int, int], int] = {}
        peak = 0
        for _, delta, _, tag in events:
            if tag.buffer == Buffer.ACTIVATION:
                key = (tag.micro, chunk_of[tag.key])
                alive[key] = alive.get(key, 0) + (1 if delta > 0 else -1)
                peak = max(peak, sum(1 for n in alive.values() if n > 0))
        most.append(peak)
    assert most == [warmup_micro_batches(p, r, v, m) + 1 for r in range(p)] == [11, 9, 7, 5]
    assert result.pipeline.peak_bytes[0] == max(result.pipeline.peak_bytes)


def test_chunks_placed_as_megatron_and_shown():
    p, v = 4, 2
    sc = interleaved(p, v, 8, **{"model.tied_embeddings": True})
    result, trace = run_scenario(sc)
    pp = result.pipeline
    # chunk j of rank i is virtual stage j * p + i: rank 0 holds layers 0 and 4
    assert pp.layers == [[k, k + 1] for k in range(8)]
    assert (pp.schedule, pp.virtual_stages) == ("interleaved", 2)
    assert result.to_dict()["pipeline"]["virtual_stages"] == 2
    # the embedding on rank 0's first chunk, the tied head on the last rank's last chunk
    tied = [op for op in trace.schedule.ops if op.kind == OpKind.TIED_ALLREDUCE]
    assert sorted(op.pipe_stage for op in tied) == [0, p - 1]
    assert all(op.comm.group == ProcessGroup(Group.TIED, 2, (p - 1) * trace.schedule.pipeline.data_parallel)
               for op in tied)
    from zsim.report.writers import chrome_trace
    names = [e["args"]["name"] for e in chrome_trace(trace, sc.name)["traceEvents"] if e.get("name") == "process_name"]
    assert names[0].endswith("(pipeline stage 0, rank 0, chunks 0: layers 0-0, 1: layers 4-4)")


def test_table_and_memory_command_show_the_chunks(tmp_path, capsys):
    from zsim.cli import main as cli_main

    path = tmp_path / "s.yaml"
    raw = mapping(**{"model.layers": 8, "parallelism.pipeline": 4, "parallelism.virtual_stages": 2,
                     "parallelism.pipeline_schedule": "interleaved", "deepspeed.zero_optimization.stage": 1,
                     "training.gradient_accumulation_steps": 4})
    path.write_text(json.dumps(raw))
    assert cli_main(["run", str(path)]) == 0
    assert "interleaved 1F1B, 2 model chunks per stage" in capsys.readouterr().out
    out = tmp_path / "m.json"
    assert cli_main(["memory", str(path), "--json", str(out)]) == 0
    full = run_scenario(scenario(**{"model.layers": 8}))[0]
    # the estimator sees one rank's two chunks (about a quarter of the model)
    assert full.n_params / 6 < json.loads(out.read_text())["n_params"] < full.n_params / 2
