"""The simulation's entry point: build the step, shortened where it repeats, simulate it, and let
the full step stand on what was simulated.

One idea at nested levels. A step repeats itself in time: its middle micro-steps (a pipeline's
steady 1F1B periods) are alike, and within a ZeRO-3 pass its transformer blocks are alike. So the
step is built shortened, declaring what it left out: with a few micro-steps (below), and, under
ZeRO-3, without the middle layers of each pass (the builder leaves them out as it builds: see
[Note: layers the builder skips]). The engine simulates the shortened step; each window next to
something left out is checked to run exactly as the period before it did (the engine is
deterministic and shift-invariant, so the same state gives the same window), and the trace
stands for the full step through one `Repeat` (zsim/engine/repeat.py): micro-steps
(zsim/engine/steady.py), layers (zsim/engine/layer_repeat.py), or both nested. Whatever does
not check out is simulated op by op: only speed depends on the shortcuts, never the answer.
"""
from __future__ import annotations

from zsim.engine.layer_repeat import run_layers, simulate_layers
from zsim.engine.repeat import nest
from zsim.engine.sim import Trace, collector_paused, simulate, stage_peaks
from zsim.engine.steady import find_pipeline_repeat, find_repeat
from zsim.schedule.build import build_schedule
from zsim.schedule.generate import build_generation, simulated_forwards
from zsim.specs.generation import generation_kernels
from zsim.specs.scenario import Scenario
from zsim.workload.generation import (decode_workload, deepspeed_tensor_parallel, prefill_workload,
                                     with_quantized_weights)
from zsim.workload.module import Workload

# the first, two middle micro-steps (the second repeating the first), the boundary one; one or two
# more when the first middle one is still settling from the first micro-step (a reduction of its
# shape runs into it). Under ZeRO-3 with parameters on the GPU it always is for a window opened
# by a forward (find_repeat: on every test variant four never sufficed), but a window opened by
# the backward (find_repeat's second window) has settled by then: four sufficed on every test variant.
# ZeRO-2 with its optimizer on the GPU (and the BF16_Optimizer) keeps no 16-bit .grad from one
# micro-step to the next, and its first micro-step settles before the second one's backward:
# three micro-steps (the first, one middle, the boundary) sufficed for 18 of 19 random ZeRO-2
# configurations and every such test variant, none at ZeRO-1 or with an offloaded optimizer.
# Only speed depends on this: a repeat is used only when checked exact.
SIMULATED_MICRO_STEPS = (4, 5, 6)
SHORT_SIMULATED_MICRO_STEPS = (3, 4, 5, 6)


def simulate_scenario(sc: Scenario, steady: bool = True) -> tuple[Workload, Trace]:
    """Build and simulate the step of `sc`; `steady=False` simulates every micro-step."""
    with collector_paused():
        return _simulate(sc, steady)


def _simulate(sc: Scenario, steady: bool) -> tuple[Workload, Trace]:
    gas = sc.gradient_accumulation_steps
    pipeline = sc.pipeline_stages > 1
    wl = None
    spent = 0   # micro-steps simulated in attempts: never more than the full step's
    # Megatron's interleaved schedule runs micro-batches in groups of `pipeline` through every
    # chunk: its period is a group of micro-steps, 1F1B's one micro-step
    stride = sc.pipeline_stages if sc.parallelism.virtual_stages > 1 else 1
    settles_early = ((sc.zero.stage == 2 or sc.deepspeed.uses_bf16_optimizer)
                     and sc.zero.optimizer_offload_device == "none")
    attempts = (_pipeline_micro_steps(sc.pipeline_stages, stride) if pipeline
                else SHORT_SIMULATED_MICRO_STEPS if settles_early else SIMULATED_MICRO_STEPS)
    for micro_steps in attempts if steady else ():
        spent += micro_steps
        if gas <= micro_steps or spent > gas:
            break
        wl, reduced = build_schedule(sc, wl, micro_steps=micro_steps, skip_layers=not pipeline)
        # the layers the builder left out stand on the windows simulated (layer_repeat.py)
        out = run_layers(reduced, sc.cluster, sc.precision)
        if out is None:     # they did not run alike: every layer built
            wl, reduced = build_schedule(sc, wl, micro_steps=micro_steps)
            out = run_layers(reduced, sc.cluster, sc.precision)
            assert out is not None    # nothing left out to disagree
        timings, ledgers, layers = out
        events = tuple(ledger.events() for ledger in ledgers)
        period = (find_pipeline_repeat(reduced, timings, events, micro_steps, gas, stride) if pipeline
                  else find_repeat(reduced, timings, events, micro_steps, gas))
        repeat = None if period is None else nest(period, layers or ())
        if repeat is not None:
            end = repeat.shift_s(max(t.end_s for t in timings))
            ops = repeat.step_ops(reduced.full_ops)
            if not pipeline:
                return wl, Trace(reduced, tuple(timings), events[0], end, ops, repeat)
            peaks, worst = stage_peaks(events)
            return wl, Trace(reduced, tuple(timings), events[worst], end, ops, repeat,
                             stage_ledger_events=events, worst_stage=worst, stage_peaks_bytes=peaks)
    wl, schedule = build_schedule(sc, wl, skip_layers=steady and not pipeline)
    if schedule.skipped:   # the layers left out stand on the windows simulated (layer_repeat.py)
        trace = simulate_layers(schedule, sc.cluster, sc.precision)
        if trace is not None:
            return wl, trace
        wl, schedule = build_schedule(sc, wl)    # they did not run alike: every layer built
    return wl, simulate(schedule, sc.cluster, sc.precision)


def _pipeline_micro_steps(stages: int, stride: int) -> tuple[int, ...]:
    """A pipeline of `stages` stages settles into its 1F1B period a micro-step after the last
    stage's first backward (stage 0 then runs one forward and one backward per period), one
    later where the first micro-step's backwards are shorter than the others (ZeRO-0/1 create
    the .grads there that later micro-steps add into: see [Note: gradient accumulation add]):
    the shortened step runs stages + 4 micro-steps, so that the window (stage 0's forward of
    micro-step stages + 2 to that of stages + 3) and the period before it are both steady
    (stages + 3 held on every 1F1B variant tried before the add, PP 2-8, checkpointing,
    ZeRO-0/1, TP, fp16/bf16, 144 cases; with it PP 2 and 4 need stages + 4), and a step that
    has not settled falls back to 2 x stages + 4. The interleaved schedule's
    period is a group of `stride` (= stages) micro-steps: rank 0 warms up for
    2 (p - 1) + (v - 1) p of its p v forwards per group (get_pp_rank_microbatches) and runs its
    first backward of chunk 0 (the last chunk's to start its gradients) (v - 1) p backwards
    later, in its second group of forwards; the period before the window starts in the third
    group, the window ends at the fifth's first forward (five groups), or two groups later."""
    if stride > 1:
        return (5 * stride, 7 * stride)
    return (stages + 4, 2 * stages + 4)


def simulate_generation(sc: Scenario, head: str = "lm", all_logits: bool = False,
                        trained_engine: bool = False) -> tuple[Workload, Trace, tuple[int, ...]]:
    """Build and simulate the scenario's generate() call (sc.inference): the decode step's
    workload, the trace, and the forwards it simulated (0: the prefill; see [Note: generation]).
    `head` and `all_logits`: a one-token "generation" that is a PPO experience's forward
    (workload.generation.prefill_workload); `trained_engine`: the engine has a ZeRO-3 optimizer
    (generate.build_generation)."""
    gen = sc.inference
    assert gen is not None, "not an inference scenario"
    attn, kernels = generation_kernels(gen, sc.training)
    prefill = prefill_workload(sc.model, gen.batch_size, gen.prompt_len, sc.precision, attn, kernels,
                               gen.tensor_parallel, head, all_logits)
    decode = decode_workload(sc.model, gen.batch_size, sc.precision, attn, kernels, gen.tensor_parallel)
    prefill = deepspeed_tensor_parallel(prefill, sc.model, gen.tensor_parallel, gen.kernel_inject)
    decode = deepspeed_tensor_parallel(decode, sc.model, gen.tensor_parallel, gen.kernel_inject)
    if gen.weight_bits < 16:   # see [Note: ZeRO-Inference quantized weights]
        fp16 = sc.precision == "fp16"
        prefill = with_quantized_weights(prefill, gen.weight_bits, gen.weight_group_size, fp16)
        decode = with_quantized_weights(decode, gen.weight_bits, gen.weight_group_size, fp16)
    forwards = simulated_forwards(gen.new_tokens)
    with collector_paused():
        return decode, simulate(build_generation(sc, prefill, decode, forwards, trained_engine), sc.cluster,
                                sc.precision), forwards
