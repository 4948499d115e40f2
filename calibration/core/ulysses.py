"""DeepSpeed-Ulysses on the calibration GPT, as Hugging Face models get it (see [Note: DeepSpeed-Ulysses]):
DeepSpeed's parallel_state_sp groups (the mpu deepspeed.initialize takes, as accelerate hands it over),
every attention core through UlyssesSPAttentionHF over sdpa, each rank fed its 1/sp of every sample
(UlyssesSPDataLoaderAdapter's split) and the HF Trainer's loss (deepspeed_sp_compute_loss).

Used by the DeepSpeed recorder (calibration/deepspeed_record/ulysses.py) and by `zsim validate
--engine deepspeed` (calibration/core/peers.py). Needs deepspeed and transformers >= 4.51.3."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Ulysses:
    """The sequence-parallel wiring of one run: `mpu` for deepspeed.initialize, `shard` for the
    rank's tokens and positions, `loss` for the token-weighted mean over the sequence group."""

    def __init__(self, m, sp: int, micro_batch: int, seq_len: int):
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        mpu.initialize_sequence_parallel(sequence_parallel_size=sp)
        self.mpu, self.sp = mpu, sp
        self.group, self.rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
        self.local = seq_len // sp
        hd = m.head_size
        self.m = m
        self.positions = None
        self.uattn = UlyssesSPAttentionHF(attn=_sdpa, batch_size=micro_batch, attn_head_count=m.heads,
                                          attn_head_size=hd, kv_head_count=m.n_kv_heads,
                                          num_hidden_layers=m.layers, process_group=self.group,
                                          seq_length_is_variable=False, local_seq_length=self.local,
                                          global_seq_length=seq_len)
        self.uattn.core_attn_implementation = "sdpa"

    def install(self, model) -> None:
        """Each layer's attention core (calibration/core/layers.attend, called by the GPT's
        Attention) through UlyssesSPAttentionHF."""
        from calibration.core import model as gpt

        def attend(heads, kv_heads, head_dim, q, k, v, window=None, v_dim=None):
            if window is not None or (v_dim or head_dim) != head_dim:
                raise SystemExit("Ulysses on the calibration GPT: sliding windows and MLA are not wired")
            B, S, _ = q.shape
            q = q.reshape(B, S, heads, head_dim).transpose(1, 2)
            k = k.reshape(B, S, kv_heads, head_dim).transpose(1, 2)
            v = v.reshape(B, S, kv_heads, head_dim).transpose(1, 2)
            out, _ = self.uattn(_Training(), q, k, v, None, position_ids=self.positions)
            return out
        gpt.attend = attend

    def shard(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of the sequence (and its position ids, kept for the exchange)."""
        mine = slice(self.rank * self.local, (self.rank + 1) * self.local)
        self.positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)[:, mine].contiguous()
        return ids[:, mine].contiguous(), labels[:, mine].contiguous()

    def loss(self, local_mean: torch.Tensor, tokens: int) -> torch.Tensor:
        """deepspeed_sp_compute_loss: the shard's loss sum and token count all-reduced over the
        sequence group, each rank backpropagating its own share of the whole mean."""
        import torch.distributed as td

        good = torch.tensor(float(tokens), device=local_mean.device)
        local_sum = local_mean.float() * good
        totals = torch.stack((local_sum.detach(), good))
        td.all_reduce(totals, group=self.group)
        return (local_sum + (totals[0] - local_sum.detach())) / totals[1].clamp(min=1)


class _Training:
    """The `module` argument UlyssesSPAttentionHF reads (training mode; GQA's group count)."""
    training = True
    num_key_value_groups = 1


def _sdpa(module, q, k, v, mask, *args, **kwargs):
    """HF's sdpa attention interface: [batch, heads, seq, dim] in, [batch, seq, heads, dim] out."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]).transpose(1, 2), None
