"""The workload builder: adds parameters and modules in forward order, with the cost rules of
one norm, one Linear, one elementwise activation and one MLP (dense or one expert's).

Sources (see zsim/workload/transformer.py for the whole list): 2*m*n*k FLOPs per GEMM and 2x
that in backward; activations per Korthikanti et al. 2022, sec. 4.1 (a Linear keeps its input,
a norm its input, GeLU its input, a gated MLP both projections and the product).
"""
from __future__ import annotations

from enum import StrEnum

from zsim.specs.model import ModelSpec
from zsim.workload import hf_kernels
from zsim.workload.module import Module, ModuleKind, Param, TensorRole


class Split(StrEnum):
    """Megatron-LM's parallel linears (core/tensor_parallel/layers.py)."""
    COLUMN = "column"   # ColumnParallelLinear: the output features split, each rank a slice of n_out
    ROW = "row"         # RowParallelLinear: the input features split, partial sums all-reduced


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Builder:
    """Parameters and modules of one micro-batch of `tokens` tokens, `act_bytes` per activation
    element. `scope` is the nn.Module containers the next modules sit in; `expert` the routed
    expert they compute for (their parameters are then expert parameters)."""

    def __init__(self, m: ModelSpec, tokens: int, act_bytes: int, dropout: bool, tensor: int = 1,
                 sequence_parallel: bool = False, kernels: str = "fused", attn_implementation: str = "flash_attention_2",
                 padding_mask: bool = False, experts_implementation: str = "grouped_mm",
                 sequence_parallel_size: int = 1):
        self.m, self.t, self.a, self.drop = m, tokens, act_bytes, 1 if dropout else 0
        # training.kernels: "hf" prices the norms, RoPE and SwiGLU op by op (zsim/workload/hf_kernels.py)
        self.hf = kernels == "hf"
        self.attn, self.padding_mask = attn_implementation, padding_mask
        self.experts_implementation = experts_implementation   # a dropless MoE's (zsim/workload/moe.py)
        # Megatron tensor parallelism: `tp` ranks split the linears; `seq` shards the residual
        # stream's elementwise work and activations by sequence (sequence parallelism), else 1
        self.tp, self.seq = tensor, tensor if sequence_parallel else 1
        # DeepSpeed-Ulysses: `tokens` is the rank's sequence shard; the attention core sees the whole
        # sequence for 1/ulysses of the heads (see [Note: DeepSpeed-Ulysses])
        self.ulysses = sequence_parallel_size
        self.params: list[Param] = []
        self.modules: list[Module] = []
        self.scope: tuple[str, ...] = ()
        self.expert: int | None = None

    def param(self, name: str, numel: int, tensor_partial_grad: bool = False, shape: tuple[int, ...] = ()) -> int:
        """A parameter of `numel` elements (`shape`: its dimensions; default one of numel)."""
        self.params.append(Param(name, int(numel), expert=self.expert is not None,
                                 tensor_partial_grad=tensor_partial_grad, shape=shape or (int(numel),)))
        return len(self.params) - 1

    def add(self, **fields) -> None:
        self.modules.append(Module(containers=self.scope, expert=self.expert, **fields))

    def norm(self, name: str, layer: int, size: int | None = None, width: int | None = None,
             residual: bool = True) -> None:
        """A norm of `size` weights (default hidden) over `width` features per token (default
        size; Qwen3's q_norm normalizes every head of a heads x head_dim query). A norm of the
        residual stream is replicated over the tensor-parallel ranks and, with sequence
        parallelism, runs on the rank's 1/tp of the tokens (Korthikanti et al. 2022 sec. 4.2.2)."""
        n, a = size or self.m.hidden, self.a
        t = self.t // self.seq if residual else self.t
        w = width or n
        # see Param.tensor_partial_grad: a residual norm on a sequence shard, a qk norm shared by
        # the heads of every TP rank
        partial = self.seq > 1 if residual else self.tp > 1
        ids = (self.param(f"{name}.weight", n, partial),) + \
            ((self.param(f"{name}.bias", n, partial),) if self.m.norm == "layernorm" else ())
        if self.hf and self.m.norm == "rmsnorm":
            c = hf_kernels.rms_norm(a)
            self.add(name=name, kind=ModuleKind.NORM, layer=layer, params=ids, gemm=None, fwd_flops=8.0 * t * w,
                     bwd_flops=16.0 * t * w, model_fwd_flops=0.0, fwd_mem_bytes=c.fwd * t * w,
                     bwd_mem_bytes=c.bwd * t * w, fp32_fwd_mem_bytes=c.fp32_fwd * t * w,
                     fp32_bwd_mem_bytes=c.fp32_bwd * t * w, act_bytes=c.act * t * w, kernels_fwd=c.kernels_fwd,
                     kernels_bwd=c.kernels_bwd)
            return
        # fwd: read x, write y; bwd: read dy and x, write dx (Korthikanti: stores its input, 2sbh)
        self.add(name=name, kind=ModuleKind.NORM, layer=layer, params=ids, gemm=None, fwd_flops=8.0 * t * w,
                 bwd_flops=16.0 * t * w, model_fwd_flops=0.0, fwd_mem_bytes=2 * t * w * self.a,
                 bwd_mem_bytes=3 * t * w * a, act_bytes=t * w * a)

    def linear(self, name: str, layer: int, n_in: int, n_out: int, bias: bool, *, tokens: int | None = None,
               model_tokens: float | None = None, extra_act: float = 0.0, fwd_mem: float = 0.0, bwd_mem: float = 0.0,
               weight: int | None = None, saves_input: bool = True, split: Split | None = None, groups: int = 1,
               grouped_mm: bool = True, nn_linear: bool = True) -> None:
        """A Linear over `tokens` rows (default: the micro-batch's); `model_tokens` the rows the
        MFU convention counts (a routed expert's mean load, not its padded capacity). `split`:
        Megatron's column- or row-parallel linear over `tp` ranks (n_out or n_in split; a
        vocabulary that does not divide is padded, as Megatron's make_vocab_size_divisible_by
        does). A column-parallel linear keeps its input (replicated; with sequence parallelism
        only the rank's sequence shard, re-gathered in backward); a row-parallel one adds its
        bias after the all-reduce (replicated) and its residual add and dropout (`extra_act`,
        `fwd_mem`, `bwd_mem`) run on the sequence shard under sequence parallelism. `groups`: a
        grouped linear of that many experts in one 3D weight (Module.groups; `tokens` the rows of
        all of them), one kernel each way with `grouped_mm`, else one per expert; never an
        nn.Linear (Module.nn_linear), nor is `nn_linear=False` (a bare weight under F.linear)."""
        t = self.t if tokens is None else tokens
        role, width, kept_input = None, 0, 1
        if split == Split.COLUMN:
            role, width, kept_input = (TensorRole.ENTER if saves_input else None), n_in, self.seq
            n_out = ceil_div(n_out, self.tp)
        elif split == Split.ROW:
            role, width = TensorRole.EXIT, n_out
            n_in //= self.tp
            extra_act, fwd_mem, bwd_mem = extra_act / self.seq, fwd_mem / self.seq, bwd_mem / self.seq
        lead = (groups,) if groups > 1 else ()
        ids: tuple[int, ...] = (weight if weight is not None else
                                self.param(f"{name}.weight", groups * n_in * n_out, shape=lead + (n_out, n_in)),)
        if bias:   # a row-parallel bias added on the sequence shard (Param.tensor_partial_grad)
            ids += (self.param(f"{name}.bias", groups * n_out, split == Split.ROW and self.seq > 1,
                               shape=lead + (n_out,)),)
        flops = 2.0 * t * n_in * n_out
        model = flops if model_tokens is None else 2.0 * model_tokens * n_in * n_out
        kernels = 1 if grouped_mm else groups
        self.add(name=name, kind=ModuleKind.LINEAR, layer=layer, params=ids, gemm=(t, n_out, n_in),
                 fwd_flops=flops, bwd_flops=2 * flops, model_fwd_flops=model, fwd_mem_bytes=fwd_mem,
                 bwd_mem_bytes=bwd_mem, act_bytes=t * n_in * self.a * saves_input / kept_input + extra_act,
                 kernels_fwd=kernels, kernels_bwd=2 * kernels, tensor_role=role, tensor_width=width,
                 groups=groups, grouped_mm=grouped_mm, nn_linear=nn_linear and groups == 1)

    def activation(self, name: str, layer: int, flops: float, fwd_mem: float, bwd_mem: float, act: float,
                   fwd_workspace: float = 0.0, kernels_fwd: int = 1, kernels_bwd: int = 1) -> None:
        self.add(name=name, kind=ModuleKind.ACTIVATION, layer=layer, params=(), gemm=None, fwd_flops=flops,
                 bwd_flops=2 * flops, model_fwd_flops=0.0, fwd_mem_bytes=fwd_mem, bwd_mem_bytes=bwd_mem,
                 act_bytes=act, kernels_fwd=kernels_fwd, kernels_bwd=kernels_bwd, fwd_workspace_bytes=fwd_workspace)

    def mlp(self, pfx: str, layer: int, width: int, *, tokens: int | None = None, model_tokens: float | None = None,
            residual_add: bool = True, groups: int = 1) -> None:
        """One MLP (`pfx`.gate_proj/up_proj or gate_up_proj, act, fc_out; or fc_in, act, fc_out).
        With `residual_add` its fc_out also adds the residual stream (read 2, write 1) and keeps
        the dropout mask; an expert's output goes to the MoE combine instead. `groups`: the
        experts of a transformers 5 MoE block as grouped linears (gate and up concatenated, see
        [Note: transformers 5 MoE experts]); `tokens` and `model_tokens` then count all their rows."""
        m, a, h = self.m, self.a, self.m.hidden
        t = self.t if tokens is None else tokens
        bias, f = m.mlp_proj_bias, width
        gmm = self.experts_implementation == "grouped_mm"
        # elementwise kernels per pass: transformers' eager experts loop runs them once per expert
        per = 1 if gmm else groups
        # the dense MLP of a layer is Megatron's ParallelMLP: fc1 (gate/up) column-, fc2 row-parallel
        col, row = (Split.COLUMN, Split.ROW) if residual_add else (None, None)
        fr = f // self.tp if residual_add else f     # the rank's MLP width
        if m.glu:
            if m.fused_gate_up or groups > 1:
                self.linear(f"{pfx}.gate_up_proj", layer, h, 2 * f, bias, split=col, tokens=tokens, model_tokens=model_tokens,
                            groups=groups, grouped_mm=gmm)
            else:
                self.linear(f"{pfx}.gate_proj", layer, h, f, bias, split=col, tokens=tokens, model_tokens=model_tokens)
                # shares gate's input
                self.linear(f"{pfx}.up_proj", layer, h, f, bias, saves_input=False, split=col, tokens=tokens, model_tokens=model_tokens)
            if self.hf:    # SiLU, then mul: hf_kernels.swiglu
                c = hf_kernels.swiglu(a)
                self.activation(f"{pfx}.act", layer, flops=4.0 * t * fr, fwd_mem=c.fwd * t * fr,
                                bwd_mem=c.bwd * t * fr, act=c.act * t * fr, kernels_fwd=c.kernels_fwd * per,
                                kernels_bwd=c.kernels_bwd * per)
            else:
                # act(gate)*up: stores gate and up (above as the projections' outputs) and the product
                self.activation(f"{pfx}.act", layer, flops=4.0 * t * fr, fwd_mem=3 * t * fr * a,
                                bwd_mem=5 * t * fr * a, act=2 * t * fr * a, kernels_fwd=per, kernels_bwd=per)
        else:
            self.linear(f"{pfx}.fc_in", layer, h, f, bias, split=col, tokens=tokens, model_tokens=model_tokens,
                        groups=groups, grouped_mm=gmm)
            # one pass each way, as Megatron's bias_gelu_fusion runs it (fc1's bias added inside the
            # GeLU kernel, fused_bias_gelu.py); the bias gradient's reduction is not charged
            self.activation(f"{pfx}.act", layer, flops=8.0 * t * fr, fwd_mem=2 * t * fr * a, bwd_mem=3 * t * fr * a,
                            act=t * fr * a, kernels_fwd=per, kernels_bwd=per)
        if residual_add:
            # bias + dropout + residual add in one kernel's passes (Megatron's bias_dropout_add_fused_train)
            self.linear(f"{pfx}.fc_out", layer, f, h, bias, extra_act=self.drop * t * h, fwd_mem=3 * t * h * a,
                        bwd_mem=2 * t * h * a, split=row, tokens=tokens, model_tokens=model_tokens)
        else:
            self.linear(f"{pfx}.fc_out", layer, f, h, bias, tokens=tokens, model_tokens=model_tokens, groups=groups,
                        grouped_mm=gmm)
