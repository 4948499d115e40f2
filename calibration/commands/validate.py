"""zsim validate: run a scenario for real (torchrun, gloo on CPU) and put the measurement beside
zsim's prediction on the calibrated profile: step time, phases, collectives, peak memory.

Contributed to the `zsim` CLI through the `zsim.commands` entry point group (pyproject.toml;
zsim never imports calibration). torch is needed by the launched ranks only; this module
imports no torch. See docs/validation.md.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from zsim.errors import ZsimInputError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PROFILE = "cpu-gloo-localhost"
ENGINES = ("own", "deepspeed", "fsdp")
INSTALL = {
    "own": "pip install torch==2.13.0",
    "fsdp": "pip install torch==2.13.0",
    "deepspeed": "pip install torch==2.13.0 && DS_BUILD_OPS=0 pip install deepspeed==0.19.8",
}


def add_parser(sub):
    p = sub.add_parser("validate", help="run a scenario on the real sharded core and compare with the prediction",
                       description="Launch the scenario under torchrun (the own ZeRO core, DeepSpeed or FSDP2), "
                                   "simulate it on the calibrated profile and print measured vs predicted.")
    p.add_argument("scenario", help="scenario YAML")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a scenario key (repeatable)")
    p.add_argument("--engine", default="own", help="own | deepspeed | fsdp (default: own)")
    p.add_argument("--profile", default=None,
                   help=f"hardware profile of the prediction (default: {DEFAULT_PROFILE}, written by zsim calibrate)")
    p.add_argument("--nproc-per-node", default=None, metavar="N",
                   help="ranks to launch (default: the scenario's world size; one node)")
    p.add_argument("--steps", default="8", metavar="N", help="timed optimizer steps after warm-up (default 8)")
    p.add_argument("--warmup", default="2", metavar="N", help="warm-up steps (default 2)")
    p.add_argument("--python", default=None, metavar="PATH",
                   help="python that runs the ranks (default: this one; e.g. a venv with deepspeed)")
    p.add_argument("--json", metavar="PATH", help="write measured, predicted and errors as JSON")
    p.add_argument("--trace", metavar="PATH", help="write the measured and the simulated step as one Chrome trace")
    p.add_argument("--timeout", default="900", metavar="SECONDS", help="give up on the run after this long")
    p.set_defaults(func=main)


def _int(text, field, lo=1):
    try:
        v = int(text)
    except (TypeError, ValueError):
        raise ZsimInputError(field, text, f"give an integer >= {lo}") from None
    if v < lo:
        raise ZsimInputError(field, text, f"give an integer >= {lo}")
    return v


def peer_note(engine: str, sc) -> str:
    """What the peer runs in place of a ZeRO stage it has no counterpart of ("" when it runs the
    stage itself): calibration/core/peers.py shards FSDP2 with reshard_after_forward=False for
    stages 1 and 2 (its SHARD_GRAD_OP)."""
    if engine != "fsdp" or sc.zero.stage not in (1, 2):
        return ""
    return (f"--engine fsdp runs ZeRO stage {sc.zero.stage} as FSDP2 fully_shard with reshard_after_forward=False: "
            "each module's gradients reduce-scattered in every backward, parameters kept gathered after forward; "
            f"DeepSpeed's stage {sc.zero.stage} reduces its gradients in buckets"
            + (" at the accumulation boundary only" if sc.zero.stage == 1 else "")
            + ", so the collective lists differ")


def check_engine(engine: str, python: str) -> None:
    """One-line error naming the install command when the engine's packages are missing."""
    if engine not in ENGINES:
        raise ZsimInputError("--engine", engine, "use one of: " + ", ".join(ENGINES))
    mods = ["torch"] + (["deepspeed"] if engine == "deepspeed" else [])
    if python == sys.executable:
        missing = [m for m in mods if importlib.util.find_spec(m) is None]
    else:
        code = "import importlib.util as u,sys;print(','.join(m for m in sys.argv[1:] if u.find_spec(m) is None))"
        try:
            out = subprocess.run([python, "-c", code, *mods], capture_output=True, text=True, timeout=60)
        except OSError:
            raise ZsimInputError("--python", python, "give the path of a python executable") from None
        missing = [m for m in out.stdout.strip().split(",") if m]
    if missing:
        raise ZsimInputError("--engine", engine, f"{' and '.join(missing)} not installed in {python}: "
                                                 f"run `{INSTALL[engine]}` (or pass --python of a venv that has it)")


def _stop(proc) -> None:
    """SIGTERM to the run's process group, SIGKILL if it has not gone within 10 s."""
    import signal
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def failure_line(stderr: str) -> str:
    """The line of a failed torchrun that says why: the ranks' last own line (an exception's
    message, a SystemExit text), not torchrun's report around it (its W/E/I log lines, the
    ChildFailedError banner, traceback frames)."""
    # an uncaught exception's lines come prefixed by the rank ("[rank1]: NameError: ...")
    lines = [re.sub(r"^\[rank\d+\]: ", "", ln) for ln in stderr.splitlines()
             if ln.strip() and not ln.startswith(("W1", "E1", "I1"))]
    said = [ln for ln in lines if not ln.startswith((" ", "=", "-", "[", "Traceback", "torch.distributed"))
            and "ChildFailedError" not in ln and "FAILED" not in ln and not ln.rstrip().endswith(":")]
    return (said or lines or ["no output"])[-1]


def has_cuda(python: str) -> bool:
    """Whether the ranks' python sees a CUDA GPU (the peers then run on it: calibration/core/peers.py).
    Without an NVIDIA driver on the machine it cannot, and no torch is imported to find out."""
    if not (shutil.which("nvidia-smi") or Path("/dev/nvidiactl").exists()):
        return False
    try:
        out = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip() == "True"


def predict(sc) -> tuple[dict, object]:
    from zsim.api import run_scenario
    from zsim.schedule.build import build_schedule
    from calibration.validation import (collective_summary, phase_times, schedule_collectives, schedule_summary,
                                        stage_calls)
    from zsim.schedule.build import DTYPE_BYTES

    # every micro-step simulated: phase times are compared with a run that executes them all
    result, trace = run_scenario(sc, steady=False)
    _, schedule = build_schedule(sc)
    out = {"step_time_s": result.step_time_s, "peak_bytes": result.memory.peak_bytes,
           "phases_s": phase_times(trace.schedule, trace.timings),
           "collectives": [list(c) for c in schedule_collectives(schedule)],
           "collectives_summary": schedule_summary(schedule),
           "memory_breakdown": result.memory.breakdown}
    if schedule.stages > 1 or schedule.tensor > 1:
        # each stage's rank issues its own calls (rank 0: stage 0's); under TP only the tensor
        # group's and the pipe's are compared (see validation.tensor_and_pipe_calls)
        per_stage = [[list(c) for c in stage_calls(schedule, s, DTYPE_BYTES[sc.precision],
                                                   tensor_and_pipe=schedule.tensor > 1)]
                     for s in range(schedule.stages)]
        out.update(collectives=per_stage[0], collectives_per_stage=per_stage,
                   collectives_summary=collective_summary(per_stage[0]))
    return out, trace


def main(args) -> int:
    from zsim.config.scenario import load_scenario
    from zsim.report.writers import chrome_trace, write_atomic
    from calibration.validation import (collective_summary, compare, prediction_overrides, render_text,
                                        tensor_and_pipe_calls)

    from zsim.commands.common import check_output_paths
    check_output_paths(args)   # before the run: an output must not replace the scenario or the other output
    python = args.python or sys.executable
    if args.engine not in ENGINES:
        raise ZsimInputError("--engine", args.engine, "use one of: " + ", ".join(ENGINES))
    steps = _int(args.steps, "--steps")
    warmup = _int(args.warmup, "--warmup", 0)
    timeout = _int(args.timeout, "--timeout")
    overrides = list(args.set or ())
    # the prediction's profile is --profile's; `--set hardware.profile=P`, as zsim run takes it, says the same
    set_profiles = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].strip() == "hardware.profile"]
    if set_profiles and args.profile is not None and set_profiles[-1] != args.profile:
        raise ZsimInputError("--set hardware.profile", set_profiles[-1], f"disagrees with --profile {args.profile}; "
                             "give the prediction's profile once (--profile)")
    args.profile = args.profile or (set_profiles[-1] if set_profiles else DEFAULT_PROFILE)
    sc0 = load_scenario(args.scenario, tuple(overrides))
    if sc0.pipeline_stages > 1 and args.engine == "fsdp":
        raise ZsimInputError("parallelism.pipeline", sc0.pipeline_stages,
                             "--engine fsdp runs data parallelism only; use --engine own or deepspeed")
    tensor = sc0.tensor_parallel_size > 1
    if tensor:
        # the core's tensor-parallel runner (calibration/core/tensor_run.py) trains Megatron's TP
        # with DeepSpeed's 1F1B, plain AdamW and ZeRO-0's data-parallel all-reduce: ZeRO-0 is
        # what it shares with zsim's schedule
        if args.engine != "own":
            raise ZsimInputError("--engine", args.engine, "tensor parallelism runs on the own core only; use --engine own")
        if sc0.precision != "fp32":
            raise ZsimInputError("training.precision", sc0.precision,
                                 "the core's tensor-parallel runner keeps AdamW states in the model dtype where "
                                 "DeepSpeed keeps fp32 masters; validate tensor parallelism in fp32")
        if sc0.zero.stage != 0:
            raise ZsimInputError("deepspeed.zero_optimization.stage", sc0.zero.stage,
                                 "the core's tensor-parallel runner steps plain AdamW; set it to 0")
    nproc = _int(args.nproc_per_node, "--nproc-per-node") if args.nproc_per_node else sc0.cluster.world_size
    overrides += prediction_overrides(args.profile, nproc)
    sc = load_scenario(args.scenario, tuple(overrides))
    if args.engine == "own" and not tensor:
        from calibration.core.plan import unsupported   # pure python, no torch
        why = unsupported(sc)
        if why:
            raise ZsimInputError("scenario", args.scenario, f"the training core does not run {why}")
    if args.engine == "deepspeed" and sc.pipeline_stages > 1:
        from calibration.core.ds_pipe import unsupported as pipe_unsupported   # no torch at import
        why = pipe_unsupported(sc)
        if why:
            raise ZsimInputError("scenario", args.scenario, f"--engine deepspeed with a pipeline does not run {why}")
    check_engine(args.engine, python)
    for warning in sc.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    note = peer_note(args.engine, sc)
    if note:
        print(f"note: {note}", file=sys.stderr)
    predicted, trace = predict(sc)

    with tempfile.TemporaryDirectory(prefix="zsim-validate-") as tmp:
        out = Path(tmp) / "measured.json"
        mtrace = Path(tmp) / "measured_trace.json"
        cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        common = ["--scenario", str(Path(args.scenario).resolve()), "--steps", str(steps), "--warmup", str(warmup),
                  "--out", str(out)]
        cmd += (["-m", "calibration.core.tensor_run", *common] if tensor else
                ["-m", "calibration.core.run", *common, "--engine", args.engine, "--trace", str(mtrace)])
        for o in overrides:
            cmd += ["--set", o]
        cuda = args.engine != "own" and not tensor and has_cuda(python)
        if args.engine != "own" and not tensor:
            from calibration.core.peers import unsupported as peer_unsupported   # no torch at import
            why = peer_unsupported(sc, cuda)
            if why:
                raise ZsimInputError("scenario", args.scenario, f"--engine {args.engine} does not run {why}")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        if not cuda:   # CPU ranks share the cores; on a GPU DeepSpeedCPUAdam uses them all
            env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
        if args.engine == "deepspeed":
            if not cuda:
                env.setdefault("DS_ACCELERATOR", "cpu")
            env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
        print(f"zsim validate: running {sc.name} on {nproc} ranks ({args.engine}), {warmup}+{steps} steps ...",
              file=sys.stderr)
        # the ranks in a session of their own: a timeout or Ctrl-C stops torchrun and every rank
        # (subprocess.run's kill would reach torchrun alone and leave its ranks running)
        with subprocess.Popen(cmd, env=env, cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) as proc:
            try:
                _, stderr = proc.communicate(timeout=timeout)
            except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
                _stop(proc)
                what = (f"did not finish within {timeout} s" if isinstance(exc, subprocess.TimeoutExpired)
                        else "was interrupted")
                print(f"zsim: error: the {args.engine} run {what}; its ranks were stopped", file=sys.stderr)
                return 1 if isinstance(exc, subprocess.TimeoutExpired) else 130
        if proc.returncode != 0 or not out.exists():
            print(f"zsim: error: the {args.engine} run failed (exit {proc.returncode}): {failure_line(stderr or '')}",
                  file=sys.stderr)
            return 1
        measured = json.loads(out.read_text())
        measured_trace = json.loads(mtrace.read_text()) if mtrace.exists() else None
    if tensor:
        measured["collectives"] = tensor_and_pipe_calls(measured["collectives"])
        measured["collectives_per_rank"] = [tensor_and_pipe_calls(c) for c in measured["collectives_per_rank"]]
    measured["collectives_summary"] = collective_summary(measured.get("collectives", []))
    report = compare(measured, predicted)
    report.update(scenario=sc.name, engine=args.engine, profile=args.profile, world_size=nproc)
    print(f"{sc.name}: {args.engine} engine, {nproc} ranks, profile {args.profile}")
    print(render_text(report))
    if args.json:
        write_atomic(args.json, json.dumps(report, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.trace:
        sim = chrome_trace(trace, sc.name)
        events = sim["traceEvents"] + (measured_trace["traceEvents"] if measured_trace else [])
        write_atomic(args.trace, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}) + "\n")
        print(f"wrote {args.trace}", file=sys.stderr)
    return 0
