"""What a stage builder works with: the scenario, the workload, the builder, and the hooks the
forward/backward passes call so each ZeRO stage adds its own collectives and memory."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from zsim.specs.scenario import Scenario
from zsim.schedule.builder import Builder
from zsim.schedule.ir import Phase, Stream
from zsim.workload.module import Module, Workload

if TYPE_CHECKING:   # layer_skip.py builds on this module
    from zsim.schedule.layer_skip import LayerSkip


@dataclass
class StepContext:
    sc: Scenario
    wl: Workload
    b: Builder
    param_bytes: int            # 16-bit (2) or fp32 (4) model/gradient width
    dp_size: int                # the data-parallel ranks ZeRO partitions over (Scenario.seq_data_parallel_size)
    reduce_bytes: int           # width of a reduced gradient element (DeepSpeedConfig.reduction_dtype)
    ckpt_offload_ops: dict = field(default_factory=dict)   # (micro, layer) -> D2H op of its checkpoint
    # what the passes add around the modules: moe.TokenExchanges (the MoE all-to-alls) and
    # tensor.TensorCollectives (Megatron's tensor-parallel collectives); build.py sets them
    exchanges: tuple = ()
    # (id of a module, backward?) -> its pass's payload (passes.py), made once per step
    passes: dict = field(default_factory=dict)
    # (phase, runs first?) -> the pass copied to other micro-steps (see [Note: pass templates]); None: none
    pass_templates: dict | None = field(default_factory=dict)
    # the passes may skip layers that repeat (see [Note: layers the builder skips]): asked by the
    # caller, and where stage3.py supports it, its layer_skip.LayerSkip (None: build every layer)
    skip_layers: bool = False
    layer_skip: LayerSkip | None = None

    def for_slice(self, wl: Workload) -> StepContext:
        """A pipeline stage's (or model chunk's) context: this step's settings over its slice of
        the model, with its own checkpoint ops and no exchanges yet (the caller sets them)."""
        return StepContext(sc=self.sc, wl=wl, b=self.b, param_bytes=self.param_bytes, dp_size=self.dp_size,
                           reduce_bytes=self.reduce_bytes, pass_templates=None if self.pass_templates is None else {})

    @property
    def reduce_dtype(self) -> str:
        """The dtype gradients are reduced in (DeepSpeedConfig.reduction_dtype; Comm.dtype)."""
        return self.sc.deepspeed.reduction_dtype

    @property
    def gas(self) -> int:
        return self.sc.gradient_accumulation_steps

    @property
    def last_micro(self) -> int:
        return self.sc.gradient_accumulation_steps - 1

    @property
    def checkpointing(self) -> str:
        return self.sc.training.activation_checkpointing

    @property
    def cpu_checkpointing(self) -> bool:
        """deepspeed.checkpointing with cpu_checkpointing: each block's input goes to host memory
        (activation_checkpointing/checkpointing.py:613-616 forward, 639-640 backward). It applies
        to checkpointed blocks, i.e. full checkpointing."""
        return self.checkpointing == "full" and self.sc.deepspeed.activation_checkpointing.cpu_checkpointing

    @property
    def grad_stream(self) -> Stream:
        return Stream.REDUCE if self.sc.zero.overlap else Stream.COMPUTE

    @property
    def optimizer_offloaded(self) -> bool:
        return self.sc.zero.optimizer_offload_device != "none"

    @property
    def params_offloaded(self) -> bool:
        return self.sc.zero.param_offload_device != "none"


class StageHooks:
    """Default: a plain data-parallel replica (no communication in the passes)."""

    def pre_module(self, ctx: StepContext, module: Module, micro: int, phase: Phase) -> list[int]:
        return []

    def post_module(self, ctx: StepContext, module: Module, micro: int, phase: Phase, op: int):
        pass

    def end_backward(self, ctx: StepContext, micro: int, last_op: int):
        pass

    def accumulated_grads(self, ctx: StepContext, module: Module, micro: int) -> tuple[int, ...]:
        """Params whose new gradient autograd adds into a .grad kept from an earlier micro-step,
        at `module`'s backward (see [Note: gradient accumulation add]); none by default."""
        return ()

    def stationary(self, ctx: StepContext, phase: Phase, micro: int) -> bool:
        """Whether a pass of `phase` at `micro` adds the same ops, but for its micro-step, as
        any other pass these hooks call stationary, and changes nothing else: no op added
        before it, no state of the hooks or the context (see [Note: pass templates]; a copy
        repeats only the pass's own ops). Hooks that keep state across modules or micro-steps
        say no."""
        return False
