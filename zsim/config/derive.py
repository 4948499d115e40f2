"""Overrides that derive: `--set hardware.nodes=4` or `--set training.gradient_accumulation_steps=16`
on a file that pins deepspeed.train_batch_size would contradict DeepSpeed's batch rule
(runtime/config.py _batch_assertion: train_batch_size == micro x GAS x data-parallel size).
When micro-batch and GAS are both fixed, train_batch_size is the dependent key: re-derive it as
DeepSpeed's rule does and say so. When one of them is free, DeepSpeed derives that one from
train_batch_size itself (_set_batch_related_parameters), and the loader reports a remainder.

A layout change (`parallelism.*`, the ds_config's `pipeline` / `tensor_parallel` blocks) alone
keeps the global batch instead: the same samples per optimizer step over a different
data-parallel size, so GAS is the dependent key (train_batch_size / (micro x DP)), the way a
Megatron-DeepSpeed run keeps --global-batch-size when it changes --tensor/--pipeline-model-parallel-size.
When the global batch does not divide by micro x the new DP, train_batch_size is re-derived instead.
"""
from __future__ import annotations

from pathlib import Path

from zsim.config.scenario import apply_set, load_raw, scenario_from_mapping
from zsim.errors import ZsimInputError

# keys whose change moves micro x GAS x data-parallel size (world / pipeline stages)
_LAYOUT = ("parallelism", "deepspeed.pipeline", "deepspeed.tensor_parallel")
_DEPENDS = ("hardware", *_LAYOUT, "training.micro_batch_size", "training.gradient_accumulation_steps",
            "deepspeed.train_micro_batch_size_per_gpu", "deepspeed.gradient_accumulation_steps")


# the same setting under the scenario's name and DeepSpeed's: overriding one carries the other
_MIRRORS = {("training", "micro_batch_size"): ("deepspeed", "train_micro_batch_size_per_gpu"),
            ("training", "gradient_accumulation_steps"): ("deepspeed", "gradient_accumulation_steps")}
_MIRRORS.update({v: k for k, v in list(_MIRRORS.items())})


def _get(raw: dict, block: str, key: str):
    node = raw.get(block)
    return node.get(key) if isinstance(node, dict) else None


def _mirrored(raw: dict, keys: list[str]) -> list[str]:
    """Assignments that carry an overridden batch key to its pinned twin."""
    out = []
    for (block, key), (tw_block, tw_key) in _MIRRORS.items():
        mine, twin = f"{block}.{key}", f"{tw_block}.{tw_key}"
        value, other = _get(raw, block, key), _get(raw, tw_block, tw_key)
        if mine in keys and twin not in keys and other not in (None, "auto") and value != other:
            out.append(f"{twin}={value}")
    return out


def _touches(key: str, prefixes=_DEPENDS) -> bool:
    return any(key == d or key.startswith(d + ".") for d in prefixes)


def _pinned(raw: dict, training_key: str, ds_key: str) -> bool:
    tr, ds = raw.get("training"), raw.get("deepspeed")
    return ((isinstance(tr, dict) and tr.get(training_key) is not None)
            or (isinstance(ds, dict) and ds.get(ds_key) not in (None, "auto")))


def rederive_batch(path: str | Path, overrides: tuple[str, ...],
                   base: tuple[str, ...] = ()) -> tuple[tuple[str, ...], str | None]:
    """`rederive_raw` on a scenario file (read only when the overrides move a batch key). `base`
    completes the file without moving anything: a ds_config names no cluster, so the --gpus /
    --nodes / --profile flags define its world rather than change it, and a train_batch_size
    that disagrees with that world is DeepSpeed's batch assertion to refuse, not to rewrite."""
    if _batch_keys_moved(overrides) is None:
        return (), None
    path = Path(path)
    try:
        raw = load_raw(path)
        for a in base:
            raw = apply_set(raw, a)
    except ZsimInputError:
        return (), None
    return rederive_raw(raw, overrides, path.parent, path.stem)


def _batch_keys_moved(overrides: tuple[str, ...]) -> tuple[list[str], list[str]] | None:
    """(every overridden key, those that move a batch key), or None when nothing is to derive:
    no batch key moves, or the user sets the deepspeed block or train_batch_size themselves."""
    keys = [a.split("=", 1)[0].strip() for a in overrides if "=" in a]
    changed = [k for k in keys if _touches(k)]
    if not changed or any(k in ("deepspeed", "deepspeed.train_batch_size") for k in keys):
        return None
    return keys, changed


_BATCH_FIELDS = frozenset({"deepspeed.train_batch_size", "deepspeed.gradient_accumulation_steps",
                           "deepspeed.train_micro_batch_size_per_gpu", "training.micro_batch_size",
                           "training.gradient_accumulation_steps"})


def rederive_raw(raw: dict, overrides: tuple[str, ...], base_dir: Path,
                 name: str) -> tuple[tuple[str, ...], str | None]:
    """(extra assignments, one-line note) when the overrides move a batch key that the mapping pins
    under its other name, or move the batch product while it pins train_batch_size;
    ((), None) when nothing needs deriving or the loader should speak."""
    moved = _batch_keys_moved(overrides)
    if moved is None:
        return (), None
    keys, changed = moved
    layout_only = all(_touches(k, _LAYOUT) for k in changed)
    try:
        pinned_tb = _get(raw, "deepspeed", "train_batch_size")
        for a in overrides:
            raw = apply_set(raw, a)
        mirrored = _mirrored(raw, keys)
        for a in mirrored:
            raw = apply_set(raw, a)
        if pinned_tb in (None, "auto") or not (
                _pinned(raw, "micro_batch_size", "train_micro_batch_size_per_gpu")
                and _pinned(raw, "gradient_accumulation_steps", "gradient_accumulation_steps")):
            derived: tuple[str, ...] = ()
        else:
            derived = _rederived(raw, base_dir, name, layout_only)
    except ZsimInputError as err:
        if err.field in _BATCH_FIELDS:
            return (), None      # the loader names the batch rule the keys break
        # the moved scenario is refused for another reason (a sequence TP does not divide, LoRA
        # with TP): that reason, not the batch mismatch re-derivation would have repaired
        raise
    extra = tuple(mirrored) + derived
    if not extra:
        return (), None
    what = "; ".join(f"{a.split('=')[0]} -> {a.split('=')[1]}" for a in extra)
    if any(a.startswith("deepspeed.train_batch_size=") for a in derived):
        rule = " (train_batch_size = micro-batch x GAS x GPUs, DeepSpeed's rule)"
    elif derived:
        rule = " (global batch kept: GAS = train_batch_size / (micro-batch x data-parallel size), DeepSpeed's rule)"
    else:
        rule = ""
    note = (f"{what}{rule} after --set {', '.join(changed)}; --set those keys yourself to keep other values")
    return extra, note


def _rederived(raw: dict, base_dir: Path, name: str, keep_global: bool) -> tuple[str, ...]:
    """The dependent batch key re-derived when the pinned train_batch_size no longer matches
    micro x GAS x data-parallel size: GAS when `keep_global` and the batch divides, else
    train_batch_size."""
    try:
        scenario_from_mapping(raw, base_dir, name_default=name)
        return ()                    # the product still matches
    except ZsimInputError as err:
        if err.field != "deepspeed.train_batch_size":
            return ()                # another problem: the loader reports it
    if keep_global:
        # DeepSpeed derives a free GAS from train_batch_size (runtime/config.py
        # _set_batch_related_parameters); write it back under each name the mapping pins
        pinned = [k for k in ("training.gradient_accumulation_steps", "deepspeed.gradient_accumulation_steps")
                  if _get(raw, *k.split(".")) not in (None, "auto")]
        free = raw
        for k in pinned:
            free = apply_set(free, f"{k}=null")
        try:
            sc = scenario_from_mapping(free, base_dir, name_default=name)
            return tuple(f"{k}={sc.gradient_accumulation_steps}" for k in pinned)
        except ZsimInputError:
            pass                     # the global batch does not divide: keep GAS, move the batch
    sc = scenario_from_mapping(apply_set(raw, "deepspeed.train_batch_size=null"), base_dir, name)
    return (f"deepspeed.train_batch_size={sc.global_batch_size}",)
