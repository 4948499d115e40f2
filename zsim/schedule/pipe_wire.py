"""What a tensor between pipeline stages costs on the wire under tensor parallelism, for both
pipeline schedules: DeepSpeed's PipelineEngine (pipeline.py) and Megatron-LM's interleaved
schedule (interleaved.py).

[Note: partitioned pipeline sends]
The t tensor-parallel ranks of a stage hold the same activation (and, in backward, the same
gradient) at a stage boundary. Both frameworks send each rank's 1/t of it to the same
tensor-parallel rank of the next (or previous) stage and rebuild the whole tensor at the
receiver with an all-gather over the tensor-parallel group (NVLink), instead of t identical
copies over the slower link between stages:
- Megatron-LM v2.x-v3.0 p2p_communication.py _communicate: scatter_gather_tensors_in_pipeline
  (on unless --no-scatter-gather-tensors-in-pipeline; Narayanan et al. SC'21 section 4.1),
  split_tensor_into_1d_equal_chunks / gather_split_1d_tensor;
- DeepSpeed 0.19.8 runtime/pipe/engine.py: is_pipe_partitioned / is_grad_partitioned
  (engine.py:137-138: the grid is model-parallel and the ds_config's pipeline.pipe_partitioned /
  grad_partitioned, both true by default in runtime/config.py), runtime/utils.py
  PartitionedTensor: the sender keeps its 1/t (partition_uniform of the flattened tensor),
  PartitionedTensor.full() all-gathers it over the slice (tensor) group
  (all_gather_into_tensor).
With sequence parallelism the tensor at a stage boundary is already the rank's 1/t of the
sequence and goes as it is: Megatron v3.0 skips the scatter/gather; under DeepSpeed,
PartitionedTensor would split each rank's shard again and gather the ranks' different shards
into one mixed tensor, so a sequence-parallel run keeps pipe/grad_partitioned off, which sends
the shard as it is.

DeepSpeed's own details (pipeline.py places them):
- each partitioned send is two sends: the PartitionedTensor's meta (to_meta: an int64 tensor of
  ndims, the shape, num_parts, rank and the t + 1 partition offsets), then the part; the meta
  goes with every micro-batch (_exec_send_activations sends every tensor of the outputs tuple,
  _exec_send_grads "first two sends are partitioned gradient"). The int32 tensor-meta handshake
  (_send_tensor_meta) goes only with the engine's first send (first_output_send, pipe_recv_buf
  None), not in a steady step.
- the all-gather runs in the instruction that uses the tensor, not in the receive: the
  received activation in ForwardPass (not on the first stage); in BackwardPass (not on the last
  stage) first the stage's own output, whose data the forward dropped after partitioning it
  (it keeps only its part), then the received gradient. With pipe_partitioned and not
  grad_partitioned, RecvGrad rebuilds the output before it receives the whole gradient.
"""
from __future__ import annotations

from typing import NamedTuple

from zsim.schedule.ir import Collective
from zsim.schedule.payloads import Comm
from zsim.schedule.tensor import tensor_parallel_group
from zsim.specs.scenario import Scenario

META_DIMS = 3   # the stage boundary's tensor: micro-batch x sequence x hidden


class Wire(NamedTuple):
    """One tensor between stages: the bytes a rank sends of it, the all-gather over the
    tensor-parallel group that rebuilds it at the receiver (None: sent whole), and DeepSpeed's
    PartitionedTensor meta sent before the part (0: none)."""
    size_bytes: float
    gather: Comm | None
    meta_bytes: int = 0


def wire(sc: Scenario, act_bytes: float, act_dtype_bytes: int, partitioned: bool = True) -> Wire:
    """The rule both frameworks share (see [Note: partitioned pipeline sends]); `partitioned`
    False sends the whole tensor from every rank."""
    t = sc.parallelism.tensor
    if t == 1 or sc.parallelism.sequence_parallel or not partitioned:
        return Wire(act_bytes, None)
    numel = round(act_bytes / act_dtype_bytes)
    return Wire(act_bytes / t, Comm(Collective.ALL_GATHER, numel, act_bytes, group=tensor_parallel_group(t)))


def deepspeed_wires(sc: Scenario, act_bytes: float, act_dtype_bytes: int) -> tuple[Wire, Wire]:
    """(activation, gradient) of DeepSpeed's PipelineEngine under the ds_config's
    pipeline.pipe_partitioned / grad_partitioned, each partitioned send with its meta."""
    keys = sc.deepspeed.pipeline
    out = []
    for partitioned in (keys.pipe_partitioned, keys.grad_partitioned):
        w = wire(sc, act_bytes, act_dtype_bytes, partitioned)
        # PartitionedTensor.to_meta: [ndims, *shape, num_parts, rank, *partition (t + 1)], int64
        out.append(w if w.gather is None else w._replace(meta_bytes=8 * (META_DIMS + 4 + sc.parallelism.tensor)))
    return out[0], out[1]
