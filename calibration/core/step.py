"""The training core's optimizer boundary: the local gradient partition as DeepSpeed's
averaged_gradients, the local norm and overflow passes, and the AdamW step of each flat group.

ZeRO-1/2 step one flat group at a time, as stage_1_and_2.py step does (`for i, group in
enumerate(self.bit16_groups)`: flatten the group's gradient partition, convert it to fp32,
_optimizer_step(i), drop both copies): the schedule has one OPTIMIZER_STEP per flat group (its
payload's sub_group is the group's index), and each runs an AdamW over that group's slice of the
fp32 master, so only one group's temporaries are alive at a time (see [Note: MoE parameter
groups]). Stages 0 and 3 step the whole master in one AdamW (one group).
"""
from __future__ import annotations

import torch

from calibration.core.ds_passes import overflow_count, squared_norm


def adamw_per_group(core) -> list[tuple[torch.nn.Parameter, torch.optim.AdamW]]:
    """One (master slice, AdamW) per flat group the step runs over; the slices are views of
    core.master, so the master stays one fp32 buffer."""
    opt = core.sc.deepspeed.optimizer.params or {}
    spans = [(0, core.master.numel())]
    if core.stage in (1, 2):
        spans = [(local, local + own.stop - own.start) for _, own, local, _ in core.layout]
    out = []
    for lo, hi in spans:
        master = core.master if (lo, hi) == (0, core.master.numel()) else torch.nn.Parameter(
            core.master.data[lo:hi], requires_grad=False)
        out.append((master, torch.optim.AdamW([master], lr=float(opt.get("lr", 1e-3)),
                                              betas=tuple(opt.get("betas", (0.9, 0.999))),
                                              eps=float(opt.get("eps", 1e-8)),
                                              weight_decay=float(opt.get("weight_decay", 0.01)), fused=True)))
    return out


class OptimizerStep:
    """Mixed into ZeroCore: the ops of the optimizer boundary that read the gradient partition."""

    def _grad_pieces(self):
        """The local gradient partition as DeepSpeed's averaged_gradients: one view per parameter
        with elements in it, plus the alignment padding of each group's last partition."""
        if self.stage == 3:
            return [self.grads.gpart[self.goff[p]:self.goff[p + 1]] for p in self._trained()], []
        pieces, pad = [], []
        for group_pieces, group_pad in self._group_grad_pieces():
            pieces += group_pieces
            pad += group_pad
        return pieces, pad

    def _group_grad_pieces(self):
        """(pieces, padding) of the local gradient partition, per flat group."""
        kept = self.grads.grads_kept   # the .grads themselves (see [Note: ZeRO-2 gradients without contiguous_gradients])
        gpart = None if kept else self.grads.partition_grads()
        out = []
        for (base, own, local, _), group in zip(self.layout, self.plan.groups):
            lo, hi = own.start, own.stop
            part = None if kept else gpart[local: local + hi - lo]
            pieces = []
            for p in group.pids:
                a, b = max(lo, self.offsets[p]), min(hi, self.offsets[p] + self.numels[p])
                if a < b:
                    pieces.append(self.grads.accumulated_piece(p, a - self.offsets[p], b - self.offsets[p]) if kept
                                  else part[a - lo:b - lo])
            covered = min(hi, base + sum(self.numels[p] for p in group.pids)) - lo
            if covered < hi - lo:   # the group's alignment padding
                pad = torch.zeros(hi - lo - covered, dtype=self.dtype) if kept else part[covered:]
                out.append((pieces, [pad]))
            else:
                out.append((pieces, []))
        return out

    def _fp32_grads(self, group: int):
        """The fp32 gradient of what `group`'s step updates: the flat group's partition flattened
        (a new buffer, as self.flatten(averaged_gradients[i])) and then converted."""
        if self.stage == 0:
            return self.flatgrad[: self.total].float().div_(self.world)
        if self.stage == 3:
            pieces, pad = self._grad_pieces()
        else:
            pieces, pad = self._group_grad_pieces()[group]
        flat = torch.cat(pieces + pad).float()
        return flat if self.grads.scatter_coalesced else flat.div_(self.world)

    def _norm_and_overflow_local(self):
        """DeepSpeed's passes before the scalar all-reduces: each piece checked for inf/NaN with
        amax/amin when the overflow flag is reduced (has_inf_or_nan), and its norm taken in fp64
        (get_grad_norm_direct, get_norm_dtype)."""
        if self.stage == 0:   # runtime/utils.py clip_grad_norm_: the averaged gradients' fp32 norm
            if self.dtype != torch.float32:
                # the 16-bit wrapper's has_inf_or_nan per gradient (see [Note: stage-0 16-bit step])
                self._bad = overflow_count([self.flatgrad[self.offsets[p]: self.offsets[p] + self.numels[p]]
                                            for p, t in enumerate(self.trainable) if t])
            # the norm of the sums divided by the world size, not the norm of a divided copy:
            # DeepSpeed averages in place after its all-reduce, and the copy (a fresh buffer the
            # size of the gradients) made this step twice DeepSpeed's at fp32 (medium GPT, 2 ranks:
            # 172 ms against 75-86 ms). Equal bit for bit at power-of-two world sizes
            self._sq = self.flatgrad[: self.total].float().norm().div(self.world).square()
            return
        pieces, _ = self._grad_pieces()
        if self.check_overflow:
            self._bad = overflow_count(pieces)
        # the pieces hold sums over ranks; the step divides them
        scale = 1.0 if self.grads.scatter_coalesced else 1.0 / self.world ** 2
        if len(self.layout) > 1:   # one norm per flat group (get_grad_norm_direct per group)
            self._sq_groups = [(squared_norm(p) * scale).float() for p, _ in self._group_grad_pieces()]
            self._norms = []
        # ZeRO-3 all-reduces the squared norm in fp64 (stage3.py:2457-2469), ZeRO-1/2 in fp32
        self._sq = squared_norm(pieces) * scale if self.stage == 3 else (squared_norm(pieces) * scale).float()

    def _step(self, group: int):
        """One flat group's step (the whole shard at stages 0 and 3): clipped on the global norm,
        its fp32 copy dropped after AdamW, its 16-bit partition updated."""
        master, opt = self.opts[group]
        g = self._fp32_grads(group)
        if self.grads.grads_kept:
            self.grads.drop_accumulated(self.plan.groups[group].pids)
        if self.clip > 0:
            norm = self._norm if self._norm is not None else torch.dot(g, g).sqrt()
            coef = self.clip / (float(norm) + 1e-6)
            if coef < 1.0:
                g.mul_(coef)
        master.grad = g
        opt.step()
        master.grad = None
        del g
        if self.stage == 0:
            if self.master.data_ptr() != self.flat16.data_ptr():
                self.flat16[: self.total].copy_(self.master)
            self.flatgrad.zero_()
        elif self.stage < 3:
            _, own, local, _ = self.layout[group]
            self.flat16[own].copy_(self.master[local: local + own.stop - own.start])
            if group == len(self.layout) - 1:
                self.grads.gpart = None   # grads_in_partition dropped after the last group's step
        else:
            if all(self.trainable):
                self.shard16.copy_(self.master)
            else:
                for p in self._trained():
                    self.shard16[self.soff[p]:self.soff[p + 1]].copy_(self.master[self.goff[p]:self.goff[p + 1]])
            self.grads.gpart.zero_()
