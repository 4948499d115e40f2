"""The scenario's `parallelism:` block: how the ranks are split beyond ZeRO's data parallelism.

Names follow DeepSpeed (deepspeed/utils/groups.py) and Megatron-LM. Today it holds expert
parallelism; tensor and pipeline parallelism join it later (issue 15).

Expert parallelism (DeepSpeed-MoE, `deepspeed.moe.layer.MoE(ep_size=...)`): the experts of every
MoE layer are split over `expert` consecutive ranks (the expert-parallel group, which exchanges
tokens by all-to-all); the ranks holding the same experts form the expert-data-parallel group
(world / expert ranks, strided by `expert`), over which the experts' gradients are reduced
(groups.py _create_expert_and_data_parallel, the default E + D ordering).
"""
from __future__ import annotations

from dataclasses import dataclass

from zsim.schema import spec


@dataclass(frozen=True, kw_only=True)
class ParallelismSpec:
    expert: int = spec(1, gt=0, le=2**18, doc="expert-parallel size (DeepSpeed-MoE ep_size): ranks one MoE "
                                              "layer's experts are split over")

    def expert_data_parallel(self, world: int) -> int:
        """Ranks holding the same experts: the expert-data-parallel group's size."""
        return world // self.expert
