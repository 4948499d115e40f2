"""Unsharded single-process AdamW run of the same model and data: the loss the sharded core
must reproduce (to 1e-5 in fp32)."""
from __future__ import annotations

import torch

from calibration.core.model import batch, build_segments, init_params, param_shapes, run_forward_backward


def reference_losses(sc, steps: int, world: int, seed: int = 1234) -> list[float]:
    """With MoE layers each rank's micro-batch runs on its own (the capacity of an expert is a
    function of one rank's tokens), through the full model (every expert), and the gradients
    add up; otherwise the ranks' micro-batches run as one batch."""
    from dataclasses import replace

    from zsim.schedule.build import workload_for
    from zsim.specs.parallelism import ParallelismSpec

    sc = replace(sc, parallelism=ParallelismSpec())
    wl = workload_for(sc)
    shapes = param_shapes(wl)
    params = [t.clone().requires_grad_(p.trainable) for t, p in zip(init_params(wl, shapes, seed), wl.params)]
    segs = build_segments(sc, wl)
    order = [m.name for m in wl.modules]
    opt_cfg = sc.deepspeed.optimizer.params or {}
    # the optimizer gets the trainable params only, as HF Trainer / PEFT hand them to DeepSpeed
    opt = torch.optim.AdamW([p for p in params if p.requires_grad], lr=float(opt_cfg.get("lr", 1e-3)),
                            betas=tuple(opt_cfg.get("betas", (0.9, 0.999))), eps=float(opt_cfg.get("eps", 1e-8)),
                            weight_decay=float(opt_cfg.get("weight_decay", 0.01)))
    gas = sc.gradient_accumulation_steps
    losses = []
    for step in range(steps):
        for micro in range(gas):
            parts = [batch(sc, step, micro, r, seed) for r in range(world)]
            if sc.model.moe is not None:
                losses.append(sum(run_forward_backward(segs, order, lambda i: params[i], ids, labels,
                                                       1.0 / gas / world) for ids, labels in parts) / world)
                continue
            ids = torch.cat([p[0] for p in parts])
            labels = torch.cat([p[1] for p in parts])
            losses.append(run_forward_backward(segs, order, lambda i: params[i], ids, labels, 1.0 / gas))
        if sc.deepspeed.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_([p for p in params if p.requires_grad], sc.deepspeed.gradient_clipping)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses
