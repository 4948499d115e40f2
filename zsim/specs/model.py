"""The model: the scenario's `model:` block as a frozen dataclass, and the named presets.

Each preset reproduces the parameter count its authors published (tests/workload/test_workload.py
checks them). Preset keys are those of the `model:` block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from zsim.schema import spec


# Upper bounds: several times the largest published transformer (Llama-3 405B: 126 layers,
# hidden 16384, ffn 53248; vocabularies up to 256k; contexts up to 10M tokens), so no real model
# is refused, while the schedule (ops per layer) and the parameter bookkeeping stay bounded.
MAX_LAYERS = 1024
MAX_HIDDEN = 2**18
MAX_VOCAB = 2**24
MAX_SEQ_LEN = 2**25


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """A Mixture-of-Experts MLP: DeepSpeed-MoE's `deepspeed.moe.layer.MoE(num_experts, ep_size, k,
    capacity_factor, eval_capacity_factor, min_capacity, use_residual, drop_tokens)` and the Hugging
    Face MoE configs (Mixtral, Qwen-MoE, DeepSeek). Expert parallelism (ep_size) is a property of
    the run, not of the model: it lives in the scenario's parallelism block."""
    experts: int = spec(gt=0, le=MAX_HIDDEN, doc="routed experts per MoE layer (num_experts)")
    top_k: int = spec(gt=0, le=MAX_HIDDEN, doc="experts each token is routed to (k)")
    expert_ffn_hidden: Optional[int] = spec(None, gt=0, le=4 * MAX_HIDDEN, doc="one expert's MLP width; default model.ffn_hidden")
    shared_experts: int = spec(0, ge=0, le=MAX_HIDDEN, doc="always-active experts (DeepSeek n_shared_experts, Qwen-MoE shared expert)")
    shared_ffn_hidden: Optional[int] = spec(None, gt=0, le=4 * MAX_HIDDEN, doc="MLP width of the shared experts together; default shared_experts * expert_ffn_hidden")
    shared_expert_gate: bool = spec(False, doc="sigmoid gate on the shared expert's output (Qwen-MoE)")
    layer_freq: int = spec(1, gt=0, le=MAX_LAYERS, doc="every layer_freq-th block is MoE (Qwen decoder_sparse_step, DeepSeek moe_layer_freq)")
    layer_offset: int = spec(0, ge=0, le=MAX_LAYERS, doc="block i is MoE when i % layer_freq == layer_offset (Jamba expert_layer_offset)")
    first_dense_layers: int = spec(0, ge=0, le=MAX_LAYERS, doc="leading blocks with a dense MLP (DeepSeek first_k_dense_replace)")
    dispatch: Literal["capacity", "dropless"] = spec("capacity", doc="capacity: DeepSpeed-MoE's TopKGate with capacity buffers; dropless: Hugging Face's loop over the experts")
    capacity_factor: float = spec(1.0, gt=0, le=MAX_HIDDEN, doc="DeepSpeed-MoE training capacity factor")
    eval_capacity_factor: float = spec(1.0, gt=0, le=MAX_HIDDEN)
    min_capacity: int = spec(4, ge=0, le=MAX_SEQ_LEN, doc="DeepSpeed-MoE min_capacity")
    drop_tokens: bool = spec(True, doc="DeepSpeed-MoE drop_tokens: tokens over capacity are dropped")
    use_residual: bool = spec(False, doc="Residual MoE (Rajbhandari et al. 2022): a dense MLP beside the experts, mixed by a learned coefficient")

    def __post_init__(self):
        if self.top_k > self.experts:
            raise ValueError("top_k", self.top_k, f"must not exceed experts ({self.experts})")
        if not self.shared_experts and (self.shared_ffn_hidden or self.shared_expert_gate):
            raise ValueError("shared_experts", 0, "shared_ffn_hidden and shared_expert_gate need shared_experts >= 1")
        if self.layer_offset >= self.layer_freq:
            raise ValueError("layer_offset", self.layer_offset, f"must be below layer_freq ({self.layer_freq})")


@dataclass(frozen=True, kw_only=True)
class MambaSpec:
    """Mamba mixers (Gu & Dao 2023, arXiv:2312.00752) in place of attention in most blocks of a
    hybrid model: Jamba (Lieber et al. 2024; transformers models/jamba/modeling_jamba.py
    JambaMambaMixer): in_proj (hidden -> 2 x inner), a causal depthwise conv1d of d_conv taps,
    x_proj (inner -> dt_rank + 2 x d_state), dt_proj (dt_rank -> inner), the selective scan with
    A_log (inner x d_state) and D, out_proj (inner -> hidden); block i has attention when
    i % attn_layer_period == attn_layer_offset."""
    d_state: int = spec(16, gt=0, le=MAX_HIDDEN, doc="SSM state per channel (mamba_d_state)")
    d_conv: int = spec(4, gt=0, le=64, doc="conv1d taps (mamba_d_conv)")
    expand: int = spec(2, gt=0, le=16, doc="inner width = expand x hidden (mamba_expand)")
    dt_rank: int = spec(gt=0, le=MAX_HIDDEN, doc="the time step's low rank (mamba_dt_rank; 'auto' is ceil(hidden / 16))")
    conv_bias: bool = spec(True, doc="conv1d bias (mamba_conv_bias)")
    proj_bias: bool = spec(False, doc="in_proj and out_proj biases (mamba_proj_bias)")
    inner_norms: bool = spec(True, doc="RMSNorms on dt, B and C (Jamba's dt_layernorm, b_layernorm, c_layernorm)")
    attn_layer_period: int = spec(gt=0, le=MAX_LAYERS, doc="one attention block every attn_layer_period blocks")
    attn_layer_offset: int = spec(0, ge=0, le=MAX_LAYERS, doc="the first attention block")

    def __post_init__(self):
        if self.attn_layer_offset >= self.attn_layer_period:
            raise ValueError("attn_layer_offset", self.attn_layer_offset,
                             f"must be below attn_layer_period ({self.attn_layer_period})")


@dataclass(frozen=True, kw_only=True)
class MLASpec:
    """DeepSeek-V2/V3 Multi-head Latent Attention (DeepSeek-AI 2024, arXiv:2405.04434 sec. 2.1;
    HF modeling_deepseek_v2.py DeepseekV2Attention): queries through an optional low-rank
    q_a_proj/q_b_proj, keys and values through one compressed latent (kv_a_proj_with_mqa, of
    kv_lora_rank + one shared RoPE key of qk_rope_head_dim) expanded per head by kv_b_proj."""
    kv_lora_rank: int = spec(gt=0, le=MAX_HIDDEN, doc="width of the compressed key-value latent")
    qk_nope_head_dim: int = spec(gt=0, le=MAX_HIDDEN, doc="per-head query/key dims without RoPE")
    qk_rope_head_dim: int = spec(gt=0, le=MAX_HIDDEN, doc="per-head query/key dims with RoPE (the key part shared by all heads)")
    v_head_dim: int = spec(gt=0, le=MAX_HIDDEN, doc="per-head value dims")
    q_lora_rank: Optional[int] = spec(None, gt=0, le=MAX_HIDDEN, doc="low-rank query (q_a_proj/q_b_proj); absent: one q_proj")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    layers: int = spec(gt=0, le=MAX_LAYERS)
    hidden: int = spec(gt=0, le=MAX_HIDDEN)
    heads: int = spec(gt=0, le=MAX_HIDDEN)
    vocab: int = spec(gt=0, le=MAX_VOCAB)
    seq_len: int = spec(gt=0, le=MAX_SEQ_LEN, doc="maximum positions (learned position table size)")
    kv_heads: Optional[int] = spec(None, gt=0, le=MAX_HIDDEN, doc="GQA/MQA key-value heads; default = heads")
    ffn_hidden: Optional[int] = spec(None, gt=0, le=4 * MAX_HIDDEN, doc="default 4*hidden")
    glu: bool = spec(False, doc="gated MLP (SwiGLU): three projections")
    tied_embeddings: bool = spec(True)
    position: Literal["learned", "rope", "alibi", "none"] = spec("learned", doc="none: no position encoding (Jamba: its Mamba layers order the tokens)")
    norm: Literal["layernorm", "rmsnorm"] = spec("layernorm")
    bias: bool = spec(True)
    fused_qkv: bool = spec(True, doc="one QKV Linear (GPT-2/MPT/BLOOM) or q/k/v_proj modules (Llama)")
    embedding_norm: bool = spec(False, doc="LayerNorm after the embedding (BLOOM)")
    head_dim: Optional[int] = spec(None, gt=0, le=MAX_HIDDEN, doc="per-head width; default hidden/heads (Gemma: 16 heads x 256 with hidden 3072)")
    attention_bias: Optional[bool] = spec(None, doc="biases on q/k/v and the output projection; default model.bias")
    qkv_bias: Optional[bool] = spec(None, doc="biases on q/k/v only (Qwen2: true with attention_bias false); default attention_bias")
    mlp_bias: Optional[bool] = spec(None, doc="biases on the MLP projections; default model.bias")
    fused_gate_up: bool = spec(False, doc="one gate_up_proj Linear of 2*ffn_hidden (Phi-3) instead of gate_proj and up_proj; needs glu")
    parallel_residual: bool = spec(False, doc="attention and MLP both read the block input, x + attn(ln_1(x)) + mlp(ln_2(x)) (GPT-NeoX, Falcon)")
    shared_norm: bool = spec(False, doc="with parallel_residual: one LayerNorm feeds both (Falcon-7B); no ln_2")
    qk_norm: bool = spec(False, doc="RMSNorm over each head's query and key, q_norm and k_norm of head_dim weights (Qwen3)")
    attention_sinks: bool = spec(False, doc="a learned logit per head joins each softmax's denominator (GPT-OSS): "
                                            "transformers runs it in eager attention or a FlashAttention kernel that "
                                            "takes sinks, never torch's sdpa; its one scalar per head is not counted")
    post_norms: bool = spec(False, doc="a norm on the attention and on the MLP output before each residual add (Gemma-2: 4 norms per block)")
    sliding_window: Optional[int] = spec(None, gt=0, le=MAX_SEQ_LEN, doc="each query attends to the last sliding_window positions (Mistral, Gemma-2); absent: full causal attention")
    sliding_window_layers: Literal["all", "even", "pattern"] = spec(
        "all", doc="the blocks with the window: all (Mistral), the even-numbered ones (Gemma-2 alternates local "
                   "and global), or pattern: all but every sliding_window_pattern-th (Gemma-3: 5 local, 1 global)")
    sliding_window_pattern: Optional[int] = spec(None, gt=1, le=64, doc="with sliding_window_layers pattern: block i "
                                                 "is global when (i + 1) % pattern == 0 (HF Gemma3TextConfig's "
                                                 "layer_types rule), local otherwise")
    post_layernorm: bool = spec(False, doc="norms after each residual add, none at the end (OPT-350m's do_layer_norm_before false)")
    embed_proj_dim: Optional[int] = spec(None, gt=0, le=MAX_HIDDEN, doc="token embedding and lm_head of this width, with project_in/project_out to hidden (OPT-350m's word_embed_proj_dim)")
    position_offset: int = spec(0, ge=0, le=MAX_SEQ_LEN, doc="extra rows of the learned position table (OPT: 2)")
    mla: Optional[MLASpec] = spec(None, doc="DeepSeek Multi-head Latent Attention instead of q/k/v projections")
    moe: Optional[MoESpec] = spec(None, doc="Mixture-of-Experts MLPs; absent: every MLP is dense")
    mamba: Optional[MambaSpec] = spec(None, doc="Mamba mixers in place of attention in most blocks (Jamba); "
                                                "absent: attention in every block")
    preset: Optional[str] = spec(None)

    def __post_init__(self):
        if self.head_dim is None and self.mla is None and self.hidden % self.heads:
            raise ValueError("hidden", self.hidden, f"must be divisible by heads ({self.heads}), or give model.head_dim")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError("kv_heads", self.kv_heads, f"must divide heads ({self.heads})")
        if self.fused_gate_up and not self.glu:
            raise ValueError("fused_gate_up", True, "needs glu: true (a fused gate and up projection)")
        if self.shared_norm and not self.parallel_residual:
            raise ValueError("shared_norm", True, "needs parallel_residual: true")
        if self.mla is not None and (self.kv_heads is not None or self.head_dim is not None or self.fused_qkv):
            raise ValueError("mla", "...", "MLA has its own projections: drop kv_heads and head_dim, set fused_qkv: false")
        if self.post_layernorm and (self.parallel_residual or self.post_norms):
            raise ValueError("post_layernorm", True, "does not combine with parallel_residual or post_norms")
        if self.qk_norm and (self.fused_qkv or self.mla is not None):
            raise ValueError("qk_norm", True, "needs separate q_proj and k_proj (fused_qkv: false, no mla)")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def attn_bias(self) -> bool:
        return self.bias if self.attention_bias is None else self.attention_bias

    @property
    def qkv_proj_bias(self) -> bool:
        return self.attn_bias if self.qkv_bias is None else self.qkv_bias

    @property
    def mlp_proj_bias(self) -> bool:
        return self.bias if self.mlp_bias is None else self.mlp_bias

    def is_moe_layer(self, layer: int) -> bool:
        """DeepSeek's rule (modeling_deepseek_v2.py DeepseekV2DecoderLayer): block i is MoE when
        i >= first_k_dense_replace and i % moe_layer_freq == 0; with layer_freq 1 every block from
        first_dense_layers on is (Mixtral, Qwen-MoE with decoder_sparse_step 1)."""
        moe = self.moe
        return moe is not None and layer >= moe.first_dense_layers and layer % moe.layer_freq == moe.layer_offset

    @property
    def has_dense_mlp(self) -> bool:
        """Some block's MLP is dense (not an MoE block)."""
        return not all(self.is_moe_layer(i) for i in range(self.layers))

    def is_attention_layer(self, layer: int) -> bool:
        """Block i mixes tokens by attention (else by a Mamba mixer): JambaConfig.layers_block_type."""
        mb = self.mamba
        return mb is None or layer % mb.attn_layer_period == mb.attn_layer_offset

    def has_window(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        if self.sliding_window_layers == "pattern":
            return (layer + 1) % (self.sliding_window_pattern or 1) != 0
        return self.sliding_window_layers == "all" or layer % 2 == 0


_GPT2 = dict(vocab=50257, seq_len=1024, position="learned", tied_embeddings=True, norm="layernorm",
             bias=True, glu=False, fused_qkv=True)
# GPT-3: Brown et al. 2020, Table 2.1 (n_layers, d_model, n_heads); vocab 50257, context 2048.
# The paper's 1.3B row lists 24 heads of 128 (inconsistent with d_model 2048); we use 16 of 128.
_GPT3 = dict(vocab=50257, seq_len=2048, position="learned", tied_embeddings=True, norm="layernorm",
             bias=True, glu=False, fused_qkv=True)
# Llama 2: Touvron et al. 2023 and the HF config.json files; RMSNorm, SwiGLU, RoPE, no biases, untied.
_LLAMA2 = dict(vocab=32000, seq_len=4096, position="rope", tied_embeddings=False, norm="rmsnorm",
               bias=False, glu=True, fused_qkv=False)
# Llama 3: Meta's HF config.json (vocab 128256, GQA with 8 KV heads, context 8192).
_LLAMA3 = dict(_LLAMA2, vocab=128256, seq_len=8192)

PRESETS: dict[str, dict] = {
    # GPT-2 (Radford et al. 2019; HF gpt2* configs): 124,439,808 / 354,823,168 / 774,030,080 / 1,557,611,200
    "gpt2": dict(_GPT2, layers=12, hidden=768, heads=12),
    "gpt2-medium": dict(_GPT2, layers=24, hidden=1024, heads=16),
    "gpt2-large": dict(_GPT2, layers=36, hidden=1280, heads=20),
    "gpt2-xl": dict(_GPT2, layers=48, hidden=1600, heads=25),
    "gpt3-1.3b": dict(_GPT3, layers=24, hidden=2048, heads=16),
    "gpt3-2.7b": dict(_GPT3, layers=32, hidden=2560, heads=32),
    "gpt3-6.7b": dict(_GPT3, layers=32, hidden=4096, heads=32),
    "gpt3-13b": dict(_GPT3, layers=40, hidden=5120, heads=40),  # paper: d_model 5140, not divisible by 40 heads
    "gpt3-175b": dict(_GPT3, layers=96, hidden=12288, heads=96),
    # Llama 2: 6,738,415,616 / 13,015,864,320 / 68,976,648,192
    "llama2-7b": dict(_LLAMA2, layers=32, hidden=4096, heads=32, ffn_hidden=11008),
    "llama2-13b": dict(_LLAMA2, layers=40, hidden=5120, heads=40, ffn_hidden=13824),
    "llama2-70b": dict(_LLAMA2, layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672),
    # Llama 3: 8,030,261,248 / 70,553,706,496
    "llama3-8b": dict(_LLAMA3, layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336),
    "llama3-70b": dict(_LLAMA3, layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672),
    # BLOOM (BigScience 2022, arXiv:2211.05100): 176,247,271,424 with embedding LayerNorm, ALiBi, tied.
    "bloom-176b": dict(vocab=250880, seq_len=2048, position="alibi", tied_embeddings=True, norm="layernorm",
                       bias=True, glu=False, fused_qkv=True, embedding_norm=True,
                       layers=70, hidden=14336, heads=112),
    # MPT (MosaicML llm-foundry benchmark table, shared/reference): learned positions, tied, biases.
    "mpt-760m": dict(_GPT2, vocab=50368, seq_len=2048, layers=24, hidden=1536, heads=12),
    "mpt-1b": dict(_GPT2, vocab=50368, seq_len=2048, layers=24, hidden=2048, heads=16),
    "mpt-3b": dict(_GPT2, vocab=50368, seq_len=2048, layers=32, hidden=2560, heads=20),
    "mpt-7b": dict(_GPT2, vocab=50368, seq_len=2048, layers=32, hidden=4096, heads=32),
    "mpt-13b": dict(_GPT2, vocab=50368, seq_len=2048, layers=40, hidden=5120, heads=40),
    "mpt-30b": dict(_GPT2, vocab=50368, seq_len=2048, layers=48, hidden=7168, heads=64),
    "mpt-70b": dict(_GPT2, vocab=50368, seq_len=2048, layers=80, hidden=8192, heads=64),
}

# Published totals the tests hold the presets to (exact where the authors gave exact figures).
PUBLISHED_PARAMS: dict[str, int] = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200,
    "llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "bloom-176b": 176_247_271_424,
    "mpt-7b": 6_658_859_008, "mpt-30b": 29_975_214_080, "mpt-70b": 64_862_437_376,
}
# GPT-3's paper gives rounded sizes only.
PUBLISHED_NOMINAL_PARAMS: dict[str, float] = {
    "gpt3-1.3b": 1.3e9, "gpt3-2.7b": 2.7e9, "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9, "gpt3-175b": 175e9,
}
