"""zsim validate on configurations drawn at random (calibration/random_cases.py: stages 0-3,
bucket / prefetch / persistence / max-live sizes with DeepSpeed's defaults and "auto",
overlap_comm, contiguous_gradients, GAS 1-4, bf16/fp32, two model sizes, world 2 and 4), on
each engine: predicted vs measured step time and peak memory per case, the measured run-to-run
spread, step-time MAPE and max, peak-memory MAPE, and whether the collective lists are equal.

    python benchmarks/validate_random.py [--seed S] [--n 20] [--engines own,deepspeed]
                                         [--profile P] [--steps 8] [--repeats 3] [--json out.json]
                                         [--runs-log runs.jsonl] [--report-only [--repredict]]

Without --seed a fresh seed is drawn; the seed is printed first either way. A seed listed in
benchmarks/validate_random_tuned_seeds.txt was used to change the model or a profile: its
figures are not held-out, and the script refuses it unless --reuse-tuned-seed (then it says so
in the output). After tuning on a seed's cases, add the seed to that file.

Each case runs --repeats times as separate launches in interleaved passes, as validate_matrix.py
does (benchmarks/_validate_common.py combine); "run spread" is (max - min) / median of the runs'
medians, "step spread" the largest within one run. A case an engine cannot run (the own core has
no optimizer offload; the DeepSpeed peer on CPU has no host/device split to measure) is printed
as skipped with the reason, and the offload draw is kept only when every engine runs it.

--runs-log appends every finished launch to a JSON-lines file as it ends; started again with the
same file (and the same seed, n, steps, warmup and profile, which its first line records), the
benchmark skips the launches already there, so a long run that is stopped loses nothing.

--report-only --repredict reports a runs-log's measurements against the current tree's
prediction (made as `zsim validate` makes it, with --profile): what a model change does to cases
already measured. Such figures are tuned on, not held-out.

--probe times the calibration's layer benchmark (benchmarks/_layer_probe.py: the case's model
layer, its precision, its ranks) before every launch and keeps it beside the launch. The report
then adds, beside the step-time MAPE, the MAPE with each prediction scaled by the machine's speed
at that case (the probe's forward + backward over the same layer's in the profile's calibration
records): a diagnostic that separates the machine's drift since calibrating from the model's
error. It is not a prediction (it reads the machine at the time of the run); the target is the
unscaled figure.

DeepSpeed runs in the python named by ZSIM_DS_PYTHON (e.g. /work/venv-ds/bin/python) with
DS_ACCELERATOR=cpu. Timing-sensitive: run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _validate_common import SCEN, combine, run_case  # noqa: E402

from calibration.random_cases import describe, sample  # noqa: E402
from calibration.validation import mape  # noqa: E402

TUNED_SEEDS_FILE = Path(__file__).parent / "validate_random_tuned_seeds.txt"
# engines whose measured run separates device from host memory, so an offloaded optimizer can
# be compared; on CPU/gloo neither does (all tensors live in one memory)
RUNS_OFFLOAD: frozenset[str] = frozenset()


def tuned_seeds(path: Path = TUNED_SEEDS_FILE) -> dict[int, str]:
    """{seed: what it was tuned for} from the file's `seed  note` lines (# comments)."""
    out = {}
    for line in path.read_text().splitlines() if path.exists() else ():
        line = line.split("#", 1)[0].strip()
        if line:
            seed, _, note = line.partition(" ")
            out[int(seed)] = note.strip()
    return out


def load_runs_log(path: Path, header: dict, any_profile: bool = False) -> dict[tuple[str, int], dict]:
    """{(engine/case, pass): result} of a --runs-log written by a run with the same header (but
    for the profile when `any_profile`: a re-prediction names its own)."""
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    if not lines:
        return {}
    first = json.loads(lines[0])
    if any_profile:
        first, header = {**first, "profile": None}, {**header, "profile": None}
    if first != header:
        raise ValueError(f"--runs-log {path} was written by another run ({first}); this run is {header}: "
                         "give a new file, or the same --seed/--n/--steps/--warmup/--profile")
    return {(d["key"], d["pass"]): d["result"] for d in map(json.loads, lines[1:])}


def open_runs_log(path: Path, header: dict):
    new = not path.exists() or not path.read_text().strip()
    f = path.open("a")
    if new:
        f.write(json.dumps(header) + "\n")
    return f


def profiles_by_world(spec: str | None):
    """--profile P (every case) or W=P,W=P (the profile of each world size): a function of the world size.

    Why per world size: on a machine with fewer cores than ranks (world 4 on this VM's 2 cores)
    each rank computes at a fraction of a core, which only a calibration with that many ranks sees."""
    if not spec or "=" not in spec:
        return lambda world: spec
    table = {}
    for item in spec.split(","):
        world, _, path = item.partition("=")
        if not world.strip().isdigit() or not path.strip():
            raise ValueError(f"--profile {spec!r}: each item must be WORLD=PROFILE (e.g. 2=a.yaml,4=b.yaml), got {item!r}")
        table[int(world)] = path.strip()

    def profile_for(world: int) -> str:
        if world not in table:
            raise ValueError(f"--profile {spec!r} names no profile for world size {world}")
        return table[world]
    return profile_for


def repredict(case, profile: str | None, launches: list[dict]) -> list[dict]:
    """The launches' measured figures against the current tree's prediction of the case, made as
    `zsim validate` makes it (its overrides, the profile, one node of the case's ranks): what a
    model change does to cases already measured. A seed used this way is tuned on."""
    from calibration.commands.validate import DEFAULT_PROFILE, predict
    from calibration.validation import compare, prediction_overrides
    from zsim.config.scenario import load_scenario

    ov = (*case.overrides, *prediction_overrides(profile or DEFAULT_PROFILE, case.world_size))
    predicted, _ = predict(load_scenario(str(SCEN / f"{case.scenario}.yaml"), ov))
    return [r if "failed" in r else {**r, **compare(r["measured"], predicted)} for r in launches]


def probe(case, profile: str | None) -> dict:
    """The layer probe before a launch of `case` (see --probe): the machine's layer time now and
    in the profile's calibration records, and their ratio (None where the records have no such layer)."""
    from zsim.config.scenario import load_scenario
    sc = load_scenario(str(SCEN / f"{case.scenario}.yaml"), case.overrides)
    layer = f"{sc.model.hidden},{sc.model.heads},{sc.seq_len},{sc.micro_batch_size}"
    label = f"h{sc.model.hidden}-a{sc.model.heads}-s{sc.seq_len}-b{sc.micro_batch_size}"
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "p.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(case.world_size),
               str(Path(__file__).parent / "_layer_probe.py"), "--layer", layer, "--dtype", sc.precision, "--out", str(out)]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)})
        if proc.returncode != 0 or not out.exists():
            return {"failed": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        now = json.loads(out.read_text())
    calibrated = None
    if profile:
        from calibration.harness.launch import output_paths
        records = output_paths(root, yaml.safe_load(Path(profile).read_text()).get("name", ""))[1] / "records.json"
        if records.exists():
            times = {r["pass"]: r["time_s"] for r in json.loads(records.read_text())["records"]
                     if r.get("kind") == "layer" and r.get("layer") == label and r.get("dtype") == sc.precision}
            if {"fwd", "bwd"} <= set(times):
                calibrated = times
    ratio = (now["fwd"] + now["bwd"]) / (calibrated["fwd"] + calibrated["bwd"]) if calibrated else None
    return {"layer": label, "dtype": sc.precision, "now_s": now, "calibrated_s": calibrated, "ratio": ratio}


def probe_ratio(launches: list[dict]) -> float | None:
    """The median probe ratio of a case's launches (None without probes)."""
    ratios = [r["probe"]["ratio"] for r in launches if r.get("probe", {}).get("ratio")]
    return statistics.median(ratios) if ratios else None


def _pct(e) -> str:
    return "     -" if e is None else f"{100 * e:+6.1f}%"


def report(engine: str, cases, results: dict) -> dict:
    print(f"\n== engine {engine} ==")
    print(f"{'case':8s} {'meas ms':>8s} {'run spr':>7s} {'step spr':>8s} {'pred ms':>8s} {'err':>7s}  "
          f"{'meas MiB':>8s} {'pred MiB':>8s} {'err':>7s}  colls  config")
    st, pk, equal = [], [], 0
    for case in cases:
        r = results.get(f"{engine}/{case.name}")
        if r is None and not case.offloaded:
            print(f"{case.name:8s} not run (the runs log has no launch of it)  {describe(case)}")
            continue
        if r is None:
            print(f"{case.name:8s} skipped: {engine} cannot run optimizer offload here  {describe(case)}")
            continue
        if "failed" in r:
            print(f"{case.name:8s} FAILED: {r['failed']}  {describe(case)}")
            continue
        m, p, e = r["measured"], r["predicted"], r["error"]
        st.append(e["step_time"])
        pk.append(e["peak_bytes"])
        equal += bool(r["collectives_equal"])
        # one launch has no run-to-run spread: its within-run step spread stands for it (flag)
        spread = m["run_spread"] if r.get("runs", 1) > 1 else m.get("step_time_spread", 0.0)
        flag = " (spread > error)" if e["step_time"] is not None and spread > abs(e["step_time"]) else ""
        run_spr = f"{100 * m['run_spread']:6.1f}%" if r.get("runs", 1) > 1 else "      -"
        print(f"{case.name:8s} {m['step_time_s'] * 1e3:8.1f} {run_spr} "
              f"{100 * m.get('step_time_spread', 0.0):7.1f}% {p['step_time_s'] * 1e3:8.1f} {_pct(e['step_time'])}  "
              f"{m['peak_bytes'] / 2**20:8.1f} {p['peak_bytes'] / 2**20:8.1f} {_pct(e['peak_bytes'])}  "
              f"{'equal' if r['collectives_equal'] else 'DIFFER'}  {describe(case)}{flag}", flush=True)
    summary = {"cases": len(st), "step_time_mape": mape(st), "peak_mape": mape(pk),
               "step_time_max": max((abs(x) for x in st if x is not None), default=None),
               "collectives_equal": equal}
    scaled = [r["predicted"]["step_time_s"] * r["probe_ratio"] / r["measured"]["step_time_s"] - 1
              for case in cases for r in [results.get(f"{engine}/{case.name}")]
              if r and "failed" not in r and r.get("probe_ratio")]
    if scaled:
        summary.update(probe_scaled_mape=mape(scaled), probe_scaled_max=max(abs(x) for x in scaled),
                       probe_scaled_cases=len(scaled))
    if st:
        print(f"{engine}: step-time MAPE {100 * summary['step_time_mape']:.1f}% (max {100 * summary['step_time_max']:.1f}%), "
              f"peak-memory MAPE {100 * summary['peak_mape']:.1f}%, collective lists equal {equal}/{len(st)}")
        if scaled:
            print(f"{engine}: step-time MAPE {100 * summary['probe_scaled_mape']:.1f}% "
                  f"(max {100 * summary['probe_scaled_max']:.1f}%, {len(scaled)} cases) with each prediction scaled by "
                  "the machine's layer speed at the case over the calibration's (--probe; a diagnostic, not the target)")
    else:
        print(f"{engine}: no successful case")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh one (printed)")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--engines", default="own,deepspeed")
    ap.add_argument("--probe", action="store_true",
                    help="time the calibration's layer benchmark before every launch (see the module's doc)")
    ap.add_argument("--profile", default=None,
                    help="hardware profile of the prediction (validate's default), or one per world size, "
                         "e.g. 2=cpu-2ranks.yaml,4=cpu-4ranks.yaml: each calibrated with that many ranks "
                         "(`zsim calibrate --nproc-per-node N`), as a user calibrates the layout they run")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reuse-tuned-seed", action="store_true", help="allow a seed listed as tuned on")
    ap.add_argument("--json", default=None)
    ap.add_argument("--runs-log", default=None, help="JSON lines of finished launches; resumes from it")
    ap.add_argument("--report-only", action="store_true",
                    help="launch nothing: report the --runs-log's launches (every pass it holds)")
    ap.add_argument("--repredict", action="store_true",
                    help="with --report-only: predict each case again with the current tree and --profile "
                         "(the measured figures stay the log's); the seed then counts as tuned on")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else secrets.randbelow(2**31)
    tuned = tuned_seeds()
    if seed in tuned and not a.reuse_tuned_seed:
        print(f"validate_random: error: seed {seed} was tuned on ({tuned[seed]}); its figures are not held-out. "
              "Draw a fresh seed, or pass --reuse-tuned-seed to rerun it knowingly", file=sys.stderr)
        return 2
    engines = a.engines.split(",")
    offload = all(e in RUNS_OFFLOAD for e in engines)
    cases = sample(seed, a.n, offload=offload)
    print(f"seed {seed}: {a.n} cases, engines {','.join(engines)}, profile {a.profile or 'validate default'}, "
          f"{a.repeats} runs x {a.steps} steps per case"
          + (f"  [TUNED SEED: {tuned[seed]}; not held-out]" if seed in tuned else "  [fresh: not tuned on]"), flush=True)
    try:
        profile_for = profiles_by_world(a.profile)
        for case in cases:          # every world size drawn has its profile before anything launches
            profile_for(case.world_size)
    except ValueError as e:
        print(f"validate_random: error: {e}", file=sys.stderr)
        return 2
    header = {"seed": seed, "n": a.n, "steps": a.steps, "warmup": a.warmup, "profile": a.profile}
    try:
        done = load_runs_log(Path(a.runs_log), header, any_profile=a.repredict) if a.runs_log else {}
    except ValueError as e:
        print(f"validate_random: error: {e}", file=sys.stderr)
        return 2
    if a.repredict and not a.report_only:
        print("validate_random: error: --repredict needs --report-only (it re-predicts launches already measured)",
              file=sys.stderr)
        return 2
    if a.report_only and not a.runs_log:
        print("validate_random: error: --report-only needs --runs-log FILE (the launches to report)", file=sys.stderr)
        return 2
    log = open_runs_log(Path(a.runs_log), header) if a.runs_log and not a.report_only else None
    runs: dict[str, list[dict]] = {}
    for (key, _), r in sorted(done.items()) if a.report_only else ():
        runs.setdefault(key, []).append(r)
    for rep in range(0 if a.report_only else a.repeats):
        print(f"pass {rep + 1}/{a.repeats}", file=sys.stderr, flush=True)
        for case in cases:
            for engine in engines:
                if case.offloaded and engine not in RUNS_OFFLOAD:
                    continue
                key = f"{engine}/{case.name}"
                r = done.get((key, rep))
                if r is None:
                    probed = probe(case, profile_for(case.world_size)) if a.probe else None
                    r = run_case(case.scenario, case.overrides, engine, a.steps, a.warmup, profile_for(case.world_size))
                    if probed is not None:
                        r = {**r, "probe": probed}
                    if log:
                        log.write(json.dumps({"key": key, "pass": rep, "result": r}, default=str) + "\n")
                        log.flush()
                print(f"  {key}: " + ("failed" if "failed" in r else f"{r['measured']['step_time_s'] * 1e3:.1f} ms"),
                      file=sys.stderr, flush=True)
                runs.setdefault(key, []).append(r)
    if a.repredict:
        print("re-predicted with the current tree: step-time and peak errors are of the new prediction", flush=True)
        by_name = {c.name: c for c in cases}
        runs = {k: repredict(by_name[k.split("/", 1)[1]], profile_for(by_name[k.split("/", 1)[1]].world_size), v)
                for k, v in runs.items()}
    results = {k: {**combine(v), "probe_ratio": probe_ratio(v)} for k, v in runs.items()}
    summaries = {engine: report(engine, cases, results) for engine in engines}
    print(f"\nseed {seed}")
    if a.json:
        Path(a.json).write_text(json.dumps({"seed": seed, "tuned": seed in tuned, "summary": summaries,
                                            "cases": {c.name: {"draws": dict(c.draws), "overrides": list(c.overrides)}
                                                      for c in cases},
                                            "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
