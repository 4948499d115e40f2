"""The same scenario on DeepSpeed 0.19.8 (`--engine deepspeed`) or torch FSDP2 (`--engine fsdp`),
measured the way the own core is (calibration/core/run.py): step time after warm-up, phases,
the collectives of one step, peak tensor memory per rank.

The model is calibration/core/model.py's GPT (zsim's workload module for module, the own
core's initial values and data), so DeepSpeed's flat groups, buckets and ZeRO-3 module trace
match what zsim schedules.
- DeepSpeed: the scenario's ds_config (stage, buckets, prefetch, persistence, clipping, bf16),
  client optimizer torch.optim.AdamW, gloo (DS_ACCELERATOR=cpu on a machine without a GPU).
  On CUDA GPUs: NCCL, the batch on the rank's GPU, and ZeRO-Offload (offload_optimizer /
  offload_param) as configured, with DeepSpeed's own optimizer built from the ds_config
  (DeepSpeedCPUAdam for an offloaded AdamW), as a user's offload run is.
- FSDP2: fully_shard on every block and the root; stage 3 reshards after forward, stages 1/2
  keep parameters gathered between forward and backward (ZeRO-2-like); stage 0 is DDP.
  bf16 via MixedPrecisionPolicy (fp32 sharded master parameters).
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import time

_tls = threading.local()
RECORD = {"log": None, "phase": ""}
_KINDS = {"all_reduce": "all_reduce", "reduce": "reduce", "broadcast": "broadcast",
          "all_gather_single": "all_gather", "all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather",
          "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
          "_reduce_scatter_base": "reduce_scatter", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
          "all_to_all_single": "all_to_all", "send": "send", "recv": "recv"}   # send/recv: a pipeline's (ds_pipe.py)


def install_recorder():
    """Wrap torch.distributed collectives (before deepspeed is imported: its backend captures them)."""
    import torch
    import torch.distributed as dist

    from calibration.deepspeed_record.recorder import comm_buffer

    def wrap(name, fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            depth = getattr(_tls, "depth", 0)
            if depth == 0 and RECORD["log"] is not None:
                b = comm_buffer(name, args, kwargs)
                ts = b if isinstance(b, (list, tuple)) else [b]
                ts = [t for t in ts if isinstance(t, torch.Tensor)]
                RECORD["log"].append((RECORD["phase"], _KINDS[name], sum(t.numel() for t in ts),
                                      sum(t.numel() * t.element_size() for t in ts)))
            _tls.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                _tls.depth = depth
        return inner

    for name in _KINDS:
        if hasattr(dist, name) and not getattr(getattr(dist, name), "_zsim_wrapped", False):
            w = wrap(name, getattr(dist, name))
            w._zsim_wrapped = True
            setattr(dist, name, w)


def ds_config(sc) -> dict:
    z = sc.zero
    zero = {"stage": z.stage, "contiguous_gradients": z.contiguous_gradients, "reduce_scatter": z.reduce_scatter,
            "reduce_bucket_size": int(z.reduce_bucket_size), "allgather_bucket_size": int(z.allgather_bucket_size),
            "use_multi_rank_bucket_allreduce": z.use_multi_rank_bucket_allreduce, "overlap_comm": z.overlap}
    if z.stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(z.prefetch_bucket_size),
                    stage3_param_persistence_threshold=int(z.param_persistence_threshold),
                    stage3_max_live_parameters=int(z.max_live_parameters),
                    stage3_max_reuse_distance=int(z.max_reuse_distance))
    cfg = {"train_micro_batch_size_per_gpu": sc.micro_batch_size,
           "gradient_accumulation_steps": sc.gradient_accumulation_steps,
           "bf16": {"enabled": sc.precision == "bf16"}, "gradient_clipping": sc.deepspeed.gradient_clipping,
           "zero_optimization": zero, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if sc.deepspeed.communication_data_type is not None:
        cfg["communication_data_type"] = sc.deepspeed.reduction_dtype
    if sc.sequence_parallel_size > 1:
        # the engine takes the size from the mpu; the reduction dtype from this key (see [Note: DeepSpeed-Ulysses])
        cfg["sequence_parallel_size"] = sc.sequence_parallel_size
        cfg["seq_parallel_communication_data_type"] = sc.deepspeed.reduction_dtype
        cfg.pop("communication_data_type", None)
    if z.optimizer_offload_device != "none":
        zero["offload_optimizer"] = {"device": z.optimizer_offload_device, "pin_memory": z.offload_optimizer.pin_memory}
        o = sc.deepspeed.optimizer.params or {}
        cfg["optimizer"] = {"type": "AdamW", "params": {
            "lr": float(o.get("lr", 1e-3)), "betas": list(o.get("betas", (0.9, 0.999))),
            "eps": float(o.get("eps", 1e-8)), "weight_decay": float(o.get("weight_decay", 0.01))}}
    if z.param_offload_device != "none":
        zero["offload_param"] = {"device": z.param_offload_device, "pin_memory": z.offload_param.pin_memory}
    return cfg


def offload_needs_gpu(sc, cuda: bool) -> bool:
    """ZeRO-Offload on a CPU device: no host/device split to measure."""
    return not cuda and sc.zero.offloaded


def unsupported(sc, cuda: bool) -> str | None:
    """Why the DeepSpeed/FSDP peers would not run what zsim predicts for `sc` (None when they
    would): `ds_config` writes a bf16 or fp32 config without activation checkpointing, `_optimizer`
    steps AdamW, and offload needs a GPU (`cuda`: the ranks run on one)."""
    if sc.precision == "fp16":
        return "training.precision fp16 (the peers train bf16 or fp32); set bf16 or fp32"
    if sc.training.activation_checkpointing != "none":
        return "training.activation_checkpointing (the peers run without it); set none"
    if sc.deepspeed.optimizer.name not in ("adam", "adamw"):
        return f"optimizer {sc.deepspeed.optimizer.type} (the peers step AdamW)"
    if sc.training.gradient_accumulation_fusion:
        return "training.gradient_accumulation_fusion (Megatron-LM's; DeepSpeed and FSDP add into .grad); set false"
    if offload_needs_gpu(sc, cuda):
        return ("ZeRO-Offload on a CPU device (there is no host/device split to measure); run it where CUDA is, "
                "or set the offload device to none")
    return None


def on_cuda() -> bool:
    """The peer runs on this rank's GPU: CUDA is there and DS_ACCELERATOR does not ask for the CPU."""
    import torch

    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"


def _trained(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _optimizer(sc, params):
    import torch

    # fused, as the own core's and as DeepSpeed's own choice for an "AdamW" ds_config optimizer
    # (FusedAdam, multi_tensor_apply): zsim charges one fused pass over the shard
    o = sc.deepspeed.optimizer.params or {}
    return torch.optim.AdamW(params, lr=float(o.get("lr", 1e-3)), betas=tuple(o.get("betas", (0.9, 0.999))),
                             eps=float(o.get("eps", 1e-8)), weight_decay=float(o.get("weight_decay", 0.01)),
                             fused=True)


def _model(sc, seed: int, use_peft: bool):
    """The scenario's GPT as it is trained: with training.lora, through PEFT's own get_peft_model
    (`use_peft`, the DeepSpeed reference) or the core's mirror of it (model.peft_wrap)."""
    from calibration.core.lora import for_training
    from calibration.core.model import GPT
    from zsim.schedule.build import workload_for

    lora = sc.training.lora
    if sc.model.moe is not None:
        if lora is not None or sc.training.frozen:
            raise SystemExit("--engine deepspeed: DeepSpeed-MoE with training.lora or training.frozen is not mirrored")
        from calibration.core.moe import deepspeed_moe_gpt
        return deepspeed_moe_gpt(sc, seed)
    wl = workload_for(sc)
    model = GPT(sc.model).initialized(seed)
    if not (use_peft and lora is not None):
        return for_training(model, sc, wl)
    from peft import LoraConfig, get_peft_model

    # the targets zsim chose (zsim/workload/lora.py), as full module names: PEFT matches a name in
    # the list exactly
    targets = [m.name.removesuffix(".lora_A.default") for m in wl.modules if m.name.endswith(".lora_A.default")]
    saved = [m.name.removesuffix(".modules_to_save.default") for m in wl.modules
             if m.name.endswith(".modules_to_save.default")]
    model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                             target_modules=targets, modules_to_save=saved or None))
    names = [n.removeprefix("base_model.model.") for n, _ in model.named_parameters()]
    if names != [p.name for p in wl.params] or \
            [p.requires_grad for p in model.parameters()] != [p.trainable for p in wl.params]:
        raise SystemExit("PEFT's model does not mirror zsim's LoRA workload")
    return model


def main(args, sc) -> int:
    install_recorder()
    import torch
    import torch.distributed as dist

    from calibration.core.measured import measure_steps
    from calibration.core.model import batch

    gas = sc.gradient_accumulation_steps
    cuda = on_cuda()
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if offload_needs_gpu(sc, cuda):
        raise SystemExit("ZeRO-Offload needs a GPU: on a CPU device there is no host/device split to measure")
    offloaded = sc.zero.offloaded
    if args.engine == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
        rank = dist.get_rank()
        model = _model(sc, args.seed, use_peft=True)
        ulysses = None
        if sc.sequence_parallel_size > 1:     # see [Note: DeepSpeed-Ulysses]
            from calibration.core.ulysses import Ulysses
            ulysses = Ulysses(sc.model, sc.sequence_parallel_size, sc.micro_batch_size, sc.seq_len)
            ulysses.install(model)
        # the optimizer gets the trainable params, as HF Trainer / PEFT hand them over
        params = _trained(model)
        if sc.model.moe is not None:
            # DeepSpeed-MoE: the expert params in their own optimizer groups (moe/utils.py), as the
            # engine requires of a client optimizer (_configure_moe_settings)
            from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

            params = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense-params"})
        # offloaded: DeepSpeed builds its own optimizer from the ds_config (DeepSpeedCPUAdam)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=None if offloaded else _optimizer(sc, params),
                                               model_parameters=params if offloaded else None,
                                               config=ds_config(sc), mpu=None if ulysses is None else ulysses.mpu)

        def fwd(ids, labels):
            if ulysses is not None:
                ids, labels = ulysses.shard(ids, labels)
                return ulysses.loss(engine(ids, labels), labels.numel())
            return engine(ids, labels)

        def bwd(loss):
            engine.backward(loss)
            if not engine.is_gradient_accumulation_boundary():
                # DeepSpeed counts micro-steps in engine.step(), which must follow every backward
                # (it steps the optimizer at the boundary only); without it every backward of
                # the window after gas-1 skipped ones would count as a boundary
                engine.step()

        def step(boundary):
            engine.step()
    else:
        dist.init_process_group("nccl" if cuda else "gloo")
        rank = dist.get_rank()
        if sc.sequence_parallel_size > 1:
            raise SystemExit("--engine fsdp: DeepSpeed-Ulysses (parallelism.sequence) runs on --engine deepspeed")
        if sc.model.moe is not None:
            raise SystemExit("--engine fsdp: MoE models run on the own core or DeepSpeed")
        if offloaded:
            raise SystemExit("--engine fsdp: ZeRO-Offload runs on DeepSpeed")
        model = _model(sc, args.seed, use_peft=False).to(device)
        dtype = torch.bfloat16 if sc.precision == "bf16" else torch.float32
        if sc.zero.stage == 0:
            from torch.nn.parallel import DistributedDataParallel as DDP
            model = model.to(dtype)
            module = DDP(model, bucket_cap_mb=max(1, int(sc.zero.reduce_bucket_size * 2 / 2**20)),
                         device_ids=[device.index] if cuda else None)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
            reshard = sc.zero.stage == 3
            for blk in model.layers:
                fully_shard(blk, reshard_after_forward=reshard, mp_policy=mp)
            fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
            module = model
        opt = _optimizer(sc, _trained(model))
        clip = sc.deepspeed.gradient_clipping

        def fwd(ids, labels):
            return module(ids, labels)

        def bwd(loss):
            (loss / gas).backward()

        def step(boundary):
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(_trained(model), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

    # a phase ends when its GPU work has (the CPU path's calls block already)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    def train_step(s, phases=None, around_step=contextlib.nullcontext):
        losses = []
        for micro in range(gas):
            # the ranks of one sequence group train the same samples, each its own slice
            ids, labels = (t.to(device) for t in batch(sc, s, micro, rank // sc.sequence_parallel_size, args.seed))
            for ph in ("forward", "backward"):
                RECORD["phase"] = ph
                t0 = time.perf_counter()
                if ph == "forward":
                    loss = fwd(ids, labels)
                    losses.append(float(loss.detach()))
                else:
                    bwd(loss)
                sync()
                if phases is not None:
                    phases[ph] = phases.get(ph, 0.0) + time.perf_counter() - t0
        RECORD["phase"] = "step"
        t0 = time.perf_counter()
        with around_step():
            step(True)
            sync()
        if phases is not None:
            phases["step"] = phases.get("step", 0.0) + time.perf_counter() - t0
        return losses

    measure_steps(args, sc, args.engine, train_step, RECORD, device=device)
