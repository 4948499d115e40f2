"""Collective recorder: wrappers on torch.distributed (and its c10d module) that log every
collective's op, size, dtype, group, phase and caller, plus the annotations annotations.py
pushes while a DeepSpeed internal runs."""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading

STATE = {"phase": "setup", "micro_step": None, "opt_step": None}
# Stack of dicts set by wrappers around a few DeepSpeed internals (which params a bucket /
# gather holds, which submodule triggered a ZeRO-3 fetch); merged into each record.
ANNOT = []
PARAM_INDEX = {}  # id(param) -> index in model.named_parameters() order
MODULE_NAME = {}  # id(module) -> qualified name
RECORDS = []
_tls = threading.local()
_coalesce = {"next_id": 0, "active": None}

# name in torch.distributed -> normalised op
WRAPPED = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather_coalesced": "all_gather",
    "all_gather_object": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "reduce": "reduce",
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
    "gather": "gather",
    "scatter": "scatter",
    "send": "send",
    "recv": "recv",
    "isend": "send",
    "irecv": "recv",
}


def _numel(x):
    import torch

    if isinstance(x, torch.Tensor):
        return int(x.numel())
    if isinstance(x, (list, tuple)):
        return sum(_numel(t) for t in x)
    return 0


def _nbytes(x):
    import torch

    if isinstance(x, torch.Tensor):
        return int(x.numel() * x.element_size())
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _first_dtype(x):
    import torch

    if isinstance(x, torch.Tensor):
        return str(x.dtype).replace("torch.", "")
    if isinstance(x, (list, tuple)):
        for t in x:
            d = _first_dtype(t)
            if d is not None:
                return d
    return None


def _arg(args, kwargs, pos, *names):
    for n in names:
        if n in kwargs:
            return kwargs[n]
    if len(args) > pos:
        return args[pos]
    return None


# the argument (position, keyword) holding the tensor(s) whose numel a call reports
_BUFFER_ARG = {
    **{n: (0, "tensor") for n in ("all_reduce", "broadcast", "reduce", "send", "recv", "isend", "irecv", "gather",
                                  "scatter")},
    "all_reduce_coalesced": (0, "tensors"),
    **{n: (0, "output_tensor") for n in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")},
    "all_gather": (0, "tensor_list"),
    "all_gather_coalesced": (0, "output_tensor_lists"),
    **{n: (1, "input") for n in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base",
                                 "all_to_all_single")},
    "reduce_scatter": (1, "input_list"),
    "all_to_all": (1, "input_tensor_list"),
}


def comm_buffer(fn_name, args, kwargs):
    """The tensor(s) whose numel is reported for this torch.distributed call (None: unknown call)."""
    spec = _BUFFER_ARG.get(fn_name)
    return _arg(args, kwargs, *spec) if spec else None


def _caller(depth=1):
    """First frame(s) outside torch, deepspeed/comm and this package (its wrappers)."""
    f = sys._getframe(2)
    out = []
    here = os.path.dirname(os.path.abspath(__file__))
    while f is not None and len(out) < depth:
        fn = f.f_code.co_filename
        skip = (
            "/torch/" in fn
            or "/deepspeed/comm/" in fn
            or "/deepspeed/utils/nvtx" in fn
            or os.path.dirname(os.path.abspath(fn)) == here
            or fn.endswith("contextlib.py")
            or fn.endswith("typing_extensions.py")
            or "<" in fn
        )
        if not skip:
            if "/deepspeed/" in fn:
                short = "deepspeed/" + fn.split("/deepspeed/", 1)[1]
            else:
                short = os.path.basename(fn)
            out.append(f"{short}:{f.f_lineno}:{f.f_code.co_name}")
        f = f.f_back
    return out


DEBUG_STACK = int(os.environ.get("RECORD_DEBUG_STACK", "0"))


def _make_wrapper(name, orig):
    import inspect

    try:
        sig = inspect.signature(orig)
    except (TypeError, ValueError):  # pragma: no cover
        sig = None

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        depth = getattr(_tls, "depth", 0)
        if depth == 0:
            _record(name, sig, args, kwargs)
        _tls.depth = depth + 1
        try:
            return orig(*args, **kwargs)
        finally:
            _tls.depth = depth

    return wrapper


def _record(name, sig, args, kwargs):
    import torch.distributed as td

    if sig is not None:
        try:
            b = sig.bind(*args, **kwargs)
            b.apply_defaults()
            kw = dict(b.arguments)
            args = ()
        except TypeError:
            kw = kwargs
    else:
        kw = kwargs
    group = kw.get("group")
    try:
        gsize = td.get_world_size(group=group) if td.is_initialized() else None
    except Exception:  # pragma: no cover
        gsize = None
    buf = comm_buffer(name, args, kw)
    rec = {
        "op": WRAPPED[name],
        "fn": name,
        "numel": _numel(buf),
        "nbytes": _nbytes(buf),
        "dtype": _first_dtype(buf),
        "group_size": gsize,
        "async_op": bool(kw.get("async_op", False)),
        "phase": STATE["phase"],
        "micro_step": STATE["micro_step"],
        "opt_step": STATE["opt_step"],
    }
    if isinstance(buf, (list, tuple)):
        rec["n_tensors"] = len(buf)
    for key in ("src", "dst"):  # broadcast source / reduce destination (global rank)
        if kw.get(key) is not None:
            rec[key] = int(kw[key])
    if _coalesce["active"] is not None:
        rec["coalesced"] = _coalesce["active"]
    for ann in ANNOT:
        rec.update(ann)
    stack = _caller(max(1, DEBUG_STACK))
    rec["caller"] = stack[0] if stack else None
    if DEBUG_STACK:
        rec["stack"] = stack
    RECORDS.append(rec)


def install_recorder():
    import torch.distributed as td
    import torch.distributed.distributed_c10d as c10d

    for mod in (c10d, td):
        for name in WRAPPED:
            orig = getattr(mod, name, None)
            if orig is None or getattr(orig, "_zsim_wrapped", False):
                continue
            w = _make_wrapper(name, orig)
            w._zsim_wrapped = True
            setattr(mod, name, w)
        cm = getattr(mod, "_coalescing_manager", None)
        if cm is not None and not getattr(cm, "_zsim_wrapped", False):
            setattr(mod, "_coalescing_manager", _wrap_coalescing(cm))


def _wrap_coalescing(cm_fn):
    @contextlib.contextmanager
    def wrapped(*args, **kwargs):
        prev = _coalesce["active"]
        cid = _coalesce["next_id"]
        _coalesce["next_id"] += 1
        _coalesce["active"] = cid
        try:
            with cm_fn(*args, **kwargs) as cm:
                yield cm
        finally:
            _coalesce["active"] = prev

    wrapped._zsim_wrapped = True
    return wrapped
