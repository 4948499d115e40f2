"""zsim's model definition from a Hugging Face config.json against transformers' own
(zsim/config/hf_config.py, zsim/workload/transformer.py, zsim/workload/lora.py).

Every expected figure is a literal measured outside this repository (transformers is not a zsim
dependency, so nothing here imports it): transformers 5.23.0 AutoModelForCausalLM.from_config on
the meta device,

    with torch.device("meta"): model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    total = sum(p.numel() for p in model.parameters())            # a tied lm_head counted once

per decoder block the parameters under `model.layers.{i}` (`transformer.h.{i}`, `gpt_neox.layers.{i}`,
...), and tying as `model.get_output_embeddings().weight is model.get_input_embeddings().weight`.
LoRA figures: peft 0.21.2 get_peft_model(model, LoraConfig(r=8, target_modules=...)), the
parameters with requires_grad. The configs are the shape-giving fields of each public model's
config.json (keys that shape no parameter, rope_theta, eps, token ids, left out), and 2-layer,
64-wide variants of them.
"""
from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, scenario
from zsim.config.hf_config import model_from_hf
from zsim.errors import ZsimInputError
from zsim.schedule.build import workload_for
from zsim.schema import build
from zsim.specs.model import ModelSpec
from zsim.workload.lora import trainable_params
from zsim.workload.transformer import build_workload

MODELS = ROOT / "scenarios" / "models"


def _shipped(name: str) -> dict:
    return json.loads((MODELS / f"{name}.json").read_text())


def _workload(config: dict, **model):
    return build_workload(build(ModelSpec, {**model_from_hf(config, "config.json"), **model}, "model"),
                          1, 16, "bf16", True, False)


def _per_layer(wl) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in wl.params:
        if p.name.startswith("layers."):
            i = int(p.name.split(".")[1])
            out[i] = out.get(i, 0) + p.numel
    return out


def _tied(wl) -> bool:
    by_name = {m.name: m for m in wl.modules}
    return by_name["lm_head"].params[0] == by_name["wte"].params[0]


def _llama(**k):
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, vocab_size=32000, max_position_embeddings=4096,
                tie_word_embeddings=False) | k


QWEN15_MOE = dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=2048,
                  num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, intermediate_size=5632,
                  moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
                  num_experts_per_tok=4, decoder_sparse_step=1, vocab_size=151936, max_position_embeddings=8192,
                  mlp_only_layers=[], tie_word_embeddings=False, use_sliding_window=False)
QWEN3_8B = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=4096, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936,
                max_position_embeddings=40960, tie_word_embeddings=False, attention_bias=False,
                use_sliding_window=False)
QWEN3_30B = dict(QWEN3_8B, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, intermediate_size=6144,
                 moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                 mlp_only_layers=[])
GPT2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=768, n_layer=12, n_head=12, n_positions=1024,
            vocab_size=50257)
PYTHIA_160M = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=768, num_hidden_layers=12,
                   num_attention_heads=12, intermediate_size=3072, vocab_size=50304, max_position_embeddings=2048,
                   rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False)
FALCON_7B = dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=4544, num_hidden_layers=32,
                 num_attention_heads=71, vocab_size=65024, multi_query=True, parallel_attn=True, bias=False,
                 alibi=False, new_decoder_architecture=False)
FALCON_40B = dict(FALCON_7B, hidden_size=8192, num_hidden_layers=60, num_attention_heads=128, num_kv_heads=8,
                  new_decoder_architecture=True)
BLOOM_176B = dict(model_type="bloom", architectures=["BloomForCausalLM"], hidden_size=14336, n_layer=70, n_head=112,
                  vocab_size=250880, seq_length=2048)
OPT_1B3 = dict(model_type="opt", architectures=["OPTForCausalLM"], hidden_size=2048, num_hidden_layers=24,
               num_attention_heads=32, ffn_dim=8192, vocab_size=50272, max_position_embeddings=2048,
               do_layer_norm_before=True, word_embed_proj_dim=2048)
OPT_350M = dict(OPT_1B3, hidden_size=1024, num_attention_heads=16, ffn_dim=4096, do_layer_norm_before=False,
                word_embed_proj_dim=512)

# public models: (config, total, {block: its parameters}, lm_head tied to the embedding)
REAL = {
    "Llama-2-7b": (_llama(), 6_738_415_616, {0: 202_383_360}, False),
    "Meta-Llama-3-8B": (_llama(intermediate_size=14336, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=8192), 8_030_261_248, {0: 218_112_000}, False),
    "Llama-3.2-1B": (_llama(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_key_value_heads=8,
                            vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=True, head_dim=64),
                     1_235_814_400, {0: 60_821_504}, True),
    "Mistral-7B-v0.1": (_shipped("mistral-7b"), 7_241_732_096, {0: 218_112_000}, False),
    "Mistral-Nemo-Base-2407": (dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=5120,
                                    head_dim=128, intermediate_size=14336, num_hidden_layers=40,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=131072,
                                    max_position_embeddings=1024000, sliding_window=None),
                               12_247_782_400, {0: 272_640_000}, False),
    "Mixtral-8x7B-v0.1": (_shipped("mixtral-8x7b"), 46_702_792_704, {0: 1_451_270_144}, False),
    "Qwen2-7B": (_shipped("qwen2-7b"), 7_615_616_512, {0: 233_057_792}, False),
    "Qwen2-72B": (_shipped("qwen2-72b"), 72_706_203_648, {0: 877_684_736}, False),
    "Qwen2-0.5B": (dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896,
                        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                        vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                        use_sliding_window=False, sliding_window=32768), 494_032_768, {0: 14_912_384}, True),
    "Qwen1.5-MoE-A2.7B": (QWEN15_MOE, 14_315_784_192, {0: 570_560_512}, False),
    "Qwen3-8B": (QWEN3_8B, 8_190_735_360, {0: 192_946_432}, False),
    "Qwen3-0.6B": (dict(QWEN3_8B, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                        intermediate_size=3072, tie_word_embeddings=True), 596_049_920, {0: 15_730_944}, True),
    "Qwen3-30B-A3B": (QWEN3_30B, 30_532_122_624, {0: 623_120_640}, False),
    "gemma-7b": (_shipped("gemma-7b"), 8_537_680_896, {0: 276_830_208}, True),
    "gemma-2b": (dict(model_type="gemma", architectures=["GemmaForCausalLM"], hidden_size=2048,
                      intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1,
                      head_dim=256, vocab_size=256000, max_position_embeddings=8192),
                 2_506_172_416, {0: 110_104_576}, True),
    "gemma-2-9b": (dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_size=3584,
                        num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                        intermediate_size=14336, vocab_size=256000, max_position_embeddings=8192, sliding_window=4096),
                   9_241_705_984, {0: 198_195_200}, True),
    "gemma-2-2b": (dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_size=2304,
                        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        intermediate_size=9216, vocab_size=256000, max_position_embeddings=8192, sliding_window=4096),
                   2_614_341_888, {0: 77_865_984}, True),
    "Phi-3-mini-4k-instruct": (_shipped("phi3-mini"), 3_821_079_552, {0: 113_252_352}, False),
    "Phi-3-medium-4k-instruct": (dict(model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=5120,
                                      intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40,
                                      num_key_value_heads=10, vocab_size=32064, max_position_embeddings=4096,
                                      sliding_window=2047), 13_960_238_080, {0: 340_797_440}, False),
    "gpt2": (GPT2, 124_439_808, {0: 7_087_872}, True),
    "gpt2-xl": (dict(GPT2, n_embd=1600, n_layer=48, n_head=25), 1_557_611_200, {0: 30_740_800}, True),
    "pythia-160m": (PYTHIA_160M, 162_322_944, {0: 7_087_872}, False),
    "gpt-neox-20b": (dict(PYTHIA_160M, hidden_size=6144, num_hidden_layers=44, num_attention_heads=64,
                          intermediate_size=24576, vocab_size=50432), 20_554_567_680, {0: 453_064_704}, False),
    "falcon-7b": (FALCON_7B, 6_921_720_704, {0: 207_070_080}, True),
    "falcon-40b": (FALCON_40B, 41_303_293_952, {0: 679_510_016}, True),
    "falcon-rw-1b": (dict(FALCON_7B, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                          vocab_size=50304, multi_query=False, parallel_attn=False, bias=True, alibi=True),
                     1_311_625_216, {0: 50_358_272}, True),
    "bloom": (BLOOM_176B, 176_247_271_424, {0: 2_466_437_120}, True),
    "opt-1.3b": (OPT_1B3, 1_315_758_080, {0: 50_358_272}, True),
    "opt-350m": (OPT_350M, 331_196_416, {0: 12_596_224}, True),
    # layer 0 dense (first_k_dense_replace), later ones MoE
    "DeepSeek-V2-Lite": (_shipped("deepseek-v2-lite"), 15_706_484_224, {0: 81_007_104, 1: 584_847_872, 26: 584_847_872},
                         False),
    "DeepSeek-V3": (_shipped("deepseek-v3"), 671_026_404_352,
                    {0: 583_483_392, 2: 583_483_392, 3: 11_507_286_016}, False),
    # Mamba mixers with a dense MLP (0), with the MoE block (1), attention with a dense MLP (4):
    # transformers 5.25.0's JambaForCausalLM, the config.json's keys as the catalogue keeps them
    # (the rest JambaConfig's defaults)
    "Jamba-v0.1": (dict(model_type="jamba", architectures=["JambaForCausalLM"], attn_layer_offset=4,
                        attn_layer_period=8, expert_layer_offset=1, expert_layer_period=2, hidden_size=4096,
                        mamba_d_conv=4, mamba_d_state=16, mamba_expand=2, max_position_embeddings=262144,
                        num_attention_heads=32, num_experts=16, num_experts_per_tok=2, num_hidden_layers=32,
                        num_key_value_heads=8, vocab_size=65536),
                   51_570_323_328, {0: 281_477_408, 1: 2_923_954_464, 4: 218_112_000, 5: 2_923_954_464}, False),
}
# kinds of block, where more than the dense/MoE two
BLOCK_KINDS = {"Jamba-v0.1": 3}


@pytest.mark.parametrize("name", sorted(REAL))
def test_public_config_counts_what_transformers_builds(name):
    config, total, layers, tied = REAL[name]
    more = 0
    if name == "DeepSeek-V3":
        # 3 dense blocks and 58 alike MoE blocks of 256 experts: 4 blocks built (a second's work
        # less), the other 57 counted as the fourth
        config, more = config | {"num_hidden_layers": 4}, 57
    # BLOOM has no position table: the sequence length is the scenario's, and shapes nothing
    wl = _workload(config, **({"seq_len": 2048} if config["model_type"] == "bloom" else {}))
    per_layer = _per_layer(wl)
    assert wl.n_params + more * per_layer[max(per_layer)] == total
    assert {i: per_layer[i] for i in layers} == layers
    assert len(set(per_layer.values())) == BLOCK_KINDS.get(name, 2 if "n_routed_experts" in config else 1)
    assert _tied(wl) is tied


def test_bloom_560m_with_the_sequence_length_given_beside():
    # bigscience/bloom-560m (no seq_length in its config.json): 559,214,592
    config = dict(model_type="bloom", architectures=["BloomForCausalLM"], hidden_size=1024, n_layer=24, n_head=16,
                  vocab_size=250880)
    assert _workload(config, seq_len=2048).n_params == 559_214_592


# 2-layer, 64-wide variants: the weights of block 0 (sorted numels; zsim names the modules its own way)
TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, vocab_size=1000, max_position_embeddings=128,
                  tie_word_embeddings=False)
TINY_MISTRAL = dict(TINY_LLAMA, model_type="mistral", architectures=["MistralForCausalLM"], num_key_value_heads=2,
                    sliding_window=32)
TINY_MIXTRAL = dict(TINY_MISTRAL, model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=None)
TINY_QWEN2 = dict(TINY_LLAMA, model_type="qwen2", architectures=["Qwen2ForCausalLM"], num_key_value_heads=4,
                  use_sliding_window=False)
TINY_QWEN2_MOE = dict(TINY_QWEN2, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], num_key_value_heads=2,
                      moe_intermediate_size=48, shared_expert_intermediate_size=128, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
TINY_QWEN3 = dict(TINY_LLAMA, model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_key_value_heads=2,
                  head_dim=16, attention_bias=False, use_sliding_window=False)
TINY_QWEN3_MOE = dict(TINY_QWEN3, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_key_value_heads=4,
                      head_dim=32, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[])
TINY_GEMMA = dict({k: v for k, v in TINY_LLAMA.items() if k != "tie_word_embeddings"}, model_type="gemma",
                  architectures=["GemmaForCausalLM"], num_key_value_heads=2, head_dim=32)     # tied by default
TINY_GEMMA2 = dict(TINY_GEMMA, model_type="gemma2", architectures=["Gemma2ForCausalLM"], sliding_window=32)
# Phi3Config's default pad_token_id (32000) must be a row of the 1000-word embedding
TINY_PHI3 = dict(TINY_MISTRAL, model_type="phi3", architectures=["Phi3ForCausalLM"], pad_token_id=None)
TINY_GPT2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=2, n_head=4, n_positions=128,
                 vocab_size=1000)
TINY_NEOX = dict(model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"], hidden_size=64, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=128, vocab_size=1000, max_position_embeddings=128,
                 tie_word_embeddings=False)
TINY_FALCON = dict(model_type="falcon", architectures=["FalconForCausalLM"], hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, vocab_size=1000, max_position_embeddings=128, multi_query=True,
                   parallel_attn=True, bias=False, alibi=False, new_decoder_architecture=False)
TINY_FALCON_NEW = dict(TINY_FALCON, num_kv_heads=2, new_decoder_architecture=True)
TINY_BLOOM = dict(model_type="bloom", architectures=["BloomForCausalLM"], hidden_size=64, n_layer=2, n_head=4,
                  vocab_size=1000, seq_length=2048)
TINY_OPT = dict(model_type="opt", architectures=["OPTForCausalLM"], hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, ffn_dim=128, vocab_size=1000, max_position_embeddings=128,
                do_layer_norm_before=True, word_embed_proj_dim=64)
TINY_OPT_350M = dict(TINY_OPT, do_layer_norm_before=False, word_embed_proj_dim=32)
TINY_DSV2 = dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], hidden_size=64,
                 intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=1000,
                 max_position_embeddings=128, tie_word_embeddings=False, kv_lora_rank=16, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=None, first_k_dense_replace=1, moe_layer_freq=1,
                 n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2, moe_intermediate_size=48)
TINY_DSV3 = dict(TINY_DSV2, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], q_lora_rank=24,
                 n_shared_experts=1, num_nextn_predict_layers=1)

TINY = {   # name: (config, total, block 0's sorted weight numels or its total)
    "llama": (TINY_LLAMA, 210_240, [64, 64, 4096, 4096, 4096, 4096, 8192, 8192, 8192]),
    "mistral": (TINY_MISTRAL, 202_048, 36_992),
    "mixtral": (TINY_MIXTRAL, 350_016, 110_976),
    "qwen2": (TINY_QWEN2, 210_624, 41_280),
    "qwen2_moe": (TINY_QWEN2_MOE, 276_672, 74_304),
    "qwen3": (TINY_QWEN3, 202_112, [16, 16, 64, 64, 2048, 2048, 4096, 4096, 8192, 8192, 8192]),
    "qwen3_moe": (TINY_QWEN3_MOE, 268_224, 70_080),
    "gemma": (TINY_GEMMA, 162_624, 49_280),
    "gemma2": (TINY_GEMMA2, 162_880, [64, 64, 64, 64, 4096, 4096, 8192, 8192, 8192, 8192, 8192]),
    "phi3": (TINY_PHI3, 202_048, 36_992),
    "gpt2": (TINY_GPT2, 172_288, [64, 64, 64, 64, 64, 64, 192, 256, 4096, 12288, 16384, 16384]),
    "gpt_neox": (TINY_NEOX, 195_072, 33_472),
    "falcon": (TINY_FALCON, 150_400, 43_136),
    "falcon new_decoder_architecture": (TINY_FALCON_NEW, 154_752, [64, 64, 64, 64, 4096, 8192, 16384, 16384]),
    "bloom": (TINY_BLOOM, 164_224, 49_984),
    "opt": (TINY_OPT, 139_392, 33_472),
    "opt post-LN, word_embed_proj_dim": (TINY_OPT_350M, 111_360,
                                         [64, 64, 64, 64, 64, 64, 64, 64, 64, 128, 4096, 4096, 4096, 4096, 8192, 8192]),
    "deepseek_v2": (TINY_DSV2, 305_648, 38_544),
    "deepseek_v3": (TINY_DSV3, 280_376, 36_264),
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_variant_counts_what_transformers_builds(name):
    config, total, block0 = TINY[name]
    wl = _workload(config)
    assert wl.n_params == total
    if isinstance(block0, list):
        assert sorted(p.numel for p in wl.params if p.name.startswith("layers.0.")) == block0
    else:
        assert _per_layer(wl)[0] == block0


# Keys and defaults where zsim differed from transformers 5.23.0 before (each figure measured
# as above); the comment names what transformers does
OPTIONS = {
    # LlamaAttention/LlamaMLP read attention_bias and mlp_bias
    "llama attention_bias, mlp_bias": (dict(TINY_LLAMA, attention_bias=True, mlp_bias=True), 211_392),
    # Mistral, Mixtral, Qwen2, Phi-3 hard-code bias=False (Qwen2's q/k/v biases are its own): the keys change nothing
    "mistral ignores the bias keys": (dict(TINY_MISTRAL, attention_bias=True, mlp_bias=True), 202_048),
    "mixtral ignores the bias keys": (dict(TINY_MIXTRAL, attention_bias=True, mlp_bias=True), 350_016),
    "qwen2 ignores the bias keys": (dict(TINY_QWEN2, attention_bias=True, mlp_bias=True), 210_624),
    "qwen2_moe ignores the bias keys": (dict(TINY_QWEN2_MOE, attention_bias=True, mlp_bias=True), 276_672),
    "phi3 ignores the bias keys": (dict(TINY_PHI3, attention_bias=True, mlp_bias=True), 202_048),
    # Gemma, Gemma-2, Qwen3 read attention_bias only
    "gemma attention_bias, mlp_bias ignored": (dict(TINY_GEMMA, attention_bias=True, mlp_bias=True), 163_264),
    "qwen3 attention_bias, mlp_bias ignored": (dict(TINY_QWEN3, attention_bias=True, mlp_bias=True), 202_496),
    # Qwen2MoeConfig.qkv_bias (default true) puts the q/k/v biases on or off
    "qwen2_moe qkv_bias false": (dict(TINY_QWEN2_MOE, qkv_bias=False), 276_416),
    # Qwen3Config.head_dim defaults to 128, not hidden / heads
    "qwen3 without head_dim": ({k: v for k, v in TINY_QWEN3.items() if k != "head_dim"}, 374_592),
    # Qwen2Config.num_key_value_heads defaults to 32 (Qwen2-72B's 64 heads then have 32 K/V heads)
    "qwen2-72b without num_key_value_heads": (
        {k: v for k, v in _shipped("qwen2-72b").items() if k != "num_key_value_heads"}, 76_733_227_008),
    # GPT-2, GPT-NeoX, OPT: head_dim = hidden // heads whatever the config says
    "gpt2 ignores head_dim": (dict(TINY_GPT2, head_dim=32), 172_288),
    "gpt_neox ignores head_dim": (dict(TINY_NEOX, head_dim=32), 195_072),
    "opt ignores head_dim": (dict(TINY_OPT, head_dim=32), 139_392),
    # FalconConfig's booleans are `bool | None`; FalconDecoderLayer/FalconAttention test them for truth
    "falcon multi_query null": (dict(TINY_FALCON, multi_query=None), 162_688),
    "falcon parallel_attn null": (dict(TINY_FALCON, parallel_attn=None), 150_656),
    # attribute_map aliases and the legacy n_embed
    "falcon n_embed": ({**{k: v for k, v in TINY_FALCON.items() if k != "hidden_size"}, "n_embed": 64}, 150_400),
    "mixtral num_experts": ({**{k: v for k, v in TINY_MIXTRAL.items() if k != "num_local_experts"},
                             "num_experts": 6}, 448_576),
    # decoder_sparse_step 2: block 1 MoE, block 0 a gated MLP of intermediate_size ((i + 1) % step == 0)
    "qwen2_moe decoder_sparse_step 2": (dict(TINY_QWEN2_MOE, decoder_sparse_step=2), 239_488),
    "qwen3_moe decoder_sparse_step 2": (dict(TINY_QWEN3_MOE, decoder_sparse_step=2), 255_680),
    "qwen3_moe num_local_experts (as transformers 5 saves it)": (
        {**{k: v for k, v in TINY_QWEN3_MOE.items() if k != "num_experts"}, "num_local_experts": 6}, 305_344),
    "gpt2 common names": (dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], hidden_size=64,
                               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                               vocab_size=1000), 172_288),
    "bloom common names": ({**{k: v for k, v in TINY_BLOOM.items() if k not in ("n_layer", "n_head")},
                            "num_hidden_layers": 2, "num_attention_heads": 4}, 164_224),
    "bloom n_embed": ({**{k: v for k, v in TINY_BLOOM.items() if k != "hidden_size"}, "n_embed": 64}, 164_224),
    "deepseek_v2 num_experts": ({**{k: v for k, v in TINY_DSV2.items() if k != "n_routed_experts"},
                                 "num_experts": 4}, 305_648),
    "deepseek_v3 num_local_experts": ({**{k: v for k, v in TINY_DSV3.items() if k != "n_routed_experts"},
                                       "num_local_experts": 4}, 280_376),
    # DeepseekV2Config/V3Config defaults: q_lora_rank 1536 (null: one q_proj), n_routed_experts 64 / 256,
    # n_shared_experts 2 / 1, first_k_dense_replace 0 / 3
    "deepseek_v2 without q_lora_rank": ({k: v for k, v in TINY_DSV2.items() if k != "q_lora_rank"}, 1_029_104),
    "deepseek_v2 without n_routed_experts": ({k: v for k, v in TINY_DSV2.items() if k != "n_routed_experts"},
                                             1_419_248),
    "deepseek_v3 without first_k_dense_replace, n_shared_experts": (
        {k: v for k, v in TINY_DSV3.items() if k not in ("first_k_dense_replace", "n_shared_experts")}, 236_856),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_options_and_defaults_count_what_transformers_builds(name):
    config, total = OPTIONS[name]
    assert _workload(config).n_params == total


@pytest.mark.parametrize("config,key", [
    # MistralConfig's default of 8 K/V heads does not divide 4 heads (transformers builds it, then fails)
    ({k: v for k, v in TINY_MISTRAL.items() if k != "num_key_value_heads"}, "num_key_value_heads"),
    (dict(TINY_FALCON, num_ln_in_parallel_attn=3), "num_ln_in_parallel_attn"),
    # biases on the dense and shared-expert MLPs but not on the routed experts (306,480 in transformers)
    (dict(TINY_DSV2, mlp_bias=True), "mlp_bias"),
    (dict(TINY_GPT2, n_head=5), "n_head"),
    ({**{k: v for k, v in TINY_QWEN3_MOE.items() if k != "num_experts"}, "num_local_experts": "8"},
     "num_local_experts"),
])
def test_configs_zsim_cannot_build_are_refused_in_one_line(config, key):
    with pytest.raises(ZsimInputError) as err:
        _workload(config)
    assert key in err.value.field and "\n" not in str(err.value)


# peft 0.21.2 trainable parameters, r=8 (target_modules None: PEFT's default for the model_type)
LORA = [
    ("Llama-2-7b", None, 4_194_304),
    ("Llama-2-7b", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 19_988_480),
    ("Llama-2-7b", "all-linear", 19_988_480),
    ("Meta-Llama-3-8B", ["q_proj", "k_proj", "v_proj", "o_proj"], 6_815_744),
    ("Mistral-7B-v0.1", "all-linear", 20_971_520),
    ("Qwen2-7B", None, 2_523_136),
    ("Qwen2-7B", "all-linear", 20_185_088),
    ("Qwen3-8B", "all-linear", 21_823_488),
    ("gemma-7b", "all-linear", 25_001_984),
    ("Phi-3-mini-4k-instruct", ["qkv_proj"], 3_145_728),
    ("Phi-3-mini-4k-instruct", "all-linear", 12_582_912),
    ("gpt2", None, 294_912),
    ("gpt2", ["c_attn", "c_proj", "c_fc"], 1_179_648),
    ("pythia-160m", ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], 1_179_648),
    ("falcon-7b", ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], 16_318_464),
    ("falcon-40b", "all-linear", 55_541_760),
    ("opt-1.3b", ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"], 7_077_888),
    ("opt-350m", "all-linear", 3_563_520),   # project_in and project_out are linears too
    # MoE models: the attention and the dense companions (transformers 5 stores the routed experts
    # as fused 3-D parameters, which PEFT adapts only through target_parameters)
    ("Mixtral-8x7B-v0.1", ["q_proj", "k_proj", "v_proj", "o_proj"], 6_815_744),
    ("Qwen1.5-MoE-A2.7B", ["shared_expert_gate"], 393_408),
]


@pytest.mark.parametrize("name,targets,trainable", LORA, ids=[f"{n}-{t}" for n, t, _ in LORA])
def test_lora_trainable_parameters_are_pefts(name, targets, trainable):
    config = REAL[name][0]
    sc = scenario(**{"model": model_from_hf(config, "config.json"), "training.seq_len": 64,
                     "training.lora": {"rank": 8, "target_modules": targets}})
    assert trainable_params(workload_for(sc)) == trainable


def test_down_proj_reaches_every_gated_mlp_as_gate_proj_does():
    # down_proj reaches the shared expert's down projection wherever gate_proj reaches its gate
    # projection (a Qwen-MoE block has no dense mlp.fc_out, where down_proj matched nothing); the
    # routed experts are 3D parameters PEFT's target_modules does not reach (see [Note:
    # transformers 5 MoE experts]). Each of the three adds (hidden + width) x r per MLP.
    def trainable(targets):
        sc = scenario(**{"model": model_from_hf(TINY_QWEN2_MOE, "config.json"), "training.seq_len": 64,
                         "training.lora": {"rank": 8, "target_modules": targets}})
        return trainable_params(workload_for(sc))
    gate = trainable(["gate_proj"])
    assert trainable(["down_proj"]) == gate and trainable(["gate_proj", "up_proj", "down_proj"]) == 3 * gate
