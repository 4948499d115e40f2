"""The scenario's `rlhf:` block: one PPO iteration of DeepSpeed-Chat's step 3 (DeepSpeedExamples
applications/DeepSpeed-Chat: main.py's arguments, dschat/rlhf/rlhf_engine.py's four engines,
dschat/rlhf/ppo_trainer.py's iteration), with the scenario's model and ds_config as the actor's.
See [Note: DeepSpeed-Chat's PPO iteration] (zsim/rlhf.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from zsim.schema import spec
from zsim.specs.model import MAX_SEQ_LEN


@dataclass(frozen=True, kw_only=True)
class RlhfSpec:
    critic_model: Any = spec(None, doc="the critic's and the reward model's model (step 2's), as a model: block "
                                       "(preset, hf_config, keys); default: the actor's")
    critic_zero_stage: Optional[int] = spec(None, ge=0, le=3, doc="--critic_zero_stage; default the actor's stage "
                                                                  "(the scenario's zero_optimization.stage)")
    per_device_generation_batch_size: int = spec(16, gt=0, le=2**14, doc="--per_device_generation_batch_size "
                                                 "(DeepSpeed-Chat's default 16): prompts each GPU generates for")
    per_device_training_batch_size: int = spec(16, gt=0, le=2**14, doc="--per_device_training_batch_size (default 16): "
                                               "the actor's and critic's micro-batch")
    generation_batches: int = spec(1, gt=0, le=2**10, doc="--generation_batches: experience batches generated "
                                                          "before the PPO epochs train on them")
    ppo_epochs: int = spec(1, gt=0, le=2**10, doc="--ppo_epochs: passes over the generated experience")
    max_prompt_seq_len: int = spec(256, gt=0, le=MAX_SEQ_LEN, doc="--max_prompt_seq_len (default 256)")
    max_answer_seq_len: int = spec(256, gt=0, le=MAX_SEQ_LEN, doc="--max_answer_seq_len (default 256): tokens "
                                                                  "generated per prompt")
    enable_hybrid_engine: bool = spec(False, doc="--enable_hybrid_engine: the actor generates through DeepSpeed's "
                                                 "inference kernels (runtime/hybrid_engine.py)")
    inference_tp_size: int = spec(1, gt=0, le=2**10, doc="--inference_tp_size: the hybrid engine's tensor-parallel "
                                                         "size while generating")
    tp_gather_partition_size: int = spec(8, gt=0, le=2**10, doc="--tp_gather_partition_size: layers gathered at once "
                                                                "into the tensor-parallel containers (ZeRO-3)")
    unpin_actor_parameters: bool = spec(False, doc="--unpin_actor_parameters: under ZeRO-3 the hybrid engine "
                                                   "gathers each layer in every forward instead of the whole "
                                                   "model once per generate()")
    release_inference_cache: bool = spec(False, doc="--release_inference_cache: the inference workspace is freed "
                                                    "after each generate()")
    offload_reference_model: bool = spec(False, doc="--offload_reference_model: the reference model's parameters "
                                                    "in CPU memory (ZeRO-3 offload_param; under stage 0 DeepSpeed "
                                                    "ignores it)")
    offload_reward_model: bool = spec(False, doc="--offload_reward_model: the reward model's parameters in CPU "
                                                 "memory (under ZeRO-3, as for the reference)")
    max_out_tokens: Optional[int] = spec(None, gt=0, le=MAX_SEQ_LEN, doc="the hybrid engine's inference workspace "
                                         "tokens (the ds_config's hybrid_engine.max_out_tokens; DeepSpeed-Chat sets "
                                         "prompt + answer); default prompt + answer")
    critic_gradient_checkpointing: bool = spec(False, doc="--critic_gradient_checkpointing (the actor's: "
                                                          "training.activation_checkpointing)")

    pipeline: bool = spec(False, doc="also estimate steps 1 (the actor's supervised fine-tuning) and 2 (the reward "
                                     "model's training), one epoch each over the data split, and step 3's epoch: the "
                                     "whole pipeline DeepSpeed-Chat's e2e script runs")
    dataset_samples: int = spec(76256, gt=0, le=2**40, doc="rows of the training data (--data_path's train split; "
                                                             "default Dahoas/rm-static's 76,256, DeepSpeed-Chat's "
                                                             "default data)")
    data_split: str = spec("2,4,4", doc="--data_split: the data's shares for steps 1, 2 and 3")
    sft_micro_batch_size: int = spec(16, gt=0, le=2**14, doc="step 1's --per_device_train_batch_size (default 16)")
    sft_seq_len: int = spec(512, gt=0, le=MAX_SEQ_LEN, doc="step 1's --max_seq_len (default 512)")
    reward_micro_batch_size: int = spec(16, gt=0, le=2**14, doc="step 2's --per_device_train_batch_size: pairs "
                                        "(chosen and rejected) per GPU (default 16)")
    reward_seq_len: int = spec(512, gt=0, le=MAX_SEQ_LEN, doc="step 2's --max_seq_len (default 512)")

    @property
    def split(self) -> tuple[float, float, float]:
        """The data's fractions for steps 1, 2 and 3 (create_prompt_dataset's proportions)."""
        parts = [float(x) for x in self.data_split.split(",")]
        return parts[0] / sum(parts), parts[1] / sum(parts), parts[2] / sum(parts)

    def __post_init__(self):
        parts = self.data_split.split(",")
        try:
            shares = [float(x) for x in parts]
            ok = len(shares) == 3 and all(math.isfinite(x) and x >= 0 for x in shares) and sum(shares) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("data_split", self.data_split, "expected three comma-separated shares, e.g. 2,4,4")

    @property
    def seq_len(self) -> int:
        """The experience's length: prompt + answer (what every forward after generation reads)."""
        return self.max_prompt_seq_len + self.max_answer_seq_len
