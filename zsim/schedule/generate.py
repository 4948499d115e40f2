"""Generation's schedule: one generate() call, the prefill and then one forward per new token,
each over the KV cache the earlier ones filled. See [Note: generation].

[Note: generation]
transformers 5's generate (GenerationMixin._sample) runs one forward per new token: the prefill
over the prompt (logits for the last position only), then a decode step per token after the
first, feeding one token per sequence. Each step ends on the host: the stopping criteria's
`this_peer_finished` is read back (`.item()`-like sync), so a step starts on an idle device and
its time is its own forward's. zsim schedules each forward as the training passes schedule one
(its modules' FORWARD ops on the compute stream, micro_step = the forward's index: 0 the prefill,
k decode step k), with what generation adds:
- the KV cache: under the model's HF code (DynamicCache, cache_utils.py DynamicLayer.update) each
  attention layer's keys and values are concatenated with the new token's (torch.cat: a new
  tensor, the old one freed after it), so during a layer's core the old and the new cache are
  both alive; DeepSpeed-Inference's injected kernels (`kernel_inject`) write into a workspace
  preallocated for max_out_tokens (a static buffer);
- no_grad: nothing is kept for a backward; the forward's hidden states (the residual stream and
  the normed copy a block reads) live through it, and each linear's output while it runs;
- tensor parallelism (init_inference's tp_size, AutoTP, the injected kernels): the row-parallel
  linears' outputs all-reduced over the replica's GPUs (Megatron's g, the plan
  zsim/schedule/tensor.py holds); the token embedding whole on every GPU; lm_head whole under the
  injected kernels, else AutoTP's LmHeadLinearAllreduce (its logits all-reduced:
  workload.generation.deepspeed_tensor_parallel);
- ZeRO-3 (ZeRO-Inference: deepspeed.initialize with stage 3 and no optimizer, then
  model.generate): every forward is a step of the engine's parameter coordinator, whose trace is
  that forward alone, as a preference run's reference engine is (see [Note: a reference engine
  under ZeRO-3]): every module's parameters are gathered in every forward (prefetched along the
  trace, released after use), with offload_param first copied from host memory or NVMe. The first
  forward (the prefill) records the trace: nothing is prefetched and each module's parameters go
  right after it (reset_step's RECORD pass). From the first decode step the trace is complete, so
  the parameters under stage3_param_persistence_threshold are not released
  (__params_to_release skips ds_persist): gathered in that step, kept from the next on (an engine
  with a ZeRO-3 optimizer, the RLHF actor's, keeps them gathered from its step on);
- DeepSpeed-Inference's injected kernels preallocate one workspace for max_out_tokens (inference_
  context.h GenWorkSpace: every layer's keys and values over all heads, the activations and the
  scores), held for the whole call.
Not modelled: generate's synced_gpus (DeepSpeed-Chat passes it under ZeRO-3: an all-reduce of a flag
each step), a sliding-window layer's prefill cache (kept whole until the first decode step).
Decode steps differ only in the context their attention reads, and every op's price is affine in
it (the cores' traffic and FLOPs; nothing else depends on it), so a long generation simulates a
sample of its decode steps (the first and the last among them) and interpolates the others'
times linearly between their neighbours (zsim/generation.py); the peak is the last step's, which
is simulated.
"""
from __future__ import annotations

from dataclasses import replace

from zsim.schedule import offload
from zsim.schedule.builder import Builder
from zsim.schedule.context import StepContext
from zsim.schedule.ir import Alloc, Buffer, Category, OpKind, Phase, Schedule, Stream, Tag
from zsim.schedule.param_fetch import ParamCoordinator
from zsim.schedule.partition import persistent_params, shard_numel
from zsim.schedule.passes import forward_work
from zsim.schedule.payloads import ModulePass
from zsim.schedule.tensor import TensorCollectives
from zsim.specs.generation import generation_kernels
from zsim.specs.parallelism import ParallelismSpec
from zsim.specs.scenario import Scenario
from zsim.workload.generation import (KvShape, decode_core, injected_workspace_bytes, kv_cache_bytes, kv_shapes,
                                     prefill_core)
from zsim.workload.module import DTYPE_BYTES, Module, ModuleKind, Workload

# decode steps simulated one by one up to this many; a longer generation simulates SAMPLED_STEPS
# of them, evenly spaced from the first to the last (see [Note: generation])
ALL_STEPS_UP_TO = 64
SAMPLED_STEPS = 33


def simulated_forwards(new_tokens: int) -> tuple[int, ...]:
    """The forwards the schedule holds: the prefill (0) and the decode steps simulated (1 to
    new_tokens - 1, all or an even sample with both ends)."""
    steps = new_tokens - 1
    if steps <= ALL_STEPS_UP_TO:
        return tuple(range(new_tokens))
    picked = sorted({1 + round(i * (steps - 1) / (SAMPLED_STEPS - 1)) for i in range(SAMPLED_STEPS)})
    return (0, *picked)


class _EngineFetch:
    """ZeRO-3's parameter coordinator over one generation forward: its trace is the forward alone
    (param_fetch.module_visits with every module in the engine), as a reference engine's is."""

    def __init__(self, ctx: StepContext, traced: bool, persistent: tuple[int, ...]):
        names = frozenset(m.name for m in ctx.wl.modules if m.params)
        self.fetch = ParamCoordinator(ctx, persistent, names, traced=traced)
        self.current: int | None = None

    def pre(self, module: Module, micro: int) -> list[int]:
        f = self.fetch
        # the container visits before the module's own (their hooks run on the host)
        f.visit_containers(module.name, micro, Phase.FORWARD)
        self.current = None
        if f.step_id < len(f.visits) and f.visits[f.step_id].module == module.name:
            self.current = f.step_id
            return f.visit(f.visits[f.step_id], micro, Phase.FORWARD)
        return []

    def post(self, micro: int, op: int):
        f = self.fetch
        f.module_ran(op)
        if self.current is not None:
            f.release(self.current, micro, op)

    def end(self, micro: int, op: int):
        self.fetch.release_all(micro, op)


def _output_bytes(module: Module, a: int) -> float:
    """A linear's output, alive while it runs (the transients zsim counts under no_grad)."""
    if module.gemm is None:
        return 0.0
    tokens, n_out, _ = module.gemm
    return float(tokens * n_out * a)


class _Generation:
    def __init__(self, sc: Scenario, prefill: Workload, decode: Workload, trained_engine: bool):
        gen = sc.inference
        assert gen is not None
        self.sc, self.gen, self.prefill, self.decode = sc, gen, prefill, decode
        self.a = DTYPE_BYTES[sc.precision]
        self.zero3 = sc.zero.stage == 3
        # ZeRO-3 partitions over every rank (no tensor parallelism beside it: config/generation.py)
        dp = sc.cluster.world_size if self.zero3 else 1
        self.ctx = StepContext(sc=sc, wl=decode, b=Builder(), param_bytes=self.a, dp_size=dp, reduce_bytes=self.a,
                               pass_templates=None)
        par = ParallelismSpec(tensor=gen.tensor_parallel)
        self.tp = {id(prefill): TensorCollectives(par, prefill, sc.precision),
                   id(decode): TensorCollectives(par, decode, sc.precision)}
        self.kv = kv_shapes(sc.model, gen.tensor_parallel)
        self.injected = gen.kernel_inject
        self.eager = generation_kernels(gen, sc.training)[0] == "eager"
        self.passes: dict[tuple, ModulePass] = {}
        # see [Note: generation]: the parameters under the persistence threshold stay gathered once the
        # trace is complete (forward 2 on; an engine with an optimizer: always, its step gathers them)
        numels = decode.stored_numels(self.a)
        z = sc.zero
        self.persistent = persistent_params(numels, z.param_persistence_threshold, z.model_persistence_threshold) \
            if self.zero3 else ()
        self.persistent_from = 0 if trained_engine else 2

    def build(self, forwards: tuple[int, ...]) -> Schedule:
        ctx, b = self.ctx, self.ctx.b
        numels = self.decode.stored_numels(self.a)
        shard = shard_numel(numels, ctx.dp_size) if self.zero3 else sum(numels)
        states = offload.place_states(ctx, {Category.PARAMETERS: float(shard * self.a)}, shard)
        b.static_alloc(Category.PARAMETERS, states[Category.PARAMETERS])
        if self.persistent and (ctx.dp_size > 1 or ctx.params_offloaded):
            # gathered whole once the trace is complete, and kept (held from the start: they are small)
            b.static_alloc(Category.PERSISTENT, sum(numels[p] for p in self.persistent) * self.a)
        if self.injected:   # the injected kernels' workspace, for max_out_tokens
            cache, rest = injected_workspace_bytes(self.sc.model, self.gen.batch_size, self.gen.max_out_tokens,
                                                   self.gen.tensor_parallel, self.a)
            b.static_alloc(Category.KV_CACHE, cache)
            b.static_alloc(Category.INFERENCE_WORKSPACE, rest)
        last: int | None = None
        previous: int | None = None
        for f in forwards:
            wl = self.prefill if f == 0 else self.decode
            last = self._forward(wl, f, previous, last, final=f == forwards[-1])
            previous = f
        return b.build(3 if self.zero3 else self.sc.zero.stage, self.sc.cluster.world_size, offload.host_settings(ctx),
                       tensor=self.gen.tensor_parallel)

    def _core(self, module: Module, forward: int) -> Module:
        shape = self.kv[module.layer]
        copies = not self.injected
        if forward == 0:
            return prefill_core(module, shape, self.gen.batch_size, self.gen.prompt_len, self.a, copies)
        m = self.sc.model
        repeat = m.heads // m.n_kv_heads if self.eager and m.mla is None else 1
        return decode_core(module, shape, self.gen.batch_size, self.gen.context(forward), self.a, copies, repeat)

    def _pass(self, module: Module, forward: int) -> ModulePass:
        """The module's forward payload: one per module and context (a decode step's modules but
        the cores are the same every step, so the cost model prices each once)."""
        key = (id(module), forward if module.kind == ModuleKind.ATTENTION else (forward == 0))
        mp = self.passes.get(key)
        if mp is None:
            m = self._core(module, forward) if module.kind == ModuleKind.ATTENTION else module
            mp = self.passes[key] = ModulePass(module.name, forward_work(replace(m, no_grad=True)))
        if self.gen.cuda_graph and forward > 0:
            # a decode step replayed as one CUDA graph: no per-kernel launch (see [Note: generation])
            mp = ModulePass(mp.module, replace(mp.work, kernels=0))
        return mp

    def _forward(self, wl: Workload, f: int, previous: int | None, after: int | None, final: bool) -> int:
        ctx, b, gen, a = self.ctx, self.ctx.b, self.gen, self.a
        tp = self.tp[id(wl)]
        fetch = (_EngineFetch(ctx, f > 0, self.persistent if f >= self.persistent_from else ())
                 if self.zero3 and (ctx.dp_size > 1 or ctx.params_offloaded) else None)
        if fetch is not None:
            fetch.fetch.last_compute = after
        hidden = Tag(Buffer.HIDDEN, f)
        last = after
        first = True
        # a decode step after steps not simulated finds the cache they would have left: the
        # previous simulated step's, grown to f - 1's context as the step starts
        stale = previous is not None and previous != f - 1 and not self.injected
        for m in wl.modules:
            deps = fetch.pre(m, f) if fetch is not None else []
            last = tp.before(ctx, m, f, Phase.FORWARD, last)
            allocs = []
            grown: tuple[Tag, ...] = ()
            if first:
                allocs.append(Alloc(hidden, Category.ACTIVATIONS, 2.0 * wl.tokens * self.sc.model.hidden * a))
                if stale and previous is not None:
                    grown = tuple(Tag(Buffer.KV_CACHE, previous, layer) for layer in self.kv)
                    allocs += [Alloc(Tag(Buffer.KV_CACHE, f - 1, layer), Category.KV_CACHE,
                                     kv_cache_bytes(shape, gen.batch_size, gen.context(f - 1), a))
                               for layer, shape in self.kv.items()]
                    previous = f - 1
                first = False
            work = Tag(Buffer.WORKSPACE, f, m.name, Phase.FORWARD)
            transient = _output_bytes(m, a) + m.fwd_workspace_bytes
            if transient:
                allocs.append(Alloc(work, Category.LOGITS if m.name == "lm_head" else Category.ACTIVATIONS, transient))
            cache_free: tuple[Tag, ...] = ()
            if m.kind == ModuleKind.ATTENTION and not self.injected:
                shape: KvShape = self.kv[m.layer]
                size = kv_cache_bytes(shape, gen.batch_size, gen.context(f), a)
                allocs.append(Alloc(Tag(Buffer.KV_CACHE, f, m.layer), Category.KV_CACHE, size))
                if previous is not None:
                    cache_free = (Tag(Buffer.KV_CACHE, previous, m.layer),)
            op = b.add(OpKind.FORWARD, Stream.COMPUTE, Phase.FORWARD, f, self._pass(m, f), deps + [last], tuple(allocs))
            if grown:
                b.add_free_before(op, *grown)
            if transient:
                b.add_free(op, work)
            if cache_free:
                b.add_free(op, *cache_free)
            if fetch is not None:
                fetch.post(f, op)
            last = tp.after(ctx, m, f, Phase.FORWARD, op)
        assert last is not None
        if fetch is not None:
            fetch.end(f, last)
        b.add_free(last, hidden)
        if final and not self.injected:    # generate returns: its cache goes
            b.add_free(last, *(Tag(Buffer.KV_CACHE, f, layer) for layer in self.kv))
        return last


def build_generation(sc: Scenario, prefill: Workload, decode: Workload, forwards: tuple[int, ...],
                     trained_engine: bool = False) -> Schedule:
    """The schedule of `forwards` (simulated_forwards) of the scenario's generate() call;
    `trained_engine`: the engine has a ZeRO-3 optimizer, whose step keeps the persistent
    parameters gathered."""
    return _Generation(sc, prefill, decode, trained_engine).build(forwards)
