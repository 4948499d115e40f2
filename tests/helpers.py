"""What the tests share, in one module: small scenarios, hand-built schedules, the CLI in process
and as a subprocess, the training core under torchrun, DeepSpeed's recorded collectives, synthetic
calibration records, golden figures and the variants the exactness tests sweep.

The tests mirror the packages they test (tests/engine, tests/schedule, tests/workload, ...);
tests/house holds the checks on the project as a whole (imports, notes, pyflakes, types)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from calibration.harness.plan import LayerShape, layer_gemms
from zsim.api import run_file, run_scenario
from zsim.config.scenario import scenario_from_mapping
from zsim.hardware.collectives import Tier, ring_cost
from zsim.result import Result
from zsim.schedule.build import build_schedule
from zsim.schedule.ir import MEASURED_PASS, MODEL_STATES
from zsim.search.variants import Base, Variant
from zsim.units import GiB

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

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
    return json.loads((FIXTURES / "measured" / name).read_text())["cases"]


def peak_error(case: dict) -> float:
    """zsim's peak for a measured case ({"scenario", "set", "peak_bytes"}) relative to the measurement."""
    from zsim.config.scenario import load_scenario

    sc = load_scenario(str(ROOT / "benchmarks" / "validate_scenarios" / f"{case['scenario']}.yaml"),
                       (*case["set"], *VALIDATE_SETS))
    return run_scenario(sc)[0].memory.peak_bytes / case["peak_bytes"] - 1


# -- the CLI in process (tests/commands/fuzz.py's property; the search tools' tests) ------------
# one example, in process, on the tiny model (the slowest valid draws, 1,024 layers or 2**18
# GPUs, simulate in about a second)
TIME_BOUND_S = 20.0
VERDICT_CODES = {0, 1, 3}


@dataclasses.dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str
    wall_s: float


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_cli(argv: list[str], time_bound_s: float = TIME_BOUND_S) -> Outcome:
    """zsim.cli.main in this process, output captured; a run past the bound raises _Timeout
    (SIGALRM), so a hang fails the example instead of the whole test session."""
    from zsim.cli import main
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, time_bound_s)
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:   # argparse's own refusals
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return Outcome(code, out.getvalue(), err.getvalue(), time.perf_counter() - t0)


def check(outcome: Outcome, argv) -> None:
    """The property. (An exception escaping main, i.e. a traceback, fails the example by itself.)"""
    assert outcome.code in VERDICT_CODES | {2}, (argv, outcome)
    if outcome.code == 2:
        lines = [ln for ln in outcome.stderr.splitlines() if ln.startswith("zsim: error:")]
        assert len(lines) == 1, (argv, outcome.stderr)
        assert "Traceback" not in outcome.stderr
        line = lines[0]
        assert " is invalid; " in line or line.startswith("zsim: error: argument ") or "--help" in line, line
    assert outcome.wall_s < TIME_BOUND_S, (argv, outcome.wall_s)


# -- calibration: synthetic records and runs, the zsim CLI as a subprocess -----------------------
SIZES = [1024 * 4**i for i in range(8)]


def coll_records(tier: Tier, n=2, ops=("all_gather", "all_reduce", "broadcast")):
    return [{"kind": "collective", "op": op, "group": "world", "tier": "intra_node", "ranks": n, "dtype": "fp32",
             "size_bytes": s, "time_s": ring_cost(op.removesuffix("_coalesced"), s, n, tier, "intra_node",
                                                  op.endswith("_coalesced")).time_s}
            for op in ops for s in SIZES]


def compute_records(dtype: str, slowdown: float = 1.0) -> list[dict]:
    """One layer's GEMM, attention, memory-bound and layer records in `dtype`, every kernel
    `slowdown` times slower than the bf16 reference (an emulated dtype)."""
    L = {"hidden": 128, "heads": 2, "seq_len": 64, "micro_batch": 1}
    recs = [{"kind": "gemm", "dtype": dtype, "module": name, "pass": pas, "m": m, "n": n, "k": k,
             "flops": 2.0 * m * n * k, "time_s": slowdown * 2.0 * m * n * k / 1e11}
            for name, pas, m, n, k in layer_gemms(LayerShape(**L))]
    return recs + [{"kind": "attention", "dtype": dtype, "pass": "fwd", "flops": 1e6, "time_s": slowdown * 1e-4},
                   {"kind": "attention", "dtype": dtype, "pass": "bwd", "flops": 2.5e6, "time_s": slowdown * 5e-4},
                   {"kind": "membound", "dtype": dtype, "pass": "fwd", "bytes": 1e5, "time_s": slowdown * 1e-5},
                   {"kind": "layer", "dtype": dtype, "layer": "x", "pass": "fwd", **L, "time_s": slowdown * 1e-3},
                   {"kind": "layer", "dtype": dtype, "layer": "x", "pass": "bwd", **L, "time_s": slowdown * 2e-3}]


def synthetic_run():
    recs = coll_records(Tier(4e9, 30e-6, ((1024, 0.05), (1 << 24, 1.0)))) + compute_records("bf16")
    recs += [{"kind": "kernel_overhead", "time_s": 3e-6}, {"kind": "autograd_overhead", "time_s": 13e-6},
             {"kind": "memcpy", "where": "host", "GBps": 20.0, "time_s": 1e-3},
             {"kind": "adam", "impl": "torch.optim.Adam(fused)", "device": "cpu", "params": 100, "threads": 2,
              "params_per_s": 4e8, "time_s": 1e-3},
             {"kind": "file_io", "op": "read", "node_GBps": 2.0, "o_direct": True, "time_s": 1.0},
             {"kind": "file_io", "op": "write", "node_GBps": 1.0, "o_direct": True, "time_s": 1.0},
             {"kind": "interference", "gemm_alone_s": 1.0, "gemm_during_comm_s": 1.25, "comm_alone_s": 1.0,
              "comm_during_gemm_s": 2.0}]
    prov = {"world_size": "2", "ranks_per_node": "2", "nodes": "1", "backend": "gloo", "cpu_cores": "2",
            "host_memory_GiB": "16", "mode": "quick", "date": "2026-01-01T00:00:00Z", "hosts": "h"}
    return recs, prov


def zsim_cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "zsim.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout)


def run_doc(tmp_path, name, factor, date, **prov_changes):
    """A complete run whose all-reduce calls take factor * k ms at the k-th size."""
    recs, prov = synthetic_run()
    recs = [r for r in recs if r["kind"] != "collective"]
    recs += [{"kind": "collective", "op": "all_reduce", "group": "world", "tier": "intra_node", "ranks": 2,
              "dtype": "bf16", "size_bytes": s, "time_s": factor * 1e-3 * k, "times_s": [factor * 1e-3 * k] * 4}
             for k, s in enumerate(SIZES, start=1)]
    prov = {**prov, "date": date, **prov_changes}
    d = tmp_path / "calibration" / "runs" / name
    d.mkdir(parents=True)
    (d / "records.json").write_text(json.dumps({"format": 1, "status": "complete", "error": "", "provenance": prov,
                                                "plan": {}, "records": recs}))
    return d, recs, prov


# -- the training core under torchrun ------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_core(tmp_path, sc_yaml: Path, steps: int, nproc: int = 2, memory: bool = False):
    out = tmp_path / "m.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
           "-m", "calibration.core.run", "--scenario", str(sc_yaml), "--steps", str(steps), "--warmup", "0",
           "--out", str(out)] + ([] if memory else ["--no-memory"])
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-2000:]
    return json.loads(out.read_text())


# -- DeepSpeed 0.19.8's recorded collectives (tests/fixtures/deepspeed) --------------------------
DEEPSPEED = FIXTURES / "deepspeed"


def load_fixture(name: str) -> dict:
    return json.loads((DEEPSPEED / f"{name}.json").read_text())


def fixture_names() -> list[str]:
    return sorted(p.stem for p in DEEPSPEED.glob("*.json"))


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
        if "zero/utils.py" in (c.get("caller") or ""):
            continue
        out.append((c["phase"], c["op"], c["numel"]))
    return out


def simulated(fx: dict) -> list[tuple[str, str, int]]:
    sc = scenario_for(fx)
    _, schedule = build_schedule(sc)
    return [(MEASURED_PASS[op.phase], op.comm.collective.value, op.comm.numel) for op in schedule.ops if op.comm]


# -- golden results: the figures a user reads for every shipped scenario, rounded to 6
# significant digits so a deliberate model change shows up as a reviewable diff ------------------
SCENARIOS = ROOT / "scenarios"
GOLDEN = ROOT / "tests" / "golden"


def _r(x):
    return float(f"{x:.6g}") if isinstance(x, float) else x


def golden_view(result: Result) -> dict:
    mem, comm = result.memory, result.comm
    return {
        "n_params": result.n_params,
        "world_size": result.world_size,
        "step_time_s": _r(result.step_time_s),
        "tokens_per_s_per_gpu": _r(result.tokens_per_s_per_gpu),
        "mfu": _r(result.mfu),
        "peak_bytes": _r(mem.peak_bytes),
        "fits": mem.fits,
        "host_fits": mem.host.fits,
        "breakdown": {k: _r(v) for k, v in mem.breakdown.items()},
        "calls": comm.calls,
        "bytes_per_gpu": {k: _r(v) for k, v in comm.bytes_per_gpu.items()},
        "exposed_time_s": _r(comm.exposed_time_s),
    }


def scenario_files() -> list[Path]:
    return sorted(SCENARIOS.glob("*.yaml"))


def compute(path: Path) -> dict:
    return golden_view(run_file(path)[0])


# -- the exactness tests' variants: every shortcut's result equals simulating every op ----------
ZERO = "deepspeed.zero_optimization"
VARIANTS = {
    "stage0": {f"{ZERO}.stage": 0},
    "stage1": {f"{ZERO}.stage": 1},
    "stage1-overlap": {f"{ZERO}.stage": 1, f"{ZERO}.overlap_comm": True},
    "stage1-bf16-optimizer": {f"{ZERO}.stage": 1, "deepspeed.data_types": {"grad_accum_dtype": "fp32"}},
    "stage2": {f"{ZERO}.stage": 2},
    "stage2-overlap-no-contiguous": {f"{ZERO}.stage": 2, f"{ZERO}.overlap_comm": True,
                                     f"{ZERO}.contiguous_gradients": False},
    "stage2-offload-cpu": {f"{ZERO}.stage": 2, f"{ZERO}.offload_optimizer": {"device": "cpu"}},
    "stage2-offload-nvme": {f"{ZERO}.stage": 2, f"{ZERO}.offload_optimizer": {"device": "nvme"}},
    "stage3": {f"{ZERO}.stage": 3},
    "stage3-fp16": {f"{ZERO}.stage": 3, "training.precision": "fp16"},
    "stage3-offload-cpu": {f"{ZERO}.stage": 3, f"{ZERO}.offload_optimizer": {"device": "cpu"},
                           f"{ZERO}.offload_param": {"device": "cpu"}},
    "stage3-offload-nvme": {f"{ZERO}.stage": 3, f"{ZERO}.offload_optimizer": {"device": "nvme"},
                            f"{ZERO}.offload_param": {"device": "nvme"}},
    "stage3-selective": {f"{ZERO}.stage": 3, "training.activation_checkpointing": "selective"},
    "stage3-full": {f"{ZERO}.stage": 3, "training.activation_checkpointing": "full"},
    "stage2-full-cpu-checkpointing": {f"{ZERO}.stage": 2, "training.activation_checkpointing": "full",
                                      "deepspeed.activation_checkpointing": {"cpu_checkpointing": True}},
    "stage1-selective": {f"{ZERO}.stage": 1, "training.activation_checkpointing": "selective"},
}
# per-parameter gradients reduced on the reduction stream while the next micro-step computes:
# the overlap shifts a little every micro-step and never settles, so every micro-step is simulated
NEVER_SETTLES = {"stage2-overlap-no-contiguous"}


def same_result(steady, full):
    assert steady.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert steady.memory.peak_bytes == full.memory.peak_bytes
    assert steady.memory.breakdown == full.memory.breakdown
    assert steady.memory.host == full.memory.host
    assert steady.comm.calls == full.comm.calls
    assert steady.comm.bytes_per_gpu == pytest.approx(full.comm.bytes_per_gpu, rel=1e-12)
    assert steady.comm.time_s == pytest.approx(full.comm.time_s, rel=1e-9)
    assert steady.comm.exposed_time_s == pytest.approx(full.comm.exposed_time_s, rel=1e-9, abs=1e-12)
    assert steady.compute_time_s == pytest.approx(full.compute_time_s, rel=1e-9)
    assert steady.hfu == pytest.approx(full.hfu, rel=1e-9)
    assert steady.host_time_s == pytest.approx(full.host_time_s, rel=1e-9)
    assert steady.events == full.events


# buckets, prefetch and reuse distance smaller than a layer, as a large model's are next to
# DeepSpeed's defaults (the tiny model is smaller than the defaults: every param stays gathered),
# and enough tokens that a layer's compute outlasts its reductions (else they fall further behind
# every layer and never repeat)
LAYER_SIZED = {"training.micro_batch_size": 4, "training.seq_len": 1024, "model.seq_len": 1024,
               f"{ZERO}.reduce_bucket_size": 1_000_000, f"{ZERO}.stage3_prefetch_bucket_size": 5_000_000,
               f"{ZERO}.stage3_max_reuse_distance": 1_000_000, f"{ZERO}.stage3_max_live_parameters": 30_000_000}
LAYER_MODELS = {
    "gpt-32": {"model.layers": 32, "model.hidden": 1024, "model.heads": 16, **LAYER_SIZED},
    "llama-28": {"model.layers": 28, "model.hidden": 768, "model.heads": 12, "model.glu": True,
                 "model.norm": "rmsnorm", "model.position": "rope", "model.bias": False, "model.fused_qkv": False,
                 "model.tied_embeddings": True, **LAYER_SIZED},
}


def equal_results(steady, full):
    same_result(steady, full)
    a, b = steady.to_dict(), full.to_dict()
    for key in ("events", "comm", "memory", "step_time_s", "compute_time_s", "hfu", "host_time_s"):
        a.pop(key), b.pop(key)
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], float):
            assert a[key] == pytest.approx(b[key], rel=1e-9), key
        else:
            assert a[key] == b[key], key
    assert steady.memory.peak_time_s == pytest.approx(full.memory.peak_time_s, rel=1e-9, abs=1e-12)
    assert steady.comm.algorithms == full.comm.algorithms
    assert steady.comm.time_s.keys() == full.comm.time_s.keys()


# -- the search tools' scenarios: a GPU just too small ------------------------------------------
NO_RESERVE = {"gpu": {"cuda_context_GiB": 0.0, "allocator_fragmentation_fraction": 0.0}}
# a DeepSpeed-MoE tiny model (8 experts, top-2)
MOE = {"model.moe": {"experts": 8, "top_k": 2, "capacity_factor": 1.25}, "model.glu": True}


def over_by(fraction: float, **changes) -> dict:
    """TINY (micro-batch 8, no checkpointing) on a GPU whose HBM is `fraction` below its peak.
    Buckets sized to the tiny model: DeepSpeed's default 5e8-element IPG buffer would
    dominate a 3M-parameter model's memory."""
    raw = mapping(**{"training.micro_batch_size": 8, "training.gradient_accumulation_steps": 2,
                     "deepspeed.zero_optimization.reduce_bucket_size": 2e5,
                     "hardware.override": NO_RESERVE, **changes})
    peak = run_scenario(scenario_from_mapping(raw, ROOT))[0].memory.peak_bytes
    raw["hardware"]["override"] = {"gpu": {**NO_RESERVE["gpu"], "hbm_capacity_GiB": peak / (1 + fraction) / GiB}}
    return raw


def tight_gpu(fraction: float) -> dict:
    """The tiny scenario on a GPU with `fraction` of its no-reserve peak: tune must prune and trade."""
    no_reserve = {"cuda_context_GiB": 0.0, "allocator_fragmentation_fraction": 0.0}
    raw = mapping(**{"training.micro_batch_size": 4, "hardware.override": {"gpu": no_reserve}})
    peak = Base(raw, ROOT, "tight").run(Variant("base", ())).result.memory.peak_bytes
    raw["hardware"]["override"]["gpu"]["hbm_capacity_GiB"] = fraction * peak / 2**30
    return raw


# -- DeepSpeed 0.19.8's ZeRO++ recordings (tests/fixtures/deepspeed_zeropp) ----------------------
# the recorder's client optimizer, torch.optim.AdamW(lr=1e-3), as the ds_config block that builds it
# (engine.py get_optimizer_configuration); on a CPU rank torch's default is the for-loop
CLIENT_ADAMW_ON_CPU = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "foreach": False}}


def zeropp_fixture_scenario(fx: dict, optimizer: dict | None = CLIENT_ADAMW_ON_CPU):
    """A ZeRO++ recording's run as `zsim validate` predicts one: the measured CPU profile of its
    ranks, tensor memory only, the recorder's client optimizer unless told otherwise."""
    from calibration.validation import prediction_overrides
    from zsim.config.scenario import apply_set
    m, ds = fx["model"], dict(fx["ds_config"])
    if optimizer is not None:
        ds["optimizer"] = optimizer
    raw = {"name": fx["case"],
           "model": {"layers": m["layers"], "hidden": m["hidden"], "heads": m["heads"], "vocab": m["vocab"],
                     "seq_len": m["seq_len"], "ffn_hidden": m["ffn"], "tied_embeddings": False,
                     "position": "learned", "norm": "layernorm", "bias": True, "glu": False, "fused_qkv": True},
           "hardware": {"profile": "dgx-a100-80g", "nodes": 1, "gpus_per_node": fx["world_size"]},
           "training": {"seq_len": m["seq_len"], "precision": "bf16"}, "deepspeed": ds}
    for o in prediction_overrides(f"cpu-xeon-vm-{fx['world_size']}ranks", fx["world_size"]):
        raw = apply_set(raw, o)
    return scenario_from_mapping(raw, ROOT)
