"""Generation (the scenario's inference block): the schedule's forwards, its KV cache, ZeRO-3's
gathers and offloaded copies, tensor parallelism, the decode steps not simulated, and the refusals
(see [Note: generation])."""
from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, mapping, run_cli
from zsim.api import run_generation
from zsim.config.scenario import scenario_from_mapping
from zsim.engine.sim import simulate
from zsim.errors import ZsimInputError
from zsim.result.generation import summarize_generation
from zsim.schedule.generate import ALL_STEPS_UP_TO, build_generation, simulated_forwards
from zsim.schedule.ir import Category, OpKind
from zsim.simulate import simulate_generation
from zsim.specs.generation import generation_kernels
from zsim.workload.generation import decode_workload, prefill_workload

MODEL = {"layers": 4, "hidden": 512, "heads": 8, "kv_heads": 2, "ffn_hidden": 1408, "vocab": 4096, "seq_len": 4096,
         "position": "rope", "norm": "rmsnorm", "glu": True, "fused_qkv": False, "tied_embeddings": False}


def gen_scenario(inference: dict, zero: dict | None = None, gpus: int = 1, **changes):
    raw = mapping(**changes)
    raw["model"] = dict(MODEL)
    raw["hardware"]["gpus_per_node"] = gpus
    raw["training"] = {"precision": "bf16"}
    raw["deepspeed"] = {"bf16": {"enabled": True}, "zero_optimization": zero or {"stage": 0}}
    raw["inference"] = inference
    return scenario_from_mapping(raw, ROOT)


def forward_ends(trace) -> dict[int, float]:
    ends: dict[int, float] = {}
    for op, t in zip(trace.schedule.ops, trace.timings):
        ends[op.micro_step] = max(ends.get(op.micro_step, 0.0), t.end_s)
    return ends


def test_one_forward_per_token_every_module_once():
    sc = gen_scenario({"batch_size": 2, "prompt_len": 64, "new_tokens": 5})
    wl, trace, forwards = simulate_generation(sc)
    assert forwards == (0, 1, 2, 3, 4)      # the prefill and new_tokens - 1 decode steps
    names = [m.name for m in wl.modules]
    assert "loss" not in names
    for f in forwards:
        ran = [op.payload.module for op in trace.schedule.ops if op.micro_step == f and op.kind == OpKind.FORWARD]
        assert ran == names


def test_kv_cache_is_two_layers_of_keys_and_values_per_token():
    b, prompt, new = 3, 100, 9
    sc = gen_scenario({"batch_size": b, "prompt_len": prompt, "new_tokens": new})
    _, trace, _ = simulate_generation(sc)
    g = summarize_generation(sc, trace, simulated_forwards(new))
    # keys and values of the 2 KV heads of 64 dims, 2 bytes, per layer, for every token but the last
    expected = 4 * 2 * b * (prompt + new - 1) * 2 * 64 * 2
    assert g.kv_cache_bytes == expected
    # most while the last layer concatenates: its old cache and the new one are both alive
    held = most = 0.0
    for _, delta, category, _ in trace.ledger_events:
        if category == Category.KV_CACHE:
            held += delta
            most = max(most, held)
    assert most == expected + 2 * b * (prompt + new - 2) * 2 * 64 * 2
    assert held == 0.0      # generate() returns: the cache goes


def test_injected_kernels_preallocate_the_cache_for_max_out_tokens():
    sc = gen_scenario({"batch_size": 2, "prompt_len": 64, "new_tokens": 4, "kernel_inject": True,
                       "max_out_tokens": 512})
    _, trace, forwards = simulate_generation(sc)
    # inference_context.h GenWorkSpace: every layer's keys and values over all 8 heads (not the 2 KV
    # heads) of 64 dims, 2 sequences, 512 tokens, 2 bytes; the activations (10 x 512 a sequence) and the
    # scores (8 heads) per token beside them
    kv = [a for a in trace.schedule.static if a.category == Category.KV_CACHE]
    assert len(kv) == 1 and kv[0].size_bytes == 4 * 2 * 512 * 2 * 512 * 2
    rest = [a for a in trace.schedule.static if a.category == Category.INFERENCE_WORKSPACE]
    assert rest[0].size_bytes == (10 * 512 * 2 + 2 * 8 * 512) * 512 * 2
    # the result reports the cache the schedule holds
    assert summarize_generation(sc, trace, forwards).kv_cache_bytes == kv[0].size_bytes
    assert not any(a.category == Category.KV_CACHE for op in trace.schedule.ops for a in op.alloc)


def test_decode_step_time_grows_with_the_context():
    sc = gen_scenario({"batch_size": 8, "prompt_len": 1024, "new_tokens": 6})
    _, trace, forwards = simulate_generation(sc)
    ends = forward_ends(trace)
    steps = [ends[f] - ends[f - 1] for f in forwards[1:]]
    assert all(b > a for a, b in zip(steps, steps[1:]))


@pytest.mark.parametrize("zero", [None, {"stage": 3}], ids=["replicated", "zero3"])
def test_sampled_decode_steps_stand_for_every_step(zero):
    """A long generation simulates a sample of its decode steps; the interpolated total is the
    one simulating every step gives (exact where nothing overlaps; ZeRO-3's gathers within 0.1%)."""
    new = ALL_STEPS_UP_TO + 30
    sc = gen_scenario({"batch_size": 4, "prompt_len": 256, "new_tokens": new}, zero=zero, gpus=1 if zero is None else 4)
    gen = sc.inference
    attn, kernels = generation_kernels(gen, sc.training)
    prefill = prefill_workload(sc.model, 4, 256, "bf16", attn, kernels, 1)
    decode = decode_workload(sc.model, 4, "bf16", attn, kernels, 1)
    every = tuple(range(new))
    full = simulate(build_generation(sc, prefill, decode, every), sc.cluster, sc.precision)
    sampled = simulated_forwards(new)
    assert len(sampled) < len(every)
    short = simulate(build_generation(sc, prefill, decode, sampled), sc.cluster, sc.precision)
    g_full = summarize_generation(sc, full, every)
    g_short = summarize_generation(sc, short, sampled)
    tol = 1e-9 if zero is None else 1e-3
    assert g_short.decode_time_s == pytest.approx(g_full.decode_time_s, rel=tol)
    assert g_short.memory.peak_bytes == g_full.memory.peak_bytes
    assert g_short.kv_cache_bytes == g_full.kv_cache_bytes


def test_zero3_gathers_every_parameter_in_every_forward():
    sc = gen_scenario({"batch_size": 2, "prompt_len": 32, "new_tokens": 4}, zero={"stage": 3}, gpus=4)
    wl, trace, forwards = simulate_generation(sc)
    small = {i for i, p in enumerate(wl.params) if p.numel <= sc.zero.param_persistence_threshold}
    assert small     # the norms
    for f in forwards:
        gathered = [p for op in trace.schedule.ops if op.micro_step == f and op.kind == OpKind.PARAM_GATHER
                    for p in op.payload.pids]
        # every parameter once; the persistent ones only until the trace is complete and they stay
        # (see [Note: generation])
        expected = range(len(wl.params)) if f < 2 else sorted(set(range(len(wl.params))) - small)
        assert sorted(gathered) == list(expected)
    prefetched = [op for op in trace.schedule.ops if op.kind == OpKind.PARAM_GATHER and op.payload.prefetch]
    # the prefill records the trace (no prefetch); the decode steps prefetch along it
    assert prefetched and all(op.micro_step > 0 for op in prefetched)


def test_zero_inference_streams_every_parameter_from_the_host_each_step():
    sc = gen_scenario({"batch_size": 2, "prompt_len": 32, "new_tokens": 3},
                      zero={"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}})
    wl, trace, forwards = simulate_generation(sc)
    total = sum(p.numel for p in wl.params) * 2
    kept = sum(p.numel for p in wl.params if p.numel <= full_threshold(sc)) * 2
    for f in forwards:
        h2d = sum(op.payload.size_bytes for op in trace.schedule.ops if op.micro_step == f and op.kind == OpKind.PARAM_FETCH)
        # the persistent ones stay on the GPU once the trace is complete (see [Note: generation])
        assert h2d == (total if f < 2 else total - kept)
    g = summarize_generation(sc, trace, forwards)
    assert g.memory.host.breakdown["parameters (16-bit)"] == total
    assert "parameters" not in g.memory.breakdown


def full_threshold(sc) -> float:
    return sc.zero.param_persistence_threshold


def test_tensor_parallel_all_reduces_each_row_parallel_output():
    sc = gen_scenario({"batch_size": 2, "prompt_len": 32, "new_tokens": 3, "tensor_parallel": 2}, gpus=2)
    _, trace, _ = simulate_generation(sc)
    step = [op for op in trace.schedule.ops if op.micro_step == 2]
    reduces = [op for op in step if op.kind == OpKind.TP_ALL_REDUCE]
    gathers = [op for op in step if op.kind == OpKind.TP_ALL_GATHER]
    # o_proj and down_proj of each layer, and AutoTP's lm_head (LmHeadLinearAllreduce: the logits);
    # the embedding stays whole on every GPU
    assert len(reduces) == 2 * 4 + 1 and not gathers
    assert reduces[0].payload.comm.size_bytes == 2 * 512 * 2     # one token per sequence, hidden wide
    assert reduces[-1].payload.module == "lm_head" and reduces[-1].payload.comm.size_bytes == 2 * 4096 * 2
    inject = gen_scenario({"batch_size": 2, "prompt_len": 32, "new_tokens": 3, "tensor_parallel": 2,
                           "kernel_inject": True}, gpus=2)
    wl, trace, _ = simulate_generation(inject)
    assert [op.payload.module for op in trace.schedule.ops if op.micro_step == 2 and op.kind == OpKind.TP_ALL_REDUCE][-1] \
        == "layers.3.mlp.fc_out"     # the injected kernels leave lm_head whole
    wte = next(p for p in wl.params if p.name == "wte.weight")
    assert wte.numel == 4096 * 512


def test_cli_table_json_and_determinism(tmp_path):
    path = tmp_path / "gen.yaml"
    raw = mapping()
    raw["model"] = dict(MODEL)
    raw["training"] = {"precision": "bf16"}
    raw["deepspeed"] = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    raw["inference"] = {"batch_size": 4, "prompt_len": 128, "new_tokens": 100}
    import yaml
    path.write_text(yaml.safe_dump(raw))
    outs = []
    for i in range(2):
        out = run_cli(["run", str(path), "--json", str(tmp_path / f"g{i}.json")])
        assert out.code == 0, out.stderr
        outs.append((tmp_path / f"g{i}.json").read_bytes())
    assert outs[0] == outs[1]
    g = json.loads(outs[0])
    assert g["decode_steps"] == 99 and g["decode_steps_simulated"] == 33
    assert g["bound"] in g["bound_busy_s"] and g["fits"] is True
    assert "decode bound:" in out.stdout and "KV cache per GPU" in out.stdout
    assert g["tokens_per_s"] == pytest.approx(8 * 4 * 100 / g["total_time_s"])


@pytest.mark.parametrize("inference, zero, field", [
    ({"tensor_parallel": 3}, None, "inference.tensor_parallel"),
    ({"tensor_parallel": 2}, {"stage": 3}, "inference.tensor_parallel"),
    ({"kernel_inject": True}, {"stage": 3}, "inference.kernel_inject"),
    ({"cuda_graph": True}, None, "inference.cuda_graph"),
    ({"kernel_inject": True, "prompt_len": 1000, "new_tokens": 100}, None, "inference.max_out_tokens"),
    ({"batch_size": 0}, None, "inference.batch_size"),
    ({"beams": 4}, None, "inference.beams"),
])
def test_refusals_name_the_field(inference, zero, field):
    with pytest.raises(ZsimInputError) as err:
        gen_scenario(inference, zero=zero, gpus=8)
    assert str(err.value).startswith(f"{field}=") or field in str(err.value)


def test_run_generation_refuses_a_training_scenario():
    from tests.helpers import scenario
    with pytest.raises(TypeError):
        run_generation(scenario())


def test_zero_inference_quantized_weights_stream_their_packed_bytes():
    """See [Note: ZeRO-Inference quantized weights]: every nn.Linear and nn.Embedding weight is its
    codes plus a scale and a minimum per group, and that is what crosses PCIe each forward."""
    zero = {"stage": 3, "offload_param": {"device": "cpu"}}
    full = gen_scenario({"batch_size": 2, "prompt_len": 32, "new_tokens": 3}, zero=zero)
    raw = mapping()
    raw.update(model=dict(MODEL), training={"precision": "bf16"}, inference={"batch_size": 2, "prompt_len": 32,
                                                                               "new_tokens": 3})
    raw["hardware"]["gpus_per_node"] = 1
    raw["deepspeed"] = {"bf16": {"enabled": True}, "zero_optimization": zero,
                        "weight_quantization": {"quantized_initialization": {"num_bits": 4, "group_size": 64,
                                                                             "group_dim": 1, "symmetric": False}}}
    int4 = scenario_from_mapping(raw, ROOT)
    assert int4.inference.weight_bits == 4 and int4.inference.weight_group_size == 64
    wl16, tr16, f16 = simulate_generation(full)
    wl4, tr4, f4 = simulate_generation(int4)
    q_proj = next(i for i, p in enumerate(wl4.params) if p.name == "layers.0.attn.q_proj.weight")
    numel = 512 * 512
    assert wl4.params[q_proj].packed_bytes == numel // 2 + 2 * (numel // 64) * 2
    norm = next(i for i, p in enumerate(wl4.params) if p.name == "layers.0.ln_1.weight")
    assert wl4.params[norm].packed_bytes is None      # only nn.Linear and nn.Embedding weights
    h2d = lambda tr: sum(op.payload.size_bytes for op in tr.schedule.ops
                         if op.micro_step == 1 and op.kind == OpKind.PARAM_FETCH)
    assert h2d(tr4) == pytest.approx(2 * sum(p.stored_numel(2) for p in wl4.params))   # decode step 1: all
    assert h2d(tr4) < 0.35 * h2d(tr16)
    g4, g16 = summarize_generation(int4, tr4, f4), summarize_generation(full, tr16, f16)
    assert g4.decode_step_last_s < g16.decode_step_last_s


def test_weight_quantization_outside_zero3():
    with pytest.raises(ZsimInputError, match="inference.weight_bits"):
        gen_scenario({"weight_bits": 4})
    raw = mapping()
    raw.update(model=dict(MODEL), training={"precision": "bf16"}, inference={"new_tokens": 2})
    raw["deepspeed"] = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 0},
                        "weight_quantization": {"quantized_initialization": {"num_bits": 4, "group_size": 64}}}
    sc = scenario_from_mapping(raw, ROOT)      # DeepSpeed leaves them unquantized, and a note says so
    assert sc.inference.weight_bits == 16 and any("quantized_initialization" in n for n in sc.notes)


def test_quantization_group_must_divide_the_weights():
    zero = {"stage": 3, "offload_param": {"device": "cpu"}}
    with pytest.raises(ZsimInputError, match="inference.weight_group_size"):
        gen_scenario({"weight_bits": 4, "weight_group_size": 96}, zero=zero)   # 1408 % 96
