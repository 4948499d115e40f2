"""DeepSpeed's JIT-built ops, prepared before any timed benchmark.

With deepspeed installed, DeepSpeedCPUAdam compiles its C++ extension (torch.utils.cpp_extension)
on first use, which takes minutes. Done inside the CPU-Adam benchmark it ran under the
benchmark's hang timeout: the quick mode's timeout killed the compile, the compile's
torch-extensions `lock` file stayed behind, and every later run waited on it forever (torch's
FileBaton polls for the lock to vanish). So the launcher builds the op first, in a subprocess of
the same python with its own generous timeout and a progress line, refuses to start while a
stale lock is there (saying how to clear it), and tells the ranks whether the op is ready; a rank
never compiles inside a timed benchmark.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

# A cold cpu_adam compile takes 1-3 minutes on a workstation, longer on two shared cores: 20
# minutes is generous and still ends a build that waits on something that never comes.
BUILD_TIMEOUT_S = 1200.0
# torch's FileBaton holds the lock only while one process compiles; one older than this when no
# build of ours runs was left by a killed build.
STALE_LOCK_S = 60.0
# what the ranks read (worker: bench_host.bench_adam): "built", or why the op is not measured
READY_ENV = "ZSIM_CALIB_DS_CPU_ADAM"

_BUILD = """
import sys
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("CPUAdamBuilder")
if builder is None or not builder.is_compatible():
    print("DeepSpeed's CPUAdamBuilder is not available on this accelerator")
    sys.exit(3)
builder.load()
"""


class OpBuildFailed(Exception):
    """The op build cannot proceed (a stale lock, or no end within the timeout); one line."""


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def extensions_root(env: dict) -> Path:
    """torch.utils.cpp_extension.get_default_build_root: TORCH_EXTENSIONS_DIR, else
    ~/.cache/torch_extensions (XDG_CACHE_HOME respected)."""
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "torch_extensions"


def stale_locks(root: Path, now: float | None = None, older_than_s: float = STALE_LOCK_S) -> list[tuple[Path, float]]:
    """(lock path, age in seconds) of the build locks (root/<py_cu>/<op>/lock) older than the limit."""
    now = time.time() if now is None else now
    out = []
    for lock in sorted(root.glob("*/*/lock")) + sorted(root.glob("*/lock")):
        try:
            age = now - lock.stat().st_mtime
        except OSError:
            continue
        if age > older_than_s:
            out.append((lock, age))
    return out


def lock_advice(lock: Path, age_s: float) -> str:
    return (f"the torch-extensions lock {lock} ({age_s / 60:.0f} min old) was left by an interrupted build of "
            f"DeepSpeed's op, and every build waits on it forever; if no other build is running, remove it: "
            f"rm {lock}")


def prepare(env: dict, timeout_s: float = BUILD_TIMEOUT_S, log=None) -> str:
    """Build DeepSpeed's cpu_adam op when deepspeed is installed; return the READY_ENV value
    ("built" or why not). Raises OpBuildFailed on a stale lock or a build past the timeout."""
    if not deepspeed_installed():
        return "not measured: deepspeed is not installed"
    log = log or sys.stderr
    root = extensions_root(env)
    stale = stale_locks(root)
    if stale:
        raise OpBuildFailed(lock_advice(*stale[0]))
    print(f"zsim calibrate: preparing DeepSpeed's cpu_adam op before the benchmarks (compiled once into {root}, "
          f"then loaded from there; limit {timeout_s:g} s)", file=log, flush=True)
    proc = subprocess.Popen([sys.executable, "-c", _BUILD], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    t0 = time.time()
    next_line = t0 + 30
    while proc.poll() is None:
        time.sleep(0.5)
        now = time.time()
        if now - t0 > timeout_s:
            os.killpg(proc.pid, 9)
            proc.wait()
            held = [lk for lk, _ in stale_locks(root, older_than_s=0.0)]
            what = f"; it was waiting on the lock {held[0]} (remove it: rm {held[0]})" if held else \
                "; the compiler did not finish"
            raise OpBuildFailed(f"building DeepSpeed's cpu_adam op did not finish in {timeout_s:g} s{what}")
        if now >= next_line:
            print(f"zsim calibrate: still building DeepSpeed's cpu_adam op ({now - t0:.0f} s)", file=log, flush=True)
            next_line = now + 30
    output = (proc.stdout.read() if proc.stdout else "").strip().splitlines()
    if proc.returncode == 0:
        print(f"zsim calibrate: DeepSpeed's cpu_adam op is ready ({time.time() - t0:.0f} s)", file=log, flush=True)
        return "built"
    last = output[-1][:160] if output else f"exit code {proc.returncode}"
    print(f"zsim calibrate: DeepSpeed's cpu_adam op could not be built ({last}); DeepSpeedCPUAdam is not measured",
          file=log, flush=True)
    return f"not measured: the op did not build ({last})"
