"""The `parallelism:` block and the ds_config's "pipeline" block, resolved into one
ParallelismSpec, with DeepSpeed's own refusals (runtime/pipe/engine.py, module.py).

DeepSpeed takes the stage count and the partition from PipelineModule(num_stages=,
partition_method=), Python-side; a scenario gives them as `parallelism.pipeline` and
`parallelism.partition_method`, or as the ds_config's pipeline.stages / pipeline.partition
(the keys the seeds write). When both are given they must agree. The tensor-parallel size is
`parallelism.tensor` or the ds_config's tensor_parallel.autotp_size (DeepSpeed's AutoTP training
key, runtime/tensor_parallel/config.py TPTrainingConfig) or tensor_parallel.size (the seeds'),
agreeing likewise.
"""
from __future__ import annotations

from dataclasses import replace

from zsim.errors import ZsimInputError, unknown_key
from zsim.schema import _number, build
from zsim.specs.deepspeed import DeepSpeedConfig
from zsim.specs.parallelism import ParallelismSpec
from zsim.specs.model import ModelSpec
from zsim.specs.scenario import TrainingSpec


def resolve_parallelism(raw, ds_pipeline, world_size: int, layers: int, ds_tensor,
                        gpus_per_node: int, ds_sequence=None) -> ParallelismSpec:
    """`raw`: the scenario's parallelism mapping (or None); `ds_pipeline`, `ds_tensor`,
    `ds_sequence`: the ds_config's pipeline and tensor_parallel mappings and its
    sequence_parallel_size (or None). Checks what can be checked before the workload exists."""
    if raw is not None and not isinstance(raw, dict):
        raise ZsimInputError("parallelism", raw, "expected a mapping, e.g. {pipeline: 4}")
    raw = dict(raw or {})
    ds_pipeline = ds_pipeline if isinstance(ds_pipeline, dict) else {}
    for ds_key, key in (("stages", "pipeline"), ("partition", "partition_method")):
        value = ds_pipeline.get(ds_key)
        if value in (None, "auto") or (ds_key == "partition" and value == "best"):
            continue   # DeepSpeed's defaults: the PipelineModule's arguments decide
        if ds_key == "stages":
            value = _number(value, "deepspeed.pipeline.stages", want_int=True)
        elif not isinstance(value, str):
            raise ZsimInputError("deepspeed.pipeline.partition", value, "expected a string such as uniform or parameters")
        if key in raw and raw[key] != value:
            raise ZsimInputError(f"deepspeed.pipeline.{ds_key}", value,
                                 f"disagrees with parallelism.{key}={raw[key]!r}; make them equal or drop one")
        raw[key] = value
    _tensor_from_ds(raw, ds_tensor)
    if ds_sequence is not None:
        value = _number(ds_sequence, "deepspeed.sequence_parallel_size", want_int=True)
        if value < 1:
            raise ZsimInputError("deepspeed.sequence_parallel_size", ds_sequence, "must be at least 1 (1: no sequence "
                                 "parallelism)")
        if "sequence" in raw and raw["sequence"] != value:
            raise ZsimInputError("deepspeed.sequence_parallel_size", value, f"disagrees with parallelism.sequence="
                                 f"{raw['sequence']!r}; make them equal or drop one")
        raw["sequence"] = value
    par = build(ParallelismSpec, raw, "parallelism")
    pp, tp = par.pipeline, par.tensor
    if gpus_per_node % tp:
        # Megatron's rank order puts a tensor-parallel group on consecutive ranks: inside one node
        raise ZsimInputError("parallelism.tensor", tp, f"must divide the GPUs per node ({gpus_per_node}): a "
                             "tensor-parallel group sits inside one node (NVLink); use a divisor of it")
    if world_size % pp:
        raise ZsimInputError("parallelism.pipeline", pp, f"must divide the world size ({world_size} GPUs): "
                             "PipeDataParallelTopology splits it into pipeline x data-parallel ranks")
    if world_size % (tp * pp):
        raise ZsimInputError("parallelism.tensor", tp, f"tensor x pipeline ({tp} x {pp}) must divide the world size "
                             f"({world_size} GPUs): the world splits into tensor x data x pipeline ranks")
    if pp > layers:
        raise ZsimInputError("parallelism.pipeline", pp, f"exceeds the model's {layers} transformer layers; "
                             f"use at most {layers} stages")
    if world_size % par.sequence:
        # parallel_state_sp.initialize_sequence_parallel raises the same
        raise ZsimInputError("parallelism.sequence", par.sequence, f"must divide the world size ({world_size} GPUs), "
                             "as DeepSpeed's parallel_state_sp requires; use a divisor")
    return _resolve_interleaving(par, layers)


def _resolve_interleaving(par: ParallelismSpec, layers: int) -> ParallelismSpec:
    """Megatron-LM's rules for its interleaved schedule (megatron/training/arguments.py
    validate_args; megatron/core/transformer/transformer_block.py get_num_layers_to_build)."""
    pp, v = par.pipeline, par.virtual_stages
    if par.pipeline_schedule == "1f1b":
        if v > 1:
            raise ZsimInputError("parallelism.virtual_stages", v, "needs pipeline_schedule: interleaved (Megatron's "
                                 "interleaved 1F1B; DeepSpeed's TrainSchedule runs one model chunk per stage); set it "
                                 "or use virtual_stages 1")
        return par
    if v == 1:
        # arguments.py: a virtual pipeline size of 1 becomes None, i.e. the plain 1F1B schedule,
        # still over Megatron's placement (get_num_layers_to_build: equal blocks of transformer
        # layers, the embedding on the first stage, the head on the last), which is DeepSpeed's
        # partition_method type:transformer; so V = 1 is the baseline a V sweep compares with
        return replace(par, pipeline_schedule="1f1b", partition_method="type:transformer")
    if pp <= 2:
        # arguments.py: "When interleaved schedule is used and p2p communication overlap is
        # disabled, pipeline-model-parallel size should be greater than 2" (zsim's sends block)
        raise ZsimInputError("parallelism.pipeline", pp, "Megatron's interleaved schedule with blocking sends needs "
                             "more than 2 pipeline stages; use pipeline >= 3 or pipeline_schedule 1f1b")
    if layers % (pp * v):
        raise ZsimInputError("parallelism.virtual_stages", v, f"interleaving without enough layers: pipeline x "
                             f"virtual_stages ({pp} x {v}) must divide the model's {layers} layers "
                             "(transformer_block.py get_num_layers_to_build); choose values that divide it")
    return par


# runtime/tensor_parallel/config.py TPTrainingConfig's fields and aliases: the model forbids any
# other key (DeepSpeedConfigModel extra="forbid"); `size` and `enabled` are the seeds' own
TP_BLOCK_KEYS = frozenset({"dtype", "autotp_size", "tp_overlap_comm", "vocab_parallel_lm_head",
                           "vocab_parallel_ce_backend", "tensor_parallel", "tp", "injection_policy_tuple",
                           "partition_config", "preset_model", "keep_module_on_host", "replace_with_kernel_inject",
                           "kernel_inject", "size", "enabled"})


def _tensor_from_ds(raw: dict, ds_tensor) -> None:
    """The ds_config's tensor_parallel block onto raw['tensor']: autotp_size (DeepSpeed's key;
    0 disables AutoTP) or size (the seeds'); `enabled: false` turns the block off."""
    if isinstance(ds_tensor, dict):
        for key in ds_tensor:
            if key == "tp_size":
                # inference's key (init_inference's tensor_parallel: {tp_size}); the training
                # config refuses it, so a block meant to split the model would not
                raise ZsimInputError("deepspeed.tensor_parallel.tp_size", ds_tensor[key],
                                     "DeepSpeed's training config refuses tp_size here (it is init_inference's key); "
                                     "give autotp_size (AutoTP) or parallelism.tensor (Megatron's "
                                     "--tensor-model-parallel-size)")
            if key not in TP_BLOCK_KEYS:
                raise unknown_key("deepspeed.tensor_parallel", str(key), TP_BLOCK_KEYS)
    if not isinstance(ds_tensor, dict) or ds_tensor.get("enabled", True) is False:
        return
    for ds_key in ("autotp_size", "size"):
        value = ds_tensor.get(ds_key)
        if value is None or (ds_key == "autotp_size" and value == 0):
            continue
        value = _number(value, f"deepspeed.tensor_parallel.{ds_key}", want_int=True)
        if "tensor" in raw and raw["tensor"] != value:
            raise ZsimInputError(f"deepspeed.tensor_parallel.{ds_key}", value,
                                 f"disagrees with parallelism.tensor={raw['tensor']!r}; make them equal or drop one")
        raw["tensor"] = value


def check_parallelism(par: ParallelismSpec, ds: DeepSpeedConfig, training: TrainingSpec, model: ModelSpec,
                      world_size: int) -> TrainingSpec:
    """DeepSpeed's PipelineEngine and DeepSpeed-MoE rules on the resolved config; returns the
    training spec with the pipeline's activation checkpointing applied."""
    _check_tensor(par, model, training)
    _check_sequence(par, model, training)
    _check_expert(par, ds, model, world_size // (par.pipeline * par.tensor))
    hpz = ds.zero_optimization.zero_hpz_partition_size
    if ds.zero_optimization.stage == 3 and ds.zero_optimization.zero_quantized_gradients and par.tensor > 1:
        raise ZsimInputError("deepspeed.zero_optimization.zero_quantized_gradients", True,
                             "qgZ with tensor parallelism is not modelled (its all-to-all groups are global ranks); "
                             "use tensor: 1 or drop qgZ")
    if ds.zero_optimization.stage == 3 and hpz > 1 and par.tensor > 1:
        # groups.py _create_zero_param_parallel_group blocks consecutive global ranks, which under
        # tensor parallelism hold different shards of each weight
        raise ZsimInputError("deepspeed.zero_optimization.zero_hpz_partition_size", hpz,
                             "hpZ with tensor parallelism is not modelled (its groups of consecutive ranks mix "
                             "the tensor-parallel shards); use tensor: 1 or drop hpZ")
    if ds.zero_optimization.stage == 3 and hpz > 1 and world_size % min(hpz, world_size):
        # utils/groups.py _create_zero_param_parallel_group: _ensure_divisibility(world_size, group size)
        raise ZsimInputError("deepspeed.zero_optimization.zero_hpz_partition_size", hpz,
                             f"must divide the world size ({world_size}) as DeepSpeed asserts (groups.py:71); "
                             "use the GPUs per node or another divisor")
    gas = ds.gradient_accumulation_steps
    assert gas is not None    # resolved (zsim.config.scenario._resolve_batch) before these checks
    if par.pipeline_schedule == "interleaved" and gas % par.pipeline:
        # schedules.py forward_backward_pipelining_with_interleaving: micro-batch groups of
        # microbatch_group_size_per_vp_stage (default: the pipeline size) micro-batches, the
        # last one full or at least pipeline-size long; with the default, M divisible by P
        raise ZsimInputError("training.gradient_accumulation_steps", gas, f"Megatron's interleaved schedule needs "
                             f"micro-batches (GAS) divisible by the pipeline size {par.pipeline}; use a multiple of it")
    if par.pipeline > 1 and ds.zero_optimization.stage >= 2:
        # pipe/engine.py:76: assert zero_optimization_stage() < ZeroStageEnum.gradients
        raise ZsimInputError("deepspeed.zero_optimization.stage", ds.zero_optimization.stage,
                             "DeepSpeed's PipelineEngine refuses it (ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                             "parallelism, runtime/pipe/engine.py:76); use ZeRO-1 or drop pipeline")
    if par.pipeline > 1 and par.tensor > 1 and par.pipeline_schedule == "1f1b" and ds.pipeline.grad_partitioned \
            and not ds.pipeline.pipe_partitioned and not par.sequence_parallel:
        # pipe/engine.py: the sender then splits the gradient into meta and part
        # (_exec_send_grads) while the receiver, whose output went whole, posts one recv of the
        # whole gradient (_exec_recv_grads): the pair does not match
        raise ZsimInputError("deepspeed.pipeline.grad_partitioned", True,
                             "DeepSpeed's PipelineEngine cannot receive a partitioned gradient when "
                             "pipe_partitioned is false; set grad_partitioned false too, or pipe_partitioned true")
    interval = ds.pipeline.activation_checkpoint_interval
    if par.pipeline == 1 or interval == 0:
        return training
    if interval > 1:
        raise ZsimInputError("deepspeed.pipeline.activation_checkpoint_interval", interval,
                             "zsim checkpoints one transformer layer at a time; use 0 or 1")
    # pipe/engine.py:217 sets PipelineModule.activation_checkpoint_interval: every layer's
    # forward runs under checkpoint (module.py forward), i.e. full checkpointing per block
    if training.activation_checkpointing == "selective":
        raise ZsimInputError("training.activation_checkpointing", "selective",
                             "deepspeed.pipeline.activation_checkpoint_interval 1 checkpoints every layer (full); "
                             "set one of them to agree")
    return replace(training, activation_checkpointing="full")


def _check_tensor(par: ParallelismSpec, model: ModelSpec, training: TrainingSpec) -> None:
    """Megatron-LM's divisibility rules for tensor_model_parallel_size (megatron/training/
    arguments.py, core/transformer/attention.py divide(): heads and query groups per partition;
    core/tensor_parallel/layers.py: the column-parallel fc1 splits ffn_hidden_size), and what
    zsim's tensor-parallel workload (zsim/workload/tensor.py) covers."""
    tp = par.tensor
    if tp == 1:
        return
    key = "parallelism.tensor"
    if model.mla is not None:
        raise ZsimInputError(key, tp, "tensor parallelism of Multi-head Latent Attention is not modelled; use tensor: 1")
    if model.mamba is not None:
        raise ZsimInputError(key, tp, "tensor parallelism of Mamba mixers is not modelled; use tensor: 1")
    if model.moe is not None:
        raise ZsimInputError(key, tp, "tensor parallelism of an MoE model is not modelled; use tensor: 1 "
                             "(expert parallelism: parallelism.expert)")
    if training.lora is not None:
        raise ZsimInputError(key, tp, "LoRA under tensor parallelism is not modelled; use tensor: 1")
    if training.fused_linear_cross_entropy:
        raise ZsimInputError("training.fused_linear_cross_entropy", True, "Liger's fused linear cross-entropy over "
                             "vocab-parallel logits is not modelled; use tensor: 1 or drop it")
    if model.heads % tp:
        raise ZsimInputError(key, tp, f"must divide the attention heads (model.heads={model.heads}): "
                             "each rank computes heads / tensor of them; use a divisor")
    if model.n_kv_heads % tp:
        raise ZsimInputError(key, tp, f"must divide the key-value heads (model.kv_heads={model.n_kv_heads}): "
                             "Megatron splits the query groups over the tensor-parallel ranks; use a divisor")
    if model.ffn % tp:
        raise ZsimInputError(key, tp, f"must divide the MLP width (model.ffn_hidden={model.ffn}): fc1 is "
                             "column-parallel; use a divisor")
    if par.sequence_parallel and (training.seq_len or model.seq_len) % tp:
        raise ZsimInputError("parallelism.sequence_parallel", True, f"the sequence length must divide by "
                             f"tensor={tp} to shard it; set sequence_parallel: false or change training.seq_len")


def _check_sequence(par: ParallelismSpec, model: ModelSpec, training: TrainingSpec) -> None:
    refusal = ulysses_refusal(par.sequence, model, training)
    if refusal is not None:
        raise refusal


def ulysses_refusal(sp: int, model: ModelSpec, training: TrainingSpec) -> ZsimInputError | None:
    """Why DeepSpeed-Ulysses of size `sp` does not run (or is not modelled) for this model and
    training, None when it does: DeepSpeed's refusals (runtime/sequence_parallel/ulysses_sp.py:
    UlyssesSPAttentionHF.__init__, register_with_transformers, UlyssesSPDataLoaderAdapter) and
    accelerate's (_refuse_recurrent_layers_under_sequence_parallelism)."""
    if sp == 1:
        return None
    key = "parallelism.sequence"
    if model.heads % sp:
        return ZsimInputError(key, sp, f"must divide the attention heads (model.heads={model.heads}): Ulysses gives "
                              "each rank heads / sp of them (\"Attention head count ... is not divisible by SP size\"); "
                              "use a divisor")
    kv = model.n_kv_heads if model.mla is None else model.heads
    if kv % sp and sp % kv:
        return ZsimInputError(key, sp, f"the key-value heads (model.kv_heads={kv}) must divide by it or divide it "
                              "(ulysses_sp.py: \"KV attention head count ... is not divisible by SP size or vice "
                              "versa\"); use another size")
    seq = training.seq_len or model.seq_len
    if seq % sp:
        return ZsimInputError("training.seq_len", seq, f"must divide by parallelism.sequence={sp}: "
                              "UlyssesSPDataLoaderAdapter refuses \"batch's seqlen ... isn't divisible by sp-size\"; "
                              "pad it to a multiple")
    if training.attn_implementation_used == "eager":
        return ZsimInputError("training.attn_implementation", "eager", "Ulysses refuses eager attention "
                              "(register_with_transformers: it needs a 4D mask, O(n^2) memory); use sdpa, "
                              "flash_attention_2 or flash_attention_3")
    if model.mamba is not None:
        return ZsimInputError(key, sp, "a model with recurrent (Mamba) layers under sequence parallelism is refused "
                              "by accelerate (sp_allow_recurrent_layers) and not modelled; use sequence: 1")
    if training.preference is not None:
        return ZsimInputError(key, sp, "preference training under Ulysses is not modelled; use sequence: 1")
    return None


def _check_expert(par: ParallelismSpec, ds: DeepSpeedConfig, model: ModelSpec, data_parallel: int) -> None:
    """DeepSpeed-MoE's rules for ep_size: expert groups are formed within the data-parallel
    group, so ep_size divides the data-parallel size, world / pipeline (groups.py
    _create_expert_and_data_parallel, _ensure_divisibility), and the experts (moe/layer.py
    MoE.__init__); native DeepSpeed-MoE does not run under ZeRO-3 (engine.py
    _validate_zero3_moe_compatibility)."""
    ep, moe = par.expert, model.moe
    if moe is not None and par.pipeline > 1:
        # zsim's pipeline schedule (zsim/schedule/pipeline.py) has no token exchange or expert groups
        raise ZsimInputError("parallelism.pipeline", par.pipeline, "an MoE model under pipeline parallelism is not "
                             "simulated by zsim; use pipeline: 1 for an MoE model")
    if moe is not None and moe.dispatch == "capacity" and ds.zero_optimization.stage == 3:
        raise ZsimInputError("model.moe.dispatch", "capacity", "DeepSpeed-MoE's layer is not supported with ZeRO "
                             "stage 3 (engine.py _validate_zero3_moe_compatibility); use stage 0-2, or dispatch: "
                             "dropless for a Hugging Face MoE")
    if ep == 1:
        return
    if moe is None:
        raise ZsimInputError("parallelism.expert", ep, "expert parallelism needs an MoE model (model.moe); set it to 1")
    if moe.dispatch != "capacity":
        raise ZsimInputError("parallelism.expert", ep, "expert parallelism is DeepSpeed-MoE's (model.moe.dispatch: "
                             "capacity); Hugging Face's dropless MoE runs every expert on every rank: set it to 1")
    if data_parallel % ep:
        raise ZsimInputError("parallelism.expert", ep, f"must divide the data-parallel size ({data_parallel} = "
                             "world / pipeline): DeepSpeed-MoE forms expert groups within the data-parallel group")
    if moe.experts % ep:
        raise ZsimInputError("parallelism.expert", ep, f"must divide the experts per layer (model.moe.experts={moe.experts})")
