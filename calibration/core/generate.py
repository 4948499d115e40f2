"""The own core's decode loop: generate() on the calibration GPT with a KV cache, on one CPU
rank, to hold zsim's generation schedule to what torch does (see [Note: generation]).

It runs the GPT segment by segment (model.py), as the training core does, under torch.no_grad:
the prefill over the prompt, then one forward per new token, each attention core concatenating
its layer's new keys and values onto the cache as transformers' DynamicCache does
(cache_utils.py DynamicLayer.update: torch.cat), lm_head over the last position only
(generate's logits_to_keep=1) and a greedy pick. It records, per forward, the modules it ran in
order, the cache's bytes after it and its wall time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from calibration.core.model import DTYPES, GPT


@dataclass(frozen=True)
class Forward:
    modules: tuple[str, ...]
    kv_cache_bytes: int
    time_s: float


class _Cache:
    """One attention layer's keys and values, (batch, tokens, width) each."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k, v):
        # DynamicLayer.update: a new tensor each call, the old one dropped
        self.k = k.clone() if self.k is None else torch.cat([self.k, k], dim=1)
        self.v = v.clone() if self.v is None else torch.cat([self.v, v], dim=1)
        return self.k, self.v

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None or self.v is None else self.k.nbytes + self.v.nbytes


def _cached_core(m, layer: int, cache: _Cache):
    """The attention core of `layer` over the cache: causal over the prompt, one query against
    every cached position after it."""
    hd, heads, kv_heads = m.head_size, m.heads, m.n_kv_heads
    qd, kvd = heads * hd, kv_heads * hd

    def core(*qkv):
        q, k, v = qkv[0].split([qd, kvd, kvd], dim=-1) if len(qkv) == 1 else qkv
        k, v = cache.update(k, v)
        B, S, _ = q.shape
        T = k.shape[1]
        qh = q.reshape(B, S, heads, hd).transpose(1, 2)
        kh = k.reshape(B, T, kv_heads, hd).transpose(1, 2)
        vh = v.reshape(B, T, kv_heads, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=S > 1, enable_gqa=kv_heads != heads)
        return o.transpose(1, 2).reshape(B, S, qd)
    return core


def check_model(m) -> None:
    """What the decode loop runs: rope or no positions (a learned table would need the step's
    offset), plain attention (no MLA, windows, MoE or Mamba)."""
    if m.position == "learned" or m.mla is not None or m.moe is not None or m.mamba is not None or m.sliding_window:
        raise ValueError("the core's decode loop runs dense models with RoPE (or no positions) and full attention")


def generate(sc, seed: int = 0) -> list[Forward]:
    """Run the scenario's generate() call (sc.inference) on one CPU rank; one Forward each."""
    gen = sc.inference
    assert gen is not None
    m = sc.model
    check_model(m)
    torch.manual_seed(seed)
    dtype = DTYPES[sc.precision]
    gpt = GPT(m).initialized(seed).to(dtype)
    params = [p.detach() for p in gpt.parameters()]
    segs = gpt.segments()
    caches = {layer: _Cache() for layer in range(m.layers)}
    for layer, cache in caches.items():
        name = f"layers.{layer}.attn.core"
        s = segs[name]
        segs[name] = type(s)(s.name, s.inputs, s.output, lambda P, *x, f=_cached_core(m, layer, cache): f(*x))
    order = [n for n in segs if n != "loss"]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, m.vocab, (gen.batch_size, gen.prompt_len), generator=g)
    out = []
    with torch.no_grad():
        for _ in range(gen.new_tokens):
            t0 = time.perf_counter()
            env = {"ids": ids}
            for name in order:
                s = segs[name]
                if name == "lm_head":   # logits_to_keep=1: the last position only
                    env[s.inputs[0]] = env[s.inputs[0]][:, -1:]
                env[s.output] = s.fn(lambda i: params[i], *[env[k] for k in s.inputs])
            logits = env[segs["lm_head"].output].float()
            ids = logits[:, -1].argmax(dim=-1, keepdim=True)
            out.append(Forward(tuple(order), sum(c.nbytes for c in caches.values()), time.perf_counter() - t0))
    return out
