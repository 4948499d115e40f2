"""DeepSpeed's model-state memory estimators, reproduced bit for bit, and the inputs they take.

DeepSpeed 0.19.8 ships two closed forms (pure functions of the parameter count):
- estimate_zero2_model_states_mem_needs (runtime/zero/stage_1_and_2.py:4017-4034)
- estimate_zero3_model_states_mem_needs (runtime/zero/stage3.py:4016-4052)
and `*_all_live` / `*_all_cold` wrappers that print one row per offload option
(stage_1_and_2.py:4043-4107, stage3.py:4068-4150). The "live" wrappers count a real model with
model_to_params: shared tensors once, and the largest layer as the most direct parameters any
one module holds (stage_1_and_2.py:4037, stage3.py:4055).

The expressions below keep DeepSpeed's operation order so the float rounding, and hence the
int() result, is identical (tests/fixtures/ds_estimator_grid.json, recorded from the real
functions). They cover model states only; zsim's ledger adds what they leave out (see
`explain_differences`).
"""
from __future__ import annotations

from zsim.workload.module import Workload
from zsim.workload.preference import reference_params


def ds_zero2_estimate(total_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1, cpu_offload: bool = True,
                      additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """(cpu_bytes, gpu_bytes): stage_1_and_2.py:4017-4034."""
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # 2 = 16-bit params; 18 = 16-bit grads + fp32 grads + fp32 params + Adam moments
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def ds_zero3_estimate(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1, num_nodes: int = 1,
                      cpu_offload: bool = True, cpu_offload_params: bool = True, zero_init: bool = True,
                      additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(cpu_bytes, gpu_bytes, largest_layer_bytes): stage3.py:4016-4052."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = (4 * largest_layer_params)
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def params_like_deepspeed(wl: Workload) -> tuple[int, int]:
    """(total_params, largest_layer_params) as DeepSpeed's model_to_params counts the same
    module tree: tied weights once; per module only its direct parameters (containers hold none)."""
    # the trained model's: a preference run's reference copy is another engine (see [Note:
    # preference training]); Workload.params already lists a tied tensor once
    total = wl.n_params - reference_params(wl)
    largest = 0
    for m in wl.modules:
        if not m.no_grad:
            largest = max(largest, sum(wl.params[p].numel for p in dict.fromkeys(m.params)))
    return total, largest


def deepspeed_rows(stage: int, total_params: int, largest_layer_params: int, num_gpus_per_node: int,
                   num_nodes: int, additional_buffer_factor: float = 1.5) -> list[dict]:
    """The rows `estimate_zero{2,3}_model_states_mem_needs_all_cold` prints, in its order.
    Stages 0-2 use the ZeRO-2 estimator (DeepSpeed ships none for stages 0/1)."""
    rows = []
    if stage <= 2:
        for cpu_offload in (True, False):
            cpu, gpu = ds_zero2_estimate(total_params, num_gpus_per_node, num_nodes, cpu_offload,
                                         additional_buffer_factor)
            rows.append({"offload_optimizer": "cpu" if cpu_offload else "none", "cpu_bytes": cpu, "gpu_bytes": gpu})
        return rows
    for cpu_offload in (True, False):
        for cpu_offload_params in (True, False):
            if not cpu_offload and cpu_offload_params:
                continue
            for zero_init in (True, False):
                cpu, gpu, _ = ds_zero3_estimate(total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                                                cpu_offload, cpu_offload_params, zero_init, additional_buffer_factor)
                rows.append({"offload_param": "cpu" if cpu_offload_params else "none",
                             "offload_optimizer": "cpu" if cpu_offload else "none",
                             "zero_init": zero_init, "cpu_bytes": cpu, "gpu_bytes": gpu})
    return rows


def matching_row(rows: list[dict], optimizer_device: str, param_device: str, zero_init: bool = True) -> dict:
    """The estimator row for a scenario's offload settings (nvme counts as offloaded)."""
    opt = "none" if optimizer_device == "none" else "cpu"
    par = "none" if param_device == "none" else "cpu"
    for r in rows:
        if r["offload_optimizer"] == opt and r.get("offload_param", "none") == par and r.get("zero_init", True) == zero_init:
            return r
    return rows[-1]


# Why zsim's figure for the same config differs from DeepSpeed's estimator (GPU side).
DIFFERENCES = {
    "activations": "not in DeepSpeed's estimator (model states only); zsim's ledger holds them at the peak",
    "activation checkpoints": "not in DeepSpeed's estimator",
    "activation gradients": "not in DeepSpeed's estimator",
    "logits/loss buffers": "not in DeepSpeed's estimator",
    "gradient buckets": "IPG/reduce buckets (reduce_bucket_size); not in DeepSpeed's estimator",
    "gathered params": "stage 3 gathered + prefetched params; the estimator counts the largest layer (4 B/param)",
    "persistent params": "stage 3 params under the persistence threshold stay gathered; not in the estimator",
    "optimizer temporaries": "fp32 gradient copy during the step; the estimator folds 4 B/param of fp32 grads "
                             "into its 18 B/param instead",
    "CUDA context + allocator reserve": "CUDA context and caching-allocator fragmentation from the profile; "
                                        "not in the estimator",
}

