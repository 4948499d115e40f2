"""ALST's TiledMLP (training.tiled_mlp; see [Note: tiled MLP]): what each dense MLP keeps, the
recompute of its tiles before its backward, GEMMs of one tile's rows, the reused steps exact, the
recipes' keys and the refusals. DeepSpeed's own TiledMLP on CPU: tests/calibration/test_ulysses.py."""
from __future__ import annotations

import pytest

from tests.helpers import equal_results, scenario
from zsim.api import run_scenario
from zsim.errors import ZsimInputError
from zsim.schedule.build import build_schedule, workload_for
from zsim.schedule.ir import Buffer, Phase
from zsim.workload.tiling import alst_shards

LONG = {"model.layers": 4, "model.hidden": 512, "model.heads": 8, "model.seq_len": 8192, "training.seq_len": 8192,
        "training.micro_batch_size": 1, "deepspeed.zero_optimization.stage": 3}


def test_the_default_shards_are_alsts():
    assert alst_shards(8192, 512) == 16 and alst_shards(100, 4096) == 1 and alst_shards(4097, 4096) == 2


def test_an_mlp_keeps_its_input_alone_and_is_recomputed_in_tiles():
    sc = scenario(**LONG, **{"training.tiled_mlp": True})
    wl = workload_for(sc)
    mlp = [m for m in wl.modules if m.layer == 0 and m.containers[-1] == "layers.0.mlp"]
    assert [m.tile_shards for m in mlp] == [16] * len(mlp)
    assert mlp[0].tile_input_bytes == 8192 * 512 * 2 and all(m.tile_input_bytes == 0 for m in mlp[1:])
    _, sched = build_schedule(sc)
    first = [op for op in sched.ops if op.micro_step == 0 and op.payload is not None
             and getattr(op.payload, "module", None) == mlp[0].name]
    assert [op.phase for op in first] == [Phase.FORWARD, Phase.RECOMPUTE, Phase.BACKWARD]
    forward, recompute, backward = first
    assert forward.alloc[0].size_bytes == 8192 * 512 * 2                   # x, kept to the backward
    tile = next(a for a in recompute.alloc if a.tag.buffer is Buffer.TILE and a.tag.key == mlp[0].name)
    assert tile.size_bytes == mlp[0].act_bytes / 16
    # every GEMM one tile's rows: 16 of them, each over 8192 / 16 tokens
    gemms = recompute.payload.work.gemms
    assert len(gemms) == 16 and all(g == (512,) + mlp[0].gemm[1:] for g in gemms)


def test_tiling_trades_an_mlp_forward_for_its_activations():
    plain, _ = run_scenario(scenario(**LONG))
    tiled, _ = run_scenario(scenario(**LONG, **{"training.tiled_mlp": True}))
    assert tiled.memory.peak_bytes < plain.memory.peak_bytes
    assert tiled.step_time_s > plain.step_time_s
    assert tiled.model_flops_per_gpu == pytest.approx(plain.model_flops_per_gpu, rel=1e-12)
    # the recompute is executed work (HFU's), not model work: one more MLP forward a layer
    assert tiled.hfu * tiled.step_time_s > plain.hfu * plain.step_time_s


@pytest.mark.parametrize("stage, gas, ckpt", [(3, 3, "full"), (3, 2, "none"), (2, 3, "full"), (1, 2, "none")])
def test_steps_reused_equal_every_op_simulated(stage, gas, ckpt):
    sc = scenario(**{**LONG, "deepspeed.zero_optimization.stage": stage, "training.gradient_accumulation_steps": gas,
                     "training.activation_checkpointing": ckpt, "training.tiled_mlp": True, "model.layers": 6})
    reused, _ = run_scenario(sc)
    full, _ = run_scenario(sc, steady=False)
    equal_results(reused, full)


def test_refusals_and_notes():
    for changes in ({"training.lora": {"r": 8}}, {"parallelism.tensor": 2}):
        with pytest.raises(ZsimInputError) as e:
            scenario(**LONG, **{"training.tiled_mlp": True, **changes})
        assert e.value.field == "training.tiled_mlp"
    sc = scenario(**LONG, **{"training.tiled_mlp_shards": 4})
    assert any("tiled_mlp_shards: not read" in n for n in sc.notes)


def test_axolotls_tiled_mlp_keys(tmp_path):
    import json
    from zsim.cli import main
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"},
                                                  "train_micro_batch_size_per_gpu": "auto"}))
    (tmp_path / "axolotl.yaml").write_text("base_model: meta-llama/Llama-3.1-8B\nsequence_len: 32768\n"
                                           "micro_batch_size: 1\ngradient_accumulation_steps: 1\nbf16: true\n"
                                           "flash_attention: true\ndeepspeed: ds.json\ntiled_mlp: true\n"
                                           "tiled_mlp_num_shards: 8\ngradient_checkpointing: true\n")
    out = tmp_path / "r.json"
    assert main(["run", str(tmp_path / "axolotl.yaml"), "--gpus", "8", "--profile", "dgx-h100", "--json", str(out)]) == 0
    assert "MLPs tiled" in json.loads(out.read_text())["implementation"]
