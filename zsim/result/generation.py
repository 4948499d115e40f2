"""The typed result of one simulated generate() call (zsim/specs/generation.py), and its summary
from the trace: the prefill, the decode steps (those not simulated interpolated: see [Note:
generation]), throughput, memory, and what bounds a decode step."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from zsim.engine.sim import Trace
from zsim.hardware.cost_model import CostModel
from zsim.result import Memory, fits
from zsim.result.summarize import memory_at_peak
from zsim.schedule.ir import Category, Stream
from zsim.specs.generation import generation_kernels
from zsim.specs.scenario import Scenario

# what can bound a decode step, by the resource busy the longest in it
BOUNDS = {
    "gpu_kernels": "GPU kernels (decode reads every weight and the KV cache once a step: HBM-bound)",
    "kernel_launches": "host: kernel launches and ZeRO-3 hooks",
    "network": "ZeRO-3 parameter all-gathers (the interconnect)",
    "tensor_parallel": "tensor-parallel all-reduces",
    "pcie": "PCIe: parameters streamed from host memory (offload_param)",
    "nvme": "NVMe: parameters read from the drives (offload_param nvme)",
}


@dataclass(frozen=True)
class Generation:
    """One generate() call on every replica at once. Times are per call; throughput counts every
    replica's generated tokens."""
    scenario: str
    engine: str
    gpus: int
    replicas: int
    tensor_parallel: int
    batch_size: int
    prompt_len: int
    new_tokens: int
    implementation: str
    prefill_time_s: float            # the prompt's forward: time to the first token
    decode_time_s: float             # every decode step
    total_time_s: float
    decode_step_first_s: float
    decode_step_last_s: float
    tokens_per_s: float              # generated tokens of all replicas per second of the call
    decode_tokens_per_s: float       # during the decode steps alone
    decode_steps: int
    decode_steps_simulated: int
    bound: str                       # a BOUNDS key: the resource busy the longest in the last decode step
    bound_busy_s: dict[str, float]   # BOUNDS key -> busy seconds in the last decode step
    kv_cache_bytes: float            # per GPU, once the last forward has run (as the schedule holds it)
    memory: Memory

    @property
    def fits(self) -> bool:
        return fits(self.memory.fits, self.memory.host.fits)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["fits"] = self.fits
        out["bound_detail"] = BOUNDS[self.bound]
        return out


def engine_name(sc: Scenario) -> str:
    gen = sc.inference
    assert gen is not None
    z = sc.zero
    if z.stage == 3:
        where = {"cpu": "parameters streamed from CPU memory", "nvme": "parameters streamed from NVMe"}.get(
            z.param_offload_device, "parameters gathered from the GPUs' partitions")
        return f"ZeRO-Inference (ZeRO-3, {where}) + HF generate"
    inject = "kernel injection" + (" + CUDA graph" if gen.cuda_graph else "") if gen.kernel_inject else "HF model code"
    return f"DeepSpeed-Inference ({inject}, tensor parallel {gen.tensor_parallel}) + HF generate"


def _forward_ends(trace: Trace) -> dict[int, float]:
    ends: dict[int, float] = {}
    for op, t in zip(trace.schedule.ops, trace.timings):
        if t.end_s > ends.get(op.micro_step, -1.0):
            ends[op.micro_step] = t.end_s
    return ends


def _interpolated(steps: int, times: dict[int, float]) -> float:
    """The sum over decode steps 1..steps of their times, those not simulated linear between the
    simulated neighbours (see [Note: generation])."""
    known = sorted(times)
    total = 0.0
    for a, b in zip(known, known[1:]):
        ta, tb = times[a], times[b]
        # steps a..b-1; step b is counted by the next pair (or below)
        total += sum(ta + (tb - ta) * (k - a) / (b - a) for k in range(a, b))
    return total + times[known[-1]] if known else 0.0


def _busy(sc: Scenario, trace: Trace, forward: int) -> dict[str, float]:
    """Per BOUNDS key, the seconds its resource is busy in `forward`."""
    s = trace.schedule
    cm = CostModel(sc.cluster, sc.precision, s.zero_stage, s.host, tensor=s.tensor)
    busy = dict.fromkeys(BOUNDS, 0.0)
    for op, t in zip(s.ops, trace.timings):
        if op.micro_step != forward:
            continue
        span = t.end_s - t.start_s
        if op.stream is Stream.COMPUTE and op.comm is None:
            cost = cm.op_cost(op)
            busy["kernel_launches"] += cost.fixed_s
            busy["gpu_kernels"] += max(span - cost.fixed_s, 0.0)
        elif op.stream is Stream.COMPUTE:
            busy["tensor_parallel"] += span
        elif op.stream is Stream.ALLGATHER:
            busy["network"] += span
        elif op.stream is Stream.H2D:
            busy["pcie"] += span
        elif op.stream is Stream.NVME:
            busy["nvme"] += span
    return busy


def summarize_generation(sc: Scenario, trace: Trace, forwards: tuple[int, ...]) -> Generation:
    gen = sc.inference
    assert gen is not None
    ends = _forward_ends(trace)
    prefill = ends[0]
    step_times = {f: ends[f] - ends[prev] for prev, f in zip(forwards, forwards[1:])}
    steps = gen.new_tokens - 1
    decode = _interpolated(steps, step_times)
    total = prefill + decode
    replicas = sc.cluster.world_size // gen.tensor_parallel
    generated = replicas * gen.batch_size
    last = forwards[-1]
    busy = _busy(sc, trace, last) if steps else dict.fromkeys(BOUNDS, 0.0)
    memory = memory_at_peak(sc, trace)
    # the cache the schedule holds once the last forward has run: the injected kernels' preallocated
    # one, or every layer's grown by the last forward
    kv = sum(a.size_bytes for a in trace.schedule.static if a.category == Category.KV_CACHE) + sum(
        a.size_bytes for op in trace.schedule.ops if op.micro_step == last for a in op.alloc
        if a.category == Category.KV_CACHE and a.tag.micro == last)
    attn, kernels = generation_kernels(gen, sc.training)
    cache = "KV cache preallocated for max_out_tokens" if gen.kernel_inject else "DynamicCache concatenating each token"
    impl = f"{sc.precision}; attention {attn}; kernels {'fused' if kernels == 'fused' else 'hf (op by op)'}; {cache}"
    return Generation(
        scenario=sc.name, engine=engine_name(sc), gpus=sc.cluster.world_size, replicas=replicas,
        tensor_parallel=gen.tensor_parallel, batch_size=gen.batch_size, prompt_len=gen.prompt_len,
        new_tokens=gen.new_tokens, implementation=impl, prefill_time_s=prefill, decode_time_s=decode,
        total_time_s=total, decode_step_first_s=step_times.get(forwards[1], 0.0) if steps else 0.0,
        decode_step_last_s=step_times.get(last, 0.0), tokens_per_s=generated * gen.new_tokens / total,
        decode_tokens_per_s=generated * steps / decode if decode else 0.0, decode_steps=steps,
        decode_steps_simulated=len(forwards) - 1, bound=max(busy, key=busy.__getitem__), bound_busy_s=busy,
        kv_cache_bytes=kv, memory=memory)
