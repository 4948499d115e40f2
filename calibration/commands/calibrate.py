"""zsim calibrate: measure this machine with torch.distributed and write a hardware profile.

Contributed to the `zsim` CLI through the `zsim.commands` entry point group (pyproject.toml;
zsim never imports calibration). torch is imported only inside main() (through
calibration.harness), so `zsim --help` works without it. See docs/calibration.md.
"""
from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

from zsim.errors import ZsimInputError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SIZE = re.compile(r"^\s*([0-9.]+(?:[eE][+-]?\d+)?)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)
# a day is the longest silence worth waiting for; 1,024 ranks are more than any node holds
_MAX_TIMEOUT_S = 86_400
_MAX_NPROC_PER_NODE = 1024
_ONE_RANK_FIX = ("one rank measures no collective (no peer): pass --base PROFILE (e.g. dgx-h100) to take the "
                 "interconnect from a shipped profile, or launch 2+ ranks")
_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30}


def add_parser(sub):
    p = sub.add_parser("calibrate", help="measure this cluster (torch.distributed) and write a hardware profile",
                       description="Run the calibration microbenchmarks under torchrun and fit a hardware profile "
                                   "(hardware_profiles/NAME.yaml, raw records in calibration/runs/NAME/).")
    p.add_argument("--out", metavar="NAME", required=True, help="profile name: writes hardware_profiles/NAME.yaml")
    p.add_argument("--quick", action="store_true", help="a short run (about 1.5 min on 2 CPU ranks; tests and CI)")
    p.add_argument("--nproc-per-node", type=str, default=None, metavar="N",
                   help="ranks to launch on this node (default: the GPU count, or 2 on CPU)")
    p.add_argument("--backend", default=None, help="nccl or gloo (default: nccl with CUDA, else gloo)")
    p.add_argument("--max-size", default=None, metavar="BYTES",
                   help="largest collective message, e.g. 64MiB (default: 1MiB quick, 64MiB full)")
    p.add_argument("--io-path", default=None, metavar="DIR",
                   help="directory on the NVMe offload target for the file I/O benchmark (default: the run directory)")
    p.add_argument("--layer", action="append", metavar="H,HEADS,SEQ,MB",
                   help="transformer layer to time: hidden,heads,seq_len,micro_batch (repeatable)")
    p.add_argument("--scenario", default=None, metavar="YAML",
                   help="take the layer shape (hidden/heads/seq/micro-batch) and precision from a scenario")
    p.add_argument("--hooks", action="store_true",
                   help="with --quick: also time DeepSpeed's ZeRO hooks per module visit and per gradient "
                        "(cpu.zero3_hook_*_us, cpu.zero*_grad_hook_us; a full run always does; needs deepspeed)")
    p.add_argument("--dtype", default=None, metavar="DTYPE[,DTYPE...]",
                   help="training precision(s) the compute figures are fitted for (fp32, bf16, fp16; default bf16 "
                        "or the scenario's); a list such as fp32,bf16 fits each one into the profile's gpu.by_dtype, "
                        "the first also as the top-level fields")
    p.add_argument("--timeout", default=None, metavar="SECONDS",
                   help="a rank silent this long is declared hung (default: 60 quick, 180 full)")
    p.add_argument("--force", action="store_true", help="overwrite an existing profile / complete run")
    p.add_argument("--from-run", default=None, metavar="DIR",
                   help="fit records already measured (a calibration/runs/NAME directory, e.g. from a multi-node "
                        "torchrun/srun launch) instead of measuring")
    p.add_argument("--pool-collectives", action="append", default=[], metavar="DIR",
                   help="also fit the collective timings of this earlier complete run of the same cluster "
                        "(calibration/runs/NAME; repeatable): each size's calls are pooled across the runs, "
                        "averaging over the windows in which the cluster's collective times drift")
    p.add_argument("--base", default=None, metavar="PROFILE",
                   help="one rank (e.g. one GPU) measures no collective: take the interconnect (intra_node, "
                        "inter_node, nccl, interference) from this profile, e.g. dgx-h100")
    from calibration.commands.calibrate_hf import add_arguments as add_hf_arguments
    add_hf_arguments(p)   # --hf-layer: your own Hugging Face model's layer (calibrate_hf.py)
    p.add_argument("--root", default=None, metavar="DIR",
                   help="directory holding hardware_profiles/ and calibration/runs/ (default: the zsim checkout)")
    p.set_defaults(func=main)


def parse_size(text: str, field: str) -> int:
    m = _SIZE.match(str(text))
    unit = (m.group(2) or "").lower() if m else ""
    if not m or unit not in _UNITS:
        raise ZsimInputError(field, text, "give a size in bytes, e.g. 1048576, 1MiB or 64MiB")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value > 1 << 62:   # 1e400 reads as inf
        raise ZsimInputError(field, text, "too large; give a size such as 64MiB")
    return int(value)


def _positive(text, field, kind=float, most=_MAX_TIMEOUT_S):
    try:
        v = kind(text)
    except (TypeError, ValueError):
        raise ZsimInputError(field, text, f"expected a positive {'integer' if kind is int else 'number'}") from None
    if not math.isfinite(v) or v <= 0:   # nan passes `v <= 0` and would disable the hang detection
        raise ZsimInputError(field, text, f"expected a positive finite {'integer' if kind is int else 'number'}")
    if v > most:
        raise ZsimInputError(field, text, f"at most {most:,}")
    return v


def resolve(args):
    """Validate every argument before anything is launched (one-line errors, exit 2)."""
    from calibration.harness.plan import LayerShape, default_plan

    if not _NAME.match(args.out or ""):
        raise ZsimInputError("--out", args.out, "use a plain name of letters, digits, '.', '_' or '-' "
                                                "(e.g. cpu-gloo-localhost)")
    if args.out.endswith((".yaml", ".yml")):
        raise ZsimInputError("--out", args.out, f"give the profile's name, without the suffix (it writes "
                                                f"hardware_profiles/{args.out.rsplit('.', 1)[0]}.yaml)")
    mode = "quick" if args.quick else "full"
    nproc = _positive(args.nproc_per_node, "--nproc-per-node", int, _MAX_NPROC_PER_NODE) if args.nproc_per_node is not None else None
    if args.backend not in (None, "nccl", "gloo"):
        raise ZsimInputError("--backend", args.backend, "choose nccl or gloo")
    max_size = parse_size(args.max_size, "--max-size") if args.max_size is not None else None
    if max_size is not None and not 1024 <= max_size <= 1 << 34:
        raise ZsimInputError("--max-size", args.max_size, "choose a size between 1KiB and 16GiB")
    dtypes = parse_dtypes(args.dtype) if args.dtype is not None else None
    layers = []
    if args.scenario:
        from zsim.config.scenario import load_scenario
        sc = load_scenario(args.scenario)
        layers.append(LayerShape(sc.model.hidden, sc.model.heads, sc.seq_len, sc.micro_batch_size))
        dtypes = dtypes or (sc.precision,)
    for text in args.layer or ():
        parts = text.split(",")
        try:
            h, a, s, b = (int(x) for x in parts)
        except ValueError:
            raise ZsimInputError("--layer", text, "give hidden,heads,seq_len,micro_batch, e.g. 512,8,256,2") from None
        if min(h, a, s, b) <= 0 or h % a:
            raise ZsimInputError("--layer", text, "all four must be positive and hidden divisible by heads")
        layers.append(LayerShape(h, a, s, b))
    dtypes = dtypes or ("bf16",)
    timeout = _positive(args.timeout, "--timeout") if args.timeout is not None else None
    io_path = ""
    if args.io_path:
        p = Path(args.io_path)
        if not (p.is_dir() or p.parent.is_dir()) or (p.exists() and not p.is_dir()):
            raise ZsimInputError("--io-path", args.io_path, "give an existing directory (the NVMe offload target)")
        io_path = str(p.resolve())
    root = Path(args.root).resolve() if args.root else Path(__file__).resolve().parents[2]
    if args.root and not root.is_dir():
        raise ZsimInputError("--root", args.root, "give an existing directory")
    if nproc == 1 and not args.base and not args.from_run:
        raise ZsimInputError("--nproc-per-node", 1, _ONE_RANK_FIX)
    plan = default_plan(mode, max_size_bytes=max_size, io_path=io_path, layers=tuple(layers) or None,
                        timeout_s=timeout, dtypes=dtypes)
    cores = os.cpu_count() or 1
    if mode == "quick" and nproc is not None and nproc > cores and args.backend != "nccl":
        # more CPU ranks than cores: each rank runs in the gaps the others leave, and a quick run's
        # five one-iteration repetitions of a layer spread 20-126% at 4 ranks on 2 cores (its fp32
        # fit then came out 12-23% fast on the medium layer); time each repetition as long as a
        # full run does, three times as often
        plan = replace(plan, reps=3 * plan.reps, min_rep_time_s=max(plan.min_rep_time_s, 0.01))
    if args.hooks:
        import importlib.util
        if args.from_run:
            raise ZsimInputError("--hooks", "set", "--from-run fits records already measured; drop --hooks")
        if importlib.util.find_spec("deepspeed") is None:
            raise ZsimInputError("--hooks", "set", f"DeepSpeed's hooks are timed in DeepSpeed itself, which "
                                                   f"{sys.executable} cannot import: pip install deepspeed, or "
                                                   f"run zsim from a Python that has it")
        plan = replace(plan, hooks=True)
    return plan, nproc, dtypes, root


def base_interconnect(name: str | None) -> tuple[str, dict] | None:
    """(name, mapping) of the --base profile, whose interconnect a one-rank run takes."""
    if not name:
        return None
    from zsim.config.profile import read_profile_mapping

    try:
        data, _ = read_profile_mapping(name)
    except ZsimInputError as err:
        raise ZsimInputError("--base", name, err.fix) from None
    missing = [k for k in ("intra_node", "inter_node") if not isinstance((data or {}).get(k), dict)]
    if missing:
        raise ZsimInputError("--base", name, f"the profile has no {missing[0]} section; choose a full profile "
                                             "such as dgx-h100")
    return name, data


def parse_dtypes(text: str) -> tuple[str, ...]:
    """`--dtype bf16` or a list `fp32,bf16` (the first is the profile's top-level dtype)."""
    dtypes = tuple(x.strip() for x in str(text).split(","))
    bad = next((d for d in dtypes if d not in ("fp32", "bf16", "fp16")), None)
    if bad is not None:
        raise ZsimInputError("--dtype", text, f"{bad!r} is not a dtype: choose fp32, bf16 or fp16, or a list "
                                              "such as fp32,bf16")
    if len(set(dtypes)) != len(dtypes):
        raise ZsimInputError("--dtype", text, "a dtype is listed twice; list each once")
    return dtypes


def _fit_existing(args, dtypes, profile_path: Path, run_dir: Path, fit_and_write, base=None) -> int:
    """Fit a run measured elsewhere: a calibration/runs/NAME directory (records.json) or a
    worker's run directory from a torchrun/srun launch (records.partial.jsonl + status/)."""
    import json
    import shutil
    from calibration.harness.launch import read_records, write_atomic
    from calibration.harness.pool import add_sources, pooled, read_json, read_pool, write_pool

    src = Path(args.from_run)
    if profile_path.exists() and not args.force:
        raise ZsimInputError("--out", args.out, f"{profile_path} exists; pass --force to overwrite it")
    here = run_dir / "records.json"
    if src.resolve() != run_dir.resolve() and here.is_file() and not args.force:
        raise ZsimInputError("--out", args.out, f"{here} holds another run; pass --force to replace it")

    def load(path: Path) -> dict:
        return read_json(path, "--from-run", args.from_run)
    if (src / "records.json").is_file():
        doc = load(src / "records.json")
    elif (src / "records.partial.jsonl").is_file():
        if not (src / "provenance.json").is_file():
            raise ZsimInputError("--from-run", args.from_run, "the worker directory has no provenance.json (which "
                                 "machine, backend and ranks measured it); copy the whole run directory")
        states = [load(p).get("state") for p in (src / "status").glob("rank*.json")]
        doc = {"format": 1, "status": "complete" if states and all(x == "done" for x in states) else "failed",
               "error": "", "records": read_records(src), "provenance": load(src / "provenance.json"),
               "plan": load(src / "plan.json") if (src / "plan.json").exists() else {}}
    else:
        raise ZsimInputError("--from-run", args.from_run, "expected a run directory with records.json "
                             "or records.partial.jsonl")
    if doc.get("status") != "complete":
        raise ZsimInputError("--from-run", args.from_run, f"the run is {doc.get('status')!r}, not complete "
                             "(a rank did not finish); measure again")
    prov = doc.get("provenance", {})
    pool = add_sources(read_pool(src), args.pool_collectives, prov)
    if base is not None and int(prov.get("world_size", 1)) > 1:
        # as when measuring: ranks that measured their own interconnect take none from --base
        print(f"zsim calibrate: --base {base[0]} unused: the run's {prov.get('world_size')} ranks measured their "
              "own interconnect", file=sys.stderr)
        base = None
    base = base or base_interconnect(prov.get("interconnect_from"))   # a one-rank run names its own
    if base is not None:
        prov = {**prov, "interconnect_from": base[0]}
    created = not run_dir.exists()
    try:
        if src.resolve() != run_dir.resolve():
            write_atomic(run_dir / "records.json", json.dumps(doc, indent=1, sort_keys=True) + "\n")
            (run_dir / "torchrun.log").unlink(missing_ok=True)   # the replaced run's, not this one's
        write_pool(run_dir, pool, write_atomic)
        _, report = fit_and_write(args.out, *pooled(doc["records"], prov, pool), dtypes, profile_path, run_dir, base)
    except (ValueError, ZsimInputError) as err:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)   # nothing of a failed fit is left behind
        if isinstance(err, ZsimInputError):
            raise
        # records that cannot be fitted (no GEMM, no layer of the dtype)
        raise ZsimInputError("--from-run", args.from_run, f"cannot be fitted: {err}") from None
    _print_layers(report)
    print(f"wrote {profile_path} and {run_dir}/" + (f" (collectives pooled with {len(pool)} more runs)" if pool else ""),
          file=sys.stderr)
    return 0


# p10-p90 over the median of a layer's repetitions above which its timing is called noisy: the
# 2-rank VM profile's layers spread 2-12%, 4 ranks on the VM's 2 cores 10-61% (2026-11-26/27)
NOISY_LAYER_SPREAD = 0.25


def _print_layers(report: dict) -> None:
    """Each measured layer (every fitted dtype's) against the fitted profile's prediction."""
    host = report.get("host_streaming_GBps", {})
    if host.get("cpu_adam"):
        print(f"  host streaming: copy {host['memcpy'] or 0:.1f} GB/s, DeepSpeedCPUAdam out of cache "
              f"{host['cpu_adam']:.1f} GB/s (cpu.memory_bw_GBps: the better)", file=sys.stderr)
    for r in report["compute"].get("layers", []):
        print(f"  layer {r['layer']} {r['dtype']} {r['pass']}: measured {r['measured_s'] * 1e3:.3f} ms, "
              f"zsim {r['predicted_s'] * 1e3:.3f} ms ({100 * r['error']:+.1f}%), run-to-run spread "
              f"{100 * r.get('spread', 0.0):.0f}%", file=sys.stderr)
    noisy = [r for r in report["compute"].get("layers", []) if r.get("spread", 0.0) > NOISY_LAYER_SPREAD]
    if noisy:
        print(f"zsim calibrate: {len(noisy)} layer timings spread more than {100 * NOISY_LAYER_SPREAD:.0f}% between "
              "repetitions (a busy or oversubscribed machine): their fit is no better than that; calibrate again "
              "when the machine is quiet, or with fewer ranks per core", file=sys.stderr)


def _complete(path: Path) -> bool:
    import json
    try:
        return json.loads(path.read_text()).get("status") == "complete"
    except (ValueError, OSError, AttributeError):
        return False


def main(args) -> int:
    import shutil

    if getattr(args, "hf_layer", False):
        from calibration.commands.calibrate_hf import main as hf_layer_main
        return hf_layer_main(args)
    plan, nproc, dtypes, root = resolve(args)
    base = base_interconnect(args.base)
    profile_path = root / "hardware_profiles" / f"{args.out}.yaml"
    run_dir = root / "calibration" / "runs" / args.out
    if not args.force and not args.from_run:   # refuse before spending minutes measuring
        if profile_path.exists():
            raise ZsimInputError("--out", args.out, f"{profile_path} exists; pass --force to overwrite it "
                                                    "or choose another name")
        rec = run_dir / "records.json"
        if rec.exists() and _complete(rec):
            raise ZsimInputError("--out", args.out, f"{rec} holds a complete run; pass --force to overwrite it")
    try:
        import torch
    except ImportError:
        raise ZsimInputError("torch", "not installed", "the calibration harness needs it: "
                             "`pip install torch==2.13.0` then `pip install -e '.[calibration]'`") from None
    from calibration.harness.launch import CalibrationFailed, calibrate, fit_and_write
    from calibration.harness.pool import precheck
    if args.from_run:
        return _fit_existing(args, dtypes, profile_path, run_dir, fit_and_write, base)
    if nproc is None:
        nproc = torch.cuda.device_count() if torch.cuda.is_available() else 2
        if nproc == 1 and base is None:   # one GPU
            raise ZsimInputError("--nproc-per-node", "1 (the GPU count)", _ONE_RANK_FIX)
    if args.backend == "nccl":
        if not torch.cuda.is_available():
            raise ZsimInputError("--backend", "nccl", "NCCL needs CUDA GPUs; use gloo on this machine")
    if args.pool_collectives:   # the pooled runs must have measured the cluster this run will
        backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        precheck(args.pool_collectives, run_dir, {"world_size": nproc, "backend": backend})
    if base is not None and nproc > 1:
        print(f"zsim calibrate: --base {base[0]} unused: {nproc} ranks measure their own interconnect",
              file=sys.stderr)
        base = None
    print(f"zsim calibrate: {plan.mode} mode, {nproc} ranks, results in {run_dir}", file=sys.stderr)
    # a --force re-measure replaces the complete run the profile came from only once it succeeds
    previous = run_dir.with_name(run_dir.name + ".previous")
    rec = run_dir / "records.json"
    kept = args.force and rec.is_file() and _complete(rec)
    if kept:
        shutil.rmtree(previous, ignore_errors=True)
        shutil.copytree(run_dir, previous)
    try:
        out = calibrate(args.out, plan, root=root, nproc=nproc, backend=args.backend, force=args.force, dtypes=dtypes,
                        interconnect=base)
    except CalibrationFailed as err:
        print(f"zsim: error: {err}", file=sys.stderr)
        if kept:
            failed = run_dir.with_name(run_dir.name + ".failed")
            shutil.rmtree(failed, ignore_errors=True)
            run_dir.rename(failed)
            previous.rename(run_dir)
            print(f"zsim calibrate: the previous complete run is back in {run_dir} (this attempt's records: "
                  f"{failed})", file=sys.stderr)
        return 1
    if kept:
        shutil.rmtree(previous, ignore_errors=True)
    _print_layers(out["report"])
    print(f"wrote {out['profile_path']} and {out['run_dir']}/ ({out['records']} records, {out['wall_s']:.1f} s)",
          file=sys.stderr)
    if args.pool_collectives:
        args.from_run = str(out["run_dir"])
        args.force = True   # refit the run just written, with the pooled collectives
        from calibration.harness.launch import fit_and_write
        return _fit_existing(args, dtypes, profile_path, run_dir, fit_and_write, base)
    return 0
