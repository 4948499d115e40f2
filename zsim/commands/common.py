"""Arguments shared by the subcommands: the scenario (or a ds_config.json), --set, and the
flags that fill in what a ds_config lacks (zsim.config.source)."""
from __future__ import annotations

import os
from pathlib import Path

from zsim.errors import ZsimInputError

DEFAULT_SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "default.yaml"


def add_scenario_args(p, optional: bool = True, cluster_flags: bool = True):
    """`cluster_flags=False` for a command that already has --nodes/--gpus-per-node of its own."""
    if optional:
        p.add_argument("scenario", nargs="?", default=str(DEFAULT_SCENARIO),
                       help="scenario YAML or a ds_config.json (default: the embedded small default scenario)")
    else:
        # optional to argparse so that a launch command after -- can stand for it (resolve_source)
        p.add_argument("scenario", nargs="?", help="scenario YAML, ds_config.json, recipe or launch script "
                                                   "(or the launch command after --)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override any scenario key, e.g. deepspeed.zero_optimization.stage=2 (repeatable)")
    p.add_argument("--model", metavar="NAME|config.json",
                   help="model preset or Hugging Face config.json (for a ds_config; on a scenario it replaces model:)")
    p.add_argument("--profile", metavar="P", help="hardware profile name or .yaml path (ds_config default: dgx-a100-80g)")
    if cluster_flags:
        p.add_argument("--gpus", type=int, metavar="N", help="GPUs per node (DeepSpeed launcher's --num_gpus)")
        p.add_argument("--nodes", type=int, metavar="K", help="nodes (ds_config default: 1)")


def _count(flag: str, value):
    if value is not None and value < 1:
        raise ZsimInputError(flag, value, "give 1 or more")
    return value


def scenario_overrides(args) -> tuple[str, ...]:
    """The flags as --set assignments, then the user's own --set (which win), then a
    re-derived train_batch_size when they move micro x GAS x world size (one note on stderr)."""
    import sys

    from zsim.config.derive import rederive_batch
    from zsim.config.scenario import source_is_ds_config
    from zsim.config.source import cluster_overrides

    gpus = getattr(args, "gpus", None)
    gpus = _count("--gpus", gpus if gpus is not None else getattr(args, "gpus_per_node", None))
    nodes = _count("--nodes", args.nodes)
    ds_config = source_is_ds_config(args.scenario)
    flags = cluster_overrides(ds_config, args.scenario, args.model, gpus, nodes, args.profile)
    flags += tuple(getattr(args, "recipe_set", ()))   # a launch's or recipe's settings (resolve_source)
    overrides = flags + tuple(args.set or ())
    # a ds_config's cluster comes from the flags alone: they complete it, they move nothing
    derived, note = (rederive_batch(args.scenario, tuple(args.set or ()), base=flags) if ds_config
                     else rederive_batch(args.scenario, overrides))
    if note:
        print(f"zsim: note: {note}", file=sys.stderr)
    _print_source_notes(args, overrides + derived)
    print_input_notes(args.scenario, overrides + derived)
    return overrides + derived


def print_input_notes(path: str, overrides: tuple[str, ...]):
    """The scenario's `notes` (defaults taken for what the files leave open, keys DeepSpeed
    ignores) on stderr, once per command; a scenario that does not load says nothing here (the
    command's own load names the error, or a search mends it)."""
    import sys

    from zsim.config.scenario import load_scenario
    try:
        notes = load_scenario(path, overrides).notes
    except ZsimInputError:
        return
    for note in notes:
        print(f"zsim: note: {note}", file=sys.stderr)


def add_headroom_arg(p):
    p.add_argument("--headroom", metavar="PCT", default="0%",
                   help="safety margin on the fits verdict: the peak must stay under (100 - PCT)%% of HBM "
                        "(e.g. 10%%; default 0%%)")


def headroom_fraction(text: str) -> float:
    """`10%` or `0.1` -> 0.1; at most 90% (a larger margin leaves no memory to train in)."""
    import math
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ZsimInputError("--headroom", text, "give a percentage such as 10% (or a fraction such as 0.1)") from None
    if not math.isfinite(value) or not 0 <= value <= 0.9:
        raise ZsimInputError("--headroom", text, "give a margin from 0% to 90%")
    return value


def add_width_arg(p):
    p.add_argument("--width", type=int, metavar="COLS", help="table width (default: the terminal's; 400 when piped)")


def table_width(value: int | None) -> int | None:
    if value is not None and not 20 <= value <= 10_000:
        raise ZsimInputError("--width", value, "give 20 to 10000 columns")
    return value


def add_workers_arg(p, what: str):
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help=f"worker processes that {what} (default: CPU count; 1: none)")


def workers_count(value: int) -> int:
    """--workers checked: each worker is a forked process holding a copy of the scenario, so
    more than a few per core only costs memory."""
    max_workers = 4 * (os.cpu_count() or 1)
    if not 1 <= value <= max_workers:
        raise ZsimInputError("--workers", value, f"use 1 to {max_workers} worker processes (4 per CPU core)")
    return value


# the attributes commands keep their file arguments in, with the flag a user typed
OUTPUT_FLAGS = (("json", "--json"), ("csv", "--csv"), ("trace", "--trace"), ("plot", "--plot"), ("out", "--out"),
                ("scenario_out", "--scenario-out"))
INPUT_FLAGS = (("scenario", "SCENARIO"), ("results", "RESULTS"), ("model", "--model"), ("profile", "--profile"),
               ("recipe", "recipe"))


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):   # a name too long for the OS, a NUL byte: not a file of ours
        return False


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (hard links and symlinks included); a path that does not
    exist yet is compared by where it would be created."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except (OSError, ValueError, RuntimeError):
        return False


def _referenced(scenario) -> list[tuple[str, str]]:
    """The files a scenario file names (its ds_config, profile YAML, Hugging Face config.json),
    as (where, path); none when it cannot be read (its loader says why)."""
    if not isinstance(scenario, str) or not _is_file(scenario):
        return []
    from zsim.config.scenario import _read_yaml
    try:
        raw = _read_yaml(Path(scenario))
    except ZsimInputError:
        return []
    here = Path(scenario).parent
    out = []
    for where, value in (("deepspeed", raw.get("deepspeed")),
                         ("hardware.profile", (raw.get("hardware") or {}).get("profile")
                          if isinstance(raw.get("hardware"), dict) else None),
                         ("model.hf_config", (raw.get("model") or {}).get("hf_config")
                          if isinstance(raw.get("model"), dict) else None)):
        if isinstance(value, str) and value:
            path = Path(value) if Path(value).is_absolute() else here / value
            if _is_file(str(path)):
                out.append((f"scenario's {where}", str(path)))
    return out


def check_output_paths(args):
    """Refuse, before anything runs, an output that would replace one of the command's inputs
    (`zsim run --json scenarios/default.yaml`), an output named twice (`--json x --trace x`: one
    would be lost) and an output that is a directory. Replacing an earlier output is allowed and
    said on stderr (writers.save)."""
    inputs = [(flag, v) for attr, flag in INPUT_FLAGS
              if isinstance(v := getattr(args, attr, None), str) and _is_file(v)]
    for item in getattr(args, "set", None) or ():   # --set model.hf_config=PATH and the like
        key, _, value = item.partition("=")
        if value and _is_file(value):
            inputs.append((f"--set {key}", value))
    model = getattr(args, "model", None)
    if isinstance(model, str) and _is_file(str(Path(model) / "config.json")):   # --model FOLDER
        inputs.append(("--model", str(Path(model) / "config.json")))
    inputs += _referenced(getattr(args, "scenario", None))
    outputs: list[tuple[str, str]] = []
    for attr, flag in OUTPUT_FLAGS:
        path = getattr(args, attr, None)
        if not isinstance(path, str) or not path or path == "-":
            continue
        p = Path(path)
        try:
            is_dir = p.is_dir()
        except (OSError, ValueError):
            is_dir = False   # the write itself will name what is wrong with it
        if is_dir:
            raise ZsimInputError(flag, path, "is a directory; give a file path (e.g. one inside it)")
        for other_flag, other in inputs:
            if _same_file(p, Path(other)):
                raise ZsimInputError(flag, path, f"is the {other_flag} input, which the output would replace; "
                                     "give the output its own path")
        for other_flag, other in outputs:
            if _same_file(p, Path(other)):
                raise ZsimInputError(flag, path, f"is also the {other_flag} output, and one would be lost; give "
                                     "each output its own path")
        outputs.append((flag, path))


# the ds_config a launch or recipe without one runs on: {} (ZeRO stage 0, DeepSpeed's defaults)
NO_DEEPSPEED = DEFAULT_SCENARIO.parent / "no-deepspeed.json"


def resolve_source(args, launch: list[str] | None = None):
    """What the user gave where a scenario belongs, made what the commands load: a launch
    command (`zsim run -- deepspeed ...`), a launch script, or an accelerate / axolotl /
    LLaMA-Factory recipe becomes its ds_config file (NO_DEEPSPEED when it names none), --model /
    --gpus / --nodes where the user gave none, and the `training.*` assignments it stands for
    (args.recipe_set: they complete the ds_config as the flags do). A Hub id given as the model
    becomes the path of its config.json (zsim.config.hub)."""

    from zsim.config import hub
    from zsim.config.launch import is_launch_script, read_launch, read_script
    from zsim.config.recipes import ACCEPTED, read_recipe_file, recipe_kind
    from zsim.config.trainer_args import Recipe, assignments

    recipe = None
    scenario = getattr(args, "scenario", None)
    if launch is not None:
        if scenario not in (None, str(DEFAULT_SCENARIO)):
            raise ZsimInputError("scenario", scenario, "give a scenario file or a launch command after --, not both")
        recipe = read_launch(launch, Path.cwd(), "the launch command")
        args.launch_words = launch
    elif isinstance(scenario, str) and _is_file(scenario):
        path = Path(scenario)
        if is_launch_script(path):
            args.launch_script = str(path)      # what zsim tune --write answers beside
            words, env = read_script(path)
            recipe = read_launch(words, path.parent.resolve(), str(path), env)
        elif path.suffix in (".yaml", ".yml"):
            from zsim.config.scenario import _read_yaml
            from zsim.config.source import SCENARIO_KEYS, is_ds_config
            try:
                data = _read_yaml(path)
            except ZsimInputError:
                data = None         # the loader says what is wrong with it
            if recipe_kind(data):
                recipe = read_recipe_file(path, Path.cwd(), Recipe(origin=str(path), framework="hf_trainer"))
            elif isinstance(data, dict) and data and not is_ds_config(data) and not _near_known(data, SCENARIO_KEYS):
                raise ZsimInputError("scenario", scenario, f"is none of the files zsim reads ({ACCEPTED}); its keys "
                                     f"({', '.join(map(str, list(data)[:4]))}...) name no scenario block")
    elif scenario is None:
        raise ZsimInputError("scenario", None, f"give one: {ACCEPTED}")
    if recipe is not None:
        _apply_recipe(args, recipe, assignments(recipe))
    model = getattr(args, "model", None)
    if isinstance(model, str) and hub.is_repo_id(model):
        from zsim.config.hf_config import preset_names
        if model not in preset_names():
            path, where = hub.resolve(model)
            _note(args, f"model {model}: config.json from {where}")
            args.model = str(path)


def _near_known(data: dict, scenario_keys) -> bool:
    """Whether any key is a scenario block or a misspelling of one (the loader's did-you-mean)."""
    import difflib
    return any(k in scenario_keys or difflib.get_close_matches(str(k), scenario_keys, n=1, cutoff=0.6) for k in data)


def _apply_recipe(args, recipe, sets: list[str]):
    import json

    origin = recipe.origin
    if recipe.ds_config is not None and recipe.ds_inline:
        recipe.notes.append("the DeepSpeed settings of the accelerate config are replaced by --deepspeed "
                            f"{recipe.ds_config.name} (the Trainer's own, as transformers does)")
        sets = [s for s in sets if not s.startswith("deepspeed.")]
    if recipe.ds_config is None and not recipe.ds_inline and not any("DDP" in n for n in recipe.notes):
        recipe.notes.append(f"{origin} names no DeepSpeed config: the run uses PyTorch DDP, simulated as DeepSpeed "
                            "ZeRO stage 0 (data parallel, gradients all-reduced)")
    args.recipe = origin if _is_file(origin) else None
    args.scenario = str(recipe.ds_config or NO_DEEPSPEED)
    if getattr(args, "model", None) is None:
        if recipe.model is None:
            raise ZsimInputError("--model", None, f"{origin} names no model (model_name_or_path); add --model "
                                 "NAME|config.json|hub-id")
        args.model = recipe.model
    gpu_attr = "gpus" if hasattr(args, "gpus") else "gpus_per_node"
    if getattr(args, gpu_attr, None) is None:
        if recipe.gpus_per_node is None:
            raise ZsimInputError("--gpus", None, f"{origin} names no GPU count (the launcher gives it); add --gpus N "
                                 "(GPUs per node) and --nodes K")
        setattr(args, gpu_attr, recipe.gpus_per_node)
    if getattr(args, "nodes", None) is None:
        args.nodes = recipe.nodes or 1
    if recipe.global_batch_size is not None:
        dp_micro = getattr(args, gpu_attr) * args.nodes * recipe.training.get("micro_batch_size", 1)
        if recipe.global_batch_size % dp_micro:
            raise ZsimInputError("global_batch_size", recipe.global_batch_size, f"must be divisible by the GPUs x "
                                 f"micro_batch_size ({dp_micro}), as LLaMA-Factory requires")
        sets = [*sets, f"training.gradient_accumulation_steps={recipe.global_batch_size // dp_micro}"]
    critic = recipe.rlhf.get("critic_model")
    if isinstance(critic, str):
        from zsim.config import hub
        from zsim.config.hf_config import preset_names
        from zsim.config.source import model_mapping
        if hub.is_repo_id(critic) and critic not in preset_names():
            path, where = hub.resolve(critic)
            _note(args, f"critic model {critic}: config.json from {where}")
            critic = str(path)
        sets = [*sets, f"rlhf.critic_model={model_mapping(critic, '--critic_model_name_or_path')}"]
    stem = Path(origin.split(" (")[-1].rstrip(")")).stem or "launch"
    args.recipe_set = (f"name={json.dumps(stem)}", *sets)
    for note in recipe.notes:
        _note(args, note)
    if recipe.ignored:
        _note(args, f"ignored (no effect zsim models): {', '.join(dict.fromkeys(recipe.ignored))}")


def _note(args, text: str):
    args.source_notes = [*getattr(args, "source_notes", []), text]


def _print_source_notes(args, overrides: tuple[str, ...]):
    """What resolve_source read (the Hub id's config.json, a launch's ignored flags, a tool's
    defaults), on stderr when the scenario loads: a refusal stays the one line that says why."""
    import sys

    from zsim.config.scenario import load_scenario
    notes = getattr(args, "source_notes", None)
    if not notes:
        return
    try:
        load_scenario(args.scenario, overrides)
    except ZsimInputError:
        return
    for text in notes:
        print(f"zsim: note: {text}", file=sys.stderr)
