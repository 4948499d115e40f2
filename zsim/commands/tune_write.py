"""zsim tune --write on an accelerate config YAML and on a launch script: the best configuration
written back in the user's own file, beside it (zsim.config.accelerate_writer,
zsim.config.launch_writer); the notes say what was written and what the user must give by hand.
The axolotl / LLaMA-Factory recipe writer is zsim.commands.tune's `_write_recipe`."""
from __future__ import annotations

import json
import os
from pathlib import Path

from zsim.errors import ZsimInputError


def _ref(target: Path, base: Path) -> str:
    """`target` relative to `base` when it sits under it, else absolute."""
    rel = os.path.relpath(target.resolve(), base.resolve())
    return str(target.resolve()) if rel.startswith("..") else rel


def trainer_flags(best, start) -> tuple[list[str], list[str]]:
    """(the HF Trainer's arguments the winner changes, notes): the micro-batch, GAS and checkpointing
    are the training script's arguments, not keys of the file."""
    flags, notes = [], []
    if best.micro_batch != start.micro_batch_size:
        flags.append(f"--per_device_train_batch_size {best.micro_batch}")
    if best.gas != start.gradient_accumulation_steps:
        flags.append(f"--gradient_accumulation_steps {best.gas}")
    if best.checkpointing != start.training.activation_checkpointing:
        if best.checkpointing == "selective":
            notes.append("the best configuration checkpoints selectively, which the HF Trainer's "
                         "--gradient_checkpointing cannot say")
        else:
            flags.append("--gradient_checkpointing" + ("" if best.checkpointing == "full" else " false"))
    return flags, notes


def write_accelerate(args, base, best, cfg: dict) -> list[str]:
    """The accelerate config with the plugin keys the winner changes (NAME.tuned.yaml), or, where
    the tuned ds_config needs keys the inline plugin cannot set or the plugin names a file, the
    ds_config written as a file the plugin's deepspeed_config_file names."""
    from zsim.config import accelerate_writer as aw
    from zsim.config.recipe_writer import set_nested, set_top_level
    from zsim.inputs import mapping_or_empty, parse_yaml, read_text
    from zsim.report.writers import save

    recipe, out = Path(args.recipe), Path(args.out)
    text = read_text(recipe, "recipe", "an accelerate config")
    data = parse_yaml(text, "recipe", str(recipe))
    plugin = mapping_or_empty(data.get(aw.PLUGIN))
    start, base_ds = base.scenario(()), base.raw.get("deepspeed") or {}
    notes, written = [], []
    ref = plugin.get("deepspeed_config_file")
    if ref not in (None, "", "none"):
        if cfg != base_ds:
            save(str(out), json.dumps(cfg, indent=2) + "\n")
            new_ref = str(Path(str(ref)).with_name(out.name))
            text = set_nested(text, aw.PLUGIN, "deepspeed_config_file", new_ref)
            written.append(f"{aw.PLUGIN}.deepspeed_config_file: {new_ref}")
    else:
        keys, other = aw.plugin_changes(base_ds, cfg, start.zero.optimizer_offload_device != "none")
        if (keys or other) and str(data.get("distributed_type", "NO")).upper() != "DEEPSPEED" and not other:
            text = set_top_level(text, "distributed_type", "DEEPSPEED")
            written.append("distributed_type: DEEPSPEED")
            notes.append(f"the best configuration runs ZeRO stage {best.stage}: {args.recipe_out} launches DeepSpeed "
                         f"instead of PyTorch DDP ({data.get('distributed_type')})")
        if other:
            save(str(out), json.dumps(aw.file_config(cfg, data), indent=2) + "\n")
            text, moved_written, moved = aw.file_plugin(text, data, _ref(out, Path.cwd()))
            written += moved_written
            was = f"; {', '.join(moved)} moved into it" if moved else ""
            precision = f", mixed_precision {data['mixed_precision']} as its 16-bit block" \
                if data.get("mixed_precision") is not None else ""
            notes.append(f"{out}: the tuned ds_config needs {', '.join(other)}, which accelerate's inline "
                         f"DeepSpeed plugin cannot set: {args.recipe_out} names it as deepspeed_config_file "
                         f"(accelerate takes the file or the inline keys, not both{was}{precision})")
        else:
            text, inline = aw.inline_plugin(text, keys)
            written += inline
    if best.layout.sequence != start.sequence_parallel_size:
        # DeepSpeed-Ulysses is accelerate's parallelism_config, beside whichever ds_config the run
        # passes (see [Note: DeepSpeed-Ulysses])
        text = set_nested(text, "parallelism_config", "parallelism_config_sp_size", best.layout.sequence)
        written.append(f"parallelism_config.parallelism_config_sp_size: {best.layout.sequence}")
        if best.layout.sequence > 1:
            text = set_nested(text, "parallelism_config", "parallelism_config_sp_backend", "deepspeed")
    save(args.recipe_out, text)
    notes.append(f"{args.recipe_out}: {recipe.name} with " + ("; ".join(written) if written else "no key changed")
                 + " (every other line as written)")
    flags, more = trainer_flags(best, start)
    if flags:
        notes.append(f"the micro-batch, GAS and checkpointing are the training script's arguments, not accelerate "
                     f"keys: give the HF Trainer {' '.join(flags)}")
    return notes + more


def launch_recipe(script: Path):
    """(the script's text, the launch's first line, its words as written, expanded, its Recipe)."""
    from zsim.config.launch import find_launch, read_launch, read_script
    from zsim.inputs import read_text
    text = read_text(script, "launch script", "a shell script holding the launch command")
    line_no, raw, _ = find_launch(text, script, dict(os.environ))
    expanded, env = read_script(script)
    return text, line_no, raw, expanded, read_launch(expanded, script.parent.resolve(), str(script), env)


def check_launch(args):
    """Refuse, before any simulation, a launch whose DeepSpeed settings are accelerate's own
    (a --config_file plugin or accelerate launch's plugin flags): its script's --deepspeed would
    meet accelerate's check against both (see [Note: accelerate's plugin keys beside a
    deepspeed_config_file])."""
    script = Path(args.launch_script)
    _, _, _, _, rec = launch_recipe(script)
    if rec.ds_inline and rec.ds_config is None:
        raise ZsimInputError("--write", str(script), "its DeepSpeed settings are accelerate's (the --config_file plugin "
                             "or accelerate launch's flags), which zsim tune cannot write back into a script: run "
                             "zsim tune ACCELERATE_CONFIG.yaml --write")


def write_launch(args, base, best, cfg: dict) -> list[str]:
    """NAME.tuned.sh: the launch with the training script's flags the winner changes edited in
    place, --deepspeed pointing at the tuned ds_config (written beside the original, or beside
    the script), or the recipe it hands on pointing at the tuned recipe."""
    from zsim.config.launch import _at
    from zsim.config.launch_writer import script_flags, tuned_launch
    from zsim.report.writers import save

    script = Path(args.launch_script)
    text, line_no, raw, expanded, rec = launch_recipe(script)
    cwd = script.parent.resolve()
    start = base.scenario(())
    notes: list[str] = []
    replace: dict[int, str] = {}
    kwargs: dict = {}
    if args.recipe_out:
        # the recipe carries the tuned keys (written by _write_recipe): the script names the tuned one
        at = next(i for i, w in enumerate(expanded) if _at(cwd, w).resolve() == Path(args.recipe).resolve())
        replace[at] = str(Path(expanded[at]).with_name(Path(args.recipe_out).name))
        if "$" in raw[at]:
            notes.append(f"{raw[at]} (= {expanded[at]}) in {script.name}: written as {replace[at]}")
    else:
        flag = "deepspeed_config" if rec.framework == "deepspeed" else "deepspeed"
        if rec.framework != "deepspeed":        # DeepSpeed's own loop reads the batch from the ds_config
            micro_batch = best.micro_batch if best.micro_batch != start.micro_batch_size else None
            gas = best.gas if best.gas != start.gradient_accumulation_steps else None
            kwargs.update(micro_batch=micro_batch, gas=gas)
            if best.checkpointing != start.training.activation_checkpointing:
                if best.checkpointing == "selective":
                    notes.append(f"the best configuration checkpoints selectively, which the HF Trainer's "
                                 f"--gradient_checkpointing cannot say: {args.launch_out} keeps the script's")
                else:
                    kwargs["checkpointing"] = best.checkpointing
        if cfg != (base.raw.get("deepspeed") or {}):
            out = Path(args.out)
            given = script_flags(expanded, rec.script_index + 1).get(flag) if rec.ds_config is not None else None
            if given is not None and given.value is not None:
                word = expanded[given.value].partition("=")[2] if given.inline else expanded[given.value]
                kwargs["deepspeed"] = str(Path(word).with_name(out.name)) \
                    if _at(cwd, word).resolve().parent == out.resolve().parent else _ref(out, cwd)
            else:
                kwargs["deepspeed"] = _ref(out, cwd)
            kwargs["deepspeed_flag"] = flag
    index = rec.script_index if rec.script_index is not None else len(raw)
    new, written, more = tuned_launch(text, line_no, raw, index, script.name, values=expanded, words=replace,
                                      **kwargs)
    save(args.launch_out, new)
    notes += more
    notes.append(f"{args.launch_out}: {script.name} with " + ("; ".join(written) if written else "no flag changed")
                 + " (every other byte as written)")
    gpus, nodes = getattr(args, "gpus", None), getattr(args, "nodes", None)
    if (rec.gpus_per_node, rec.nodes or 1) != (gpus, nodes or 1) and rec.gpus_per_node is not None:
        notes.append(f"tuned for {gpus} GPUs per node x {nodes or 1} node(s) (--gpus/--nodes); the launcher says "
                     f"{rec.gpus_per_node} x {rec.nodes or 1}: left as written")
    return notes
