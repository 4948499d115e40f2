"""The OOM doctor: why a scenario does not fit, and which changes make it fit, cheapest first.

`diagnose` names the components above capacity and the moment of the peak (from the ledger).
`playbook` lists the changes an expert tries, each as scenario overrides (the same dotted `--set`
assignments `zsim run` takes, so every fix is printable and re-applicable):
  smaller micro-batch with more accumulation (same global batch); activation checkpointing
  (selective, full, full + cpu_checkpointing); a higher ZeRO stage; optimizer offload; parameter
  offload; a larger expert-parallel size (DeepSpeed-MoE); smaller buckets / prefetch /
  max_live_parameters; 16-bit precision; when fewer than
  MIN_FITTING of those fit, other tensor x pipeline x data-parallel layouts that zsim tune's
  search finds fitting (`layout_fixes`).
`doctor` simulates every candidate (and pairs of them when too few fit alone) and returns those
that fit on the GPU and on the host, ranked by throughput. It is a pure function of the raw
scenario mapping (a `Base`), and runs its candidates through the shared variant runner.
"""
from __future__ import annotations

import itertools
from pathlib import Path

from zsim.config.scenario import parse_value
from zsim.engine.sim import Trace
from zsim.result import Result
from zsim.search.variants import Base, Variant
from zsim.specs.scenario import Scenario

MIN_FITTING = 3
LAYOUT_BUDGET = 11     # simulations of zsim tune's search spent on other TP x PP layouts
LAYOUT_FIXES = 3


def _peak_event(trace: Trace) -> tuple[int, int]:
    """(index in trace.ledger_events, layer copies later) of the allocation the result's peak is
    at. [Note: peak of a shortened step] A step simulated shortened (trace.repeat: repeated
    micro-steps or layers) peaks where the repeat's peak_and_breakdown says, on the full step's
    clock: a layer window that grows memory peaks in its last copy, after the simulated events'
    own highest point (what was named before: a different op, or the right op for the wrong
    bytes). The event is found by that time: the simulated event shifted onto it (the running
    total's first highest there), or a growing window's highest event plus its skipped copies."""
    events = trace.ledger_events
    totals = list(itertools.accumulate(e[1] for e in events))

    def first_highest(indices) -> int:
        return max(indices, key=lambda i: (totals[i], -i))

    rep = trace.repeat
    if rep is None:
        return (first_highest(range(len(events))), 0) if events else (-1, 0)
    _, peak_t, _ = rep.peak_and_breakdown(events)
    at = [i for i, e in enumerate(events) if rep.shift_s(e[0]) == peak_t]
    if at:
        return first_highest(at), 0
    for w in rep.layers:
        inside = [i for i, e in enumerate(events) if w.start_s <= e[0] < w.end_s]
        if inside and rep.shift_s(events[first_highest(inside)][0]) + w.skipped_s == peak_t:
            return first_highest(inside), (w.copies - 1) * w.layers
    return (first_highest(range(len(events))), 0) if events else (-1, 0)


def _op_at_peak(trace: Trace) -> dict:
    """The op whose allocation reaches the peak the result reports (see [Note: peak of a
    shortened step]; the only reader of op fields here: alloc tags, name, phase, micro_step)."""
    index, later = _peak_event(trace)
    if index < 0:
        return {"op": "model states (allocated before the step)", "phase": "static", "micro_step": 0}
    time_s, _, _, tag = trace.ledger_events[index]
    start = {t.op_id: t.start_s for t in trace.timings}
    for op in trace.schedule.ops:
        # a pipeline's ledger_events are the worst stage's (tags repeat across stages); an op
        # allocates at its start: the one of this tag that started at the event's time
        if op.pipe_stage == trace.worst_stage and start.get(op.id) == time_s and any(a.tag == tag for a in op.alloc):
            where: dict = {"op": op.name, "phase": op.phase.value, "micro_step": op.micro_step}
            if later:
                where["op"] += f" ({later} layers later: the last copy of a repeated layer window)"
            return where
    for op in trace.schedule.ops:   # (timings that do not give the start: the tag alone)
        if op.pipe_stage == trace.worst_stage and any(a.tag == tag for a in op.alloc):
            return {"op": op.name, "phase": op.phase.value, "micro_step": op.micro_step}
    return {"op": "model states (allocated before the step)", "phase": "static", "micro_step": 0}


def diagnose(result: Result, trace: Trace) -> dict:
    """Where the peak is, what it is made of, and by how much it misses the capacity."""
    mem = result.memory
    over = mem.peak_bytes - mem.capacity_bytes
    comps = sorted(mem.breakdown.items(), key=lambda kv: -kv[1])
    # the components that, largest first, make up at least the overflow
    pushing, acc = [], 0.0
    for k, v in comps:
        if over <= 0 or acc >= over:
            break
        pushing.append(k)
        acc += v
    host = mem.host
    return {"fits": mem.fits, "host_fits": host.fits, "over_bytes": over,
            "over_fraction": over / mem.capacity_bytes, "peak_bytes": mem.peak_bytes,
            "capacity_bytes": mem.capacity_bytes, "peak_time_s": mem.peak_time_s, "at": _op_at_peak(trace),
            "components": dict(comps), "pushing_over": pushing,
            "host_over_bytes": host.bytes_per_node - host.capacity_bytes}


def _batch_candidates(raw: dict, sc: Scenario) -> list[Variant]:
    mb, gas = sc.micro_batch_size, sc.gradient_accumulation_steps
    per_rank = mb * gas
    training = raw.get("training") or {}
    out = []
    for new_mb in sorted((d for d in range(1, mb) if per_rank % d == 0), reverse=True):
        new_gas = per_rank // new_mb
        sets = [f"deepspeed.train_micro_batch_size_per_gpu={new_mb}", f"deepspeed.gradient_accumulation_steps={new_gas}",
                f"deepspeed.train_batch_size={sc.global_batch_size}"]
        if training.get("micro_batch_size") is not None:
            sets.append(f"training.micro_batch_size={new_mb}")
        if training.get("gradient_accumulation_steps") is not None:
            sets.append(f"training.gradient_accumulation_steps={new_gas}")
        out.append(Variant(f"micro-batch {new_mb} x GAS {new_gas} (same global batch)", tuple(sets)))
    return out


def _tiles_help(sc: Scenario) -> bool:
    """A long sequence (zsim tune's Ulysses threshold) whose dense MLPs are not tiled yet: see
    [Note: tiled MLP]."""
    from zsim.search.tune import LONG_SEQUENCE
    tr, m = sc.training, sc.model
    return (not tr.tiled_mlp and sc.seq_len >= LONG_SEQUENCE and tr.lora is None and tr.quantization == "none"
            and sc.tensor_parallel_size == 1 and sc.pipeline_stages == 1
            and m.has_dense_mlp)


def _logits_weigh(sc: Scenario) -> bool:
    """The loss's fp32 log-softmax output (4 B per logit, what the HF loss keeps: see [Note: HF loss
    memory]) is a tenth of the GPU or more, and Liger's fused linear cross-entropy could replace it."""
    tr = sc.training
    if tr.fused_linear_cross_entropy or tr.preference is not None or sc.tensor_parallel_size > 1:
        return False
    logits = sc.micro_batch_size * sc.seq_len // sc.sequence_parallel_size * sc.model.vocab * 4
    return logits >= 0.1 * sc.cluster.hbm_capacity_bytes


def _ulysses_candidates(raw: dict, sc: Scenario) -> list[Variant]:
    """DeepSpeed-Ulysses for a long sequence (zsim tune's sizes, inside a node first, at most
    three): each rank holds 1/u of every sequence, so its activations shrink by u; the global
    batch is kept by u times the GAS (the batch divides by world / u)."""
    from zsim.search.tune import _sequence_sizes
    if sc.tensor_parallel_size > 1 or sc.pipeline_stages > 1 or sc.expert_parallel_size > 1:
        return []
    sizes = [u for u in _sequence_sizes(sc) if u > sc.sequence_parallel_size
             and u % sc.sequence_parallel_size == 0 and u <= sc.cluster.gpus_per_node][:3]
    training = raw.get("training") or {}
    out = []
    for u in sizes:
        gas = sc.gradient_accumulation_steps * u // sc.sequence_parallel_size
        sets = [f"parallelism.sequence={u}", f"deepspeed.sequence_parallel_size={u}",
                f"deepspeed.gradient_accumulation_steps={gas}", f"deepspeed.train_batch_size={sc.global_batch_size}"]
        if training.get("gradient_accumulation_steps") is not None:
            sets.append(f"training.gradient_accumulation_steps={gas}")
        out.append(Variant(f"Ulysses sequence parallel {u} (DeepSpeed-Ulysses / ALST: 1/{u} of each sequence a "
                           f"rank; GAS {gas} keeps the global batch)", tuple(sets)))
    return out


def playbook(raw: dict, sc: Scenario) -> list[Variant]:
    """Single changes an expert would try, in a fixed order (micro-batch candidates largest first)."""
    z, tr = sc.zero, sc.training
    out: list[Variant] = []
    if tr.activation_checkpointing == "none" and not tr.flash_attention:
        # with FlashAttention nothing s^2-sized is stored, so selective recompute frees nothing
        out.append(Variant("selective activation checkpointing", ("training.activation_checkpointing=selective",)))
    if tr.activation_checkpointing != "full":
        out.append(Variant("full activation checkpointing", ("training.activation_checkpointing=full",)))
    if not sc.deepspeed.activation_checkpointing.cpu_checkpointing:
        out.append(Variant("full activation checkpointing, checkpoints in CPU memory",
                             ("training.activation_checkpointing=full",
                              "deepspeed.activation_checkpointing.cpu_checkpointing=true")))
    pp = sc.pipeline_stages
    # DeepSpeed's PipelineEngine refuses ZeRO-2/3 (pipe/engine.py:76): a pipeline's remedies stay at
    # ZeRO-1 and add stages instead
    top_stage = 1 if pp > 1 else 3
    for stage in range(z.stage + 1, top_stage + 1):
        out.append(Variant(f"ZeRO stage {stage}", (f"deepspeed.zero_optimization.stage={stage}",)))
    if pp > 1 and sc.cluster.world_size % (2 * pp) == 0 and 2 * pp <= sc.model.layers:
        out.append(Variant(f"{2 * pp} pipeline stages", (f"parallelism.pipeline={2 * pp}",)))
    moe = sc.model.moe
    if moe is not None and moe.dispatch == "capacity":
        # DeepSpeed-MoE: a larger ep_size splits each MoE layer's experts over more ranks, each
        # holding fewer (ep_size divides the data-parallel size and the experts: _check_expert)
        dp = sc.data_parallel_size
        for ep in [e for e in range(sc.expert_parallel_size + 1, dp + 1)
                   if dp % e == 0 and moe.experts % e == 0][:3]:
            out.append(Variant(f"expert parallel size {ep} (DeepSpeed-MoE ep_size, {moe.experts // ep} experts a rank)",
                               (f"parallelism.expert={ep}",)))
    out += _ulysses_candidates(raw, sc)
    if _tiles_help(sc):
        out.append(Variant("ALST's tiled MLP (each MLP over sequence tiles, recomputed tile by tile)",
                           ("training.tiled_mlp=true",)))
    if _logits_weigh(sc):
        # see [Note: fused linear cross-entropy]
        out.append(Variant("Liger's fused linear cross-entropy (lm_head and the loss in chunks: the logits never "
                           "whole)", ("training.fused_linear_cross_entropy=true",
                                                "training.fused_cross_entropy=false")))
    if z.optimizer_offload_device == "none":
        sets: tuple[str, ...] = ("deepspeed.zero_optimization.offload_optimizer.device=cpu",
                "deepspeed.zero_optimization.offload_optimizer.pin_memory=true")
        offload_stage = 2 if pp == 1 else 1
        if z.stage == 0:
            sets = (f"deepspeed.zero_optimization.stage={offload_stage}",) + sets
        out.append(Variant("optimizer offload to CPU" + (f" (ZeRO-{offload_stage})" if z.stage == 0 else ""), sets))
    if z.param_offload_device == "none" and pp == 1:
        sets = ("deepspeed.zero_optimization.offload_param.device=cpu",
                "deepspeed.zero_optimization.offload_param.pin_memory=true")
        if z.optimizer_offload_device == "none":
            sets += ("deepspeed.zero_optimization.offload_optimizer.device=cpu",
                     "deepspeed.zero_optimization.offload_optimizer.pin_memory=true")
        if z.stage != 3:
            sets = ("deepspeed.zero_optimization.stage=3",) + sets
        out.append(Variant("parameter + optimizer offload to CPU (ZeRO-Infinity, stage 3)", sets))
    cl = sc.cluster
    if (z.stage == 3 and cl.nodes > 1 and cl.gpus_per_node > 1 and z.zero_hpz_partition_size <= 1
            and z.param_offload_device == "none"):
        # ZeRO++ hpZ: later gathers inside the node, for a secondary partition of every released
        # param (see [Note: hpZ secondary partitions])
        out.append(Variant(f"ZeRO++ hpZ over each node (zero_hpz_partition_size {cl.gpus_per_node})",
                           (f"deepspeed.zero_optimization.zero_hpz_partition_size={cl.gpus_per_node}",)))
    if z.stage == 3 and cl.nodes > 1 and not z.zero_quantized_weights:
        # qwZ: int8 gathers with fp32 scales (see [Note: qwZ quantized gathers])
        out.append(Variant("ZeRO++ qwZ (zero_quantized_weights: int8 parameter gathers)",
                           ("deepspeed.zero_optimization.zero_quantized_weights=true",)))
    if z.stage == 3 and cl.nodes > 1 and z.reduce_scatter and not z.zero_quantized_gradients:
        # qgZ: int4 all-to-alls within and across the nodes (see [Note: qgZ quantized gradient reduction])
        out.append(Variant("ZeRO++ qgZ (zero_quantized_gradients: int4 gradient all-to-alls)",
                           ("deepspeed.zero_optimization.zero_quantized_gradients=true",)))
    if z.stage >= 1:
        small = max(int(z.reduce_bucket_size // 4), 1)
        if small < z.reduce_bucket_size:
            out.append(Variant(f"reduce_bucket_size {small:.3g}", (f"deepspeed.zero_optimization.reduce_bucket_size={small}",)))
    if z.stage == 3:
        pf = int(z.prefetch_bucket_size // 4)
        live = int(z.max_live_parameters // 4)
        out.append(Variant(f"stage3_prefetch_bucket_size {pf:.3g}, stage3_max_live_parameters {live:.3g}, "
                             "stage3_max_reuse_distance 0",
                             (f"deepspeed.zero_optimization.stage3_prefetch_bucket_size={pf}",
                              f"deepspeed.zero_optimization.stage3_max_live_parameters={live}",
                              "deepspeed.zero_optimization.stage3_max_reuse_distance=0")))
    if tr.preference is not None and tr.preference.runs_reference:
        # TRL DPOConfig precompute_ref_log_probs: the reference runs once over the data before
        # training, and the step reads its log-probs (no reference forward, no reference copy)
        out.append(Variant("reference log-probs precomputed (TRL precompute_ref_log_probs: one pass over the data "
                           "before training, not in the step)", ("training.preference.reference=false",)))
    if sc.precision == "fp32":
        gpu = sc.cluster.profile.gpu
        half = "bf16" if gpu.peak_tflops_bf16 > gpu.peak_tflops_fp32 else "fp16"
        out.append(Variant(f"{half} mixed precision", (f"training.precision={half}", f"deepspeed.{half}.enabled=true")))
    out.extend(_batch_candidates(raw, sc))
    return out


def evaluate(base: Base, cand: Variant, baseline: Result) -> dict:
    """Simulate one candidate: a row of the doctor's report (its keys are the JSON schema)."""
    out = base.run(cand)
    r = out.result
    if r is None:
        return {"name": cand.name, "overrides": list(cand.assignments), "valid": False, "error": out.error}
    mem = r.memory
    return {"name": cand.name, "overrides": list(cand.assignments), "valid": True, "fits": r.fits,
            "gpu_fits": mem.fits, "host_fits": mem.host.fits,
            "step_time_s": r.step_time_s, "tokens_per_s": r.tokens_per_s, "mfu": r.mfu,
            "peak_bytes": mem.peak_bytes, "capacity_bytes": mem.capacity_bytes,
            "host_bytes_per_node": mem.host.bytes_per_node,
            "throughput_change": r.tokens_per_s / baseline.tokens_per_s - 1.0,
            "ds_config_change": ds_config_change(cand.assignments)}


def _memory_bound(base: Base, cand: Variant) -> float | None:
    """The candidate's memory lower bound (zsim.search.tune.memory_lower_bound) where it exceeds
    the GPU's capacity, else None (it may fit, or it is invalid: `evaluate` says which)."""
    from zsim.errors import ZsimInputError
    from zsim.search.tune import memory_lower_bound
    try:
        sc = base.resolve(cand)[0]
    except ZsimInputError:
        return None
    bound = memory_lower_bound(sc)
    return bound if bound > sc.cluster.hbm_capacity_bytes else None


def _bounded_row(cand: Variant, bound_bytes: float, sc: Scenario) -> dict:
    """A row of the report for a candidate ruled out unsimulated by its memory lower bound."""
    return {"name": cand.name, "overrides": list(cand.assignments), "valid": True, "fits": False,
            "gpu_fits": False, "simulated": False, "memory_lower_bound_bytes": bound_bytes,
            "capacity_bytes": sc.cluster.hbm_capacity_bytes, "ds_config_change": ds_config_change(cand.assignments)}


def ds_config_change(overrides) -> dict:
    """The overrides as a nested mapping, split into the ds_config part and the scenario part."""
    out: dict = {}
    for o in overrides:
        key, value = o.split("=", 1)
        node = out
        parts = key.split(".")
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        node[parts[-1]] = _plain_number(parse_value(value))
    return out


def _plain_number(value):
    """5e7 as the number DeepSpeed's config takes (YAML 1.1 reads it as a string), whole numbers
    as integers (DeepSpeed's bucket and threshold keys are ints)."""
    from zsim.schema import SCIENTIFIC
    if isinstance(value, str) and SCIENTIFIC.match(value.strip()):
        value = float(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 63:
        return int(value)
    return value


def doctor(base: Base, max_pairs: int = 40) -> dict:
    sc = base.scenario(())
    singles = playbook(base.raw, sc)
    base.prefetch(singles)    # simulated on the workers while the baseline runs here
    _, baseline, trace = base.simulate(scenario=sc)
    report: dict = {"scenario": sc.name, "baseline": {"fits": baseline.fits, "step_time_s": baseline.step_time_s,
                                                "tokens_per_s": baseline.tokens_per_s},
              "diagnosis": diagnose(baseline, trace)}
    evaluated = [evaluate(base, c, baseline) for c in singles]
    # micro-batch candidates: keep the largest micro-batch that fits (smaller ones are only slower)
    evaluated = _prune_batches(evaluated)
    fitting = [e for e in evaluated if e["valid"] and e["fits"]]
    if len(fitting) < MIN_FITTING:
        by_name = {c.name: c for c in singles}
        # pair the changes that saved the most memory; skip pairs whose parts already fit alone
        helpful = sorted((e for e in evaluated if e["valid"] and not e["fits"]), key=lambda e: e["peak_bytes"])
        names = [e["name"] for e in helpful]
        pairs = [by_name[a] + by_name[b] for a, b in itertools.combinations(names, 2)
                 if not (a.startswith("micro-batch") and b.startswith("micro-batch"))]
        # a pair whose second change sets only keys the first already sets is the first again
        # (offload to CPU at ZeRO-1 + ZeRO stage 1): not simulated twice
        singles_of = {frozenset(c.assignments) for c in singles}
        pairs = [p for p in pairs if frozenset(p.assignments) not in singles_of][:max_pairs]
        # a pair whose memory lower bound (zsim tune's, no simulation) is over the capacity cannot
        # fit: it is not simulated (each costs a whole step, seconds for a large MoE)
        bounds = {p.assignments: _memory_bound(base, p) for p in pairs}
        base.prefetch([p for p in pairs if bounds[p.assignments] is None])
        evaluated += [_bounded_row(cand, bound, sc) if (bound := bounds[cand.assignments]) is not None
                      else evaluate(base, cand, baseline) for cand in pairs]
        evaluated = _prune_batches(evaluated)
        fitting = [e for e in evaluated if e["valid"] and e["fits"]]
    if len(fitting) < MIN_FITTING:
        evaluated += [evaluate(base, c, baseline) for c in layout_fixes(base, sc)]
        fitting = [e for e in evaluated if e["valid"] and e["fits"]]
    fitting.sort(key=lambda e: (-e["tokens_per_s"], len(e["overrides"]), e["name"]))
    report["fixes"] = fitting
    report["tried"] = evaluated
    return report


def layout_fixes(base: Base, sc: Scenario) -> list[Variant]:
    """Other tensor x pipeline x data-parallel layouts that fit, found by zsim tune's search
    (its layouts, memory bound and evaluator) within LAYOUT_BUDGET simulations, best first: each
    with the stage, micro-batch x GAS at the same global batch and checkpointing tune chose."""
    from zsim.search.tune import make_space, tune
    out: list[Variant] = []
    # only the layouts the run's framework can use (see [Note: framework search space])
    space = make_space((), sc.training.framework)
    # keep=None: the step-time bound protects the best few points overall, not each layout's best
    for c, _ in tune(base, budget=LAYOUT_BUDGET, other_layouts=True, keep=None, space=space).ranked:
        if any(v.name.startswith(_layout_name(sc, c.layout)) for v in out):
            continue
        out.append(Variant(f"{_layout_name(sc, c.layout)}: {c.variant.name}", c.assignments()))
        if len(out) == LAYOUT_FIXES:
            break
    return out


def _layout_name(sc: Scenario, layout) -> str:
    sp = " (sequence parallel)" if layout.sequence_parallel else ""
    ep = f" (EP {layout.expert})" if layout.expert > 1 else ""
    ulysses = f" x Ulysses SP {layout.sequence}" if layout.sequence > 1 else ""
    return (f"layout TP {layout.tensor}{sp} x PP {layout.pipeline}{ep}{ulysses} x DP "
            f"{sc.cluster.world_size // layout.sample_parallel}")


def _prune_batches(evaluated: list[dict]) -> list[dict]:
    """Among candidates that differ only in micro-batch size, keep the fitting one with the largest
    micro-batch, and drop the smaller ones (same memory class, lower throughput)."""
    groups: dict[str, list[dict]] = {}
    for e in evaluated:
        rest = tuple(o for o in e["overrides"] if "micro_batch" not in o and "gradient_accumulation" not in o
                     and "train_batch_size" not in o)
        if len(rest) != len(e["overrides"]):
            groups.setdefault(str(rest), []).append(e)
    drop: set = set()
    for members in groups.values():
        fit = [m for m in members if m["valid"] and m["fits"]]
        if fit:
            best = max(fit, key=lambda m: m["tokens_per_s"])
            drop.update(id(m) for m in fit if m is not best)
    return [e for e in evaluated if id(e) not in drop]


def doctor_file(path: str | Path, overrides=(), workers: int = 1) -> dict:
    """`workers` > 1 simulates the candidates on that many processes (the report is the same)."""
    base = Base.load(path, tuple(overrides), workers=workers)
    try:
        return doctor(base)
    finally:
        base.close()
