"""The CLI fuzzer: hypothesis strategies over everything a user hands zsim (scenario files,
ds_configs, --set values, hardware overrides, the other subcommands' arguments) and the one
property they must all meet (tests/commands/test_fuzz.py runs it).

Property: `zsim ...` exits 0 (or a documented verdict code: 1 tune found nothing that fits,
3 run --check predicts an OOM), or exits 2 with ONE stderr line `zsim: error: KEY: VALUE is
invalid; FIX`, never a traceback, and within TIME_BOUND_S. Values cover the classic breakers:
non-UTF-8 bytes, deep nesting, huge/NaN/inf/subnormal numbers, whole-number floats and
booleans where integers belong, unhashable values where a name belongs.

Valid-but-large gradient accumulation (65..65,536 micro-steps) is not drawn: the limit is one of
meaning (zsim.specs.deepspeed.MAX_GRADIENT_ACCUMULATION_STEPS), and simulating every micro-step
makes such a step take minutes until the engine reuses the steady state (issue 14);
test_fuzz.py checks the limit itself.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import typing

import yaml
from hypothesis import strategies as st

from tests.helpers import TINY
from zsim.specs.deepspeed import DeepSpeedConfig
from zsim.specs.hardware import HardwareProfile
from zsim.specs.model import ModelSpec
from zsim.specs.parallelism import ParallelismSpec
from zsim.specs.scenario import HardwareSpec, TrainingSpec



def _paths(cls, prefix: str) -> list[str]:
    """Every dotted key a dataclass accepts (names and DeepSpeed aliases), nested blocks included."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        names = [f.name] + ([f.metadata["alias"]] if f.metadata.get("alias") else [])
        tp = hints[f.name]
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        sub = inner[0] if inner else tp if dataclasses.is_dataclass(tp) else None
        for n in names:
            out.append(f"{prefix}.{n}")
            if sub is not None:
                out.extend(_paths(sub, f"{prefix}.{n}"))
    return out


KEY_PATHS = sorted(set(
    _paths(ModelSpec, "model") + _paths(HardwareSpec, "hardware") + _paths(TrainingSpec, "training")
    + _paths(DeepSpeedConfig, "deepspeed") + _paths(ParallelismSpec, "parallelism") + ["parallelism"]
    + [p.replace("hw", "hardware.override", 1) for p in _paths(HardwareProfile, "hw")]
    + ["deepspeed.bfloat16", "deepspeed.bfloat16.enabled", "deepspeed.communication_data_type",
       "deepspeed.scheduler", "deepspeed.pipeline", "name", "description", "model.preset", "model.nope",
       "deepspeed.zero_optimization.typo_key"]))

# integers that are small (cheap to simulate) or past a limit; never the valid-but-slow band
_INTS = st.one_of(st.integers(-3, 64), st.sampled_from([0, -1, 1024, 1025, 2**16 + 1, 2**18 + 1, 2**31,
                                                         2**63 - 1, 2**63, 2**64, 10**30, 10**400]))
_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([5e-324, 1e-300, 1e-9, 0.5, 1.0, 2.0, 64.0, 1e30, 1e300, float("nan"),
                                     float("inf"), -0.0]))
_STRINGS = st.one_of(st.text(max_size=12), st.sampled_from(
    ["auto", "none", "cpu", "nvme", "fp16", "bf16", "bfp16", "gpt2", "5e8", "1e400", "nan", "true", "2.0",
     "\udcff\udcfe", "dgx-h100", "llama3-8b", "x" * 300]))
SCALARS = st.one_of(st.none(), st.booleans(), _INTS, _FLOATS, _STRINGS)


@dataclasses.dataclass(frozen=True)
class Deep:
    """A value nested `depth` levels ([{k: [{k: ... 1}]}]), kept symbolic so hypothesis can print
    and shrink it; `text()` spells it out for a file or a --set value."""
    depth: int

    def text(self) -> str:
        half = self.depth // 2
        return '{"k": [' * half + "1" + "]}" * half

    @property
    def token(self) -> str:
        return f"__deep_{self.depth}__"


def _swap_deep(value, found: list):
    if isinstance(value, Deep):
        found.append(value)
        return value.token
    if isinstance(value, dict):
        return {k: _swap_deep(v, found) for k, v in value.items()}
    if isinstance(value, list):
        return [_swap_deep(v, found) for v in value]
    return value


def _spell(dump, value) -> str:
    found: list[Deep] = []
    text = dump(_swap_deep(value, found))
    for d in found:
        text = text.replace(repr(d.token), d.text()).replace(json.dumps(d.token), d.text()).replace(d.token, d.text())
    return text


VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.lists(st.lists(SCALARS, max_size=2), max_size=3),
    st.dictionaries(st.sampled_from(["device", "enabled", "stage", "x", "nvme_path"]), SCALARS, max_size=3),
    st.builds(Deep, st.integers(60, 3000)),
)


def set_text(value) -> str:
    """A value as the user would type it after `--set key=` (YAML flow style)."""
    if isinstance(value, str):
        return value
    return _spell(lambda v: yaml.safe_dump(v, default_flow_style=True, width=10**6).strip()
                  .removesuffix("...").strip(), value)


@st.composite
def mutated_scenarios(draw) -> dict:
    """The tiny scenario with 1-4 keys set to arbitrary values (or removed)."""
    raw = copy.deepcopy(TINY)
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(KEY_PATHS)).split(".")
        node = raw
        for k in path[:-1]:
            nxt = node.get(k) if isinstance(node, dict) else None
            if not isinstance(nxt, dict):
                nxt = {}
                if isinstance(node, dict):
                    node[k] = nxt
            node = nxt
        if draw(st.integers(0, 9)) == 0:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = draw(VALUES)
    return raw


@st.composite
def set_assignments(draw) -> list[str]:
    out = []
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.one_of(st.sampled_from(KEY_PATHS), st.text(max_size=10)))
        out.append(f"{key}={set_text(draw(VALUES))}")
    return out


def ds_configs() -> st.SearchStrategy[dict]:
    """A ds_config.json: the tiny scenario's deepspeed block with mutations, batch keys included."""
    return mutated_scenarios().map(lambda raw: raw.get("deepspeed") if isinstance(raw.get("deepspeed"), dict)
                                   else {"zero_optimization": {"stage": 2}})


def dump_yaml(raw) -> str:
    return _spell(lambda v: yaml.safe_dump(v, allow_unicode=False), raw)


def dump_json(raw) -> str:
    return _spell(lambda v: json.dumps(v, default=str), raw)
