"""ZeRO++ (DeepSpeed 0.19.8; docs/zeropp.md): the pure rules of hpZ's secondary partitions, qwZ's and
the frozen weights' int8 gathers, and qgZ's quantized gradient reduction, which param_fetch.py
(the fetches) and grad_buckets.py (the reductions) apply."""
from __future__ import annotations

from zsim.errors import ZsimInputError
from zsim.schedule.context import StepContext
from zsim.schedule.partition import padded
from zsim.workload.module import DTYPE_BYTES

# [Note: hpZ secondary partitions]
# ZeRO++'s hierarchical partitioning (zero_hpz_partition_size = h > 1, ZeRO-3 only; docs/zeropp.md,
# DeepSpeed 0.19.8). groups._create_zero_param_parallel_group splits the global world into blocks
# of min(h, world) consecutive ranks (one node when h = GPUs per node). Whenever a gathered
# param is released (partition_parameters.py _partition -> _partition_param_sec, the post-module
# release and release_and_reset_all at the end of backward), it keeps a secondary partition:
# its padded numel / h elements in the param dtype, allocated once and held until the optimizer
# step's _post_step drops every one (invalidate_secondary_tensor, stage3.py:755-759, 2846); the
# persistent params are never released and get none. A later fetch of a param with a secondary
# partition gathers over the hpZ group from it (all_gather_coalesced, partition_parameters.py:
# 1571-1575): the same padded output, but each rank receives (h - 1) / h of it from inside its
# block instead of (W - 1) / W across the data-parallel group. The coordinator splits each fetch
# into the params with a secondary partition and those without, one coalesced gather each, in
# that order (partitioned_param_coordinator.py:594-611). So a step's first forward gathers over
# the data-parallel group, and the backward's gathers of params released after their forward,
# and the later micro-steps' forwards, over the hpZ group; the gradients' reduce-scatter is
# untouched. Recorded on CPU/gloo (tests/fixtures/deepspeed_zeropp/stage3_hpz2_*): the calls,
# their sizes and their groups, held call for call by tests/calibration/test_zeropp.py. The hpZ
# gathers run on the hpZ communicator's NCCL stream (Stream.HPZ), launched from the allgather
# stream, so they are ordered with its data-parallel gathers but not queued behind the
# reduce-scatters of the data-parallel communicator. A reference engine never steps: its
# params keep their secondary partitions from the first step on (`secondary_kept`).
# [Note: qwZ quantized gathers]
# ZeRO++'s quantized weights (zero_quantized_weights, ZeRO-3; docs/zeropp.md, DeepSpeed 0.19.8,
# modelled from the source: the quantizer is a CUDA op, so DeepSpeed cannot run it on a CPU and
# nothing here is checked against a recording). The coordinator passes quantize=True to every
# fetch, forward and backward, primary and hpZ (partitioned_param_coordinator.py:569-580), not to
# the post-step gathers of the persistent params. A fetch of the rank's partitions (S elements
# a rank, N = S x the group's ranks gathered) is cast to fp16 and quantized to int8 with one fp32
# scale per group of up to 8,000 elements (CUDAQuantizer.quantize, partition_parameters.py:
# 867-894: `quant_groups`; it asserts S a multiple of 8), then gathered as two all-gathers in the
# same group: the int8 data (N bytes) and the scales (4 x groups x ranks bytes), instead of one
# gather of 2N bytes (_all_gather_coalesced 1479-1538; a one-param fetch goes through
# _all_gather_sequential, 1373-1444, the same two calls). Its wait (AllGatherCoalescedHandle.wait,
# 761-797), on the compute stream at the hook of the module that uses it, dequantizes the int8
# flat into an fp16 flat (read N + scales, write 2N) and each param's copy is cast to its dtype
# (bf16: read 2, write 2 a element; fp16: none). zsim charges the quantize pass (read 2S, write
# 2S; read 2S, write S and the scales) to the int8 call's own buffer passes, the dequantize and
# cast to a DEQUANTIZE op on the compute stream at the first wait on the fetch, holding the fp16
# flat while it runs; the int8 flat and the scales replace the 16-bit flat buffer until the wait.
QUANT_TARGET_GROUP = 8000     # CUDAQuantizer.target_group_size
FP16_BYTES, FP32_BYTES = DTYPE_BYTES["fp16"], DTYPE_BYTES["fp32"]
QUANT_MAX_GROUP = 16000


def quant_groups(n: int) -> int | None:
    """CUDAQuantizer.quantize's group count for `n` elements; None where its asserts fail (n not a
    multiple of 8 groups of fewer than 16,000 elements)."""
    g = -(-n // QUANT_TARGET_GROUP)
    while g < n:
        if n % (8 * g) == 0:
            break
        g += 1
    while n % (16 * g) == 0 and n / g > QUANT_TARGET_GROUP:
        g *= 2
    if n % (8 * g) or n / g >= QUANT_MAX_GROUP or n <= g:
        return None
    return g


def hpz_size(ctx: StepContext) -> int:
    """The hpZ group's ranks (0: hpZ off, or one rank, which gathers nothing)."""
    h = ctx.sc.zero.zero_hpz_partition_size
    if h <= 1 or ctx.dp_size == 1 or ctx.sc.zero.stage != 3:
        return 0
    return min(h, ctx.sc.cluster.world_size)


def secondary_bytes(numel: int, ctx: StepContext, int8: bool = False) -> float:
    """One param's secondary partition: its numel padded to the data-parallel size, over h (a
    frozen shard stored int8: a byte an element and its scales, see [Note: quantized frozen weights])."""
    h = hpz_size(ctx)
    if int8:
        return padded(numel, ctx.dp_size) / h + FP32_BYTES * stored_groups(numel, h, True, ctx)
    return padded(numel, ctx.dp_size) / h * ctx.param_bytes


# [Note: quantized frozen weights]
# zero_quantized_nontrainable_weights (ZeRO-3; docs/zeropp.md, DeepSpeed 0.19.8, from the source:
# CUDA-only): every param frozen when deepspeed.initialize partitions it has its shard stored int8
# with fp32 scales (ds_quant_scale: the shard quantized alone by CUDAQuantizer, partition_parameters.py
# 1836-1841; its hpZ secondary likewise, 1921-1924), a byte an element instead of the model
# dtype's. Every fetch of such params goes quantized, whatever zero_quantized_weights says
# (partitioned_param_coordinator.py:569-578): the coordinator gathers them apart and first, the
# int8 data and the stored scales (`stored_groups` a param) as qwZ's two calls, dequantized at the
# wait (see [Note: qwZ quantized gathers]). zsim: the frozen params of LoRA, training.frozen and a
# preference run's reference copy; bitsandbytes-packed weights are stored as bitsandbytes packs
# them (DeepSpeed's quantize_nontrainable_params asserts fp16 shards) and keep their own path.
def stored_int8(ctx: StepContext) -> frozenset[int]:
    """The params whose ZeRO-3 shards are stored int8 (see [Note: quantized frozen weights])."""
    z = ctx.sc.zero
    if z.stage != 3 or not z.zero_quantized_nontrainable_weights:
        return frozenset()
    return frozenset(i for i, p in enumerate(ctx.wl.params) if not p.trainable and p.packed_bytes is None)


def stored_groups(numel: int, ranks: int, secondary: bool, ctx: StepContext) -> int:
    """The scales a frozen param's stored int8 shard carries: its shard (ceil(numel / world), or
    the hpZ secondary's padded numel / h) quantized alone."""
    shard = padded(numel, ctx.dp_size) // ranks if secondary else -(-numel // ctx.dp_size)
    return checked_quant_groups(shard, "zero_quantized_nontrainable_weights", "a frozen shard")


def checked_quant_groups(n: int, key: str, what: str) -> int:
    """quant_groups(n), refused in one line where DeepSpeed's quantizer asserts."""
    groups = quant_groups(n)
    if groups is None:
        raise ZsimInputError(f"deepspeed.zero_optimization.{key}", True,
                             f"DeepSpeed's quantizer asserts on {what} of {n:,} elements (a multiple of 8 groups of "
                             "under 16,000 elements: partition_parameters.py CUDAQuantizer); drop it")
    return groups


# [Note: qgZ quantized gradient reduction]
# ZeRO++'s quantized gradients (zero_quantized_gradients, ZeRO-3; docs/zeropp.md, DeepSpeed
# 0.19.8, modelled from the source: its quantizer kernels are CUDA-only, and across nodes it
# fails on a CPU, so only the one-node case is recorded). stage3.py __avg_scatter_grads hands a
# reduced bucket to coalesced_collectives.py all_to_all_quant_reduce when the world spans more
# than one node (world // device_count() > 1; on one node it is the plain reduce-scatter,
# recorded: tests/fixtures/deepspeed_zeropp/stage3_qgz_w4_1node). It reduces the bucket one
# gradient at a time: a 1-D tensor, or one whose numel does not divide by 2 x world, goes alone
# through reduce_scatter_coalesced over the whole world; any other is quantized to int4 with
# q = max(shape[0], shape[1], world) fp32 scales (swizzle_quant), exchanged by an all-to-all of
# the data (numel / 2 bytes a rank) and one of the scales inside the node (local_i), reduced and
# requantized (quantized_reduction: numel / (2 L) bytes, q / L scales), exchanged by two
# all-to-alls across the nodes (global_j, one rank a node), dequantized to fp16 and averaged
# over its node chunks into the rank's numel / world slice. zsim: the four calls on the reduce
# stream, the kernels' passes as their buffer passes (`qgz_work_bytes`), the int4 buffers held
# from the first call to the last.
def qgz_nodes(ctx) -> int:
    """The nodes qgZ reduces across (0: off; 1: one node, where it is the plain reduce-scatter)."""
    z = ctx.sc.zero
    if z.stage != 3 or not z.zero_quantized_gradients or ctx.dp_size == 1:
        return 0
    return ctx.dp_size // ctx.sc.cluster.gpus_per_node


def qgz_work_bytes(n: int, q: int, gpn: int, world: int) -> tuple[float, float, float]:
    """The memory passes of one tensor's quantized reduction, before each hop: swizzle_quant (read
    16-bit n, write int4 n / 2 and q scales), quantized_reduction (read the int4 pieces and scales,
    write n / (2 L) and q / L), dequantize and the mean over the node chunks (read n / (2 L), write
    fp16 n / L; read it, write the n / world slice)."""
    quant = 2.0 * n + n / 2 + FP32_BYTES * q
    reduce = n / 2 + FP32_BYTES * q + n / (2 * gpn) + FP32_BYTES * q / gpn
    dequant = n / (2 * gpn) + 2.0 * n / gpn + 2.0 * n / gpn + 2.0 * n / world
    return quant, reduce, dequant
