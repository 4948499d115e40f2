"""The one torch GPT of calibration, built from a scenario's ModelSpec.

It mirrors zsim/workload/transformer.py module for module: the same module names, the same
parameters in the same registration order (tied weights registered once), so the simulator's
op names ("forward layers.0.attn.qkv") and its parameter ids map onto this model, and
DeepSpeed's flat groups, buckets and ZeRO-3 module trace match what zsim schedules
(tests/workload/test_gpt.py checks the mirror for every model variant the workload supports).

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

A module's direct parameters and its segment's work are one leaf (`_Leaf.run`, in
calibration/core/layers.py): the module
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

from calibration.core.layers import (Embedding, HeadNorm, Linear, Norm, PositionEmbedding, attend, cross_entropy, mla_core,
                                     own_params, swappable_linear)
from calibration.core.moe import build_moe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Segment:
    name: str
    inputs: tuple[str, ...]
    output: str
    fn: Callable


# ----------------------------------------------------------------------------- containers
class Graph(nn.Module):
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


class Attention(Graph):
    """q/k/v (fused or not) or MLA's projections, the core, o_proj; o_proj adds the residual
    unless a post norm follows (Gemma-2: the block adds it after post_attn_ln)."""

    def __init__(self, m, layer: int):
        super().__init__(("a", "x"), "x1")
        h = m.hidden
        residual = () if m.post_norms else ("x",)
        if m.mla is not None:
            self._mla(m)
            v_heads = m.heads * m.mla.v_head_dim
        else:
            hd = m.head_size
            qd, kvd = m.heads * hd, m.n_kv_heads * hd
            window = m.sliding_window if m.has_window(layer) else None
            core = lambda *qkv: attend(m.heads, m.n_kv_heads, hd, *qkv, window=window)
            if m.fused_qkv:
                self.qkv = Linear(h, qd + 2 * kvd, m.qkv_proj_bias)
                self.steps.append(("qkv", ("a",), "qkv"))
                self.ops["core"] = lambda qkv: core(*qkv.split([qd, kvd, kvd], dim=-1))
                self.steps.append(("core", ("qkv",), "c"))
            else:
                self.q_proj = Linear(h, qd, m.qkv_proj_bias)
                if m.qk_norm:
                    self.q_norm = HeadNorm(m.norm, hd)
                self.k_proj = Linear(h, kvd, m.qkv_proj_bias)
                if m.qk_norm:
                    self.k_norm = HeadNorm(m.norm, hd)
                self.v_proj = Linear(h, kvd, m.qkv_proj_bias)
                if m.qk_norm:   # Qwen3: q_proj, q_norm, k_proj, k_norm, v_proj
                    self.steps += [("q_proj", ("a",), "q0"), ("q_norm", ("q0",), "q"), ("k_proj", ("a",), "k0"),
                                   ("k_norm", ("k0",), "k"), ("v_proj", ("a",), "v")]
                else:
                    self.steps += [(f"{n}_proj", ("a",), n) for n in "qkv"]
                self.ops["core"] = core
                self.steps.append(("core", ("q", "k", "v"), "c"))
            v_heads = qd
        self.o_proj = Linear(v_heads, h, m.attn_bias)
        self.steps.append(("o_proj", ("c", *residual), "x1"))

    def _mla(self, m):
        mla, h, H = m.mla, m.hidden, m.heads
        if mla.q_lora_rank is not None:
            self.q_a_proj = Linear(h, mla.q_lora_rank, m.attn_bias)
            self.q_a_layernorm = Norm(m.norm, mla.q_lora_rank)
            self.q_b_proj = Linear(mla.q_lora_rank, H * mla.qk_head_dim, False)
            self.steps += [("q_a_proj", ("a",), "qa"), ("q_a_layernorm", ("qa",), "qan"), ("q_b_proj", ("qan",), "q")]
        else:
            self.q_proj = Linear(h, H * mla.qk_head_dim, False)
            self.steps.append(("q_proj", ("a",), "q"))
        self.kv_a_proj_with_mqa = Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, m.attn_bias)
        self.kv_a_layernorm = Norm(m.norm, mla.kv_lora_rank)
        self.kv_b_proj = Linear(mla.kv_lora_rank, H * (mla.qk_nope_head_dim + mla.v_head_dim), False)
        self.ops["core"] = lambda q, kv, kv_a: mla_core(m, q, kv, kv_a)
        self.steps += [("kv_a_proj_with_mqa", ("a",), "kva"), ("kv_a_layernorm", ("kva",), "kvn"),
                       ("kv_b_proj", ("kvn",), "kv"), ("core", ("q", "kv", "kva"), "c")]


class MLP(Graph):
    """fc_out adds the residual unless a post norm follows (Gemma-2)."""

    def __init__(self, m):
        super().__init__(("b", "x1"), "x2")
        h, f, bias = m.hidden, m.ffn, m.mlp_proj_bias
        if m.glu and m.fused_gate_up:
            self.gate_up_proj = Linear(h, 2 * f, bias)
            self.ops["act"] = lambda gu: F.silu(gu[..., :f]) * gu[..., f:]
            self.steps += [("gate_up_proj", ("b",), "gu"), ("act", ("gu",), "g")]
        elif m.glu:
            self.gate_proj = Linear(h, f, bias)
            self.up_proj = Linear(h, f, bias)
            self.ops["act"] = lambda g, u: F.silu(g) * u
            self.steps += [("gate_proj", ("b",), "gate"), ("up_proj", ("b",), "up"), ("act", ("gate", "up"), "g")]
        else:
            self.fc_in = Linear(h, f, bias)
            # tanh GELU, as GPT-2's gelu_new
            self.ops["act"] = lambda x: F.gelu(x, approximate="tanh")
            self.steps += [("fc_in", ("b",), "f"), ("act", ("f",), "g")]
        self.fc_out = Linear(f, h, bias)
        self.steps.append(("fc_out", ("g",) if m.post_norms else ("g", "x1"), "x2"))


class Block(Graph):
    """Sequential: x1 = x + attn(ln_1(x)), x2 = x1 + mlp(ln_2(x1)). Parallel residual (GPT-NeoX,
    Falcon): the MLP reads ln_2(x) (ln_1(x) with one shared norm), x2 = x + attn + mlp. Post
    norms (Gemma-2): x1 = x + post_attn_ln(attn), x2 = x1 + post_mlp_ln(mlp). Post-LN (OPT-350m):
    x1 = ln_1(x + attn(x)), x2 = ln_2(x1 + mlp(x1))."""

    def __init__(self, m, layer: int, expert_parallel_size: int = 1):
        super().__init__(("x",), "x2")
        if m.post_layernorm:     # registered in the workload's order: attn, ln_1, mlp, ln_2
            self.attn = Attention(m, layer)
            self.ln_1 = Norm(m.norm, m.hidden)
            self.mlp = MLP(m)
            self.ln_2 = Norm(m.norm, m.hidden)
            self.steps = [("attn", ("x", "x"), "r1"), ("ln_1", ("r1",), "x1"), ("mlp", ("x1", "x1"), "r2"),
                          ("ln_2", ("r2",), "x2")]
            return
        self.ln_1 = Norm(m.norm, m.hidden)
        self.attn = Attention(m, layer)
        self.steps = [("ln_1", ("x",), "a"), ("attn", ("a", "x"), "x1")]
        if m.post_norms:
            self.post_attn_ln = Norm(m.norm, m.hidden)
            self.steps = [("ln_1", ("x",), "a"), ("attn", ("a", "x"), "o"), ("post_attn_ln", ("o", "x"), "x1")]
        mlp_in = "x" if m.parallel_residual else "x1"
        if m.shared_norm:
            b = "a"
        else:
            self.ln_2 = Norm(m.norm, m.hidden)
            self.steps.append(("ln_2", (mlp_in,), "b"))
            b = "b"
        self.mlp = build_moe(Graph, Linear, m, expert_parallel_size) if m.is_moe_layer(layer) else MLP(m)
        if m.post_norms:
            self.post_mlp_ln = Norm(m.norm, m.hidden)
            self.steps += [("mlp", (b, "x1"), "m"), ("post_mlp_ln", ("m", "x1"), "x2")]
        else:
            self.steps.append(("mlp", (b, "x1"), "x2"))


class GPT(Graph):
    """Decoder-only GPT from a zsim ModelSpec; forward(ids, labels) -> mean loss. With expert
    parallelism it holds one rank's experts (calibration/core/moe.py)."""

    def __init__(self, m, expert_parallel_size: int = 1):
        super().__init__(("ids", "labels"), "loss")
        h, e = m.hidden, m.embed_proj_dim or m.hidden
        self.wte = Embedding(m.vocab, e)
        self.steps.append(("wte", ("ids",), "x.emb"))
        cur = "x.emb"
        if m.embed_proj_dim:      # OPT-350m: a narrower embedding projected to hidden
            self.project_in = Linear(e, h, False)
            self.steps.append(("project_in", (cur,), "x.in"))
            cur = "x.in"
        if m.position == "learned":
            self.wpe = PositionEmbedding(m.seq_len, h, m.position_offset)
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
        if not m.post_layernorm:
            self.ln_f = Norm(m.norm, h)
            self.steps.append(("ln_f", (cur,), "x.f"))
            cur = "x.f"
        if m.embed_proj_dim:
            self.project_out = Linear(h, e, False)
            self.steps.append(("project_out", (cur,), "x.out"))
            cur = "x.out"
        # the lm_head is a Linear whose weight is wte's when tied (DeepSpeed ZeRO-3 fetches it again)
        self.lm_head = Linear(e, m.vocab, False, weight=self.wte.weight if m.tied_embeddings else None)
        self.ops["loss"] = cross_entropy
        self.steps += [("lm_head", (cur,), "logits"), ("loss", ("logits", "labels"), "loss")]

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

        def flatten(graph: Graph, prefix: str, values: dict[str, str]):
            for name, ins, res in graph.steps:
                path = prefix + name
                ins = tuple(values.get(i, prefix + i) for i in ins)
                res = values.get(res, prefix + res)
                if name in graph.ops:
                    op = graph.ops[name]
                    out[path] = Segment(path, ins, res, lambda P, *x, op=op: op(*x))
                    continue
                child = graph.get_submodule(name)
                if isinstance(child, Graph):
                    flatten(child, path + ".", {**dict(zip(child.inputs, ins)), child.output: res})
                    continue
                pids = tuple(pid[id(p)] for p in own_params(child))
                out[path] = Segment(path, ins, res, lambda P, *x, leaf=child, pids=pids:
                                    leaf.run(tuple(P(i) for i in pids), swappable_linear, *x))

        flatten(self, "", {"ids": "ids", "labels": "labels", "loss": "loss"})
        return out


class EmbeddingPipe(nn.Module):
    """A PipelineModule's first layer: the GPT's token and learned position embeddings (its own
    modules, not copies)."""

    def __init__(self, gpt: GPT):
        super().__init__()
        self.wte, self.wpe = gpt.wte, gpt.wpe

    def forward(self, ids):
        return self.wpe(self.wte(ids))


def pipeline_layers(gpt: GPT) -> list[nn.Module]:
    """An untied GPT as DeepSpeed PipelineModule layers: embeddings, blocks, final norm, head
    (the loss is the PipelineModule's loss_fn)."""
    return [EmbeddingPipe(gpt), *gpt.layers, gpt.ln_f, gpt.lm_head]


# ----------------------------------------------------------------------------- the core's view
def param_shapes(wl) -> list[tuple[int, ...]]:
    """Shape of every workload param, from the module that owns it."""
    shapes: dict[int, tuple[int, ...]] = {}
    hidden = next(wl.params[m.params[0]].numel for m in wl.modules if m.kind == "norm")
    # the token embedding's width: project_in's input when the model has one (OPT-350m)
    embed = next((m.gemm[2] for m in wl.modules if m.name == "project_in"), hidden)
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
                width = embed if m.name == "wte" else hidden
                shapes[pid] = (n // width, width)
            else:
                shapes[pid] = (n,)
    by_name = {wl.params[pid].name: s for pid, s in shapes.items()}
    for pid, p in enumerate(wl.params):   # a saved module's original: the shape of its trained copy
        if pid not in shapes:
            shapes[pid] = by_name[p.name.replace(".original_module.", ".modules_to_save.default.")]
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
    from calibration.core.lora import for_training   # lora.py builds on this module's classes

    with torch.device("meta"):
        segs = for_training(GPT(sc.model, sc.expert_parallel_size), sc, wl).segments()
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
