"""Fuzzing the CLI (the strategies and the property are in tests/commands/fuzz.py).

The fast profile runs in the normal test run (a few seconds); the long one, >= 10,000 examples
over all the properties, runs with `pytest -m fuzz` (pyproject.toml excludes the marker by
default). A sample also runs as real subprocesses (`zsim` on PATH semantics: python -m zsim.cli).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.commands import fuzz
from tests.helpers import ROOT, TIME_BOUND_S, TINY, Outcome, check, run_cli

FAST_EXAMPLES = int(os.environ.get("ZSIM_FUZZ_FAST", "12"))
LONG_EXAMPLES = int(os.environ.get("ZSIM_FUZZ_LONG", "2000"))   # per property; 6 properties


def _settings(n):
    return settings(max_examples=n, deadline=None, derandomize=n <= FAST_EXAMPLES, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def _write(tmp: str, name: str, data) -> str:
    p = Path(tmp) / name
    if isinstance(data, bytes):
        p.write_bytes(data)
    else:
        p.write_text(data, encoding="utf-8", errors="surrogateescape")
    return str(p)


COMMANDS = st.sampled_from([["run", "--quiet"], ["run"], ["memory"], ["compare", "--quiet"],
                            ["memory", "--like-deepspeed"], ["run", "--check", "--quiet"]])


def prop_scenario_file(raw, cmd):
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(tmp, "s.yaml", fuzz.dump_yaml(raw))
        argv = cmd[:1] + [path] + cmd[1:]
        check(run_cli(argv), argv)


def prop_set_values(assignments, cmd):
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(tmp, "s.yaml", fuzz.dump_yaml(TINY))
        argv = cmd[:1] + [path] + cmd[1:] + [a for s in assignments for a in ("--set", s)]
        check(run_cli(argv), argv)


def prop_ds_config(ds, as_positional, gpus):
    with tempfile.TemporaryDirectory() as tmp:
        ds_path = _write(tmp, "ds_config.json", fuzz.dump_json(ds))
        if as_positional:
            argv = ["run", ds_path, "--quiet", "--model", "gpt2", "--gpus", str(gpus)]
        else:
            raw = dict(TINY, deepspeed="ds_config.json")
            argv = ["run", _write(tmp, "s.yaml", fuzz.dump_yaml(raw)), "--quiet"]
        check(run_cli(argv), argv)


def prop_file_bytes(data, cmd_index):
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(tmp, ("s.yaml", "s.json", "r.json", "r.csv", "p.yaml")[cmd_index], data)
        argv = [["run", path], ["run", "--quiet", path], ["plot", path, "--kind", "scaling", "--out",
                str(Path(tmp) / "o.png")], ["plot", path, "--kind", "memory", "--out", str(Path(tmp) / "o.png")],
                ["run", "--quiet", "--set", f"hardware.profile={path}"]][cmd_index]
        check(run_cli(argv), argv)


_ARG = st.one_of(st.text(max_size=8), st.sampled_from(["0", "-1", "1e400", "nan", "inf", "1e30", "2.0", "true",
                                                       "1,2", "x=1", "hardware.nodes=1,2", "\udcff"]))
SUBCOMMANDS = st.one_of(
    st.tuples(st.just("memory"), st.sampled_from(["--total-params", "--largest-layer-params", "--gpus-per-node",
                                                  "--nodes", "--buffer-factor", "--stage"]), _ARG),
    st.tuples(st.just("tune"), st.sampled_from(["--budget", "--top", "--headroom"]), _ARG),
    st.tuples(st.just("doctor"), st.sampled_from(["--top", "--headroom"]), _ARG),
    st.tuples(st.just("run"), st.sampled_from(["--headroom", "--width", "--model", "--gpus", "--nodes",
                                               "--profile"]), _ARG),
    st.tuples(st.just("sweep"), st.sampled_from(["--vary", "--workers"]), _ARG),
)


def prop_subcommand_args(cmd):
    name, flag, value = cmd
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(tmp, "s.yaml", fuzz.dump_yaml(TINY))
        argv = [name, path, flag, value] + {"memory": ["--like-deepspeed"] if flag != "--stage" else [],
                                            "tune": ["--budget", "3"] if flag != "--budget" else [],
                                            "sweep": ["--workers", "1", "--quiet"] + (
                                                ["--vary", "hardware.nodes=1"] if flag != "--vary" else [])
                                            }.get(name, [])
        if name in ("run", "doctor"):
            argv.append("--quiet") if name == "run" else None
        check(run_cli(argv), argv)


PROPERTIES = [
    (prop_scenario_file, dict(raw=fuzz.mutated_scenarios(), cmd=COMMANDS)),
    (prop_set_values, dict(assignments=fuzz.set_assignments(), cmd=COMMANDS)),
    (prop_ds_config, dict(ds=fuzz.ds_configs(), as_positional=st.booleans(), gpus=st.integers(1, 16))),
    (prop_file_bytes, dict(data=st.one_of(st.binary(max_size=300), st.text(max_size=200),
                                          st.builds(lambda d: fuzz.Deep(d).text(), st.integers(1, 3000)),
                                          st.builds(lambda r: json.dumps(r, default=str),
                                                    st.lists(st.dictionaries(st.sampled_from(
                                                        ["world_size", "stage", "tokens_per_s", "ok", "memory.fits",
                                                         "breakdown", "peak_bytes"]), fuzz.SCALARS), max_size=3))),
                           cmd_index=st.integers(0, 4))),
    (prop_subcommand_args, dict(cmd=SUBCOMMANDS)),
]


def _run(prop, strategies, examples: int) -> int:
    """Run `prop` on `examples` generated inputs; return how many ran (hypothesis could stop
    early on a small search space: the count proves the profile's size)."""
    count = 0

    def counted(**kwargs):
        nonlocal count
        count += 1
        prop(**kwargs)
    given(**strategies)(_settings(examples)(counted))()
    print(f"{prop.__name__}: {count} examples, each under {TIME_BOUND_S:g} s")
    return count


@pytest.mark.parametrize("prop,strategies", PROPERTIES, ids=[p.__name__ for p, _ in PROPERTIES])
def test_fuzz_fast(prop, strategies):
    assert _run(prop, strategies, FAST_EXAMPLES) >= FAST_EXAMPLES


@pytest.mark.fuzz
@pytest.mark.parametrize("prop,strategies", PROPERTIES, ids=[p.__name__ for p, _ in PROPERTIES])
def test_fuzz_long(prop, strategies):
    assert _run(prop, strategies, LONG_EXAMPLES) >= LONG_EXAMPLES


@pytest.mark.parametrize("argv", [
    ["run", "SCEN", "--quiet", "--set", "deepspeed.zero_optimization.stage=2.0"],
    ["run", "SCEN", "--quiet", "--set", "model.preset=[gpt2]"],
    ["run", "BIN"], ["memory", "BIN"], ["compare", "BIN"], ["plot", "BIN", "--kind", "scaling", "--out", "o.png"],
    ["run", "SCEN", "--quiet", "--set", "hardware.nodes=1e30"],
])
def test_a_sample_as_real_subprocesses(tmp_path, argv):
    (tmp_path / "bin.yaml").write_bytes(bytes(range(256)))
    argv = [a.replace("SCEN", str(ROOT / "scenarios" / "default.yaml")).replace("BIN", str(tmp_path / "bin.yaml"))
            for a in argv]
    p = subprocess.run([sys.executable, "-m", "zsim.cli", *argv], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    check(Outcome(p.returncode, p.stdout, p.stderr, 0.0), argv)


@pytest.mark.parametrize("argv,code", [
    ([b"run", b"--set", b"name=\xff\xfe"], 0),                 # printed in the table
    ([b"run", b"--quiet", b"--set", b"training.precision=\xff"], 2),
    ([b"run", b"nope\xff.yaml"], 2),
    ([b"memory", b"--set", b"deepspeed.zero_optimization.st\xffage=1"], 2),
])
def test_non_utf8_arguments_as_real_subprocesses(tmp_path, argv, code):
    p = subprocess.run([sys.executable.encode(), b"-m", b"zsim.cli", *argv], capture_output=True, timeout=60,
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    err = p.stderr.decode("utf-8", "backslashreplace")
    check(Outcome(p.returncode, "", err, 0.0), argv)
    assert p.returncode == code, err
