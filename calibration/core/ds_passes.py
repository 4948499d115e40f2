"""DeepSpeed 0.19.8's passes over the local gradient pieces before the optimizer step, shared by
the own core (engine.py) and the calibration benchmark that times them (harness/bench_zero.py
bench_optimizer_step), so the rate zsim charges is measured on the code the core runs."""
from __future__ import annotations

import torch


def overflow_count(pieces) -> torch.Tensor:
    """has_overflow_partitioned_grads_serial: has_inf_or_nan (runtime/utils.py, amax and amin)
    per piece, accumulated."""
    bad = torch.zeros(1, device=pieces[0].device)
    for g in pieces:
        bad += torch.isfinite(g.amax()).logical_and(torch.isfinite(g.amin())).logical_not()
    return bad


def squared_norm(pieces) -> torch.Tensor:
    """get_grad_norm_direct: each piece's norm in fp64 (zero/utils.py get_norm_dtype), squared
    and summed."""
    return torch.stack([g.to(torch.float64).norm() for g in pieces]).pow(2).sum()
