"""LoRA adapters and frozen parameters: a post-pass over the built workload (build_workload), as
PEFT's get_peft_model rewrites an HF model (peft 0.21, tuners/lora/layer.py, tuners_utils.py).

- `training.frozen` patterns and `training.lora` both freeze weights (requires_grad=False):
  no gradient, no optimizer state, but ZeRO-3 still partitions and gathers them; see
  [Note: frozen parameters under ZeRO] (zsim/schedule/partition.py).
- A LoRA target `X` (a linear) becomes PEFT's lora.Linear: a container `X` holding the frozen
  `X.base_layer` and two nn.Linear adapters `X.lora_A.default` (in -> r) and `X.lora_B.default`
  (r -> out), each its own module (ZeRO-3 fetches each on its own), registered in that order.
  The adapters' dtype is the model's: PEFT upcasts them to fp32 (cast_adapter_dtype,
  autocast_adapter_dtype=True), then deepspeed.initialize casts every parameter to the bf16/fp16
  training dtype (runtime/engine.py _configure_distributed_model -> _cast_module_mixed_precision);
  their fp32 copies are DeepSpeed's master weights, as for any trained parameter.
- `modules_to_save` (ModulesToSaveWrapper): a trainable copy `X.modules_to_save.default` runs,
  the frozen `X.original_module` stays registered (a tied weight stays its owner's).
- Backward: a frozen weight skips its weight-gradient GEMM; a module whose input carries no
  gradient (nothing trainable before it in the forward) skips the input-gradient GEMM, and a
  module with neither runs no backward at all (autograd never reaches it, ZeRO-3's pre-backward
  hook does not fire). With full activation checkpointing PEFT calls the model's
  enable_input_require_grads (peft_model.py _prepare_model_for_gradient_checkpointing), so
  every input past the embedding carries a gradient.
- Activations: a frozen linear saves no input (mm's backward keeps the input only for the
  weight's gradient); the input shared by q/k/v (or gate/up) stays while any of them trains a
  weight or an adapter. Modules without a backward keep nothing.
  [Note: ZeRO-3 linear saves its input] Under ZeRO-3 with memory_efficient_linear (DeepSpeed's
  default) F.linear is DeepSpeed's zero3_linear_wrap (partition_parameters.py
  _enable_mem_efficient_linear, installed by the Init that deepspeed.initialize runs on the
  model, parameter_offload.py _convert_to_zero_parameters): LinearFunctionForZeroStage3
  .setup_context saves (input, weight, bias) whatever needs a gradient (runtime/zero/linear.py),
  so a frozen linear that autograd reaches keeps its input too.

Names: `target_modules`, `modules_to_save` and `training.frozen` are module-name suffixes on a
dot boundary (PEFT's rule for a list: `key == t or key.endswith("." + t)`; no regex, no
wildcards), matched against zsim's names; PEFT names of modules that zsim names differently
map through PEFT_NAMES. `training.frozen` also matches containers (`layers.0`, `attn`).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

from zsim.errors import ZsimInputError
from zsim.specs.scenario import FreezeSpec, LoraSpec, TrainingSpec
from zsim.workload import quant
from zsim.workload.module import Module, ModuleKind, Param, Workload
from zsim.workload.transformer import REWARD_HEADS, fused_linear_saved_bytes

# PEFT / HF module names -> zsim module suffixes (zsim's own names match as they are)
PEFT_NAMES: dict[str, tuple[str, ...]] = {
    "c_attn": ("attn.qkv",), "query_key_value": ("attn.qkv",), "qkv_proj": ("attn.qkv",), "Wqkv": ("attn.qkv",),
    "c_proj": ("attn.o_proj", "mlp.fc_out"),     # GPT-2 names both projections c_proj
    "attn.c_proj": ("attn.o_proj",), "mlp.c_proj": ("mlp.fc_out",),
    "dense": ("attn.o_proj",), "out_proj": ("attn.o_proj",),
    "c_fc": ("mlp.fc_in",), "fc1": ("mlp.fc_in",), "dense_h_to_4h": ("mlp.fc_in",),
    "fc2": ("mlp.fc_out",), "dense_4h_to_h": ("mlp.fc_out",),
    # a gated MLP's down projection wherever gate_proj and up_proj are: the dense MLP, a MoE
    # block's shared experts (Qwen-MoE's shared_expert, DeepSeek's shared_experts) and routed experts
    "down_proj": ("fc_out",),
    "embed_tokens": ("wte",), "word_embeddings": ("wte",), "embed_in": ("wte",), "embed_out": ("lm_head",),
}
ALL_LINEAR = "all-linear"


def _peft_linear(m: Module) -> bool:
    """A module PEFT's target_modules can wrap (and bitsandbytes quantize): an nn.Linear, not a
    transformers 5 MoE block's router or grouped experts (bare parameters: see [Note: transformers
    5 MoE experts])."""
    return m.kind == ModuleKind.LINEAR and m.nn_linear


def _matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def _select(modules, key: str, path: str, linear_only: bool, containers: bool = False) -> set[int]:
    found = {i for i, m in enumerate(modules)
             if (_peft_linear(m) or not linear_only) and m.params and not m.no_grad
             and any(_matches(n, s) for s in PEFT_NAMES.get(key, (key,))
                     for n in ((m.name,) + (m.containers if containers else ())))}
    if not found:
        kind = "linear module" if linear_only else "module with parameters"
        raise ZsimInputError(path, key, f"matches no {kind} of the model (zsim names end in e.g. attn.q_proj, "
                             "attn.qkv, mlp.fc_in, mlp.fc_out, lm_head, wte; see docs/scenario.md)")
    return found


def _targets(modules, lora: LoraSpec) -> set[int]:
    keys = lora.target_modules
    if keys == ALL_LINEAR:   # PEFT's shorthand: every linear but the output layer
        return {i for i, m in enumerate(modules)
                if _peft_linear(m) and m.name != "lm_head" and not m.no_grad}
    if keys is None:         # PEFT's default for llama/mistral/opt (q_proj, v_proj), gpt2/neox/bloom (c_attn)
        fused = any(_matches(m.name, "attn.qkv") for m in modules)
        keys = ("attn.qkv",) if fused else ("q_proj", "v_proj")
    # PEFT's inject_adapter refuses target_modules only when no module matched at all; a name that
    # matches nothing (gate_proj on a transformers 5 MoE, whose experts are no nn.Linear) is skipped
    found: set[int] = set()
    for k in keys:
        try:
            found |= _select(modules, k, "training.lora.target_modules", True)
        except ZsimInputError:
            if len(keys) == 1:
                raise
    if not found:
        raise ZsimInputError("training.lora.target_modules", ", ".join(keys), "matches no linear module of the model "
                             "(zsim names end in e.g. attn.q_proj, attn.qkv, mlp.fc_in, mlp.fc_out, lm_head, wte; "
                             "see docs/scenario.md)")
    return found


def _input_groups(wl: Workload) -> list[int]:
    """The module whose input each module reads: k/v_proj (and up_proj) read q_proj's (gate_proj's)
    input; they save none of it themselves (build_workload's saves_input=False)."""
    start: list[int] = []
    for i, m in enumerate(wl.modules):
        shared = (m.kind == ModuleKind.LINEAR and i > 0 and wl.modules[i - 1].kind == ModuleKind.LINEAR
                  and m.gemm is not None and m.act_bytes < m.gemm[0] * m.gemm[2] * wl.act_dtype_bytes)
        start.append(start[i - 1] if shared else i)
    return start


def apply_training(wl: Workload, training: TrainingSpec, zero3_linear: bool) -> Workload:
    """`wl` with training.frozen and training.lora applied (the workload itself when neither is set);
    `zero3_linear`: F.linear is zero3_linear_wrap (see [Note: ZeRO-3 linear saves its input])."""
    lora, mods = training.lora, wl.modules
    if training.quantization != "none" and lora is None:
        # transformers trainer_utils.py validate_quantization_for_training
        raise ZsimInputError("training.quantization", training.quantization, "quantized base weights train only "
                             "under adapters (transformers refuses fine-tuning a purely quantized model); set "
                             "training.lora")
    if lora is None and not training.frozen and training.freeze is None:
        return wl
    frozen = {pid for pid, _ in enumerate(wl.params)} if lora else set()
    for key in training.frozen:
        frozen.update(p for i in _select(mods, key, "training.frozen", False, containers=True) for p in mods[i].params)
    if training.freeze is not None:
        frozen.update(_freeze_tuning(wl, training.freeze))
    # a preference run's reference model trains nothing (see [Note: preference training])
    frozen.update(p for m in mods if m.no_grad for p in m.params)
    # a reward model's head trains whole under LoRA (see [Note: reward model heads])
    heads = {i for i, m in enumerate(mods) if m.name in REWARD_HEADS.values() and not m.no_grad}
    frozen -= {p for i in heads for p in mods[i].params}
    targets = _targets(mods, lora) - heads if lora else set()
    saved = set().union(*(_select(mods, k, "training.lora.modules_to_save", False) for k in lora.modules_to_save)) \
        if lora else set()
    if targets & saved:
        raise ZsimInputError("training.lora.modules_to_save", mods[min(targets & saved)].name,
                             "is also a LoRA target; PEFT wraps a module one way, keep it in one list")
    weight_grad = [not m.no_grad and (i in saved or any(p not in frozen for p in m.params))
                   for i, m in enumerate(mods)]
    trains = [weight_grad[i] or i in targets for i in range(len(mods))]
    if not any(trains):
        raise ZsimInputError("training.frozen", list(training.frozen), "freezes every parameter; nothing to train")
    group = _input_groups(wl)
    full_ckpt = training.activation_checkpointing == "full"
    before = [any(trains[:i]) for i in range(len(mods))]
    input_grad = [m.kind != ModuleKind.EMBEDDING and not m.no_grad and (full_ckpt or before[group[i]])
                  for i, m in enumerate(mods)]
    keeps_input = {group[i] for i in range(len(mods))
                   if mods[i].kind == ModuleKind.LINEAR and (trains[i] or (zero3_linear and input_grad[i]))}
    quantized = _quantized(wl, training, frozen, saved)
    return _rebuild(wl, training, frozen, targets, saved, weight_grad, input_grad, keeps_input, quantized)


# LLaMA-Factory's freeze_trainable_modules / freeze_extra_modules (HF names) -> zsim's
HF_BLOCK_MODULES = {"self_attn": "attn", "attention": "attn", "mlp": "mlp", "block_sparse_moe": "mlp",
                    "input_layernorm": "ln_1", "post_attention_layernorm": "ln_2"}
HF_EXTRA_MODULES = {"embed_tokens": "wte", "norm": "ln_f", "lm_head": "lm_head"}


def trainable_layer_ids(layers: int, freeze: FreezeSpec) -> range:
    """The blocks LLaMA-Factory's freeze tuning trains (model/adapter.py _setup_freeze_tuning)."""
    n = freeze.trainable_layers
    if freeze.llama_pro:
        if n < 0 or layers % n:
            raise ZsimInputError("training.freeze.trainable_layers", n, f"LLaMA-Pro needs the model's {layers} "
                                 "layers divisible by it (LLaMA-Factory: \"num_layers should be divisible by "
                                 "num_layer_trainable\")")
        stride = layers // n
        return range(stride - 1, layers + stride - 1, stride)
    if n > 0:
        return range(max(0, layers - n), layers)
    return range(min(-n, layers))


def _freeze_tuning(wl: Workload, freeze: FreezeSpec) -> set[int]:
    """The params freeze tuning leaves frozen: all but those of the trainable blocks' named
    sub-modules and the extra modules."""
    names = []
    for key in freeze.trainable_modules:
        if key != "all" and key not in HF_BLOCK_MODULES:
            raise ZsimInputError("training.freeze.trainable_modules", key, "choose all or a block's sub-module: "
                                 + ", ".join(HF_BLOCK_MODULES))
        names += [f"layers.{i}" + ("" if key == "all" else "." + HF_BLOCK_MODULES[key])
                  for i in trainable_layer_ids(wl.layers, freeze)]
    mods = wl.modules
    trained = {i for i, m in enumerate(mods) if not m.no_grad and m.params
               and any(_matches(n, k) for k in names for n in (m.name,) + m.containers)}
    for key in freeze.extra_modules:
        trained |= _select(mods, HF_EXTRA_MODULES.get(key, key), "training.freeze.extra_modules", False)
    kept = {p for i in trained for p in mods[i].params}
    return {pid for pid in range(len(wl.params)) if pid not in kept}


def _quantized(wl: Workload, training: TrainingSpec, frozen: set[int], saved: set[int]) -> dict[int, Module]:
    """The weights bitsandbytes quantizes, with their linear: every frozen Linear's weight but
    lm_head's and tied ones (replace_with_bnb_linear, get_keys_to_not_convert; see [Note:
    bitsandbytes quantized base weights]); modules_to_save keep theirs 16-bit."""
    if training.quantization == "none":
        return {}
    # a PEFT reference forward uses the same weights (see [Note: preference training]): not a tie
    uses = Counter(p for m in wl.modules if not m.no_grad for p in m.params)
    return {m.params[0]: m for i, m in enumerate(wl.modules)
            if _peft_linear(m) and m.name != "lm_head" and i not in saved and m.params and not m.no_grad
            and m.params[0] in frozen and uses[m.params[0]] == 1}


def _dequantizing(m: Module, weight: Param, training: TrainingSpec, a: int) -> Module:
    """`m` paying for its quantized weight: each forward (and recompute) and each input-gradient
    GEMM dequantizes it to a transient 16-bit copy; LLM.int8's forward quantizes its input instead
    (see [Note: bitsandbytes quantized base weights])."""
    q, dq = training.quantization, training.double_quant
    assert m.gemm is not None
    tokens, rows, n_in = m.gemm
    dequant = quant.dequant_bytes(weight.numel, rows, q, dq, a)
    kernels = quant.dequant_kernels(q, dq)
    if q in quant.FOUR_BIT:
        fwd_mem, fwd_kernels, fwd_ws = dequant, kernels, weight.numel * a
    else:
        fwd_mem, fwd_kernels, fwd_ws = quant.int8_input_bytes(tokens, n_in, a), 1, tokens * (n_in + quant.FP32_BYTES)
    m = replace(m, fwd_mem_bytes=m.fwd_mem_bytes + fwd_mem, kernels_fwd=m.kernels_fwd + fwd_kernels,
                fwd_workspace_bytes=m.fwd_workspace_bytes + fwd_ws)
    if m.input_grad:
        m = replace(m, bwd_mem_bytes=m.bwd_mem_bytes + dequant, kernels_bwd=m.kernels_bwd + kernels,
                    bwd_workspace_bytes=m.bwd_workspace + weight.numel * a)
    return m


def _rebuild(wl, training, frozen, targets, saved, weight_grad, input_grad, keeps_input, quantized) -> Workload:
    lora = training.lora
    params: list[Param] = []
    new_id: dict[int, int] = {}
    a = wl.act_dtype_bytes

    def own(pid: int, rename: tuple[str, str] | None = None) -> int:
        if pid not in new_id:
            p = wl.params[pid]
            name = p.name.replace(rename[0], rename[1], 1) if rename and p.name.startswith(rename[0] + ".") else p.name
            p = replace(p, name=name, trainable=pid not in frozen)
            if pid in quantized:
                q, rows = training.quantization, quantized[pid].gemm[1]
                p = replace(p, packed_bytes=quant.packed_bytes(p.numel, q),
                            quant_state_bytes=quant.quant_state_bytes(p.numel, rows, q, training.double_quant))
            params.append(p)
            new_id[pid] = len(params) - 1
        return new_id[pid]

    def new(name: str, numel: int, shape: tuple[int, ...] = ()) -> int:
        params.append(Param(name, numel, shape=shape or (numel,)))
        return len(params) - 1

    modules: list[Module] = []
    for i, m in enumerate(wl.modules):
        m = _backward_of(m, input_grad[i], weight_grad[i], a, i in keeps_input)
        if m.params and m.params[0] in quantized:
            m = _dequantizing(m, wl.params[m.params[0]], training, a)
        if i in targets:
            base = f"{m.name}.base_layer"
            ids = tuple(own(p, (m.name, base)) for p in m.params)
            modules.append(replace(m, name=base, params=ids, containers=m.containers + (m.name,)))
            modules += _adapters(m, lora, a, new)
        elif i in saved:
            for p in m.params:
                own(p, (m.name, f"{m.name}.original_module"))
            copy = f"{m.name}.modules_to_save.default"
            ids = tuple(new(wl.params[p].name.replace(m.name, copy, 1) if wl.params[p].name.startswith(m.name + ".")
                            else f"{copy}.weight", wl.params[p].numel, wl.params[p].shape) for p in m.params)
            modules.append(replace(m, name=copy, params=ids, containers=m.containers + (m.name,)))
        else:
            modules.append(replace(m, params=tuple(own(p) for p in m.params)))
    for pid in range(len(wl.params)):   # params no module uses stay registered
        own(pid)
    return replace(wl, params=tuple(params), modules=tuple(modules))


def _backward_of(m: Module, input_grad: bool, weight_grad: bool, a: int, keeps_input: bool) -> Module:
    """`m` with only the backward work autograd does for it."""
    runs = input_grad or (weight_grad and bool(m.params))
    if not runs:
        return replace(m, input_grad=False, weight_grad=False, bwd_flops=0.0, bwd_mem_bytes=0.0, kernels_bwd=0,
                       act_bytes=0.0, act_bytes_s2=0.0, bwd_workspace_bytes=0.0)
    if m.kind != ModuleKind.LINEAR:
        return replace(m, input_grad=input_grad, weight_grad=weight_grad)
    assert m.gemm is not None
    tokens, n_out, n_in = m.gemm
    if m.backward_in_forward:    # the gradients it makes in the forward are what it keeps
        return replace(m, input_grad=input_grad, weight_grad=weight_grad,
                       act_bytes=fused_linear_saved_bytes(tokens, n_out, n_in, a, input_grad, weight_grad))
    gemm_flops = m.fwd_flops
    act = m.act_bytes - (0.0 if keeps_input else m.saved_input_bytes(a))
    return replace(m, input_grad=input_grad, weight_grad=weight_grad, bwd_flops=gemm_flops * (input_grad + weight_grad),
                   kernels_bwd=(int(input_grad) + int(weight_grad)) * (1 if m.grouped_mm else m.groups), act_bytes=act,
                   bwd_workspace_bytes=tokens * n_in * a if input_grad else 0.0)


def _adapters(base: Module, lora: LoraSpec, a: int, new) -> list[Module]:
    """lora_A (in -> r) and lora_B (r -> out) of a target; lora_B's output is scaled by alpha/r and
    added to the base's (peft lora/layer.py Linear.forward: result + lora_B(lora_A(dropout(x))) * scaling).
    The adapters run on the base's rows: an expert's are its capacity buffer, of which the model
    FLOPs count the routed tokens as the base's do; their params are dense to DeepSpeed, as
    Experts marks only the params it was built with as MoE params (moe/experts.py sets
    allreduce=False and group_name; moe/utils.py is_moe_param)."""
    assert base.gemm is not None
    t, n_out, n_in = base.gemm
    model_share = base.model_fwd_flops / base.fwd_flops if base.fwd_flops else 1.0
    r = lora.rank
    drop = lora.dropout > 0
    name_a, name_b = f"{base.name}.lora_A.default", f"{base.name}.lora_B.default"
    pa, pb = new(f"{name_a}.weight", n_in * r, (r, n_in)), new(f"{name_b}.weight", r * n_out, (n_out, r))
    inside = base.containers + (base.name,)
    fa, fb = 2.0 * t * n_in * r, 2.0 * t * r * n_out
    ig = base.input_grad
    # with lora_dropout the dropped copy of x (and its mask) is what lora_A saves; without, it
    # saves x itself, which the base's input group keeps already
    lora_a = Module(name=name_a, kind=ModuleKind.LINEAR, layer=base.layer, params=(pa,), gemm=(t, r, n_in),
                    fwd_flops=fa, bwd_flops=fa * (1 + ig), model_fwd_flops=fa * model_share,
                    fwd_mem_bytes=(2 * a + 1) * t * n_in if drop else 0.0,
                    bwd_mem_bytes=(2 * a + 1) * t * n_in if drop and ig else 0.0,
                    act_bytes=(a + 1) * t * n_in if drop else 0.0, kernels_fwd=1 + drop,
                    kernels_bwd=1 + ig + (drop and ig),
                    bwd_workspace_bytes=t * n_in * a if ig else 0.0, containers=inside, input_grad=ig,
                    expert=base.expert)
    lora_b = Module(name=name_b, kind=ModuleKind.LINEAR, layer=base.layer, params=(pb,), gemm=(t, n_out, r),
                    fwd_flops=fb, bwd_flops=2 * fb, model_fwd_flops=fb * model_share,
                    fwd_mem_bytes=5.0 * t * n_out * a, bwd_mem_bytes=2.0 * t * n_out * a,
                    act_bytes=float(t * r * a), kernels_fwd=3, kernels_bwd=3, bwd_workspace_bytes=float(t * r * a),
                    containers=inside, expert=base.expert)
    return [lora_a, lora_b]


def trainable_params(wl: Workload) -> int:
    return sum(p.numel for p in wl.params if p.trainable)
