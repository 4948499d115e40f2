"""Single-node launcher: runs the ranks under torchrun, watches them, fits, writes outputs.

The ranks measure into a scratch directory; the launcher shows the progress of rank 0 with
an ETA, detects a rank that dies (its pid vanishes) or hangs (no rank advances for the
timeout), stops the job and names the rank and the benchmark. Raw records are kept in every
case; the profile is written (atomically) only after a complete run.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from calibration.harness import ds_ops, nccl_log
from calibration.harness.fit import build_profile
from calibration.harness.plan import Plan, estimated_cost, items
from calibration.harness.nccl_log import NCCL_TUNING_FILE
from calibration.harness.pool import POOL_FILE

REPO_ROOT = Path(__file__).resolve().parents[2]
# How long the ranks may take to report at all (torchrun start, torch import, gloo rendezvous)
# before the launch counts as hung; after that the plan's own timeout applies.
START_GRACE_S = 120.0


class CalibrationFailed(Exception):
    """A run that could not finish; str() is one line naming the rank and the benchmark."""


def write_atomic(path: Path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def output_paths(root: Path, name: str) -> tuple[Path, Path]:
    return root / "hardware_profiles" / f"{name}.yaml", root / "calibration" / "runs" / name


def read_records(scratch: Path) -> list[dict]:
    p = scratch / "records.partial.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break   # a line cut by a kill: keep everything before it
    return out


def _proc_state(pid: int) -> str | None:
    """'R', 'S', 'T' (stopped), 'Z' (zombie) ... or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return "?"
        except OSError:
            return None


def _statuses(scratch: Path) -> dict[int, dict]:
    out = {}
    for p in (scratch / "status").glob("rank*.json"):
        try:
            s = json.loads(p.read_text())
            out[int(s["rank"])] = s
        except (OSError, ValueError, KeyError):
            pass
    return out


class _Bar:
    def __init__(self, names: list[str]):
        self.names = names
        self.w = [estimated_cost(n) for n in names]
        self.cum = [sum(self.w[:i]) for i in range(len(names) + 1)]
        self.t0 = time.time()
        self.tty = sys.stderr.isatty()
        self.last = -1.0
        self.shown = -1

    def show(self, index: int):
        if index == self.shown and not self.tty:
            return
        self.shown = index
        frac = self.cum[min(index, len(self.names))] / self.cum[-1]
        el = time.time() - self.t0
        eta = el / frac * (1 - frac) if frac > 0.02 else math.nan
        eta_s = "--:--" if math.isnan(eta) else f"{int(eta) // 60}:{int(eta) % 60:02d}"
        bar = "#" * int(30 * frac) + "." * (30 - int(30 * frac))
        name = self.names[min(index, len(self.names) - 1)]
        line = f"[{bar}] {min(index + 1, len(self.names))}/{len(self.names)} {100 * frac:3.0f}% ETA {eta_s}  {name[:56]}"
        if self.tty:
            sys.stderr.write("\r" + line.ljust(112))
            sys.stderr.flush()
        elif time.time() - self.last > 10:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
            self.last = time.time()

    def close(self):
        if self.tty:
            sys.stderr.write("\r" + " " * 112 + "\r")
            sys.stderr.flush()


def _kill_job(proc: subprocess.Popen):
    """Stop torchrun and its ranks: the job runs in its own session (we started it)."""
    for sig, wait_s in ((signal.SIGCONT, 0), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if wait_s:
            try:
                proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                pass


def _culprit(stat: dict[int, dict], first_dead: dict[int, float], world: int) -> tuple[int | None, str]:
    """The rank that failed first and how: a vanished rank before a rank with a Python error
    (its peers then fail too, with connection errors); among errors, not-a-peer-error first."""
    if first_dead:
        dead = sorted(first_dead, key=lambda r: (first_dead[r], r))
        silent = [r for r in dead if stat.get(r, {}).get("state") not in ("error", "terminated")]
        if silent:
            return silent[0], "died (killed or crashed without a Python error)"
    errs = [r for r in sorted(stat) if stat[r].get("state") == "error"]
    peer_words = ("connection", "peer", "closed", "reset", "broken pipe", "timed out", "timeout")
    own = [r for r in errs if not any(w in stat[r]["error"].lower() for w in peer_words)]
    if own or errs:
        r = (own or errs)[0]
        return r, f"failed: {stat[r]['error'][:160]}"
    missing = [r for r in range(world) if r not in stat]
    if missing:
        return missing[0], "never started (rendezvous or import failure; see torchrun.log)"
    return None, "failed"


def waiting_on(status: dict, env: dict) -> str:
    """What a rank silent past the timeout was waiting on, from its last status and the build locks."""
    held = ds_ops.stale_locks(ds_ops.extensions_root(env), older_than_s=0.0)
    if held:
        return f"waiting on the torch-extensions lock {held[0][0]}: {ds_ops.lock_advice(*held[0])}"
    if status.get("phase") == "sync":
        return "waiting at the benchmark's synchronisation for a rank that never arrived"
    return "inside the benchmark's measurement, before its first synchronisation with the other ranks"


def measure(plan: Plan, scratch: Path, nproc: int, backend: str | None, log_path: Path) -> None:
    """Run the ranks; return on success, raise CalibrationFailed otherwise."""
    if scratch.exists():
        shutil.rmtree(scratch)
    (scratch / "status").mkdir(parents=True)
    (scratch / "plan.json").write_text(plan.to_json())
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["ZSIM_CALIB_NO_PROGRESS"] = "1"    # the launcher draws rank 0's progress itself
    # on NCCL, rank 0 prints the tuner's latency/bandwidth table per communicator (nccl_log.py); gloo ignores it
    env.setdefault("NCCL_DEBUG", "INFO")
    env.setdefault("NCCL_DEBUG_SUBSYS", "INIT,TUNING")
    try:   # before any timed benchmark: a rank must never compile inside one
        env[ds_ops.READY_ENV] = ds_ops.prepare(env)
    except ds_ops.OpBuildFailed as err:
        raise CalibrationFailed(str(err)) from None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "calibration.harness.worker", "--run-dir", str(scratch)]
    if backend:
        cmd += ["--backend", backend]
    names = items(plan, nproc, 1)
    bar = _Bar(names)
    first_dead: dict[int, float] = {}
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    t_start = time.time()
    reason = None
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            stat = _statuses(scratch)
            if 0 in stat:
                bar.show(int(stat[0].get("index", 0)))
            now = time.time()
            for r, s in stat.items():
                if s.get("state") != "done" and r not in first_dead and _proc_state(int(s["pid"])) in (None, "Z"):
                    first_dead[r] = now
            if first_dead:
                # torchrun tears the others down within seconds; do not wait for the timeout
                if now - min(first_dead.values()) > 10:
                    _kill_job(proc)
                continue
            last = max([s.get("time", t_start) for s in stat.values()] + [t_start])
            # until every rank has reported, the clock also covers torchrun, the torch import and
            # the rendezvous, which take tens of seconds on a loaded machine without any hang
            limit_s = plan.timeout_s if len(stat) == nproc else max(plan.timeout_s, START_GRACE_S)
            if now - last > limit_s:
                stopped = [r for r, s in stat.items() if _proc_state(int(s["pid"])) == "T"]
                # the culprit is behind: an earlier benchmark, or the same one but short of its
                # first synchronisation while the others wait there
                lag = min(stat.values(), key=lambda s: (s.get("index", 0), s.get("phase") == "sync", s["rank"])) \
                    if stat else None
                if stopped:
                    r = stopped[0]
                    reason = f"rank {r} hung (process stopped) during benchmark '{stat[r]['item']}'"
                elif lag is not None and len({(s.get('index'), s.get('phase')) for s in stat.values()}) > 1:
                    reason = f"rank {lag['rank']} hung during benchmark '{lag['item']}' ({waiting_on(lag, env)})"
                elif lag is not None:
                    reason = (f"ranks {','.join(map(str, sorted(stat)))} made no progress for {plan.timeout_s:g} s "
                              f"in benchmark '{lag['item']}' ({waiting_on(lag, env)})")
                else:
                    reason = f"no rank started within {limit_s:g} s (see {log_path})"
                _kill_job(proc)
                break
    except KeyboardInterrupt:
        _kill_job(proc)
        bar.close()
        raise CalibrationFailed("interrupted")
    finally:
        log.close()
    bar.close()
    stat = _statuses(scratch)
    if reason is None and proc.returncode == 0 and len(stat) == nproc and all(s.get("state") == "done" for s in stat.values()):
        return
    if reason is None:
        r, how = _culprit(stat, first_dead, nproc)
        where = f" during benchmark '{stat[r]['item']}'" if r is not None and stat.get(r, {}).get("item") else ""
        reason = f"rank {r} {how}{where}" if r is not None else f"torchrun exited with code {proc.returncode}"
    raise CalibrationFailed(reason)


def finish(name: str, scratch: Path, profile_path: Path, run_dir: Path, dtypes: tuple[str, ...], status: str,
           error: str = "", interconnect: tuple[str, dict] | None = None) -> tuple[list[dict], dict | None, dict | None]:
    """Move the raw records to run_dir (atomically); on a complete run fit and write the profile."""
    records = read_records(scratch)
    prov = {}
    if (scratch / "provenance.json").exists():
        prov = json.loads((scratch / "provenance.json").read_text())
    plan = json.loads((scratch / "plan.json").read_text()) if (scratch / "plan.json").exists() else {}
    run_dir.mkdir(parents=True, exist_ok=True)
    log = scratch / "torchrun.log"
    tunings = nccl_log.parse_tuning(log.read_text(errors="replace")) if log.exists() else []
    (run_dir / NCCL_TUNING_FILE).unlink(missing_ok=True)   # a previous run's, on other hardware perhaps
    if tunings:   # NCCL's own tuning and the algorithm it names for each measured size
        write_atomic(run_dir / NCCL_TUNING_FILE, json.dumps(
            {"communicators": tunings, "choices": nccl_log.choices_for(records, tunings)}, indent=1) + "\n")
        prov["nccl_tuning"] = NCCL_TUNING_FILE
    if interconnect is not None:   # a refit (--from-run) of a one-rank run finds its base here
        prov["interconnect_from"] = interconnect[0]
    # collectives pooled into the run this one replaces belong to that run's profile
    (run_dir / POOL_FILE).unlink(missing_ok=True)
    doc = {"format": 1, "status": status, "error": error, "provenance": prov, "plan": plan, "records": records}
    write_atomic(run_dir / "records.json", json.dumps(doc, indent=1, sort_keys=True) + "\n")
    if (scratch / "torchrun.log").exists():
        shutil.copyfile(scratch / "torchrun.log", run_dir / "torchrun.log")
    if status != "complete":
        return records, None, None
    profile, report = fit_and_write(name, records, prov, dtypes, profile_path, run_dir, interconnect)
    return records, profile, report


def fit_and_write(name: str, records: list[dict], prov: dict, dtypes: tuple[str, ...], profile_path: Path,
                  run_dir: Path, interconnect: tuple[str, dict] | None = None):
    from zsim.schema import build
    from zsim.specs.hardware import HardwareProfile
    profile, report = build_profile(name, records, prov, dtypes, interconnect)
    build(HardwareProfile, profile, str(profile_path))   # refuse to write a profile zsim cannot load
    write_atomic(run_dir / "fit_report.json", json.dumps(report, indent=1, sort_keys=True, default=float) + "\n")
    write_atomic(profile_path, profile_header(profile, report, run_dir) +
                 _dump_profile(profile))
    return profile, report


class _ProfileDumper(yaml.SafeDumper):
    """Block style for mappings, flow style for number lists ([bytes, fraction] pairs)."""


def _dump_profile(profile: dict) -> str:
    class D(_ProfileDumper):
        pass
    D.add_representer(list, lambda d, data: d.represent_sequence(
        "tag:yaml.org,2002:seq", data, flow_style=all(isinstance(v, (int, float)) for v in data)))
    return yaml.dump(profile, Dumper=D, sort_keys=False, default_flow_style=False, width=100)


def profile_header(profile: dict, report: dict, run_dir: Path) -> str:
    p = profile["provenance"]
    lines = [f"# {profile['name']}: measured by `zsim calibrate` ({p.get('mode')} mode), not hand-written.",
             f"# {p.get('date')} on {p.get('hosts')}: {p.get('world_size')} ranks ({p.get('ranks_per_node')} per node), "
             f"backend {p.get('backend')}, torch {p.get('torch')}, device: {p.get('gpu')}.",
             f"# Raw records and fit residuals: {run_dir.as_posix().split('/calibration/', 1)[-1] if '/calibration/' in run_dir.as_posix() else run_dir}"
             " (calibration/runs/<name>/records.json, fit_report.json).",
             "# Method (calibration/harness/fit.py): collectives alpha-beta per tier with one efficiency table per",
             "# collective at every measured size; GEMM law fitted on the layer's shapes (peak: the datasheet's dense",
             "# peak on a known GPU, max efficiency fitted; else the law's asymptote;",
             "# see [Note: the GEMM law against the datasheet], calibration/harness/fit_compute.py);",
             "# attention and memory-bound efficiencies against zsim's FLOP/byte counts; then a layer closure",
             "# (GEMM and attention fwd/bwd scales, least squares; memory-bound and launch costs stay as measured)",
             "# fits the measured transformer layers. Leave-one-shape-out errors: fit_report.json compute.layers_held_out."]
    if p.get("pooled_collectives"):
        lines.append(f"# Collective timings pooled with {p['pooled_collectives']} "
                     "(calibration/runs/<name>/pooled_collectives.json).")
    for tier, t in report["collectives"].items():
        worst = max((abs(e) for ab in t["alpha_beta"].values() for _, e in ab["residuals"]), default=0.0)
        lines.append(f"# {tier}: alpha-beta fit worst residual {100 * worst:.0f}% (the per-size tables remove it).")
    for r in report["compute"].get("layers", []):
        lines.append(f"# layer {r['layer']} {r['dtype']} {r['pass']}: measured {r['measured_s'] * 1e3:.3f} ms, "
                     f"zsim {r['predicted_s'] * 1e3:.3f} ms ({100 * r['error']:+.1f}%)")
    if p.get("nodes") == "1":
        lines.append("# inter_node was not measured (single node): it mirrors intra_node.")
    return "\n".join(lines) + "\n"


def calibrate(name: str, plan: Plan, *, root: Path, nproc: int, backend: str | None, force: bool,
              dtypes: tuple[str, ...], interconnect: tuple[str, dict] | None = None) -> dict:
    profile_path, run_dir = output_paths(root, name)
    scratch = run_dir.parent / f".{name}.scratch-{os.getpid()}"
    scratch.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        try:
            measure(plan, scratch, nproc, backend, scratch / "torchrun.log")
        except CalibrationFailed as err:
            records, _, _ = finish(name, scratch, profile_path, run_dir, dtypes, "failed", str(err))
            raise CalibrationFailed(f"calibration failed: {err}; {len(records)} records measured so far are kept "
                                    f"in {run_dir / 'records.json'}") from None
        records, profile, report = finish(name, scratch, profile_path, run_dir, dtypes, "complete",
                                          interconnect=interconnect)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"profile_path": profile_path, "run_dir": run_dir, "records": len(records), "wall_s": time.time() - t0,
            "report": report, "profile": profile}
