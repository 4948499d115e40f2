"""The one torch GPT of calibration, built from a scenario's ModelSpec.

It mirrors zsim/workload/transformer.py module for module: the same module names, the same
parameters in the same registration order (tied weights registered once), so the simulator's
op names ("forward layers.0.attn.qkv") and its parameter ids map onto this model, and
DeepSpeed's flat groups, buckets and ZeRO-3 module trace match what zsim schedules
(tests/test_gpt.py checks the mirror for every model variant the workload supports).

It runs two ways, through the same code:
- As an nn.Module, `GPT(spec)(ids, labels) -> loss`: what DeepSpeed, FSDP2 and DDP wrap
  (calibration/core/peers.py), what the fixture recorder hands DeepSpeed
  (calibration/deepspeed_record/) and whose block the calibration worker times
  (calibration/harness/bench_compute.py). Every container and every module with parameters
  is *called* as a module, so ZeRO-3's per-module hooks see the tree zsim schedules.
- Segment by segment, `GPT(spec).segments()`: one Segment per workload module
  (inputs -> output) that can be run and back-propagated on its own, with the parameters
  supplied by the caller (`P(pid)`); the training core runs the schedule op by op this way
  (gathers before a module, releases and gradient buckets after it). The core owns the
  parameters as leaf tensors and swaps their storage in and out (p.data = ...) the way
  DeepSpeed ZeRO-3 does, so autograd's saved weights see the re-gathered data in backward.

A module's direct parameters and its segment's work are one leaf (`_Leaf.run`): the module
path passes its own parameters, the segment path the core's. Parameterless workload modules
(attention core, MLP activation, loss) are plain functions, not nn.Modules, as in HF models:
DeepSpeed's module trace does not see them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from calibration.core.moe import build_moe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NORM_EPS = 1e-5


@dataclass
class Segment:
    name: str
    inputs: tuple[str, ...]
    output: str
    fn: Callable


class _Linear(torch.autograd.Function):
    """y = x W^T + b that saves the weight *itself* (not a transposed view), as DeepSpeed's
    zero3_linear_wrap does: ZeRO-3 releases a weight by swapping its storage out (p.data = empty),
    which frees the memory only if autograd holds no separate view of the old storage; the
    re-gather before backward swaps the data back in."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g @ w
        g2 = g.reshape(-1, g.shape[-1])
        gw = g2.t() @ x.reshape(-1, x.shape[-1])
        gb = g2.sum(0) if ctx.has_bias else None
        return gx, gw, gb


def swappable_linear(x, w, b=None):
    """The segment path's linear: the core swaps weights as ZeRO-3 does (see _Linear). A model
    handed to DeepSpeed or FSDP is not built under deepspeed.zero.Init (which installs
    zero3_linear_wrap), so the module path runs F.linear, as an HF model does there."""
    return _Linear.apply(x, w, b)


# ----------------------------------------------------------------------------- leaves
class _Leaf(nn.Module):
    """A workload module with direct parameters: `run(weights, linear, *inputs)` is its work."""

    def forward(self, *inputs):
        return self.run(tuple(self._parameters.values()), F.linear, *inputs)


class Embedding(_Leaf):
    """Token embedding (wte): rows of the table."""

    def __init__(self, rows: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))

    def run(self, ws, linear, ids):
        return F.embedding(ids, ws[0])


class PositionEmbedding(_Leaf):
    """Learned positions (wpe), added to the token embedding."""

    def __init__(self, rows: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))

    def run(self, ws, linear, x):
        return x + ws[0][: x.shape[1]]


class Norm(_Leaf):
    def __init__(self, kind: str, hidden: int):
        super().__init__()
        self.kind, self.hidden = kind, hidden
        self.weight = nn.Parameter(torch.empty(hidden))
        if kind == "layernorm":
            self.bias = nn.Parameter(torch.empty(hidden))

    def run(self, ws, linear, x):
        if self.kind == "layernorm":
            return F.layer_norm(x, (self.hidden,), ws[0], ws[1], NORM_EPS)
        return F.rms_norm(x, (self.hidden,), ws[0], NORM_EPS)


class Linear(_Leaf):
    """y = x W^T (+ b), plus the residual stream when given one: zsim's workload charges the
    residual add of o_proj and fc_out to those modules (transformer.py fwd_mem)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, weight: nn.Parameter | None = None):
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(torch.empty(n_out, n_in))
        if bias:
            self.bias = nn.Parameter(torch.empty(n_out))

    def run(self, ws, linear, x, residual=None):
        y = linear(x, ws[0], ws[1] if len(ws) > 1 else None)
        return y if residual is None else residual + y


# ----------------------------------------------------------------------------- parameterless ops
def attend(heads: int, kv_heads: int, head_dim: int, q, k, v):
    """Causal SDPA over (B, S, heads * head_dim) projections; GQA when kv_heads < heads."""
    B, S, _ = q.shape
    q = q.reshape(B, S, heads, head_dim).transpose(1, 2)
    k = k.reshape(B, S, kv_heads, head_dim).transpose(1, 2)
    v = v.reshape(B, S, kv_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    return o.transpose(1, 2).reshape(B, S, heads * head_dim)


def cross_entropy(logits, labels):
    """HF-style loss: logits upcast to fp32, mean cross-entropy over the micro-batch's tokens."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


# ----------------------------------------------------------------------------- containers
class _Graph(nn.Module):
    """A container whose forward runs its steps in order. A step (name, inputs, output) calls a
    child module (its hooks fire) or a parameterless op, reading and writing named values; the
    same steps, flattened, are the training core's segments."""

    inputs: tuple[str, ...]
    output: str

    def __init__(self, inputs: tuple[str, ...], output: str):
        super().__init__()
        self.inputs, self.output = inputs, output
        self.steps: list[tuple[str, tuple[str, ...], str]] = []
        self.ops: dict[str, Callable] = {}

    def forward(self, *args):
        env = dict(zip(self.inputs, args))
        for name, ins, out in self.steps:
            f = self.ops[name] if name in self.ops else self.get_submodule(name)
            env[out] = f(*[env[i] for i in ins])
        return env[self.output]


class Attention(_Graph):
    def __init__(self, m):
        super().__init__(("a", "x"), "x1")
        h, kvd = m.hidden, m.n_kv_heads * (m.hidden // m.heads)
        core = lambda *qkv: attend(m.heads, m.n_kv_heads, h // m.heads, *qkv)
        if m.fused_qkv:
            self.qkv = Linear(h, h + 2 * kvd, m.bias)
            self.steps.append(("qkv", ("a",), "qkv"))
            self.ops["core"] = lambda qkv: core(*qkv.split([h, kvd, kvd], dim=-1))
            self.steps.append(("core", ("qkv",), "c"))
        else:
            self.q_proj = Linear(h, h, m.bias)
            self.k_proj = Linear(h, kvd, m.bias)
            self.v_proj = Linear(h, kvd, m.bias)
            self.steps += [(f"{n}_proj", ("a",), n) for n in "qkv"]
            self.ops["core"] = core
            self.steps.append(("core", ("q", "k", "v"), "c"))
        self.o_proj = Linear(h, h, m.bias)
        self.steps.append(("o_proj", ("c", "x"), "x1"))


class MLP(_Graph):
    def __init__(self, m):
        super().__init__(("b", "x1"), "x2")
        h, f = m.hidden, m.ffn
        if m.glu:
            self.gate_proj = Linear(h, f, m.bias)
            self.up_proj = Linear(h, f, m.bias)
            self.ops["act"] = lambda g, u: F.silu(g) * u
            self.steps += [("gate_proj", ("b",), "gate"), ("up_proj", ("b",), "up"), ("act", ("gate", "up"), "g")]
        else:
            self.fc_in = Linear(h, f, m.bias)
            # tanh GELU, as GPT-2's gelu_new
            self.ops["act"] = lambda x: F.gelu(x, approximate="tanh")
            self.steps += [("fc_in", ("b",), "f"), ("act", ("f",), "g")]
        self.fc_out = Linear(f, h, m.bias)
        self.steps.append(("fc_out", ("g", "x1"), "x2"))


class Block(_Graph):
    def __init__(self, m, layer: int, expert_parallel_size: int):
        super().__init__(("x",), "x2")
        self.ln_1 = Norm(m.norm, m.hidden)
        self.attn = Attention(m)
        self.ln_2 = Norm(m.norm, m.hidden)
        self.mlp = build_moe(_Graph, Linear, m, expert_parallel_size) if m.is_moe_layer(layer) else MLP(m)
        self.steps = [("ln_1", ("x",), "a"), ("attn", ("a", "x"), "x1"), ("ln_2", ("x1",), "b"),
                      ("mlp", ("b", "x1"), "x2")]


class GPT(_Graph):
    """Decoder-only GPT from a zsim ModelSpec; forward(ids, labels) -> mean loss. With expert
    parallelism it holds one rank's experts (calibration/core/moe.py)."""

    def __init__(self, m, expert_parallel_size: int = 1):
        super().__init__(("ids", "labels"), "loss")
        h = m.hidden
        self.wte = Embedding(m.vocab, h)
        self.steps.append(("wte", ("ids",), "x.emb"))
        cur = "x.emb"
        if m.position == "learned":
            self.wpe = PositionEmbedding(m.seq_len, h)
            self.steps.append(("wpe", (cur,), "x.pos"))
            cur = "x.pos"
        if m.embedding_norm:
            self.emb_ln = Norm(m.norm, h)
            self.steps.append(("emb_ln", (cur,), "x.embln"))
            cur = "x.embln"
        self.layers = nn.ModuleList([Block(m, i, expert_parallel_size) for i in range(m.layers)])
        for i in range(m.layers):
            self.steps.append((f"layers.{i}", (cur,), f"layers.{i}.x2"))
            cur = f"layers.{i}.x2"
        self.ln_f = Norm(m.norm, h)
        # the lm_head is a Linear whose weight is wte's when tied (DeepSpeed ZeRO-3 fetches it again)
        self.lm_head = Linear(h, m.vocab, False, weight=self.wte.weight if m.tied_embeddings else None)
        self.ops["loss"] = cross_entropy
        self.steps += [("ln_f", (cur,), "x.f"), ("lm_head", ("x.f",), "logits"), ("loss", ("logits", "labels"), "loss")]

    def initialized(self, seed: int) -> "GPT":
        """This model with init_params' values (the training core's initial parameters)."""
        params = list(self.parameters())
        values = initial_values([n for n, _ in self.named_parameters()], [tuple(p.shape) for p in params], seed)
        with torch.no_grad():
            for p, t in zip(params, values):
                p.copy_(t)
        return self

    def segments(self) -> dict[str, Segment]:
        """One segment per workload module, in forward order; a segment's fn(P, *inputs) takes
        its parameters from P(pid), pid the index in self.parameters() (the workload's order)."""
        pid = {id(p): i for i, p in enumerate(self.parameters())}
        out: dict[str, Segment] = {}

        def flatten(graph: _Graph, prefix: str, values: dict[str, str]):
            for name, ins, res in graph.steps:
                path = prefix + name
                ins = tuple(values.get(i, prefix + i) for i in ins)
                res = values.get(res, prefix + res)
                if name in graph.ops:
                    op = graph.ops[name]
                    out[path] = Segment(path, ins, res, lambda P, *x, op=op: op(*x))
                    continue
                child = graph.get_submodule(name)
                if isinstance(child, _Graph):
                    flatten(child, path + ".", {**dict(zip(child.inputs, ins)), child.output: res})
                    continue
                pids = tuple(pid[id(p)] for p in child._parameters.values())
                out[path] = Segment(path, ins, res, lambda P, *x, leaf=child, pids=pids:
                                    leaf.run(tuple(P(i) for i in pids), swappable_linear, *x))

        flatten(self, "", {"ids": "ids", "labels": "labels", "loss": "loss"})
        return out


# ----------------------------------------------------------------------------- the core's view
def param_shapes(wl) -> list[tuple[int, ...]]:
    """Shape of every workload param, from the module that owns it."""
    shapes: dict[int, tuple[int, ...]] = {}
    hidden = next(wl.params[m.params[0]].numel for m in wl.modules if m.kind == "norm")
    for m in wl.modules:
        for pid in m.params:
            if pid in shapes:
                continue
            name = wl.params[pid].name
            n = wl.params[pid].numel
            if m.kind == "linear":
                _, n_out, n_in = m.gemm
                shapes[pid] = (n_out, n_in) if name.endswith(".weight") else (n_out,)
            elif m.kind == "embedding":
                shapes[pid] = (n // hidden, hidden)
            else:
                shapes[pid] = (n,)
    return [shapes[i] for i in range(len(wl.params))]


def initial_values(names, shapes, seed: int) -> list[torch.Tensor]:
    """fp32 initial values (GPT-2 style), identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in zip(names, shapes):
        if name.endswith(".bias"):
            t = torch.zeros(shape)
        elif len(shape) == 1:          # norm weights
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=g) * 0.02
        out.append(t)
    return out


def init_params(wl, shapes, seed: int) -> list[torch.Tensor]:
    return initial_values([p.name for p in wl.params], shapes, seed)


def build_segments(sc, wl) -> dict[str, Segment]:
    """The scenario's GPT (on the meta device: the core owns the parameters) as segments."""
    with torch.device("meta"):
        segs = GPT(sc.model, sc.expert_parallel_size).segments()
    missing = [m.name for m in wl.modules if m.name not in segs]
    if missing:
        raise ValueError(f"modules without a segment: {missing}")
    return segs


def batch(sc, step: int, micro: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic token ids and labels of one rank's micro-batch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + micro * 101 + rank)
    x = torch.randint(0, sc.model.vocab, (sc.micro_batch_size, sc.seq_len + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def run_forward_backward(segs, order, P, ids, labels, scale: float = 1.0) -> float:
    """Plain (unsharded) forward + backward through the segments in one autograd graph."""
    env = {"ids": ids, "labels": labels}
    for name in order:
        s = segs[name]
        env[s.output] = s.fn(P, *[env[k] for k in s.inputs])
    loss = env["loss"]
    (loss * scale).backward()
    return float(loss.detach())
