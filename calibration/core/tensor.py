"""Megatron-LM tensor parallelism in plain torch.distributed (gloo): the training core's TP
model, run by calibration/core/tensor_run.py.

Shoeybi et al. 2019 / Megatron-LM core/tensor_parallel (layers.py, mappings.py, cross_entropy.py):
- column-parallel linears (attention's fused QKV by heads, the MLP's fc_in) take their input
  through `f` (copy_to_tensor_model_parallel_region: identity forward, all-reduce backward);
- row-parallel linears (o_proj, fc_out) hand their partial output to `g`
  (reduce_from_tensor_model_parallel_region: all-reduce forward, identity backward); their
  bias is added once, after the reduction;
- with sequence parallelism (Korthikanti et al. 2022) `f` becomes an all-gather along the
  sequence (in backward the all-gather again, the saved input being the shard, then a
  reduce-scatter) and `g` a reduce-scatter (all-gather in backward); the layer norms,
  residuals and biases run on the rank's sequence shard, and the gradients of those
  replicated over the TP group (norms, row-parallel biases: Megatron's `sequence_parallel`
  params; not the positions, added before the scatter) are all-reduced over it in one
  flattened call (finalize_model_grads' _allreduce_non_tensor_model_parallel_grads);
- VocabParallelEmbedding: each rank holds V/t rows, looks up its own ids, zeros the others,
  and the partial embeddings are all-reduced; with SP the sum (positions added) is split into
  sequence shards (its gradient all-gathered; LanguageModelEmbedding, reduce_scatter_embeddings
  off with learned positions);
- the LM head is column-parallel over the vocabulary and the loss is
  _VocabParallelCrossEntropy: the logits' max, the target logit and the sum of exponentials
  all-reduced over the TP group, the gradient (softmax - one-hot) computed locally.

Every TP call is logged as (phase, collective, numel, bytes, "tensor"): numel as the fixtures
count it (the output of an all-gather, the input of a reduce-scatter).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from calibration.core.layers import NORM_EPS, attend

TENSOR = "tensor"   # zsim's Group.TENSOR (the tp branch's contract), as the calls are tagged


class TPComm:
    """The tensor-parallel group's calls, logged with the pass they run in."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank
        self.log: list[tuple] | None = None
        self.phase = "forward"

    def _rec(self, kind: str, t: torch.Tensor):
        if self.log is not None:
            self.log.append((self.phase, kind, int(t.numel()), int(t.numel() * t.element_size()), TENSOR))

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        self._rec("all_reduce", t)
        dist.all_reduce(t, op=op, group=self.group)
        return t

    def all_gather_seq(self, x: torch.Tensor) -> torch.Tensor:
        """The sequence shards (dim 1) of every rank, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        out = torch.cat(parts, dim=1)
        self._rec("all_gather", out)
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def reduce_scatter_seq(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of this rank's sequence shard (dim 1)."""
        self._rec("reduce_scatter", x)
        chunks = [c.contiguous() for c in x.chunk(self.size, dim=1)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, group=self.group)
        return out


class _Region(torch.autograd.Function):
    """Megatron's mappings.py regions: `forward_fn` on the way in, `backward_fn` on the gradient."""

    @staticmethod
    def forward(ctx, x, forward_fn, backward_fn):
        ctx.backward_fn = backward_fn
        return forward_fn(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.backward_fn(g), None, None


def _identity(x):
    return x.view_as(x)


def _reduced(comm):
    return lambda x: comm.all_reduce(x.contiguous().clone())


def copy_to_tp(x, comm):                     # f: identity forward, all-reduce backward
    return _Region.apply(x, _identity, _reduced(comm))


def reduce_from_tp(x, comm):                 # g: all-reduce forward, identity backward
    return _Region.apply(x, _reduced(comm), _identity)


def reduce_scatter_to_sp(x, comm):           # g with SP: reduce-scatter forward, all-gather backward
    return _Region.apply(x, comm.reduce_scatter_seq, comm.all_gather_seq)


class _SequenceParallelColumnLinear(torch.autograd.Function):
    """A column-parallel linear under SP as Megatron's LinearWithGradAccumulationAndAsync
    Communication runs it (tensor_parallel/layers.py): forward all-gathers the sequence shards
    but keeps only the shard for backward, which all-gathers it again (for the weight gradient)
    before reduce-scattering the input gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, comm):
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.has_bias = comm, bias is not None
        return F.linear(comm.all_gather_seq(x), weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        total = ctx.comm.all_gather_seq(x)
        grad_x = ctx.comm.reduce_scatter_seq(g.matmul(weight))
        g2 = g.reshape(-1, g.shape[-1])
        grad_w = g2.t().matmul(total.reshape(-1, total.shape[-1]))
        return grad_x, grad_w, g2.sum(0) if ctx.has_bias else None, None


def scatter_to_sp(x, comm):                  # split into sequence shards, all-gather backward
    return _Region.apply(x, lambda t: t.chunk(comm.size, dim=1)[comm.rank].contiguous(), comm.all_gather_seq)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron core/tensor_parallel/cross_entropy.py: per-token loss over vocab-sharded logits."""

    @staticmethod
    def forward(ctx, logits, target, lo, comm):
        logits = logits.float()
        peak = logits.max(dim=-1).values
        comm.all_reduce(peak, op=dist.ReduceOp.MAX)
        logits = logits - peak.unsqueeze(-1)
        mask = (target < lo) | (target >= lo + logits.shape[-1])
        local = (target - lo).masked_fill(mask, 0)
        predicted = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(mask, 0.0)
        comm.all_reduce(predicted)
        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mask)
        return sum_exp.log() - predicted

    @staticmethod
    def backward(ctx, g):
        softmax, local, mask = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), -(~mask).float().unsqueeze(-1))
        return grad * g.unsqueeze(-1), None, None, None


# ----------------------------------------------------------------------------- sharding
def supported(m) -> str | None:
    """Why the TP model cannot mirror this ModelSpec (None when it can)."""
    if m.norm != "layernorm" or not m.fused_qkv or m.glu or m.position != "learned" or m.tied_embeddings:
        return "a GPT-2-style model (layernorm, fused QKV, GELU MLP, learned positions, untied head)"
    if m.n_kv_heads != m.heads or m.post_norms or m.parallel_residual or m.post_layernorm or m.embed_proj_dim \
            or m.moe is not None or m.mla is not None or m.qk_norm or m.embedding_norm:
        return "multi-head attention, pre-LN, sequential residual, no MoE"
    return None


def shard(name: str, full: torch.Tensor, m, rank: int, size: int) -> tuple[torch.Tensor, bool]:
    """This TP rank's part of a parameter and whether it is partitioned (not a duplicate)."""
    def rows(t):
        n = t.shape[0] // size
        return t[rank * n:(rank + 1) * n]

    if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
        # [q; k; v], each heads x head_size rows: this rank's heads of each
        h = m.heads // size
        return full.reshape(3, m.heads, -1)[:, rank * h:(rank + 1) * h].reshape(-1, *full.shape[1:]), True
    if name in ("wte.weight", "lm_head.weight") or name.endswith("fc_in.weight") or name.endswith("fc_in.bias"):
        return rows(full), True
    if name.endswith("o_proj.weight") or name.endswith("fc_out.weight"):
        return rows(full.t()).t(), True
    return full, False


class TPModel:
    """One TP rank's parameters (leaf tensors by workload name) and the forward of its layers."""

    def __init__(self, sc, comm: TPComm, sp: bool, seed: int, dtype):
        from calibration.core.model import init_params, param_shapes
        from zsim.schedule.build import workload_for

        m = sc.model
        self.m, self.comm, self.sp, self.t = m, comm, sp, comm.size
        if m.heads % self.t or m.vocab % self.t or m.ffn % self.t or (sp and sc.seq_len % self.t):
            raise SystemExit(f"tensor parallel {self.t} must divide heads, vocab, ffn (and seq_len with SP)")
        # the whole model's parameters, each rank taking its shard below (a scenario that sets
        # parallelism.tensor describes one rank's already)
        whole = replace(sc, parallelism=replace(sc.parallelism, tensor=1, sequence_parallel=False))
        wl = workload_for(whole)
        self.params, self.partitioned = {}, {}
        for p, value in zip(wl.params, init_params(wl, param_shapes(wl), seed)):
            local, part = shard(p.name, value, m, comm.rank, self.t)
            # a row shard is a view of the whole tensor: cloned, so the rank holds its part only
            # (a view would keep the whole weight's storage alive: the peak measured 8% high)
            self.params[p.name] = local.to(dtype).contiguous().clone().requires_grad_(True)
            self.partitioned[p.name] = part
        # Megatron's `sequence_parallel` params: replicated, run on the sequence shard, their
        # gradients partial sums (the position embedding is added before the scatter: whole)
        self.partial_grad = {n: sp and not part and n != "wpe.weight" for n, part in self.partitioned.items()}

    def W(self, name):
        return self.params[name]

    def _column(self, x, name: str, bias: bool = True):     # a column-parallel linear
        w, b = self.W(name + ".weight"), self.W(name + ".bias") if bias else None
        if self.sp:
            return _SequenceParallelColumnLinear.apply(x, w, b, self.comm)
        return F.linear(copy_to_tp(x, self.comm), w, b)

    def _out_of_tp(self, x):   # after a row-parallel linear
        return reduce_scatter_to_sp(x, self.comm) if self.sp else reduce_from_tp(x, self.comm)

    def _norm(self, x, name):
        return F.layer_norm(x, (x.shape[-1],), self.W(name + ".weight"), self.W(name + ".bias"), NORM_EPS)

    def embed(self, ids):
        w = self.W("wte.weight")
        lo = self.comm.rank * w.shape[0]
        mask = (ids < lo) | (ids >= lo + w.shape[0])
        e = F.embedding((ids - lo).masked_fill(mask, 0), w).masked_fill(mask.unsqueeze(-1), 0.0)
        # LanguageModelEmbedding with learned positions: the word embeddings all-reduced (not
        # reduce-scattered: reduce_scatter_embeddings needs no position embedding), the positions
        # added, and with SP the sum split into sequence shards
        e = reduce_from_tp(e, self.comm) + self.W("wpe.weight")[:ids.shape[1]]
        return scatter_to_sp(e, self.comm) if self.sp else e

    def block(self, i: int, x):
        p, m = f"layers.{i}.", self.m
        qkv = self._column(self._norm(x, p + "ln_1"), p + "attn.qkv")
        h = m.heads // self.t
        q, k, v = qkv.split(h * m.head_size, dim=-1)
        c = attend(h, h, m.head_size, q, k, v)
        x1 = x + self._out_of_tp(F.linear(c, self.W(p + "attn.o_proj.weight"))) + self.W(p + "attn.o_proj.bias")
        f = F.gelu(self._column(self._norm(x1, p + "ln_2"), p + "mlp.fc_in"), approximate="tanh")
        return x1 + self._out_of_tp(F.linear(f, self.W(p + "mlp.fc_out.weight"))) + self.W(p + "mlp.fc_out.bias")

    def head_loss(self, x, labels):
        logits = self._column(self._norm(x, "ln_f"), "lm_head", bias=False)
        lo = self.comm.rank * logits.shape[-1]
        return _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), lo,
                                                self.comm).mean()
