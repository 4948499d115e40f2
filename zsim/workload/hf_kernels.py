"""The memory-bound work of Hugging Face transformers' modeling code, op by op (training.kernels
"hf"), per element of the tensor each op runs over, for `a` bytes per activation element.

The fused implementations (Megatron-LM's, llm-foundry's, Liger's kernels: training.kernels
"fused") read their input and write their output once per norm, RoPE and activation; these are
what the HF code launches instead. Sources, transformers 4.50-5.x:
 - RMSNorm: models/llama/modeling_llama.py LlamaRMSNorm.forward (the same in Mistral, Mixtral,
   Qwen2/2-MoE/3/3-MoE): hidden_states.to(float32); variance = hidden_states.pow(2).mean(-1);
   hidden_states * rsqrt(variance + eps); weight * hidden_states.to(input_dtype).
 - RoPE: apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, rotate_half = cat((-x2, x1)).
 - MLP: LlamaMLP.forward: down_proj(act_fn(gate_proj(x)) * up_proj(x)), SiLU then mul.
 - repeat_kv (integrations/sdpa_attention.py, eager_attention_forward): expand + reshape, a copy
   of K and V to every query head, when the attention cannot take grouped K/V itself.
 - Backward: autograd's formulas, torch tools/autograd/derivatives.yaml: mul saves both inputs
   and computes grad*other and grad*self (a weight's gradient then reduced over the tokens,
   sum_to_size); pow_backward is grad * (2 * self.pow(1)) (three passes); mean's backward
   expands and divides (one write); to()'s backward casts back; slice's backward writes zeros
   and copies the slice in; autograd sums the gradients of a tensor used twice.
Reductions over the hidden dimension (mean, the rsqrt of the variance) write one value per
token, not charged. cos/sin are broadcast over the heads (read from cache, not charged).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpByOp:
    """Per element: HBM bytes in the run's precision (`fwd`, `bwd`) and in fp32 (`fp32_fwd`,
    `fp32_bwd`), bytes kept for backward (`act`), and kernels launched."""
    fwd: float
    bwd: float
    fp32_fwd: float = 0.0
    fp32_bwd: float = 0.0
    act: float = 0.0
    kernels_fwd: int = 1
    kernels_bwd: int = 1


def rms_norm(a: int) -> OpByOp:
    """LlamaRMSNorm over one element of its input. Forward: to(fp32) a+4 (a no-op in fp32),
    pow 8, mean 4, mul by rsqrt 8, to(a) 4+a (a no-op in fp32), weight mul 2a. Backward: the
    weight mul's input gradient 2a and weight gradient (product 3a, reduction a), to()'s cast
    back 4+a, the rsqrt mul's two gradients (8; product 12, reduction 4), mean's expand 4,
    pow's three passes (8, 8, 12), the sum of the two gradients of the fp32 input 12, the cast
    to the input's dtype 4+a. Kept: the fp32 copy (pow and mul save it) and the normalized
    16-bit tensor (the weight mul saves it); in fp32 both are 4-byte tensors."""
    cast = a + 4 if a != 4 else 0
    return OpByOp(fwd=2 * a, fp32_fwd=cast + 8 + 4 + 8 + cast,
                  bwd=6 * a, fp32_bwd=cast + 24 + 4 + 28 + 12 + cast,
                  act=4 + a, kernels_fwd=8 if cast else 6, kernels_bwd=14 if cast else 12)


def rope(a: int) -> OpByOp:
    """apply_rotary_pos_emb over one element of q (or k). Forward: x*cos 2a, -x2 a (half the
    tensor read and written), cat 2a, *sin 2a, add 3a. Backward: *sin's and *cos's input
    gradients 2a each, neg's a, the two slices' zeros-and-copy 2a each, the two sums of the
    three gradients of x 3a each. Nothing kept (cos and sin need no gradient)."""
    return OpByOp(fwd=10 * a, bwd=15 * a, kernels_fwd=5, kernels_bwd=9)


def swiglu(a: int) -> OpByOp:
    """act_fn(gate) * up over one element of the MLP's width. Forward: SiLU 2a, mul 3a.
    Backward: mul's two gradients 3a each, SiLU's 3a. Kept: gate's output (SiLU saves it), the
    SiLU output and up's output (mul saves both)."""
    return OpByOp(fwd=5 * a, bwd=9 * a, act=3 * a, kernels_fwd=2, kernels_bwd=3)


def repeat_kv(a: int, heads: int, kv_heads: int) -> OpByOp:
    """repeat_kv over one element of K (or V) of `kv_heads` heads repeated to `heads`: the copy
    reads a and writes heads/kv_heads * a; backward sums the copies back (expand's backward).
    Kept: the repeated tensor (attention saves it) beyond the K or V it came from."""
    rep = heads / kv_heads
    return OpByOp(fwd=a * (1 + rep), bwd=a * (1 + rep), act=a * (rep - 1), kernels_fwd=1, kernels_bwd=1)
