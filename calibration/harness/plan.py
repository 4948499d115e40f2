"""What a calibration run measures: a plain, torch-free description of every benchmark.

The launcher, the ranks and the tests all derive the same item list from a Plan, so rank 0
can show an honest ETA and a failure can name the benchmark a rank was in.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from zsim.specs.hardware import REDUCED_16BIT, REDUCING_COLLECTIVES
from zsim.specs.model import ModelSpec
from zsim.schedule.passes import linear_gemms
from zsim.workload.module import Module
from zsim.workload.transformer import build_workload

KB = 1024
# all_gather_coalesced: a batch of async all-gathers waited together, as DeepSpeed re-gathers
# ZeRO-3's persistent parameters after the step (zsim's Comm.coalesced)
COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all",
                  "all_gather_coalesced")


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer as zsim's workload models it (GPT-style, fused QKV, 4h MLP)."""
    hidden: int
    heads: int
    seq_len: int
    micro_batch: int

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def label(self) -> str:
        return f"h{self.hidden}-a{self.heads}-s{self.seq_len}-b{self.micro_batch}"

    @staticmethod
    def of(record: dict) -> "LayerShape":
        """The shape a layer record (or any mapping with these keys) was measured at."""
        return LayerShape(record["hidden"], record["heads"], record["seq_len"], record["micro_batch"])

    def model_spec(self) -> ModelSpec:
        """A one-block model of this shape with zsim's default (GPT-2 style) architecture: the
        worker times calibration's GPT built from it, the fit predicts zsim's workload of it."""
        return ModelSpec(layers=1, hidden=self.hidden, heads=self.heads, vocab=128, seq_len=self.seq_len)

    def block_modules(self, dtype: str) -> tuple[Module, ...]:
        """zsim's workload modules of the block, as the simulator costs them."""
        wl = build_workload(self.model_spec(), self.micro_batch, self.seq_len, dtype, flash_attention=True,
                            dropout=False)
        return wl.layer_modules(0)


@dataclass(frozen=True)
class Plan:
    mode: str                        # quick | full
    max_size_bytes: int
    size_step: int                   # sizes grow by this factor from 1 KB
    coll_dtypes: tuple[str, ...]
    compute_dtypes: tuple[str, ...]
    profile_dtype: str               # the dtype whose compute figures are the profile's top-level gpu fields
    layers: tuple[LayerShape, ...]
    warmup: int
    reps: int
    min_rep_time_s: float            # a repetition loops the op until it lasts at least this long
    coll_calls_per_rep: int          # a collective repetition: this many calls, each after a compute phase
    memcpy_bytes: int
    io_path: str
    io_bytes: int
    adam_params: int
    timeout_s: float
    # collectives run in this many passes over all sizes, each with 1/passes of the
    # repetitions: a size's calls then meet the machine at moments minutes apart (a 1 MiB gloo
    # all-reduce's in-step mean moved between 2 and 5 ms from one minute to the next here)
    coll_passes: int = 1
    ops: tuple[str, ...] = COLLECTIVE_OPS
    # `--dtype fp32,bf16`: each dtype gets its own compute fit and layer closure, written to the
    # profile's gpu.by_dtype (the first is profile_dtype). Empty: profile_dtype alone, no by_dtype
    fit_dtypes: tuple[str, ...] = ()
    # `--hooks`: a quick run also times DeepSpeed's ZeRO hooks (zero3_hooks; a full run always does)
    hooks: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def fitted_dtypes(self) -> tuple[str, ...]:
        """The dtypes whose compute figures the fit writes (the optimizer step is measured in each)."""
        return self.fit_dtypes or (self.profile_dtype,)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "Plan":
        d = json.loads(text)
        d["layers"] = tuple(LayerShape(**x) for x in d["layers"])
        for k in ("coll_dtypes", "compute_dtypes", "ops", "fit_dtypes"):
            if k in d:   # a plan.json written before fit_dtypes existed has no such key
                d[k] = tuple(d[k])
        return Plan(**d)


def message_sizes(max_size_bytes: int, step: int) -> list[int]:
    """Log-spaced sizes from 1 KB to max_size_bytes inclusive (max appended if off-grid)."""
    sizes, s = [], KB
    while s <= max_size_bytes:
        sizes.append(s)
        s *= step
    if sizes[-1] != max_size_bytes and max_size_bytes > KB:
        sizes.append(max_size_bytes)
    return sizes


def default_plan(mode: str, *, max_size_bytes: int | None = None, io_path: str = "",
                 layers: tuple[LayerShape, ...] | None = None, timeout_s: float | None = None,
                 dtypes: tuple[str, ...] = ("bf16",)) -> Plan:
    """`dtypes`: the training precisions the compute figures are fitted for, the first one the
    profile's top-level fields; two or more also give the profile a gpu.by_dtype entry each."""
    profile_dtype, fit_dtypes = dtypes[0], (tuple(dtypes) if len(dtypes) > 1 else ())
    if mode == "quick":
        # About 1.5 minutes on two cores (98 s measured, 2 gloo ranks; 128 s with deepspeed installed
        # and the machine busy): one small layer, sizes up to 1 MiB, fp32 collectives (the reducing
        # ones again in each 16-bit dtype asked for); the compute benchmarks once per dtype asked for.
        return Plan(mode=mode, max_size_bytes=max_size_bytes or 1 << 20, size_step=4,
                    coll_dtypes=tuple(dict.fromkeys(("fp32", *(d for d in dtypes if d in REDUCED_16BIT)))),
                    compute_dtypes=tuple(dtypes), profile_dtype=profile_dtype,
                    fit_dtypes=fit_dtypes,
                    layers=layers or (LayerShape(256, 4, 128, 1),), warmup=1, reps=5, min_rep_time_s=0.002,
                    coll_calls_per_rep=4, memcpy_bytes=16 << 20, io_path=io_path, io_bytes=8 << 20, adam_params=1 << 20,
                    timeout_s=timeout_s or 60.0)
    if mode == "full":
        return Plan(mode=mode, max_size_bytes=max_size_bytes or 64 << 20, size_step=2,
                    coll_dtypes=("fp32", "bf16"), compute_dtypes=tuple(dict.fromkeys((*dtypes, "fp32", "bf16"))),
                    profile_dtype=profile_dtype, fit_dtypes=fit_dtypes,
                    layers=layers or (LayerShape(256, 4, 128, 2), LayerShape(512, 8, 256, 2),
                                      LayerShape(768, 12, 512, 1), LayerShape(1024, 16, 256, 2)),
                    warmup=3, reps=15, min_rep_time_s=0.01, coll_calls_per_rep=8, memcpy_bytes=256 << 20, io_path=io_path,
                    io_bytes=256 << 20, adam_params=16 << 20, timeout_s=timeout_s or 180.0, coll_passes=3)
    raise ValueError(mode)


def layer_gemms(shape: LayerShape) -> list[tuple[str, str, int, int, int]]:
    """(module, pass, m, n, k) of the GEMMs of one layer, in the layouts autograd runs them:
    zsim.schedule.passes.linear_gemms of the block's workload modules, fwd (t, out, in);
    dgrad (t, in, out); wgrad (out, in, t)."""
    out = []
    for mod in shape.block_modules("bf16"):
        if mod.gemm is not None:
            (fwd,), (dgrad, wgrad) = linear_gemms(mod, False), linear_gemms(mod, True)
            name = mod.name.rsplit(".", 1)[1]
            out += [(name, "fwd", *fwd), (name, "dgrad", *dgrad), (name, "wgrad", *wgrad)]
    return out


def stats(times_s: list[float]) -> dict:
    """Median, min, p10, p90 and relative spread of repetition times (all of them kept)."""
    xs = sorted(times_s)
    q = lambda p: xs[min(len(xs) - 1, max(0, round(p * (len(xs) - 1))))]
    return {"time_s": q(0.5), "time_s_min": xs[0], "time_s_p10": q(0.1), "time_s_p90": q(0.9),
            "spread": (q(0.9) - q(0.1)) / q(0.5) if q(0.5) > 0 else 0.0, "times_s": xs}


def items(plan: Plan, world_size: int, nodes: int) -> list[str]:
    """Names of every benchmark, in run order (each becomes one or more records)."""
    names = ["overhead", "memcpy", "fresh_alloc"]
    for p in range(plan.coll_passes):
        for grp in groups(world_size, nodes):
            for dt in plan.coll_dtypes:
                for op in plan.ops:
                    if dt != plan.coll_dtypes[0] and op not in REDUCING_COLLECTIVES:
                        continue   # a copy moves bytes alike in any dtype; the sums are timed again in 16-bit
                    for s in message_sizes(plan.max_size_bytes, plan.size_step):
                        names.append(f"collective/{op}/{grp}/{dt}/{s}" + (f"/pass{p + 1}" if plan.coll_passes > 1 else ""))
    for dt in plan.compute_dtypes:
        for L in plan.layers:
            names.append(f"gemm/{dt}/{L.label}")
            names.append(f"gemm_decode/{dt}/{L.label}")
            names.append(f"attention/{dt}/{L.label}")
            names.append(f"membound/{dt}/{L.label}")
            names.append(f"layer/{dt}/{L.label}")
    names += ["adam", "optimizer_step", "grad_accumulate", "io", "interference", "rank_views"]
    if world_size >= 2:
        names.append("collective_memory")
    if plan.mode == "full" or plan.hooks:
        names.append("zero3_hooks")
    return names


def groups(world_size: int, nodes: int) -> list[str]:
    """The process groups that matter: the world, one node, one rank per node (none for one
    rank: a collective without a peer measures nothing)."""
    per_node = world_size // max(nodes, 1)
    if world_size < 2:
        return []
    out = ["world"]
    if nodes > 1 and per_node > 1:
        out.append("intra_node")
    if nodes > 1:
        out.append("inter_node")
    return out


def tier_of_group(group: str, nodes: int) -> str:
    if group == "world":
        return "intra_node" if nodes == 1 else "world"
    return group


def estimated_cost(name: str) -> float:
    """Relative weight of an item for the ETA (collectives scale with their size)."""
    parts = name.split("/")
    if parts[0] == "collective":
        size = max(int(parts[4]), 1024)   # sizes up to 1 MiB run 3x the repetitions (worker)
        passes = 3.0 if len(parts) > 5 else 1.0
        return ((0.9 if size <= 1 << 20 else 0.3) + math.log2(size / 1024) * 0.15) / passes
    return {"layer": 4.0, "gemm": 4.0, "attention": 1.5, "membound": 1.5, "io": 3.0,
            "interference": 3.0, "adam": 2.0, "optimizer_step": 1.5,
            "zero3_hooks": 4.0}.get(parts[0], 1.0)
