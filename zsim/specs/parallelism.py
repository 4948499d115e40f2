"""The scenario's `parallelism:` block: how the world is split beyond ZeRO's data parallelism.

Names follow DeepSpeed (deepspeed/utils/groups.py, runtime/pipe/) and Megatron-LM.

Pipeline parallelism follows DeepSpeed's PipelineEngine (runtime/pipe/): `pipeline` stages
hold consecutive slices of the model's layers (PipelineModule's `partition_method`), and the
data-parallel size is world / pipeline (PipeDataParallelTopology: pipe is the outer axis,
data the inner one, so rank = stage * dp + dp_rank).

Tensor parallelism follows Megatron-LM (megatron/core/tensor_parallel/layers.py; Shoeybi et al.
2019, Korthikanti et al. 2022): `tensor` ranks split every transformer layer's linears
(column-parallel QKV and fc1, row-parallel output projections), the vocabulary of the embedding
and of the logits; `sequence_parallel` shards the norms' and dropouts' activations by sequence
and turns each all-reduce into a reduce-scatter + all-gather. The world is tp x dp x pp with tp
innermost (megatron/core/parallel_state.py's order tp-dp-pp): data parallel = world / (tensor x
pipeline), and global rank = (stage * dp + dp_rank) * tensor + tp_rank.

Expert parallelism (DeepSpeed-MoE, `deepspeed.moe.layer.MoE(ep_size=...)`): the experts of every
MoE layer are split over `expert` consecutive ranks (the expert-parallel group, which exchanges
tokens by all-to-all); the ranks holding the same experts form the expert-data-parallel group
(data-parallel size / expert ranks, strided by `expert`), over which the experts' gradients are
reduced (groups.py _create_expert_and_data_parallel, the default E + D ordering: expert groups
are formed within the data-parallel group).

DeepSpeed-Ulysses sequence parallelism (deepspeed/runtime/sequence_parallel/: parallel_state_sp.py,
ulysses_sp.py UlyssesSPAttentionHF; the ds_config's `sequence_parallel_size`, accelerate's
`parallelism_config.sp_size`): `sequence` consecutive ranks each hold 1/sequence of every sample's
tokens, and around each attention core exchange the sequence for the heads by all-to-all
(see [Note: DeepSpeed-Ulysses]). Not Megatron's `sequence_parallel` flag above. ZeRO partitions
over the whole sequence-data-parallel group (the world: groups.py _get_sequence_data_parallel_group),
while the batch divides by world / sequence (runtime/config.py: world_size / sequence_parallel_size).

`pipeline_schedule: interleaved` is Megatron-LM's interleaved 1F1B (Narayanan et al. SC'21 2.2.2),
which Megatron-DeepSpeed runs through Megatron's own schedule: DeepSpeed's PipelineEngine has no
interleaving. Each rank holds `virtual_stages` model chunks (zsim/schedule/interleaved.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from zsim.schema import spec

# PipelineModule(partition_method=...) (runtime/pipe/module.py _partition_layers): 'profile' raises
# NotImplementedError there, so it is not offered here either
PARTITION_METHODS = ("parameters", "uniform", "type:<regex>")


@dataclass(frozen=True, kw_only=True)
class ParallelismSpec:
    expert: int = spec(1, gt=0, le=2**18, doc="expert-parallel size (DeepSpeed-MoE ep_size): ranks one MoE "
                                              "layer's experts are split over")
    tensor: int = spec(1, gt=0, le=4096, doc="tensor-parallel size (Megatron-LM tensor_model_parallel_size; "
                                             "DeepSpeed's tensor_parallel.autotp_size): ranks each layer is split over")
    sequence_parallel: bool = spec(False, doc="Megatron-LM sequence parallelism: norms and dropouts sharded by sequence "
                                              "over the tensor-parallel group (needs tensor > 1)")
    sequence: int = spec(1, gt=0, le=4096, doc="DeepSpeed-Ulysses sequence-parallel size (ds_config "
                                               "sequence_parallel_size, accelerate sp_size): consecutive ranks that "
                                               "split each sample's tokens and all-to-all the heads around attention")
    pipeline: int = spec(1, gt=0, le=4096, doc="pipeline stages (PipelineModule num_stages); data parallel = world / (tensor x pipeline)")
    pipeline_schedule: Literal["1f1b", "interleaved"] = spec(
        "1f1b", doc="1f1b: DeepSpeed's TrainSchedule (runtime/pipe/schedule.py); interleaved: Megatron-LM's interleaved "
                    "1F1B (schedules.py forward_backward_pipelining_with_interleaving), virtual_stages chunks per rank")
    partition_method: str = spec("parameters", doc="PipelineModule partition_method: parameters | uniform | type:<regex>")
    virtual_stages: int = spec(1, gt=0, le=1024, doc="model chunks per pipeline rank (Megatron's "
                                                     "--num-virtual-stages-per-pipeline-rank); > 1 needs interleaved")

    def __post_init__(self):
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("sequence_parallel", True, "shards over the tensor-parallel group; "
                             "set parallelism.tensor > 1 or drop it")
        if self.sequence > 1 and (self.tensor > 1 or self.pipeline > 1 or self.expert > 1):
            # parallel_state_sp.py's mpu is sequence x data only, and aliases the model-parallel
            # group to the sequence group: no tensor, pipeline or expert groups beside it
            raise ValueError("sequence", self.sequence, "DeepSpeed-Ulysses (parallel_state_sp) composes sequence "
                             "parallelism with data parallelism only; set tensor, pipeline and expert to 1")
        method = self.partition_method.lower()
        if method in ("parameters", "uniform"):
            return
        if not method.startswith("type:") or not method[5:]:
            raise ValueError("partition_method", self.partition_method,
                             f"choose one of {', '.join(PARTITION_METHODS)} (PipelineModule's methods)")
        try:
            re.compile(method[5:])
        except re.error as e:
            raise ValueError("partition_method", self.partition_method,
                             f"the type regex does not compile ({e}); e.g. type:transformer") from None

    def expert_data_parallel(self, data_parallel: int) -> int:
        """Ranks holding the same experts: the expert-data-parallel group's size."""
        return data_parallel // self.expert
