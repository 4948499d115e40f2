"""Decoder-only transformer workload: parameters, FLOPs, memory traffic and activation bytes
per module, in forward execution order, for one micro-batch.

Sources:
 - FLOPs: 2*m*n*k per GEMM, backward 2x forward (Kaplan et al. 2020; Narayanan et al. 2021,
   "Efficient Large-Scale Language Model Training on GPU Clusters", eq. 3). Model FLOPs count
   full (non-causal) attention, 4*b*s^2*h forward, as Megatron-LM and llm-foundry do for MFU.
 - Executed attention FLOPs: causal FlashAttention skips the upper triangle (half the work)
   and its backward runs 5 matmuls for the forward's 2 (Dao 2023, FlashAttention-2, sec. 3).
 - Activation bytes: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
   Transformer Models", sec. 4.1: 34*s*b*h + 5*a*s^2*b per layer with 16-bit activations
   (11sbh+5as^2b attention, 19sbh MLP, 4sbh norms); dropout masks (sbh each) only with
   dropout; FlashAttention stores no s^2 terms; GQA shrinks K and V; a gated MLP stores
   both projections.
 - Module granularity follows the torch module tree DeepSpeed ZeRO-3 hooks into
   (one fetch per nn.Module with direct parameters).
"""
from __future__ import annotations

from dataclasses import dataclass

from zsim.specs.model import ModelSpec

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class Param:
    name: str
    numel: int


@dataclass(frozen=True)
class Module:
    name: str
    kind: str                  # embedding | norm | linear | attention | activation | loss
    layer: int                 # transformer block index; -1 before the blocks, -2 after
    params: tuple[int, ...]    # indices into Workload.params (tied weights share an index)
    gemm: tuple[int, int, int] | None  # (m tokens, n out, k in) for linear modules
    fwd_flops: float           # executed on the device
    bwd_flops: float
    model_fwd_flops: float     # MFU convention (full attention)
    fwd_mem_bytes: float       # HBM traffic of the memory-bound kernels
    bwd_mem_bytes: float
    act_bytes: float           # activations this module keeps for backward
    act_bytes_s2: float = 0.0  # the s^2 part of act_bytes (dropped by selective checkpointing)
    kernels_fwd: int = 1
    kernels_bwd: int = 2
    fwd_workspace_bytes: float = 0.0   # transient while the forward kernel runs
    bwd_workspace_bytes: float | None = None  # transient in backward; default: act_bytes (input grads)

    @property
    def bwd_workspace(self) -> float:
        return self.act_bytes if self.bwd_workspace_bytes is None else self.bwd_workspace_bytes


@dataclass(frozen=True)
class Workload:
    params: tuple[Param, ...]
    modules: tuple[Module, ...]
    layers: int
    tokens: int                # per micro-batch per GPU
    micro_batch_size: int
    seq_len: int
    layer_input_bytes: float   # what full checkpointing keeps per block
    act_dtype_bytes: int

    @property
    def n_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def model_flops(self) -> float:
        """Model FLOPs of one micro-batch, forward + backward (3x forward)."""
        return 3.0 * sum(m.model_fwd_flops for m in self.modules)

    def layer_modules(self, layer: int) -> tuple[Module, ...]:
        by_layer = self.__dict__.get("_by_layer")
        if by_layer is None:
            by_layer = {}
            for m in self.modules:
                by_layer.setdefault(m.layer, []).append(m)
            by_layer = {k: tuple(v) for k, v in by_layer.items()}
            object.__setattr__(self, "_by_layer", by_layer)   # cache on the frozen instance
        return by_layer.get(layer, ())


def count_params(m: ModelSpec, seq_len: int | None = None) -> int:
    return build_workload(m, micro_batch_size=1, seq_len=seq_len or m.seq_len, precision="bf16",
                          flash_attention=True, dropout=False).n_params


def build_workload(m: ModelSpec, micro_batch_size: int, seq_len: int, precision: str,
                   flash_attention: bool, dropout: bool, fused_cross_entropy: bool = False) -> Workload:
    b, s, h, V = micro_batch_size, seq_len, m.hidden, m.vocab
    t = b * s
    a = DTYPE_BYTES[precision]
    head_dim = h // m.heads
    kvd = m.n_kv_heads * head_dim
    f = m.ffn
    drop = 1 if dropout else 0
    params: list[Param] = []
    modules: list[Module] = []

    def P(name, numel):
        params.append(Param(name, int(numel)))
        return len(params) - 1

    def norm(name, layer):
        ids = (P(f"{name}.weight", h),) + ((P(f"{name}.bias", h),) if m.norm == "layernorm" else ())
        # fwd: read x, write y; bwd: read dy and x, write dx (Korthikanti: stores its input, 2sbh)
        modules.append(Module(name, "norm", layer, ids, None, 8.0 * t * h, 16.0 * t * h, 0.0,
                              2 * t * h * a, 3 * t * h * a, t * h * a))

    def linear(name, layer, n_in, n_out, bias, extra_act=0.0, fwd_mem=0.0, bwd_mem=0.0, weight=None,
               saves_input=True):
        ids = (weight if weight is not None else P(f"{name}.weight", n_in * n_out),)
        if bias:
            ids += (P(f"{name}.bias", n_out),)
        flops = 2.0 * t * n_in * n_out
        modules.append(Module(name, "linear", layer, ids, (t, n_out, n_in), flops, 2 * flops, flops,
                              fwd_mem, bwd_mem, t * n_in * a * saves_input + extra_act, 0.0, 1, 2))

    wte = P("wte.weight", V * h)
    # token embedding: gather rows (write t*h); backward scatter-adds into the fp32-width table
    modules.append(Module("wte", "embedding", -1, (wte,), None, 0.0, 0.0, 0.0,
                          t * h * a, 2 * t * h * a, drop * t * h, 0.0, 1, 1))
    if m.position == "learned":
        wpe = P("wpe.weight", m.seq_len * h)
        modules.append(Module("wpe", "embedding", -1, (wpe,), None, 0.0, 0.0, 0.0,
                              3 * t * h * a, 2 * t * h * a, 0.0, 0.0, 1, 1))
    if m.embedding_norm:
        norm("emb_ln", -1)

    for i in range(m.layers):
        pfx = f"layers.{i}"
        norm(f"{pfx}.ln_1", i)
        if m.fused_qkv:
            linear(f"{pfx}.attn.qkv", i, h, h + 2 * kvd, m.bias)
        else:
            linear(f"{pfx}.attn.q_proj", i, h, h, m.bias)
            linear(f"{pfx}.attn.k_proj", i, h, kvd, m.bias, saves_input=False)  # shares q_proj's input
            linear(f"{pfx}.attn.v_proj", i, h, kvd, m.bias, saves_input=False)
        # Attention core. Model FLOPs: QK^T and AV, 2*b*s*s*h each (full matrix, MFU convention).
        model_flops = 4.0 * b * s * s * h
        rope_mem = 4 * t * (h + kvd) * a if m.position == "rope" else 0.0
        qkv_saved = t * (h + 2 * kvd) * a
        if flash_attention:
            fwd = model_flops / 2          # causal: lower triangle only
            bwd = fwd * 2.5                # 5 matmuls vs 2 (FlashAttention-2)
            act, act_s2 = qkv_saved + 4 * b * m.heads * s, 0.0  # Q,K,V + logsumexp (fp32)
            mem_f, mem_b = rope_mem + 2 * t * (h + 2 * kvd) * a, rope_mem + 4 * t * (h + 2 * kvd) * a
            kf, kb = 1, 2
        else:
            fwd, bwd = model_flops, 2 * model_flops
            s2 = b * m.heads * s * s
            # softmax output (a bytes per score); with dropout also its mask (1 B) and output (a B)
            act_s2 = s2 * (2 * a + 1) if dropout else s2 * a
            act = qkv_saved + act_s2
            mem_f = rope_mem + s2 * a * (3 + 2 * drop)   # scores write, softmax read/write
            mem_b = rope_mem + s2 * a * (4 + 2 * drop)
            kf, kb = 4, 6
        modules.append(Module(f"{pfx}.attn.core", "attention", i, (), None, fwd, bwd, model_flops,
                              mem_f, mem_b, act, act_s2, kf, kb))
        # output projection + residual add (+ dropout mask): read 2, write 1
        linear(f"{pfx}.attn.o_proj", i, h, h, m.bias, extra_act=drop * t * h,
               fwd_mem=3 * t * h * a, bwd_mem=2 * t * h * a)
        norm(f"{pfx}.ln_2", i)
        if m.glu:
            linear(f"{pfx}.mlp.gate_proj", i, h, f, m.bias)
            linear(f"{pfx}.mlp.up_proj", i, h, f, m.bias, saves_input=False)
            # SiLU(gate)*up: stores gate and up (above as the projections' outputs) and the product
            modules.append(Module(f"{pfx}.mlp.act", "activation", i, (), None, 4.0 * t * f, 8.0 * t * f, 0.0,
                                  3 * t * f * a, 5 * t * f * a, 2 * t * f * a, 0.0, 1, 1))
        else:
            linear(f"{pfx}.mlp.fc_in", i, h, f, m.bias)
            modules.append(Module(f"{pfx}.mlp.act", "activation", i, (), None, 8.0 * t * f, 16.0 * t * f, 0.0,
                                  2 * t * f * a, 3 * t * f * a, t * f * a, 0.0, 1, 1))
        linear(f"{pfx}.mlp.fc_out", i, f, h, m.bias, extra_act=drop * t * h,
               fwd_mem=3 * t * h * a, bwd_mem=2 * t * h * a)

    norm("ln_f", -2)
    # lm_head: a Linear whose weight is wte's when tied (DeepSpeed ZeRO-3 fetches it again here)
    linear("lm_head", -2, h, V, False, weight=wte if m.tied_embeddings else None)
    if fused_cross_entropy:
        # fused kernel (e.g. flash-attn's CrossEntropyLoss): keeps the 16-bit logits and the
        # log-sum-exp, writes the gradient in place
        modules.append(Module("loss", "loss", -2, (), None, 5.0 * t * V, 3.0 * t * V, 0.0,
                              t * V * a, 2 * t * V * a, t * V * a + 4 * t, 0.0, 1, 1,
                              fwd_workspace_bytes=0.0, bwd_workspace_bytes=0.0))
    else:
        # HF-style: logits upcast to fp32 and held by the model output, log-softmax output saved
        # by cross_entropy; the 16-bit logits are transient; backward makes fp32 and 16-bit grads.
        modules.append(Module("loss", "loss", -2, (), None, 5.0 * t * V, 3.0 * t * V, 0.0,
                              t * V * (a + 12), t * V * (24 + a), 8 * t * V, 0.0, 3, 3,
                              fwd_workspace_bytes=t * V * a, bwd_workspace_bytes=t * V * (4 + a)))
    return Workload(tuple(params), tuple(modules), m.layers, t, b, s, float(t * h * a), a)
