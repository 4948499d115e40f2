"""zsim tune: the best ZeRO configuration that fits, at the scenario's global batch."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from zsim.commands.common import (add_headroom_arg, add_scenario_args, add_width_arg, add_workers_arg,
                                  headroom_fraction, scenario_overrides, table_width, workers_count)
from zsim.config.hf_auto import TRAINER_DEFAULTS
from zsim.errors import ZsimInputError
from zsim.specs.scenario import FRAMEWORKS



def add_parser(sub):
    p = sub.add_parser("tune", help="search the TP x PP x DP layout, stage, micro-batch, checkpointing, offload and ZeRO knobs")
    add_scenario_args(p, optional=False)
    p.add_argument("--objective", default="tokens_per_s", choices=("tokens_per_s", "mfu", "step_time_s"))
    p.add_argument("--budget", default="60",
                   help="most configurations to simulate (default 60), or 'all': every candidate the memory "
                        "and step-time lower bounds leave, then the knob refinement")
    p.add_argument("--top", type=int, default=5, help="how many to print")
    p.add_argument("--out", metavar="DS_CONFIG.json", help="write the best configuration as a ds_config.json")
    p.add_argument("--scenario-out", metavar="SCENARIO.yaml",
                   help="write the best configuration as a scenario zsim run takes: the scenario with its "
                        "parallelism (TP, PP, sequence parallel) and training keys, and the tuned ds_config "
                        "(the --out file when given, else inline)")
    p.add_argument("--json", metavar="PATH", help="write the ranked candidates as JSON")
    p.add_argument("--write", action="store_true",
                   help="write the best configuration beside the input in its own format: a ds_config.json "
                        "input as NAME.tuned.json, a scenario YAML as NAME.tuned.yaml, an axolotl or LLaMA-Factory "
                        "recipe as NAME.tuned.yaml with only the changed keys edited (comments kept) and its "
                        "ds_config, where it changes, as DS.tuned.json beside it (never the input itself)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --out, --scenario-out or --write file")
    p.add_argument("--framework", choices=FRAMEWORKS,
                   help="what runs the training loop, which bounds the layouts searched (default: the scenario's "
                        "training.framework; not stated: every layout zsim models)")
    p.add_argument("--fix", action="append", metavar="KEY=VALUE", default=[],
                   help="pin a setting for the search, e.g. parallelism.tensor=1 or "
                        "deepspeed.zero_optimization.stage=3 (repeatable)")
    p.add_argument("--global-batch", type=int, metavar="N",
                   help="the global batch (samples per optimizer step) micro-batch x GAS x data-parallel size "
                        "must make; default: the scenario's, or where micro-batch and GAS are \"auto\" the "
                        "ds_config's train_batch_size, else the HF Trainer's default (8 a GPU, GAS 1)")
    add_width_arg(p)
    add_headroom_arg(p)
    add_workers_arg(p, "simulate the configurations the search is about to try")
    p.set_defaults(func=main)


def _int_or_none(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def distinct(ranked) -> list:
    """The ranking with configurations that simulate identically merged (a knob that changes
    nothing, e.g. a prefetch size above every layer, gives the same step): the first, which sets
    the fewest knobs among its equals at the same rank, stays."""
    from zsim.search.tune import distinct_key

    out, seen = [], set()
    for c, r in ranked:
        key = distinct_key(c, r)
        if key not in seen:
            seen.add(key)
            out.append((c, r))
    return out


def tuned_scenario(base, assignments, deepspeed) -> dict:
    """The scenario mapping of a tuned configuration: the base's (its --set and cluster flags
    applied) with the configuration's assignments, so its `parallelism:` block carries the
    layout a ds_config cannot (sequence_parallel, a TP size agreeing with autotp_size), and
    `deepspeed` the tuned ds_config (a mapping, or the path of the --out file). Paths that were
    relative to the scenario's folder (a profile file; model.hf_config is absolute already) are
    made absolute, so the file runs from wherever it is written."""
    import copy

    from zsim.config.scenario import apply_set

    raw = copy.deepcopy(base.raw)
    for a in assignments:
        raw = apply_set(raw, a)
    raw["deepspeed"] = deepspeed
    hw = raw.get("hardware")
    profile = hw.get("profile") if isinstance(hw, dict) else None
    if isinstance(profile, str) and Path(profile).suffix in (".yaml", ".yml") and not Path(profile).is_absolute() \
            and (base.base_dir / profile).is_file():
        hw["profile"] = str((base.base_dir / profile).resolve())
    return raw


def batch_overrides(path: str, overrides: tuple[str, ...], global_batch: int | None) -> tuple[tuple[str, ...], str]:
    """(assignments, note) giving the base of the search a micro-batch and GAS where the
    ds_config leaves them "auto" for the HF Trainer and the scenario's training keys do not set
    them: choosing them is the search's job, at a global batch of `global_batch`, else the
    ds_config's train_batch_size when it is a number, else the HF Trainer's default (8 a GPU,
    GAS 1; the one of them the run gives, as a training key or a number in the ds_config, in
    its place) x the data-parallel size, which the note names; the search starts from the value
    the run gives. The ds_config keeps its "auto" (the
    file written back keeps it too, with the values to give the Trainer). Without "auto",
    `global_batch` replaces the scenario's global batch (its micro-batch and GAS keys dropped:
    DeepSpeed derives them from train_batch_size). ((), "") when there is nothing to choose."""
    from zsim.config.scenario import apply_set, load_raw, scenario_from_mapping

    if global_batch is not None and global_batch < 1:
        raise ZsimInputError("--global-batch", global_batch, "give 1 or more samples per optimizer step")
    raw = load_raw(Path(path))
    for a in overrides:
        raw = apply_set(raw, a)
    ds_raw, training_raw = raw.get("deepspeed"), raw.get("training")
    ds: dict = ds_raw if isinstance(ds_raw, dict) else {}
    training: dict = training_raw if isinstance(training_raw, dict) else {}
    auto = [key for ds_key, key in (("train_micro_batch_size_per_gpu", "micro_batch_size"),
                                    ("gradient_accumulation_steps", "gradient_accumulation_steps"))
            if ds.get(ds_key) == "auto" and training.get(key) is None]
    if not auto and global_batch is None:
        return (), ""
    given_batch = ds.get("train_batch_size")
    file_batch = given_batch if isinstance(given_batch, int) and not isinstance(given_batch, bool) else None
    # the data-parallel size the batch divides by: the base's layout, with any batch (the probe's)
    probe = raw
    for a in ("training.micro_batch_size=1", "training.gradient_accumulation_steps=1",
              "deepspeed.train_micro_batch_size_per_gpu=null", "deepspeed.gradient_accumulation_steps=null",
              "deepspeed.train_batch_size=null"):
        probe = apply_set(probe, a)
    dp = scenario_from_mapping(probe, Path(path).parent, name_default=Path(path).stem).data_parallel_size
    # the one of micro-batch and GAS the run fixes where the other is "auto": a training key (the
    # Trainer's argument), else the ds_config's number, which the search's start must keep
    known: list[tuple[str, int, bool]] = [
             (key, training[key], False) if training.get(key) is not None else (key, ds[ds_key], True)
             for ds_key, key in (("train_micro_batch_size_per_gpu", "micro_batch_size"),
                                 ("gradient_accumulation_steps", "gradient_accumulation_steps"))
             if key not in auto and _count_or_none(training.get(key) if training.get(key) is not None
                                                   else ds.get(ds_key)) is not None]
    note = ""
    if global_batch is None:
        if file_batch is not None:
            global_batch = file_batch
        elif not known:
            micro = int(TRAINER_DEFAULTS["micro_batch_size"][0])
            global_batch = micro * dp
            note = (f"the global batch is {global_batch} (the HF Trainer's default per_device_train_batch_size "
                    f"{micro} x gradient_accumulation_steps 1 x {dp} data-parallel ranks: "
                    "train_batch_size is \"auto\"); --global-batch N to choose it")
        else:
            key, value, _ = known[0]
            micro = value if key == "micro_batch_size" else int(TRAINER_DEFAULTS["micro_batch_size"][0])
            gas = value if key == "gradient_accumulation_steps" else 1
            global_batch = micro * gas * dp
            note = (f"the global batch is {global_batch} (per_device_train_batch_size {micro} x "
                    f"gradient_accumulation_steps {gas} x {dp} data-parallel ranks, the HF Trainer's default "
                    "for the one not given: train_batch_size is \"auto\"); --global-batch N to choose it")
    elif file_batch is not None and file_batch != global_batch and auto:
        raise ZsimInputError("--global-batch", global_batch, f"disagrees with the ds_config's train_batch_size "
                             f"{file_batch}; drop one (the HF Trainer refuses the mismatch)")
    assert global_batch is not None
    if global_batch % dp:
        raise ZsimInputError("--global-batch" if note == "" else "deepspeed.train_batch_size", global_batch,
                             f"does not divide over the {dp} data-parallel ranks; give a multiple of {dp}")
    if auto:
        # a start the search moves from ("auto" stays in the ds_config): the value the run fixes
        # with the rest accumulated (or batched), else micro-batch 1 and the rest accumulated
        micro, gas = 1, global_batch // dp
        if known:
            key, value, in_file = known[0]
            if global_batch % (dp * value) == 0:
                micro, gas = (value, global_batch // (dp * value)) if key == "micro_batch_size" \
                    else (global_batch // (dp * value), value)
            elif in_file:
                ds_key = "train_micro_batch_size_per_gpu" if key == "micro_batch_size" else key
                raise ZsimInputError("--global-batch", global_batch, f"is not a multiple of the {dp} data-parallel "
                                     f"ranks x the ds_config's {ds_key} {value}; give a multiple of {dp * value} "
                                     f"or make {ds_key} \"auto\"")
        return (f"training.micro_batch_size={micro}", f"training.gradient_accumulation_steps={gas}"), note
    out = [f"deepspeed.train_batch_size={global_batch}", "deepspeed.train_micro_batch_size_per_gpu=null",
           "deepspeed.gradient_accumulation_steps=null"]
    out += [f"training.{k}=null" for k in ("micro_batch_size", "gradient_accumulation_steps") if training.get(k) is not None]
    return tuple(out), note


def _count_or_none(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _trainer_autos(ds) -> bool:
    """Whether the ds_config has an "auto" that the HF Trainer fills from its arguments (batch,
    GAS, precision, clipping): DeepSpeed alone refuses those, so the file is an HF Trainer's
    (or accelerate's, axolotl's, LLaMA-Factory's)."""
    if not isinstance(ds, dict):
        return False
    blocks = [ds.get(k) for k in ("fp16", "bf16")]
    return (any(ds.get(k) == "auto" for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                              "gradient_accumulation_steps", "gradient_clipping"))
            or any(isinstance(b, dict) and b.get("enabled") == "auto" for b in blocks))


def _recipe_kind(args) -> str | None:
    """The kind of the recipe the user gave (axolotl, llama_factory, accelerate), or None."""
    recipe = getattr(args, "recipe", None)
    if not recipe or Path(recipe).suffix not in (".yaml", ".yml"):
        return None
    from zsim.config.recipes import recipe_kind
    from zsim.inputs import parse_yaml, read_text
    return recipe_kind(parse_yaml(read_text(Path(recipe), "recipe", "a recipe"), "recipe", recipe))


def _write_paths(args):
    """--write: the answer beside the input, in its format (`_tuned_path`); never the input. An
    axolotl or LLaMA-Factory recipe gets NAME.tuned.yaml with the changed keys, its ds_config
    (when the winner's differs) NAME.tuned.json beside the one it names, or beside the recipe;
    an accelerate config the same (its plugin's keys, or a deepspeed_config_file); a launch
    script NAME.tuned.sh with the training script's flags edited (and the recipe it hands on,
    as above). What has no file format of its own to answer in is refused in one line."""
    from zsim.commands.common import NO_DEEPSPEED
    from zsim.config.launch_writer import tuned_path
    from zsim.config.recipe_writer import WRITABLE
    from zsim.config.scenario import source_is_ds_config

    path = Path(args.scenario)
    args.recipe_out = args.launch_out = None
    kind = _recipe_kind(args)
    script = getattr(args, "launch_script", None)
    if getattr(args, "launch_words", None) is not None:
        raise ZsimInputError("--write", " ".join(args.launch_words[:1]), "a launch command after -- has no file to "
                             "write beside: save it in a script (train.sh) and give zsim tune train.sh --write, or "
                             "use --out/--scenario-out")
    recipe = Path(args.recipe) if getattr(args, "recipe", None) else None
    if recipe is not None and kind not in (*WRITABLE, "accelerate"):
        raise ZsimInputError("--write", str(recipe), "is the HF Trainer's arguments as a YAML/JSON file, which zsim "
                             "tune cannot write back yet; use --out DS.json and the notes' Trainer arguments")
    if script:
        from zsim.commands.tune_write import check_launch
        check_launch(args)
        args.launch_out = str(tuned_path(Path(script)))
    if recipe is not None:
        args.recipe_out = str(tuned_path(recipe))
    if recipe is not None or script:
        beside = recipe or Path(script)
        args.out = args.out or str(beside.with_name(beside.stem + ".ds_config.tuned.json") if path == NO_DEEPSPEED
                                   else path.with_name(path.stem + ".tuned.json"))
    elif source_is_ds_config(path):
        args.out = args.out or str(path.with_name(path.stem + ".tuned.json"))
    else:
        args.scenario_out = args.scenario_out or str(path.with_name(path.stem + ".tuned.yaml"))


def main(args) -> int:
    import os

    import yaml

    from zsim.report.table import make_console, tune_table
    from zsim.report.writers import dumps, save
    from zsim.config.ds_writer import tuned_ds_config
    from zsim.search.tune import KNOBS, KNOBS_STAGE3, ZEROPP_KNOBS, make_space, structural_candidates, tune
    from zsim.search.variants import Base

    budget = None if args.budget == "all" else _int_or_none(args.budget)
    if args.budget != "all" and (budget is None or budget < 1):
        raise ZsimInputError("--budget", args.budget, "give a number of configurations (1 or more) or 'all'")
    if args.top < 0:
        raise ZsimInputError("--top", args.top, "give 0 or more")
    headroom = headroom_fraction(args.headroom)
    width = table_width(args.width)
    if args.write:
        _write_paths(args)
    outputs = (("--out", args.out), ("--scenario-out", args.scenario_out),
               ("--write", getattr(args, "recipe_out", None)), ("--write", getattr(args, "launch_out", None)))
    inputs = [p for p in (args.scenario, getattr(args, "recipe", None), getattr(args, "launch_script", None)) if p]
    for flag, path in outputs:
        if path and any(Path(path).resolve() == Path(p).resolve() for p in inputs):
            raise ZsimInputError(flag, path, "is an input of this run; zsim tune never writes over its input")
        if path and Path(path).exists() and not args.force:
            raise ZsimInputError(flag, path, "the file exists; pass --force to overwrite it or choose another path")
    if args.out and args.scenario_out and Path(args.out).resolve() == Path(args.scenario_out).resolve():
        raise ZsimInputError("--scenario-out", args.scenario_out, "is the --out file; give the scenario its own path")
    overrides = scenario_overrides(args)
    batch, batch_note = batch_overrides(args.scenario, overrides, args.global_batch)
    if batch_note:
        print(f"zsim: note: {batch_note}", file=sys.stderr)
    base = Base.load(args.scenario, overrides + batch, workers=workers_count(args.workers))
    sc = base.scenario(())
    space = make_space(args.fix, args.framework or sc.training.framework,
                       "--framework" if args.framework else "training.framework")
    print(space.describe(), file=sys.stderr)
    if space.framework is None and _trainer_autos(base.raw.get("deepspeed")):
        print("zsim: note: the ds_config has \"auto\" values only the HF Trainer fills; --framework hf_trainer "
              "searches only what it runs (no Megatron sequence parallelism or pipeline)", file=sys.stderr)
    if not structural_candidates(sc, space):
        raise ZsimInputError("--fix" if space.fixed else "--framework", " ".join(space.fixed) or space.framework,
                             "no configuration of the search space satisfies it (e.g. a tensor size that does not "
                             "divide the heads or the GPUs per node); loosen it")
    try:
        res = tune(base, args.objective, budget, keep=args.top, headroom=headroom, space=space)
    finally:
        base.close()
    res.ranked = distinct(r for r in res.ranked if r[1].fits_with(headroom))
    tune_table(res, args.top, make_console(width))
    print(f"simulated {res.simulated} configurations ({res.shared} of them sharing another's simulation, "
          f"{len(res.pruned)} pruned by the memory lower bound, "
          f"{len(res.bounded)} skipped by the step-time lower bound, "
          f"{res.rejected} rejected as invalid) in {res.wall_s:.1f} s", file=sys.stderr)
    if budget is None:
        print(f"every candidate structure was simulated or ruled out by a bound: none left out can enter the "
              f"best {max(args.top, 3)} (the knobs are refined from the best three)", file=sys.stderr)
    if args.json:
        rows = [{"rank": i + 1, "set": list(c.assignments()), "stage": c.stage,
                 "tensor_parallel_size": c.layout.tensor, "sequence_parallel": c.layout.sequence_parallel,
                 "expert_parallel_size": c.layout.expert, "ulysses_sequence_parallel_size": c.layout.sequence,
                 "pipeline_stages": c.layout.pipeline, "data_parallel_size": r.world_size // c.layout.sample_parallel,
                 "offload": c.offload,
                 "micro_batch_size": c.micro_batch, "gradient_accumulation_steps": c.gas,
                 "activation_checkpointing": c.checkpointing, "knobs": c.knobs,
                 "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu, "mfu": r.mfu, "step_time_s": r.step_time_s,
                 "peak_bytes": r.memory.peak_bytes} for i, (c, r) in enumerate(res.ranked)]
        restricted = {"search_space": {"framework": space.framework, "fixed": list(space.fixed)}} \
            if space.framework or space.fixed else {}   # (absent: every layout, as before)
        save(args.json, dumps({"objective": res.objective, "simulated": res.simulated, "shared": res.shared,
                               "pruned": len(res.pruned), "bounded": len(res.bounded),
                               "rejected": res.rejected, **restricted, "candidates": rows}))
    if not res.ranked:   # the JSON (an empty ranking, the counts) is written all the same
        margin = f" with {headroom:.0%} headroom" if headroom else ""
        print(f"zsim: no configuration fits{margin}; see zsim doctor for offload/NVMe options", file=sys.stderr)
        return 1
    best, _ = res.ranked[0]
    if best.checkpointing != "none":
        print(f"note: the best configuration uses {best.checkpointing} activation checkpointing; enable it in the "
              "model (e.g. model.gradient_checkpointing_enable() or deepspeed.checkpointing)", file=sys.stderr)
    if args.out or args.scenario_out:
        ds_args = (base.raw.get("deepspeed"), base.scenario(()), base.scenario(best.assignments()),
                   [*KNOBS, *KNOBS_STAGE3, *ZEROPP_KNOBS])
        cfg, notes = tuned_ds_config(*ds_args)
        if batch and batch[0].startswith("training.micro_batch_size="):
            # the search chose micro-batch and GAS where the ds_config says "auto": the Trainer's
            # arguments carry them (whatever the base's start was, so said here for both)
            notes = [n for n in notes if not n.startswith(("train_micro_batch_size_per_gpu stays",
                                                           "gradient_accumulation_steps stays"))]
            notes.insert(0, f"micro-batch and GAS stay \"auto\" as written; give the HF Trainer "
                            f"--per_device_train_batch_size {best.micro_batch} --gradient_accumulation_steps {best.gas}")
        recipe_out, launch_out = getattr(args, "recipe_out", None), getattr(args, "launch_out", None)
        accelerate = recipe_out is not None and _recipe_kind(args) == "accelerate"
        if args.out and not ((recipe_out or launch_out) and cfg == base.raw.get("deepspeed")) and not accelerate:
            save(args.out, json.dumps(cfg, indent=2) + "\n")
        if recipe_out or launch_out:
            # the recipe or the script's flags carry the micro-batch and GAS the Trainer fills the "auto" with
            notes = [n for n in notes if not n.startswith(("train_micro_batch_size_per_gpu stays",
                                                           "gradient_accumulation_steps stays", "micro-batch and GAS"))]
        if accelerate:
            from zsim.commands.tune_write import write_accelerate
            notes += write_accelerate(args, base, best, cfg)
        elif recipe_out:
            notes += _write_recipe(args, base, best, cfg)
        if launch_out:
            from zsim.commands.tune_write import write_launch
            notes += write_launch(args, base, best, cfg)
        if args.scenario_out:
            where = Path(args.scenario_out).resolve().parent
            # where the ds_config keeps an "auto" the tuned value differs from (for the HF Trainer to
            # fill), the scenario carries the tuned values inline, so zsim run reproduces the winner
            pinned, _ = tuned_ds_config(*ds_args, resolve_auto=True)
            ds = os.path.relpath(Path(args.out).resolve(), where) if args.out and pinned == cfg else pinned
            if args.out and pinned != cfg:
                notes.append(f"{args.scenario_out} carries the tuned values inline where {args.out} keeps \"auto\"")
            raw = tuned_scenario(base, best.assignments(), ds)
            save(args.scenario_out, f"# zsim tune's best configuration ({res.objective}): {best.variant.name}\n"
                 + yaml.safe_dump(raw, sort_keys=False))
        elif best.layout.sequence_parallel:
            notes.append("the ds_config cannot say sequence_parallel (Megatron's --sequence-parallel): "
                         "--scenario-out writes a scenario that zsim run takes with the whole layout")
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
    return 0


def _write_recipe(args, base, best, cfg) -> list[str]:
    """The user's recipe with the keys the winner changes (zsim.config.recipe_writer), beside it;
    the notes saying what was written."""
    import os

    from zsim.commands.common import NO_DEEPSPEED
    from zsim.config.recipe_writer import tuned_recipe
    from zsim.inputs import read_text
    from zsim.report.writers import save

    recipe, kind = Path(args.recipe), _recipe_kind(args)
    assert kind is not None    # _write_paths chose a recipe's writer
    start = base.scenario(())
    notes = []
    checkpointing = None
    if best.checkpointing != start.training.activation_checkpointing:
        if best.checkpointing == "selective":
            notes.append("the best configuration checkpoints selectively, which the recipe cannot say: "
                         f"{args.recipe_out} keeps the recipe's checkpointing")
        else:
            checkpointing = best.checkpointing
    deepspeed = None
    if cfg != base.raw.get("deepspeed"):
        ref = os.path.relpath(Path(args.out).resolve(), Path.cwd())
        deepspeed = ref if Path(args.scenario) == NO_DEEPSPEED else _tuned_ref(recipe, ref, args)
    text, written = tuned_recipe(
        read_text(recipe, "recipe", "a recipe"), kind,
        micro_batch=best.micro_batch if best.micro_batch != start.micro_batch_size else None,
        gas=best.gas if best.gas != start.gradient_accumulation_steps else None,
        checkpointing=checkpointing, deepspeed=deepspeed)
    save(args.recipe_out, text)
    notes.append(f"{args.recipe_out}: {recipe.name} with " + ("; ".join(written) if written else "no key changed")
                 + " (every other line as written)")
    return notes


def _tuned_ref(recipe: Path, fallback: str, args) -> str:
    """The recipe's own `deepspeed:` reference with the tuned file's name (it resolves as the
    original does: the tuned file sits beside it), else `fallback`."""
    from zsim.inputs import parse_yaml, read_text
    data = parse_yaml(read_text(recipe, "recipe", "a recipe"), "recipe", str(recipe))
    ref = data.get("deepspeed") if isinstance(data, dict) else None
    if isinstance(ref, str) and ref:
        return str(Path(ref).with_name(Path(args.out).name))
    return fallback
