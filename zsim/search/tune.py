"""zsim tune: search ZeRO configurations at the scenario's global batch and world size.

Search (deterministic):
1. Structural candidates: layout (`layouts`: tensor-parallel sizes dividing the GPUs per node
   and the heads / key-value heads / MLP width, with sequence parallelism on and off, x pipeline stages
   dividing the rest up to the layer count, data parallel = world / (TP x PP) dividing the global
   batch; DeepSpeed's PipelineEngine takes ZeRO-0/1 only, pipe/engine.py:76) x stage x offload x micro-batch (dividing the batch
   per data-parallel rank, the rest accumulated) x activation checkpointing. Each is first checked against a memory lower
   bound that needs no simulation: model states left on the GPU + the activations every
   micro-batch must hold at the end of its forward + the CUDA/allocator reserve. The
   simulated peak can only be higher, so a candidate over capacity is pruned unsimulated.
2. The survivors are simulated, cheapest-looking first (no offload, no recompute, larger
   micro-batches; a pipeline's with GAS >= 4 x PP first), until half the budget is spent,
   round-robin over the layouts (the scenario's own first) so that each gets a fitting try
   before any gets a second; with `budget=None` (`zsim tune --budget all`) every survivor. The
   scenario's own configuration is simulated before them, and a configuration refused as invalid
   (a rule of DeepSpeed's or a layout zsim does not model) costs no part of the budget.
3. Knob refinement: for the best fitting structures, coordinate descent over bucket sizes,
   prefetch, persistence threshold, max live parameters and overlap_comm.
Throughout, a candidate whose step-time lower bound (its compute alone, see [Note: step-time
lower bound]) keeps it from beating the `keep`-th best fitting result so far is skipped
unsimulated: it cannot enter the best `keep`, and the k-th best only improves as the search goes
on. (Every candidate runs the scenario's global batch and sequence, so tokens/s is the same
constant over the step time for all; MFU is each one's model FLOPs per GPU over it.) With
`budget=None` the survivors go in order of the objective's bound, so the search stops at the
first one skipped: every candidate is simulated or proven unable to enter the best `keep`.
Points whose `structural_key` is equal (ZeRO-3 persistence thresholds that keep the same
parameters gathered) build the same schedule: one is simulated, the others share its Result.
A point of the search space is a `TunePoint`; it runs as a `Variant` (a list of `--set`
assignments) through the shared runner, so every result is re-runnable.
"""
from __future__ import annotations

import bisect
import itertools
import sys
import time
from dataclasses import dataclass, field, replace

from zsim.config.scenario import parse_value
from zsim.config.parallel import ulysses_refusal
from zsim.errors import ZsimInputError
from zsim.report.format import fmt_setting
from zsim.result import Result
from zsim.result.summarize import model_flops_per_gpu
from zsim.search.bound import (ComputePricer, layer_compute_s, stage_compute_s, step_time_lower_bound_s,
                               tensor_collectives, zero3_host_s)
from zsim.schedule.build import training_workload, workload_for
from zsim.schedule.optimizer import ADAM_STATE_BYTES, model_state_bytes, optimizer_state_bytes
from zsim.schedule.partition import persistent_params
from zsim.workload.lora import trainable_params
from zsim.search.variants import Base, Outcome, Variant
from zsim.schema import accepted_keys
from zsim.specs.deepspeed import ZeroConfig
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
# ZeRO++ knobs the refinement tries on a multi-node ZeRO-3 point (Tuner.refine)
ZEROPP_KNOBS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")
OBJECTIVES = {"tokens_per_s": True, "mfu": True, "step_time_s": False}


@dataclass(frozen=True)
class Layout:
    """How the world splits besides data parallelism (data parallel = world / (tensor x pipeline)).
    Megatron-LM's placement (zsim/hardware/placement.py): a tensor-parallel group inside a node,
    pipeline stages across nodes, data parallel over what remains."""
    pipeline: int = 1
    tensor: int = 1
    sequence_parallel: bool = False
    expert: int = 1     # DeepSpeed-MoE's ep_size: experts split inside the data-parallel group
    expert_searched: bool = False   # ep_size is a dimension of the search (DeepSpeed-MoE's layer)
    sequence: int = 1   # DeepSpeed-Ulysses's sequence-parallel size (see [Note: DeepSpeed-Ulysses])
    sequence_searched: bool = False   # it is a dimension of the search (see `_sequence_sizes`)

    @property
    def model_parallel(self) -> int:
        """GPUs per ZeRO data-parallel rank (Ulysses' sequence ranks are inside ZeRO's group)."""
        return self.pipeline * self.tensor

    @property
    def sample_parallel(self) -> int:
        """GPUs per sample: the global batch divides by world / this."""
        return self.model_parallel * self.sequence

    @property
    def top_stage(self) -> int:
        # DeepSpeed's PipelineEngine refuses ZeRO-2/3 (pipe/engine.py:76)
        return 1 if self.pipeline > 1 else 3

    def assignments(self) -> tuple[str, ...]:
        return (f"parallelism.pipeline={self.pipeline}", f"parallelism.tensor={self.tensor}",
                f"parallelism.sequence_parallel={str(self.sequence_parallel).lower()}",
                # written wherever it is searched: an ep_size of 1 on a base with another is one
                *((f"parallelism.expert={self.expert}",) if self.expert_searched else ()),
                # under both its names, so a ds_config holding DeepSpeed's key agrees
                *((f"parallelism.sequence={self.sequence}", f"deepspeed.sequence_parallel_size={self.sequence}")
                  if self.sequence_searched else ()))

    def label(self) -> str:
        sp = " SP" if self.sequence_parallel else ""
        return ((f", TP {self.tensor}{sp}" if self.tensor > 1 else "") + (f", PP {self.pipeline}" if self.pipeline > 1 else "")
                + (f", EP {self.expert}" if self.expert > 1 else "")
                + (f", Ulysses SP {self.sequence}" if self.sequence > 1 else ""))


def _tensor_sizes(sc) -> list[int]:
    """Tensor-parallel sizes the scenario admits: divisors of the GPUs per node (the group stays
    on NVLink) that divide the heads, the key-value heads and the MLP width (Megatron's rules,
    zsim/config/parallel.py _check_tensor); 1 only where zsim models no tensor parallelism."""
    m = sc.model
    if m.mla is not None or m.moe is not None or sc.training.lora is not None:
        return [1]
    return [t for t in _divisors(sc.cluster.gpus_per_node)
            if m.heads % t == 0 and m.n_kv_heads % t == 0 and m.ffn % t == 0]


def own_layout(sc) -> Layout:
    return Layout(sc.pipeline_stages, sc.tensor_parallel_size, sc.parallelism.sequence_parallel, sc.expert_parallel_size,
                  _searches_expert(sc), sc.sequence_parallel_size, bool(_sequence_sizes(sc)))


# the sequence length from which tune tries DeepSpeed-Ulysses: ALST's runs (Bekman et al. 2025,
# arXiv:2506.13996) start at 32k tokens; half that leaves room for a run whose activations barely fit
LONG_SEQUENCE = 16384


def _sequence_sizes(sc) -> list[int]:
    """Ulysses sizes tune tries, besides 1: for a sequence of LONG_SEQUENCE tokens or more (or a
    scenario already using Ulysses), the divisors of the world that DeepSpeed accepts for this
    model and zsim models (zsim/config/parallel.py ulysses_refusal)."""
    if sc.sequence_parallel_size == 1 and sc.seq_len < LONG_SEQUENCE:
        return []
    return [u for u in _divisors(sc.cluster.world_size)
            if u > 1 and ulysses_refusal(u, sc.model, sc.training) is None]


def _searches_expert(sc) -> bool:
    """DeepSpeed-MoE's layer (capacity dispatch) takes an ep_size; a dense model or Hugging
    Face's dropless MoE has none."""
    return sc.model.moe is not None and sc.model.moe.dispatch == "capacity"


def _expert_sizes(sc, data_parallel: int, searched: bool) -> list[int]:
    """DeepSpeed-MoE ep_size values: divisors of the data-parallel size that divide the experts
    (zsim/config/parallel.py _check_expert) where `searched` (`_searches_expert`); 1 for a dense
    model or Hugging Face's dropless MoE."""
    if not searched:
        return [1]
    return [e for e in _divisors(data_parallel) if sc.model.moe.experts % e == 0]


def own_point(sc) -> "TunePoint":
    """The scenario's own structure as a point of the search (its knobs stay the scenario's)."""
    z = sc.zero
    offload = ("none" if z.optimizer_offload_device == "none" else
               f"optimizer+params {z.param_offload_device}" if z.param_offload_device != "none" else "optimizer cpu")
    return TunePoint(z.stage, offload, sc.micro_batch_size, sc.gradient_accumulation_steps,
                     sc.training.activation_checkpointing, {}, own_layout(sc))


# [Note: framework search space]
# What runs the training loop bounds what tune may propose (training.framework, or tune's
# --framework). The HF Trainer (and accelerate, axolotl, LLaMA-Factory on top of it) wraps the
# user's model in deepspeed.initialize: it runs ZeRO, offload and DeepSpeed AutoTP
# (tensor_parallel.autotp_size, which zsim models as tensor parallelism without Megatron's
# sequence parallelism; AutoTP shards the linears only, runtime/tensor_parallel/), but no
# pipeline (that needs the model rebuilt as a PipelineModule) and no DeepSpeed-MoE ep_size (an
# argument of deepspeed.moe.layer.MoE in the model code). The DeepSpeed engine on the user's own
# model adds the PipelineModule and DeepSpeed-MoE; only Megatron-DeepSpeed has Megatron's
# tensor parallelism with --sequence-parallel. Not stated: every layout zsim models, as before.
_SPACE_TEXT = {
    "hf_trainer": "ZeRO stages, offload, micro-batch x GAS, checkpointing, DeepSpeed AutoTP "
                  "(tensor_parallel.autotp_size) and, for a long sequence, DeepSpeed-Ulysses (ALST); no Megatron "
                  "sequence parallelism, pipeline or ep_size",
    "deepspeed": "ZeRO stages, offload, micro-batch x GAS, checkpointing, AutoTP, PipelineModule pipelines, "
                 "DeepSpeed-MoE ep_size and, for a long sequence, DeepSpeed-Ulysses; no Megatron sequence parallelism",
    "megatron_deepspeed": "every layout zsim models (Megatron TP with and without sequence parallelism, "
                          "pipelines, ep_size, DeepSpeed-Ulysses for a long sequence)",
    None: "every layout zsim models (Megatron TP with and without sequence parallelism, pipelines, ep_size, "
          "DeepSpeed-Ulysses for a long sequence)",
}

# --fix keys that name a dimension of the search: the TunePoint attribute each pins (several
# spellings of one setting: the scenario's and DeepSpeed's)
_PIN_FIELDS = {
    "parallelism.tensor": "tensor", "deepspeed.tensor_parallel.autotp_size": "tensor",
    "parallelism.pipeline": "pipeline", "deepspeed.pipeline.stages": "pipeline",
    "parallelism.sequence_parallel": "sequence_parallel", "parallelism.expert": "expert",
    "parallelism.sequence": "sequence", "deepspeed.sequence_parallel_size": "sequence",
    f"{Z}.stage": "stage",
    "training.micro_batch_size": "micro_batch", "deepspeed.train_micro_batch_size_per_gpu": "micro_batch",
    "training.gradient_accumulation_steps": "gas", "deepspeed.gradient_accumulation_steps": "gas",
    "training.activation_checkpointing": "checkpointing",
    f"{Z}.offload_optimizer.device": "optimizer_device", f"{Z}.offload_param.device": "param_device",
    f"{Z}.offload_optimizer": "optimizer_device", f"{Z}.offload_param": "param_device",
}
_OFFLOAD_DEVICES = {name: tuple(a.split("device: ")[1].split(",")[0].rstrip("}") for a in sets)
                    for name, sets in OFFLOADS.items()}   # "optimizer cpu" -> ("cpu", "none")


@dataclass(frozen=True)
class Space:
    """What tune may propose: the framework's layouts (see [Note: framework search space]) and
    the user's pins (`--fix KEY=VALUE`): `pins` (TunePoint attribute, value) restrict the
    candidates, `fixed` (the assignments as given) are applied after every point's own, and
    `knobs` names the ZeRO knobs pinned (left out of the refinement)."""
    framework: str | None = None
    framework_from: str = "training.framework"
    pins: tuple[tuple[str, object], ...] = ()
    fixed: tuple[str, ...] = ()
    knobs: frozenset = frozenset()

    @property
    def sequence_parallel(self) -> bool:
        return self.framework in (None, "megatron_deepspeed")

    @property
    def pipeline(self) -> bool:
        return self.framework != "hf_trainer"

    @property
    def expert(self) -> bool:
        return self.framework != "hf_trainer"

    def _pinned(self, name: str, value) -> bool:
        return all(v == value for k, v in self.pins if k == name)

    def allows_layout(self, layout: Layout) -> bool:
        return ((self.sequence_parallel or not layout.sequence_parallel) and (self.pipeline or layout.pipeline == 1)
                and all(self._pinned(k, getattr(layout, k)) for k in ("tensor", "pipeline", "sequence_parallel",
                                                                      "expert", "sequence")))

    def allows(self, c: "TunePoint") -> bool:
        opt, par = _OFFLOAD_DEVICES[c.offload]
        return (self.allows_layout(c.layout) and self._pinned("stage", c.stage) and self._pinned("micro_batch", c.micro_batch)
                and self._pinned("gas", c.gas) and self._pinned("checkpointing", c.checkpointing)
                and self._pinned("optimizer_device", opt) and self._pinned("param_device", par))

    def describe(self) -> str:
        """One line: the space searched, why, and how to change it."""
        name = self.framework or "framework not stated"
        fixed = f"; fixed: {', '.join(self.fixed)}" if self.fixed else ""
        return (f"search space: {name} ({self.framework_from}): {_SPACE_TEXT[self.framework]}{fixed}; "
                "--framework / --fix to change it")


def parse_fix(text: str) -> tuple[str, str, str | None, object]:
    """`KEY=VALUE` of --fix: (key, assignment, the TunePoint attribute it pins or None, the pinned
    value); a bad value of a searched key is bad input."""
    if "=" not in text or not text.split("=", 1)[0].strip():
        raise ZsimInputError("--fix", text, "use --fix KEY=VALUE, e.g. --fix parallelism.tensor=1")
    key, value = (x.strip() for x in text.split("=", 1))
    parsed = parse_value(value)
    attr = _PIN_FIELDS.get(key)
    if attr is None:
        return key, f"{key}={value}", None, parsed
    if attr.endswith("_device"):
        if isinstance(parsed, dict):
            parsed = parsed.get("device", "none")
        if parsed not in ("none", "cpu", "nvme"):
            raise ZsimInputError("--fix", text, "an offload device is none, cpu or nvme")
    elif attr == "checkpointing":
        if parsed not in ("none", "selective", "full"):
            raise ZsimInputError("--fix", text, "activation_checkpointing is none, selective or full")
    elif attr == "sequence_parallel":
        if not isinstance(parsed, bool):
            raise ZsimInputError("--fix", text, "give true or false")
    elif isinstance(parsed, bool) or not isinstance(parsed, int) or parsed < (0 if attr == "stage" else 1) \
            or (attr == "stage" and parsed > 3):
        raise ZsimInputError("--fix", text, "give a ZeRO stage 0-3" if attr == "stage" else "give a whole number, 1 or more")
    return key, f"{key}={value}", attr, parsed


def make_space(fixes=(), framework: str | None = None, framework_from: str = "training.framework") -> Space:
    """The Space of `framework` with the `--fix` assignments `fixes`: a searched dimension is
    pinned, a ZeRO knob (under any of DeepSpeed's spellings) left out of the refinement, and
    every fix applied after each point's own assignments."""
    spellings = accepted_keys(ZeroConfig)
    pins: list = []
    fixed: list = []
    knobs: set = set()
    seen: dict = {}
    for text in fixes:
        key, assignment, attr, value = parse_fix(text)
        name = attr or key
        if name in seen:
            raise ZsimInputError("--fix", text, f"fixes what --fix {seen[name]} already fixes; keep one")
        seen[name] = text
        fixed.append(assignment)
        if attr is not None:
            pins.append((attr, value))
        elif key.startswith(Z + ".") and key[len(Z) + 1:] in spellings:
            field_ = spellings[key[len(Z) + 1:]]
            knobs.update(k for k in (*KNOBS, *KNOBS_STAGE3, *ZEROPP_KNOBS) if spellings.get(k) == field_)
    return Space(framework, framework_from, tuple(pins), tuple(fixed), frozenset(knobs))


def layouts(sc, space: Space = Space()) -> list[Layout]:
    """`_layouts` that the search space allows (see [Note: framework search space])."""
    return [layout for layout in _layouts(sc, space.expert) if space.allows_layout(layout)]


def _layouts(sc, expert_search: bool = True) -> list[Layout]:
    """Every layout of the scenario's world: tensor sizes from `_tensor_sizes` x pipeline sizes
    dividing the rest, with a transformer layer per stage at least and a data-parallel size that
    divides the global batch. With tensor parallelism, sequence parallelism on (wherever the
    sequence divides) and off: on first (Korthikanti et al. 2022: it shards the activations TP
    leaves replicated for the same communication volume), off because its extra all-gathers
    can cost more than it saves. The scenario's own layout comes first. Without `expert_search`
    each layout keeps the scenario's ep_size."""
    world, batch = sc.cluster.world_size, sc.global_batch_size
    seq = sc.seq_len
    own = own_layout(sc)
    out = [own]
    # DeepSpeed-Ulysses composes with data parallelism only (parallel_state_sp): for a long sequence
    # (the only runs it is tried on) next after the scenario's own, smallest first, the fewest
    # all-to-all ranks that fit
    for u in _sequence_sizes(sc):
        layout = Layout(1, 1, False, 1, own.expert_searched, u, True)
        if layout != own and batch % (world // u) == 0:
            out.append(layout)
    # Megatron-LM's practice (Narayanan et al. 2021, takeaway #1): tensor parallel up to the GPUs
    # of a node, then the fewest pipeline stages that fit: tried in that order
    for tp in sorted(_tensor_sizes(sc), reverse=True):
        # an MoE model runs without a pipeline (zsim/config/parallel.py _check_expert)
        for pp in (_divisors(world // tp) if sc.model.moe is None else [1]):
            if pp > sc.model.layers or batch % (world // (tp * pp)):
                continue
            for sp in ((True, False) if tp > 1 else (False,)):
                # largest expert-parallel size first: fewer experts a rank, the memory an MoE needs
                eps = _expert_sizes(sc, world // (tp * pp), own.expert_searched) if expert_search else [own.expert]
                for ep in sorted(eps, reverse=True):
                    layout = Layout(pp, tp, sp, ep, own.expert_searched, 1, own.sequence_searched)
                    if layout != own and not (sp and seq % tp):
                        out.append(layout)
    return out


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
    fixed: tuple[str, ...] = field(default=(), compare=False)   # the --fix assignments, applied last

    def assignments(self) -> tuple[str, ...]:
        out = [*self.layout.assignments(), f"{Z}.stage={self.stage}", *OFFLOADS[self.offload],
               f"training.micro_batch_size={self.micro_batch}",
               f"training.gradient_accumulation_steps={self.gas}",
               "deepspeed.train_micro_batch_size_per_gpu=null", "deepspeed.gradient_accumulation_steps=null",
               f"training.activation_checkpointing={self.checkpointing}"]
        if "params" in self.offload:
            # hpZ keeps its secondary partitions on the offload device, which zsim does not model
            out.append(f"{Z}.zero_hpz_partition_size=1")
        out += [f"{Z}.{k}={fmt_setting(v)}" for k, v in sorted(self.knobs.items())]
        return tuple(out) + self.fixed

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
    z = sc.zero
    return _bound(workload_terms(wl or workload_for(sc), sc.training.activation_checkpointing,
                                 sc.deepspeed.activation_checkpointing.cpu_checkpointing), sc.pipeline_stages,
                  sc.seq_data_parallel_size, z.stage, z.optimizer_offload_device, z.param_offload_device, sc.precision,
                  sc.cluster.reserved_bytes, state_bytes=optimizer_state_bytes(sc.deepspeed),
                  gas=sc.gradient_accumulation_steps)


def point_lower_bound(sc, c: "TunePoint", wl, terms: tuple | None = None) -> float:
    """`memory_lower_bound` of the point `c` of the base scenario `sc`, with `wl` its workload at
    micro-batch 1 from `point_workload` (activation bytes are per sample: they scale with the
    micro-batch): no scenario is loaded or workload built per candidate (that costs more than
    simulating the survivors). `terms`: `workload_terms(wl, c.checkpointing)` when already known
    (candidates sharing a workload and a checkpointing mode share them)."""
    off = OFFLOADS[c.offload]
    return _bound(terms or workload_terms(wl, c.checkpointing, sc.deepspeed.activation_checkpointing.cpu_checkpointing),
                  c.layout.pipeline,
                  sc.cluster.world_size // c.layout.model_parallel, c.stage,
                  "none" if "device: none" in off[0] else "offloaded",
                  "none" if "device: none" in off[1] else "offloaded", sc.precision,
                  sc.cluster.reserved_bytes, c.micro_batch, optimizer_state_bytes(sc.deepspeed), c.gas)


def point_workload(sc, c: "TunePoint", micro_batch: int = 1):
    """The per-rank workload of the point `c` of the base scenario `sc` at `micro_batch` (what
    `workload_for` builds for the scenario `c` sets, with that micro-batch)."""
    training = replace(sc.training, activation_checkpointing=c.checkpointing)
    return training_workload(sc.model, micro_batch, sc.seq_len, sc.precision, training, c.layout.expert,
                             c.layout.tensor, c.layout.sequence_parallel, c.stage == 3 and sc.zero.memory_efficient_linear,
                             c.layout.sequence)


def workload_terms(wl, mode: str, cpu_checkpointing: bool = False) -> tuple[float, float, float]:
    """(parameters, trained parameters, activation bytes one micro-batch holds at the end of its
    forward under checkpointing `mode`): the parts of the bound that depend on the workload only.
    Parameters count as stored (Param.stored_numel: a QLoRA base weight's packed bytes in the
    run's dtype; its statistics, whole on every rank, counted as if sharded: still a bound).
    With deepspeed.activation_checkpointing.cpu_checkpointing the block inputs go to host memory
    (passes.py _checkpoint_block_input): none need stay on the GPU."""
    if mode == "full" and cpu_checkpointing:
        acts = 0.0
    elif mode == "full":
        acts = wl.layers * wl.layer_input_bytes
    elif mode == "selective":
        acts = sum(m.act_bytes - m.act_bytes_s2 for m in wl.modules)
    else:
        acts = sum(m.act_bytes for m in wl.modules)
    a = wl.act_dtype_bytes
    stored = sum(wl.stored_numels(a)) + wl.quant_state_bytes / a
    return stored, trainable_params(wl), acts


def _bound(terms, pp: int, dp: int, stage: int, optimizer_offload: str, param_offload: str, precision: str,
           reserved_bytes: float, act_scale: int = 1, state_bytes: float = ADAM_STATE_BYTES, gas: int = 1) -> float:
    # a pipeline: the worst stage holds at least the average stage's share of the model (states
    # and one micro-batch's activations of its layers)
    n_params, trained_params, acts = terms
    n = n_params / pp
    trained = trained_params / pp   # frozen weights have no gradients or optimizer states
    states = model_state_bytes(n, n / dp, stage, DTYPE_BYTES[precision], trainable=(trained, trained / dp),
                               state_bytes=state_bytes)
    if optimizer_offload != "none":
        states["optimizer states"] = 0.0
        if stage >= 2:
            states["gradients"] = 0.0
    if param_offload != "none":
        states["parameters"] = 0.0
    acts = act_scale * acts / pp
    if stage <= 1 and gas == 1:
        # ZeRO-0/1's 16-bit gradients are autograd's, made in the backward as it frees the
        # activations (see [Note: ZeRO-1/2 gradient lifetime], see [Note: ZeRO-0 gradient lifetime]):
        # with one micro-step the two need not be alive together; from the second micro-step on the
        # first one's gradients are there through the next forward
        grads = states.pop("gradients", 0.0)
        return sum(states.values()) + max(grads, acts) + reserved_bytes
    return sum(states.values()) + acts + reserved_bytes


def structural_key(sc, c: TunePoint, wl) -> tuple:
    """`c.key()` with stage3_param_persistence_threshold replaced by the parameters it keeps
    gathered (partition.persistent_params on the point's workload `wl`): the one place the builder
    reads the threshold (zsim/schedule/stage3.py build), and summarize never does, so points with
    the same key build the same schedule and get the same Result (tests/search/test_search.py compares
    them with their own simulations)."""
    knobs = dict(c.knobs)
    if c.stage == 3:
        threshold = knobs.pop("stage3_param_persistence_threshold", sc.zero.param_persistence_threshold)
        knobs["persistent"] = persistent_params(wl.stored_numels(wl.act_dtype_bytes), threshold,
                                                sc.zero.model_persistence_threshold)
    return (c.layout, c.stage, c.offload, c.micro_batch, c.gas, c.checkpointing, tuple(sorted(knobs.items())))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def structural_candidates(sc, space: Space = Space()) -> list[TunePoint]:
    out = []
    for layout in layouts(sc, space):
        # the batch divides by the data-parallel size
        per_rank = sc.global_batch_size // (sc.cluster.world_size // layout.sample_parallel)
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
                        c = TunePoint(stage, off, mb, per_rank // mb, ck, layout=layout, fixed=space.fixed)
                        if space.allows(c):
                            out.append(c)
    # cheapest-looking first: the scenario's own layout (a layout adds bubbles and point-to-point
    # sends; the others are tried when the budget is not spent), no offload, no recompute, big
    # micro-batches, higher ZeRO stages last for ties
    off_rank = {k: i for i, k in enumerate(OFFLOADS)}
    ck_rank = {"none": 0, "selective": 1, "full": 2}
    order = {layout: i for i, layout in enumerate(layouts(sc, space))}
    # a pipeline's bubble is (p - 1) / GAS of its step (Narayanan et al. 2021): its micro-batches
    # that leave at least 4 per stage come first, the largest of those first. A Ulysses layout is
    # tried for a sequence whose activations do not fit: micro-batch 1 first, as ALST runs it (the
    # sequence is the batch), then checkpointing
    out.sort(key=lambda c: (order[c.layout], off_rank[c.offload], c.layout.sequence > 1 and c.micro_batch > 1,
                            ck_rank[c.checkpointing],
                            c.layout.pipeline > 1 and c.gas < 4 * c.layout.pipeline, -c.micro_batch, c.stage))
    return out


@dataclass
class TuneResult:
    ranked: list[tuple[TunePoint, Result]]       # the points that fit, best first on the objective
    evaluated: list[tuple[TunePoint, Outcome]]   # every point run (simulated or invalid), in order
    pruned: list[TunePoint]                      # over capacity by the lower bound, never simulated
    bounded: list[tuple[TunePoint, float]]       # (point, its step-time lower bound) when skipped by it
    rejected: int                                # invalid configurations
    wall_s: float
    objective: str

    @property
    def simulated(self) -> int:
        """Configurations with a result (simulated, or sharing another's simulation)."""
        return sum(out.ok for _, out in self.evaluated)

    @property
    def shared(self) -> int:
        """Configurations whose result is another's simulation (see `structural_key`)."""
        return sum(out.ok and out.shared for _, out in self.evaluated)


def distinct_key(c: TunePoint, r: Result) -> tuple:
    """Points that simulate identically (a knob that changes nothing, e.g. a prefetch size above
    every layer) share this: the ranking shows them as one row."""
    return c.layout, c.stage, c.offload, c.micro_batch, c.gas, c.checkpointing, r.step_time_s, r.memory.peak_bytes


def score(result: Result, objective: str) -> float:
    """The objective, signed so that higher is better."""
    v = getattr(result, objective)
    return v if OBJECTIVES[objective] else -v


def tune(base: Base, objective: str = "tokens_per_s", budget: int | None = 60,
         other_layouts: bool = False, keep: int | None = 3, headroom: float = 0.0,
         space: Space = Space()) -> TuneResult:
    """`budget`: the most configurations to evaluate; None evaluates every candidate the bounds
    leave, then refines the knobs of the best three as always. `other_layouts` searches only
    the tensor x pipeline layouts other than the scenario's own (the doctor's layout fixes:
    its own layout is what its other fixes change), its own configuration not simulated first.
    `keep`: how many of the best results (rows of `distinct_key`) the step-time bound must leave
    exact (at least 3, the ones refined; None: no point is skipped by it); `headroom`: the margin
    (`--headroom`) a result must fit with to count there. `space`: what may be proposed (the
    framework's layouts, the user's --fix pins; see [Note: framework search space])."""
    return Tuner(base, objective, budget, keep, headroom, space).run(other_layouts)


class Tuner:
    """One search (see `tune`), in four parts: `candidates` (the structural points the memory
    lower bound leaves), `bound` (the step-time lower bound that skips a point that cannot place
    among the best), `evaluate` (a point simulated once, or sharing the simulation of a point of
    the same structure), `refine` (the knobs of the best three). `run` spends the budget on the
    candidates layout by layout, then on the rest, then refines."""

    def __init__(self, base: Base, objective: str, budget: int | None, keep: int | None, headroom: float,
                 space: Space):
        self.t0 = time.perf_counter()
        self.base, self.objective, self.headroom, self.space = base, objective, headroom, space
        self.exhaustive = budget is None
        self.budget = sys.maxsize if budget is None else budget
        self.keep = None if keep is None else max(keep, 3)
        self.seen: dict = {}    # point key -> (point, Outcome), in evaluation order
        self.pruned: list[TunePoint] = []
        self.rejected = 0
        self.sc = sc = base.scenario(())
        self.by_structure: dict = {}   # structural_key -> Outcome of the first point simulated with it
        # the objective over a constant shared by every candidate: work / step time, with work the
        # model FLOPs per GPU for MFU, 1 for tokens/s and the step time (see `summarize`)
        self.mfu = objective == "mfu"
        # of the fitting results that rank apart (`distinct_key`), ascending (negated: the best first)
        self.best_rates: list[float] = []
        self.ranked_apart: set = set()
        self.bounded: dict = {}   # point key -> (point, its step-time lower bound in s), skipped
        self.pricer = ComputePricer(sc.cluster, sc.precision, sc.matmul_dtype == "tf32")
        self.stage_s: dict = {}   # (workload id, checkpointing, pipeline, ZeRO-3) -> each stage's compute per micro-step
        self.layer_s: dict = {}   # (workload id, checkpointing) -> (its layers, each one's compute per micro-step)
        self.interleaved = sc.parallelism.virtual_stages > 1   # the candidates' pipelines keep the scenario's
        self.workloads: dict = {}    # candidates share workloads: their tensor-parallel shape, ZeRO-3's linear and
        # the micro-batch decide them (not the pipeline: a stage is a slice of one), checkpointing too where
        # LoRA or frozen weights make the workload depend on it
        self.by_mode = sc.training.lora is not None or bool(sc.training.frozen)
        self.fitted: list[Layout] = []

    def workload(self, c: TunePoint, micro_batch: int = 1):
        key = (c.layout.tensor, c.layout.sequence_parallel, c.layout.expert, c.layout.sequence, c.stage == 3,
               c.checkpointing if self.by_mode else None, micro_batch)
        if key not in self.workloads:
            self.workloads[key] = point_workload(self.sc, c, micro_batch)
        return self.workloads[key]

    # -- bound ---------------------------------------------------------------------------------

    def step_bound_s(self, c: TunePoint) -> float:
        """see [Note: step-time lower bound]"""
        sc = self.sc
        wl = self.workload(c, c.micro_batch)
        key = (id(wl), c.checkpointing, c.layout.pipeline, c.stage == 3)   # `workloads` keeps each alive
        if key not in self.stage_s:
            tensor = tensor_collectives(c.layout, wl, sc.precision)
            if key[:2] not in self.layer_s:
                self.layer_s[key[:2]] = layer_compute_s(wl, c.checkpointing, self.pricer, tensor)
            host_s = zero3_host_s(sc, wl, c.checkpointing, c.stage, c.layout.pipeline,
                                  sc.cluster.world_size // c.layout.model_parallel, tensor)
            layers, layer_s = self.layer_s[key[:2]]
            self.stage_s[key] = stage_compute_s(layers, layer_s, c.layout.pipeline,
                                                sc.parallelism.partition_method, host_s)
        return step_time_lower_bound_s(self.stage_s[key], c.gas, c.layout.pipeline > 1 and self.interleaved)

    def best_rate(self, c: TunePoint) -> float:
        """The most `rate` the point can reach: its work over its step-time lower bound."""
        bound_s = self.step_bound_s(c)
        if bound_s <= 0.0:
            return float("inf")
        if not self.mfu:
            return 1.0 / bound_s
        return model_flops_per_gpu(self.workload(c, c.micro_batch).model_flops, c.gas, c.layout.pipeline) / bound_s

    def rate(self, r: Result) -> float:
        return (r.model_flops_per_gpu if self.mfu else 1.0) / r.step_time_s

    def cannot_place(self, c: TunePoint) -> bool:
        """The point's bound keeps it from beating the `keep`-th best fitting result (then it
        never will: that only improves); recorded as bounded."""
        if c.key() in self.seen:
            return False
        if c.key() in self.bounded:
            return True
        if self.keep is None or len(self.best_rates) < self.keep:
            return False
        if self.best_rate(c) > -self.best_rates[self.keep - 1]:
            return False
        self.bounded[c.key()] = (c, self.step_bound_s(c))
        return True

    # -- evaluate ------------------------------------------------------------------------------

    def evaluate(self, c: TunePoint) -> Result | None:
        if self.cannot_place(c):
            return None
        if c.key() not in self.seen:
            skey = structural_key(self.sc, c, self.workload(c))
            prior = self.by_structure.get(skey)
            out = self.base.run(c.variant) if prior is None else replace(prior, variant=c.variant, shared=True)
            self.by_structure.setdefault(skey, out)
            self.rejected += not out.ok
            self.seen[c.key()] = (c, out)
            # results that simulate alike rank as one row (`distinct_key`): counted once
            r = out.result
            if out.ok and r is not None and r.fits_with(self.headroom) and distinct_key(c, r) not in self.ranked_apart:
                self.ranked_apart.add(distinct_key(c, r))
                bisect.insort(self.best_rates, -self.rate(r))
        return self.seen[c.key()][1].result

    def lookahead(self, points):
        """Prefetch (Base.prefetch) the next points this search may simulate, one per worker."""
        todo = []
        room = self.base.workers if self.exhaustive else min(self.base.workers, self.budget - self.used())
        for c in points:
            if len(todo) >= room:
                break
            if (c.key() not in self.seen and structural_key(self.sc, c, self.workload(c)) not in self.by_structure
                    and not self.cannot_place(c)):
                todo.append(c.variant)
        self.base.prefetch(todo)

    def ranked(self):
        ok = [(c, out.result) for c, out in self.seen.values() if out.fits]
        return sorted(ok, key=lambda cr: -score(cr[1], self.objective))

    def used(self) -> int:
        """Points of the budget spent: a configuration refused as invalid costs no simulation."""
        return len(self.seen) - self.rejected

    def spent(self) -> bool:
        return not self.exhaustive and (self.used() >= self.budget
                                        or (self.used() >= max(1, self.budget // 2) and bool(self.fitted)))

    # -- candidates ----------------------------------------------------------------------------

    def candidates(self, other_layouts: bool) -> list[TunePoint]:
        """The structural candidates of the space whose memory lower bound fits (the rest in
        `pruned`); with `other_layouts` none of the scenario's own layout."""
        survivors = []
        terms: dict = {}    # (workload, checkpointing) -> workload_terms, once for the candidates sharing them
        cpu_checkpointing = self.sc.deepspeed.activation_checkpointing.cpu_checkpointing
        own = own_layout(self.sc)
        capacity = self.sc.cluster.hbm_capacity_bytes
        for c in structural_candidates(self.sc, self.space):
            if other_layouts and c.layout == own:
                continue
            wl = self.workload(c)
            if (id(wl), c.checkpointing) not in terms:
                terms[id(wl), c.checkpointing] = workload_terms(wl, c.checkpointing, cpu_checkpointing)
            if point_lower_bound(self.sc, c, wl, terms[id(wl), c.checkpointing]) > capacity:
                self.pruned.append(c)
            else:
                survivors.append(c)
        return survivors

    def structures(self, survivors: list[TunePoint]) -> None:
        """Half the budget on structures (if nothing fits, keep going until one does), layout by
        layout in `layouts` order: the scenario's own (up to a quarter of the budget), then a few
        tries each until one fits. A layout whose tensor size already fits with fewer stages is
        skipped: more stages add bubble and sends for memory it does not need (Narayanan et al.
        2021, takeaway #1), and a pipeline of many stages costs the most to simulate."""
        own = own_layout(self.sc)
        queues: dict[Layout, list] = {}
        for c in survivors:
            queues.setdefault(c.layout, []).append(c)

        def covered(layout, fits) -> bool:
            return any(f.tensor == layout.tensor and f.pipeline < layout.pipeline for f in fits)

        order = list(queues.items()) if not self.exhaustive else []
        for j, (layout, queue) in enumerate(order):
            if covered(layout, self.fitted):
                continue
            tries = queue[:max(1, self.budget // 4) if layout == own else 3]
            for c in tries:
                if self.spent():
                    break
                # what comes next if this try fits: the first try of each later layout it leaves uncovered
                self.lookahead(itertools.chain([c], (q[0] for later, q in order[j + 1:]
                                                     if not covered(later, self.fitted + [layout]))))
                r = self.evaluate(c)
                if r is not None and r.fits:
                    self.fitted.append(layout)
                    break

    def rest(self, survivors: list[TunePoint]) -> None:
        """The remaining budget on the points of the two best layouts (all of them when nothing
        fitted yet, or when exhaustive: best bound first, the first point the bound skips ending
        the search)."""
        best = {c.layout for c, _ in self.ranked()[:2]}

        def wanted(c: TunePoint) -> bool:
            return c.layout in best or not self.fitted or self.exhaustive

        for i, c in enumerate(survivors):
            if self.spent():
                break
            if self.exhaustive and c.key() not in self.seen and self.cannot_place(c):
                for x in survivors[i + 1:]:   # their bounds are no lower: skipped alike
                    self.cannot_place(x)
                break
            if wanted(c):
                self.lookahead(x for x in survivors[i:] if wanted(x))
                self.evaluate(c)
                if c.key() in self.seen and self.seen[c.key()][1].fits and c.layout not in self.fitted:
                    self.fitted.append(c.layout)

    # -- refine --------------------------------------------------------------------------------

    def refine(self) -> None:
        """The knobs (KNOBS, and KNOBS_STAGE3 at stage 3 with ZEROPP_KNOBS across nodes; not those
        the space pins) of the best three, one knob at a time, each value kept when it scores better."""
        for c, r in self.ranked()[:3]:
            best_c, best_r = c, r
            knobs = dict(KNOBS)
            if c.stage == 3:
                knobs.update(KNOBS_STAGE3)
                cl = self.sc.cluster
                if cl.nodes > 1 and cl.gpus_per_node > 1 and "params" not in c.offload and c.layout.tensor == 1:
                    # ZeRO++ hpZ over each node (see [Note: hpZ secondary partitions])
                    knobs["zero_hpz_partition_size"] = (1, cl.gpus_per_node)
                if cl.nodes > 1:   # ZeRO++'s quantized gathers and gradient reduction
                    knobs["zero_quantized_weights"] = (False, True)
                    if c.layout.tensor == 1:
                        knobs["zero_quantized_gradients"] = (False, True)
            knobs = {k: v for k, v in knobs.items() if k not in self.space.knobs}
            for name, values in knobs.items():
                for i in range(len(values)):
                    if self.used() >= self.budget:
                        break
                    trials = [TunePoint(best_c.stage, best_c.offload, best_c.micro_batch, best_c.gas,
                                        best_c.checkpointing, {**best_c.knobs, name: x}, best_c.layout, best_c.fixed)
                              for x in values[i:]]
                    self.lookahead(trials)
                    trial = trials[0]
                    r = self.evaluate(trial)
                    if r is not None and r.fits and score(r, self.objective) > score(best_r, self.objective):
                        best_c, best_r = trial, r

    def run(self, other_layouts: bool = False) -> TuneResult:
        survivors = self.candidates(other_layouts)
        # the scenario's own configuration is simulated first, whatever the budget: the ranking
        # always has what the user runs to compare with (it does not end its layout's tries: those
        # go cheapest-looking first as below); left out by `space` when outside it, and with
        # other_layouts (no survivor has its key)
        mine = own_point(self.sc)
        for c in survivors:
            if c.key() == mine.key():
                self.evaluate(c)
                break
        if self.exhaustive:   # best-first: the first point the bound skips ends the search
            survivors.sort(key=lambda c: -self.best_rate(c))
        self.structures(survivors)
        self.rest(survivors)
        self.refine()
        return TuneResult(self.ranked(), list(self.seen.values()), self.pruned, list(self.bounded.values()),
                          self.rejected, time.perf_counter() - self.t0, self.objective)
