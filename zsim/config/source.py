"""What the user handed zsim where a scenario belongs: a scenario YAML, or a ds_config.json
(`zsim run ds_config.json --model NAME|config.json --gpus N [--nodes K] [--profile P]`).

A ds_config carries DeepSpeed's settings but not the model or the cluster; the flags fill them
in. They are shorthand for `--set` assignments, so the rest of zsim sees one scenario mapping
and one list of overrides whatever the source: `cluster_overrides` turns the flags into those
assignments and names the flags a ds_config still needs.
"""
from __future__ import annotations

import json
from pathlib import Path

from zsim.errors import ZsimInputError, did_you_mean
from zsim.schema import accepted_keys
from zsim.specs.deepspeed import IGNORED_TOP_LEVEL, REMOVED_TOP_LEVEL, DeepSpeedConfig
from zsim.config.hf_config import preset_names

SCENARIO_KEYS = ("name", "description", "model", "hardware", "training", "parallelism", "deepspeed", "inference", "rlhf")
# the profile a ds_config runs on when --profile is not given: the default scenario's
DEFAULT_PROFILE = "dgx-a100-80g"


def is_ds_config(data: dict) -> bool:
    """A mapping with no scenario block and at least one of DeepSpeed's top-level keys, or an
    empty one (`{}`: a ds_config of DeepSpeed's defaults, whose cluster the flags give)."""
    ds_keys = set(accepted_keys(DeepSpeedConfig)) | IGNORED_TOP_LEVEL | set(REMOVED_TOP_LEVEL) | {"bfloat16"}
    return not any(k in SCENARIO_KEYS for k in data) and (not data or any(k in ds_keys for k in data))


def as_scenario(data: dict, path: Path) -> dict:
    """A ds_config as a scenario mapping without model and hardware (the flags add them)."""
    return {"name": path.stem, "deepspeed": data}


def _model_assignment(model: str) -> str:
    """--model NAME (a preset), --model path/to/config.json (a Hugging Face config) or the
    model's folder holding its config.json (what from_pretrained is given)."""
    return f"model={model_mapping(model, '--model')}"


def model_mapping(model: str, flag: str) -> str:
    """A model as `flag` names it (a preset, a config.json, its folder), as a model: mapping in YAML."""
    if Path(model).is_dir():
        config = Path(model) / "config.json"
        if not config.is_file():
            raise ZsimInputError(flag, model, "is a folder without a config.json; give a preset, a Hugging Face "
                                 "config.json or the model folder that holds it")
        model = str(config)
    if model.endswith(".json") or Path(model).is_file():
        return f"{{hf_config: {json.dumps(model)}}}"
    names = preset_names()
    if model not in names:
        raise ZsimInputError(flag, model, f"unknown preset{did_you_mean(model, names)}; available: "
                             f"{', '.join(names)} or the path of a Hugging Face config.json")
    return f"{{preset: {json.dumps(model)}}}"


def cluster_overrides(source_is_ds_config: bool, source: str, model: str | None, gpus_per_node: int | None,
                      nodes: int | None, profile: str | None) -> tuple[str, ...]:
    """The --set assignments the flags stand for. A scenario file keeps what the flags do not
    name; a ds_config needs --model and --gpus (DeepSpeed's launcher --num_gpus: GPUs per node)."""
    if source_is_ds_config:
        missing = [flag for flag, value in (("--model NAME", model), ("--gpus N", gpus_per_node)) if value is None]
        if missing:
            raise ZsimInputError("scenario", source, f"is a ds_config.json, which names no model or cluster; add "
                                 f"{' '.join(missing)} (and optionally --nodes K, --profile P; default "
                                 f"{DEFAULT_PROFILE})")
        profile = profile or DEFAULT_PROFILE
        nodes = 1 if nodes is None else nodes
    out = [_model_assignment(model)] if model is not None else []
    out += [f"hardware.{key}={json.dumps(value)}" for key, value in
            (("profile", profile), ("nodes", nodes), ("gpus_per_node", gpus_per_node)) if value is not None]
    return tuple(out)
