"""ALST's TiledMLP: each dense MLP run over sequence tiles, recomputed in the backward (see
[Note: tiled MLP])."""
from __future__ import annotations

from dataclasses import replace

from zsim.workload.module import Module, ModuleKind, Workload


# [Note: tiled MLP]
# DeepSpeed's TiledMLP (runtime/sequence_parallel/ulysses_sp.py, ALST: Bekman et al. 2025,
# arXiv:2506.13996; axolotl's tiled_mlp) replaces an MLP's forward by an autograd Function:
# - forward, under no_grad, runs the MLP over `shards` chunks of the tokens (torch.chunk along
#   the sequence) and concatenates the outputs: it keeps only its input x (ctx.save_for_backward),
#   so none of the MLP's intermediates outlive one tile;
# - backward allocates x's gradient whole (zeros_like), then per tile recomputes the MLP forward
#   with grad and backpropagates it (torch.autograd.backward) before the next tile; the weights'
#   gradients accumulate over the tiles and are handed to ZeRO once, at the last
#   (param.ds_grad_is_ready).
# So the MLP's forward runs twice a micro-batch (thrice under activation checkpointing, whose
# recompute runs TiledMLP's no-grad forward again), and its activations are one tile's. The shard
# count is axolotl's tiled_mlp_num_shards, default ALST's ceil(seqlen / hidden) over the rank's own
# tokens. zsim builds the recompute as RECOMPUTE ops of the MLP's modules (all tiles' FLOPs, GEMMs
# of one tile's rows each) before their backward, each holding one tile of its activations; per-tile
# hook calls (ZeRO-3 visits each module once per tile) are not charged.
def mlp_groups(wl: Workload) -> dict[str, list[int]]:
    """Each dense MLP (a layer's modules whose innermost container is its `.mlp`) -> its module
    indices in forward order; an MoE block's experts are left out."""
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(wl.modules):
        if (m.layer >= 0 and m.containers and m.containers[-1].endswith(".mlp") and m.expert is None
                and m.kind in (ModuleKind.LINEAR, ModuleKind.ACTIVATION)):
            groups.setdefault(m.containers[-1], []).append(i)
    return groups


def alst_shards(seq_len: int, hidden: int) -> int:
    """ALST's default shard count: ceil(seqlen / hidden) (TiledMLP's docstring example, axolotl)."""
    return max(1, -(-seq_len // hidden))


def with_tiled_mlp(wl: Workload, hidden: int, shards: int | None = None) -> Workload:
    """The workload with every dense MLP tiled (see [Note: tiled MLP])."""
    n = shards or alst_shards(wl.seq_len, hidden)
    x_bytes = float(wl.tokens * hidden * wl.act_dtype_bytes)    # the MLP's input, which TiledMLP keeps
    modules = list(wl.modules)
    for first, *rest in mlp_groups(wl).values():
        assert modules[first].kind == ModuleKind.LINEAR
        modules[first] = _tiled(modules[first], n, x_bytes)
        for j in rest:
            modules[j] = _tiled(modules[j], n, 0.0)
    return replace(wl, modules=tuple(modules))


def _tiled(m: Module, shards: int, input_bytes: float) -> Module:
    """`m` run over `shards` tiles: one tile's activations in its forward (transient) and in the
    backward's recompute; its input gradient a tile's."""
    return replace(m, tile_shards=shards, tile_input_bytes=input_bytes,
                   fwd_workspace_bytes=m.fwd_workspace_bytes + m.act_bytes / shards,
                   bwd_workspace_bytes=m.bwd_workspace / shards,
                   kernels_fwd=m.kernels_fwd * shards, kernels_bwd=m.kernels_bwd * shards)
