"""Validation cases drawn at random from the configuration space a DeepSpeed user meets, for
benchmarks/validate_random.py (pure python: no torch, no launch).

The matrix of benchmarks/validate_matrix.py is where the CPU profile and the model were tuned;
figures from it say little about configurations nobody tuned on. Here each case draws every
dimension uniformly and independently from its options, from a seeded `random.Random`, so a
seed names a fixed list of cases and a fresh seed a held-out one.

Sizes are drawn among DeepSpeed's own default (written out explicitly, since the validate
scenarios pin a reduce_bucket_size), the HF Trainer's "auto" (resolved by zsim.config as
transformers' HfTrainerDeepSpeedConfig does) and explicit values around the models' parameter
sizes. The ZeRO-3 keys are drawn only at stage 3 (DeepSpeed reads them only there).
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from zsim.specs.deepspeed import ZeroConfig

Z = "deepspeed.zero_optimization."
DEFAULT = "default"     # the option "DeepSpeed's default value"
AUTO = "auto"           # the option "HF Trainer's auto"

MODELS = ("small", "medium")        # benchmarks/validate_scenarios/*.yaml: 3.7M and 21M params
WORLD_SIZES = (2, 4)
STAGES = (0, 1, 2, 3)
PRECISIONS = ("bf16", "fp32")
GAS = (1, 2, 3, 4)
OVERLAP_COMM = (DEFAULT, True, False)          # default: true at stage 3, false below (zero/config.py)
CONTIGUOUS_GRADIENTS = (True, False)
OFFLOAD_OPTIMIZER = ("none", "cpu")            # ZeRO-Offload: stages 1-3 only
# per ds_config key: the options drawn (explicit values in elements)
REDUCE_BUCKET = (DEFAULT, AUTO, 5e5, 2e6, 1e7)
STAGE3_SIZES = {
    "stage3_prefetch_bucket_size": (DEFAULT, AUTO, 0, 2e5, 1e6),
    "stage3_param_persistence_threshold": (DEFAULT, AUTO, 0, 1e4),
    "stage3_max_live_parameters": (DEFAULT, 5e5, 2e6),
    "stage3_max_reuse_distance": (DEFAULT, 0),
}


def deepspeed_default(key: str):
    """DeepSpeed's default of a zero_optimization key, as zsim's ZeroConfig holds it (by name or
    by its stage3_ alias)."""
    for f in dataclasses.fields(ZeroConfig):
        if key in (f.name, f.metadata.get("alias")):
            return f.default
    raise KeyError(key)


@dataclass(frozen=True)
class RandomCase:
    name: str
    scenario: str                   # benchmarks/validate_scenarios/<scenario>.yaml
    world_size: int
    draws: tuple[tuple[str, object], ...]   # (dimension, option drawn), for the report
    overrides: tuple[str, ...]      # `zsim validate --set` values

    @property
    def offloaded(self) -> bool:
        return dict(self.draws).get("offload_optimizer", "none") != "none"


def _size(key: str, option) -> str:
    value = deepspeed_default(key) if option == DEFAULT else option
    return f"{Z}{key}={value if value == AUTO else int(value)}"


def draw_case(rng: random.Random, name: str, offload: bool = True) -> RandomCase:
    """One case; every dimension drawn uniformly from its options, in a fixed order. The offload
    draw is always made (a seed names the same other draws either way) and kept when `offload`."""
    stage = rng.choice(STAGES)
    draws = {"model": rng.choice(MODELS), "world": rng.choice(WORLD_SIZES), "stage": stage,
             "precision": rng.choice(PRECISIONS), "gas": rng.choice(GAS),
             "overlap_comm": rng.choice(OVERLAP_COMM), "contiguous_gradients": rng.choice(CONTIGUOUS_GRADIENTS),
             "reduce_bucket_size": rng.choice(REDUCE_BUCKET),
             "offload_optimizer": rng.choice(OFFLOAD_OPTIMIZER)}
    if stage == 0 or not offload:
        draws["offload_optimizer"] = "none"
    if stage == 3:
        draws.update({k: rng.choice(v) for k, v in STAGE3_SIZES.items()})
    ov = [f"{Z}stage={stage}", f"training.precision={draws['precision']}",
          f"training.gradient_accumulation_steps={draws['gas']}", f"hardware.gpus_per_node={draws['world']}",
          f"{Z}contiguous_gradients={str(draws['contiguous_gradients']).lower()}",
          _size("reduce_bucket_size", draws["reduce_bucket_size"])]
    if draws["overlap_comm"] != DEFAULT:
        ov.append(f"{Z}overlap_comm={str(draws['overlap_comm']).lower()}")
    if draws["offload_optimizer"] != "none":
        ov.append(f"{Z}offload_optimizer={{device: {draws['offload_optimizer']}}}")
    ov += [_size(k, draws[k]) for k in STAGE3_SIZES if k in draws]
    return RandomCase(name, draws["model"], draws["world"], tuple(draws.items()), tuple(ov))


def sample(seed: int, n: int, offload: bool = True) -> list[RandomCase]:
    """The first n cases of seed `seed` (a longer draw extends a shorter one); `offload` False
    when an engine of the run cannot run an offloaded optimizer."""
    rng = random.Random(seed)
    return [draw_case(rng, f"s{seed}-{i:02d}", offload) for i in range(n)]


def describe(case: RandomCase) -> str:
    """A short label of the draws, e.g. `small w2 z3 bf16 gas2 ov=default cg rb=auto pf=0 ...`."""
    d = dict(case.draws)
    short = {"stage3_prefetch_bucket_size": "pf", "stage3_param_persistence_threshold": "pt",
             "stage3_max_live_parameters": "ml", "stage3_max_reuse_distance": "rd"}
    parts = [d["model"], f"w{d['world']}", f"z{d['stage']}", d["precision"], f"gas{d['gas']}",
             f"ov={d['overlap_comm']}", "cg" if d["contiguous_gradients"] else "nocg",
             f"rb={d['reduce_bucket_size']:g}" if not isinstance(d["reduce_bucket_size"], str)
             else f"rb={d['reduce_bucket_size']}"]
    parts += [f"{s}={d[k]:g}" if not isinstance(d[k], str) else f"{s}={d[k]}" for k, s in short.items() if k in d]
    if d["offload_optimizer"] != "none":
        parts.append(f"offload={d['offload_optimizer']}")
    return " ".join(parts)
