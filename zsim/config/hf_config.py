"""A Hugging Face config.json -> the `model:` block's keys (zsim.specs.model.ModelSpec).

No network and no transformers import: each supported `model_type` reads the fields its
transformers modeling file builds the modules from, with the defaults of its configuration
class where released config.json files leave them out (tie_word_embeddings, num_key_value_heads,
head_dim, attention_bias, ...; a key left out takes the class default, an explicit null what
the class's __post_init__ makes of None), under either name its attribute_map allows
(num_experts / num_local_experts, n_head / num_attention_heads, ...). Keys a modeling file does
not read (Mistral's attention_bias, GPT-NeoX's head_dim) change nothing, as in transformers.
Fields that change no parameter shape (rope_theta, rope_scaling, hidden_act, dropout, eps) are
not needed; shape-changing options zsim does not model are refused by name. Reference:
transformers 5.23.0 (AutoModelForCausalLM.from_config; tests/workload/test_hf_param_counts.py holds the
counts it gives). The files in scenarios/models/ are presets named by their stem (docs/model.md).
"""
from __future__ import annotations

from pathlib import Path

from zsim.errors import ZsimInputError, did_you_mean
from zsim.inputs import parse_json, read_text
from zsim.specs.model import PRESETS

MISSING = object()
# The training length when a config.json gives only its context (max_position_embeddings: 131,072
# for Llama-3.1, Qwen2.5, Phi-4) and the scenario none: TRL's SFTConfig max_length default
# (trl/trainer/sft_config.py, TRL 1.16), what a fine-tune of such a model trains at unless told
FINE_TUNE_SEQ_LEN = 1024


def models_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "scenarios" / "models"


def model_files() -> dict[str, Path]:
    """The shipped config.json presets: name (the file's stem) -> path."""
    return {p.stem: p for p in sorted(models_dir().glob("*.json"))}


# Other names a config.json may give a field: the configuration classes' attribute_map (alias ->
# the field zsim reads). transformers 5 writes Qwen3-MoE's num_experts as num_local_experts and
# reads either; GPT-2 and BLOOM take the common names for their n_* fields.
ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_local_experts": "num_experts"},
    "gpt2": {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
             "num_hidden_layers": "n_layer"},
    "bloom": {"num_hidden_layers": "n_layer", "num_attention_heads": "n_head"},
    "deepseek_v2": {"num_experts": "n_routed_experts"},
    "deepseek_v3": {"num_local_experts": "n_routed_experts"},
}
# num_key_value_heads when a config.json leaves it out: the class default (MistralConfig 8,
# Qwen2Config 32, ...); LlamaConfig and Phi3Config default to None, i.e. num_attention_heads,
# as does an explicit null in every class (their __post_init__)
KV_HEADS_DEFAULT = {"mistral": 8, "mixtral": 8, "glm4": 2, "qwen2": 32, "qwen2_moe": 16, "qwen3": 32, "qwen3_moe": 4,
                    "gemma": 16, "gemma2": 4}


class _Config:
    """The parsed config with one-line errors that name the file and the key."""

    def __init__(self, data: dict, name: str):
        self.data, self.name = dict(data), name
        self.model_type = model_type = data.get("model_type")
        self.spelled: dict[str, str] = {}     # field -> the alias the config gave it under
        for alias, field in (ALIASES.get(model_type, {}) if isinstance(model_type, str) else {}).items():
            if self.data.get(field) is None and self.data.get(alias) is not None:
                self.data[field], self.spelled[field] = self.data[alias], alias

    def error(self, key: str, value, fix: str) -> ZsimInputError:
        return ZsimInputError(f"{self.name}: {self.spelled.get(key, key)}", value, fix)

    def hidden_key(self) -> str:
        """Falcon's and BLOOM's width key: the legacy n_embed, when given, over hidden_size (their
        configuration classes' __post_init__ pops it over hidden_size)."""
        return "n_embed" if self.data.get("n_embed") is not None else "hidden_size"

    def flag(self, key: str, default: bool) -> bool:
        """A boolean the modeling file tests for truth: left out, the class default; null, false."""
        if key not in self.data:
            return default
        return self.data[key] is not None and self.get(key, default, bool)

    def get(self, key: str, default=MISSING, kind=int):
        value = self.data.get(key)
        if value is None:
            if default is MISSING:
                raise self.error(key, None, f"missing; a {self.data.get('model_type')} config.json needs it")
            return default
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise self.error(key, value, "expected a positive integer")
        if kind is bool and not isinstance(value, bool):
            raise self.error(key, value, "expected true or false")
        return value

    def refuse(self, key: str, unsupported, why: str):
        """Refuse a shape-changing option zsim does not model."""
        value = self.data.get(key)
        if value is not None and unsupported(value):
            raise self.error(key, value, f"{why}, which zsim does not model; use a config without it")

    def heads(self, hidden_key: str = "hidden_size", heads_key: str = "num_attention_heads",
              default_head_dim: int | None = None, reads_head_dim: bool = True) -> dict:
        """hidden and heads, and head_dim where it is not hidden / heads (absent from the config:
        the class's default, or hidden / heads, which the heads must then divide). Without
        `reads_head_dim` (GPT-2, GPT-NeoX, Falcon, OPT: head_dim = hidden // heads in the
        modeling file) a head_dim key changes nothing."""
        hidden, heads = self.get(hidden_key), self.get(heads_key)
        if not reads_head_dim:
            if hidden % heads:
                raise self.error(heads_key, heads, f"does not divide {hidden_key} {hidden}")
            return dict(hidden=hidden, heads=heads)
        head_dim = self.get("head_dim", default_head_dim)
        if head_dim is None and hidden % heads:
            raise self.error(heads_key, heads, f"does not divide {hidden_key} {hidden}; give head_dim in the config")
        out = dict(hidden=hidden, heads=heads)
        if head_dim is not None and (hidden % heads or head_dim != hidden // heads):
            out["head_dim"] = head_dim
        return out


# the model_types whose modeling file reads attention_bias (q/k/v/o_proj) and mlp_bias
# (gate/up/down_proj); the others hard-code bias=False (Mistral, Mixtral, Phi-3, the Qwen2s,
# whose q/k/v biases are their own) and ignore the keys
READS_ATTENTION_BIAS = {"llama", "qwen3", "qwen3_moe", "gemma", "gemma2", "gpt_oss", "granite", "smollm3"}
READS_MLP_BIAS = {"llama", "granite", "smollm3"}


def _kv_heads(c: _Config) -> int:
    heads = c.get("num_attention_heads")
    default = KV_HEADS_DEFAULT.get(c.model_type or "")
    if "num_key_value_heads" in c.data or default is None:
        return c.get("num_key_value_heads", heads)
    if heads % default:
        raise c.error("num_key_value_heads", None, f"missing; transformers' {c.model_type} default is {default}, "
                      f"which does not divide num_attention_heads ({heads}); give it")
    return default


def _llama_like(c: _Config, tied: bool, default_head_dim: int | None = None) -> dict:
    """LlamaForCausalLM and the models built like it (Mistral, Mixtral, Qwen2, Gemma, Phi-3):
    RMSNorm, RoPE, q/k/v_proj and o_proj, gate/up/down_proj (SwiGLU, GeGLU for Gemma)."""
    reads_attn, reads_mlp = c.model_type in READS_ATTENTION_BIAS, c.model_type in READS_MLP_BIAS
    out = dict(c.heads(default_head_dim=default_head_dim), layers=c.get("num_hidden_layers"),
               vocab=c.get("vocab_size"), seq_len=c.get("max_position_embeddings"), ffn_hidden=c.get("intermediate_size"),
               kv_heads=_kv_heads(c),
               tied_embeddings=c.get("tie_word_embeddings", tied, bool), position="rope", norm="rmsnorm",
               glu=True, fused_qkv=False, bias=False,
               attention_bias=reads_attn and c.get("attention_bias", False, bool),
               mlp_bias=reads_mlp and c.get("mlp_bias", False, bool))
    for key in ("kv_heads", "attention_bias", "mlp_bias"):   # only what differs from the defaults
        if out[key] == {"kv_heads": out["heads"], "attention_bias": False, "mlp_bias": False}[key]:
            del out[key]
    return out


def _window(c: _Config, out: dict, pattern: str = "all", every: int | None = None) -> dict:
    """sliding_window (null: full attention) on all layers, the even ones, or all but every
    `every`-th (pattern); a layer_types list names its own, which must be one of those."""
    window = c.data.get("sliding_window")
    if window is not None:
        out.update(sliding_window=c.get("sliding_window"), sliding_window_layers=pattern)
        if pattern == "pattern":
            out["sliding_window_pattern"] = every
    types = c.data.get("layer_types")
    if types is not None:
        sliding = [t == "sliding_attention" for t in types] if isinstance(types, list) else None
        n = out["layers"]
        if sliding == [False] * n:
            for key in ("sliding_window", "sliding_window_layers", "sliding_window_pattern"):
                out.pop(key, None)
            return out
        candidates: list[tuple[str, int | None, list[bool]]] = [("all", None, [True] * n),
                                                                ("even", None, [i % 2 == 0 for i in range(n)])]
        candidates += [("pattern", p, [(i + 1) % p != 0 for i in range(n)]) for p in range(3, 65)]
        match = next(((name, p) for name, p, layout in candidates if layout == sliding), None)
        if window is None or match is None:
            raise c.error("layer_types", "...", "zsim models a window on all layers, on the even ones, or on all "
                                                "but every N-th")
        out.pop("sliding_window_pattern", None)
        out["sliding_window_layers"] = match[0]
        if match[1] is not None:
            out["sliding_window_pattern"] = match[1]
    return out


def _llama(c: _Config) -> dict:
    return _window(c, _llama_like(c, tied=False))


def _qwen2(c: _Config, qkv_bias: bool = True) -> dict:
    # Qwen2Attention: q/k/v_proj with bias, o_proj without (attention_bias is not read)
    out = dict(_llama_like(c, tied=False), qkv_bias=qkv_bias)
    c.refuse("use_sliding_window", bool, "a sliding window from layer max_window_layers on")
    return out


def _moe_fields(c: _Config, experts_key: str, width_key: str | None) -> dict:
    """Routed experts of a Hugging Face MoE block (dropless); width_key None: intermediate_size."""
    experts, top_k = c.get(experts_key), c.get("num_experts_per_tok")
    if top_k > experts:
        named = c.spelled.get(experts_key, experts_key)
        raise c.error("num_experts_per_tok", top_k, f"must not exceed {named} ({experts})")
    out = dict(experts=experts, top_k=top_k, dispatch="dropless")
    if width_key is not None:
        out["expert_ffn_hidden"] = c.get(width_key)
    return out


def _mixtral(c: _Config) -> dict:
    # MixtralSparseMoeBlock: gate + experts (w1, w3, w2 of intermediate_size)
    return dict(_window(c, _llama_like(c, tied=False)), moe=_moe_fields(c, "num_local_experts", None))


def _qwen2_moe(c: _Config) -> dict:
    # Qwen2MoeAttention: q/k/v_proj biases from qkv_bias (default true), o_proj without
    out = _qwen2(c, qkv_bias=c.get("qkv_bias", True, bool))
    c.refuse("mlp_only_layers", bool, "dense MLPs on listed layers")
    # Qwen2MoeSparseMoeBlock: gate, experts, one shared_expert with its sigmoid shared_expert_gate
    moe = dict(_moe_fields(c, "num_experts", "moe_intermediate_size"), shared_experts=1,
               shared_ffn_hidden=c.get("shared_expert_intermediate_size"), shared_expert_gate=True)
    return dict(out, moe=dict(moe, **_sparse_step(c)))


def _sparse_step(c: _Config) -> dict:
    """Qwen2/3-MoE's decoder_sparse_step (default 1): block i is MoE when (i + 1) % step == 0
    (Qwen2MoeDecoderLayer, Qwen3MoeDecoderLayer), a gated MLP of intermediate_size otherwise."""
    step = c.get("decoder_sparse_step", 1)
    return dict(layer_freq=step, layer_offset=step - 1) if step > 1 else {}


def _qwen3(c: _Config, default_head_dim: int | None = 128) -> dict:
    # Qwen3Attention: q_norm and k_norm (RMSNorm of head_dim) on every head; attention_bias
    # (default false) on q/k/v/o; head_dim given in the config (Qwen3-0.6B: 16 x 128, hidden
    # 1024), Qwen3Config's default 128 where it is not (Qwen3MoeConfig has none: hidden / heads)
    c.refuse("use_sliding_window", bool, "a sliding window from layer max_window_layers on")
    return dict(_llama_like(c, tied=False, default_head_dim=default_head_dim), qk_norm=True)


def _qwen3_moe(c: _Config) -> dict:
    # Qwen3MoeSparseMoeBlock: gate + experts, no shared expert
    c.refuse("mlp_only_layers", bool, "dense MLPs on listed layers")
    return dict(_qwen3(c, default_head_dim=None),
                moe=dict(_moe_fields(c, "num_experts", "moe_intermediate_size"), **_sparse_step(c)))


def _gpt_oss(c: _Config) -> dict:
    # modeling_gpt_oss.py: GptOssAttention q/k/v/o_proj with bias (attention_bias), head_dim from the
    # config (64 x 64 heads over hidden 2880), a learned sink logit per head; layer_types alternate
    # sliding (sliding_window 128) and full attention. GptOssMLP: a router (Linear with bias) and
    # GptOssExperts, every expert's gate_up_proj (hidden -> 2 x intermediate_size, one GEMM) and
    # down_proj with biases, run expert by expert in training (the loop over expert_hit); its
    # clamped GLU ((up + 1) * gate * sigmoid(1.702 gate)) is priced as SwiGLU's SiLU and mul
    out = _window(c, _llama_like(c, tied=False))
    out.update(mlp_bias=True, fused_gate_up=True, attention_sinks=True)
    return dict(out, moe=_moe_fields(c, "num_local_experts", None))


def _strict(c: _Config, *keys: str):
    """Keys a reader needs given (their class defaults differ between releases)."""
    for key in keys:
        c.get(key, kind=bool if key == "tie_word_embeddings" else int)


def _granite(c: _Config) -> dict:
    # modeling_granite.py (modular on Llama): LlamaAttention's and LlamaMLP's shapes, attention_bias
    # and mlp_bias read; embedding/residual/attention/logits multipliers are scalars
    _strict(c, "num_key_value_heads", "tie_word_embeddings")
    return _llama(c)


def _smollm3(c: _Config) -> dict:
    # modeling_smollm3.py (modular on Llama): Llama's modules; no_rope_layers drop RoPE on some
    # blocks (no parameter); use_sliding_window refused as for Qwen2
    _strict(c, "num_key_value_heads", "tie_word_embeddings")
    c.refuse("use_sliding_window", bool, "a sliding window from layer max_window_layers on")
    return _llama_like(c, tied=False)


def _glm4(c: _Config) -> dict:
    # modeling_glm4.py: q/k/v_proj with bias (attention_bias, Glm4Config default true), o_proj
    # without; one gate_up_proj; four RMSNorms a block (input, post_self_attn, post_attention,
    # post_mlp: Gemma-2's placement); head_dim default 128; partial rotary (no parameter)
    out = _llama_like(c, tied=False, default_head_dim=128)
    return dict(out, qkv_bias=c.get("attention_bias", True, bool), fused_gate_up=True, post_norms=True)


def _starcoder2(c: _Config) -> dict:
    # modeling_starcoder2.py: LayerNorm (with bias), q/k/v/o_proj and c_fc/c_proj with bias
    # (use_bias), a GeLU MLP of intermediate_size, RoPE, GQA, sliding_window on every block
    _strict(c, "num_key_value_heads", "tie_word_embeddings")
    bias = c.get("use_bias", True, bool)
    out = dict(_llama_like(c, tied=False), glu=False, norm="layernorm", bias=bias)
    out.pop("attention_bias", None)
    out.pop("mlp_bias", None)
    return _window(c, out)


def _gemma(c: _Config) -> dict:
    # GemmaConfig default head_dim 256; GeGLU has SwiGLU's three projections; tied by default
    return _llama_like(c, tied=True, default_head_dim=256)


def _gemma2(c: _Config) -> dict:
    # Gemma2DecoderLayer: input, post_attention, pre_feedforward and post_feedforward norms;
    # even layers slide (is_sliding = not bool(layer_idx % 2))
    return _window(c, dict(_gemma(c), post_norms=True), pattern="even")


def _gemma3_text(c: _Config) -> dict:
    # Gemma3DecoderLayer: Gemma-2's four norms, plus q_norm/k_norm (Gemma3RMSNorm of head_dim) on
    # every head; Gemma3TextConfig: layer i slides unless (i + 1) % sliding_window_pattern == 0
    # (default 6: five local blocks, one global), or as its layer_types list says
    every = c.get("sliding_window_pattern", 6)
    return _window(c, dict(_gemma(c), post_norms=True, qk_norm=True), pattern="pattern", every=every)


def _phi3(c: _Config) -> dict:
    # Phi3Attention: one qkv_proj; Phi3MLP: one gate_up_proj; no biases
    return _window(c, dict(_llama_like(c, tied=False), fused_qkv=True, fused_gate_up=True))


def _gpt2(c: _Config) -> dict:
    c.refuse("add_cross_attention", bool, "cross-attention blocks")
    out = dict(c.heads("n_embd", "n_head", reads_head_dim=False), layers=c.get("n_layer"), vocab=c.get("vocab_size"),
               seq_len=c.get("n_positions"), tied_embeddings=c.get("tie_word_embeddings", True, bool),
               position="learned", norm="layernorm", bias=True, glu=False, fused_qkv=True)
    if c.data.get("n_inner") is not None:       # null: 4 x n_embd, zsim's default too
        out["ffn_hidden"] = c.get("n_inner")
    return out


def _gpt_neox(c: _Config) -> dict:
    # GPTNeoXLayer: query_key_value, dense; dense_h_to_4h, dense_4h_to_h; two LayerNorms; embed_out untied
    return dict(c.heads(reads_head_dim=False), layers=c.get("num_hidden_layers"), vocab=c.get("vocab_size"),
                seq_len=c.get("max_position_embeddings"), ffn_hidden=c.get("intermediate_size"),
                tied_embeddings=c.get("tie_word_embeddings", False, bool), position="rope", norm="layernorm",
                bias=True, attention_bias=c.get("attention_bias", True, bool), glu=False, fused_qkv=True,
                parallel_residual=c.get("use_parallel_residual", True, bool))


def _falcon(c: _Config) -> dict:
    # FalconAttention.query_key_value: (heads + 2 kv heads) x head_dim; kv heads: num_kv_heads with
    # new_decoder_architecture, else 1 with multi_query, else heads. Parallel blocks have two
    # norms (ln_attn, ln_mlp) with new_decoder_architecture or num_ln_in_parallel_attn 2, else one.
    # FalconConfig's booleans are `bool | None` and FalconDecoderLayer tests them for truth: a
    # null multi_query or parallel_attn is false.
    out = dict(c.heads(c.hidden_key(), reads_head_dim=False), layers=c.get("num_hidden_layers"), vocab=c.get("vocab_size"),
               seq_len=c.get("max_position_embeddings", 2048), tied_embeddings=c.get("tie_word_embeddings", True, bool),
               norm="layernorm", bias=c.flag("bias", False), glu=False, fused_qkv=True,
               position="alibi" if c.flag("alibi", False) else "rope")
    if c.data.get("ffn_hidden_size") is not None:   # null: 4 x hidden_size, zsim's default too
        out["ffn_hidden"] = c.get("ffn_hidden_size")
    new_arch = c.flag("new_decoder_architecture", False)
    if new_arch:
        out["kv_heads"] = c.get("num_kv_heads", out["heads"])
    elif c.flag("multi_query", True):
        out["kv_heads"] = 1
    if c.flag("parallel_attn", True):
        norms = c.get("num_ln_in_parallel_attn", 2 if new_arch else 1)
        if norms not in (1, 2):
            raise c.error("num_ln_in_parallel_attn", norms, "expected 1 or 2 (norms before a parallel block)")
        out.update(parallel_residual=True, shared_norm=norms == 1)
    if out.get("kv_heads") == out["heads"]:
        del out["kv_heads"]
    return out


def _bloom(c: _Config) -> dict:
    # BloomModel: word_embeddings_layernorm, ALiBi, fused query_key_value, tied; no position table,
    # so no max_position_embeddings: seq_length when present, else give model.seq_len beside
    hidden = c.get(c.hidden_key())
    heads = c.get("n_head")
    if hidden % heads:
        raise c.error("n_head", heads, f"does not divide hidden_size {hidden}")
    out = dict(hidden=hidden, heads=heads, layers=c.get("n_layer"), vocab=c.get("vocab_size"),
               tied_embeddings=c.get("tie_word_embeddings", True, bool), position="alibi", norm="layernorm",
               bias=True, glu=False, fused_qkv=True, embedding_norm=True)
    if c.data.get("seq_length") is not None:
        out["seq_len"] = c.get("seq_length")
    return out


def _opt(c: _Config) -> dict:
    # OPTDecoderLayer: q/k/v/out_proj, fc1/fc2 with enable_bias; OPTLearnedPositionalEmbedding
    # holds max_position_embeddings + 2 rows (offset 2). do_layer_norm_before false (OPT-350m):
    # post-LN blocks and no final_layer_norm; word_embed_proj_dim other than hidden_size: the
    # embedding and lm_head at that width, with project_in/project_out (OPTDecoder)
    c.refuse("_remove_final_layer_norm", bool, "no final LayerNorm")
    c.refuse("layer_norm_elementwise_affine", lambda v: v is False, "LayerNorms without weights")
    out = dict(c.heads(reads_head_dim=False), layers=c.get("num_hidden_layers"), vocab=c.get("vocab_size"),
               seq_len=c.get("max_position_embeddings"), ffn_hidden=c.get("ffn_dim"), position_offset=2,
               tied_embeddings=c.get("tie_word_embeddings", True, bool), position="learned", norm="layernorm",
               bias=c.get("enable_bias", True, bool), glu=False, fused_qkv=False)
    if not c.get("do_layer_norm_before", True, bool):
        out["post_layernorm"] = True
    proj = c.get("word_embed_proj_dim", out["hidden"])
    if proj != out["hidden"]:
        out["embed_proj_dim"] = proj
    return out


# DeepseekV2Config / DeepseekV3Config defaults for the keys zsim does not require
DEEPSEEK_DEFAULTS = {
    "deepseek_v2": dict(q_lora_rank=1536, n_routed_experts=64, n_shared_experts=2, first_k_dense_replace=0),
    "deepseek_v3": dict(q_lora_rank=1536, n_routed_experts=256, n_shared_experts=1, first_k_dense_replace=3,
                        num_experts_per_tok=8),
}


def _deepseek(c: _Config) -> dict:
    # DeepseekV2/V3: MLA attention; DeepseekV2MoE (gate, experts, shared_experts of
    # moe_intermediate_size x n_shared_experts) on layers >= first_k_dense_replace with
    # layer % moe_layer_freq == 0 (DeepSeek's own modeling code; transformers' ignores
    # moe_layer_freq, which every released config sets to 1). num_nextn_predict_layers (V3's
    # multi-token prediction) is not part of transformers' DeepseekV3ForCausalLM, so zsim does
    # not count it either. Keys left out take the configuration class's defaults
    # (DEEPSEEK_DEFAULTS: a config without q_lora_rank has q_a_proj/q_b_proj of 1536, one
    # without n_routed_experts 64 or 256 routed experts); an explicit null q_lora_rank is one
    # q_proj, a null n_routed_experts a dense MLP in every block (DeepSeek's own code).
    c.data = {**DEEPSEEK_DEFAULTS[c.model_type or ""], **c.data}     # what a config leaves out (null stays null)
    # DeepseekV2MLP's mlp_bias puts biases on the dense and shared-expert MLPs but not on the
    # routed experts (one fused tensor each), which zsim's model cannot say
    if c.model_type == "deepseek_v2":
        c.refuse("mlp_bias", bool, "biases on the dense and shared-expert MLPs only")
    out = dict(layers=c.get("num_hidden_layers"), hidden=c.get("hidden_size"), heads=c.get("num_attention_heads"),
               vocab=c.get("vocab_size"), seq_len=c.get("max_position_embeddings"),
               ffn_hidden=c.get("intermediate_size"), tied_embeddings=c.get("tie_word_embeddings", False, bool),
               position="rope", norm="rmsnorm", glu=True, fused_qkv=False, bias=False)
    if c.get("attention_bias", False, bool):
        out["attention_bias"] = True
    mla = dict(kv_lora_rank=c.get("kv_lora_rank"), qk_nope_head_dim=c.get("qk_nope_head_dim"),
               qk_rope_head_dim=c.get("qk_rope_head_dim"), v_head_dim=c.get("v_head_dim"))
    if c.data.get("q_lora_rank") is not None:
        mla["q_lora_rank"] = c.get("q_lora_rank")
    out["mla"] = mla
    if c.data.get("n_routed_experts") is not None:
        moe = _moe_fields(c, "n_routed_experts", "moe_intermediate_size")
        first = c.get("first_k_dense_replace") if c.data.get("first_k_dense_replace") else 0
        moe.update(first_dense_layers=first, layer_freq=c.get("moe_layer_freq", 1))
        if c.data.get("n_shared_experts"):
            moe["shared_experts"] = c.get("n_shared_experts")
        out["moe"] = moe
    return out


# JambaConfig's defaults (transformers 5.25 models/jamba/configuration_jamba.py) for the keys a
# config.json may leave out
JAMBA_DEFAULTS = dict(vocab_size=65536, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=262144, num_experts_per_tok=2, num_experts=16,
                      expert_layer_period=2, expert_layer_offset=1, attn_layer_period=8, attn_layer_offset=4,
                      mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank="auto", mamba_conv_bias=True,
                      mamba_proj_bias=False)


def _jamba(c: _Config) -> dict:
    # modeling_jamba.py: attention blocks (JambaAttention: q/k/v/o without bias, GQA, no position
    # encoding) where i % attn_layer_period == attn_layer_offset, JambaMambaMixer elsewhere; the
    # feed-forward a JambaSparseMoeBlock (router, experts of intermediate_size) where
    # i % expert_layer_period == expert_layer_offset and num_experts > 1, else a JambaMLP
    c.data = {**JAMBA_DEFAULTS, **{k: v for k, v in c.data.items() if v is not None}}
    hidden = c.get("hidden_size")
    dt_rank: int = -(-hidden // 16) if c.data["mamba_dt_rank"] == "auto" else c.get("mamba_dt_rank")
    periods = {}
    for period, offset in (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset")):
        n, at = c.get(period), c.data[offset]
        if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at < n:
            raise c.error(offset, at, f"expected an integer from 0 to {period} - 1 ({n - 1})")
        periods[period] = (n, at)
    out = dict(layers=c.get("num_hidden_layers"), hidden=hidden, heads=c.get("num_attention_heads"),
               kv_heads=c.get("num_key_value_heads"), vocab=c.get("vocab_size"),
               seq_len=c.get("max_position_embeddings"), ffn_hidden=c.get("intermediate_size"),
               tied_embeddings=c.get("tie_word_embeddings", kind=bool), position="none", norm="rmsnorm",
               glu=True, fused_qkv=False, bias=False)
    out["mamba"] = dict(d_state=c.get("mamba_d_state"), d_conv=c.get("mamba_d_conv"), expand=c.get("mamba_expand"),
                        dt_rank=dt_rank, conv_bias=c.get("mamba_conv_bias", kind=bool),
                        proj_bias=c.get("mamba_proj_bias", kind=bool),
                        attn_layer_period=periods["attn_layer_period"][0],
                        attn_layer_offset=periods["attn_layer_period"][1])
    if c.get("num_experts") > 1:
        freq, first = periods["expert_layer_period"]
        out["moe"] = dict(_moe_fields(c, "num_experts", None), layer_freq=freq, layer_offset=first)
    return out


READERS = {"llama": _llama, "mistral": _llama, "mixtral": _mixtral, "qwen2": _qwen2, "qwen2_moe": _qwen2_moe,
           "qwen3": _qwen3, "qwen3_moe": _qwen3_moe,
           "gemma": _gemma, "gemma2": _gemma2, "gemma3_text": _gemma3_text, "gpt_oss": _gpt_oss, "phi3": _phi3,
           "granite": _granite, "smollm3": _smollm3, "glm4": _glm4, "starcoder2": _starcoder2, "gpt2": _gpt2, "gpt_neox": _gpt_neox,
           "falcon": _falcon, "bloom": _bloom, "opt": _opt, "deepseek_v2": _deepseek, "deepseek_v3": _deepseek,
           "jamba": _jamba}
# encoder and encoder-decoder families: not decoder-only language models
NOT_DECODERS = {"bert", "roberta", "deberta", "deberta-v2", "distilbert", "albert", "electra", "xlm-roberta",
                "t5", "mt5", "bart", "mbart", "pegasus", "whisper", "vit", "clip", "mpnet", "longformer"}


def model_from_hf(data, name: str) -> dict:
    """The `model:` keys of a parsed config.json; `name` labels errors (the file)."""
    if not isinstance(data, dict):
        raise ZsimInputError(name, type(data).__name__, "a config.json is a JSON object")
    c = _Config(data, name)
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise c.error("model_type", model_type, "missing; a Hugging Face config.json names its model_type")
    if model_type in NOT_DECODERS:
        raise c.error("model_type", model_type, "not a decoder-only language model; zsim simulates causal LMs")
    if model_type not in READERS:
        raise c.error("model_type", model_type, f"not supported{did_you_mean(model_type, READERS)}; supported: "
                      f"{', '.join(sorted(READERS))}")
    archs = data.get("architectures")
    if isinstance(archs, list) and archs and not any(
            isinstance(a, str) and a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise c.error("architectures", archs, "no *ForCausalLM (or *LMHeadModel) head; zsim simulates causal LMs")
    # a quantization_config (DeepSeek-V3/R1's fp8 blocks) describes how the checkpoint is stored,
    # not the model's shapes: training loads it in the run's precision (read_hf_config notes it)
    quant = data.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise c.error("quantization_config", quant, "expected a mapping (transformers' quantization config)")
    return READERS[model_type](c)


def preset_names() -> list[str]:
    """Every model preset: zsim.specs.model.PRESETS and the config.json files in scenarios/models/."""
    return sorted([*PRESETS, *model_files()])


def preset_model(name: str) -> dict:
    """The `model:` keys of a shipped config.json preset."""
    return read_hf_config(model_files()[name], "model.preset")


def read_hf_config(path: Path, field: str = "model.hf_config", notes: list | None = None) -> dict:
    """The `model:` keys of the config.json at `path`; what it reads differently from the file's
    own words (a quantization_config) is appended to `notes`."""
    data = parse_json(read_text(path, field, "a Hugging Face config.json"), field, str(path))
    model = model_from_hf(data, path.name)
    quant = data.get("quantization_config")
    if notes is not None and isinstance(quant, dict):
        method = quant.get("quant_method", "quantized")
        fmt = quant.get("fmt") or quant.get("bits")
        if method == "bitsandbytes":
            four = quant.get("load_in_4bit") or quant.get("_load_in_4bit")
            what = quant.get("bnb_4bit_quant_type", "fp4") if four else "int8"
            double = " training.double_quant=true" if four and quant.get("bnb_4bit_use_double_quant") else ""
            notes.append(f"{path.name}: quantization_config (bitsandbytes {what}) is read as the model's shapes only; "
                         f"to simulate its quantized base weights under LoRA, --set training.quantization={what}{double}")
        else:
            notes.append(f"{path.name}: quantization_config ({method}{f' {fmt}' if fmt else ''} weights) is the "
                         "checkpoint's storage; the run trains in its own precision (training.precision), as "
                         "DeepSpeed trains the dequantized 16-bit weights")
    return model
