"""DeepSpeed-Chat's step-3 launch read as main.py's argparse reads it (zsim/config/dschat.py): the
actor's ds_config as get_train_ds_config builds it, the PPO settings as the rlhf block."""
from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli
from zsim.config.dschat import read_dschat
from zsim.config.launch import read_launch
from zsim.config.trainer_args import Recipe, assignments
from zsim.errors import ZsimInputError

STEP3 = ["deepspeed", "--num_gpus", "8", "main.py", "--actor_model_name_or_path", "llama2-7b",
         "--critic_model_name_or_path", "llama2-7b", "--actor_zero_stage", "3", "--critic_zero_stage", "2",
         "--enable_hybrid_engine", "--inference_tp_size", "2", "--dtype", "bf16", "--offload_reference_model",
         "--per_device_generation_batch_size", "8", "--per_device_training_batch_size", "4",
         "--actor_gradient_checkpointing", "--data_path", "Dahoas/rm-static", "--deepspeed"]


def test_main_py_arguments_become_the_rlhf_block(tmp_path):
    r = read_launch(STEP3, tmp_path, "the launch command")
    assert r.model == "llama2-7b" and r.gpus_per_node == 8 and r.framework == "deepspeed"
    assert r.rlhf == {"critic_model": "llama2-7b", "per_device_generation_batch_size": 8,
                      "per_device_training_batch_size": 4, "inference_tp_size": 2, "enable_hybrid_engine": True,
                      "offload_reference_model": True, "critic_zero_stage": 2}
    assert r.training == {"precision": "bf16", "gradient_accumulation_steps": 1, "activation_checkpointing": "full"}
    z = r.ds_inline["zero_optimization"]
    # get_train_ds_config's ZeRO block (dschat/utils/ds_utils.py)
    assert z["stage"] == 3 and z["stage3_prefetch_bucket_size"] == 3e7 and z["offload_param"] == {"device": "none"}
    assert r.ds_inline["bf16"] == {"enabled": True}
    sets = assignments(r)
    assert "rlhf.inference_tp_size=2" in sets and not any(s.startswith("rlhf.critic_model") for s in sets)


def test_main_py_defaults():
    r = read_dschat({"actor_model_name_or_path": "a", "critic_model_name_or_path": "c"},
                    Recipe(origin="x", framework="hf_trainer"))
    # --dtype fp16, --actor_zero_stage 0, --critic_zero_stage 0, no offload
    assert r.training["precision"] == "fp16" and r.ds_inline["fp16"] == {"enabled": True}
    assert r.ds_inline["zero_optimization"]["stage"] == 0 and r.rlhf["critic_zero_stage"] == 0
    assert "offload_param" not in r.ds_inline["zero_optimization"]


@pytest.mark.parametrize("extra, field", [
    (["--actor_zero_stage", "2"], "--inference_tp_size"),
    (["--dtype", "fp32"], "--dtype"),
])
def test_refusals(tmp_path, extra, field):
    words = [w for w in STEP3]
    with pytest.raises(ZsimInputError) as err:
        read_launch(words + extra, tmp_path, "the launch command")
    assert field in str(err.value)


def test_zsim_run_on_the_launch(tmp_path):
    out = run_cli(["run", "--json", str(tmp_path / "r.json"), "--", *STEP3])
    assert out.code == 0, out.stderr
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["hybrid_engine"] is True and r["generation_batch_size"] == 8 and r["training_batch_size"] == 4
    assert r["phases"][0]["engine"].startswith("hybrid engine") and "tensor parallel 2" in r["phases"][0]["engine"]
    # offloaded to the CPU under ZeRO-3: its persistent norms alone on the GPU
    assert r["resident_bytes"]["reference"] < 1e-3 * r["resident_bytes"]["actor"]
