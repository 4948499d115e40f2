"""Issue 46's target on real public files (tests/fixtures/real_inputs/, each with its source in
SOURCES.csv): every file DeepSpeed runs simulates as shipped, with only launch arguments added;
every file DeepSpeed rejects is refused in one line with exit 2; no traceback, no hang; the
defaults zsim chose for "auto" are named in the output.

The ground truth is SOURCES.csv's `deepspeed_verdict`, recorded by running DeepSpeed 0.19.8's own
config parsing (tests/fixtures/real_inputs/record_verdicts.py, run by hand in a separate venv).
Each file runs as a user runs it: `zsim run FILE` in-process, from the folder its project's
documentation launches in (the corpus files of that repository laid out at their paths in it,
so a recipe's `deepspeed: deepspeed_configs/zero3.json` resolves), adding only what a launch
adds: `--gpus 8` (DeepSpeed's --num_gpus) where the file names no GPU count, and
`--model gpt3-1.3b` (the training script's --model_name_or_path) where the file names no model.
No network: an empty Hugging Face cache and HF_HUB_OFFLINE=1.

benchmarks/real_inputs.py prints the same cases as counts (simulated / refused correctly /
wrong, with each reason).
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "real_inputs"
MODEL = "gpt3-1.3b"      # hidden size 2048, as record_verdicts.py's Trainer fill assumes
GPUS = "8"               # the world size record_verdicts.py judged at
HANG_S = 60              # a case still running after this has hung


def rows() -> list[dict]:
    with (CORPUS / "SOURCES.csv").open(newline="") as f:
        return list(csv.DictReader(f))


# The field each file DeepSpeed rejects must be named by (any one of), from DeepSpeed's message.
REJECT_FIELDS = {
    # DeepSpeed 0.19.8's CompileConfig forbids extra keys: "disable", "backend" (axolotl wrote
    # them for an older DeepSpeed)
    "deepspeed/zero1_torch_compile.json": ("compile",),
    "deepspeed/zero2_torch_compile.json": ("compile",),
    # train_batch_size 16 = micro-batch 16 x GAS x 8 GPUs has no GAS >= 1
    "deepspeed/megatron_ds_universal_checkpointing_ds_config.json": ("train_batch_size", "gradient_accumulation_steps"),
    # a template: a removed top-level key (DeepSpeed: "Use
    # 'data_efficiency.data_sampling.curriculum_learning'"), and placeholders such as
    # CONFIG_BATCH_SIZE where numbers belong (line 2, column 24: train_batch_size's value), which
    # DeepSpeed would refuse next
    "deepspeed/ds_config_gpt_TEMPLATE.json": ("curriculum_learning", "train_batch_size", "train_micro_batch_size_per_gpu",
                                              "line 2, column 24"),
    # 1-bit Adam left DeepSpeed in 0.19.7 (deepspeedai/DeepSpeed#8490): 0.19.8's deepspeed.initialize
    # asserts "OneBitAdam is not a supported DeepSpeed Optimizer" (engine.py _do_sanity_check)
    "deepspeed/deepspeed_bsz4k_onebitadam_config_seq128_nccl.json": ("optimizer.type",),
    # 1-bit LAMB left with 1-bit Adam (as above: "OneBitLamb is not a supported DeepSpeed Optimizer")
    "deepspeed/dsx_nccl_deepspeed_bsz64k_onebitlamb_config_seq128_nccl.json": ("optimizer.type",),
    # removed blocks (runtime/config.py _reject_removed_config_keys)
    "deepspeed/dsx_bing_bert_deepspeed_bsz64k_lamb_config_seq128.json": ("sparse_attention",),
    "deepspeed/dsx_bing_bert_deepspeed_bsz4k_progressive_layer_drop_config_seq128.json": ("progressive_layer_drop",),
    # train_batch_size below micro-batch x 8 GPUs: "Gradient accumulation steps: 0 has to be greater than 0"
    "deepspeed/dsx_config_ds_config_gpt_base_random_ltd.json": ("train_batch_size",),
    "deepspeed/dsx_compression_gpt2_ds_config.json": ("train_batch_size",),
    # an "auto" file for the HF Trainer without zero_optimization: accelerate's DeepSpeedPlugin
    # raises "Please specify the ZeRO optimization config in the DeepSpeed config."
    "deepspeed/dsx_dsconfigs_ds_config_tune.json": ("zero_optimization",),
    # the HF Trainer refuses train_batch_size 1 against 1 x 1 x 8 GPUs; zsim stops first at its
    # sequence_parallel_size 2 (DeepSpeed-Ulysses, not modelled), a true refusal of the same file
    "deepspeed/dsx_configs_autosp_config.json": ("train_batch_size", "sequence_parallel_size"),
}

# What each file needs that has not landed yet (issue 46). strict: a case that starts passing
# fails here until its mark is removed.
_PENDING_BY_REASON: dict[str, tuple[str, ...]] = {}
PENDING: dict[str, str] = {f: reason for reason, files in _PENDING_BY_REASON.items() for f in files}


def expectation(row: dict) -> str:
    """simulates | refused | not_deepspeed (an accelerate FSDP file: a one-line answer, exit 2) |
    ddp (an accelerate multi-GPU file: a simulation or a one-line answer, never a traceback)."""
    verdict = row["deepspeed_verdict"]
    if verdict.startswith("rejects"):
        return "refused"
    if "FSDP" in verdict:
        return "not_deepspeed"
    if "DDP" in verdict:
        return "ddp"
    assert verdict.startswith("accepts"), row
    return "simulates"


def launch_args(row: dict) -> list[str]:
    """What the launch adds to the file: the GPU count unless the file names it (an accelerate
    config's num_processes), the model unless the file names it (a recipe's base_model or
    model_name_or_path)."""
    kind = row["kind"]
    args = []
    if kind in ("ds_config", "accelerate_yaml"):
        args += ["--model", MODEL]
    if kind != "accelerate_yaml":
        args += ["--gpus", GPUS]
    return args + MODEL_ARGS.get(row["file"], [])


# Recipes whose Hub model has no public config.json copy to catalogue, run offline: the launch
# names the architecture itself (--model), as a user without the file does. file -> arguments
MODEL_ARGS = {
    # Skywork/Skywork-Reward-V2-Qwen3-8B: its model card's base_model is Qwen/Qwen3-8B, and the
    # recipe's model_type (AutoModelForSequenceClassification, num_labels 1) builds the score head
    "axolotl/reward-model.yaml": ["--model", "Qwen/Qwen3-8B"],
}


# Recipes whose model_name_or_path is a folder of the user's (the project's documentation makes it
# first): the launch finds it there, as the user's machine has it. file -> (folder, the Hub config
# it holds, what the documented step changed in it)
LOCAL_MODELS = {
    # LLaMA-Factory examples/README.md runs examples/extras/asft/ on a local copy of Qwen2.5-7B
    "llama_factory/extras_asft_qwen2_full_asft.yaml": ("models/Qwen2.5-7B", "Qwen--Qwen2.5-7B.json", {}),
    # examples/extras/llama_pro/expand.sh: scripts/llama_pro.py --model_name_or_path
    # meta-llama/Meta-Llama-3-8B-Instruct --output_dir models/llama3-8b-pro --num_expand 8, which
    # saves the config with num_hidden_layers + num_expand (32 + 8)
    "llama_factory/extras_llama_pro_llama3_freeze_sft.yaml": (
        "models/llama3-8b-pro", "meta-llama--Meta-Llama-3-8B-Instruct.json", {"num_hidden_layers": 40}),
}


def local_model(row: dict, root: Path):
    """Lay out the user's local model folder a recipe names (LOCAL_MODELS)."""
    if row["file"] not in LOCAL_MODELS:
        return
    folder, config, changes = LOCAL_MODELS[row["file"]]
    data = json.loads((CORPUS / "models" / config).read_text())
    data.update(changes)
    (root / folder).mkdir(parents=True, exist_ok=True)
    (root / folder / "config.json").write_text(json.dumps(data))


def launch_folder(row: dict, root: Path) -> Path:
    """Where the project's documentation launches from (as record_verdicts.py)."""
    if row["repo"] == "huggingface/accelerate" and row["kind"] == "accelerate_yaml":
        return (root / row["path"]).parent
    return root


def lay_out(row: dict, all_rows: list[dict], root: Path) -> Path:
    """The corpus files of the row's repository at their paths in it; returns the row's file."""
    for other in all_rows:
        if other["repo"] == row["repo"]:
            dest = root / other["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(CORPUS / other["file"], dest)
    return root / row["path"]


@dataclass
class Outcome:
    rc: int | None
    out: str
    err: str
    result: dict | None
    crash: str = ""        # an exception out of main: what a user sees as a traceback


class _Hang(Exception):
    pass


def run_case(row: dict, all_rows: list[dict], tmp: Path, capture) -> Outcome:
    """`zsim run FILE <launch args> --json OUT` in-process from the launch folder; capture() returns
    (stdout, stderr) captured since the last call."""
    from zsim.cli import main
    root = tmp / "repo"
    path = lay_out(row, all_rows, root)
    local_model(row, root)
    out_json = tmp / "result.json"
    argv = ["run", str(path), *launch_args(row), "--json", str(out_json), "--width", "160"]
    cwd = os.getcwd()
    env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME")}
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp / "hf-cache"), HF_HOME=str(tmp / "hf-home"))
    (tmp / "hf-cache").mkdir(exist_ok=True)

    def on_alarm(signum, frame):
        raise _Hang(f"still running after {HANG_S} s")
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(HANG_S)
    rc, crash = None, ""
    try:
        os.chdir(launch_folder(row, root))
        rc = main(argv)
    except SystemExit as exit_:          # argparse's own exits
        rc = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException as err:         # noqa: BLE001 - any exception out of main is the finding
        crash = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(cwd)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out, err = capture()
    result = json.loads(out_json.read_text()) if rc == 0 and out_json.is_file() else None
    return Outcome(rc, out, err, result, crash)


def _auto_batch_keys(row: dict, all_rows: list[dict]) -> list[str]:
    """The batch keys a ds_config leaves to the Trainer ("auto"), whose default the output must name."""
    if row["kind"] != "ds_config":
        return []
    config = json.loads((CORPUS / row["file"]).read_text())
    return [k for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps") if config.get(k) == "auto"]


# the names a default for a batch key may go by: DeepSpeed's key or the HF Trainer's flag
_BATCH_NAMES = {"train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu", "per_device_train_batch_size"),
                "gradient_accumulation_steps": ("gradient_accumulation_steps",)}


def judge(row: dict, all_rows: list[dict], o: Outcome) -> str | None:
    """None when the outcome is the target's; else the one-line reason it is not."""
    if o.crash:
        return f"traceback: {o.crash}"
    if "Traceback (most recent call last)" in o.out + o.err:
        return "a traceback in the output"
    want = expectation(row)
    err_lines = [line for line in o.err.splitlines() if line.strip()]
    errors = [line for line in err_lines if line.startswith("zsim: error:")]
    if want == "simulates" or (want == "ddp" and o.rc == 0):
        if o.rc != 0:
            return f"exit {o.rc}, DeepSpeed accepts it: {errors[0] if errors else (err_lines or ['(no message)'])[-1]}"
        if not o.result or not (o.result.get("step_time_s") or 0) > 0:
            return "exit 0 without a step_time_s in the JSON"
        text = o.out + o.err
        for key in _auto_batch_keys(row, all_rows):
            names = _BATCH_NAMES[key]
            if not any(re.search(rf"{name}\b.*(auto|default)|(auto|default).*\b{name}", line)
                       for line in text.splitlines() for name in names):
                return f'"{key}": "auto" simulated without the output naming its default ({" or ".join(names)})'
        return None
    # refused: one line, exit 2, naming what it must
    if o.rc != 2:
        return f"exit {o.rc}, expected a one-line refusal with exit 2 ({row['deepspeed_verdict'][:120]})"
    if len(err_lines) != 1 or not err_lines[0].startswith("zsim: error:"):
        return f"refused in {len(err_lines)} stderr lines, expected one 'zsim: error:' line"
    line = err_lines[0]
    if want == "not_deepspeed" and "FSDP" not in line:
        return f"an FSDP file refused without saying FSDP is not modelled: {line}"
    fields = REJECT_FIELDS.get(row["file"], ())
    if want == "refused" and not any(f in line for f in fields):
        return f"the refusal names none of {fields}: {line}"
    return None


def _case_id(row: dict) -> str:
    return row["file"]


def _param(row: dict):
    reason = PENDING.get(row["file"])
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(row, id=_case_id(row), marks=marks)


def test_the_corpus_is_the_issues_sample():
    """>= 30 public files across the four kinds, each with its source and DeepSpeed's verdict."""
    all_rows = rows()
    assert len(all_rows) >= 30
    assert {r["kind"] for r in all_rows} == {"ds_config", "accelerate_yaml", "axolotl_yaml", "llama_factory_yaml"}
    for r in all_rows:
        assert (CORPUS / r["file"]).is_file(), r["file"]
        assert re.fullmatch(r"[0-9a-f]{40}", r["commit"]) and "/" in r["repo"] and r["path"], r
        assert r["deepspeed_verdict"].startswith(("accepts", "rejects")), r
        if r["deepspeed_verdict"].startswith("rejects"):
            assert r["file"] in REJECT_FIELDS, f"{r['file']}: a rejected file needs the field its refusal names"
    assert set(REJECT_FIELDS) <= {r["file"] for r in all_rows}
    assert set(PENDING) <= {r["file"] for r in all_rows}


@pytest.mark.parametrize("row", [_param(r) for r in rows()])
def test_real_input_as_deepspeed_reads_it(row, tmp_path, capsys):
    def capture():
        got = capsys.readouterr()
        return got.out, got.err
    outcome = run_case(row, rows(), tmp_path, capture)
    reason = judge(row, rows(), outcome)
    assert reason is None, f"{row['file']} ({row['repo']} {row['path']}): {reason}"
