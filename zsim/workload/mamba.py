"""A Mamba mixer (Gu & Dao 2023, arXiv:2312.00752) in place of a block's attention, as Jamba's
transformers code trains it (models/jamba/modeling_jamba.py JambaMambaMixer.cuda_kernels_forward,
with the mamba_ssm and causal_conv1d kernels its use_mamba_kernels default requires):

    x, z   = in_proj(h).chunk(2)                                   hidden -> 2 x inner
    u      = causal_conv1d_fn(x, conv1d.weight, conv1d.bias, silu)  depthwise, d_conv taps
    dt, B, C = x_proj(u).split(dt_rank, d_state, d_state)          then dt/b/c RMSNorms (Jamba)
    delta  = dt_proj.weight @ dt                                   dt_rank -> inner (its bias goes to the scan)
    y      = selective_scan_fn(u, delta, -exp(A_log), B, C, D, z, dt_proj.bias, delta_softplus=True)
    out    = out_proj(y)                                           inner -> hidden

Memory kept for backward (mamba_ssm SelectiveScanFn saves u, delta, A, B, C, D, z, delta_bias,
its chunk states and its pre-gate output; causal_conv1d saves its input x; each linear its
input): x and z (in_proj's output, t x 2 inner), u (x_proj's input, shared with the scan), delta,
the scan's pre-gate output and y (out_proj's input), B and C, dt, and in_proj's input.
Time: the GEMMs by the GEMM law; the conv and the scan are fused memory-bound kernels priced by
their traffic (the scan's recurrence, ~9 x inner x d_state FLOPs a token, runs in fp32 inside the
kernel and is not priced: a first guess until a GPU measures it).
"""
from __future__ import annotations

from zsim.workload.builder import Builder
from zsim.workload.module import ModuleKind


def mamba_mixer(bld: Builder, pfx: str, layer: int) -> None:
    """Block `layer`'s Mamba mixer (modules `pfx`.in_proj ... `pfx`.out_proj)."""
    m, t, a = bld.m, bld.t, bld.a
    mb = m.mamba
    assert mb is not None
    h, e, n, r, k = m.hidden, mb.expand * m.hidden, mb.d_state, mb.dt_rank, mb.d_conv
    bld.linear(f"{pfx}.in_proj", layer, h, 2 * e, mb.proj_bias)
    # depthwise causal conv with SiLU: read x, write u; backward reads du and x, writes dx and
    # the taps' gradient; keeps x (z, the other half of in_proj's output, is the scan's)
    conv = (bld.param(f"{pfx}.conv1d.weight", e * k, shape=(e, 1, k)),) + \
        ((bld.param(f"{pfx}.conv1d.bias", e),) if mb.conv_bias else ())
    bld.add(name=f"{pfx}.conv1d", kind=ModuleKind.SSM, layer=layer, params=conv, gemm=None,
            fwd_flops=2.0 * k * t * e, bwd_flops=4.0 * k * t * e, model_fwd_flops=2.0 * k * t * e,
            fwd_mem_bytes=2 * t * e * a, bwd_mem_bytes=3 * t * e * a, act_bytes=t * e * a)
    bld.linear(f"{pfx}.x_proj", layer, e, r + 2 * n, False)
    if mb.inner_norms:
        for name, width in (("dt_layernorm", r), ("b_layernorm", n), ("c_layernorm", n)):
            bld.norm(f"{pfx}.{name}", layer, size=width, residual=False)
    # dt_proj's weight alone (its bias is the scan's delta_bias)
    bld.linear(f"{pfx}.dt_proj", layer, r, e, False)
    delta_bias = (bld.param(f"{pfx}.dt_proj.bias", e),)
    # the selective scan: reads u, delta, z, B, C, writes its pre-gate output and y; backward
    # reads them and dy, writes du, ddelta, dz, dB, dC; keeps delta, z, its output, B and C
    scan = (bld.param(f"{pfx}.A_log", e * n, shape=(e, n)), bld.param(f"{pfx}.D", e)) + delta_bias
    bld.add(name=f"{pfx}.scan", kind=ModuleKind.SSM, layer=layer, params=scan, gemm=None,
            fwd_flops=9.0 * t * e * n, bwd_flops=18.0 * t * e * n, model_fwd_flops=9.0 * t * e * n,
            fwd_mem_bytes=(5 * t * e + 2 * t * n) * a, bwd_mem_bytes=(10 * t * e + 4 * t * n) * a,
            act_bytes=(3 * t * e + 2 * t * n) * a)
    bld.linear(f"{pfx}.out_proj", layer, e, h, mb.proj_bias)
