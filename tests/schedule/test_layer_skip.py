"""Layers the ZeRO-3 builder skips (zsim/schedule/layer_skip.py, see [Note: layers the builder
skips]): the schedule it builds is, op for op, the full build with the same layers left out,
and the step it simulates is the step of every op."""
from __future__ import annotations

import pytest

from tests.helpers import ROOT, scenario
from tests.helpers import LAYER_MODELS as MODELS, equal_results
from tests.helpers import VARIANTS
from zsim.api import run_scenario
from zsim.config.scenario import scenario_from_mapping
from zsim.schedule import layer_skip
from zsim.schedule.build import build_schedule

SKIPPED = ("stage3", "stage3-fp16", "stage3-selective", "stage3-full", "stage3-offload-cpu", "stage3-offload-nvme")


def _ids(short, full_ops: int) -> tuple[list[int], list[int]]:
    """Per op built, its id in the full step; and per op of the full step, the op it stands at
    (a left-out op: its copy as many layers before its gap, `count * length` ops earlier)."""
    kept, target, dropped = [], list(range(full_ops)), 0
    marks = iter(short.skipped)
    mark = next(marks, None)
    for i in range(len(short.ops)):
        while mark is not None and mark.at == i:
            first, span = i + dropped, mark.count * mark.length
            target[first:first + span] = range(first - span, first)
            dropped += span
            mark = next(marks, None)
        kept.append(i + dropped)
    return kept, target


def _frees(ops) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per op, the ops whose allocations its `free_before` and `free` release (the latest
    allocation of each tag in program order)."""
    live: dict = {}
    out = []
    for op in ops:
        before = tuple(live.pop(t) for t in op.free_before)
        live.update((a.tag, op.id) for a in op.alloc)
        out.append((before, tuple(live.pop(t) for t in op.free)))
    return out


def _assert_the_full_build_less_the_gaps(short, full):
    """Each op built is the full step's op at its place (kind, stream, phase, micro-step, payload,
    hooks, allocation sizes), and waits on and frees the allocations of the same ops, an op left
    out standing for its copy before the gap (the one built)."""
    assert short.full_ops == len(full.ops)
    kept, target = _ids(short, len(full.ops))
    new_id = {x: i for i, x in enumerate(kept)}
    short_frees, full_frees = _frees(short.ops), _frees(full.ops)

    def facts(op):
        return (op.kind, op.stream, op.phase, op.micro_step, op.payload, op.hook_visits, op.grad_hooks, op.host_views,
                [(a.category, a.size_bytes, a.touched_bytes) for a in op.alloc])
    for op, x in zip(short.ops, kept):
        f = full.ops[x]
        where = f"op {op.id} (the full step's {x})"
        assert facts(op) == facts(f), where
        assert set(op.deps) == {new_id[target[d]] for d in f.deps}, where
        assert [[kept[r] for r in rs] for rs in short_frees[op.id]] == \
            [[target[r] for r in rs] for rs in full_frees[x]], where


def _builds(sc):
    """(the schedule the builder skips layers of, the full one)."""
    _, short = build_schedule(sc, skip_layers=True)
    _, full = build_schedule(sc)
    return short, full


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("name", SKIPPED)
def test_the_skipped_schedule_is_the_full_one_less_its_gaps(name, model):
    for gas in (1, 2, 3):
        sc = scenario(**VARIANTS[name], **MODELS[model], **{"training.gradient_accumulation_steps": gas})
        short, full = _builds(sc)
        regions = {k.region for k in short.skipped}
        assert regions == {(m, d) for m in range(gas) for d in "fb"} | {(gas - 1, "s")}, f"GAS {gas}"
        _assert_the_full_build_less_the_gaps(short, full)


@pytest.mark.parametrize("name", SKIPPED)
def test_the_step_simulated_from_skipped_layers_is_the_full_step(name):
    for gas in (1, 3, 7):
        sc = scenario(**VARIANTS[name], **MODELS["gpt-32"], **{"training.gradient_accumulation_steps": gas})
        reused, trace = run_scenario(sc)
        full, full_trace = run_scenario(sc, steady=False)
        assert trace.schedule.skipped, f"GAS {gas}: the builder built every layer"
        assert trace.events_processed == len(full_trace.schedule.ops)
        equal_results(reused, full)


@pytest.mark.parametrize("sequence_parallel", (False, True))
def test_tensor_parallel_layers_are_skipped_too(sequence_parallel):
    """Megatron's tensor-parallel collectives act per module (no state across layers), so a
    ZeRO-3 + TP2 step skips its layers as well, op for op."""
    for gas in (1, 3):
        sc = scenario(**VARIANTS["stage3-full"], **MODELS["gpt-32"],
                      **{"parallelism.tensor": 2, "parallelism.sequence_parallel": sequence_parallel,
                         "training.gradient_accumulation_steps": gas})
        short, full = _builds(sc)
        assert {d for _, d in (k.region for k in short.skipped)} == {"f", "b", "s"}
        _assert_the_full_build_less_the_gaps(short, full)
        reused, trace = run_scenario(sc)
        assert trace.schedule.skipped
        equal_results(reused, run_scenario(sc, steady=False)[0])


@pytest.mark.parametrize("name", ("stage3", "stage3-full"))
def test_a_backward_whose_bucket_spans_layers_skips_whole_periods(name):
    """An IPG bucket of about 1.6 layers' gradients fills alike every 3 layers: the forward drops
    a multiple of 3 layers and the backward drops them 3 at a time, op for op."""
    model = {**MODELS["gpt-32"], "model.layers": 48, "deepspeed.zero_optimization.reduce_bucket_size": 20_000_000}
    for gas in (1, 2):
        sc = scenario(**VARIANTS[name], **model, **{"training.gradient_accumulation_steps": gas})
        short, full = _builds(sc)
        assert {(k.region[1], k.layers) for k in short.skipped} == {("f", 1), ("b", 3), ("s", 1)}
        _assert_the_full_build_less_the_gaps(short, full)
        reused, trace = run_scenario(sc)
        assert trace.schedule.skipped
        equal_results(reused, run_scenario(sc, steady=False)[0])


@pytest.mark.parametrize("name", ("stage3", "stage3-full"))
@pytest.mark.parametrize("layers, reuse", ((32, 20_000_000), (32, 80_000_000), (48, 200_000_000)))
def test_a_forward_whose_last_layers_keep_their_params_skips_the_layers_before(name, layers, reuse):
    """Under max_reuse_distance the forward's last layers keep their params for their backward,
    close enough: their visits are not alike the others' (GPT-3 175B with TP8 on 1,024 GPUs, its
    last two layers, was built whole for it). The forward's gap stays before them, as far as
    the backward needs to settle after them (48 layers: 8 not alike)."""
    model = {**MODELS["gpt-32"], "model.layers": layers,
             "deepspeed.zero_optimization.stage3_max_reuse_distance": reuse}
    seen = []
    for gas in (1, 2):
        sc = scenario(**VARIANTS[name], **model, **{"training.gradient_accumulation_steps": gas})
        short, full = _builds(sc)
        assert short.skipped, f"GAS {gas}: nothing skipped"
        _assert_the_full_build_less_the_gaps(short, full)
        reused, trace = run_scenario(sc)
        equal_results(reused, run_scenario(sc, steady=False)[0])
        seen.append(len(short.ops) < len(full.ops))
    assert all(seen)
    # the case is the one meant: the forward's visits are alike only up to its last layers
    geo = _geometry(scenario(**VARIANTS[name], **model))
    assert geo.ok and geo.alike["f"] < geo.layers and geo.alike["b"] == geo.layers


def _geometry(sc):
    """The builder's layer geometry for `sc` (layer_skip._Geometry), as stage3.build makes it."""
    made = []
    real = layer_skip.LayerSkip.__init__

    def spy(self, ctx, hooks):
        real(self, ctx, hooks)
        made.append(self.geo)
    layer_skip.LayerSkip.__init__ = spy
    try:
        build_schedule(sc, skip_layers=True)
    finally:
        layer_skip.LayerSkip.__init__ = real
    return made[0]


def test_gpt3_175b_builds_a_fraction_of_its_layers():
    sc = scenario_from_mapping({
        "name": "gpt3-175b-zero3-1024", "model": {"preset": "gpt3-175b"},
        "hardware": {"profile": "dgx-a100-80g", "nodes": 128},
        "training": {"micro_batch_size": 1, "seq_len": 2048, "precision": "bf16", "activation_checkpointing": "full"},
        "deepspeed": {"zero_optimization": {"stage": 3, "overlap_comm": True}}}, ROOT)
    _, short = build_schedule(sc, skip_layers=True)
    assert {k.region for k in short.skipped} == {(0, "f"), (0, "b"), (0, "s")}
    assert len(short.ops) < 0.2 * short.full_ops
    reused, trace = run_scenario(sc)
    full, _ = run_scenario(sc, steady=False)
    assert trace.repeat is not None and trace.repeat.layers and trace.repeat.period is None
    equal_results(reused, full)


def test_a_backward_that_does_not_repeat_gets_the_step_built_whole(monkeypatch):
    """The backward must drop its forward's layers; where its state does not repeat over them
    (forced here) the builder aborts and builds every layer, and every op is simulated."""
    sc = scenario(**VARIANTS["stage3"], **MODELS["gpt-32"])
    periodic = layer_skip.LayerSkip._periodic

    def forward_only(self, p):
        return periodic(self, p) and self._history[-1][1][0] == "f"
    monkeypatch.setattr(layer_skip.LayerSkip, "_periodic", forward_only)
    _, built = build_schedule(sc, skip_layers=True)
    _, full = build_schedule(sc)
    assert not built.skipped and built == full
    reused, trace = run_scenario(sc)
    assert trace.repeat is None and not trace.schedule.skipped
    equal_results(reused, run_scenario(sc, steady=False)[0])


def test_layers_that_do_not_run_alike_are_simulated_from_a_whole_build(monkeypatch):
    """Where a window of the skipped schedule does not repeat in time (forced here), the step is
    built whole and every op simulated."""
    import zsim.engine.layer_repeat as layer_repeat
    sc = scenario(**VARIANTS["stage3-full"], **MODELS["gpt-32"])
    expected, _ = run_scenario(sc, steady=False)
    window = layer_repeat._window
    monkeypatch.setattr(layer_repeat, "_window",
                        lambda gap, schedule, *a: None if schedule.skipped else window(gap, schedule, *a))
    reused, trace = run_scenario(sc)
    assert not trace.schedule.skipped and trace.repeat is None
    equal_results(reused, expected)


@pytest.mark.parametrize("what, device", [("optimizer", "cpu"), ("optimizer", "nvme"), ("param", "cpu")])
def test_an_optimizer_or_params_offloaded_alone_skip_layers_too(what, device):
    """ZeRO-Offload's per-bucket gradient copies (offload.grads_to_host, after each reduction)
    keep no state across layers but the bucket's last copy, which the state holds; the
    parameters' copies (offload.params_to_device) are per gather."""
    zero = "deepspeed.zero_optimization"
    for gas in (1, 3):
        sc = scenario(**VARIANTS["stage3"], **MODELS["llama-28"], **{f"{zero}.offload_{what}": {"device": device},
                                                                      "training.gradient_accumulation_steps": gas})
        short, full = _builds(sc)
        assert {d for _, d in (k.region for k in short.skipped)} == {"f", "b", "s"}
        _assert_the_full_build_less_the_gaps(short, full)
        reused, _ = run_scenario(sc)
        equal_results(reused, run_scenario(sc, steady=False)[0])


@pytest.mark.parametrize("name", ["stage2", "stage3-cpu-checkpointing"])
def test_what_the_builder_does_not_skip(name):
    """The stages below 3 and ZeRO-3 with CPU checkpointing (its copies per layer are outside
    the hooks' state) are built whole."""
    variant = (VARIANTS[name] if name in VARIANTS else
               {**VARIANTS["stage2-full-cpu-checkpointing"], "deepspeed.zero_optimization.stage": 3})
    _, built = build_schedule(scenario(**variant, **MODELS["gpt-32"]), skip_layers=True)
    assert not built.skipped




def test_random_zero3_configurations_skip_layers_exactly():
    """A fixed random sample of ZeRO-3 configurations (models, buckets, prefetch, reuse
    distance, max live, persistence, checkpointing, GAS): wherever the builder skips layers, the
    step is the step of every op. (A wider sample, 180 configurations of which 110 skipped,
    matched too when this was written.)"""
    import random
    rng = random.Random(20261127)
    zero = "deepspeed.zero_optimization"
    used = 0
    for _ in range(20):
        changes = {"model.layers": rng.choice([24, 32, 48]), "model.hidden": 256, "model.heads": 4,
                   "training.micro_batch_size": rng.choice([1, 4]), "training.seq_len": 512, "model.seq_len": 512,
                   "training.gradient_accumulation_steps": rng.choice([1, 2, 3]),
                   "training.activation_checkpointing": rng.choice(["none", "full", "selective"]),
                   f"{zero}.stage": 3, f"{zero}.overlap_comm": rng.choice([True, False]),
                   f"{zero}.contiguous_gradients": rng.choice([True, False]),
                   f"{zero}.reduce_bucket_size": rng.choice([200_000, 1_000_000, 500_000_000]),
                   f"{zero}.stage3_prefetch_bucket_size": rng.choice([0, 100_000, 1_000_000, 50_000_000]),
                   f"{zero}.stage3_max_reuse_distance": rng.choice([0, 100_000, 1_000_000_000]),
                   f"{zero}.stage3_max_live_parameters": rng.choice([1_000_000, 30_000_000, 1_000_000_000]),
                   f"{zero}.stage3_param_persistence_threshold": rng.choice([0, 1000, 100_000])}
        sc = scenario(**changes)
        reused, trace = run_scenario(sc)
        if not trace.schedule.skipped:
            continue
        used += 1
        full, full_trace = run_scenario(sc, steady=False)
        assert trace.events_processed == len(full_trace.schedule.ops), changes
        equal_results(reused, full)
    assert used >= 4
