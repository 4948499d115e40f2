"""Megatron-LM tensor and sequence parallelism: per-rank parameters, FLOPs and activations against
Korthikanti et al. 2022 (Table 2), the collectives per layer, the placement, ZeRO on top, refusals."""
import json
import subprocess
import sys
from collections import Counter

import pytest

from tests.helpers import scenario
from zsim.api import run_scenario
from zsim.errors import ZsimInputError
from zsim.hardware.placement import group_shape, rank_map
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import Group, OpKind, Phase, ProcessGroup
from zsim.schedule.payloads import TensorComm
from zsim.specs.model import ModelSpec
from zsim.workload.transformer import build_workload

# a GPT (learned positions, LayerNorm, biases, fused QKV, GeLU MLP 4h), Korthikanti's setting
L, H, A, S, B, V = 2, 1024, 16, 512, 2, 51200
GPT = ModelSpec(layers=L, hidden=H, heads=A, vocab=V, seq_len=S, position="learned", tied_embeddings=True,
                norm="layernorm", bias=True, glu=False, fused_qkv=True)
TP = {"parallelism.tensor": 2, "deepspeed.zero_optimization.stage": 1}


def _wl(t, sp=False, flash=False, dropout=True):
    return build_workload(GPT, micro_batch_size=B, seq_len=S, precision="fp16", flash_attention=flash,
                          dropout=dropout, tensor=t, sequence_parallel=sp)


@pytest.mark.parametrize("t", [1, 2, 8])
def test_per_rank_params_follow_megatrons_column_and_row_split(t):
    wl = _wl(t)
    # QKV 3h^2/t + 3h/t, proj h^2/t + h, fc1 4h^2/t + 4h/t, fc2 4h^2/t + h, two LayerNorms 4h
    layer = 12 * H * H // t + 7 * H // t + 6 * H
    # vocab-parallel embedding (tied with the head), replicated positions and final LayerNorm
    assert wl.n_params == L * layer + V * H // t + S * H + 2 * H


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_per_rank_activations_are_korthikantis_table_2(t, sp):
    if sp and t == 1:
        pytest.skip("sequence parallelism needs t > 1")
    wl = _wl(t, sp)
    sbh, s2 = S * B * H, 5 * A * S / (H * t)
    expected = sbh * ((34 / t if sp else 10 + 24 / t) + s2)
    for layer in range(L):
        assert sum(m.act_bytes for m in wl.layer_modules(layer)) == pytest.approx(expected, rel=1e-12)
    # full recompute keeps each layer's input: 2sbh, 2sbh/t under SP (Table 2's last rows)
    assert wl.layer_input_bytes == 2 * sbh / (t if sp else 1)


@pytest.mark.parametrize("t", [1, 2, 8])
def test_per_rank_flops_are_one_tth_of_the_layer(t):
    wl = _wl(t)
    for layer in range(L):
        mods = wl.layer_modules(layer)
        gemm = sum(m.fwd_flops for m in mods if m.gemm is not None)
        assert gemm == pytest.approx(24 * B * S * H * H / t)           # Narayanan et al. eq. 3, per rank
        model = sum(m.model_fwd_flops for m in mods)
        assert model == pytest.approx((24 * B * S * H * H + 4 * B * S * S * H) / t)


def _tp_ops(sched):
    return [op for op in sched.ops if isinstance(op.payload, TensorComm)]


def _counts(ops, phase):
    return Counter(op.kind for op in ops if op.phase == phase)


def test_two_all_reduces_per_layer_each_way_without_sp():
    sc = scenario(**TP)
    _, sched = build_schedule(sc)
    ops = _tp_ops(sched)
    layers = sc.model.layers
    # per layer one after attention and one after the MLP; + the embedding's; + the loss's three
    assert _counts(ops, Phase.FORWARD) == {OpKind.TP_ALL_REDUCE: 2 * layers + 1 + 3}
    # per layer the f conjugates of QKV and fc1; + lm_head's input gradient
    assert _counts(ops, Phase.BACKWARD) == {OpKind.TP_ALL_REDUCE: 2 * layers + 1}
    assert all(op.comm.group == ProcessGroup(Group.TENSOR, 2, 1) for op in ops)
    h, tokens = sc.model.hidden, sc.micro_batch_size * sc.seq_len
    layer_ops = [op for op in ops if op.payload.module.startswith("layers.")]
    assert {op.payload.size_bytes for op in layer_ops} == {tokens * h * 2}


def test_sequence_parallel_turns_them_into_reduce_scatter_and_all_gather():
    sc = scenario(**TP, **{"parallelism.sequence_parallel": True})
    assert sc.model.position == "learned"
    wl, sched = build_schedule(sc)
    ops = _tp_ops(sched)
    n = sc.model.layers
    fwd, bwd = _counts(ops, Phase.FORWARD), _counts(ops, Phase.BACKWARD)
    # forward: all-gather before QKV, fc1 and lm_head; reduce-scatter after proj and fc2; the
    # embedding all-reduced before the learned positions (LanguageModelEmbedding: no
    # reduce_scatter_embeddings with a position embedding); the loss's three
    assert fwd == {OpKind.TP_ALL_GATHER: 2 * n + 1, OpKind.TP_REDUCE_SCATTER: 2 * n, OpKind.TP_ALL_REDUCE: 1 + 3}
    # backward: re-gather of each column-parallel input + reduce-scatter of its gradient; the
    # all-gather of the row-parallel outputs' (and the scattered embedding's) gradients; one
    # all-reduce of the sequence-parallel gradients
    assert bwd == {OpKind.TP_ALL_GATHER: 2 * (2 * n + 1), OpKind.TP_REDUCE_SCATTER: 2 * n + 1,
                   OpKind.TP_ALL_REDUCE: 1}
    grads = [op for op in ops if op.phase == Phase.BACKWARD and op.kind == OpKind.TP_ALL_REDUCE]
    # finalize_model_grads: every norm and row-parallel bias, flattened; not the positions
    partial = [p for p in wl.params if p.tensor_partial_grad]
    assert {p.name.rsplit(".", 2)[-2] for p in partial} == {"ln_1", "ln_2", "ln_f", "o_proj", "fc_out"}
    assert grads[0].comm.numel == sum(p.numel for p in partial)
    # after the last backward and the ZeRO-1 reduction, before the step's norm
    last_bwd = max(op.id for op in sched.ops if op.kind == OpKind.BACKWARD)
    assert grads[0].id > last_bwd
    assert any(grads[0].id in op.deps for op in sched.ops if op.kind == OpKind.GRAD_NORM)


def test_without_learned_positions_the_embedding_is_reduce_scattered():
    """LanguageModelEmbedding's reduce_scatter_embeddings: RoPE under SP reduce-scatters the
    vocab-parallel rows (VocabParallelEmbedding), no all-reduce; without SP no partial gradients."""
    sc = scenario(**TP, **{"parallelism.sequence_parallel": True, "model.position": "rope"})
    wte = [op for op in _tp_ops(build_schedule(sc)[1]) if op.payload.module == "wte"]
    assert [(op.phase, op.kind) for op in wte][:2] == [(Phase.FORWARD, OpKind.TP_REDUCE_SCATTER),
                                                       (Phase.BACKWARD, OpKind.TP_ALL_GATHER)]
    assert not any(p.tensor_partial_grad for p in build_schedule(scenario(**TP))[0].params)


def test_qk_layernorm_gradients_are_summed_over_tp_without_sp():
    """finalize_model_grads sums q_layernorm / k_layernorm grads over the TP group even without SP:
    each rank normalizes only its heads with the shared head_dim-wide weights."""
    sc = scenario(**TP, **{"model.qk_norm": True, "model.fused_qkv": False})
    wl, sched = build_schedule(sc)
    partial = [p for p in wl.params if p.tensor_partial_grad]
    assert partial and all(p.name.split(".")[-2] in ("q_norm", "k_norm") for p in partial)
    grads = [op for op in _tp_ops(sched) if op.payload.module == "tensor_partial_grads"]
    assert [(op.phase, op.comm.numel) for op in grads] == [(Phase.BACKWARD, sum(p.numel for p in partial))]


def test_full_recompute_reruns_the_forward_collectives():
    sc = scenario(**TP, **{"training.activation_checkpointing": "full"})
    _, sched = build_schedule(sc)
    assert _counts(_tp_ops(sched), Phase.RECOMPUTE) == {OpKind.TP_ALL_REDUCE: 2 * sc.model.layers}


def test_tp_group_is_inside_a_node_and_dp_strides_over_it():
    tp = ProcessGroup(Group.TENSOR, 8, 1)
    # 16 nodes of 8: TP8 fills a node; DP over the 16 nodes is one rank per node
    assert group_shape(tp, 0, 16, 8, tensor=8) == (1, 8)
    assert group_shape(None, 0, 16, 8, tensor=8) == (16, 1)
    # TP2 x DP8 on 8-GPU nodes: the data-parallel group, 2 apart, spans 2 nodes, 4 each
    assert group_shape(None, 0, 8, 8, tensor=2) == (2, 4)
    # pipe group (stride dp) of TP2 x DP2 x PP2: ranks 0 and 4 on one 8-GPU node
    assert group_shape(ProcessGroup(Group.PIPE, 2, 2), 0, 2, 8, tensor=2) == (1, 2)
    ranks = rank_map(2, 2, 2, 4)
    assert [(r["stage"], r["dp_rank"], r["tp_rank"], r["node"]) for r in ranks[:5]] == [
        (0, 0, 0, 0), (0, 0, 1, 0), (0, 1, 0, 0), (0, 1, 1, 0), (1, 0, 0, 1)]


def test_tp_collectives_are_shown_apart_and_priced_inside_the_node():
    sc = scenario(**TP)
    result, trace = run_scenario(sc)
    assert trace.schedule.tensor == 2 and trace.schedule.data_parallel == 4
    n = sc.model.layers
    assert result.comm.calls["tp all_reduce"] == (2 * n + 4) + (2 * n + 1)
    # the same bytes over 2 ranks on NVLink: a TP all-reduce of a 2-rank group reaches NVLink's busbw
    # far faster than ZeRO's over 4 ranks would across nodes; here both are inside the one node
    assert result.comm.achieved_busbw_Bps["tp all_reduce"] > 0


def test_zero3_with_tp_shards_each_tp_slice_over_its_data_parallel_group():
    sc = scenario(**{"parallelism.tensor": 2, "deepspeed.zero_optimization.stage": 3,
                     "deepspeed.zero_optimization.stage3_param_persistence_threshold": 0})
    assert sc.data_parallel_size == 4
    wl, sched = build_schedule(sc)
    full = build_schedule(scenario(**{"deepspeed.zero_optimization.stage": 3}))[0]
    assert wl.n_params < full.n_params
    params = sum(a.size_bytes for a in sched.static if a.category == "parameters")
    # each rank's 16-bit partition: 1/dp of its TP slice (padding to dp: a few elements per param)
    assert params == pytest.approx(wl.n_params * 2 / 4, rel=1e-3)


def test_batch_divides_by_data_parallel_only_and_result_shows_the_layout():
    sc = scenario(**TP, **{"training.gradient_accumulation_steps": 2})
    assert sc.global_batch_size == sc.micro_batch_size * 2 * 4
    result, _ = run_scenario(sc)
    tp = result.to_dict()["tensor_parallel"]
    assert (tp["tensor"], tp["data_parallel"], tp["pipeline"]) == (2, 4, 1) and len(tp["rank_map"]) == 8
    assert "tensor_parallel" not in run_scenario(scenario())[0].to_dict()


def test_ds_config_tensor_parallel_maps_onto_tensor():
    assert scenario(**{"deepspeed.tensor_parallel": {"autotp_size": 2}}).tensor_parallel_size == 2
    assert scenario(**{"deepspeed.tensor_parallel": {"size": 4}}).tensor_parallel_size == 4
    assert scenario(**{"deepspeed.tensor_parallel": {"size": 4, "enabled": False}}).tensor_parallel_size == 1
    assert not scenario(**{"deepspeed.tensor_parallel": {"size": 2}}).warnings


@pytest.mark.parametrize("change, field, fix", [
    ({"parallelism.tensor": 3}, "parallelism.tensor", "must divide the GPUs per node"),
    ({"parallelism.tensor": 16, "hardware.nodes": 2}, "parallelism.tensor", "must divide the GPUs per node"),
    ({"parallelism.tensor": 8, "model.heads": 4}, "parallelism.tensor", "must divide the attention heads"),
    ({"parallelism.tensor": 4, "model.heads": 8, "model.kv_heads": 2}, "parallelism.tensor",
     "must divide the key-value heads"),
    ({"parallelism.tensor": 0}, "parallelism.tensor", ""),
    ({"parallelism.tensor": 4, "parallelism.pipeline": 4, "model.layers": 4}, "parallelism.tensor",
     "must divide the world size"),
    ({"parallelism.sequence_parallel": True}, "parallelism.sequence_parallel", "set parallelism.tensor > 1"),
    ({"parallelism.tensor": 2, "deepspeed.tensor_parallel": {"size": 4}}, "deepspeed.tensor_parallel.size",
     "disagrees with parallelism.tensor"),
])
def test_refusals(change, field, fix):
    with pytest.raises(ZsimInputError) as err:
        scenario(**change)
    assert err.value.field == field and fix in str(err.value)


def test_bad_tensor_size_exits_2_in_one_line(tmp_path):
    from tests.helpers import mapping
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(mapping(**{"parallelism.tensor": 3})))
    proc = subprocess.run([sys.executable, "-m", "zsim.cli", "run", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "parallelism.tensor" in proc.stderr


@pytest.mark.parametrize("changes, key", [
    ({"deepspeed.zero_optimization.stage": 0, "hardware.gpus_per_node": 2}, "--engine"),   # no DeepSpeed TP runner
    ({"deepspeed.zero_optimization.stage": 1, "hardware.gpus_per_node": 2, "training.precision": "fp32"},
     "deepspeed.zero_optimization.stage"),
    ({"deepspeed.zero_optimization.stage": 0, "hardware.gpus_per_node": 2}, "training.precision"),   # bf16
])
def test_validate_refuses_what_the_tensor_core_does_not_run_in_one_line(tmp_path, capsys, changes, key):
    from tests.helpers import mapping
    from zsim.cli import main as cli_main

    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(mapping(**{**TP, **changes})))
    args = ["validate", str(path)] + (["--engine", "deepspeed"] if key == "--engine" else [])
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and key in err