"""Helpers to compare zsim's schedules with DeepSpeed 0.19.8's recorded collectives."""
from __future__ import annotations

import json
from pathlib import Path

from zsim.config.scenario import scenario_from_mapping
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import MEASURED_PASS

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
ROOT = Path(__file__).resolve().parents[1]


def load_fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def fixture_names() -> list[str]:
    return sorted(p.stem for p in FIXTURES.glob("*.json"))


def scenario_for(fx: dict):
    m = fx["model"]
    ds = dict(fx["ds_config"])
    precision = "bf16" if ds.get("bf16", {}).get("enabled") else "fp32"
    raw = {
        "name": fx["case"],
        "model": {"layers": m["layers"], "hidden": m["hidden"], "heads": m["heads"], "vocab": m["vocab"],
                  "seq_len": m["seq_len"], "ffn_hidden": m["ffn"], "tied_embeddings": False,
                  "position": "learned", "norm": "layernorm", "bias": True, "glu": False, "fused_qkv": True},
        "hardware": {"profile": "dgx-a100-80g", "nodes": 1, "gpus_per_node": fx["world_size"]},
        "training": {"seq_len": m["seq_len"], "precision": precision,
                     **({"preference": fx["preference"]} if "preference" in fx else {}),
                     **({"lora": fx["lora"]} if "lora" in fx else {})},
        "deepspeed": ds,
    }
    return scenario_from_mapping(raw, ROOT)


def recorded_steady_state(fx: dict) -> list[tuple[str, str, int]]:
    """Collectives of the last optimizer step, without the once-per-run trace-consistency
    broadcasts (zero/utils.py assert_ints_same_as_other_ranks) stage 3 issues when its
    module trace completes."""
    last = max(c["opt_step"] for c in fx["collectives"] if c["opt_step"] is not None)
    out = []
    for c in fx["collectives"]:
        if c["opt_step"] != last or c["phase"] == "init":
            continue
        if "zero/utils.py" in c.get("caller", ""):
            continue
        out.append((c["phase"], c["op"], c["numel"]))
    return out


def simulated(fx: dict) -> list[tuple[str, str, int]]:
    sc = scenario_for(fx)
    _, schedule = build_schedule(sc)
    return [(MEASURED_PASS[op.phase], op.comm.collective.value, op.comm.numel) for op in schedule.ops if op.comm]
