"""zsim tune within the user's framework (see [Note: framework search space]), --fix pins,
micro-batch and GAS chosen where the ds_config says "auto", and the answer written back in the
input's own format."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import run_cli
from tests.helpers import mapping, scenario
from zsim.errors import ZsimInputError
from zsim.search.tune import layouts, make_space, structural_candidates


def test_hf_trainer_searches_autotp_but_no_sequence_parallelism_or_pipeline():
    sc = scenario()
    every = layouts(sc)
    hf = layouts(sc, make_space(framework="hf_trainer"))
    # AutoTP: the tensor sizes stay, without Megatron's sequence parallelism; no pipeline
    assert {(lay.tensor, lay.pipeline, lay.sequence_parallel) for lay in hf} == {(1, 1, False), (2, 1, False),
                                                                                   (4, 1, False)}
    assert any(lay.sequence_parallel for lay in every) and any(lay.pipeline > 1 for lay in every)
    ds = layouts(sc, make_space(framework="deepspeed"))
    assert any(lay.pipeline > 1 for lay in ds) and not any(lay.sequence_parallel for lay in ds)
    # megatron_deepspeed and "not stated" search everything, in the same order
    assert layouts(sc, make_space(framework="megatron_deepspeed")) == every
    assert [c.key() for c in structural_candidates(sc, make_space())] == [c.key() for c in structural_candidates(sc)]


def test_fix_pins_a_dimension_under_any_spelling_and_a_knob_leaves_the_refinement():
    sc = scenario()
    for fix in ("parallelism.tensor=2", "deepspeed.tensor_parallel.autotp_size=2"):
        cands = structural_candidates(sc, make_space([fix]))
        assert cands and {c.layout.tensor for c in cands} == {2}
        assert all(c.assignments()[-1] == fix for c in cands)   # applied after the point's own
    cands = structural_candidates(sc, make_space(["deepspeed.zero_optimization.stage=3",
                                                  "deepspeed.zero_optimization.offload_optimizer.device=cpu"]))
    assert {c.stage for c in cands} == {3} and {c.offload for c in cands} == {"optimizer cpu", "optimizer+params cpu"}
    space = make_space(["deepspeed.zero_optimization.prefetch_bucket_size=1e6"])   # DeepSpeed's alias
    assert space.knobs == {"stage3_prefetch_bucket_size"} and not space.pins
    with pytest.raises(ZsimInputError, match="--fix"):
        make_space(["deepspeed.zero_optimization.stage=5"])
    with pytest.raises(ZsimInputError, match="already fixes"):
        make_space(["parallelism.tensor=1", "deepspeed.tensor_parallel.autotp_size=2"])


def _write(tmp_path, raw, name="s.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw) if name.endswith(".yaml") else json.dumps(raw))
    return str(path)


def test_tune_says_its_space_and_keeps_to_it(tmp_path):
    path = _write(tmp_path, mapping(**{"training.framework": "hf_trainer"}))
    out = run_cli(["tune", path, "--budget", "6", "--workers", "1", "--json", str(tmp_path / "t.json")])
    assert out.code == 0, out.stderr
    line = next(x for x in out.stderr.splitlines() if x.startswith("search space:"))
    assert "hf_trainer (training.framework)" in line and "no Megatron sequence parallelism, pipeline" in line
    assert "--fix" in line and "--framework" in line
    res = json.loads((tmp_path / "t.json").read_text())
    assert res["search_space"] == {"framework": "hf_trainer", "fixed": []}
    assert all(c["pipeline_stages"] == 1 and not c["sequence_parallel"] for c in res["candidates"])
    # --framework overrides the scenario's, --fix pins
    out = run_cli(["tune", path, "--budget", "4", "--workers", "1", "--framework", "megatron_deepspeed",
                   "--fix", "parallelism.tensor=2", "--json", str(tmp_path / "u.json")])
    assert out.code == 0, out.stderr
    assert "search space: megatron_deepspeed (--framework)" in out.stderr and "fixed: parallelism.tensor=2" in out.stderr
    res = json.loads((tmp_path / "u.json").read_text())
    assert res["candidates"] and {c["tensor_parallel_size"] for c in res["candidates"]} == {2}
    # a pin nothing in the space satisfies: one line, exit 2
    out = run_cli(["tune", path, "--budget", "4", "--workers", "1", "--fix", "parallelism.tensor=3"])
    assert out.code == 2 and "--fix" in out.stderr and "Traceback" not in out.stderr


AUTO_DS = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "reduce_bucket_size": 200000}}


def _auto_scenario(tmp_path, name="s.yaml", **ds):
    raw = mapping(**{"deepspeed": {**AUTO_DS, **ds}, "training.framework": "hf_trainer"})
    del raw["training"]["micro_batch_size"], raw["training"]["gradient_accumulation_steps"]
    return _write(tmp_path, raw, name)


def test_tune_chooses_micro_batch_and_gas_where_they_are_auto(tmp_path):
    path = _auto_scenario(tmp_path)
    out = run_cli(["tune", path, "--budget", "6", "--workers", "1", "--global-batch", "32",
                   "--json", str(tmp_path / "t.json")])
    assert out.code == 0, out.stderr
    rows = json.loads((tmp_path / "t.json").read_text())["candidates"]
    assert rows and all(c["micro_batch_size"] * c["gradient_accumulation_steps"] * c["data_parallel_size"] == 32
                        for c in rows)
    assert len({c["micro_batch_size"] for c in rows}) > 1   # a choice was made, not the file's
    # no --global-batch: the HF Trainer's default 8 a GPU x GAS 1 x 8 ranks, said in the output
    out = run_cli(["tune", path, "--budget", "3", "--workers", "1", "--json", str(tmp_path / "d.json")])
    assert out.code == 0, out.stderr
    assert "the global batch is 64" in out.stderr and "--global-batch" in out.stderr
    rows = json.loads((tmp_path / "d.json").read_text())["candidates"]
    assert all(c["micro_batch_size"] * c["gradient_accumulation_steps"] * c["data_parallel_size"] == 64 for c in rows)
    # a numeric train_batch_size is the global batch; a --global-batch that disagrees is refused
    numeric = _auto_scenario(tmp_path, "n.yaml", train_batch_size=16)
    out = run_cli(["tune", numeric, "--budget", "3", "--workers", "1", "--json", str(tmp_path / "n.json")])
    assert out.code == 0, out.stderr
    rows = json.loads((tmp_path / "n.json").read_text())["candidates"]
    assert all(c["micro_batch_size"] * c["gradient_accumulation_steps"] * c["data_parallel_size"] == 16 for c in rows)
    out = run_cli(["tune", numeric, "--budget", "3", "--workers", "1", "--global-batch", "64"])
    assert out.code == 2 and "--global-batch" in out.stderr and "16" in out.stderr
    out = run_cli(["tune", path, "--budget", "3", "--workers", "1", "--global-batch", "12"])
    assert out.code == 2 and "multiple of 8" in out.stderr


def test_tune_write_answers_in_the_inputs_format_and_never_replaces_a_file(tmp_path):
    ds_path = tmp_path / "ds_config.json"
    ds_path.write_text(json.dumps(AUTO_DS))
    before = ds_path.read_text()
    args = ["tune", str(ds_path), "--model", "gpt2", "--gpus", "8", "--budget", "4", "--workers", "1",
            "--set", "training.seq_len=256", "--global-batch", "32", "--write"]
    out = run_cli(args)
    assert out.code == 0, out.stderr
    tuned = tmp_path / "ds_config.tuned.json"
    assert ds_path.read_text() == before and f"wrote {tuned}" in out.stderr
    cfg = json.loads(tuned.read_text())
    # "auto" stays for the Trainer to fill, and the output says what to give it
    assert cfg["train_micro_batch_size_per_gpu"] == "auto" and cfg["gradient_accumulation_steps"] == "auto"
    assert "--per_device_train_batch_size" in out.stderr and "--gradient_accumulation_steps" in out.stderr
    # the file written back runs (with the Trainer's arguments as the scenario's training keys)
    note = next(x for x in out.stderr.splitlines() if "--per_device_train_batch_size" in x).split()
    mb, gas = note[note.index("--per_device_train_batch_size") + 1], note[note.index("--gradient_accumulation_steps") + 1]
    again = run_cli(["run", str(tuned), "--model", "gpt2", "--gpus", "8", "--quiet", "--set", "training.seq_len=256",
                     "--set", f"training.micro_batch_size={mb}", "--set", f"training.gradient_accumulation_steps={gas}"])
    assert again.code == 0, again.stderr
    # a second --write finds the file there: refused without --force, never silently replaced
    out = run_cli(args)
    assert out.code == 2 and "--force" in out.stderr
    # a scenario YAML answers as a scenario
    path = _write(tmp_path, mapping())
    out = run_cli(["tune", path, "--budget", "3", "--workers", "1", "--write"])
    assert out.code == 0, out.stderr
    assert yaml.safe_load((tmp_path / "s.tuned.yaml").read_text())["model"] == mapping()["model"]
