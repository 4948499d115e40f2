"""The DeepSpeed configs the fixtures record, and the model they run."""
from __future__ import annotations

import copy

from zsim.specs.model import ModelSpec

WORLD_SIZE = 2
MICRO_BATCH = 2
OPT_STEPS = 2
# GPT-2 style, untied lm_head (tests/helpers.py scenario_for rebuilds it from the
# fixture's "model" block)
MODEL = ModelSpec(layers=8, hidden=512, heads=8, vocab=1024, seq_len=128, ffn_hidden=2048, tied_embeddings=False,
                  position="learned", norm="layernorm", bias=True, glu=False, fused_qkv=True)


def _base(stage, **zero):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }
    cfg["zero_optimization"].update(zero)
    return cfg


def _with(cfg, **top):
    cfg = copy.deepcopy(cfg)
    cfg.update(top)
    return cfg


def build_cases():
    c = {}
    # ---- stage 1
    c["stage1_default"] = _base(1)
    c["stage1_reduce_bucket_1e6"] = _base(1, reduce_bucket_size=1000000)
    c["stage1_allgather_bucket_1e6"] = _base(1, allgather_bucket_size=1000000)
    c["stage1_gas2"] = _with(_base(1), gradient_accumulation_steps=2)
    c["stage1_clip"] = _with(_base(1), gradient_clipping=1.0)
    c["stage1_overlap_true"] = _base(1, overlap_comm=True)
    c["stage1_multi_rank_allreduce_false"] = _base(1, use_multi_rank_bucket_allreduce=False)
    c["stage1_contiguous_false_bucket_2e5"] = _base(1, contiguous_gradients=False, reduce_bucket_size=200000)
    c["stage1_grad_accum_fp32"] = _with(_base(1), data_types={"grad_accum_dtype": "fp32"})
    # ---- stage 2
    c["stage2_default"] = _base(2)
    c["stage2_reduce_bucket_1e6"] = _base(2, reduce_bucket_size=1000000)
    c["stage2_allgather_bucket_1e6"] = _base(2, allgather_bucket_size=1000000)
    c["stage2_overlap_false"] = _base(2, overlap_comm=False)
    c["stage2_overlap_true"] = _base(2, overlap_comm=True)
    c["stage2_reduce_scatter_false"] = _base(2, reduce_scatter=False)
    c["stage2_contiguous_false"] = _base(2, contiguous_gradients=False)
    c["stage2_multi_rank_allreduce_false"] = _base(2, use_multi_rank_bucket_allreduce=False)
    # without contiguous_gradients a bucket is all-reduced whole (buffered_reduce_fallback), even
    # when it straddles the partition boundary and exceeds the bucket size (params of 1M elements)
    c["stage2_contiguous_false_bucket_2e5"] = _base(2, contiguous_gradients=False, reduce_bucket_size=200000)
    c["stage2_gas2"] = _with(_base(2), gradient_accumulation_steps=2)
    c["stage2_clip"] = _with(_base(2), gradient_clipping=1.0)
    c["stage2_fp32"] = _with(_base(2), bf16={"enabled": False})
    # ---- stage 0 (plain data parallel)
    c["stage0_default"] = _base(0)
    # ---- stage 3
    c["stage3_default"] = _base(3, stage3_prefetch_bucket_size=50000000)
    c["stage3_prefetch_1e6"] = _base(3, stage3_prefetch_bucket_size=1000000)
    c["stage3_prefetch_0"] = _base(3, stage3_prefetch_bucket_size=0)
    c["stage3_persistence_0"] = _base(3, stage3_param_persistence_threshold=0)
    c["stage3_max_live_1e6"] = _base(3, stage3_max_live_parameters=1000000)
    c["stage3_reuse_0"] = _base(3, stage3_max_reuse_distance=0)
    c["stage3_gas2"] = _with(_base(3), gradient_accumulation_steps=2)
    c["stage3_reduce_bucket_1e6"] = _base(3, reduce_bucket_size=1000000)
    c["stage3_clip"] = _with(_base(3), gradient_clipping=1.0)
    c["stage3_reduce_scatter_false"] = _base(3, reduce_scatter=False)
    # reuse distance only matters once params can actually be released between fwd and bwd,
    # i.e. when the prefetcher has not already scanned past their backward use.
    c["stage3_prefetch_0_reuse_0"] = _base(3, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    c["stage3_prefetch_1e6_reuse_0"] = _base(3, stage3_prefetch_bucket_size=1000000,
                                             stage3_max_reuse_distance=0)
    c["stage3_max_live_1e6_reuse_0"] = _base(3, stage3_max_live_parameters=1000000,
                                             stage3_max_reuse_distance=0)
    # the release sets frozen in the first complete-trace micro-step (see [Note: release sets
    # frozen at the first complete trace], zsim/schedule/param_fetch.py): with gradient
    # accumulation the persistent params count against max live there, the prefetcher stops
    # short of lm_head's backward use, and lm_head is released after its forward in every later
    # micro-step; without, an optimizer step gathers the persistent params in between and the
    # sets are the steady state's
    c["stage3_max_live_3e6_reuse_0"] = _base(3, stage3_max_live_parameters=3000000,
                                             stage3_max_reuse_distance=0)
    c["stage3_gas2_max_live_3e6_reuse_0"] = _with(_base(3, stage3_max_live_parameters=3000000,
                                                        stage3_max_reuse_distance=0), gradient_accumulation_steps=2)
    # ---- communication_data_type fp32 under bf16 weights: every gradient reduction in fp32
    # (engine.py:1719-1730, 3800; stage_1_and_2.py:2376; stage3.py:780-784, 1919)
    c["stage0_comm_fp32"] = _with(_base(0), communication_data_type="fp32")
    # ---- stage 0 in fp32 with clipping: engine.py _take_model_step clips through
    # runtime/utils.py clip_grad_norm_, one fp32 norm all-reduce over the data-parallel group
    c["stage0_fp32_clip"] = _with(_base(0), bf16={"enabled": False}, gradient_clipping=1.0)
    c["stage2_comm_fp32"] = _with(_base(2), communication_data_type="fp32")
    c["stage3_comm_fp32"] = _with(_base(3), communication_data_type="fp32")
    return c


CASES = build_cases()
