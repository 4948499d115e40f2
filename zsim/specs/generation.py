"""The scenario's `inference:` block: one generate() call (prefill, then one decode step per new
token with a KV cache), as HF's generate runs it on a DeepSpeed engine or on DeepSpeed-Inference.

Which engine holds the weights is the ds_config's: ZeRO stage 3 is ZeRO-Inference
(deepspeed.initialize on the model, no optimizer, `model.generate`: every forward gathers every
layer, from the GPUs' partitions or, with offload_param, streamed from CPU or NVMe); any other
stage keeps the whole model on each GPU (DeepSpeed-Inference's init_inference, with
`tensor_parallel` GPUs to a replica). See [Note: generation] (zsim/schedule/generate.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from zsim.schema import spec
from zsim.specs.model import MAX_SEQ_LEN

# DeepSpeedInferenceConfig.max_out_tokens's default (deepspeed/inference/config.py): the tokens
# the injected kernels' workspace (and its KV cache) is sized for
DS_INFERENCE_MAX_OUT_TOKENS = 1024


@dataclass(frozen=True, kw_only=True)
class GenerationSpec:
    batch_size: int = spec(1, gt=0, le=2**16, doc="sequences in each forward of one model replica (the prompts "
                                                  "generate() is given at once)")
    prompt_len: int = spec(512, gt=0, le=MAX_SEQ_LEN, doc="prompt tokens of each sequence (the prefill's length)")
    new_tokens: int = spec(128, gt=0, le=MAX_SEQ_LEN, doc="tokens generated per sequence (max_new_tokens, every "
                                                          "sequence running to it: no early stop)")
    tensor_parallel: int = spec(1, gt=0, le=2**10, doc="GPUs one replica is split over (init_inference's "
                                                       "tensor_parallel.tp_size, formerly mp_size); the world runs "
                                                       "world / tensor_parallel replicas")
    kernel_inject: bool = spec(False, doc="init_inference(replace_with_kernel_inject=True): DeepSpeed's fused "
                                          "inference kernels, whose KV cache is preallocated for max_out_tokens and "
                                          "written in place; false: the model's own HF code, whose DynamicCache "
                                          "concatenates each new token (a copy of the whole cache per step)")
    max_out_tokens: int = spec(DS_INFERENCE_MAX_OUT_TOKENS, gt=0, le=MAX_SEQ_LEN,
                               doc="init_inference's max_out_tokens: the tokens (prompt + generated) the injected "
                                   "kernels' KV cache holds, allocated up front")
    weight_bits: int = spec(16, doc="ZeRO-Inference's weight quantization (the ds_config's weight_quantization."
                                    "quantized_initialization num_bits, read into it): 8 or 4 stores every nn.Linear "
                                    "and nn.Embedding weight packed, dequantized at each use; 16: not quantized "
                                    "(see [Note: ZeRO-Inference quantized weights])")
    weight_group_size: int = spec(64, gt=0, le=2**16, doc="quantized_initialization group_size: one scale and "
                                                            "one minimum per group of weights")
    cuda_graph: bool = spec(False, doc="init_inference's enable_cuda_graph (with kernel_inject): each decode step "
                                       "replayed as one graph, without a launch per kernel")

    @property
    def total_tokens(self) -> int:
        """The sequence length at the end: prompt + generated."""
        return self.prompt_len + self.new_tokens

    def context(self, forward: int) -> int:
        """The tokens the KV cache holds after forward `forward` (0: the prefill, k: decode step k)."""
        return self.prompt_len + forward


def generation_kernels(gen: GenerationSpec, training) -> tuple[str, str]:
    """(attention, elementwise kernels) a generation runs: the training block's when it names them,
    else the model's HF code (from_pretrained's sdpa, op-by-op kernels) or, with kernel_inject,
    DeepSpeed's fused inference kernels."""
    attn = training.attn_implementation or ("eager" if not training.flash_attention else
                                            "flash_attention_2" if gen.kernel_inject else "sdpa")
    return attn, training.kernels or ("fused" if gen.kernel_inject else "hf")
