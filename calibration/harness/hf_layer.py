"""Time the user's own Hugging Face decoder layer, per module kind (`zsim calibrate --hf-layer`).

One decoder layer of the model's class is built from its config.json (transformers'
AutoConfig.for_model, AutoModel.from_config with one layer: random weights, nothing
downloaded) on the local device (CUDA when present, else CPU). One forward of that one-layer
model records, with forward pre-hooks, the arguments the model hands the layer and each of its
submodules (the rotary embedding's cos/sin, the causal mask HF's masking_utils builds for the
attention implementation, position ids). Each timed unit is then called with those arguments,
its tensor inputs fresh random leaves that require grad:

- the whole layer; its attention module (`self_attn`) and every nn.Linear directly inside it;
  its MLP (the dense MLP, or a MoE's sparse block) and every nn.Linear directly inside a dense
  one, or a MoE's router (`gate`); each norm directly under the layer; one residual add;
- forward (`fwd`), backward (`bwd`: torch.autograd.grad to the inputs and weights, as the HF
  Trainer's step meets it with fresh .grads), and the backward of a forward run under
  torch.utils.checkpoint (`bwd_ckpt`: with use_reentrant as transformers' own gradient
  checkpointing passes it, the forward re-run inside the backward), whose excess over `bwd` is
  what gradient checkpointing re-runs.

Timing: warm-up calls, then `reps` repetitions whose median is kept (with its spread); a
repetition times `inner` calls back to back (enough to last min_rep_s) and keeps their mean.
CUDA events on a GPU, time.perf_counter on a CPU. The records are raw timings; the per-kind
times and the profile fit are calibration/harness/fit_hf_layer.py's (pure, no torch).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from calibration.harness.plan import stats

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the attention and MLP containers of HF's decoder layers (Llama, Mistral, Qwen2/3, Gemma, Phi-3,
# Mixtral, Qwen-MoE, DeepSeek); the norms are the layer's direct children named *norm*
ATTENTION_NAMES = ("self_attn",)
MLP_NAMES = ("mlp", "block_sparse_moe")


@dataclass(frozen=True)
class Unit:
    """One timed call: `module` (a dotted path in the layer; "" the layer, "+" the residual add),
    the group it belongs to (fit_hf_layer.GROUPS) and how many of it the layer runs."""
    module: str
    group: str
    count: int = 1


def build_layer(config_dict: dict, attn_implementation: str, dtype: str, device, layer_idx: int):
    """(one-layer model, its decoder layer) of the config's model class, random weights on `device`."""
    import transformers

    cfg_dict = {k: v for k, v in config_dict.items() if k not in ("architectures", "torch_dtype", "dtype",
                                                                  "quantization_config", "auto_map")}
    model_type = cfg_dict.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **cfg_dict)
    # the layer index the timed layer has in the model (a MoE model's first sparse block)
    cfg.num_hidden_layers = layer_idx + 1
    cfg.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cfg, attn_implementation=attn_implementation)
    model.to(device=device, dtype=TORCH_DTYPES[dtype])
    model.train()
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .layers: not a decoder of the Llama family's layout")
    return model, cfg, layers[layer_idx]


def units_of(layer) -> list[Unit]:
    """The timed units of a decoder layer (see the module docstring)."""
    import torch.nn as nn

    out = [Unit("", "layer")]
    children = dict(layer.named_children())
    attn = next((n for n in ATTENTION_NAMES if n in children), None)
    mlp = next((n for n in MLP_NAMES if n in children), None)
    if attn is None or mlp is None:
        raise ValueError(f"{type(layer).__name__} has no {'/'.join(ATTENTION_NAMES)} and {'/'.join(MLP_NAMES)} "
                         "children: not a decoder layer of the Llama family's layout")
    out.append(Unit(attn, "attention"))
    out += [Unit(f"{attn}.{n}", "attn_proj") for n, m in children[attn].named_children() if isinstance(m, nn.Linear)]
    out.append(Unit(mlp, "mlp"))
    mlp_children = dict(children[mlp].named_children())
    moe = "experts" in mlp_children
    if moe:
        out.append(Unit(f"{mlp}.gate", "router"))
    else:
        out += [Unit(f"{mlp}.{n}", "mlp_proj") for n, m in mlp_children.items() if isinstance(m, nn.Linear)]
    out += [Unit(n, "norm") for n in children if "norm" in n.lower()]
    # the layer's residual adds (`hidden_states = residual + hidden_states`): one per block, attention and MLP
    out.append(Unit("+", "residual", count=2))
    return out


def capture_calls(model, layer, names: list[str], x) -> dict:
    """name -> (args, kwargs) each module received in one forward of the model on inputs_embeds `x`."""
    seen: dict = {}
    handles = []
    for name in names:
        mod = layer if name == "" else layer.get_submodule(name)

        def hook(m, args, kwargs, name=name):
            seen.setdefault(name, (args, kwargs))
        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(inputs_embeds=x)
    finally:
        for h in handles:
            h.remove()
    return seen


def _fresh(t, requires_grad: bool):
    return torch.randn(t.shape, dtype=t.dtype, device=t.device).requires_grad_(requires_grad)


def _call_maker(module, args, kwargs):
    """A function making one call's (callable, input leaves): float tensor args and a
    `hidden_states` kwarg become fresh random leaves requiring grad; everything else (the mask,
    the rotary embedding's cos/sin, position ids) is passed as the model passed it."""
    def make():
        leaves = []
        new_args = []
        for a in args:
            if torch.is_tensor(a) and a.is_floating_point():
                a = _fresh(a, True)
                leaves.append(a)
            new_args.append(a)
        new_kwargs = dict(kwargs)
        hs = new_kwargs.get("hidden_states")
        if torch.is_tensor(hs):
            new_kwargs["hidden_states"] = hs = _fresh(hs, True)
            leaves.append(hs)
        return (lambda: module(*new_args, **new_kwargs)), leaves
    return make


def _float_outputs(out) -> list:
    if torch.is_tensor(out):
        return [out] if out.is_floating_point() and out.requires_grad else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _float_outputs(o)]
    if hasattr(out, "to_tuple"):
        return _float_outputs(out.to_tuple())
    return []


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, inner: int) -> float:
        """Mean seconds of `fn(i)` over i in range(inner)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(inner):
                fn(i)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
        t0 = time.perf_counter()
        for i in range(inner):
            fn(i)
        return (time.perf_counter() - t0) / inner


def time_unit(make, params, timer: Timer, use_reentrant: bool, reps: int, warmup: int, min_rep_s: float) -> dict:
    """{pass: stats} for one unit: fwd, bwd and bwd_ckpt (see the module docstring)."""
    from torch.utils.checkpoint import checkpoint

    def forward(made, ckpt: bool):
        call, leaves = made
        out = checkpoint(call, use_reentrant=use_reentrant) if ckpt else call()
        return _float_outputs(out), leaves

    def backward(state):
        outs, leaves = state
        torch.autograd.grad(outs, leaves + params, [torch.ones_like(o) for o in outs], allow_unused=True)

    def timed_forward(n: int) -> float:
        # the inputs are made before the clock starts, and the outputs (with their graphs) are
        # kept until it stops, as a training forward keeps them
        made, kept = [make() for _ in range(n)], []
        return timer(lambda i: kept.append(made[i][0]()), n)

    for _ in range(warmup):
        backward(forward(make(), False))
        backward(forward(make(), True))
    # calls per repetition so that one lasts min_rep_s (the forward's time decides)
    # (the median of three single calls: one stall on a shared machine would set it to 1)
    probe = sorted(timed_forward(1) for _ in range(3))[1]
    inner = max(1, min(256, int(min_rep_s / max(probe, 1e-9))))
    times = {"fwd": [], "bwd": [], "bwd_ckpt": []}
    for _ in range(reps):
        times["fwd"].append(timed_forward(inner))
        for pas, ckpt in (("bwd", False), ("bwd_ckpt", True)):
            states = [forward(make(), ckpt) for _ in range(inner)]
            if timer.cuda:
                torch.cuda.synchronize()
            times[pas].append(timer(lambda i, st=states: backward(st[i]), inner))
            del states
    return {p: {**stats(ts), "inner": inner} for p, ts in times.items()}


def measure(config_dict: dict, shapes: list[tuple[int, int]], dtype: str, attn_implementation: str,
            layer_idx: int, reps: int, warmup: int, min_rep_s: float, progress=None) -> list[dict]:
    """Raw records of every unit at every (seq_len, micro_batch) shape."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model, cfg, layer = build_layer(config_dict, attn_implementation, dtype, device, layer_idx)
    units = units_of(layer)
    hf_gc = getattr(model, "gradient_checkpointing_enable", None)
    use_reentrant = _hf_use_reentrant(model) if hf_gc else True
    timer = Timer(device)
    params = {u.module: [p for p in (layer if u.module == "" else layer.get_submodule(u.module)).parameters()]
              if u.module != "+" else [] for u in units}
    records = []
    for seq_len, micro_batch in shapes:
        x = torch.randn(micro_batch, seq_len, cfg.hidden_size, dtype=TORCH_DTYPES[dtype], device=device)
        calls = capture_calls(model, layer, [u.module for u in units if u.module != "+"], x)
        for u in units:
            if progress:
                progress(f"s{seq_len}-b{micro_batch} {u.module or 'layer'}")
            if u.module == "+":
                def make(x=x):
                    a, b = _fresh(x, True), _fresh(x, True)
                    return (lambda: a + b), [a, b]
            else:
                if u.module not in calls:
                    continue   # a module the model's forward does not call (none in the supported families)
                mod = layer if u.module == "" else layer.get_submodule(u.module)
                make = _call_maker(mod, *calls[u.module])
            timed = time_unit(make, params[u.module], timer, use_reentrant, reps, warmup, min_rep_s)
            for pas, st in timed.items():
                records.append({"kind": "hf_module", "module": u.module or "layer", "group": u.group,
                                "count": u.count, "pass": pas, "seq_len": seq_len, "micro_batch": micro_batch,
                                "dtype": dtype, "layer_idx": layer_idx, **st})
        del calls, x
    return records


def _hf_use_reentrant(model) -> bool:
    """use_reentrant as transformers' own gradient checkpointing passes it (False from 5.x's
    _activation_checkpointing_enable; True in 4.35-4.x's gradient_checkpointing_enable)."""
    import functools

    # transformers 5 names it activation_checkpointing_enable (the old name warns)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    enable()
    try:
        for m in model.modules():
            f = getattr(m, "_gradient_checkpointing_func", None)
            if isinstance(f, functools.partial):
                return bool(f.keywords.get("use_reentrant", True))
        return True
    finally:
        disable()


def provenance(attn_implementation: str) -> dict:
    import datetime
    import platform
    import transformers

    prov = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "hosts": platform.node(), "attn_implementation": attn_implementation,
            "threads": str(torch.get_num_threads())}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        prov.update(gpu=p.name, gpu_memory_GiB=f"{p.total_memory / 2**30:.1f}", cuda=str(torch.version.cuda),
                    device="cuda")
    else:
        prov.update(gpu=f"CPU ({platform.processor() or platform.machine()})", device="cpu")
    return prov
