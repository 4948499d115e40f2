"""Record the torch.distributed collectives that real DeepSpeed issues for a small GPT.

This is calibration tooling, not part of zsim: it imports torch and deepspeed and is
never imported by the simulator or its tests.  It produces the JSON fixtures under
tests/fixtures/deepspeed/ that the simulator's tests compare against.

Usage (one case, 2 ranks, CPU/gloo):

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 TORCH_EXTENSIONS_DIR=/work/.torch_ext \
      /work/venv-ds/bin/torchrun --standalone --nproc-per-node 2 \
      calibration/deepspeed_record.py --case stage2_default --out tests/fixtures/deepspeed

All cases, one after another (spawns torchrun per case):

    /work/venv-ds/bin/python calibration/deepspeed_record.py --all --out tests/fixtures/deepspeed

The wrappers are installed on torch.distributed *before* deepspeed is imported,
because deepspeed.comm.torch.TorchBackend captures
torch.distributed.all_gather_into_tensor / reduce_scatter_tensor at construction time.
"""

import argparse
import contextlib
import copy
import functools
import json
import os
import subprocess
import sys
import threading

# --------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------

WORLD_SIZE = 2
MICRO_BATCH = 2
OPT_STEPS = 2


def _base(stage, **zero):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }
    cfg["zero_optimization"].update(zero)
    return cfg


def _with(cfg, **top):
    cfg = copy.deepcopy(cfg)
    cfg.update(top)
    return cfg


def build_cases():
    c = {}
    # ---- stage 1
    c["stage1_default"] = _base(1)
    c["stage1_reduce_bucket_1e6"] = _base(1, reduce_bucket_size=1000000)
    c["stage1_allgather_bucket_1e6"] = _base(1, allgather_bucket_size=1000000)
    c["stage1_gas2"] = _with(_base(1), gradient_accumulation_steps=2)
    c["stage1_clip"] = _with(_base(1), gradient_clipping=1.0)
    c["stage1_overlap_true"] = _base(1, overlap_comm=True)
    c["stage1_multi_rank_allreduce_false"] = _base(1, use_multi_rank_bucket_allreduce=False)
    c["stage1_grad_accum_fp32"] = _with(_base(1), data_types={"grad_accum_dtype": "fp32"})
    # ---- stage 2
    c["stage2_default"] = _base(2)
    c["stage2_reduce_bucket_1e6"] = _base(2, reduce_bucket_size=1000000)
    c["stage2_allgather_bucket_1e6"] = _base(2, allgather_bucket_size=1000000)
    c["stage2_overlap_false"] = _base(2, overlap_comm=False)
    c["stage2_overlap_true"] = _base(2, overlap_comm=True)
    c["stage2_reduce_scatter_false"] = _base(2, reduce_scatter=False)
    c["stage2_contiguous_false"] = _base(2, contiguous_gradients=False)
    c["stage2_multi_rank_allreduce_false"] = _base(2, use_multi_rank_bucket_allreduce=False)
    c["stage2_gas2"] = _with(_base(2), gradient_accumulation_steps=2)
    c["stage2_clip"] = _with(_base(2), gradient_clipping=1.0)
    c["stage2_fp32"] = _with(_base(2), bf16={"enabled": False})
    # ---- stage 0 (plain data parallel)
    c["stage0_default"] = _base(0)
    # ---- stage 3
    c["stage3_default"] = _base(3, stage3_prefetch_bucket_size=50000000)
    c["stage3_prefetch_1e6"] = _base(3, stage3_prefetch_bucket_size=1000000)
    c["stage3_prefetch_0"] = _base(3, stage3_prefetch_bucket_size=0)
    c["stage3_persistence_0"] = _base(3, stage3_param_persistence_threshold=0)
    c["stage3_max_live_1e6"] = _base(3, stage3_max_live_parameters=1000000)
    c["stage3_reuse_0"] = _base(3, stage3_max_reuse_distance=0)
    c["stage3_gas2"] = _with(_base(3), gradient_accumulation_steps=2)
    c["stage3_reduce_bucket_1e6"] = _base(3, reduce_bucket_size=1000000)
    c["stage3_clip"] = _with(_base(3), gradient_clipping=1.0)
    c["stage3_reduce_scatter_false"] = _base(3, reduce_scatter=False)
    # reuse distance only matters once params can actually be released between fwd and bwd,
    # i.e. when the prefetcher has not already scanned past their backward use.
    c["stage3_prefetch_0_reuse_0"] = _base(3, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    c["stage3_prefetch_1e6_reuse_0"] = _base(3, stage3_prefetch_bucket_size=1000000,
                                             stage3_max_reuse_distance=0)
    c["stage3_max_live_1e6_reuse_0"] = _base(3, stage3_max_live_parameters=1000000,
                                             stage3_max_reuse_distance=0)
    return c


CASES = build_cases()

# --------------------------------------------------------------------------------------
# Collective recorder (installed before deepspeed is imported)
# --------------------------------------------------------------------------------------

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


def _buffer(fn_name, args, kwargs):
    """Return the tensor(s) whose numel is reported for this call."""
    if fn_name in ("all_reduce", "broadcast", "reduce", "send", "recv", "isend", "irecv"):
        return _arg(args, kwargs, 0, "tensor")
    if fn_name == "all_reduce_coalesced":
        return _arg(args, kwargs, 0, "tensors")
    if fn_name in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"):
        return _arg(args, kwargs, 0, "output_tensor")
    if fn_name == "all_gather":
        return _arg(args, kwargs, 0, "tensor_list")
    if fn_name == "all_gather_coalesced":
        return _arg(args, kwargs, 0, "output_tensor_lists")
    if fn_name in ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base"):
        return _arg(args, kwargs, 1, "input")
    if fn_name == "reduce_scatter":
        return _arg(args, kwargs, 1, "input_list")
    if fn_name in ("all_to_all_single",):
        return _arg(args, kwargs, 1, "input")
    if fn_name in ("all_to_all",):
        return _arg(args, kwargs, 1, "input_tensor_list")
    if fn_name == "gather":
        return _arg(args, kwargs, 0, "tensor")
    if fn_name == "scatter":
        return _arg(args, kwargs, 0, "tensor")
    return None


def _caller(depth=1):
    """First frame(s) outside torch, deepspeed/comm and this file."""
    f = sys._getframe(2)
    out = []
    here = os.path.abspath(__file__)
    while f is not None and len(out) < depth:
        fn = f.f_code.co_filename
        skip = (
            "/torch/" in fn
            or "/deepspeed/comm/" in fn
            or "/deepspeed/utils/nvtx" in fn
            or os.path.abspath(fn) == here
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
    buf = _buffer(name, args, kw)
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


# --------------------------------------------------------------------------------------
# Annotations from DeepSpeed internals (param indices of buckets and gathers)
# --------------------------------------------------------------------------------------


def _pidx(params):
    return [PARAM_INDEX.get(id(p), -1) for p in params]


def _wrap_method(cls, attr, ctx_fn):
    orig = cls.__dict__.get(attr)
    if orig is None:
        raise AttributeError(f"{cls.__name__}.{attr} not found (DeepSpeed version changed?)")

    @functools.wraps(orig)
    def wrapper(self, *args, **kwargs):
        ann = ctx_fn(self, sys._getframe(1), *args, **kwargs)
        if ann is None:
            return orig(self, *args, **kwargs)
        ANNOT.append(ann)
        try:
            return orig(self, *args, **kwargs)
        finally:
            ANNOT.pop()

    setattr(cls, attr, wrapper)


def install_annotations():
    import linecache

    import torch
    from deepspeed.runtime.zero import stage_1_and_2, stage3
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as PPC

    Z12 = stage_1_and_2.DeepSpeedZeroOptimizer
    Z3 = stage3.DeepSpeedZeroOptimizer_Stage3

    # ZeRO-1/2: the IPG bucket being reduced.  bucket.params holds (group, idx_in_group, param_id).
    def z12_reduce_ipg(self, frame, comm_dtype=None):
        dts = [comm_dtype] if comm_dtype is not None else list(self.ipg_buckets.keys())
        params = []
        for dt in dts:
            for g, j, _pid in self.ipg_buckets[dt].params:
                params.append(self.bit16_groups[g][j])
        return {"bucket_params": _pidx(params)}

    _wrap_method(Z12, "reduce_ipg_grads", z12_reduce_ipg)

    # ZeRO-3: the IPG bucket being reduce-scattered (insertion order).
    def z3_reduce_ipg(self, frame, communication_data_type):
        return {"bucket_params": _pidx(self.ipg_buckets[communication_data_type].params)}

    _wrap_method(Z3, "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads", z3_reduce_ipg)

    # ZeRO-3: persistent-parameter gather after the optimizer step.
    def z3_post_step(self, frame, *a, **k):
        return {"gather": "persistent_post_step"}

    _wrap_method(Z3, "_post_step", z3_post_step)

    # ZeRO-3: submodule whose pre-forward/pre-backward hook triggered a fetch.
    def ppc_fetch(self, frame, current_submodule, forward):
        return {"module": MODULE_NAME.get(id(current_submodule), type(current_submodule).__name__)}

    _wrap_method(PPC, "fetch_sub_module", ppc_fetch)

    # ZeRO-3: the parameter set handed to one all_gather_coalesced (fetch vs prefetch).
    def ppc_all_gather(self, frame, params, forward):
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        kind = "prefetch" if "prefetch" in line else ("fetch" if "fetch" in line else frame.f_code.co_name)
        return {"gather": kind, "gather_params": sorted(_pidx(params))}

    _wrap_method(PPC, "_PartitionedParameterCoordinator__all_gather_params", ppc_all_gather)


# --------------------------------------------------------------------------------------
# Model (GPT-2 style, untied lm_head)
# --------------------------------------------------------------------------------------

VOCAB, SEQ, LAYERS, HIDDEN, HEADS, FFN = 1024, 128, 8, 512, 8, 2048


def build_model():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN, bias=True)
            self.c_proj = nn.Linear(HIDDEN, HIDDEN, bias=True)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            hd = C // HEADS
            q = q.view(B, T, HEADS, hd).transpose(1, 2)
            k = k.view(B, T, HEADS, hd).transpose(1, 2)
            v = v.view(B, T, HEADS, hd).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.c_proj(y)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(HIDDEN, FFN, bias=True)
            self.c_proj = nn.Linear(FFN, HIDDEN, bias=True)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x)))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(HIDDEN)
            self.attn = Attention()
            self.ln_2 = nn.LayerNorm(HIDDEN)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            x = x + self.mlp(self.ln_2(x))
            return x

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(VOCAB, HIDDEN)
            self.wpe = nn.Embedding(SEQ, HIDDEN)
            self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
            self.ln_f = nn.LayerNorm(HIDDEN)
            self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

        def forward(self, idx, targets):
            B, T = idx.shape
            pos = torch.arange(T, device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for blk in self.blocks:
                x = blk(x)
            x = self.ln_f(x)
            logits = self.lm_head(x)
            return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))

    return GPT()


# --------------------------------------------------------------------------------------
# One case (run under torchrun)
# --------------------------------------------------------------------------------------


def run_case(name, out_dir):
    install_recorder()

    import torch
    import torch.distributed as td

    rank = int(os.environ["RANK"])
    torch.manual_seed(1234)
    td.init_process_group("gloo")

    import deepspeed  # noqa: E402  (after the wrappers are installed)

    deepspeed.init_distributed(dist_backend="gloo")

    cfg = copy.deepcopy(CASES[name])
    gas = cfg["gradient_accumulation_steps"]
    model = build_model()
    param_list = [{"index": i, "name": n, "numel": int(p.numel()), "shape": list(p.shape)}
                  for i, (n, p) in enumerate(model.named_parameters())]
    for i, (n, p) in enumerate(model.named_parameters()):
        PARAM_INDEX[id(p)] = i
    for n, m in model.named_modules():
        MODULE_NAME[id(m)] = n or "<root>"
    install_annotations()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    STATE["phase"] = "init"
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    engine.train()

    g = torch.Generator().manual_seed(4321 + rank)
    losses = []
    for s in range(OPT_STEPS):
        for m in range(gas):
            idx = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
            tgt = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
            STATE.update(opt_step=s, micro_step=m, phase="forward")
            loss = engine(idx, tgt)
            STATE["phase"] = "backward"
            engine.backward(loss)
            STATE["phase"] = "step"
            engine.step()
            STATE.update(phase="post", micro_step=None, opt_step=None)
            losses.append(float(loss.detach().float()))

    for i, r in enumerate(RECORDS):
        r["idx"] = i

    # compare with rank 1 (traces must be identical apart from per-rank content)
    def _key(r):
        return (r["op"], r["fn"], r["numel"], r["dtype"], r["phase"], r["micro_step"], r["opt_step"])

    mine = [list(_key(r)) for r in RECORDS]
    gathered = [None] * td.get_world_size()
    STATE["phase"] = "post"
    n_before = len(RECORDS)
    td.all_gather_object(gathered, mine)
    del RECORDS[n_before:]
    identical = all(x == gathered[0] for x in gathered)

    if rank == 0:
        doc = {
            "case": name,
            "world_size": td.get_world_size(),
            "backend": td.get_backend(),
            "versions": {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                         "python": sys.version.split()[0]},
            "accelerator": type(deepspeed.get_accelerator()).__name__,
            "ds_config": cfg,
            "model": {"vocab": VOCAB, "seq_len": SEQ, "layers": LAYERS, "hidden": HIDDEN,
                      "heads": HEADS, "ffn": FFN, "tied_lm_head": False,
                      "total_params": sum(p["numel"] for p in param_list)},
            "params": param_list,
            "optimizer": {"class": type(engine.optimizer).__name__,
                          "client": "torch.optim.AdamW(lr=1e-3)"},
            "gradient_accumulation_steps": gas,
            "optimizer_steps": OPT_STEPS,
            "losses": losses,
            "final_loss": losses[-1],
            "ranks_identical_trace": identical,
            "collectives": RECORDS,
        }
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{name}.json")
        with open(path, "w") as fh:
            json.dump(doc, fh, indent=1, sort_keys=True)
            fh.write("\n")
        print(f"[record] {name}: {len(RECORDS)} collectives, identical={identical}, "
              f"loss={losses[-1]:.4f} -> {path}", flush=True)
    td.barrier()
    td.destroy_process_group()
    # Skip interpreter teardown: with gloo + DeepSpeed's shm comm op a background C++
    # thread occasionally aborts at exit ("terminate called without an active
    # exception") after all work is done, which would make torchrun report a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_all(names, out_dir):
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_EXTENSIONS_DIR", "/work/.torch_ext")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    failed = []
    for n in names:
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(WORLD_SIZE), os.path.abspath(__file__),
               "--case", n, "--out", out_dir]
        print("+", " ".join(cmd), flush=True)
        if subprocess.call(cmd, env=env) != 0:
            failed.append(n)
    if failed:
        print("FAILED:", failed)
        sys.exit(1)


def summarize(path, min_fold=4):
    """Compact, run-length compressed view of one fixture (no torch needed)."""
    with open(path) as fh:
        d = json.load(fh)
    lines = [f"== {d['case']}  ({len(d['collectives'])} collectives, optimizer={d['optimizer']['class']}, "
             f"final_loss={d['final_loss']:.4f}, ranks_identical={d['ranks_identical_trace']})"]
    recs = d["collectives"]
    i = 0
    while i < len(recs):
        r = recs[i]
        where = f"{r['phase']}" + ("" if r["opt_step"] is None else f"[s{r['opt_step']}m{r['micro_step']}]")
        # fold a run of same (phase, step, op, fn, caller) into one line
        j = i
        while (j + 1 < len(recs) and all(recs[j + 1].get(k) == r.get(k) for k in
                                         ("phase", "opt_step", "micro_step", "op", "fn", "caller", "dtype", "gather"))):
            j += 1
        run = recs[i:j + 1]
        sizes = [x["numel"] for x in run]
        if len(set(sizes)) == 1:
            sz = f"{sizes[0]} x{len(run)}" if len(run) > 1 else f"{sizes[0]}"
        elif len(run) <= min_fold:
            sz = ",".join(map(str, sizes))
        else:
            # run-length encode the sizes themselves
            parts, k = [], 0
            while k < len(sizes):
                m = k
                while m + 1 < len(sizes) and sizes[m + 1] == sizes[k]:
                    m += 1
                parts.append(f"{sizes[k]}" + (f"x{m - k + 1}" if m > k else ""))
                k = m + 1
            sz = f"n={len(run)} sum={sum(sizes)} [" + ",".join(parts) + "]"
        flags = ("async " if r["async_op"] else "") + (f"coal{r['coalesced']} " if "coalesced" in r else "")
        if r.get("gather"):
            flags += r["gather"] + " "
        lines.append(f"  {where:12s} {r['op']:14s} {r['dtype'] or '-':8s} {flags}{sz}   <{r['caller']}>")
        i = j + 1
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case")
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--summarize", nargs="+", metavar="JSON")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                                  "tests", "fixtures", "deepspeed"))
    a = ap.parse_args()
    if a.summarize:
        for p in a.summarize:
            print(summarize(p))
        return
    if a.list:
        print("\n".join(CASES))
        return
    if a.all:
        run_all(list(CASES), os.path.abspath(a.out))
        return
    if a.case not in CASES:
        ap.error(f"unknown case {a.case!r}; use --list")
    run_case(a.case, os.path.abspath(a.out))


if __name__ == "__main__":
    main()
