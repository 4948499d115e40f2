"""zsim tune: search ZeRO configurations at the scenario's global batch and world size.

Search (deterministic):
1. Structural candidates: layout (pipeline stages: every divisor of the world size up to the
   layer count whose data-parallel size divides the global batch; DeepSpeed's PipelineEngine
   takes ZeRO-0/1 only, pipe/engine.py:76) x stage x offload x micro-batch (dividing the batch
   per data-parallel rank, the rest accumulated) x activation checkpointing. Each is first checked against a memory lower
   bound that needs no simulation: model states left on the GPU + the activations every
   micro-batch must hold at the end of its forward + the CUDA/allocator reserve. The
   simulated peak can only be higher, so a candidate over capacity is pruned unsimulated.
2. The survivors are simulated, cheapest-looking first (no offload, no recompute, larger
   micro-batches), until half the budget is spent; the scenario's own layout first, the
   other layouts only while nothing fits.
3. Knob refinement: for the best fitting structures, coordinate descent over bucket sizes,
   prefetch, persistence threshold, max live parameters and overlap_comm.
A point of the search space is a `TunePoint`; it runs as a `Variant` (a list of `--set`
assignments) through the shared runner, so every result is re-runnable.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from zsim.errors import ZsimInputError
from zsim.report.format import fmt_setting
from zsim.result import Result
from zsim.schedule.build import workload_for
from zsim.schedule.optimizer import model_state_bytes
from zsim.workload.lora import trainable_params
from zsim.search.variants import Base, Outcome, Variant
from zsim.workload.module import DTYPE_BYTES

Z = "deepspeed.zero_optimization"
OFFLOADS = {
    "none": (f"{Z}.offload_optimizer={{device: none}}", f"{Z}.offload_param={{device: none}}"),
    "optimizer cpu": (f"{Z}.offload_optimizer={{device: cpu, pin_memory: true}}", f"{Z}.offload_param={{device: none}}"),
    "optimizer+params cpu": (f"{Z}.offload_optimizer={{device: cpu, pin_memory: true}}",
                             f"{Z}.offload_param={{device: cpu, pin_memory: true}}"),
    # ZeRO-Infinity: tried last, when nothing else fits
    "optimizer+params nvme": (f"{Z}.offload_optimizer={{device: nvme, nvme_path: /local_nvme, pin_memory: true}}",
                              f"{Z}.offload_param={{device: nvme, nvme_path: /local_nvme, pin_memory: true}}"),
}
KNOBS = {
    "reduce_bucket_size": (5e7, 2e8, 5e8),
    "overlap_comm": (True, False),
}
KNOBS_STAGE3 = {
    "stage3_prefetch_bucket_size": (5e6, 5e7, 2e8),
    "stage3_param_persistence_threshold": (1e4, 1e5, 1e6),
    "stage3_max_live_parameters": (1e8, 1e9),
}
OBJECTIVES = {"tokens_per_s": True, "mfu": True, "step_time_s": False}


@dataclass(frozen=True)
class Layout:
    """How the world splits besides data parallelism: the model-parallel dimensions searched
    (a tensor-parallel size joins here as a field, in `assignments`, `model_parallel` and a loop
    of `layouts`)."""
    pipeline: int = 1

    @property
    def model_parallel(self) -> int:
        """GPUs per data-parallel rank."""
        return self.pipeline

    @property
    def top_stage(self) -> int:
        # DeepSpeed's PipelineEngine refuses ZeRO-2/3 (pipe/engine.py:76)
        return 1 if self.pipeline > 1 else 3

    def assignments(self) -> tuple[str, ...]:
        return (f"parallelism.pipeline={self.pipeline}",)

    def label(self) -> str:
        return f", PP {self.pipeline}" if self.pipeline > 1 else ""


def layouts(sc) -> list[Layout]:
    """Every layout of the scenario's world: pipeline sizes dividing it, with a transformer layer
    per stage at least and a data-parallel size that divides the global batch."""
    world, batch = sc.cluster.world_size, sc.global_batch_size
    return [Layout(pp) for pp in _divisors(world) if pp <= sc.model.layers and batch % (world // pp) == 0]


@dataclass
class TunePoint:
    """One configuration of the search space: the structure and the ZeRO knobs it sets."""
    stage: int
    offload: str
    micro_batch: int
    gas: int
    checkpointing: str
    knobs: dict = field(default_factory=dict)
    layout: Layout = Layout()

    def assignments(self) -> tuple[str, ...]:
        out = [*self.layout.assignments(), f"{Z}.stage={self.stage}", *OFFLOADS[self.offload],
               f"training.micro_batch_size={self.micro_batch}",
               f"training.gradient_accumulation_steps={self.gas}",
               "deepspeed.train_micro_batch_size_per_gpu=null", "deepspeed.gradient_accumulation_steps=null",
               f"training.activation_checkpointing={self.checkpointing}"]
        out += [f"{Z}.{k}={fmt_setting(v)}" for k, v in sorted(self.knobs.items())]
        return tuple(out)

    @property
    def variant(self) -> Variant:
        knobs = "".join(f", {k}={fmt_setting(v)}" for k, v in sorted(self.knobs.items()))
        return Variant(f"ZeRO-{self.stage}{self.layout.label()}, offload {self.offload}, {self.micro_batch}x{self.gas}, "
                       f"checkpointing {self.checkpointing}{knobs}", self.assignments())

    def key(self):
        return (self.layout, self.stage, self.offload, self.micro_batch, self.checkpointing,
                tuple(sorted(self.knobs.items())))


def memory_lower_bound(sc, wl=None) -> float:
    """Bytes the simulated peak cannot go below (see module doc); `wl`: the scenario's workload
    when already built."""
    wl = wl or workload_for(sc)
    # a pipeline: the worst stage holds at least the average stage's share of the model (states
    # and one micro-batch's activations of its layers)
    pp = sc.pipeline_stages
    n = wl.n_params / pp
    z = sc.zero
    dp = sc.data_parallel_size
    trained = trainable_params(wl) / pp   # frozen weights have no gradients or optimizer states
    states = model_state_bytes(n, n / dp, z.stage, DTYPE_BYTES[sc.precision], trainable=(trained, trained / dp))
    if z.optimizer_offload_device != "none":
        states["optimizer states"] = 0.0
        if z.stage >= 2:
            states["gradients"] = 0.0
    if z.param_offload_device != "none":
        states["parameters"] = 0.0
    mode = sc.training.activation_checkpointing
    if mode == "full":
        acts = wl.layers * wl.layer_input_bytes
    elif mode == "selective":
        acts = sum(m.act_bytes - m.act_bytes_s2 for m in wl.modules)
    else:
        acts = sum(m.act_bytes for m in wl.modules)
    return sum(states.values()) + acts / pp + sc.cluster.reserved_bytes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structural_candidates(sc) -> list[TunePoint]:
    out = []
    for layout in layouts(sc):
        # the batch divides by the data-parallel size
        per_rank = sc.global_batch_size // (sc.cluster.world_size // layout.model_parallel)
        for stage in range(layout.top_stage + 1):
            for off in OFFLOADS:
                if off != "none" and stage == 0:
                    continue
                if off.startswith("optimizer+params") and stage != 3:
                    continue
                if off.endswith("nvme") and sc.cluster.profile.nvme.drives_per_node == 0:
                    continue
                for mb in _divisors(per_rank):
                    for ck in ("none", "selective", "full"):
                        if ck == "selective" and sc.training.flash_attention:
                            continue   # with FlashAttention nothing s^2-sized is stored: same as none
                        out.append(TunePoint(stage, off, mb, per_rank // mb, ck, layout=layout))
    # cheapest-looking first: the scenario's own layout (a layout adds bubbles and point-to-point
    # sends; the others are tried when the budget is not spent), no offload, no recompute, big
    # micro-batches, higher ZeRO stages last for ties
    own = Layout(sc.pipeline_stages)
    off_rank = {k: i for i, k in enumerate(OFFLOADS)}
    ck_rank = {"none": 0, "selective": 1, "full": 2}
    out.sort(key=lambda c: (c.layout != own, c.layout.model_parallel, off_rank[c.offload], ck_rank[c.checkpointing],
                            -c.micro_batch, c.stage))
    return out


@dataclass
class TuneResult:
    ranked: list[tuple[TunePoint, Result]]       # the points that fit, best first on the objective
    evaluated: list[tuple[TunePoint, Outcome]]   # every point run (simulated or invalid), in order
    pruned: list[TunePoint]                      # over capacity by the lower bound, never simulated
    rejected: int                                # invalid configurations
    wall_s: float
    objective: str

    @property
    def simulated(self) -> int:
        return sum(out.ok for _, out in self.evaluated)


def score(result: Result, objective: str) -> float:
    """The objective, signed so that higher is better."""
    v = getattr(result, objective)
    return v if OBJECTIVES[objective] else -v


def tune(base: Base, objective: str = "tokens_per_s", budget: int = 60) -> TuneResult:
    t0 = time.perf_counter()
    seen: dict = {}    # point key -> (point, Outcome), in evaluation order
    pruned: list[TunePoint] = []
    rejected = 0
    base_sc = base.scenario(())
    capacity = base_sc.cluster.hbm_capacity_bytes

    def evaluate(c: TunePoint, sc=None) -> Result | None:
        nonlocal rejected
        if c.key() not in seen:
            out = base.run(c.variant, sc)
            rejected += not out.ok
            seen[c.key()] = (c, out)
        return seen[c.key()][1].result

    def ranked():
        ok = [(c, out.result) for c, out in seen.values() if out.fits]
        return sorted(ok, key=lambda cr: -score(cr[1], objective))

    survivors = []
    workloads: dict = {}    # candidates share workloads: the micro-batch decides them here
    for c in structural_candidates(base_sc):
        try:
            sc = base.scenario(c.assignments())
        except ZsimInputError:
            rejected += 1
            continue
        key = (sc.model, sc.micro_batch_size, sc.seq_len, sc.precision, sc.training, sc.expert_parallel_size)
        if key not in workloads:
            workloads[key] = workload_for(sc)
        if memory_lower_bound(sc, workloads[key]) > capacity:
            pruned.append(c)
        else:
            survivors.append((c, sc))
    # half the budget on structures; if none of those fits, keep going until one does. Other
    # layouts than the scenario's come last, and only while nothing fits (a simulated pipeline of
    # many stages costs several data-parallel ones)
    own = Layout(base_sc.pipeline_stages)
    for i, (c, sc) in enumerate(survivors):
        if c.layout != own and any(out.fits for _, out in seen.values()):
            break
        evaluate(c, sc)
        if i + 1 >= max(1, budget // 2) and (any(out.fits for _, out in seen.values()) or len(seen) >= budget):
            break

    for c, r in ranked()[:3]:
        best_c, best_r = c, r
        knobs = dict(KNOBS)
        if c.stage == 3:
            knobs.update(KNOBS_STAGE3)
        for name, values in knobs.items():
            for v in values:
                if len(seen) >= budget:
                    break
                trial = TunePoint(best_c.stage, best_c.offload, best_c.micro_batch, best_c.gas, best_c.checkpointing,
                                  {**best_c.knobs, name: v}, best_c.layout)
                r = evaluate(trial)
                if r is not None and r.fits and score(r, objective) > score(best_r, objective):
                    best_c, best_r = trial, r
    return TuneResult(ranked(), list(seen.values()), pruned, rejected, time.perf_counter() - t0, objective)

