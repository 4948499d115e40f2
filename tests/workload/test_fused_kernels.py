"""The memory-bound passes and kernels zsim charges for one GPT layer are those of Megatron-LM's
fused kernels, not of eager PyTorch's unfused ones, and no more than them (docs/validation.md,
"Megatron's fused kernels against zsim's per-layer charges"). The layer is Korthikanti et al.
2022 Table 4's (22B: h 6144, 64 heads, s 2048, micro-batch 4, TP 8, fp16, dropout, no
FlashAttention), with and without sequence parallelism.

Megatron-LM (megatron/model/transformer.py, fused_bias_gelu.py, fused_softmax.py, mpu/layers.py;
v2.6 and the June 2022 tree Korthikanti et al. ran) per element of the tensor each kernel touches:
 - FusedLayerNorm forward: read x, write y: 2 passes, one kernel (eager torch LayerNorm: the same)
 - bias_gelu (fc1 with skip_bias_add): read y, write gelu(y + b): 2 passes, one kernel
   (eager: the bias add and the GeLU, 4 passes, two kernels); backward bias_gelu_back: read dy
   and y, write dx: 3 passes
 - bias_dropout_add_fused_train (proj, fc2 with skip_bias_add): read x and the residual, write
   the sum: 3 passes (eager: bias add, dropout, residual add: 7 passes, three kernels); backward
   the dropout's: read dy, write dx: 2 passes. With sequence parallelism on the rank's 1/t of the
   tokens (after the reduce-scatter)
 - FusedScaleMaskSoftmax (scaled_upper_triang_masked_softmax) between baddbmm (scores written
   once, scaled by its alpha) and the attention dropout: read and write the scores once
   (eager: scale, mask, softmax: 6 passes, three kernels); backward: read y and dy, write dx
 - gradient_accumulation_fusion: the wgrad GEMM accumulates into main_grad (fused_dense_cuda.
   wgrad_gemm_accum_fp32): no pass over the weight gradient besides the GEMM
"""
import pytest

from zsim.schema import build
from zsim.specs.model import ModelSpec
from zsim.workload.transformer import build_workload

H, HEADS, S, B, T = 6144, 64, 2048, 4, 8
A = 2                       # fp16 bytes
TOKENS = B * S              # t
F = 4 * H // T              # the rank's MLP width
S2 = B * (HEADS // T) * S * S   # the rank's attention scores
LAYER_22B = build(ModelSpec, dict(layers=2, hidden=H, heads=HEADS, vocab=51200, seq_len=S, position="learned",
                                  tied_embeddings=True, norm="layernorm", bias=True, glu=False, fused_qkv=True),
                  "model")


def _layer(sp: bool) -> dict:
    wl = build_workload(LAYER_22B, micro_batch_size=B, seq_len=S, precision="fp16", flash_attention=False,
                        dropout=True, tensor=T, sequence_parallel=sp)
    return {m.name.removeprefix("layers.1."): (m.fwd_mem_bytes, m.kernels_fwd, m.bwd_mem_bytes, m.kernels_bwd)
            for m in wl.layer_modules(1)}


@pytest.mark.parametrize("sp", [False, True])
def test_the_layers_passes_are_megatrons_fused_kernels(sp):
    t_res = TOKENS // T if sp else TOKENS     # the residual stream's tokens on this rank
    # (forward bytes, forward kernels, backward bytes, backward kernels); a linear's kernels are
    # its GEMMs (dgrad and wgrad in backward, the wgrad accumulating into main_grad)
    fused_norm = (2 * t_res * H * A, 1, 3 * t_res * H * A, 2)
    bias_dropout_add = (3 * t_res * H * A, 1, 2 * t_res * H * A, 2)
    assert _layer(sp) == {
        "ln_1": fused_norm,
        "attn.qkv": (0.0, 1, 0.0, 2),
        # baddbmm's scores, FusedScaleMaskSoftmax read + write, dropout read + write; backward:
        # bmm's dprobs, dropout read + write, softmax read y and dy + write; kernels: baddbmm,
        # softmax, dropout, bmm (4); bmm's two GEMMs, dropout, softmax, baddbmm's two (6)
        "attn.core": ((1 + 2 + 2) * S2 * A, 4, (1 + 2 + 3) * S2 * A, 6),
        "attn.o_proj": bias_dropout_add,
        "ln_2": fused_norm,
        "mlp.fc_in": (0.0, 1, 0.0, 2),
        "mlp.act": (2 * TOKENS * F * A, 1, 3 * TOKENS * F * A, 1),
        "mlp.fc_out": bias_dropout_add,
    }


def test_the_unfused_eager_passes_would_move_more_than_zsim_charges():
    """What fusing saves against eager PyTorch (the same kernels unfused) is already out of
    zsim's charges: each fused kernel's forward bytes are below the eager sequence's."""
    layer = _layer(False)
    eager_fwd = {
        "attn.core": (1 + 6 + 2) * S2 * A,        # scores, scale, mask, softmax, dropout
        "attn.o_proj": 7 * TOKENS * H * A,        # bias add, dropout, residual add
        "mlp.act": 4 * TOKENS * F * A,            # bias add, GeLU
    }
    for name, eager in eager_fwd.items():
        assert layer[name][0] < eager
