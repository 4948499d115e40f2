"""Small scenarios for unit tests."""
from __future__ import annotations

import copy
from pathlib import Path

from zsim.config.scenario import scenario_from_mapping
from zsim.schedule.ir import MODEL_STATES

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "name": "tiny",
    "model": {"layers": 2, "hidden": 256, "heads": 4, "vocab": 1024, "seq_len": 256, "tied_embeddings": False},
    "hardware": {"profile": "dgx-a100-80g", "nodes": 1, "gpus_per_node": 8},
    "training": {"micro_batch_size": 2, "gradient_accumulation_steps": 1, "seq_len": 256, "precision": "bf16"},
    # buckets sized to the tiny model (DeepSpeed allocates the full reduce_bucket_size)
    "deepspeed": {"zero_optimization": {"stage": 2, "reduce_bucket_size": 200000}},
}


def mapping(**changes) -> dict:
    """TINY with dotted-key changes, e.g. mapping(**{"deepspeed.zero_optimization.stage": 3})."""
    raw = copy.deepcopy(TINY)
    for dotted, value in changes.items():
        node = raw
        keys = dotted.split(".")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return raw


def scenario(**changes):
    return scenario_from_mapping(mapping(**changes), ROOT)


def model_states_held(sc) -> float:
    """The most model-state bytes alive at once in the simulated step: the static states plus the
    gradients that exist only during it (stage 1/2 16-bit gradients are allocated in backward
    and their partition is dropped after the step, as DeepSpeed does; see [Note: ZeRO-1/2 gradient lifetime])."""
    from zsim.api import run_scenario

    # every op simulated: a reused layer's copies are not in the trace's events (zsim/engine/layer_repeat.py)
    _, trace = run_scenario(sc, steady=False)
    live = peak = 0.0
    for _, delta, category, _ in trace.ledger_events:
        if category in MODEL_STATES:
            live += delta
            peak = max(peak, live)
    return peak


# -- hand-built schedules for engine tests ------------------------------------------------------
def add_gather(b, size_bytes: float, stream: str = "allgather", deps=(), alloc=()) -> int:
    from zsim.schedule.ir import Collective, OpKind, Phase, Stream
    from zsim.schedule.payloads import Comm, ParamGather
    return b.add(OpKind.PARAM_GATHER, Stream(stream), Phase.FORWARD, 0,
                 ParamGather(Comm(Collective.ALL_GATHER, 0, size_bytes)), deps, alloc)


def add_compute(b, deps=(), alloc=(), phase: str = "forward", **work) -> int:
    from zsim.schedule.ir import OpKind, Phase, Stream
    from zsim.schedule.payloads import ComputeWork, ModulePass
    kind = OpKind.BACKWARD if phase == "backward" else OpKind.FORWARD
    return b.add(kind, Stream.COMPUTE, Phase(phase), 0, ModulePass("m", ComputeWork(**work)), deps, alloc)


def add_copy(b, transfer: str, size_bytes: float) -> int:
    from zsim.schedule.ir import OpKind, Phase, Stream, Transfer
    from zsim.schedule.payloads import Copy
    stream = {"nvme_read": "nvme", "nvme_write": "nvme"}.get(transfer, transfer)
    return b.add(OpKind.GRAD_COPY, Stream(stream), Phase.STEP, 0, Copy(Transfer(transfer), size_bytes))


def build(b, stage: int = 3):
    from zsim.schedule.ir import HostSettings
    return b.build(stage, 8, HostSettings(pin_memory=True, cpu_cores_fraction=1.0, aio_block_size=1 << 20,
                                          aio_queue_depth=8, aio_thread_count=1, host_load_bytes_per_gpu=0.0))


# -- measured peaks (tests/fixtures/measured) ---------------------------------------------------
# what `zsim validate` predicts with: the run's one node, no CUDA context or allocator reserve
VALIDATE_SETS = ("hardware.nodes=1", "hardware.override.gpu.cuda_context_GiB=0",
                 "hardware.override.gpu.allocator_fragmentation_fraction=0")


def measured_cases(name: str) -> list[dict]:
    import json
    return json.loads((ROOT / "tests" / "fixtures" / "measured" / name).read_text())["cases"]


def peak_error(case: dict) -> float:
    """zsim's peak for a measured case ({"scenario", "set", "peak_bytes"}) relative to the measurement."""
    from zsim.api import run_scenario
    from zsim.config.scenario import load_scenario

    sc = load_scenario(str(ROOT / "benchmarks" / "validate_scenarios" / f"{case['scenario']}.yaml"),
                       (*case["set"], *VALIDATE_SETS))
    return run_scenario(sc)[0].memory.peak_bytes / case["peak_bytes"] - 1

