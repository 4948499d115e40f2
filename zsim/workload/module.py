"""The workload's data: parameters, modules (one per nn.Module with direct parameters, plus the
parameterless attention core, activations and loss) and the Workload of one micro-batch.

zsim/workload/builder.py fills them in; zsim/workload/transformer.py, attention.py and moe.py
say which modules a model has.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from zsim.record import record

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@record
class Param:
    name: str
    numel: int
    # an expert's weight: its gradient is reduced over the expert-data-parallel group, not the
    # whole data-parallel group (DeepSpeed-MoE, deepspeed/utils/groups.py)
    expert: bool = False
    # requires_grad: frozen weights (LoRA's base model, training.frozen) carry no gradient and no
    # optimizer state, but ZeRO-3 still partitions and gathers them
    trainable: bool = True
    # replicated over the tensor-parallel group, but each TP rank computes only part of its
    # gradient: under sequence parallelism the norms of the residual stream and the row-parallel
    # biases (they see the rank's sequence shard; Megatron tags them `sequence_parallel`,
    # fused_layer_norm.py, tensor_parallel/layers.py RowParallelLinear), and the qk layernorms
    # (shared by the heads the ranks split). finalize_model_grads sums them over the TP group
    tensor_partial_grad: bool = False
    # its dimensions, outermost first, where a rule reads them (ZeRO++ qgZ's quantization groups);
    # () where no rule needs them
    shape: tuple[int, ...] = ()
    # a bitsandbytes-quantized frozen weight (see [Note: bitsandbytes quantized base weights]): the
    # bytes of its packed tensor, which ZeRO partitions and gathers, and of its quantization
    # statistics, which stay whole on every rank; None: stored in the run's dtype
    packed_bytes: float | None = None
    quant_state_bytes: float = 0.0

    def stored_numel(self, dtype_bytes: int) -> int:
        """Elements of the run's dtype that hold the parameter as DeepSpeed sees it (its ds_numel
        when a packed 4-bit weight is stored in the compute dtype): the one place a parameter's
        stored size is decided."""
        return self.numel if self.packed_bytes is None else math.ceil(self.packed_bytes / dtype_bytes)


class ModuleKind(StrEnum):
    EMBEDDING = "embedding"
    NORM = "norm"
    LINEAR = "linear"
    ATTENTION = "attention"        # the attention core (no params)
    ACTIVATION = "activation"
    LOSS = "loss"
    SSM = "ssm"                    # a Mamba mixer's depthwise conv or selective scan: memory-bound, with params


class TensorRole(StrEnum):
    """Where a module meets Megatron-LM's tensor-parallel communication (core/tensor_parallel/
    mappings.py; Shoeybi et al. 2019 fig. 3's f and g): the schedule adds the collectives when
    the tensor-parallel size is above 1 (zsim/schedule/tensor.py)."""
    # a column-parallel linear reading the (replicated, or with sequence parallelism sequence-
    # sharded) block input: f = copy_to_tensor_model_parallel_region (identity forward, all-reduce
    # backward); with SP gather_from_sequence_parallel_region (all-gather forward, reduce-scatter backward)
    ENTER = "enter"
    # a row-parallel linear (or the vocab-parallel embedding) whose partial sums leave: g =
    # reduce_from_tensor_model_parallel_region (all-reduce forward, identity backward); with SP
    # reduce_scatter_to_sequence_parallel_region (reduce-scatter forward, all-gather backward)
    EXIT = "exit"
    # VocabParallelEmbedding under LanguageModelEmbedding with learned positions
    # (models/common/embeddings/language_model_embedding.py: reduce_scatter_embeddings only
    # without a position embedding): the partial rows all-reduced in forward, the positions
    # added, and with SP the sum split into sequence shards (scatter_to_sequence_parallel_region:
    # no communication forward, all-gather of the gradient in backward)
    EMBED = "embed"
    # vocab_parallel_cross_entropy (cross_entropy.py): three all-reduces of one fp32 per token
    # (the logits' max, the target's logit, the sum of exponentials) in forward
    VOCAB_LOSS = "vocab loss"


@record(kw_only=True)
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
    # the part of the memory-bound traffic that runs in fp32 whatever the precision (the loss
    # after its upcast: see [Note: HF loss memory]), besides fwd/bwd_mem_bytes
    fp32_fwd_mem_bytes: float = 0.0
    # plain copies in the forward (a generation's KV cache concatenated: zsim/workload/generation.py)
    fwd_copy_bytes: float = 0.0
    fp32_bwd_mem_bytes: float = 0.0
    act_bytes: float           # activations this module keeps for backward
    act_bytes_s2: float = 0.0  # the s^2 part of act_bytes (dropped by selective checkpointing)
    kernels_fwd: int = 1
    kernels_bwd: int = 2
    fwd_workspace_bytes: float = 0.0   # transient while the forward kernel runs
    bwd_workspace_bytes: float | None = None  # transient in backward; default: act_bytes (input grads)
    # the nn.Module containers it sits in, outermost first (("layers.0", "layers.0.attn")): ZeRO-3's
    # hooks visit each container as the forward enters it
    containers: tuple[str, ...] = ()
    # the routed expert (its index among this rank's local experts) a module computes for; None
    # for dense modules. A MoE layer's expert span is its modules with expert set (zsim/workload/moe.py)
    expert: int | None = None
    # which backward GEMMs run (zsim/workload/lora.py clears them for frozen weights and for inputs
    # that carry no gradient): a linear's dgrad needs input_grad, its wgrad weight_grad
    input_grad: bool = True
    weight_grad: bool = True
    # run under torch.no_grad (a preference run's reference model, see [Note: preference
    # training]): autograd records nothing, so it keeps no activations and has no backward
    no_grad: bool = False
    # its tensor-parallel communication, and the width of the activation tensor it moves
    tensor_role: TensorRole | None = None
    tensor_width: int = 0
    # a grouped linear (see [Note: transformers 5 MoE experts]): `groups` experts' weight
    # matrices in one 3D parameter, each over its own rows (`gemm` counts the rows of all groups);
    # grouped_mm: one kernel over every group (torch's grouped_mm), else one GEMM per group
    groups: int = 1
    grouped_mm: bool = True
    # an nn.Linear (or Conv1D) in the model's code: the modules PEFT's target_modules and
    # bitsandbytes replace; transformers 5's MoE routers and experts hold bare parameters
    nn_linear: bool = True
    # the backward's GEMMs run in the forward and the backward runs none (Liger's fused linear
    # cross-entropy on lm_head: see [Note: fused linear cross-entropy])
    backward_in_forward: bool = False
    # an nn.Linear Transformer Engine runs in FP8 (te.Linear: see [Note: FP8 linears])
    fp8: bool = False
    # ALST's TiledMLP (see [Note: tiled MLP]): the tiles its MLP runs over (0: not tiled), and on
    # the MLP's first module the input the tiled MLP keeps to its backward
    tile_shards: int = 0
    tile_input_bytes: float = 0.0

    @property
    def bwd_workspace(self) -> float:
        return self.act_bytes if self.bwd_workspace_bytes is None else self.bwd_workspace_bytes

    def saved_input_bytes(self, a: int) -> float:
        """The `a`-byte input a linear keeps for its wgrad, within act_bytes (0 where it reads one
        another linear keeps, as k_proj reads q_proj's)."""
        assert self.gemm is not None
        tokens, _, n_in = self.gemm
        return tokens * n_in * a if self.act_bytes >= tokens * n_in * a else 0.0


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

    def stored_numels(self, dtype_bytes: int) -> list[int]:
        """Each param's stored elements (Param.stored_numel)."""
        return [p.stored_numel(dtype_bytes) for p in self.params]

    @property
    def quant_state_bytes(self) -> float:
        """The quantized weights' statistics, whole on every rank."""
        return sum(p.quant_state_bytes for p in self.params)

    @property
    def model_flops(self) -> float:
        """Model FLOPs of one micro-batch, forward + backward (3x forward; a module run without
        grad, its forward only)."""
        return sum(m.model_fwd_flops * (1.0 if m.no_grad else 3.0) for m in self.modules)

    def layer_modules(self, layer: int) -> tuple[Module, ...]:
        by_layer = self.__dict__.get("_by_layer")
        if by_layer is None:
            by_layer = {}
            for m in self.modules:
                by_layer.setdefault(m.layer, []).append(m)
            by_layer = {k: tuple(v) for k, v in by_layer.items()}
            object.__setattr__(self, "_by_layer", by_layer)   # cache on the frozen instance
        return by_layer.get(layer, ())
