"""zsim memory: model-state memory as DeepSpeed's estimators compute it, and how zsim's fuller
accounting of the same scenario differs.

- `zsim memory scenario.yaml --like-deepspeed`: the rows estimate_zero{2,3}_model_states_mem_needs_all_live
  prints for the scenario's model and cluster (byte-exact, zsim/report/memory_estimate.py).
- `zsim memory --like-deepspeed --total-params N [--largest-layer-params N]`: the all_cold rows.
- `zsim memory scenario.yaml`: zsim's simulated peak (GPU and host) beside the estimator row for
  the scenario's own offload settings, component by component, with why each differs.
"""
from __future__ import annotations

from zsim.commands.common import add_scenario_args, scenario_overrides
from zsim.errors import ZsimInputError
from zsim.schema import _number
from zsim.units import GiB


def add_parser(sub):
    p = sub.add_parser("memory", help="memory per GPU/node: DeepSpeed's estimator figures and zsim's full accounting")
    add_scenario_args(p, cluster_flags=False)
    p.add_argument("--like-deepspeed", action="store_true",
                   help="print exactly what DeepSpeed's estimate_zero{2,3}_model_states_mem_needs_all_* print")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="estimator stage (default: the scenario's)")
    p.add_argument("--total-params", type=_count, help="cold mode: total parameters, e.g. 7e9 (no scenario model needed)")
    p.add_argument("--largest-layer-params", type=_count,
                   help="cold mode: largest layer's parameters (DeepSpeed's ZeRO-3 estimator needs it)")
    p.add_argument("--gpus-per-node", type=int, help="default: the scenario's")
    p.add_argument("--nodes", type=int, help="default: the scenario's")
    p.add_argument("--buffer-factor", type=float, default=1.5, help="additional_buffer_factor (DeepSpeed default 1.5)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.set_defaults(func=main)


def _count(text: str) -> int:
    """A parameter count as DeepSpeed users write it: 7000000000, 7e9 or 7_000_000_000."""
    import argparse
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 7e9)") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of parameters")
    return int(value)


def _positive(name: str, value):
    if value is not None:
        value = _number(value, name, want_int=isinstance(value, int))   # finite, within 2**63
        if value <= 0:
            raise ZsimInputError(name, value, "must be greater than 0")


def estimator_report(args) -> dict:
    from zsim.config.scenario import load_scenario
    from zsim.search.variants import training_only
    from zsim.report.memory_estimate import deepspeed_rows, params_like_deepspeed
    from zsim.schedule.build import workload_for

    for name in ("total_params", "gpus_per_node", "nodes", "buffer_factor"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    if args.largest_layer_params is not None:
        _number(args.largest_layer_params, "--largest-layer-params", want_int=True)
        if args.largest_layer_params < 0:
            raise ZsimInputError("--largest-layer-params", args.largest_layer_params, "must be 0 or more")
    sc = None
    if args.total_params is None or args.gpus_per_node is None or args.nodes is None or args.stage is None:
        sc = load_scenario(args.scenario, scenario_overrides(args))
        training_only(sc, "zsim memory estimates a training step's memory")

    def scenario():
        assert sc is not None    # loaded above whenever a flag leaves a figure to it
        return sc
    if args.total_params is not None:
        total, largest, mode = args.total_params, args.largest_layer_params, "cold"
        stage_now = args.stage if args.stage is not None else scenario().zero.stage
        if largest is None and stage_now == 3:
            # estimate_zero3_model_states_mem_needs_all_cold(total_params, largest_layer_params, ...):
            # the largest layer's gathered 16-bit copy is part of the ZeRO-3 row
            raise ZsimInputError("--largest-layer-params", None, "DeepSpeed's ZeRO-3 estimator needs the largest "
                                 "layer's parameter count; give --largest-layer-params N")
        largest = largest or 0
    else:
        total, largest = params_like_deepspeed(workload_for(scenario()))
        mode = "live"
    gpn = args.gpus_per_node or scenario().cluster.gpus_per_node
    nodes = args.nodes or scenario().cluster.nodes
    stage = args.stage if args.stage is not None else scenario().zero.stage
    rows = deepspeed_rows(stage, total, largest, gpn, nodes, args.buffer_factor)
    rep = {"mode": mode, "estimator": "zero3" if stage == 3 else "zero2", "total_params": total,
           "largest_layer_params": largest, "num_gpus_per_node": gpn, "num_nodes": nodes,
           "additional_buffer_factor": args.buffer_factor, "rows": rows}
    frozen = _frozen_note(sc) if mode == "live" else None
    if frozen:
        rep["notes"] = [frozen]
    return rep


def _frozen_note(sc) -> str | None:
    """DeepSpeed's estimator counts every parameter as trained (stage3.py model_to_params sums
    model.parameters(), requires_grad or not); said when the scenario freezes some."""
    from zsim.schedule.build import workload_for

    from zsim.workload.lora import trainable_params
    from zsim.workload.preference import reference_params

    wl = workload_for(sc)
    trained = trainable_params(wl)
    reference = reference_params(wl)
    model = wl.n_params - reference
    ref = (f"the preference run's {reference / 1e6:.0f}M-param reference copy is another engine: DeepSpeed's "
           "estimate leaves it out, zsim's ledger holds its 16-bit weights (at stage 3, their partition)"
           if reference else "")
    if trained == model:
        return (ref[0].upper() + ref[1:]) if ref else None
    return (f"DeepSpeed's estimator ignores frozen parameters: it charges gradients and optimizer states for all "
            f"{model / 1e6:.0f}M params, of which {trained / 1e6:.2f}M are trained (training.lora / "
            f"training.frozen / training.freeze); `zsim memory` without --like-deepspeed simulates the frozen ones{'; ' + ref if ref else ''}")


def print_like_deepspeed(rep: dict):
    """Same layout as DeepSpeed's *_all_cold printout (stage_1_and_2.py:4095-4107, stage3.py:4125-4150)."""
    n, g = rep["num_nodes"], rep["num_gpus_per_node"]
    print("Estimated memory needed for params, optim states and gradients for a:\n"
          f"HW: Setup with {n} {'nodes' if n > 1 else 'node'}, {g} {'GPUs' if g > 1 else 'GPU'} per node.")
    line = f"SW: Model with {int(rep['total_params'] / 1e6)}M total params"
    if rep["estimator"] == "zero3":
        line += f", {int(rep['largest_layer_params'] / 1e6)}M largest layer params"
    print(line + ".")
    print("  per CPU  |  per GPU |   Options")
    for r in rep["rows"]:
        opts = []
        if "offload_param" in r:
            opts.append(f"offload_param={'cpu ' if r['offload_param'] == 'cpu' else 'none'}")
        opts.append(f"offload_optimizer={'cpu ' if r['offload_optimizer'] == 'cpu' else 'none'}")
        if "zero_init" in r:
            opts.append(f"zero_init={1 if r['zero_init'] else 0}")
        print(f" {r['cpu_bytes'] / GiB:7.2f}GB | {r['gpu_bytes'] / GiB:6.2f}GB | {', '.join(opts)}")
    for note in rep.get("notes", ()):
        print(f"note: {note}")


def compare_report(args) -> dict:
    """zsim's simulated peak next to the estimator row for the scenario's settings."""
    from zsim.api import run_scenario
    from zsim.config.scenario import load_scenario
    from zsim.search.variants import training_only
    from zsim.report.memory_estimate import DIFFERENCES, deepspeed_rows, matching_row, params_like_deepspeed
    from zsim.schedule.build import workload_for

    sc = load_scenario(args.scenario, scenario_overrides(args))
    training_only(sc, "zsim memory estimates a training step's memory")
    result, _ = run_scenario(sc)
    wl, gpn, nodes = workload_for(sc), sc.cluster.gpus_per_node, sc.cluster.nodes
    pp = result.pipeline
    from zsim.hardware.placement import group_shape

    if pp is not None:
        # a pipeline stage is a ZeRO run of its own slice over its data-parallel group
        from zsim.schedule.pipe_partition import chunk_slices, stage_slices

        if pp.virtual_stages is None:
            wl = stage_slices(wl, pp.stages, pp.partition_method)[pp.worst_stage][0]
        else:   # Megatron's interleaved schedule: the stage's model chunks together
            wl = chunk_slices(wl, pp.stages, pp.virtual_stages)[pp.worst_stage][0]
        nodes, gpn = group_shape(None, pp.worst_stage, pp.data_parallel, gpn, sc.tensor_parallel_size)
    elif sc.tensor_parallel_size > 1:
        # a tensor-parallel rank is a ZeRO run of its 1/tp slice over its data-parallel group
        nodes, gpn = group_shape(None, 0, sc.data_parallel_size, gpn, sc.tensor_parallel_size)
    total, largest = params_like_deepspeed(wl)
    z = sc.zero
    rows = deepspeed_rows(z.stage, total, largest, gpn, nodes, args.buffer_factor)
    row = matching_row(rows, z.optimizer_offload_device, z.param_offload_device)
    mem = result.memory
    model_state_keys = ("parameters", "gradients", "optimizer states")
    zsim_states = sum(v for k, v in mem.breakdown.items() if k in model_state_keys)
    others = {k: v for k, v in mem.breakdown.items() if k not in model_state_keys}
    return {
        "scenario": sc.name, "stage": z.stage, "n_params": total, "largest_layer_params": largest,
        "deepspeed_estimate": row,
        "zsim": {"peak_bytes": mem.peak_bytes, "capacity_bytes": mem.capacity_bytes, "fits": mem.fits,
                 "peak_time_s": mem.peak_time_s, "model_states_bytes": zsim_states,
                 "host_bytes_per_node": mem.host.bytes_per_node, "host_fits": mem.host.fits,
                 "breakdown": mem.breakdown, "host_breakdown": mem.host.breakdown},
        "differences": {k: {"bytes": v, "why": DIFFERENCES.get(k, "not in DeepSpeed's estimator")}
                        for k, v in sorted(others.items(), key=lambda kv: -kv[1])},
        "notes": _state_notes(sc, row, zsim_states),
    }


def _state_notes(sc, row, zsim_states) -> list[str]:
    z = sc.zero
    notes = [f"model states: DeepSpeed's estimator {row['gpu_bytes'] / GiB:.2f} GiB per GPU, zsim's ledger "
             f"{zsim_states / GiB:.2f} GiB at the peak"]
    if sc.tensor_parallel_size > 1:
        notes.append(f"tensor parallel {sc.tensor_parallel_size}: the estimator is given one rank's slice of the "
                     "model (Megatron's column/row-parallel layers, vocab-parallel embedding) and its data-parallel "
                     f"group of {sc.data_parallel_size} ranks")
    if sc.pipeline_stages > 1:
        notes.append("pipeline: the estimator is given the worst stage's parameters (its own slice, a tied "
                     "embedding's copy included) and that stage's data-parallel group")
    if z.stage <= 2 and z.optimizer_offload_device == "none":
        notes.append("the ZeRO-2 estimator charges 18 B/param / world (fp32 grads included) for every stage <= 2; "
                     "zsim shards per stage (stage 0/1 keep full 16-bit gradients; stage 0 keeps full optimizer states) "
                     "and holds the fp32 gradient copy only during the step")
    frozen = _frozen_note(sc)
    if frozen:
        notes.append(frozen)
    if z.stage == 3:
        notes.append("the ZeRO-3 estimator adds the largest layer at 4 B/param for gathering; zsim's ledger holds "
                     "what the prefetcher and max_live_parameters actually keep gathered")
    if z.optimizer_offload_device != "none":
        notes.append("host side: the estimator's per-CPU figure is a bound with additional_buffer_factor; zsim's "
                     "host ledger lists the pinned buffers and offloaded states per node")
    return notes


def main(args) -> int:
    from zsim.report.writers import dumps, save

    cold = (("--total-params", args.total_params, None), ("--largest-layer-params", args.largest_layer_params, None))
    for flag, value, unset in cold:
        if not args.like_deepspeed and value != unset:
            raise ZsimInputError(flag, value, "is read only with --like-deepspeed (DeepSpeed's estimator for a "
                                 "parameter count); add --like-deepspeed, or drop it to compare the scenario's model")
    if args.like_deepspeed:
        rep = estimator_report(args)
        print_like_deepspeed(rep)
    else:
        rep = compare_report(args)
        _print_compare(rep)
    if args.json:
        save(args.json, dumps(rep))
    return 0


def _print_compare(rep: dict):
    z = rep["zsim"]
    est = rep["deepspeed_estimate"]
    verdict = "fits" if z["fits"] else "OOM"
    print(f"{rep['scenario']}: ZeRO stage {rep['stage']}, {rep['n_params'] / 1e9:.3f} B params "
          f"(largest layer {rep['largest_layer_params'] / 1e6:.1f} M)")
    opts = ", ".join(f"{k}={v}" for k, v in est.items() if k not in ("cpu_bytes", "gpu_bytes"))
    print(f"DeepSpeed estimator ({opts}): {est['gpu_bytes'] / GiB:.2f} GiB per GPU, {est['cpu_bytes'] / GiB:.2f} GiB per CPU")
    print(f"zsim peak: {z['peak_bytes'] / GiB:.2f} GiB of {z['capacity_bytes'] / GiB:.2f} GiB -> {verdict} "
          f"(at t={z['peak_time_s'] * 1e3:.1f} ms); host {z['host_bytes_per_node'] / GiB:.2f} GiB per node")
    print("Beyond the estimator (at zsim's peak):")
    for k, d in rep["differences"].items():
        print(f"  {k:34s} {d['bytes'] / GiB:8.2f} GiB  {d['why']}")
    for n in rep["notes"]:
        print(f"- {n}")
