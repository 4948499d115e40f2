"""zsim validate on a GPU: DeepSpeed 0.19.8 trains benchmarks/validate_scenarios/gpu-1b.yaml (a
1.4B GPT, bf16, DeepSpeed's defaults) on one CUDA GPU with the ZeRO stage, optimizer offload,
micro-batch and GAS varied, and its step time and peak GPU memory
(torch.cuda.max_memory_allocated over one step) are put beside zsim's prediction.

    python benchmarks/validate_gpu.py --measure DIR [--cases z0,z2-off] [--steps 5] [--profile-step]  # GPU
    python benchmarks/validate_gpu.py --report DIR --profile P [--profile Q ...]      # anywhere

--measure launches each case as `zsim validate --engine deepspeed` does (torchrun, one rank,
calibration/core/run.py) and writes DIR/CASE.json, DIR/CASE.err for a case that failed, and
DIR/provenance.json (GPU, driver, torch, CUDA, DeepSpeed, CPU). OMP_NUM_THREADS is left as the
user's run has it (torchrun sets none for one rank): DeepSpeedCPUAdam uses every core.
--report predicts every measured case on each profile, as `zsim validate` predicts (its
overrides: one node of one GPU, tensor-only memory), and prints the errors and their MAPE.
Measurements of a run are kept in tests/fixtures/measured/gpu/ with their provenance.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SCENARIO = ROOT / "benchmarks" / "validate_scenarios" / "gpu-1b.yaml"
Z = "deepspeed.zero_optimization."
OFF = f"{Z}offload_optimizer={{device: cpu, pin_memory: true}}"
# (name, overrides): every ZeRO stage at DeepSpeed's defaults, offload at stages 2 and 3 (pinned,
# DeepSpeed's default, and pageable at stage 2), GAS and micro-batch varied at stage 2
CASES = [
    ("z0", [f"{Z}stage=0"]),
    ("z1", [f"{Z}stage=1"]),
    ("z2", [f"{Z}stage=2"]),
    ("z3", [f"{Z}stage=3"]),
    ("z2-off", [f"{Z}stage=2", OFF]),
    ("z3-off", [f"{Z}stage=3", OFF]),
    ("z2-gas2", [f"{Z}stage=2", "training.gradient_accumulation_steps=2"]),
    ("z2-mb8", [f"{Z}stage=2", "training.micro_batch_size=8"]),
    ("z2-off-pageable", [f"{Z}stage=2", f"{Z}offload_optimizer={{device: cpu, pin_memory: false}}"]),
]


def provenance() -> dict:
    import platform

    import torch

    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
           "cuda": str(torch.version.cuda), "python": platform.python_version(), "cpu_cores": os.cpu_count()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_memory_GiB"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        import deepspeed
        out["deepspeed"] = deepspeed.__version__
    except ImportError:
        out["deepspeed"] = "not installed"
    try:
        out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        out["driver"] = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            out["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return out


def measure(out_dir: Path, names: list[str], steps: int, warmup: int, timeout_s: int, profile: bool = False) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "provenance.json").write_text(json.dumps(provenance(), indent=1, sort_keys=True) + "\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    failed = 0
    for name, overrides in CASES:
        if name not in names:
            continue
        out = out_dir / f"{name}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "-m", "calibration.core.run", "--engine", "deepspeed", "--scenario", str(SCENARIO),
               "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)]
        for o in overrides:
            cmd += ["--set", o]
        if profile:
            cmd += ["--profile-step", str(out_dir / f"{name}.profile.txt")]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
            ok, tail = p.returncode == 0 and out.exists(), (p.stderr or "")[-4000:]
        except subprocess.TimeoutExpired as e:
            ok, tail = False, f"timed out after {timeout_s} s\n" + str(e.stderr or "")[-4000:]
        if ok:
            m = json.loads(out.read_text())
            m["overrides"] = overrides
            out.write_text(json.dumps(m, indent=1) + "\n")
            print(f"{name}: {m['step_time_s'] * 1e3:.1f} ms, peak {m['peak_bytes'] / 2**30:.2f} GiB "
                  f"({time.time() - t0:.0f} s)", flush=True)
        else:
            failed += 1
            (out_dir / f"{name}.err").write_text(tail)
            why = [ln for ln in tail.splitlines() if "Error" in ln or "error:" in ln or "SystemExit" in ln][-1:]
            print(f"{name}: failed ({time.time() - t0:.0f} s): {why[0] if why else '?'}", flush=True)
    return 1 if failed else 0


def report(in_dir: Path, profiles: list[str]) -> int:
    from calibration.commands.validate import predict
    from calibration.validation import compare, mape, prediction_overrides
    from zsim.config.scenario import load_scenario

    prov = json.loads((in_dir / "provenance.json").read_text())
    print(f"measured: {prov.get('gpu')} (driver {prov.get('driver')}), torch {prov.get('torch')}, "
          f"DeepSpeed {prov.get('deepspeed')}, {prov.get('cpu_cores')} CPU cores, {prov.get('date')}")
    for profile in profiles:
        print(f"\nprofile {profile}")
        print(f"{'case':10} {'measured':>10} {'spread':>7} {'zsim':>10} {'error':>7}   "
              f"{'peak meas.':>10} {'zsim':>10} {'error':>7}")
        st, pk = [], []
        for name, _ in CASES:
            path = in_dir / f"{name}.json"
            if not path.exists():
                if (in_dir / f"{name}.err").exists():
                    print(f"{name:10} failed to run (see {name}.err)")
                continue
            m = json.loads(path.read_text())
            sc = load_scenario(str(SCENARIO), (*m["overrides"], *prediction_overrides(profile, 1)))
            predicted, _ = predict(sc)
            r = compare(m, predicted)
            e = r["error"]
            st.append(e["step_time"])
            pk.append(e["peak_bytes"])
            print(f"{name:10} {m['step_time_s'] * 1e3:8.1f}ms {100 * m['step_time_spread']:6.1f}% "
                  f"{predicted['step_time_s'] * 1e3:8.1f}ms {100 * e['step_time']:+6.1f}%   "
                  f"{m['peak_bytes'] / 2**30:8.2f}Gi {predicted['peak_bytes'] / 2**30:8.2f}Gi "
                  f"{100 * e['peak_bytes']:+6.1f}%")
        if st:
            print(f"step-time MAPE {100 * mape(st):.1f}% (max {100 * max(abs(x) for x in st):.1f}%), "
                  f"peak MAPE {100 * mape(pk):.1f}% (max {100 * max(abs(x) for x in pk):.1f}%), {len(st)} cases")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", metavar="DIR", help="run the cases on this machine's GPU, write DIR/CASE.json")
    ap.add_argument("--report", metavar="DIR", help="predict the cases measured in DIR and print the errors")
    ap.add_argument("--profile", action="append", default=[], help="profile of the prediction (repeatable)")
    ap.add_argument("--cases", default=",".join(n for n, _ in CASES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per case")
    ap.add_argument("--profile-step", action="store_true",
                    help="--measure: also profile two more steps' optimizer-step phase (DIR/CASE.profile.txt)")
    a = ap.parse_args()
    names = a.cases.split(",")
    unknown = [n for n in names if n not in dict(CASES)]
    if unknown or bool(a.measure) == bool(a.report):
        print(f"validate_gpu: error: give --measure DIR or --report DIR; cases from {', '.join(dict(CASES))}"
              + (f" (unknown: {', '.join(unknown)})" if unknown else ""), file=sys.stderr)
        return 2
    if a.measure:
        import torch
        if not torch.cuda.is_available():
            print("validate_gpu: error: --measure needs a CUDA GPU (this machine has none); "
                  "--report DIR works anywhere", file=sys.stderr)
            return 2
        return measure(Path(a.measure), names, a.steps, a.warmup, a.timeout, a.profile_step)
    if not a.profile:
        print("validate_gpu: error: --report needs --profile (e.g. dgx-h100)", file=sys.stderr)
        return 2
    return report(Path(a.report), a.profile)


if __name__ == "__main__":
    sys.exit(main())
