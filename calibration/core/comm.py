"""torch.distributed calls the core makes, each recorded as (phase, collective, numel).

numel follows the fixtures' convention (tests/fixtures/deepspeed/README.md): the full buffer,
i.e. the output of an all-gather and the input of a reduce-scatter.
torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single; the old names
are the fallback for older torch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    def __init__(self, group=None):
        self.group = group
        self.log: list[tuple[str, str, int]] | None = None
        self.phase = ""

    def _rec(self, kind: str, t: torch.Tensor):
        if self.log is not None:
            self.log.append((self.phase, kind, int(t.numel()), int(t.numel() * t.element_size())))

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, group=None):
        self._rec("all_reduce", t)
        dist.all_reduce(t, op=op, group=group or self.group)

    def reduce(self, t: torch.Tensor, dst: int, group=None):
        """`dst` is the rank within `group` (another group than the default: an expert-data-parallel one)."""
        self._rec("reduce", t)
        if group is None:
            dist.reduce(t, dst=dst, group=self.group)
        else:
            dist.reduce(t, group=group, group_dst=dst)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False, group=None):
        self._rec("all_gather", out)
        return _ALL_GATHER(out, inp, group=group or self.group, async_op=async_op)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group=None):
        """DeepSpeed-MoE's _AllToAll: all_to_all_single, equal splits along the first dimension."""
        self._rec("all_to_all", inp)
        dist.all_to_all_single(out, inp, group=group or self.group)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor):
        self._rec("reduce_scatter", inp)
        _REDUCE_SCATTER(out, inp, group=self.group)

    def broadcast(self, t: torch.Tensor, src: int, group=None):
        """`src` is a global rank (torch.distributed.broadcast's convention)."""
        self._rec("broadcast", t)
        dist.broadcast(t, src, group=group or self.group)

    def send(self, t: torch.Tensor, dst: int):
        """Blocking point-to-point send to global rank `dst`, as DeepSpeed's pipe/p2p.py send does
        where the backend can send/recv (can_send_recv: gloo and torch >= 1.8)."""
        self._rec("send", t)
        dist.send(t, dst)

    def recv(self, t: torch.Tensor, src: int):
        self._rec("recv", t)
        dist.recv(t, src)
