"""The scenario as frozen dataclasses: model, cluster, training and DeepSpeed config.

zsim.config.scenario builds one from YAML (strict, with DeepSpeed's batch and precision
rules); everything downstream reads only these types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, get_args

from zsim.schema import spec
from zsim.specs.generation import GenerationSpec
from zsim.specs.rlhf import RlhfSpec
from zsim.specs.deepspeed import MAX_GRADIENT_ACCUMULATION_STEPS, MAX_MICRO_BATCH_SIZE, DeepSpeedConfig
from zsim.specs.hardware import Cluster
from zsim.specs.model import MAX_SEQ_LEN, ModelSpec
from zsim.specs.parallelism import ParallelismSpec


# The largest training clusters built (2025) hold ~100k-200k GPUs; 2**18 = 262,144 covers them.
# zsim simulates one rank, but ZeRO-1/2 gradient buckets are cut at every rank's partition
# boundary (one piece per rank), so the schedule grows with the world size.
MAX_WORLD_SIZE = 2**18


@dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    profile: str = spec()
    nodes: int = spec(1, gt=0, le=MAX_WORLD_SIZE)
    gpus_per_node: Optional[int] = spec(None, gt=0, le=MAX_WORLD_SIZE, doc="default: the profile's")
    override: dict[str, Any] = spec(factory=dict, doc="profile fields to override, nested like the profile")


# PEFT's LoraConfig defaults (peft/tuners/lora/config.py): r=8, lora_alpha=8, lora_dropout=0.0
PEFT_DEFAULT_RANK = 8


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """PEFT LoraConfig vocabulary; zsim/workload/lora.py maps the names onto zsim's modules."""
    rank: int = spec(PEFT_DEFAULT_RANK, gt=0, alias="r", doc="PEFT r: the adapters' inner dimension")
    alpha: float = spec(float(PEFT_DEFAULT_RANK), gt=0, alias="lora_alpha",
                        doc="PEFT lora_alpha (the alpha/r scaling: no cost of its own)")
    dropout: float = spec(0.0, ge=0, le=1, alias="lora_dropout",
                          doc="PEFT lora_dropout: > 0 stores the dropped input of every lora_A")
    target_modules: Any = spec(None, doc="module-name suffixes (PEFT's or zsim's) or 'all-linear'; "
                                         "default PEFT's for the model: q_proj, v_proj (a fused qkv: the qkv)")
    modules_to_save: tuple[str, ...] = spec((), doc="modules trained in full (PEFT ModulesToSaveWrapper: "
                                                    "a trainable copy next to the frozen original)")

    def __post_init__(self):
        t = self.target_modules
        if t is None or t == "all-linear":
            return
        if isinstance(t, str):
            object.__setattr__(self, "target_modules", (t,))
        elif isinstance(t, (list, tuple)) and t and all(isinstance(x, str) and x for x in t):
            object.__setattr__(self, "target_modules", tuple(t))
        else:
            raise ValueError("target_modules", t, "expected a list of module names (e.g. [q_proj, v_proj]) "
                                                  "or 'all-linear'")


# LLaMA-Factory's FinetuningArguments defaults (hparams/finetuning_args.py FreezeArguments)
LF_FREEZE_TRAINABLE_LAYERS = 2


@dataclass(frozen=True, kw_only=True)
class FreezeSpec:
    """LLaMA-Factory's freeze tuning (finetuning_type: freeze; model/adapter.py _setup_freeze_tuning):
    the blocks it names train in full, everything else is frozen (zsim/workload/lora.py resolves it
    against the model's layer count)."""
    trainable_layers: int = spec(LF_FREEZE_TRAINABLE_LAYERS, doc="freeze_trainable_layers: the last N blocks "
                                 "train (a negative N: the first -N); with llama_pro, N blocks evenly spaced")
    trainable_modules: tuple[str, ...] = spec(("all",), doc="freeze_trainable_modules: the sub-modules of those "
                                              "blocks that train, by HF name (self_attn, mlp, input_layernorm, "
                                              "post_attention_layernorm) or all")
    extra_modules: tuple[str, ...] = spec((), doc="freeze_extra_modules: modules outside the blocks that train "
                                          "too (embed_tokens, norm, lm_head)")
    llama_pro: bool = spec(False, doc="use_llama_pro: the trainable blocks are every (layers/N)-th, the ones "
                                      "LLaMA-Pro's expansion added")

    def __post_init__(self):
        if self.trainable_layers == 0:
            raise ValueError("trainable_layers", 0, "trains no block; give the number of blocks to train")


# the preference losses zsim models, by the trainer's name (TRL DPOTrainer loss_type sigmoid/ipo,
# ORPOTrainer, CPOTrainer with loss_type simpo)
PreferenceMethod = Literal["dpo", "ipo", "orpo", "simpo", "reward"]
REFERENCE_FREE = ("orpo", "simpo", "reward")


@dataclass(frozen=True, kw_only=True)
class PreferenceSpec:
    """Preference training on chosen and rejected sequences (TRL's DPOTrainer and its kin; see
    [Note: preference training] in zsim/workload/preference.py)."""
    method: PreferenceMethod = spec("dpo", doc="dpo or ipo (TRL DPOTrainer: a reference model's log-probs in "
                                               "the loss), orpo or simpo (reference-free), reward (a reward "
                                               "model's Bradley-Terry loss on the pair's scores; "
                                               "see [Note: reward model heads])")
    reward_head: Literal["score", "value_head"] = spec(
        "score", doc="with method reward: score (AutoModelForSequenceClassification: a Linear hidden -> 1 "
                     "in place of lm_head; TRL RewardTrainer, axolotl reward_model) or value_head (TRL's "
                     "AutoModelForCausalLMWithValueHead: lm_head still runs, its logits unused, and a v_head "
                     "Linear hidden -> 1; LLaMA-Factory stage rm)")
    reference: Optional[bool] = spec(None, doc="whether each step runs the reference model's forward (no grad); "
                                               "default: true for dpo and ipo, false for orpo and simpo; false "
                                               "for DPO with precompute_ref_log_probs")
    pair: Literal["batch", "sequence"] = spec(
        "batch", doc="where the chosen and rejected completions go: batch (TRL's concatenated_forward: 2 x "
                     "micro-batch rows of seq_len), sequence (LLaMA-Factory v1: both in one row of seq_len, told "
                     "apart by token_type_ids)")

    @property
    def runs_reference(self) -> bool:
        return self.method not in REFERENCE_FREE if self.reference is None else self.reference


# HF's attn_implementation values (TrainingSpec.attn_implementation) and the elementwise kernels
AttnImplementation = Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3"]
Kernels = Literal["hf", "fused"]

# bitsandbytes storage of the frozen base linears (TrainingSpec.quantization; zsim/workload/quant.py)
Quantization = Literal["none", "nf4", "fp4", "int8"]

# what runs the training loop (TrainingSpec.framework; tune's --framework)
Framework = Literal["hf_trainer", "deepspeed", "megatron_deepspeed"]
FRAMEWORKS = get_args(Framework)


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    micro_batch_size: Optional[int] = spec(None, gt=0, le=MAX_MICRO_BATCH_SIZE)
    gradient_accumulation_steps: Optional[int] = spec(None, gt=0, le=MAX_GRADIENT_ACCUMULATION_STEPS)
    seq_len: Optional[int] = spec(None, gt=0, le=MAX_SEQ_LEN, doc="default: model.seq_len")
    precision: Optional[Literal["fp32", "fp16", "bf16"]] = spec(None, doc="default: from the ds_config fp16/bf16 blocks")
    activation_checkpointing: Literal["none", "full", "selective"] = spec("none")
    flash_attention: bool = spec(True, doc="an IO-aware attention kernel that keeps no s^2 scores (false: eager "
                                           "attention); attn_implementation names which")
    attn_implementation: Optional[AttnImplementation] = spec(
        None, doc="the attention HF's from_pretrained(attn_implementation=...) selects: eager, sdpa (torch's "
                  "scaled_dot_product_attention: its flash backend, or with padding_mask its memory-efficient "
                  "backend over the full square), flash_attention_2, flash_attention_3 (priced at the profile's "
                  "FlashAttention figures); default: sdpa under framework hf_trainer (from_pretrained's default), "
                  "else flash_attention_2, eager when flash_attention is false")
    kernels: Optional[Kernels] = spec(
        None, doc="the elementwise kernels the model code runs: hf (transformers' modeling code, op by op: "
                  "RMSNorm upcast to fp32, RoPE by rotate_half, SiLU then mul, repeat_kv), fused (one pass per "
                  "norm, RoPE and activation: Megatron-LM's, llm-foundry's and Liger's fused kernels); default: "
                  "hf under framework hf_trainer, else fused")
    padding_mask: bool = spec(False, doc="the batch carries an attention_mask with padding (tokenizer "
                                         "padding='max_length'): every position is still computed; under sdpa "
                                         "the mask sends attention to the memory-efficient backend, which "
                                         "computes the full square (no causal skip) and needs repeat_kv "
                                         "(see [Note: SDPA with a padding mask])")
    tf32: bool = spec(False, doc="fp32 matmuls on tensor cores (torch.backends.cuda.matmul.allow_tf32, HF --tf32); "
                                 "PyTorch's default since 1.12 is off")
    dropout: bool = spec(False, doc="dropout layers present (stores masks, Korthikanti 2022)")
    fused_cross_entropy: bool = spec(False, doc="fused loss kernel (no fp32 logits copies)")
    fp8: bool = spec(False, doc="FP8 linears through NVIDIA Transformer Engine, as accelerate's mixed_precision fp8 "
                                "runs them (te.Linear, DelayedScaling HYBRID): every nn.Linear whose dims divide by 16 "
                                "runs its three GEMMs in FP8 and keeps FP8 copies for backward; the rest stays in "
                                "precision (see [Note: FP8 linears])")
    tiled_mlp: bool = spec(False, doc="ALST's TiledMLP (DeepSpeed's ulysses_sp.py; axolotl's tiled_mlp): each dense MLP "
                                      "runs over sequence tiles and is recomputed tile by tile in the backward, so it "
                                      "keeps only its input (see [Note: tiled MLP])")
    tiled_mlp_shards: Optional[int] = spec(None, gt=0, le=MAX_SEQ_LEN, doc="the tiles (axolotl's tiled_mlp_num_shards); "
                                           "default ALST's ceil(the rank's sequence / hidden)")
    fused_linear_cross_entropy: bool = spec(
        False, doc="Liger's fused linear cross-entropy (LigerFusedLinearCrossEntropy: axolotl's "
                   "liger_fused_linear_cross_entropy, LLaMA-Factory's enable_liger_kernel): lm_head and the loss "
                   "chunk by chunk, the gradients made in the forward, the logits never whole "
                   "(see [Note: fused linear cross-entropy])")
    gradient_accumulation_fusion: bool = spec(
        False, doc="Megatron-LM's --gradient-accumulation-fusion (its default): each weight-gradient GEMM "
                   "accumulates into the fp32 main_grad itself, so no micro-step adds into a kept .grad "
                   "(see [Note: gradient accumulation add]); DeepSpeed and HF models have no such fusion")
    max_grad_norm: float = spec(1.0, ge=0, doc="HF Trainer's max_grad_norm, used for gradient_clipping: auto")
    optim: Optional[Literal["adamw_torch", "adamw_torch_fused"]] = spec(
        None, doc="the HF Trainer's optim (TrainingArguments.optim), which builds the optimizer when the ds_config "
                  "has no optimizer block: adamw_torch (torch.optim.AdamW, foreach on a GPU; "
                  "see [Note: torch Adam step temporaries]) or adamw_torch_fused; default: the ds_config's block, else a fused AdamW "
                  "(DeepSpeed's FusedAdam, and the HF Trainer's own default adamw_torch_fused on torch >= 2.8)")
    lora: Optional[LoraSpec] = spec(None, doc="PEFT LoRA: frozen base model, trained adapters (zsim/workload/lora.py)")
    frozen: tuple[str, ...] = spec((), doc="module-name suffixes whose parameters are frozen (requires_grad=False)")
    freeze: Optional[FreezeSpec] = spec(None, doc="LLaMA-Factory's freeze tuning: only some blocks train "
                                                   "(finetuning_type: freeze)")
    preference: Optional[PreferenceSpec] = spec(
        None, doc="preference training (DPO and kin): chosen and rejected sequences in each forward, and the "
                  "reference model's forward (see [Note: preference training])")
    quantization: Quantization = spec(
        "none", doc="bitsandbytes storage of the frozen base model's linears under LoRA (QLoRA): nf4 or fp4 "
                    "(load_in_4bit, bnb_4bit_quant_type), int8 (load_in_8bit, LLM.int8); embeddings, norms, lm_head "
                    "and the adapters stay 16-bit; each use of a weight dequantizes it "
                    "(see [Note: bitsandbytes quantized base weights])")
    double_quant: bool = spec(False, doc="bnb_4bit_use_double_quant: the 4-bit absmax quantized to 8 bits "
                                         "(BitsAndBytesConfig's default false; axolotl and LLaMA-Factory set true)")
    framework: Optional[Framework] = spec(
        None, doc="what runs the training loop, which bounds what zsim tune may propose: hf_trainer (HF Trainer, "
                  "accelerate, axolotl, LLaMA-Factory: ZeRO, offload and DeepSpeed AutoTP, no Megatron TP/SP or "
                  "pipeline), deepspeed (the DeepSpeed engine on the user's model: also PipelineModule and "
                  "DeepSpeed-MoE), megatron_deepspeed (also Megatron tensor/sequence parallelism); default: "
                  "hf_trainer when the ds_config holds \"auto\" values (only the HF Trainer and accelerate "
                  "fill them), else not stated: every layout zsim models")
    experts_implementation: Literal["grouped_mm", "eager", "modules"] = spec(
        "grouped_mm", doc="a Hugging Face (dropless) MoE block's routed experts as transformers runs them "
                          "(see [Note: transformers 5 MoE experts]): grouped_mm (transformers 5's default: two 3D "
                          "parameters per block, one grouped GEMM per projection), eager (the same parameters, "
                          "one GEMM per expert), modules (transformers 4: an nn.ModuleList of expert MLPs, three "
                          "parameters each)")
    z3_leaf_moe_block: bool = spec(True, doc="ZeRO-3: each MoE block is a leaf module (deepspeed.utils."
                                   "set_z3_leaf_modules; DeepSpeed 0.19.8's default zero_optimization.leaf_module "
                                   "for Mixtral/Qwen2-MoE/Qwen3-MoE) and gathers all its experts at once; false: "
                                   "the router and the experts fetched apart (one fetch per expert module under "
                                   "experts_implementation: modules)")

    def __post_init__(self):
        if self.fused_linear_cross_entropy and self.fused_cross_entropy:
            raise ValueError("fused_cross_entropy", True, "fused_linear_cross_entropy replaces the loss "
                             "kernel too; set one of the two")
        if self.attn_implementation not in (None, "eager") and not self.flash_attention:
            raise ValueError("attn_implementation", self.attn_implementation,
                             "flash_attention: false is eager attention; drop one of the two")
        if self.attn_implementation == "eager":    # eager materialises the scores
            object.__setattr__(self, "flash_attention", False)

    @property
    def attn_implementation_used(self) -> str:
        """attn_implementation with its default resolved (see the field's doc)."""
        if self.attn_implementation is not None:
            return self.attn_implementation
        if not self.flash_attention:
            return "eager"
        return "sdpa" if self.framework == "hf_trainer" else "flash_attention_2"

    @property
    def kernels_used(self) -> str:
        """kernels with its default resolved (see the field's doc)."""
        return self.kernels or ("hf" if self.framework == "hf_trainer" else "fused")

    @property
    def implementation(self) -> str:
        """What the run's attention and elementwise kernels are, as the table and JSON show it."""
        attn = self.attn_implementation_used
        if attn == "sdpa":
            attn += (" (memory-efficient backend over the full square: padding mask)" if self.padding_mask
                     else " (flash backend, causal)")
        elif attn == "flash_attention_3":
            attn += " (priced at the profile's FlashAttention figures)"
        kernels = "hf (op by op)" if self.kernels_used == "hf" else "fused"
        if self.fused_linear_cross_entropy:
            kernels += "; loss Liger's fused linear cross-entropy"
        if self.fp8:
            kernels += "; linears in FP8 (Transformer Engine)"
        if self.tiled_mlp:
            kernels += "; MLPs tiled (ALST's TiledMLP)"
        base = ""
        if self.quantization != "none":
            bits = "int8 (LLM.int8)" if self.quantization == "int8" else \
                f"4-bit {self.quantization}{' with double quant' if self.double_quant else ''}"
            base = f"; base linears {bits} (bitsandbytes, dequantized at each use)"
        pref = ""
        if self.preference is not None:
            ref = ("with the reference model's forward (no grad)" if self.preference.runs_reference
                   else "no reference model")
            where = "sequences per example" if self.preference.pair == "batch" else "completions in one sequence"
            pref = f"; {self.preference.method}: chosen and rejected {where}, {ref}"
            if self.preference.method == "reward":
                head = ("a value head beside lm_head (its logits computed, unused)"
                        if self.preference.reward_head == "value_head" else "a score head in place of lm_head")
                pref = f"; reward model, {head}: chosen and rejected {where}"
        return f"implementation: attention {attn}; kernels {kernels}{base}{pref}"


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    model: ModelSpec
    cluster: Cluster
    training: TrainingSpec
    deepspeed: DeepSpeedConfig
    description: str = ""
    warnings: tuple[str, ...] = ()
    # how the inputs were read where the files leave it open (defaults taken, keys DeepSpeed
    # ignores): printed on stderr as `zsim: note:` lines, not part of the result
    notes: tuple[str, ...] = ()
    parallelism: ParallelismSpec = ParallelismSpec()
    # a generate() call instead of a training step (zsim/specs/generation.py)
    inference: GenerationSpec | None = None
    # DeepSpeed-Chat's PPO iteration instead of a training step, the model and ds_config the actor's
    # (zsim/specs/rlhf.py); its critic_model resolved to a ModelSpec
    rlhf: RlhfSpec | None = None

    # Resolved values (DeepSpeed's batch rule, precision): the simulator reads these; the loader
    # (zsim.config.scenario) resolves every one before a Scenario is made.
    @property
    def implementation(self) -> str:
        """TrainingSpec.implementation, and a Hugging Face MoE's experts (see [Note: transformers 5
        MoE experts]), as the table and JSON show it."""
        moe = self.model.moe
        if moe is None or moe.dispatch != "dropless":
            return self.training.implementation
        impl = self.training.experts_implementation
        experts = {"grouped_mm": "grouped_mm (transformers 5: one grouped GEMM per projection)",
                   "eager": "eager (transformers 5: one GEMM per expert)",
                   "modules": "modules (transformers 4: one MLP module per expert)"}[impl]
        return f"{self.training.implementation}; experts {experts}"

    @property
    def micro_batch_size(self) -> int:
        value = self.deepspeed.train_micro_batch_size_per_gpu
        assert value is not None, "batch not resolved"
        return value

    @property
    def gradient_accumulation_steps(self) -> int:
        value = self.deepspeed.gradient_accumulation_steps
        assert value is not None, "batch not resolved"
        return value

    @property
    def global_batch_size(self) -> int:
        value = self.deepspeed.train_batch_size
        assert value is not None, "batch not resolved"
        return value

    @property
    def seq_len(self) -> int:
        return self.training.seq_len or self.model.seq_len

    @property
    def precision(self) -> str:
        value = self.training.precision
        assert value is not None, "precision not resolved"
        return value

    @property
    def matmul_dtype(self) -> str:
        """The dtype matmuls run in: the precision's, or tf32 for fp32 with training.tf32."""
        return "tf32" if self.precision == "fp32" and self.training.tf32 else self.precision

    @property
    def expert_parallel_size(self) -> int:
        return self.parallelism.expert

    @property
    def pipeline_stages(self) -> int:
        return self.parallelism.pipeline

    @property
    def tensor_parallel_size(self) -> int:
        return self.parallelism.tensor

    @property
    def sequence_parallel_size(self) -> int:
        """DeepSpeed-Ulysses's sequence-parallel size (parallelism.sequence)."""
        return self.parallelism.sequence

    @property
    def seq_data_parallel_size(self) -> int:
        """The ranks ZeRO partitions over and reduces gradients across: PipeDataParallelTopology and
        Megatron's parallel_state split the world into pipeline x data x tensor, and under
        DeepSpeed-Ulysses the group spans the sequence ranks too (engine.py seq_data_parallel_group,
        groups.py _get_sequence_data_parallel_group)."""
        return self.cluster.world_size // (self.parallelism.pipeline * self.parallelism.tensor)

    @property
    def data_parallel_size(self) -> int:
        """The ranks that take distinct samples, which the batch divides by: world / (pipeline x
        tensor x sequence) (DeepSpeedConfig.world_size under Ulysses, the HF Trainer's dp_world_size)."""
        return self.seq_data_parallel_size // self.parallelism.sequence

    @property
    def zero(self):
        return self.deepspeed.zero_optimization
