"""FP8 training of the linears, as Transformer Engine runs them under accelerate's
`mixed_precision: fp8` (see [Note: FP8 linears])."""
from __future__ import annotations

from dataclasses import replace

from zsim.workload.module import Module, ModuleKind, Workload

FP8_BYTES = 1
TE_ALIGNMENT = 16      # accelerate's convert_model leaves a Linear whose weight dims do not divide by 16


# [Note: FP8 linears]
# accelerate's FP8 with the Transformer Engine backend (its default; accelerate/utils/
# transformer_engine.py convert_model, then te.fp8_autocast with DelayedScaling, format HYBRID:
# E4M3 forward, E5M2 gradients) swaps every nn.Linear whose weight dims divide by 16 for a
# te.Linear with the same 16-bit parameters; everything else (attention core, norms, the MoE experts'
# bare 3D parameters, the loss) stays in the run's 16-bit precision, and so do ZeRO's parameters,
# gradients and fp32 master copy: FP8 lives inside each linear's call. Per te.Linear
# (transformer_engine/pytorch/module/linear.py _Linear):
# - forward casts its input (read 2 B, write 1 B an element) and its weight, rowwise for the
#   forward GEMM and columnwise for dgrad (read 2 B, write 2 x 1 B), then runs the GEMM in FP8;
# - it saves for backward the input's columnwise FP8 copy (wgrad; 1 B an element, in place of
#   the 16-bit input a plain Linear keeps) and the weight's (dgrad; 1 B a parameter, each
#   micro-batch: under ZeRO-3 this copy outlives the gathered weight);
# - backward casts the output gradient to FP8 both ways (read 2 B, write 2 x 1 B), then runs
#   dgrad and wgrad in FP8 (wgrad accumulating into the 16-bit .grad).
# The GEMMs are priced at the profile's peak_tflops_fp8 with the same efficiency law as the
# 16-bit ones; the amax histories (3 x amax_history_len fp32 a linear: kilobytes) are left out.
# A first guess from the source until a GPU measures it: no FP8 GEMM has been timed here.
def fp8_linear(m: Module, a: int) -> Module:
    """`m` (an nn.Linear of the run's 16-bit precision `a`) as te.Linear runs it."""
    assert m.gemm is not None
    t, n_out, n_in = m.gemm
    act = (m.act_bytes - m.saved_input_bytes(a) + t * n_in * FP8_BYTES * m.weight_grad
           + n_in * n_out * FP8_BYTES * m.input_grad)
    runs_backward = m.input_grad or m.weight_grad
    return replace(m, fp8=True, act_bytes=act,
                   fwd_mem_bytes=m.fwd_mem_bytes + t * n_in * (a + FP8_BYTES) + n_in * n_out * (a + 2 * FP8_BYTES),
                   bwd_mem_bytes=m.bwd_mem_bytes + t * n_out * (a + 2 * FP8_BYTES) * runs_backward,
                   kernels_fwd=m.kernels_fwd + 2, kernels_bwd=m.kernels_bwd + int(runs_backward))


def converted(m: Module) -> bool:
    """accelerate's convert_model turns this module into a te.Linear."""
    # Liger's fused linear cross-entropy reads lm_head's weight itself (see [Note: fused linear cross-entropy])
    if (m.kind != ModuleKind.LINEAR or not m.nn_linear or m.groups > 1 or m.no_grad or m.gemm is None
            or m.backward_in_forward):
        return False
    _, n_out, n_in = m.gemm
    return n_out % TE_ALIGNMENT == 0 and n_in % TE_ALIGNMENT == 0


def with_fp8(wl: Workload) -> Workload:
    """The workload with its nn.Linears in FP8 (see [Note: FP8 linears])."""
    a = wl.act_dtype_bytes
    return replace(wl, modules=tuple(fp8_linear(m, a) if converted(m) else m for m in wl.modules))
