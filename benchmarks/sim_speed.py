"""The speed targets of issue 14, measured side by side in one run for one or more source
trees (medians over repetitions; ratios against the first tree given):

- GPT-3 175B, ZeRO-3, 128 nodes of dgx-a100-80g (1024 GPUs): in-process build + simulate +
  summarize at GAS 1, 16 and 10,000, in process CPU time (the wall time of a single-threaded
  step on an idle machine; steadier than wall time on a machine shared with other work) (target: GAS 1 <= 0.05 s, GAS 16 <= 1.5x GAS 1,
  GAS 10,000 <= 2x GAS 1; a tree without the steady-state engine skips GAS 10,000);
- the same model as PP16 x DP64, ZeRO-1, GAS 128, and as TP8 x PP16 x DP8 (issue 15's target:
  <= 1 s; a pipeline's steady 1F1B period is reused, zsim/engine/steady.py, and each stage's
  passes are replayed once recorded, zsim/engine/pass_replay.py);
- every shipped training scenario as it ships and at ZeRO-0/1/2, GAS 1 and 8, in process (total CPU
  time: the stages whose layers are built and simulated whole);
- `zsim run` of the default scenario, process start to table (target <= 0.3 s);
- `zsim tune scenarios/gpt3-175b-zero3.yaml` (target: >= 1,000 configurations in <= 10 s), and with
  `--budget all` (every candidate simulated or skipped by the step-time lower bound);
- `zsim doctor` on a 70B model, 8 GPUs, DeepSpeed-Chat-like ZeRO-3 config (target <= 5 s);
- `zsim sweep` points/s on 2 local workers over 175B-class points (target >= 100);
- issue 47's MoE figures, each `zsim run` as a process (its CPU time, start-up included): Mixtral-8x7B
  (scenarios/mixtral-8x7b-zero3-16xh100.yaml) and Qwen3-30B-A3B (ZeRO-3 ds_config, 8 GPUs) (target
  <= 1 s), DeepSeek-V3 under ZeRO-3 on 1,024 H100 (target <= 2 s), and `zsim doctor` on Qwen3-30B-A3B,
  8 GPUs, micro-batch 16 (wall; target <= 10 s).
Every figure runs in a subprocess with PYTHONPATH set to the tree, from the tree's root, the
trees taking turns repetition by repetition.
Usage: python benchmarks/sim_speed.py [--tree DIR ...] [--repeat N] [--only TEXT]
  e.g. python benchmarks/sim_speed.py --tree /work/ref --tree .   (before, after)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

GPT3 = {
    "model": {"preset": "gpt3-175b"},
    "hardware": {"profile": "dgx-a100-80g", "nodes": 128},
    "training": {"micro_batch_size": 1, "seq_len": 2048, "precision": "bf16", "activation_checkpointing": "full"},
    "deepspeed": {"zero_optimization": {"stage": 3, "overlap_comm": True}},
}
# DeepSpeed-Chat's ZeRO-3 settings (training/utils/ds_utils.py get_train_ds_config) on a 70B model, one node
CHAT_70B = {
    "name": "llama2-70b-dschat-zero3-8gpu",
    "model": {"preset": "llama2-70b"},
    "hardware": {"profile": "dgx-a100-80g", "nodes": 1, "gpus_per_node": 8},
    "training": {"micro_batch_size": 4, "gradient_accumulation_steps": 1, "seq_len": 2048, "precision": "bf16",
                 "activation_checkpointing": "full"},
    "deepspeed": {"zero_optimization": {"stage": 3, "overlap_comm": True,
                                        "stage3_param_persistence_threshold": 1e4,
                                        "stage3_max_live_parameters": 3e7,
                                        "stage3_prefetch_bucket_size": 3e7}},
}
PIPE = {**GPT3, "parallelism": {"pipeline": 16}, "deepspeed": {"zero_optimization": {"stage": 1}}}
# issue 15's 3D case: Megatron-DeepSpeed's layout for 175B on 1024 GPUs (target <= 1 s)
PIPE_TP = {**PIPE, "parallelism": {"pipeline": 16, "tensor": 8}}
# issue 47's MoE cases: a plain ZeRO-3 ds_config (DeepSpeed's defaults otherwise) with a Hub config.json
MOE_DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 3, "overlap_comm": True}}
QWEN3_MOE = ["--model", "scenarios/hub/Qwen--Qwen3-30B-A3B.json", "--gpus", "8"]
DEEPSEEK_V3_1024 = ["--model", "deepseek-v3", "--profile", "dgx-h100", "--nodes", "128", "--gpus", "8"]
SWEEP_VARY = ["hardware.nodes=16,32,64,128", "training.micro_batch_size=1,2",
              "deepspeed.zero_optimization.stage=1,2,3", "deepspeed.zero_optimization.overlap_comm=true,false"]

_IN_PROCESS = """
import json, statistics, sys, time
from pathlib import Path
from zsim.api import run_scenario
from zsim.config.scenario import scenario_from_mapping
raw, gas, repeat = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if gas > 16:
    try:
        import zsim.engine.steady  # noqa: F401
    except ImportError:
        print(json.dumps(None)); sys.exit(0)
raw = dict(raw, name=f"gpt3-175b-zero3-1024-gas{gas}")
raw["training"] = dict(raw["training"], gradient_accumulation_steps=gas)
sc = scenario_from_mapping(raw, Path("."))
if gas == 1:
    run_scenario(sc)   # warm-up: first-call imports and caches
import zsim.schedule.build as build
walls = []
for _ in range(repeat):
    # a cold build each time: the workload cache (shared by a search's variants) is emptied
    getattr(getattr(build, "_workload", None), "cache_clear", lambda: None)()
    t0 = time.process_time()
    run_scenario(sc)
    walls.append(time.process_time() - t0)
print(json.dumps(statistics.median(walls)))
"""


# every shipped training scenario as it ships and at ZeRO-0/1/2 (its ZeRO-3 keys dropped), at GAS 1
# and 8: the stages whose layers the builder does not skip (issue 47's one layer mechanism)
_SCENARIOS = """
import copy, glob, json, time
from pathlib import Path
import yaml
from zsim.api import run_scenario
from zsim.config.scenario import scenario_from_mapping
from zsim.errors import ZsimInputError
total = 0.0
for f in sorted(glob.glob("scenarios/*.yaml")):
    raw = yaml.safe_load(open(f))
    for stage in (None, 0, 1, 2):
        r = copy.deepcopy(raw)
        if stage is not None:
            z = r.setdefault("deepspeed", {}).setdefault("zero_optimization", {})
            if z.get("stage") == stage:
                continue
            z["stage"] = stage
            for k in [k for k in z if k.startswith("stage3") or k == "offload_param"]:
                z.pop(k)
        for gas in (1, 8):
            r.setdefault("training", {})["gradient_accumulation_steps"] = gas
            try:   # a variant DeepSpeed would refuse (e.g. ZeRO-0 with an offloaded optimizer) is left out
                sc = scenario_from_mapping(copy.deepcopy(r), Path(f).parent)
            except ZsimInputError:
                continue
            t0 = time.process_time()
            run_scenario(sc)
            total += time.process_time() - t0
print(json.dumps(total))
"""


def _scenarios(tree: Path) -> float:
    out = subprocess.run([sys.executable, "-c", _SCENARIOS], cwd=tree, env=_env(tree), capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree)}


def _in_process(tree: Path, gas: int, repeat: int, raw: dict = GPT3) -> float | None:
    out = subprocess.run([sys.executable, "-c", _IN_PROCESS, json.dumps(raw), str(gas), str(repeat)],
                         cwd=tree, env=_env(tree), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cli(tree: Path, args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "zsim.cli", *args], cwd=tree, env=_env(tree), capture_output=True, text=True)
    return time.perf_counter() - t0


def _cli_cpu(tree: Path, args: list[str]) -> float:
    """CPU seconds (user + system) of one `zsim` process, start-up included."""
    before = os.times()
    subprocess.run([sys.executable, "-m", "zsim.cli", *args], cwd=tree, env={**_env(tree), "HF_HUB_OFFLINE": "1"},
                   capture_output=True, text=True)
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system)


def _tune_configurations(out: Path) -> int | None:
    try:
        return int(json.loads(out.read_text()).get("simulated"))
    except (OSError, ValueError, TypeError):
        return None


def _tune_count(out: Path, key: str) -> int | None:
    try:
        value = json.loads(out.read_text()).get(key)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


def _interleaved(trees: list[Path], repeat: int, fn) -> list:
    """Median of `repeat` measurements per tree, the trees taking turns (so a change of the
    machine's load falls on all of them alike)."""
    walls: list[list] = [[] for _ in trees]
    for _ in range(repeat):
        for i, tree in enumerate(trees):
            walls[i].append(fn(tree))
    return [None if None in w else statistics.median(w) for w in walls]


def measure(trees: list[Path], repeat: int, tmp: Path, only: str = "") -> dict:
    """Every figure whose name contains `only` (all by default)."""
    # every tree's modules compiled first, as an install leaves them (a tree whose bytecode is
    # not written, e.g. under PYTHONDONTWRITEBYTECODE, would pay the compiler at each start-up)
    for tree in trees:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "zsim")], check=True)
    figures: dict = {}
    slow = max(1, repeat // 2)   # repetitions of the commands that take seconds to minutes

    def want(name: str) -> bool:
        return only.lower() in name.lower()

    for gas in (1, 16, 10_000):
        name = f"175B ZeRO-3 1024 GPUs GAS {gas} (CPU s)"
        if want(name):
            figures[name] = _interleaved(trees, repeat if gas == 1 else slow,
                                         lambda t: _in_process(t, gas, 3 if gas == 1 else 1))
    for name, raw in (("175B PP16 x DP64 ZeRO-1 GAS 128 (CPU s)", PIPE), ("175B TP8 x PP16 x DP8 ZeRO-1 GAS 128 (CPU s)", PIPE_TP)):
        if want(name):
            figures[name] = _interleaved(trees, slow, lambda t: _in_process(t, 128, 1, raw))
    name = "shipped scenarios x ZeRO-0/1/2 x GAS 1, 8 (CPU s, total)"
    if want(name):
        figures[name] = _interleaved(trees, slow, _scenarios)
    if want("zsim run default (s)"):
        figures["zsim run default (s)"] = _interleaved(trees, repeat, lambda t: _cli(t, ["run", "--quiet"]))
    if want("zsim tune gpt3-175b-zero3 (s)"):
        tune_json = {t: tmp / f"tune-{i}.json" for i, t in enumerate(trees)}
        figures["zsim tune gpt3-175b-zero3 (s)"] = _interleaved(
            trees, slow, lambda t: _cli(t, ["tune", "scenarios/gpt3-175b-zero3.yaml", "--json", str(tune_json[t])]))
        figures["  configurations simulated"] = [_tune_configurations(tune_json[t]) for t in trees]
    if want("zsim tune gpt3-175b-zero3 --budget all (s)"):
        # every candidate the memory bound leaves, simulated or skipped by the step-time bound
        # (zsim/search/bound.py); a tree without that bound simulates them all (tens of minutes)
        tune_json = {t: tmp / f"tune-all-{i}.json" for i, t in enumerate(trees)}
        figures["zsim tune gpt3-175b-zero3 --budget all (s)"] = _interleaved(
            trees, slow, lambda t: _cli(t, ["tune", "scenarios/gpt3-175b-zero3.yaml", "--budget", "all",
                                            "--json", str(tune_json[t])]))
        figures["  configurations simulated (all)"] = [_tune_configurations(tune_json[t]) for t in trees]
        figures["  skipped by the step-time bound"] = [_tune_count(tune_json[t], "bounded") for t in trees]
    if want("zsim doctor 70B 8 GPUs ZeRO-3 (s)"):
        chat = tmp / "chat70b.yaml"
        chat.write_text(yaml.safe_dump(CHAT_70B))
        figures["zsim doctor 70B 8 GPUs ZeRO-3 (s)"] = _interleaved(trees, slow, lambda t: _cli(t, ["doctor", str(chat)]))
    ds_config = tmp / "moe-zero3.json"
    ds_config.write_text(json.dumps(MOE_DS_CONFIG))
    for name, args in (("zsim run Mixtral-8x7B ZeRO-3 16 GPUs (CPU s)", ["scenarios/mixtral-8x7b-zero3-16xh100.yaml"]),
                       ("zsim run Qwen3-30B-A3B ZeRO-3 8 GPUs (CPU s)", [str(ds_config), *QWEN3_MOE]),
                       ("zsim run DeepSeek-V3 ZeRO-3 1024 H100 (CPU s)", [str(ds_config), *DEEPSEEK_V3_1024])):
        if want(name):
            figures[name] = _interleaved(trees, repeat, lambda t: _cli_cpu(t, ["run", *args, "--quiet"]))
    if want("zsim doctor Qwen3-30B-A3B 8 GPUs mb 16 (s)"):
        figures["zsim doctor Qwen3-30B-A3B 8 GPUs mb 16 (s)"] = _interleaved(
            trees, slow, lambda t: _cli(t, ["doctor", str(ds_config), *QWEN3_MOE, "--set", "training.micro_batch_size=16"]))
    if want("zsim sweep 175B points/s (2 workers)"):
        base = tmp / "gpt3.yaml"
        base.write_text(yaml.safe_dump({"name": "gpt3-sweep", **GPT3}))
        vary = [a for v in SWEEP_VARY for a in ("--vary", v)]
        points = 1
        for v in SWEEP_VARY:
            points *= len(v.split("=", 1)[1].split(","))
        walls = _interleaved(trees, slow, lambda t: _cli(t, ["sweep", str(base), *vary, "--workers", "2", "--quiet"]))
        figures["zsim sweep 175B points/s (2 workers)"] = [points / w for w in walls]
    return figures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", type=Path, help="source tree to measure (repeatable; default: this one)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", default="", help="measure only the figures whose name contains this, e.g. 'PP16'")
    args = ap.parse_args(argv)
    trees = [t.resolve() for t in (args.tree or [ROOT])]
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as d:
        figures = measure(trees, args.repeat, Path(d), args.only)
    results = [{k: v[i] for k, v in figures.items()} for i in range(len(trees))]
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    names = [str(t) for t in trees]
    print(f"{'figure (median)':<42}" + "".join(f"{n[-24:]:>26}" for n in names)
          + ("".join(f"{'ratio ' + str(i + 2):>12}" for i in range(len(trees) - 1))))
    for key in results[0]:
        vals = [r[key] for r in results]
        cells = "".join(f"{'-' if v is None else f'{v:.3f}':>26}" for v in vals)
        ratios = "".join(f"{(v / vals[0]) if v and vals[0] else float('nan'):>12.3f}" for v in vals[1:])
        print(f"{key:<42}{cells}{ratios}")
    for name, r in zip(names, results):
        if not all(f"175B ZeRO-3 1024 GPUs GAS {g} (CPU s)" in r for g in (1, 16, 10_000)):
            continue
        g1, g16, g10k = (r[f"175B ZeRO-3 1024 GPUs GAS {g} (CPU s)"] for g in (1, 16, 10_000))
        print(f"{name}: GAS 16 / GAS 1 = {g16 / g1:.2f}x"
              + (f", GAS 10,000 / GAS 1 = {g10k / g1:.2f}x" if g10k else ", GAS 10,000 not measured"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
