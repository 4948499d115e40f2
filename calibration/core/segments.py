"""What the training core keeps of a segment's values between its forward and its backward.

[Note: segment values]
DeepSpeed runs the model's forward as one autograd graph (runtime/engine.py:3007
`loss = self.module(*inputs, **kwargs)`): an activation is alive while a Python local or a
tensor autograd saved refers to it, and no longer. The core runs the same graph segment by
segment, so it must not hold more than that: a segment's input enters through `SegmentEntry`, which
keeps no reference to it (a detached leaf would be kept by its AccumulateGrad node until the
segment's backward), the gradient that reaches it is collected in a list; the segment's output
is kept as its gradient edge (the node, not the tensor); and a value leaves the core's env after
its last reader in forward (recompute included). So a frozen LoRA base layer's output, which
nothing saves, is freed at lora_B's add as in PEFT's `result = result + lora_B(...)`, and
an MoE layer's all-to-all receive buffer once the experts have read it.
"""
from __future__ import annotations

import torch

from calibration.core.moe import exchanged_values
from zsim.schedule.ir import OpKind, Phase


class SegmentEntry(torch.autograd.Function):
    """A segment's input: the same storage (a view), no saved reference; backward hands the
    summed gradient to `box`. `anchor` is an empty leaf that needs a gradient, so the output
    does."""

    @staticmethod
    def forward(ctx, x, anchor, box):
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.box.append(grad)
        return None, None, None


def last_reads(ops, segs, sc) -> dict[int, list[str]]:
    """op id -> the env values it reads last in its micro-step (forward, recompute and the
    forward all-to-alls read them; backward ops read gradients only)."""
    last: dict[tuple[int, str], int] = {}
    for op in ops:
        if op.kind == OpKind.FORWARD:
            names = segs[op.payload.module].inputs
        elif op.kind == OpKind.EXPERT_ALL_TO_ALL and op.phase != Phase.BACKWARD:
            local = sc.model.moe.experts // sc.expert_parallel_size
            tokens, outputs = exchanged_values(op.payload.layer, local)
            names = outputs if op.payload.combine else (tokens,)
        else:
            continue
        for n in names:
            last[(op.micro_step, n)] = op.id
    out: dict[int, list[str]] = {}
    for (_, n), op_id in last.items():
        out.setdefault(op_id, []).append(n)
    return out
