"""DeepSpeed's config (ds_config.json), with DeepSpeed 0.19.8's key names, aliases and defaults.

Defaults are those of deepspeed/runtime/zero/config.py (DeepSpeedZeroConfig),
zero/offload_config.py, runtime/config.py and runtime/activation_checkpointing/config.py.
Top-level keys DeepSpeed accepts but that do not change a training step's time or memory
(logging, monitors, checkpoint I/O) are accepted and ignored, listed in IGNORED_TOP_LEVEL.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from zsim.schema import spec

# Gradient accumulation: no published run accumulates more than a few thousand micro-steps, and
# past a few the step's per-micro-step figures repeat (each extra micro-step adds the same time),
# so 2**16 is a bound of meaning, not of simulation speed.
MAX_GRADIENT_ACCUMULATION_STEPS = 2**16
# Sequences per GPU per micro-step: far above what fits in any GPU at any sequence length.
MAX_MICRO_BATCH_SIZE = 2**16


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig:
    device: Literal["none", "cpu", "nvme"] = spec("none")
    nvme_path: Optional[str] = spec(None)
    buffer_count: int = spec(5, ge=0)
    buffer_size: int = spec(int(1e8), ge=0)
    max_in_cpu: int = spec(int(1e9), ge=0)
    pin_memory: bool = spec(True)


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig:
    device: Literal["none", "cpu", "nvme"] = spec("none")
    nvme_path: Optional[str] = spec(None)
    buffer_count: int = spec(4, ge=0)
    pin_memory: bool = spec(True)
    pipeline_read: bool = spec(False)
    pipeline_write: bool = spec(False)
    pipeline: bool = spec(False)
    fast_init: bool = spec(False)
    ratio: float = spec(1.0, ge=0.0, le=1.0)
    super_offload: bool = spec(False)
    cpuadam_cores_perc: float = spec(0.8, ge=0.0, le=1.0)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    stage: Literal[0, 1, 2, 3] = spec(0)
    contiguous_gradients: bool = spec(True)
    reduce_scatter: bool = spec(True)
    reduce_bucket_size: int = spec(int(5e8), gt=0)
    use_multi_rank_bucket_allreduce: bool = spec(True)
    allgather_partitions: bool = spec(True)
    allgather_bucket_size: int = spec(int(5e8), ge=0)
    overlap_comm: Optional[bool] = spec(None, doc="DeepSpeed's default: true for stage 3, false otherwise")
    compute_grad_norm: bool = spec(True)
    load_from_fp32_weights: bool = spec(True)
    elastic_checkpoint: bool = spec(False)
    offload_param: Optional[OffloadParamConfig] = spec(None)
    offload_optimizer: Optional[OffloadOptimizerConfig] = spec(None)
    sub_group_size: int = spec(int(1e9), ge=0)
    cpu_offload_param: Optional[bool] = spec(None)
    cpu_offload_use_pin_memory: Optional[bool] = spec(None)
    cpu_offload: Optional[bool] = spec(None)
    prefetch_bucket_size: int = spec(int(5e7), ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = spec(int(1e5), ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = spec(2**63 - 1, ge=0, alias="stage3_model_persistence_threshold")
    max_live_parameters: int = spec(int(1e9), ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = spec(int(1e9), ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = spec(False, alias="stage3_gather_16bit_weights_on_model_save")
    module_granularity_threshold: int = spec(0, alias="stage3_module_granularity_threshold")
    use_all_reduce_for_fetch_params: bool = spec(False, alias="stage3_use_all_reduce_for_fetch_params")
    allgather_sequential: bool = spec(False, alias="stage3_allgather_sequential")
    stage3_gather_fp16_weights_on_model_save: bool = spec(False)
    ignore_unused_parameters: bool = spec(True)
    legacy_stage1: bool = spec(False)
    round_robin_gradients: bool = spec(False)
    parameter_alignment: bool = spec(False)
    zero_hpz_partition_size: int = spec(1, ge=0, doc="ZeRO++ hpZ (stage 3): a secondary partition of each "
                                        "released param over blocks of this many consecutive ranks, which later "
                                        "gathers use (see [Note: hpZ secondary partitions]); 0 and 1 are off")
    zero_quantized_weights: bool = spec(False)
    zero_quantized_nontrainable_weights: bool = spec(False)
    zero_quantized_gradients: bool = spec(False)
    memory_efficient_linear: bool = spec(True)
    pipeline_loading_checkpoint: bool = spec(False)
    override_module_apply: bool = spec(True)
    log_trace_cache_warnings: bool = spec(False)
    enable_sanity_checks: bool = spec(False)
    save_muon_momentum_buffer_in_memory: bool = spec(False)
    leaf_module: dict[str, Any] = spec(factory=dict)
    zenflow: Optional[dict[str, Any]] = spec(None)

    @property
    def overlap(self) -> bool:
        # zero/config.py overlap_comm_valid: None -> stage == 3
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    @property
    def optimizer_offload_device(self) -> str:
        if self.offload_optimizer is not None:
            return self.offload_optimizer.device
        return "cpu" if self.cpu_offload else "none"

    @property
    def param_offload_device(self) -> str:
        if self.offload_param is not None:
            return self.offload_param.device
        return "cpu" if self.cpu_offload_param else "none"

    def zero_plus_plus_warnings(self, has_frozen: bool) -> tuple[str, ...]:
        """ZeRO++ keys DeepSpeed accepts and zsim leaves out of the prediction: each at stages 0-2
        (DeepSpeed ignores them there too)."""
        out = []
        if self.stage < 3:
            for key, on in (("zero_hpz_partition_size", self.zero_hpz_partition_size > 1),
                            ("zero_quantized_weights", self.zero_quantized_weights),
                            ("zero_quantized_gradients", self.zero_quantized_gradients),
                            ("zero_quantized_nontrainable_weights", self.zero_quantized_nontrainable_weights)):
                if on:
                    out.append(f"deepspeed.zero_optimization.{key}: ZeRO++ acts at stage 3 only; DeepSpeed "
                               f"ignores it at stage {self.stage}, and so does this prediction")
        return tuple(out)

    @property
    def offloaded(self) -> bool:
        """ZeRO-Offload of the optimizer or the parameters (to CPU or NVMe)."""
        return self.optimizer_offload_device != "none" or self.param_offload_device != "none"

    def __post_init__(self):
        # ZeRO++ acts at stage 3 only (partition_parameters.py, stage3.py): DeepSpeed 0.19.8 ignores
        # its keys at stages 0-2 (recorded: tests/fixtures/deepspeed_zeropp/stage2_hpz2_w2.json
        # issues stage 2's calls unchanged), and zsim with it (zero_plus_plus_warnings says so)
        if self.stage == 3 and self.zero_quantized_gradients and not self.reduce_scatter:
            # stage3.py:389-390: assert reduce_scatter with zero_quantized_gradients
            raise ValueError("zero_quantized_gradients", True, "qgZ needs reduce_scatter: true (DeepSpeed asserts "
                             "it, stage3.py); set reduce_scatter true or drop qgZ")
        if self.stage == 3 and self.zero_hpz_partition_size > 1 and self.param_offload_device != "none":
            # partition_parameters.py:1166-1170, 1915-1920: the secondary partition goes to the
            # offload device (an NVMe one cannot hold a torch tensor)
            raise ValueError("zero_hpz_partition_size", self.zero_hpz_partition_size,
                             "hpZ with offload_param (its secondary partitions on the offload device) is not "
                             "modelled by zsim; remove one of the two")
        if self.offload_optimizer and self.offload_optimizer.ratio < 1.0 and self.stage != 3:
            raise ValueError("offload_optimizer.ratio", self.offload_optimizer.ratio,
                             "partial offloading is only supported for ZeRO stage 3 (DeepSpeed's rule)")
        if not self.compute_grad_norm and self.stage not in (1, 2):
            raise ValueError("compute_grad_norm", False, "compute_grad_norm=false is supported only with ZeRO stage 1 or 2")
        if self.optimizer_offload_device != "none" and self.stage == 0:
            # engine.py _configure_basic_optimizer builds DeepSpeedCPUAdam whenever offload_optimizer
            # names cpu/nvme, but without a ZeRO optimizer nothing moves the fp32 states or the
            # gradients to the host: its step asserts "CPUAdam param is on cuda:0 and must be 'cpu'"
            # (ops/adam/cpu_adam.py)
            raise ValueError("offload_optimizer.device", self.optimizer_offload_device,
                             "optimizer offload needs ZeRO stage 1, 2 or 3 (at stage 0 DeepSpeed's CPU Adam "
                             "fails on GPU parameters); set stage >= 1 or offload_optimizer.device: none")
        if self.param_offload_device != "none" and self.stage != 3:
            raise ValueError("offload_param.device", self.param_offload_device,
                             "parameter offload needs ZeRO stage 3; set stage: 3 or remove offload_param")


@dataclass(frozen=True, kw_only=True)
class Fp16Config:
    enabled: bool = spec(False)
    auto_cast: bool = spec(False)
    loss_scale: float = spec(0.0, ge=0)
    initial_scale_power: int = spec(16, ge=0)
    loss_scale_window: int = spec(1000, ge=1)
    hysteresis: int = spec(2, ge=1)
    consecutive_hysteresis: bool = spec(False)
    min_loss_scale: float = spec(1.0, ge=0)
    fp16_master_weights_and_grads: bool = spec(False)


@dataclass(frozen=True, kw_only=True)
class Bf16Config:
    """DeepSpeed 0.19.8's DeepSpeedBF16Config (runtime/precision_config.py:41-71), its defaults."""
    enabled: bool = spec(False)
    immediate_grad_update: bool = spec(False)
    check_grad_overflow: bool = spec(True)
    bf16_master_weights_and_grads: bool = spec(False)
    bf16_optimizer_states: bool = spec(False)


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig:
    partition_activations: bool = spec(False)
    contiguous_memory_optimization: bool = spec(False)
    cpu_checkpointing: bool = spec(False)
    number_checkpoints: Optional[int] = spec(None)
    synchronize_checkpoint_boundary: bool = spec(False)
    profile: bool = spec(False)


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    block_size: int = spec(1048576, gt=0)
    queue_depth: int = spec(8, gt=0)
    intra_op_parallelism: int = spec(1, gt=0)
    thread_count: int = spec(1, gt=0)
    single_submit: bool = spec(False)
    overlap_events: bool = spec(True)
    use_gds: bool = spec(False)


@dataclass(frozen=True, kw_only=True)
class DataTypesConfig:
    grad_accum_dtype: Optional[Literal["fp32", "fp16", "bf16"]] = spec(None)


# [Note: optimizer states by type] The fp32 state tensors per parameter of each optimizer a
# ds_config's "optimizer" block builds (engine.py _configure_basic_optimizer): a name in
# DeepSpeed's list (runtime/config.py DEEPSPEED_OPTIMIZERS, matched in any case) is DeepSpeed's
# (Adam/AdamW: FusedAdam or DeepSpeedCPUAdam, exp_avg and exp_avg_sq; Lamb: FusedLamb, the same
# two; Lion: exp_avg; Adagrad: its sum; MuAdam/MuAdamW: Adam's; MuSGD: SGD's), any other name is
# looked up in torch.optim as written (SGD: a momentum buffer when momentum > 0; RMSprop:
# square_avg, plus momentum_buffer and grad_avg when momentum > 0 and centered). Each state is
# read and written by the step, beside the fp32 master (read, write) and the gradient (read).
DEEPSPEED_OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "lamb": 2, "lion": 1, "adagrad": 1, "muadam": 2, "muadamw": 2}
# DeepSpeed <= 0.19.6's communication-compressed optimizers (runtime/config.py ONEBIT_ADAM_OPTIMIZER,
# ZERO_ONE_ADAM_OPTIMIZER, ONEBIT_LAMB_OPTIMIZER, matched in any case), removed in 0.19.7: 0.19.8's
# engine.py _do_sanity_check asserts _is_supported_optimizer (its list or a torch.optim name) and fails
REMOVED_OPTIMIZERS = {"onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam", "onebitlamb": "1-bit LAMB"}
# stage_1_and_2.py / stage3.py need an optimizer of runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS
# (torch Adam/AdamW, FusedAdam, DeepSpeedCPUAdam, Adagrad, DeepSpeedCPUAdagrad, the Lions) unless
# zero_allow_untested_optimizer; with offload_optimizer DeepSpeed builds CPU kernels for these
ZERO_SUPPORTED_OPTIMIZERS = frozenset({"adam", "adamw", "adagrad", "lion"})
CPU_OPTIMIZERS = ZERO_SUPPORTED_OPTIMIZERS


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    type: str = spec("AdamW")
    params: dict[str, Any] = spec(factory=dict)

    @property
    def name(self) -> str:
        """The optimizer as DeepSpeed resolves the type: its own (lower case) or torch.optim's."""
        lower = str(self.type).lower()
        return lower if lower in DEEPSPEED_OPTIMIZER_STATES or lower in ("musgd", "muon") else str(self.type)

    def _param(self, key: str, default):
        value = self.params.get(key, default)
        return default if value is None else value

    @property
    def state_tensors(self) -> int:
        """fp32 state tensors per parameter (see [Note: optimizer states by type])."""
        name = self.name
        if name in DEEPSPEED_OPTIMIZER_STATES:
            return DEEPSPEED_OPTIMIZER_STATES[name]
        momentum = self._param("momentum", 0)
        moving = 1 if isinstance(momentum, (int, float)) and momentum > 0 else 0
        if name in ("SGD", "musgd"):
            return moving
        if name == "RMSprop":
            return 1 + moving + (1 if self._param("centered", False) is True else 0)
        raise ValueError("type", self.type, _UNMODELLED_OPTIMIZER)

    @property
    def step_bytes_per_param(self) -> float:
        """Traffic per parameter of the optimizer's update: a fused one (FusedAdam's
        multi_tensor_apply, torch's fused=True) reads and writes the fp32 master, reads the fp32
        gradient and reads and writes each state (Adam: 28); torch's unfused Adam/AdamW ("torch_adam":
        true, see [Note: torch Adam step temporaries]) runs one pass per operation (torch/optim/adam.py
        _multi_tensor_adam, and _single_tensor_adam alike): exp_avg.lerp_(grad) 12, exp_avg_sq.mul_ 8
        and .addcmul_(grad, grad) 12, sqrt 8, the bias correction's div 8, add_(eps) 8,
        param.addcdiv_(exp_avg, denom) 16, and with a weight decay AdamW's param.mul_ 8 or Adam's L2
        grad.add(param) 12: 72-84 bytes."""
        if self.name in ("adam", "adamw") and self.params.get("torch_adam") and self.params.get("fused") is not True:
            decoupled = self.name == "adamw" or self.params.get("adam_w_mode", True) is not False
            # torch's defaults when the block gives none: AdamW 1e-2, Adam 0
            wd = self.params.get("weight_decay", 1e-2 if decoupled else 0.0)
            decay = 0.0 if not wd else 8.0 if decoupled else 12.0
            return 72.0 + decay
        return 12.0 + 8.0 * self.state_tensors

    def __post_init__(self):
        if not isinstance(self.type, str) or not self.type:
            raise ValueError("type", self.type, "give the optimizer's name, e.g. AdamW")
        lower = self.type.lower()
        if lower == "muon":
            raise ValueError("type", self.type, "Muon (MuonWithAuxAdam) is not modelled by zsim yet; "
                             + _UNMODELLED_OPTIMIZER)
        if lower in REMOVED_OPTIMIZERS:
            raise ValueError("type", self.type, f"DeepSpeed 0.19.7 removed {REMOVED_OPTIMIZERS[lower]} "
                             "(deepspeedai/DeepSpeed#8490) and 0.19.8 stops at deepspeed.initialize: "
                             f"'{self.type} is not a supported DeepSpeed Optimizer' (engine.py _do_sanity_check); "
                             f"use {'Lamb' if lower == 'onebitlamb' else 'Adam'} (the same states, gradients "
                             "all-reduced at full precision)")
        if lower in ("sgd", "rmsprop") and self.type not in ("SGD", "RMSprop"):
            # DeepSpeed looks any name outside its own list up in torch.optim, as written
            raise ValueError("type", self.type, f"DeepSpeed looks it up as torch.optim.{self.type}, which "
                             f"does not exist; write {'SGD' if lower == 'sgd' else 'RMSprop'}")
        self.state_tensors   # an optimizer zsim cannot size is refused here  # noqa: B018


_UNMODELLED_OPTIMIZER = ("zsim models Adam, AdamW, Lamb, Lion, Adagrad, MuAdam, MuAdamW, MuSGD and torch's SGD and "
                         "RMSprop; use one of those")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """The ds_config's "pipeline" block (runtime/config.py get_pipeline_config). DeepSpeed's
    PipelineEngine reads activation_checkpoint_interval from it (pipe/engine.py:217) and
    pipe/grad_partitioned (tensor-parallel only); `stages` and `partition` are parsed but the
    stages and the partition come from PipelineModule(num_stages=, partition_method=). zsim,
    which has no PipelineModule, reads them as those arguments (see zsim/config/parallel.py)."""
    stages: Optional[int] = spec(None, gt=0, doc="PipelineModule num_stages (DeepSpeed's default: auto)")
    partition: Optional[str] = spec(None, doc="PipelineModule partition_method; DeepSpeed's 'best' means unset")
    seed_layers: bool = spec(False)
    activation_checkpoint_interval: int = spec(0, ge=0)
    pipe_partitioned: bool = spec(True)
    grad_partitioned: bool = spec(True)
    use_reentrant: bool = spec(True)
    enabled: bool = spec(True, doc="not a DeepSpeed key (the seeds write it); accepted and not read")


# [Note: DeepSpeed's top-level keys] DeepSpeed 0.19.8 reads its config key by key
# (runtime/config.py DeepSpeedConfig._initialize_params and the configs it builds from the
# dict): a top-level key it does not read is ignored without a word, so zsim ignores it too and
# names it in one note (zsim/config/scenario.py); a key it removed it refuses at start-up
# (_reject_removed_config_keys), and so does zsim. Inside the blocks it builds as pydantic
# models (runtime/config_utils.py DeepSpeedConfigModel, extra="forbid": zero_optimization and
# its offload blocks, fp16, bf16, tensor_parallel, the monitors, comms_logger, hybrid_engine,
# compile) an unknown key is refused, as zsim's strict schema refuses it.
#
# Top-level keys DeepSpeed reads that do not change a step's time or memory in zsim's model
# (or whose effect NOT_MODELLED_TOP_LEVEL names): accepted.
IGNORED_TOP_LEVEL = frozenset({
    "scheduler", "steps_per_print", "wall_clock_breakdown", "dump_state", "tensorboard", "wandb",
    "csv_monitor", "comet", "flops_profiler", "comms_logger", "checkpoint", "autotuning",
    "data_efficiency", "memory_breakdown", "zero_force_ds_cpu_optimizer",
    "disable_allgather", "dataloader_drop_last", "gradient_predivide_factor", "prescale_gradients",
    # read by zsim/config/scenario.py under sequence parallelism (the engine's communication dtype then)
    "seq_parallel_communication_data_type", "timers", "hybrid_engine", "weight_quantization",
    "torch_autocast", "compile",
    "tensor_parallel",   # read by zsim/config/parallel.py into parallelism.tensor
    "use_data_before_expert_parallelism", "disable_python_gc", "managed_gradient_accumulation",
    "gradient_allreduce_op", "log_level", "vocabulary_size", "datastates_ckpt", "expert_parallel",
})

# runtime/config.py _REMOVED_TOP_LEVEL_CONFIG_KEYS and _REMOVED_ZERO_CONFIG_KEYS: DeepSpeed 0.19.8
# refuses a config holding any of these (whatever the value), naming what replaced it
REMOVED_TOP_LEVEL = {
    "nebula": "Nebula checkpointing", "compression_training": "the compression library",
    "amp": "NVIDIA Apex AMP (use fp16, bf16 or torch_autocast)", "quantize_training": "MoQ quantize_training",
    "sparse_gradients": "sparse embedding-gradient compression", "eigenvalue": "eigenvalue MoQ",
    "sparse_attention": "sparse attention", "elasticity": "elastic training (set the batch keys directly)",
    "graph_harvesting": "graph harvesting",
    "curriculum_learning": "top-level curriculum_learning (use data_efficiency.data_sampling.curriculum_learning)",
    "progressive_layer_drop": "progressive layer drop",
}
REMOVED_ZERO = {"mics_shard_size": "MiCS sharding", "mics_hierarchical_params_gather": "MiCS sharding",
                "zeropp_loco_param": "LoCo-ZeRO++"}


# The keys of the pydantic blocks DeepSpeed builds and zsim otherwise ignores (extra="forbid":
# compile/config.py CompileConfig, comm/config.py CommsLoggerConfig, monitor/config.py's four,
# runtime/config.py HybridEngineConfig): a key outside these DeepSpeed refuses, and so does zsim
STRICT_IGNORED_BLOCKS = {
    "compile": frozenset({"deepcompile", "autoep_non_moe", "free_activation", "free_activation_threshold",
                          "offload_activation", "offload_activation_pin_memory", "offload_opt_states",
                          "double_buffer", "symmetric_memory", "debug_log", "offload_parameters",
                          "sync_before_reduce", "sync_after_reduce", "sync_before_allgather", "sync_after_allgather",
                          "keep_int_input_tensors", "keep_all_input_tensors", "passes"}),
    "comms_logger": frozenset({"enabled", "prof_all", "prof_ops", "verbose", "debug"}),
    "tensorboard": frozenset({"enabled", "output_path", "job_name"}),
    "wandb": frozenset({"enabled", "group", "team", "project"}),
    "csv_monitor": frozenset({"enabled", "output_path", "job_name"}),
    "comet": frozenset({"enabled", "samples_log_interval", "project", "workspace", "api_key", "experiment_name",
                        "experiment_key", "online", "mode"}),
    "hybrid_engine": frozenset({"enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache",
                                "pin_parameters", "tp_gather_partition_size", "enable_cuda_graph"}),
}


def _enabled(block) -> bool:
    return isinstance(block, dict) and block.get("enabled") is True


def _on(block, raw) -> bool:
    """A block switched on by its `enabled: true` (the predicate of the tables below: (value, whole ds_config))."""
    return _enabled(block)


# [Note: torch_autocast over 16-bit weights] DeepSpeed 0.19.8 casts the module's parameters to
# the fp16/bf16 block's dtype whatever torch_autocast says (engine.py _configure_distributed_model:
# _mixed_precision_dtypes, _cast_module_mixed_precision); autocast then runs its matmuls in that
# same dtype. Only with neither block enabled are the weights fp32 and the step autocast's alone.
def _half_enabled(raw) -> bool:
    """The ds_config enables its fp16 or bf16 block (the older name bfloat16 included)."""
    return isinstance(raw, dict) and any(_enabled(raw.get(k)) for k in ("fp16", "bf16", "bfloat16"))


# Accepted keys that do change a real run but that zsim does not simulate: the result carries a
# warning that says what the prediction leaves out, instead of silently pretending.
NOT_MODELLED_TOP_LEVEL = {
    "hybrid_engine": (_on, "the hybrid (RLHF) engine's generation is simulated with an rlhf: block "
                           "(DeepSpeed-Chat's PPO iteration, docs/scenario.md); this prediction is the training "
                           "step alone"),
    "wall_clock_breakdown": (lambda v, raw: v is True, "its timers synchronize the device around forward, "
                                                       "backward and step; the prediction leaves those waits out"),
    "comms_logger": (_on, "the comms logger synchronizes every collective to time it; the prediction leaves "
                          "those waits out"),
    "compile": (lambda v, raw: isinstance(v, dict) and v.get("deepcompile") is True,
                "DeepCompile is not modelled; the prediction is DeepSpeed's eager ZeRO"),
    "data_efficiency": (_on, "data efficiency (curriculum, random-LTD) is not modelled; the prediction trains "
                             "every token of every sample"),
    "torch_autocast": (lambda v, raw: _enabled(v) and _half_enabled(raw),
                       "torch autocast over the bf16/fp16 block's weights: the ops autocast runs in fp32 "
                       "(softmax, norms, the loss) are priced at the weights' precision"),
}
# Keys DeepSpeed knows whose effect zsim leaves out only at the cost of the verdict itself: refused
# (torch_autocast: see [Note: torch_autocast over 16-bit weights])
NOT_MODELLED_REFUSED = {
    "torch_autocast": (lambda v, raw: _enabled(v) and not _half_enabled(raw),
                       "torch autocast (fp32 weights, lower-precision compute) is not modelled: zsim "
                       "would price the step in fp32 throughout; use the bf16 or fp16 block instead"),
    "expert_parallel": (_on, "AutoEP (expert_parallel) is not modelled; use an MoE model with "
                             "parallelism.expert (DeepSpeed-MoE ep_size) instead"),
}


# runtime/config.py get_communication_data_type accepts these (lower-cased) and raises on others
COMM_DATA_TYPES = ("fp16", "bf16", "fp32")


@dataclass(frozen=True, kw_only=True)
class DeepSpeedConfig:
    train_batch_size: Optional[int] = spec(None, gt=0)
    train_micro_batch_size_per_gpu: Optional[int] = spec(None, gt=0, le=MAX_MICRO_BATCH_SIZE)
    gradient_accumulation_steps: Optional[int] = spec(None, gt=0, le=MAX_GRADIENT_ACCUMULATION_STEPS)
    gradient_clipping: float = spec(0.0, ge=0)
    zero_optimization: ZeroConfig = spec(factory=ZeroConfig)
    fp16: Fp16Config = spec(factory=Fp16Config)
    bf16: Bf16Config = spec(factory=Bf16Config)
    activation_checkpointing: ActivationCheckpointingConfig = spec(factory=ActivationCheckpointingConfig)
    aio: AioConfig = spec(factory=AioConfig)
    optimizer: OptimizerConfig = spec(factory=OptimizerConfig)
    zero_allow_untested_optimizer: bool = spec(False, doc="run ZeRO with an optimizer DeepSpeed has not tested with it")
    data_types: DataTypesConfig = spec(factory=DataTypesConfig)
    pipeline: PipelineConfig = spec(factory=PipelineConfig)
    communication_data_type: Optional[str] = spec(
        None, doc="dtype of the gradient reductions: fp16, bf16 or fp32 (any case); DeepSpeed's default: the model's")

    def __post_init__(self):
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("bf16.enabled", True, "fp16 and bf16 cannot both be enabled; keep one")
        name, z = self.optimizer.name, self.zero_optimization
        if z.stage >= 1 and name not in ZERO_SUPPORTED_OPTIMIZERS and not self.zero_allow_untested_optimizer:
            # engine.py _do_optimizer_sanity_check asserts it
            raise ValueError("optimizer.type", self.optimizer.type, "DeepSpeed runs ZeRO with Adam, AdamW, Adagrad "
                             "or Lion only, unless the config sets zero_allow_untested_optimizer: true")
        if z.optimizer_offload_device != "none" and name not in CPU_OPTIMIZERS:
            raise ValueError("optimizer.type", self.optimizer.type, "with offload_optimizer zsim models DeepSpeed's "
                             "CPU optimizers only (Adam, AdamW, Adagrad, Lion); change the type or the offload")
        model = "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"
        accum = self.data_types.grad_accum_dtype
        if accum not in (None, model) and not self.uses_bf16_optimizer:
            raise ValueError("data_types.grad_accum_dtype", accum,
                             f"a grad_accum_dtype other than the weights' ({model}) is modelled only as "
                             "DeepSpeed's BF16_Optimizer (bf16 weights, fp32 accumulation, ZeRO stage 1 without "
                             "optimizer offload); remove it or set it to the model dtype")

    @staticmethod
    def not_modelled(raw: dict) -> tuple[str, ...]:
        """A warning per key DeepSpeed acts on and zsim does not model (see [Note: DeepSpeed's top-level keys])."""
        return tuple(f"deepspeed.{k}: {msg}" for k, (on, msg) in NOT_MODELLED_TOP_LEVEL.items()
                     if k in raw and on(raw[k], raw))

    def checkpointing_warnings(self, mode: str) -> tuple[str, ...]:
        """The activation_checkpointing block acts on the blocks deepspeed.checkpointing.checkpoint
        wraps, i.e. training.activation_checkpointing: full. partition_activations splits
        checkpoints across model-parallel ranks (checkpointing.py:354-436), a no-op in pure data
        parallelism; contiguous_memory_optimization moves them into one buffer of
        number_checkpoints slots (checkpointing.py:460-471): same bytes, less fragmentation."""
        ac = self.activation_checkpointing
        if mode != "full" and (ac.cpu_checkpointing or ac.partition_activations):
            key = "cpu_checkpointing" if ac.cpu_checkpointing else "partition_activations"
            return (f"deepspeed.activation_checkpointing.{key}: acts on checkpointed blocks only; "
                    f"ignored with training.activation_checkpointing: {mode} (set it to full)",)
        return ()

    @property
    def reduction_dtype(self) -> str:
        """The dtype gradients are reduced in: engine.communication_data_type (engine.py:1719-1730)
        is the configured one, else fp16 with fp16, bf16 with bf16, fp32 otherwise. Every stage
        reduces in it: stage 0 and BF16_Optimizer through engine.allreduce_bucket (engine.py:3800),
        ZeRO-1/2 through allreduce_bucket (stage_1_and_2.py:2376), ZeRO-3 through its IPG buffer,
        allocated in that dtype (stage3.py:780-784), and __avg_scatter_grads (stage3.py:1919)."""
        if self.communication_data_type is not None:
            return self.communication_data_type.lower()
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def uses_bf16_optimizer(self) -> bool:
        """engine._do_optimizer_sanity_check: bf16 weights + fp32 grad accumulation + ZeRO-1
        without CPU offload runs BF16_Optimizer instead of the ZeRO optimizer."""
        return (self.bf16.enabled and self.data_types.grad_accum_dtype == "fp32"
                and self.zero_optimization.stage == 1 and self.zero_optimization.optimizer_offload_device == "none")
