"""Decoder-only transformer workload: parameters, FLOPs, memory traffic and activation bytes
per module, in forward execution order, for one micro-batch. The attention block is
zsim/workload/attention.py's, a MoE MLP zsim/workload/moe.py's.

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
 - Tensor parallelism (Megatron-LM; Korthikanti et al. 2022 Table 2): per rank, the linears'
   parameters and FLOPs are 1/t (column-parallel QKV and fc1, row-parallel output projections);
   activations per layer sbh(10 + 24/t + 5as/(ht)), with sequence parallelism sbh(34/t +
   5as/(ht)); norms replicated (sequence-sharded under SP); the embedding and the logits
   vocab-parallel (VocabParallelEmbedding, vocab_parallel_cross_entropy).
 - Module granularity follows the torch module tree DeepSpeed ZeRO-3 hooks into
   (one fetch per nn.Module with direct parameters).
"""
from __future__ import annotations

from dataclasses import replace

from functools import lru_cache

from zsim.specs.model import ModelSpec
from zsim.workload.attention import attention
from zsim.workload.builder import Builder, Split, ceil_div
from zsim.workload.module import DTYPE_BYTES, Module, ModuleKind, TensorRole, Workload
from zsim.workload.mamba import mamba_mixer
from zsim.workload.moe import moe_mlp


# [Note: HF loss memory]
# The unfused loss as transformers (>= 4.46, ForCausalLMLoss) and the HF Trainer run it: the
# 16-bit logits are upcast to fp32 inside the loss function and cross_entropy's log_softmax
# saves its fp32 output (4 B per logit), the one tensor held until backward: the fp32 copy is
# not saved, and the Trainer drops the model output (the 16-bit logits) before it calls
# backward (compute_loss returns the loss alone). Forward's transient peak is the 16-bit
# logits, their fp32 copy and the log-softmax output; backward's is the saved output with
# nll_loss's fp32 gradient and log_softmax's fp32 input gradient (8 B). Measured: DeepSpeed
# on one CPU rank, vocab 50304 (medium GPT, ZeRO-2): zsim was 6.0% over (98 MiB, 2 B per
# logit) with the fp32 logits held through backward; the H200 runs (vocab 50304, 412M logits
# per micro-batch) were 2-3% over. A training loop that keeps `outputs` alive through
# `engine.backward(outputs.loss)` holds the 16-bit logits too (2 B per logit more).
def _loss(logits: float, fwd_mem: float, bwd_mem: float, act: float, kernels: int, fwd_workspace: float,
          bwd_workspace: float, fp32_fwd_mem: float = 0.0, fp32_bwd_mem: float = 0.0) -> Module:
    """Cross-entropy over `logits` (tokens x the rank's vocab) elements."""
    return Module(name="loss", kind=ModuleKind.LOSS, layer=-2, params=(), gemm=None, fwd_flops=5.0 * logits,
                  bwd_flops=3.0 * logits, model_fwd_flops=0.0, fwd_mem_bytes=fwd_mem, bwd_mem_bytes=bwd_mem,
                  fp32_fwd_mem_bytes=fp32_fwd_mem, fp32_bwd_mem_bytes=fp32_bwd_mem,
                  act_bytes=act, kernels_fwd=kernels, kernels_bwd=kernels, fwd_workspace_bytes=fwd_workspace,
                  bwd_workspace_bytes=bwd_workspace, tensor_role=TensorRole.VOCAB_LOSS, tensor_width=1)


# [Note: fused linear cross-entropy]
# Liger's LigerFusedLinearCrossEntropyFunction (liger_kernel/ops/fused_linear_cross_entropy.py
# fused_linear_cross_entropy_forward), which axolotl's liger_fused_linear_cross_entropy and
# LLaMA-Factory's enable_liger_kernel put in place of lm_head + loss: the BT tokens go through in
# chunks of min(next_power_of_2(ceil(BT / ceil(V / H))), BT) rows, so one chunk's logits (rows x V,
# the input's dtype) are about BT x H elements whatever the vocabulary; per chunk the logits GEMM,
# the cross-entropy kernel (reads the row twice, writes its gradient in place), then the input's
# gradient (grad_logits @ W) and the weight's (grad_weight.addmm_). Both gradients are made in
# the forward, held to the backward (grad_input: BT x H; grad_weight: V x H in the weight's dtype,
# only when the weight trains), which only scales them (element_mul_kernel when the loss is
# scaled, as gradient accumulation does). So no logits are kept and lm_head's three GEMMs all run
# in the forward. Not modelled: under ZeRO-3 the weight is read outside lm_head's forward (its
# gather then happens on access) and has no backward to fetch it for; zsim gathers it as for lm_head.
def liger_chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    """The rows of one chunk (see [Note: fused linear cross-entropy])."""
    inc = -(-vocab // hidden)
    rows = 1 << max(0, (-(-tokens // inc) - 1).bit_length())
    return min(rows, tokens)


def fused_linear_head(lm_head: Module, a: int) -> Module:
    """lm_head under Liger's fused linear cross-entropy: its dgrad and wgrad in the forward, the two
    gradients kept to the backward, which scales them (see [Note: fused linear cross-entropy])."""
    assert lm_head.gemm is not None
    t, v, h = lm_head.gemm
    return replace(lm_head, backward_in_forward=True, act_bytes=fused_linear_saved_bytes(t, v, h, a, True, True),
                   bwd_flops=0.0, bwd_mem_bytes=2.0 * (t * h + v * h) * a, kernels_fwd=3, kernels_bwd=2,
                   bwd_workspace_bytes=0.0)


def fused_linear_saved_bytes(tokens: int, vocab: int, hidden: int, a: int, input_grad: bool, weight_grad: bool) -> float:
    """What the fused linear cross-entropy keeps from forward to backward: grad_input and, when
    lm_head's weight trains, grad_weight."""
    return float(tokens * hidden * a * input_grad + vocab * hidden * a * weight_grad)


# [Note: reward model heads]
# A reward model trains on chosen and rejected sequences (2 x micro-batch rows) and its loss is
# -logsigmoid(r_chosen - r_rejected) on one score per sequence: nothing vocabulary-sized is
# in the loss. Two heads produce the score:
# - score: AutoModelForSequenceClassification (transformers' GenericForSequenceClassification;
#   TRL RewardTrainer, axolotl reward_model): the model without lm_head, `score` a Linear
#   hidden -> num_labels (1) without bias over every token, pooled at each sequence's last token.
# - value_head: TRL's AutoModelForCausalLMWithValueHead (trl <= 0.24 models/modeling_value_head.py,
#   LLaMA-Factory stage rm: train/rm/workflow.py load_model(add_valuehead=True)): the causal LM
#   runs whole, so lm_head computes the t x vocab logits and the wrapper upcasts them to fp32
#   (`lm_logits.float()`), both alive until the forward returns and then dropped unused (the
#   PairwiseTrainer's compute_loss takes only the values): lm_head has no backward and its weight
#   no gradient. zsim prices that weight frozen; under full fine-tuning DeepSpeed still keeps its
#   fp32 master and Adam states (and fills its missing gradient with zeros), which zsim leaves
#   out: vocab x hidden x 12 bytes over the ZeRO-1/2/3 partition (LoRA freezes it anyway). The
#   v_head is dropout (summary_dropout_prob, default 0.1: its mask kept) and `summary`, a
#   Linear hidden -> 1 with bias, over every token.
# Either head trains under LoRA (PEFT's sequence-classification task keeps `score` trained; the
# v_head sits outside the PEFT model).
REWARD_HEADS = {"score": "score", "value_head": "v_head.summary"}


def reward_head(bld: Builder, head: str, e: int, V: int, tied_wte: int | None, sequences: int) -> None:
    """A reward model's head after the final norm (see [Note: reward model heads])."""
    t, a = bld.t, bld.a
    if head == "value_head":
        # lm_head's logits, computed and dropped: a forward with nothing kept for backward, its
        # output (a bytes) and the wrapper's fp32 copy (read a, write 4) transient together
        bld.linear("lm_head", -2, e, V, False, weight=tied_wte, saves_input=False)
        lm = bld.modules[-1]
        if tied_wte is None:    # it gets no gradient: priced frozen (see the note)
            bld.params[lm.params[0]] = replace(bld.params[lm.params[0]], trainable=False)
        bld.modules[-1] = replace(lm, no_grad=True, input_grad=False, weight_grad=False,
                                  fwd_mem_bytes=t * V * (a + 4), kernels_fwd=2, fwd_workspace_bytes=t * V * (a + 4))
        # summary_dropout_prob 0.1: read x, write the dropped x and its mask (1 B), the mask kept
        bld.linear("v_head.summary", -2, e, 1, True, extra_act=t * e, fwd_mem=t * e * (2 * a + 1),
                   bwd_mem=t * e * (2 * a + 1))
    else:
        bld.linear("score", -2, e, 1, False)
    # -logsigmoid(r_chosen - r_rejected) over the sequences' pooled scores
    bld.modules.append(_loss(sequences, fwd_mem=0.0, bwd_mem=0.0, act=4.0 * sequences, kernels=2,
                             fwd_workspace=0.0, bwd_workspace=0.0))


def count_params(m: ModelSpec, seq_len: int | None = None) -> int:
    """Every parameter of the model (all experts, whatever the expert parallelism)."""
    return _param_counts(m, seq_len or m.seq_len)[0]


def count_active_params(m: ModelSpec, seq_len: int | None = None) -> int:
    """The parameters one token uses: all but the routed experts it is not sent to (top_k of
    experts in each MoE layer). Embedding tables count in full, as Mixtral's published 12.9B does."""
    n_params, routed = _param_counts(m, seq_len or m.seq_len)
    if not routed or m.moe is None:
        return n_params
    # every MoE layer has the same experts, so the active share of the routed weights is exact
    return n_params - routed + routed * m.moe.top_k // m.moe.experts


def _param_counts(m: ModelSpec, seq_len: int) -> tuple[int, int]:
    """(every parameter, the routed experts') of the whole model, from one build (a many-expert
    model's workload takes a while to build), memoised where the spec is hashable."""
    try:
        return _param_counts_cached(m, seq_len)
    except TypeError:   # a spec holding an unhashable value: counted, not memoised
        return _param_counts_cached.__wrapped__(m, seq_len)


@lru_cache(maxsize=16)
def _param_counts_cached(m: ModelSpec, seq_len: int) -> tuple[int, int]:
    wl = build_workload(m, micro_batch_size=1, seq_len=seq_len, precision="bf16", flash_attention=True, dropout=False)
    return wl.n_params, sum(p.numel for p in wl.params if p.expert)


def build_workload(m: ModelSpec, micro_batch_size: int, seq_len: int, precision: str,
                   flash_attention: bool, dropout: bool, fused_cross_entropy: bool = False,
                   expert_parallel_size: int = 1, tensor: int = 1, sequence_parallel: bool = False,
                   kernels: str = "fused", attn_implementation: str | None = None,
                   padding_mask: bool = False, experts_implementation: str = "grouped_mm",
                   head: str = "lm", sequence_parallel_size: int = 1,
                   fused_linear_cross_entropy: bool = False) -> Workload:
    """One rank's workload; with expert parallelism each MoE layer holds experts/ep_size experts
    (DeepSpeed-MoE's num_local_experts, deepspeed/moe/layer.py); with tensor parallelism the
    rank's slice of every split module (see the module docstring). `head`: lm (the causal LM's
    lm_head and loss), or a reward model's score or value_head (see [Note: reward model heads]).
    `sequence_parallel_size` > 1 (DeepSpeed-Ulysses): every module runs on the rank's
    seq_len / sequence_parallel_size tokens but the attention core, which sees the whole sequence
    for heads / sequence_parallel_size heads (see [Note: DeepSpeed-Ulysses])."""
    if m.moe is not None and m.moe.experts % expert_parallel_size:
        raise ValueError(f"expert_parallel_size {expert_parallel_size} must divide the {m.moe.experts} experts")
    b, s, h, V = micro_batch_size, seq_len // sequence_parallel_size, m.hidden, m.vocab
    t = b * s
    a = DTYPE_BYTES[precision]
    attn = attn_implementation or ("flash_attention_2" if flash_attention else "eager")
    bld = Builder(m, t, a, dropout, tensor, sequence_parallel, kernels=kernels, attn_implementation=attn,
                  padding_mask=padding_mask, experts_implementation=experts_implementation,
                  sequence_parallel_size=sequence_parallel_size)
    drop = bld.drop
    # VocabParallelEmbedding and the vocab-parallel logits: each rank holds 1/tp of the
    # (padded) vocabulary (megatron/core/tensor_parallel/layers.py)
    V = ceil_div(V, tensor)

    e = m.embed_proj_dim or h          # the token embedding's width (OPT-350m: 512 with hidden 1024)
    wte = bld.param("wte.weight", V * e, shape=(V, e))
    # token embedding: gather rows (write t*e); backward scatter-adds into the fp32-width table.
    # Vocab-parallel: each rank's partial rows are all-reduced, or with SP and no learned
    # positions reduce-scattered (LanguageModelEmbedding's reduce_scatter_embeddings; TensorRole.EMBED)
    role = TensorRole.EMBED if m.position == "learned" else TensorRole.EXIT
    bld.add(name="wte", kind=ModuleKind.EMBEDDING, layer=-1, params=(wte,), gemm=None, fwd_flops=0.0,
            bwd_flops=0.0, model_fwd_flops=0.0, fwd_mem_bytes=t * e * a, bwd_mem_bytes=2 * t * e * a,
            act_bytes=drop * t * e / bld.seq, kernels_fwd=1, kernels_bwd=1, tensor_role=role, tensor_width=e)
    if m.embed_proj_dim:
        bld.linear("project_in", -1, e, h, False)
    if m.position == "learned":
        wpe = bld.param("wpe.weight", (m.seq_len + m.position_offset) * h, shape=(m.seq_len + m.position_offset, h))
        bld.add(name="wpe", kind=ModuleKind.EMBEDDING, layer=-1, params=(wpe,), gemm=None, fwd_flops=0.0,
                bwd_flops=0.0, model_fwd_flops=0.0, fwd_mem_bytes=3 * t * h * a, bwd_mem_bytes=2 * t * h * a,
                act_bytes=0.0, kernels_fwd=1, kernels_bwd=1)
    if m.embedding_norm:
        bld.norm("emb_ln", -1)

    for i in range(m.layers):
        pfx = f"layers.{i}"
        # pre-LN: ln_1 before the attention, ln_2 before the MLP; post-LN after each residual add
        pre = not m.post_layernorm
        bld.scope = (pfx,)
        if pre:
            bld.norm(f"{pfx}.ln_1", i)
        if m.is_attention_layer(i):
            bld.scope = (pfx, f"{pfx}.attn")
            attention(bld, f"{pfx}.attn", i, b, s, flash_attention)
        else:
            bld.scope = (pfx, f"{pfx}.mamba")
            mamba_mixer(bld, f"{pfx}.mamba", i)
        bld.scope = (pfx,)
        if not pre:
            bld.norm(f"{pfx}.ln_1", i)
        if m.post_norms:
            bld.norm(f"{pfx}.post_attn_ln", i)
        # a parallel block with one shared norm feeds the MLP from ln_1 (Falcon-7B)
        if pre and not m.shared_norm:
            bld.norm(f"{pfx}.ln_2", i)
        if m.is_moe_layer(i):
            moe_mlp(bld, pfx, i, expert_parallel_size)
        else:
            bld.scope = (pfx, f"{pfx}.mlp")
            bld.mlp(f"{pfx}.mlp", i, m.ffn)
        bld.scope = (pfx,)
        if not pre:
            bld.norm(f"{pfx}.ln_2", i)
        if m.post_norms:
            bld.norm(f"{pfx}.post_mlp_ln", i)

    bld.scope = ()
    if not m.post_layernorm:       # OPTDecoder has no final_layer_norm without do_layer_norm_before
        bld.norm("ln_f", -2)
    if m.embed_proj_dim:
        bld.linear("project_out", -2, h, e, False)
    if head != "lm":
        reward_head(bld, head, e, V, wte if m.tied_embeddings else None, b)
        return Workload(params=tuple(bld.params), modules=tuple(bld.modules), layers=m.layers, tokens=t,
                        micro_batch_size=b, seq_len=s, layer_input_bytes=float(t * h * a / bld.seq),
                        act_dtype_bytes=a)
    # lm_head: a Linear whose weight is wte's when tied (DeepSpeed ZeRO-3 fetches it again here)
    # vocab-parallel logits (Megatron's parallel_lm_logits: a column-parallel linear over the vocabulary)
    bld.linear("lm_head", -2, e, V * tensor, False, weight=wte if m.tied_embeddings else None, split=Split.COLUMN)
    if fused_linear_cross_entropy:
        bld.modules[-1] = fused_linear_head(bld.modules[-1], a)
        bld.modules.append(_loss(t * V, fwd_mem=3.0 * t * V * a, bwd_mem=0.0, act=0.0, kernels=1,
                                 fwd_workspace=liger_chunk_rows(t, V, e) * V * a, bwd_workspace=0.0))
    elif fused_cross_entropy:
        # fused kernel (e.g. flash-attn's CrossEntropyLoss): keeps the 16-bit logits and the
        # log-sum-exp, writes the gradient in place
        bld.modules.append(_loss(t * V, fwd_mem=t * V * a, bwd_mem=2 * t * V * a, act=t * V * a + 4 * t, kernels=1,
                                 fwd_workspace=0.0, bwd_workspace=0.0))
    else:
        # see [Note: HF loss memory]. Its time: the upcast (read a, write 4 per logit) and, in
        # backward, ToCopyBackward's cast back (read 4, write a) run in the precision's kernels;
        # with fp32 logits `.float()` returns them as they are and neither runs. log_softmax
        # (8 B per logit) and nll_loss / log_softmax backward (20 B) run in fp32 whatever the
        # precision, at fp32's memory-bound rate (on a CPU without bf16 arithmetic 2-2.5x a bf16
        # kernel's: a medium GPT's loss, bf16, 512 x 4096 logits, took 7.8 / 8.7 ms forward /
        # backward under the training core, where the bf16 rate priced 11.7 / 19.9)
        cast = t * V * (a + 4) if a != 4 else 0.0
        bld.modules.append(_loss(t * V, fwd_mem=cast, bwd_mem=cast, act=4 * t * V, kernels=3 if cast else 2,
                                 fwd_workspace=t * V * (a + 4), bwd_workspace=8 * t * V,
                                 fp32_fwd_mem=8.0 * t * V, fp32_bwd_mem=20.0 * t * V))
    return Workload(params=tuple(bld.params), modules=tuple(bld.modules), layers=m.layers, tokens=t,
                    micro_batch_size=b, seq_len=s, layer_input_bytes=float(t * h * a / bld.seq), act_dtype_bytes=a)
