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
from enum import StrEnum

from zsim.specs.model import ModelSpec

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class Param:
    name: str
    numel: int
    # an expert's weight: its gradient is reduced over the expert-data-parallel group, not the
    # whole data-parallel group (DeepSpeed-MoE, deepspeed/utils/groups.py)
    expert: bool = False
    # requires_grad: frozen weights (LoRA's base model, training.frozen) carry no gradient and no
    # optimizer state, but ZeRO-3 still partitions and gathers them
    trainable: bool = True


class ModuleKind(StrEnum):
    EMBEDDING = "embedding"
    NORM = "norm"
    LINEAR = "linear"
    ATTENTION = "attention"        # the attention core (no params)
    ACTIVATION = "activation"
    LOSS = "loss"


@dataclass(frozen=True, kw_only=True)
class Module:
    name: str
    kind: ModuleKind
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
    # the nn.Module containers it sits in, outermost first (("layers.0", "layers.0.attn")): ZeRO-3's
    # hooks visit each container as the forward enters it
    containers: tuple[str, ...] = ()
    # which backward GEMMs run (zsim/workload/lora.py clears them for frozen weights and for inputs
    # that carry no gradient): a linear's dgrad needs input_grad, its wgrad weight_grad
    input_grad: bool = True
    weight_grad: bool = True

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


def _attention_core(m: ModelSpec, name: str, layer: int, b: int, s: int, a: int, flash_attention: bool,
                    dropout: bool, containers: tuple[str, ...]) -> Module:
    """The attention core (no params). Model FLOPs: QK^T and AV, 2*b*s*s*h each (full matrix,
    MFU convention)."""
    h, t = m.hidden, b * s
    kvd = m.n_kv_heads * (h // m.heads)
    drop = 1 if dropout else 0
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
    return Module(name=name, kind=ModuleKind.ATTENTION, layer=layer, params=(), gemm=None, fwd_flops=fwd,
                  bwd_flops=bwd, model_fwd_flops=model_flops, fwd_mem_bytes=mem_f, bwd_mem_bytes=mem_b,
                  act_bytes=act, act_bytes_s2=act_s2, kernels_fwd=kf, kernels_bwd=kb, containers=containers)


def _activation(name: str, layer: int, flops: float, fwd_mem: float, bwd_mem: float, act: float,
                containers: tuple[str, ...]) -> Module:
    return Module(name=name, kind=ModuleKind.ACTIVATION, layer=layer, params=(), gemm=None, fwd_flops=flops,
                  bwd_flops=2 * flops, model_fwd_flops=0.0, fwd_mem_bytes=fwd_mem, bwd_mem_bytes=bwd_mem,
                  act_bytes=act, kernels_fwd=1, kernels_bwd=1, containers=containers)


def _loss(logits: float, fwd_mem: float, bwd_mem: float, act: float, kernels: int, fwd_workspace: float,
          bwd_workspace: float) -> Module:
    """Cross-entropy over `logits` (tokens x vocab) elements."""
    return Module(name="loss", kind=ModuleKind.LOSS, layer=-2, params=(), gemm=None, fwd_flops=5.0 * logits,
                  bwd_flops=3.0 * logits, model_fwd_flops=0.0, fwd_mem_bytes=fwd_mem, bwd_mem_bytes=bwd_mem,
                  act_bytes=act, kernels_fwd=kernels, kernels_bwd=kernels, fwd_workspace_bytes=fwd_workspace,
                  bwd_workspace_bytes=bwd_workspace)


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

    scope: list[tuple[str, ...]] = [()]   # the containers the modules being added sit in

    def norm(name, layer):
        ids = (P(f"{name}.weight", h),) + ((P(f"{name}.bias", h),) if m.norm == "layernorm" else ())
        # fwd: read x, write y; bwd: read dy and x, write dx (Korthikanti: stores its input, 2sbh)
        modules.append(Module(name=name, kind=ModuleKind.NORM, layer=layer, params=ids, gemm=None,
                              fwd_flops=8.0 * t * h, bwd_flops=16.0 * t * h, model_fwd_flops=0.0,
                              fwd_mem_bytes=2 * t * h * a, bwd_mem_bytes=3 * t * h * a, act_bytes=t * h * a,
                              containers=scope[0]))

    def linear(name, layer, n_in, n_out, bias, extra_act=0.0, fwd_mem=0.0, bwd_mem=0.0, weight=None,
               saves_input=True):
        ids = (weight if weight is not None else P(f"{name}.weight", n_in * n_out),)
        if bias:
            ids += (P(f"{name}.bias", n_out),)
        flops = 2.0 * t * n_in * n_out
        modules.append(Module(name=name, kind=ModuleKind.LINEAR, layer=layer, params=ids, gemm=(t, n_out, n_in),
                              fwd_flops=flops, bwd_flops=2 * flops, model_fwd_flops=flops,
                              fwd_mem_bytes=fwd_mem, bwd_mem_bytes=bwd_mem,
                              act_bytes=t * n_in * a * saves_input + extra_act, kernels_fwd=1, kernels_bwd=2,
                              containers=scope[0]))

    wte = P("wte.weight", V * h)
    # token embedding: gather rows (write t*h); backward scatter-adds into the fp32-width table
    modules.append(Module(name="wte", kind=ModuleKind.EMBEDDING, layer=-1, params=(wte,), gemm=None,
                          fwd_flops=0.0, bwd_flops=0.0, model_fwd_flops=0.0, fwd_mem_bytes=t * h * a,
                          bwd_mem_bytes=2 * t * h * a, act_bytes=drop * t * h, kernels_fwd=1, kernels_bwd=1))
    if m.position == "learned":
        wpe = P("wpe.weight", m.seq_len * h)
        modules.append(Module(name="wpe", kind=ModuleKind.EMBEDDING, layer=-1, params=(wpe,), gemm=None,
                              fwd_flops=0.0, bwd_flops=0.0, model_fwd_flops=0.0, fwd_mem_bytes=3 * t * h * a,
                              bwd_mem_bytes=2 * t * h * a, act_bytes=0.0, kernels_fwd=1, kernels_bwd=1))
    if m.embedding_norm:
        norm("emb_ln", -1)

    for i in range(m.layers):
        pfx = f"layers.{i}"
        scope[0] = (pfx,)
        norm(f"{pfx}.ln_1", i)
        scope[0] = (pfx, f"{pfx}.attn")
        if m.fused_qkv:
            linear(f"{pfx}.attn.qkv", i, h, h + 2 * kvd, m.bias)
        else:
            linear(f"{pfx}.attn.q_proj", i, h, h, m.bias)
            linear(f"{pfx}.attn.k_proj", i, h, kvd, m.bias, saves_input=False)  # shares q_proj's input
            linear(f"{pfx}.attn.v_proj", i, h, kvd, m.bias, saves_input=False)
        modules.append(_attention_core(m, f"{pfx}.attn.core", i, b, s, a, flash_attention, dropout, scope[0]))
        # output projection + residual add (+ dropout mask): read 2, write 1
        linear(f"{pfx}.attn.o_proj", i, h, h, m.bias, extra_act=drop * t * h,
               fwd_mem=3 * t * h * a, bwd_mem=2 * t * h * a)
        scope[0] = (pfx,)
        norm(f"{pfx}.ln_2", i)
        scope[0] = (pfx, f"{pfx}.mlp")
        if m.glu:
            linear(f"{pfx}.mlp.gate_proj", i, h, f, m.bias)
            linear(f"{pfx}.mlp.up_proj", i, h, f, m.bias, saves_input=False)
            # SiLU(gate)*up: stores gate and up (above as the projections' outputs) and the product
            modules.append(_activation(f"{pfx}.mlp.act", i, flops=4.0 * t * f, fwd_mem=3 * t * f * a,
                                       bwd_mem=5 * t * f * a, act=2 * t * f * a, containers=scope[0]))
        else:
            linear(f"{pfx}.mlp.fc_in", i, h, f, m.bias)
            modules.append(_activation(f"{pfx}.mlp.act", i, flops=8.0 * t * f, fwd_mem=2 * t * f * a,
                                       bwd_mem=3 * t * f * a, act=t * f * a, containers=scope[0]))
        linear(f"{pfx}.mlp.fc_out", i, f, h, m.bias, extra_act=drop * t * h,
               fwd_mem=3 * t * h * a, bwd_mem=2 * t * h * a)

    scope[0] = ()
    norm("ln_f", -2)
    # lm_head: a Linear whose weight is wte's when tied (DeepSpeed ZeRO-3 fetches it again here)
    linear("lm_head", -2, h, V, False, weight=wte if m.tied_embeddings else None)
    if fused_cross_entropy:
        # fused kernel (e.g. flash-attn's CrossEntropyLoss): keeps the 16-bit logits and the
        # log-sum-exp, writes the gradient in place
        modules.append(_loss(t * V, fwd_mem=t * V * a, bwd_mem=2 * t * V * a, act=t * V * a + 4 * t, kernels=1,
                             fwd_workspace=0.0, bwd_workspace=0.0))
    else:
        # HF-style: logits upcast to fp32 and held by the model output, log-softmax output saved
        # by cross_entropy; the 16-bit logits are transient; backward makes fp32 and 16-bit grads.
        modules.append(_loss(t * V, fwd_mem=t * V * (a + 12), bwd_mem=t * V * (24 + a), act=8 * t * V, kernels=3,
                             fwd_workspace=t * V * a, bwd_workspace=t * V * (4 + a)))
    return Workload(params=tuple(params), modules=tuple(modules), layers=m.layers, tokens=t, micro_batch_size=b,
                    seq_len=s, layer_input_bytes=float(t * h * a), act_dtype_bytes=a)
