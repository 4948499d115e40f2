"""bitsandbytes-quantized frozen base weights (QLoRA's 4-bit NF4/FP4, LLM.int8's 8-bit): what each
stored weight costs in memory and what each use of it costs in time. Pure rules; zsim/workload/lora.py
applies them to the base model's linears, the schedule reads the stored size through Param.

[Note: bitsandbytes quantized base weights] Sources: bitsandbytes 0.50.2 (functional.py quantize_4bit,
QuantState, dequantize_4bit; nn/modules.py Params4bit, Linear4bit, Int8Params; autograd/_functions.py
MatMul4Bit, MatMul8bitLt; backends/cuda/ops.py gemm_4bit), transformers 5.25 (integrations/bitsandbytes.py
replace_with_bnb_linear, quantizers/base.py get_keys_to_not_convert). Measured with bitsandbytes 0.50.2 on
CPU for a 4096 x 1024 weight: nf4/fp4 0.5625 B a weight, with double quantization 0.5161 (of which the
nested code table is 1 KiB), LLM.int8 1 B plus 4 B a row.
- Which weights: replace_with_bnb_linear swaps every nn.Linear but the skipped modules for a
  Linear4bit / Linear8bitLt (frozen); get_keys_to_not_convert skips the output embedding (lm_head),
  tied weights and the last module. Embeddings, norms, lm_head and the LoRA adapters (PEFT adds them
  after quantization, as nn.Linear) stay in the compute dtype.
- 4-bit storage: two weights a byte (the packed tensor, of bnb_4bit_quant_storage elements: bf16
  packs 4 weights an element), plus QuantState.absmax: one fp32 per block of 64 weights
  (Params4bit's blocksize), or with bnb_4bit_use_double_quant (compress_statistics) one uint8 per
  block plus the nested state's fp32 absmax per 256 blocks and its fp32 offset. The code tables
  (16 fp32; the nested 256 fp32) are left out.
- 8-bit storage (LLM.int8, has_fp16_weights False): the int8 weight CB plus SCB, one fp32 per row.
- Under ZeRO-3 DeepSpeed partitions and gathers the packed tensor as any parameter (ds_numel its
  elements), so a gathered 4-bit weight moves numel/2 bytes; the QuantState is an attribute, not a
  parameter, and stays whole on every rank. Measured with DeepSpeed 0.19.8 (CPU, gloo, 2 ranks,
  bitsandbytes 0.50.2): a bf16-stored 256 x 256 Linear4bit is partitioned as 8192 bf16 elements a
  rank and trains; uint8 storage and int8 weights train too when the model's first parameter is
  16-bit (an HF model's embedding), and fail Init's dtype assertion (partition_parameters.py:348)
  when a quantized weight comes first.
- Time: for a training batch (more than 1536 rows) gemm_4bit dequantizes the whole weight
  (dequantize_4bit: read the packed bytes and the absmax, write the 16-bit weight; with double
  quantization the absmax is dequantized first, one more kernel) and runs F.linear on it; backward's
  input gradient dequantizes it again (MatMul4Bit.backward); a frozen weight has no weight gradient.
  Recompute repeats the forward's dequantization. The 16-bit weight lives while its GEMM runs.
  gemm_4bit's fused kernel for up to 1536 rows (a routed expert's few rows) is not modelled.
  LLM.int8 (MatMul8bitLt, threshold 6.0): forward quantizes the input rows to int8
  (int8_vectorwise_quant: read the 16-bit input, write int8 and a fp32 scale a row) and runs the
  int8 GEMM, priced here at the 16-bit rate (an upper bound: the outlier columns run in 16-bit);
  backward dequantizes CB with SCB into a 16-bit weight and multiplies.
"""
from __future__ import annotations

import math

FP32_BYTES = 4
BLOCKSIZE = 64          # Params4bit's blocksize on CUDA (nn/modules.py)
NESTED_BLOCKSIZE = 256  # quantize_4bit: quantize_blockwise(absmax - offset, blocksize=256)
FOUR_BIT = ("nf4", "fp4")   # of zsim.specs.scenario.Quantization


def packed_bytes(numel: int, quant: str) -> float:
    """Bytes of the quantized weight tensor itself (what ZeRO-3 partitions and gathers)."""
    return float(math.ceil(numel / 2) if quant in FOUR_BIT else numel)


def quant_state_bytes(numel: int, rows: int, quant: str, double_quant: bool) -> float:
    """Bytes of a weight's quantization statistics: 4-bit absmax (fp32 per 64 weights, or with
    double quantization uint8 per 64 plus fp32 per 256 blocks and the offset); int8 SCB per row."""
    if quant not in FOUR_BIT:
        return float(FP32_BYTES * rows)
    blocks = math.ceil(numel / BLOCKSIZE)
    if not double_quant:
        return float(FP32_BYTES * blocks)
    return float(blocks + FP32_BYTES * math.ceil(blocks / NESTED_BLOCKSIZE) + FP32_BYTES)


def dequant_bytes(numel: int, rows: int, quant: str, double_quant: bool, dtype_bytes: int) -> float:
    """HBM traffic of one dequantization to a `dtype_bytes` weight: read the packed weight and its
    statistics, write the 16-bit weight."""
    return packed_bytes(numel, quant) + quant_state_bytes(numel, rows, quant, double_quant) + numel * dtype_bytes


def dequant_kernels(quant: str, double_quant: bool) -> int:
    """Kernels of one dequantization: the nested absmax first, then the weight."""
    return 2 if quant in FOUR_BIT and double_quant else 1


def int8_input_bytes(tokens: int, n_in: int, dtype_bytes: int) -> float:
    """LLM.int8's forward input quantization (int8_vectorwise_quant): read the 16-bit input,
    write its int8 copy and a fp32 scale a row."""
    return float(tokens * n_in * (dtype_bytes + 1) + tokens * FP32_BYTES)

