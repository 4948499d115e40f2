"""Running recorded cases: each under its own torchrun, and the command line every recorder takes
(--case under torchrun, --all, --list, --out)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEAK_STEP = ("optimizer step index OPT_STEPS (the third), under calibration/core/memory.py TensorMemoryTracker "
             "started after the recorded steps; its collectives are not kept")


def torchrun_each(module: str, runs: list[tuple[str, int, dict]], out_dir: str, extensions_dir: str) -> None:
    """`python -m module --case NAME --out out_dir` under torchrun for each (name, ranks, extra
    environment) of `runs`, one after another; exits 1 naming the cases that failed."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    failed = []
    for name, ranks, extra in runs:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (REPO_ROOT, env.get("PYTHONPATH"))))
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir)
        env.pop("LOCAL_SIZE", None)
        env.update(extra)
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(ranks), "-m", module, "--case", name, "--out", out_dir]
        print("+", " ".join(cmd), flush=True)
        try:
            rc = subprocess.call(cmd, env=env, timeout=600)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            failed.append(name)
    if failed:
        print("FAILED:", failed)
        sys.exit(1)


def case_main(cases, default_out: str, run_case, run_all) -> None:
    """--list the cases, --all of them (`run_all(names, out_dir)`), or one --case
    (`run_case(name, out_dir)`, under torchrun)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--case")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", default=default_out)
    a = ap.parse_args()
    if a.list:
        print("\n".join(cases))
        return
    if a.all:
        run_all(list(cases), os.path.abspath(a.out))
        return
    if a.case not in cases:
        ap.error(f"unknown case {a.case!r}; use --list")
    run_case(a.case, os.path.abspath(a.out))


def _install_group_ranks():
    """Add the members of each collective's process group (global ranks) to its record."""
    import torch.distributed as td

    from calibration.deepspeed_record import recorder

    orig = recorder._record

    def _record(name, sig, args, kwargs):
        orig(name, sig, args, kwargs)
        rec = recorder.RECORDS[-1]
        group = None
        if sig is not None:
            try:
                group = sig.bind(*args, **kwargs).arguments.get("group")
            except TypeError:
                group = kwargs.get("group")
        else:
            group = kwargs.get("group")
        try:
            rec["group_ranks"] = list(td.get_process_group_ranks(group or td.group.WORLD))
        except Exception:  # pragma: no cover
            rec["group_ranks"] = None

    recorder._record = _record


def start_recording() -> int:
    """The recorder's wrappers on torch.distributed, gloo, each record's group members, then
    DeepSpeed's own init (imported after the wrappers, so it binds them): this rank."""
    from calibration.deepspeed_record.recorder import install_recorder

    install_recorder()
    import torch.distributed as td

    td.init_process_group("gloo")
    _install_group_ranks()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return td.get_rank()


def index_model(model) -> list[dict]:
    """The model's parameters as a fixture lists them; the recorder learns their indices and the
    modules' names."""
    from calibration.deepspeed_record.annotations import install_annotations
    from calibration.deepspeed_record.recorder import MODULE_NAME, PARAM_INDEX

    params = [{"index": i, "name": n, "numel": int(p.numel()), "shape": list(p.shape)}
              for i, (n, p) in enumerate(model.named_parameters())]
    for i, (_, p) in enumerate(model.named_parameters()):
        PARAM_INDEX[id(p)] = i
    for n, m in model.named_modules():
        MODULE_NAME[id(m)] = n or "<root>"
    install_annotations()
    return params


def end_recording() -> None:
    """Every rank done, then out without the interpreter's teardown (see
    calibration/core/measured.py exit_without_teardown)."""
    import torch.distributed as td

    from calibration.core.measured import exit_without_teardown

    td.barrier()
    td.destroy_process_group()
    exit_without_teardown()


def write_fixture(doc: dict, out_dir: str, name: str) -> str:
    """One case's fixture, out_dir/name.json (sorted keys, one-space indent): its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1, sort_keys=True)
        fh.write("\n")
    return path


def gather_traces(**own) -> tuple[list[dict], bool]:
    """Every rank's trace of the recorded collectives (numbered first), with `own` (its peak, its
    error), gathered on every rank; and whether the traces are identical. The gather's own
    collective is not kept."""
    import torch.distributed as td

    from calibration.deepspeed_record.recorder import RECORDS, STATE

    for i, r in enumerate(RECORDS):
        r["idx"] = i
    key = ("op", "fn", "numel", "dtype", "phase", "micro_step", "opt_step", "group_size")
    mine = {"trace": [[r[k] for k in key] for r in RECORDS], **own}
    gathered: list = [None] * td.get_world_size()
    n_kept = len(RECORDS)
    STATE["phase"] = "post"
    td.all_gather_object(gathered, mine)
    del RECORDS[n_kept:]
    return gathered, all(x["trace"] == gathered[0]["trace"] for x in gathered)


def run_facts(model, param_list: list[dict]) -> dict:
    """What a fixture says of the run that recorded it: backend, versions, accelerator, the model."""
    import sys

    import deepspeed
    import torch
    import torch.distributed as td

    return {"backend": td.get_backend(),
            "versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                         "python": sys.version.split()[0]},
            "accelerator": type(deepspeed.get_accelerator()).__name__,
            "model": {"vocab": model.vocab, "seq_len": model.seq_len, "layers": model.layers,
                      "hidden": model.hidden, "heads": model.heads, "ffn": model.ffn,
                      "tied_lm_head": model.tied_embeddings,
                      "total_params": sum(p["numel"] for p in param_list)}}
