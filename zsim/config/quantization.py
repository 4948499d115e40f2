"""bitsandbytes quantization as the tools configure it, in zsim's training keys
(training.quantization, training.double_quant; see [Note: bitsandbytes quantized base weights]):
a BitsAndBytesConfig's fields (what axolotl, LLaMA-Factory, TRL's flags and a config.json's
quantization_config build), and the combinations zsim refuses or warns about."""
from __future__ import annotations

from zsim.errors import ZsimInputError

QUANT_TYPES = ("nf4", "fp4")


def bnb_training(where: str, load_in_4bit: bool, load_in_8bit: bool, quant_type="nf4",
                 double_quant: bool = False) -> dict:
    """training.* keys of a BitsAndBytesConfig (transformers utils/quantization_config.py: one of
    load_in_4bit / load_in_8bit; bnb_4bit_quant_type nf4 or fp4)."""
    if load_in_4bit and load_in_8bit:
        raise ZsimInputError(f"{where}load_in_4bit", True, "and load_in_8bit are both set; BitsAndBytesConfig "
                             "takes one of them")
    if load_in_8bit:
        return {"quantization": "int8"}
    if not load_in_4bit:
        return {}
    quant_type = str(quant_type)
    if quant_type not in QUANT_TYPES:
        raise ZsimInputError(f"{where}bnb_4bit_quant_type", quant_type, "choose nf4 or fp4 (bitsandbytes' 4-bit types)")
    return {"quantization": quant_type, "double_quant": bool(double_quant)}


def quantization_notes(quantization: str, zero_stage: int, tensor: int, pipeline: int) -> list[str]:
    """Refuse what bitsandbytes' weights cannot run under; say what the run risks."""
    if quantization == "none":
        return []
    if tensor > 1 or pipeline > 1:
        raise ZsimInputError("training.quantization", quantization, "bitsandbytes-quantized weights run under the "
                             "HF Trainer (data parallel, ZeRO); zsim does not model them with tensor or pipeline "
                             "parallelism: set parallelism.tensor and pipeline to 1")
    if quantization == "int8" and zero_stage == 3:
        return ["training.quantization int8 under ZeRO-3: DeepSpeed 0.19.8 partitions the int8 weights and runs, "
                "but the loss is reported wrong (bitsandbytes-foundation/bitsandbytes#1451) and LLaMA-Factory refuses "
                "it; 4-bit (nf4) is the ZeRO-3 QLoRA path"]
    return []
