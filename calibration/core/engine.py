"""The sharded training core: ZeRO stages 0-3 in plain torch.distributed, executing zsim's
schedule for the scenario op by op (calibration/core/plan.py).

Model states, as DeepSpeed 0.19.8 keeps them:
- stages 0-2: one flat 16-bit buffer of all parameters (padded to 2*world), params are views;
  stage 0 gradients are views of one flat 16-bit gradient buffer (accumulated in place over
  micro-steps). Stage 1/2 gradients are autograd's own .grad tensors (stage 1 accumulates them
  over micro-steps); at a bucket's reduction they are copied into the IPG bucket buffer
  (contiguous_gradients; stage 2 from the hooks, stage 1 at the boundary) and dropped, and
  only this rank's partition is kept (16-bit, allocated by the step's first reduction, freed
  after the step). The IPG buffer lives from a backward's first gradient to its end.
- stages 1-3: fp32 master weights and AdamW moments of the local partition only; after the
  step the updated 16-bit partitions are all-gathered (stage 1/2, one call) or the persistent
  params are re-gathered one call each (stage 3), all launched async before any is waited.
- stage 3: each rank keeps ceil(n/world) elements of every param; a gather allocates the full
  params and points them at it (p.data = ...), a release drops it (p.data = empty), so
  autograd's saved weights see whatever is gathered when backward runs (ZeRO-3's trick).
  Gradients go into the IPG buffer in gradient order; at a bucket's reduce-scatter they are
  interleaved per rank into a new buffer and pre-divided by the world size, as DeepSpeed's
  reduce_scatter_coalesced does (with reduce_scatter false: a rank-major buffer, all-reduced).
Other gradients are communicated as sums and divided by the world size once, at the step.
Collectives are blocking and issued in program order (on CPU DeepSpeed does the same: the
accelerator is "synchronized", no side streams), except that post-step batch.
"""
from __future__ import annotations

import math
import time
from itertools import groupby

import torch

from calibration.core.comm import Comm
from calibration.core.ds_passes import overflow_count, squared_norm
from calibration.core.model import DTYPES, batch, build_segments, init_params, param_shapes
from calibration.core.plan import Plan


class ZeroCore:
    def __init__(self, sc, plan: Plan, rank: int, world: int, comm: Comm, seed: int = 1234):
        from zsim.schedule.build import workload_for

        self.sc, self.plan, self.rank, self.world, self.comm, self.seed = sc, plan, rank, world, comm, seed
        self.wl = workload_for(sc)
        self.dtype = DTYPES[sc.precision]
        self.stage = plan.stage
        self.shapes = param_shapes(self.wl)
        self.segs = build_segments(sc, self.wl)
        self.numels = plan.numels
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets[-1]
        self.gas = sc.gradient_accumulation_steps
        self.clip = sc.deepspeed.gradient_clipping
        init = init_params(self.wl, self.shapes, seed)
        self.empty = torch.empty(0, dtype=self.dtype)
        self.params = [torch.empty(0, dtype=self.dtype).requires_grad_(True) for _ in self.numels]
        W = world
        if self.stage < 3:
            self.flat16 = torch.zeros(plan.flat_padded, dtype=self.dtype)
            for pid, t in enumerate(init):
                self.flat16[self.offsets[pid]:self.offsets[pid + 1]].copy_(t.flatten())
                self.params[pid].data = self.flat16[self.offsets[pid]:self.offsets[pid + 1]].view(self.shapes[pid])
            part = plan.partition
            self.own = slice(rank * part, (rank + 1) * part)
            if self.stage == 0:
                self.flatgrad = torch.zeros(plan.flat_padded, dtype=self.dtype)
                for pid in range(len(self.numels)):
                    self.params[pid].grad = self.flatgrad[self.offsets[pid]:self.offsets[pid + 1]].view(self.shapes[pid])
            if self.stage == 0:
                src = self.flat16[: self.total]
                master = src if self.dtype == torch.float32 else src.float()
            else:
                master = self.flat16[self.own].float()
                self.gpart = None   # allocated by the first reduction of a step (grads_in_partition)
        else:
            self.c = [math.ceil(n / W) for n in self.numels]
            self.soff = [0]
            for c in self.c:
                self.soff.append(self.soff[-1] + c)
            self.shard16 = torch.zeros(self.soff[-1], dtype=self.dtype)
            for pid, t in enumerate(init):
                flat = torch.zeros(self.c[pid] * W)
                flat[: self.numels[pid]] = t.flatten()
                self.shard16[self.soff[pid]:self.soff[pid + 1]].copy_(flat[rank * self.c[pid]:(rank + 1) * self.c[pid]])
            for pid in plan.persistent:
                self.params[pid].data = init[pid].to(self.dtype)
            master = self.shard16.float()
            self.gpart = torch.zeros(self.soff[-1], dtype=self.dtype)
        del init
        self.master = torch.nn.Parameter(master, requires_grad=False)
        opt = sc.deepspeed.optimizer.params or {}
        self.opt = torch.optim.AdamW([self.master], lr=float(opt.get("lr", 1e-3)),
                                     betas=tuple(opt.get("betas", (0.9, 0.999))), eps=float(opt.get("eps", 1e-8)),
                                     weight_decay=float(opt.get("weight_decay", 0.01)), fused=True)
        # IPG bucket buffer (contiguous_gradients) for hook-time reductions of stages 2/3
        z = sc.zero
        # stage 3 with reduce_scatter fills the IPG buffer in gradient order and interleaves it
        # per rank at the reduction, as DeepSpeed does (reduce_scatter_coalesced); otherwise
        # stage 3 fills it rank-major and stages 1/2 in gradient order
        self.scatter_coalesced = self.stage == 3 and z.reduce_scatter
        rank_major = self.stage == 3 and not self.scatter_coalesced
        self.bucket_of: dict[tuple[int, int], tuple[int, int]] = {}
        for b in plan.buckets:
            o = 0
            for pid in b.pids:
                self.bucket_of[(b.micro, pid)] = (b.id, o)
                o += self.c[pid] if rank_major else self.numels[pid]
        self.contiguous = z.contiguous_gradients and self.stage >= 1
        self.ipg, self.ipg_numel = None, 0
        if self.contiguous and plan.buckets:
            size = min(z.reduce_bucket_size, self.total)
            if self.stage == 3:
                size = max(min(b.numel, size + W * len(b.pids)) for b in plan.buckets)   # padding slack
                self.ipg = torch.zeros(int(size), dtype=self.dtype)
            else:
                # stages 1/2: allocated at the first gradient of each backward and dropped at its
                # end (setup_buckets, _release_ipg_buffers), as zsim's ledger charges it
                self.ipg_numel = int(size)
        self.times: list[tuple[str, str, str, int, float, float]] = []
        # runs of post-step persistent gathers, launched async together as DeepSpeed's
        # _allgather_params_coalesced does (zsim Op.coalesced): first position -> the run's pids
        self.coalesced_runs: dict[int, list[int]] = {}
        for persistent, run in groupby(enumerate(plan.actions), key=lambda t: t[1].kind == "gather_persistent"):
            run = list(run)
            if persistent and len(run) > 1:
                self.coalesced_runs[run[0][0]] = [a.pids[0] for _, a in run]
        self.inflight: dict[int, tuple] = {}
        self.check_overflow = any(a.kind == "overflow" for a in plan.actions)

    # -- helpers -----------------------------------------------------------------------
    def P(self, pid):
        return self.params[pid]

    def _release(self, pid):
        if pid not in self.plan.persistent:
            self.params[pid].data = self.empty

    def _bucket_buffer(self, b):
        if self.stage == 0:
            pids = b.pids
            contiguous = all(pids[i + 1] == pids[i] + 1 for i in range(len(pids) - 1))
            if contiguous:
                return self.flatgrad[self.offsets[pids[0]]:self.offsets[pids[0]] + b.numel]
            return torch.cat([self.params[p].grad.reshape(-1) for p in pids])
        if self.stage == 1:
            # the boundary walk copies each accumulated .grad into the IPG buffer and drops it
            # (reduce_independent_p_g_buckets_and_remove_grads)
            if self.ipg is not None and b.numel <= self.ipg.numel():
                buf = self.ipg[: b.numel]
            else:
                buf = torch.empty(b.numel, dtype=self.dtype)
            o = 0
            for p in b.pids:
                buf[o: o + self.numels[p]].copy_(self.params[p].grad.reshape(-1))
                self.params[p].grad = None
                o += self.numels[p]
            return buf
        if self.ipg is not None and b.numel <= self.ipg.numel():
            return self.ipg[: b.numel]
        if self.stage == 2:
            if self._filled.get(b.id) is not None:
                return self._filled[b.id]
            return torch.cat([self._held[p].reshape(-1) for p in b.pids])
        return self._filled[b.id]

    def _fill(self):
        """Move ready gradients that belong to the open bucket into its buffer (grad hooks)."""
        while self.pending:
            pid = self.pending[0]
            bid, off = self.bucket_of[(self.micro, pid)]
            if bid != self.open_bucket:
                return
            self.pending.pop(0)
            p = self.params[pid]
            g = p.grad.reshape(-1)
            p.grad = None
            b = self.plan.buckets[bid]
            if self.ipg is not None and b.numel <= self.ipg.numel():
                buf = self.ipg
            elif self.stage == 3 or self.contiguous:
                buf = self._filled.get(bid)
                if buf is None:
                    buf = self._filled[bid] = torch.zeros(b.numel, dtype=self.dtype)
            else:
                self._held[pid] = g        # contiguous_gradients false: the grad waits for its bucket
                continue
            if self.stage == 3 and not self.scatter_coalesced:
                c, W, n = self.c[pid], self.world, self.numels[pid]
                seg = b.numel // W
                for r in range(W):
                    lo, hi = r * c, min((r + 1) * c, n)
                    dst = buf[r * seg + off: r * seg + off + c]
                    if hi > lo:
                        dst[: hi - lo].copy_(g[lo:hi])
                    if hi - lo < c:
                        dst[max(hi - lo, 0):].zero_()
            else:
                buf[off: off + self.numels[pid]].copy_(g)

    def _reduce(self, a):
        b = self.plan.buckets[a.bucket]
        call = b.calls[a.call]
        if a.call == 0:
            self._buf = self._bucket_buffer(b)
            self._cur = 0
        buf = self._buf
        W = self.world
        if call["collective"] == "reduce":
            pieces = call["pieces"]
            pos = self._positions(b)
            t = torch.cat([buf[pos[pid] + st: pos[pid] + st + ln] for _, pid, st, ln in pieces])
            self.comm.reduce(t, call["dst"])
            if call["dst"] == self.rank:
                o = 0
                for _, pid, st, ln in pieces:
                    self._own_write(self.offsets[pid] + st, t[o:o + ln])
                    o += ln
        elif call["collective"] == "reduce_scatter":
            flat = self._interleave(b, buf)
            flat.div_(W)   # pre-divide (reduce_scatter_coalesced): the step does not divide again
            out = torch.empty(b.numel // W, dtype=self.dtype)
            self.comm.reduce_scatter(out, flat)
            self._stage3_take(b, out)
        else:   # all_reduce of a chunk (or the whole bucket)
            chunk = buf[self._cur: self._cur + call["numel"]]
            self.comm.all_reduce(chunk)
            self._cur += call["numel"]
            if a.call == len(b.calls) - 1:
                if self.stage == 3:
                    seg = b.numel // W
                    self._stage3_take(b, buf[self.rank * seg:(self.rank + 1) * seg])
                else:
                    pos = self._positions(b)
                    part = self.plan.partition
                    for pid in b.pids:
                        lo = max(self.offsets[pid], self.rank * part)
                        hi = min(self.offsets[pid + 1], (self.rank + 1) * part)
                        if hi > lo:
                            st = lo - self.offsets[pid]
                            self._own_write(lo, buf[pos[pid] + st: pos[pid] + st + hi - lo])
        if a.call == len(b.calls) - 1:
            self._buf = None
            self._filled.pop(b.id, None)
            for p in b.pids:
                self._held.pop(p, None)
            self.open_bucket = b.id + 1
            self._fill()

    def _positions(self, b):
        pos, o = {}, 0
        for pid in b.pids:
            pos[pid] = o
            o += self.numels[pid]
        return pos

    def _partition_grads(self):
        if self.gpart is None:
            self.gpart = torch.zeros(self.plan.partition, dtype=self.dtype)
        return self.gpart

    def _own_write(self, flat_index, values):
        i = flat_index - self.rank * self.plan.partition
        dst = self._partition_grads()[i: i + values.numel()]
        if self.stage == 1:
            dst.copy_(values)
        else:
            dst.add_(values)

    def _interleave(self, b, buf):
        """coalesced_collectives.py reduce_scatter_coalesced: each rank's chunk of every gradient
        in the bucket (gradient order), padded to ceil(n/world), concatenated rank by rank into
        a new buffer (padding zeroed here, where DeepSpeed leaves it uninitialised)."""
        parts, o = [[] for _ in range(self.world)], 0
        for pid in b.pids:
            c, n = self.c[pid], self.numels[pid]
            g = buf[o: o + n]
            o += n
            for r in range(self.world):
                lo, hi = min(r * c, n), min((r + 1) * c, n)
                parts[r].append(g[lo:hi])
                if hi - lo < c:
                    parts[r].append(torch.zeros(c - (hi - lo), dtype=self.dtype))
        return torch.cat([t for ts in parts for t in ts])

    def _stage3_take(self, b, out):
        o = 0
        for pid in b.pids:
            self.gpart[self.soff[pid]:self.soff[pid + 1]].add_(out[o: o + self.c[pid]])
            o += self.c[pid]

    def _gather(self, pids):
        W = self.world
        inp = torch.cat([self.shard16[self.soff[p]:self.soff[p + 1]] for p in pids]) if len(pids) > 1 \
            else self.shard16[self.soff[pids[0]]:self.soff[pids[0] + 1]]
        S = inp.numel()
        out = torch.empty(S * W, dtype=self.dtype)
        self.comm.all_gather(out, inp)
        if len(pids) == 1:
            p = pids[0]
            self.params[p].data = out[: self.numels[p]].view(self.shapes[p])
            return
        view = out.view(W, S)
        o = 0
        for p in pids:
            c = self.c[p]
            self.params[p].data = view[:, o:o + c].reshape(-1)[: self.numels[p]].view(self.shapes[p])
            o += c

    def _launch_coalesced(self, pids):
        W = self.world
        for p in pids:
            inp = self.shard16[self.soff[p]:self.soff[p + 1]]
            out = torch.empty(inp.numel() * W, dtype=self.dtype)
            self.inflight[p] = (self.comm.all_gather(out, inp, async_op=True), out)

    def _finish_gather(self, p):
        handle, out = self.inflight.pop(p)
        handle.wait()
        self.params[p].data = out[: self.numels[p]].view(self.shapes[p])

    def _grad_pieces(self):
        """The local gradient partition as DeepSpeed's averaged_gradients: one view per parameter
        with elements in it, plus the alignment padding of the last partition."""
        if self.stage == 3:
            return [self.gpart[self.soff[p]:self.soff[p + 1]] for p in range(len(self.numels))], []
        lo, hi = self.own.start, self.own.stop
        gpart = self._partition_grads()
        pieces = []
        for p in range(len(self.numels)):
            a, b = max(lo, self.offsets[p]), min(hi, self.offsets[p + 1])
            if a < b:
                pieces.append(gpart[a - lo:b - lo])
        covered = min(hi, self.total) - lo
        return pieces, ([gpart[covered:]] if covered < hi - lo else [])

    def _fp32_grads(self):
        if self.stage == 0:
            return self.flatgrad[: self.total].float().div_(self.world)
        # flattened (a new buffer, as self.flatten(averaged_gradients)) and then converted
        pieces, pad = self._grad_pieces()
        flat = torch.cat(pieces + pad).float()
        return flat if self.scatter_coalesced else flat.div_(self.world)

    def _norm_and_overflow_local(self):
        """DeepSpeed's passes before the scalar all-reduces: each piece checked for inf/NaN with
        amax/amin when the overflow flag is reduced (has_inf_or_nan), and its norm taken in fp64
        (get_grad_norm_direct, get_norm_dtype)."""
        pieces, _ = self._grad_pieces()
        if self.check_overflow:
            self._bad = overflow_count(pieces)
        sq = squared_norm(pieces)
        if not self.scatter_coalesced:   # the pieces hold sums over ranks; the step divides them
            sq = sq / self.world ** 2
        self._sq = sq.float()

    def _step(self):
        g = self._fp32_grads()
        if self.clip > 0:
            norm = self._norm if self._norm is not None else torch.dot(g, g).sqrt()
            coef = self.clip / (float(norm) + 1e-6)
            if coef < 1.0:
                g.mul_(coef)
        self.master.grad = g
        self.opt.step()
        self.master.grad = None
        if self.stage == 0:
            if self.master.data_ptr() != self.flat16.data_ptr():
                self.flat16[: self.total].copy_(self.master)
            self.flatgrad.zero_()
        elif self.stage < 3:
            self.flat16[self.own].copy_(self.master)
            self.gpart = None   # averaged_gradients dropped after the step
        else:
            self.shard16.copy_(self.master)
            self.gpart.zero_()

    # -- one optimizer step ------------------------------------------------------------------
    def train_step(self, step: int, record: bool = False) -> list[float]:
        """Run every op of the schedule once; returns the local loss of each micro-step."""
        batches = [batch(self.sc, step, m, self.rank, self.seed) for m in range(self.gas)]
        env: dict = {}
        grads: dict = {}
        saved: dict = {}
        losses = []
        self.pending, self.open_bucket, self._filled, self._held = [], 0, {}, {}
        self._norm, self._buf = None, None
        self.micro = 0
        times = []
        t_start = time.perf_counter()
        for pos, a in enumerate(self.plan.actions):
            t0 = time.perf_counter()
            self.comm.phase = {"recompute": "backward"}.get(a.phase, a.phase)
            k = a.kind
            if self.ipg is not None and self.ipg_numel and a.phase not in ("backward", "recompute"):
                self.ipg = None   # the backward epilogue
            if k == "fwd":
                if a.micro != self.micro or not env:
                    self.micro = a.micro
                    ids, labels = batches[a.micro]
                    env = {"ids": ids, "labels": labels}
                s = self.segs[a.module]
                ins = [env[n].detach().requires_grad_(True) if env[n].is_floating_point() else env[n]
                       for n in s.inputs]
                with torch.enable_grad():
                    out = s.fn(self.P, *ins)
                if a.module == "loss":
                    losses.append(float(out.detach()))
                    out = out / self.gas
                env[s.output] = out
                saved[a.module] = (ins, out)
            elif k == "bwd":
                s = self.segs[a.module]
                ins, out = saved.pop(a.module)
                if a.module == "loss":
                    torch.autograd.backward(out)
                else:
                    torch.autograd.backward(out, grads.pop(s.output))
                env.pop(s.output, None)
                for n, t in zip(s.inputs, ins):
                    if t.is_floating_point() and t.grad is not None:
                        grads[n] = grads[n] + t.grad if n in grads else t.grad
                del ins, out
                if a.pids and self.ipg_numel and self.ipg is None:
                    self.ipg = torch.empty(self.ipg_numel, dtype=self.dtype)
                if a.pids and self.stage >= 2:
                    self.pending.extend(a.pids)
                    self._fill()
            elif k == "gather":
                self._gather(list(a.pids))
            elif k == "gather_persistent":
                if pos in self.coalesced_runs:
                    self._launch_coalesced(self.coalesced_runs[pos])
                if a.pids[0] in self.inflight:
                    self._finish_gather(a.pids[0])
                else:
                    self._gather(list(a.pids))
            elif k == "reduce":
                self._reduce(a)
            elif k == "grads_allreduce":
                i = int(a.name.rsplit(" ", 1)[1])
                lo = i * int(5e8)
                self.comm.all_reduce(self.flatgrad[lo: lo + a.numel])
            elif k == "norm_local":
                self._norm_and_overflow_local()
            elif k == "overflow":
                flag = self._bad.to(torch.uint8)
                self.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            elif k == "norm_allreduce":
                t = self._sq.reshape(1).clone()
                self.comm.all_reduce(t)
                self._norm = t.sqrt()[0]
            elif k == "adam":
                self._step()
            elif k == "gather_updated":
                self.comm.all_gather(self.flat16, self.flat16[self.own])
            else:
                raise RuntimeError(f"unknown action {k}")
            for pid in a.releases:
                self._release(pid)
            t1 = time.perf_counter()
            if record:
                times.append((a.name, a.stream, a.phase, a.micro, t0 - t_start, t1 - t0))
        if record:
            self.times = times
        return losses
