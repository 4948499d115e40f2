"""The terminal report (rich)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from zsim.report.format import fmt_bytes, fmt_setting, fmt_time
from zsim.result import ZERO3_RANK_LOOPS, Result, row_fits
from zsim.units import GiB


# Piped output (a file, `| less`) is not cut at 80 columns: rich's default for a non-terminal.
PIPED_WIDTH = 400


def make_console(width: int | None = None) -> Console:
    """The table console: `--width` when given, else the terminal's, else PIPED_WIDTH."""
    import sys
    if width is None and not sys.stdout.isatty():
        width = PIPED_WIDTH
    return Console(width=width)


def _trainable(r: Result) -> str:
    ref = "" if r.reference_params is None else f" + a {r.reference_params / 1e9:.2f} B reference copy"
    if r.trainable_params is None:
        return ref
    return f" ({r.trainable_params / 1e6:.2f} M trainable, {100 * r.trainable_params / r.n_params:.2f}%){ref}"


def tensor_parallel_line(tp, nodes_shown: int = 4) -> str:
    """The layout and the rank map of a tensor-parallel run, node by node (the first few)."""
    by_node: dict[int, list[dict]] = {}
    for entry in tp.rank_map:
        by_node.setdefault(entry["node"], []).append(entry)
    shown = []
    for node in sorted(by_node)[:nodes_shown]:
        ranks = by_node[node]
        stages = sorted({e["stage"] for e in ranks})
        dps = sorted({e["dp_rank"] for e in ranks})
        shown.append(f"node {node}: ranks {ranks[0]['rank']}-{ranks[-1]['rank']} = stage "
                     f"{_span(stages)}, dp {_span(dps)}, tp 0-{tp.tensor - 1}")
    more = f"; ... {len(by_node) - nodes_shown} more nodes" if len(by_node) > nodes_shown else ""
    sp = " + sequence parallel" if tp.sequence_parallel else ""
    return (f"layout: tensor parallel {tp.tensor}{sp} x data parallel {tp.data_parallel} x pipeline {tp.pipeline} "
            f"(rank = (stage x {tp.data_parallel} + dp) x {tp.tensor} + tp; {'; '.join(shown)}{more})")


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _params(r: Result) -> str:
    """The model's parameters; under tensor parallelism the whole model's and each rank's slice."""
    tp = r.tensor_parallel
    if tp is None or not tp.model_params:
        return f"{r.n_params / 1e9:.2f} B params"
    return (f"{tp.model_params / 1e9:.2f} B params ({r.n_params / 1e9:.2f} B in each of the {tp.tensor} "
            "tensor-parallel slices)")


def _speed_table() -> Table:
    perf = Table(title="Speed", show_header=False)
    perf.add_column("metric")
    perf.add_column("value", justify="right")
    return perf


def memory_table(mem) -> Table:
    """The peak's breakdown per GPU, with the verdict."""
    verdict = "[green]fits[/green]" if mem.fits else "[bold red]OOM[/bold red]"
    mt = Table(title=f"Peak memory per GPU: {fmt_bytes(mem.peak_bytes)} of {fmt_bytes(mem.capacity_bytes)} -> {verdict}")
    mt.add_column("component")
    mt.add_column("at peak", justify="right")
    mt.add_column("share", justify="right")
    for name, b in sorted(mem.breakdown.items(), key=lambda kv: -kv[1]):
        mt.add_row(name, fmt_bytes(b), f"{100 * b / mem.peak_bytes:.1f}%")
    return mt


def print_host_memory(console: Console, host) -> None:
    """The node's host memory, when the run holds any there, and a load-time OOM."""
    if host.load_bytes_per_node > host.capacity_bytes:
        console.print(f"[bold red]host OOM while loading the model: {fmt_bytes(host.load_bytes_per_node)} per node "
                      f"of {fmt_bytes(host.capacity_bytes)} (every rank materialises it; ZeRO-3's zero.Init "
                      "partitions it)[/bold red]")
    if host.bytes_per_node > 0:
        hv = "[green]fits[/green]" if host.fits else "[bold red]host OOM[/bold red]"
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in host.breakdown.items())
        console.print(f"Host memory per node: {fmt_bytes(host.bytes_per_node)} of {fmt_bytes(host.capacity_bytes)} "
                      f"-> {hv} ({parts})")


def render_generation(g, console: Console | None = None):
    """The table of a generate() call (zsim/result/generation.py)."""
    from zsim.result.generation import BOUNDS
    console = console or make_console()
    console.print(f"[bold]{g.scenario}[/bold]: generation on {g.gpus} GPU{'s' if g.gpus != 1 else ''} "
                  f"({g.replicas} replica{'s' if g.replicas != 1 else ''} of {g.tensor_parallel}), {g.engine}; "
                  f"batch {g.batch_size} x (prompt {g.prompt_len} + {g.new_tokens} new tokens) per replica")
    console.print(f"implementation: {g.implementation}")
    perf = _speed_table()
    perf.add_row("prefill (time to first token)", fmt_time(g.prefill_time_s))
    perf.add_row("decode step, first / last", f"{fmt_time(g.decode_step_first_s)} / {fmt_time(g.decode_step_last_s)}")
    perf.add_row(f"decode ({g.decode_steps} steps, {g.decode_steps_simulated} simulated)", fmt_time(g.decode_time_s))
    perf.add_row("generate() call", fmt_time(g.total_time_s))
    perf.add_row("tokens/s (generated, all replicas)", f"{g.tokens_per_s:,.1f}")
    perf.add_row("tokens/s during decode", f"{g.decode_tokens_per_s:,.1f}")
    console.print(perf)
    if g.decode_steps:
        busy = ", ".join(f"{k} {fmt_time(v)}" for k, v in sorted(g.bound_busy_s.items(), key=lambda kv: -kv[1]) if v)
        console.print(f"decode bound: {BOUNDS[g.bound]} (busy in the last step: {busy})")
    console.print(memory_table(g.memory))
    console.print(f"KV cache per GPU at the end: {fmt_bytes(g.kv_cache_bytes)}")
    print_host_memory(console, g.memory.host)


def render_rlhf(r, console: Console | None = None):
    """The table of a PPO iteration (zsim/result/rlhf.py)."""
    console = console or make_console()
    console.print(f"[bold]{r.scenario}[/bold]: DeepSpeed-Chat step 3 (PPO) on {r.gpus} GPU{'s' if r.gpus != 1 else ''}; "
                  f"actor {r.actor_params / 1e9:.2f} B params, critic {r.critic_params / 1e9:.2f} B; per GPU "
                  f"{r.generation_batches} x {r.generation_batch_size} prompts of {r.prompt_len} tokens, "
                  f"{r.answer_len} generated, {r.ppo_epochs} PPO epoch{'s' if r.ppo_epochs != 1 else ''} of "
                  f"micro-batch {r.training_batch_size}; hybrid engine {'on' if r.hybrid_engine else 'off'}")
    t = Table(title=f"One PPO iteration: {fmt_time(r.iteration_time_s)}")
    for col, right in (("phase", False), ("engine", False), ("runs", True), ("each", True), ("total", True),
                       ("share", True), ("peak per GPU", True)):
        t.add_column(col, justify="right" if right else "left")
    for p in r.phases:
        verdict = "" if p.fits else " [bold red]OOM[/bold red]"
        t.add_row(p.name, p.engine, f"{p.runs:g}", fmt_time(p.time_s), fmt_time(p.total_s),
                  f"{100 * p.total_s / r.iteration_time_s:.1f}%", fmt_bytes(p.peak_bytes) + verdict)
    console.print(t)
    console.print(f"generation: {r.generated_tokens_per_s:,.0f} tokens/s (all GPUs), {100 * r.generation_share:.1f}% "
                  f"of the iteration; {r.samples_per_s:,.2f} experiences/s end to end")
    verdict = "[green]fits[/green]" if r.fits else "[bold red]does not fit[/bold red]"
    held = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r.resident_bytes.items())
    console.print(f"peak per GPU {fmt_bytes(r.peak_bytes)} of {fmt_bytes(r.capacity_bytes)} -> {verdict}; held "
                  f"through the iteration: {held}")
    if r.host_bytes_per_node:
        console.print(f"host memory per node: {fmt_bytes(r.host_bytes_per_node)} of {fmt_bytes(r.host_capacity_bytes)}")
    if r.pipeline:
        pt = Table(title=f"DeepSpeed-Chat's pipeline, one epoch each: {fmt_time(r.pipeline_time_s)}")
        for col, right in (("step", False), ("samples", True), ("steps", True), ("each", True), ("total", True),
                           ("peak per GPU", True)):
            pt.add_column(col, justify="right" if right else "left")
        for s in r.pipeline:
            pt.add_row(s.name, f"{s.samples:,}", f"{s.steps:,.1f}", fmt_time(s.step_time_s), fmt_time(s.total_s),
                       fmt_bytes(s.peak_bytes) + ("" if s.fits else " [bold red]OOM[/bold red]"))
        console.print(pt)
    for s in r.suggestions:
        console.print(f"doctor: {s}")


def render(r: Result, console: Console | None = None):
    console = console or make_console()
    head = (f"[bold]{r.scenario}[/bold]: ZeRO stage {r.stage}, {r.world_size} GPU{'s' if r.world_size != 1 else ''} "
            f"({r.nodes} x {r.gpus_per_node} {r.hardware_profile}), {r.precision}, "
            f"{_params(r)}{_trainable(r)}, micro-batch {r.micro_batch_size} x GAS "
            f"{r.gradient_accumulation_steps} -> global batch {r.global_batch_size} x {r.seq_len} tokens")
    console.print(head)
    console.print(r.implementation)
    if r.moe is not None:
        m = r.moe
        console.print(f"MoE: {m.experts} experts, top-{m.top_k}, expert parallel {m.expert_parallel_size}: "
                      f"{m.total_params / 1e9:.2f} B params in total, {m.active_params / 1e9:.2f} B active per token, "
                      f"{r.n_params / 1e9:.2f} B on each GPU ({m.rank_expert_params / 1e9:.2f} B in its "
                      f"{m.experts // m.expert_parallel_size} local experts)")
    pp = r.pipeline
    if pp is not None:
        layers = ", ".join(f"{a}-{b - 1}" for a, b in pp.layers)
        if pp.virtual_stages is None:
            how = f"1F1B, partition {pp.partition_method}; layers per stage {layers}"
        else:
            how = (f"Megatron's interleaved 1F1B, {pp.virtual_stages} model chunks per stage; layers per virtual "
                   f"stage {layers}, chunk j of stage i is virtual stage j x {pp.stages} + i")
        console.print(f"pipeline: {pp.stages} stages x {pp.data_parallel} data-parallel ({how}); "
                      f"bubble {pp.bubble_fraction * 100:.1f}% of the stages' time")
    if r.tensor_parallel is not None:
        console.print(tensor_parallel_line(r.tensor_parallel))
    for w in r.warnings:
        console.print(f"[yellow]warning: {w}[/yellow]")
    perf = _speed_table()
    perf.add_row("step time", fmt_time(r.step_time_s))
    perf.add_row("samples/s", f"{r.samples_per_s:,.2f}")
    perf.add_row("tokens/s", f"{r.tokens_per_s:,.0f}")
    perf.add_row("tokens/s per GPU", f"{r.tokens_per_s_per_gpu:,.1f}")
    perf.add_row("TFLOP/s per GPU (model)", f"{r.tflops_per_gpu:.1f}")
    perf.add_row("MFU / HFU", f"{r.mfu * 100:.1f}% / {r.hfu * 100:.1f}%")
    perf.add_row("compute time", fmt_time(r.compute_time_s))
    perf.add_row("exposed communication", fmt_time(r.comm.exposed_time_s))
    console.print(perf)
    mem = r.memory
    console.print(memory_table(mem))
    if pp is not None:
        peaks = ", ".join(f"{fmt_bytes(b)}{' (worst)' if s == pp.worst_stage else ''}"
                          for s, b in enumerate(pp.peak_bytes))
        console.print(f"Peak memory per pipeline stage: {peaks}; the breakdown above is stage {pp.worst_stage}'s")
    print_host_memory(console, mem.host)
    ct = Table(title="Communication per GPU per step")
    ct.add_column("collective")
    ct.add_column("calls", justify="right")
    ct.add_column("bytes sent", justify="right")
    ct.add_column("busy time", justify="right")
    ct.add_column("algorithm/protocol (calls)")
    ct.add_column("busbw GB/s", justify="right")
    c = r.comm
    for k in sorted(c.bytes_per_gpu):
        algos = ", ".join(f"{a} {n}" for a, n in sorted(c.algorithms.get(k, {}).items(), key=lambda x: -x[1]))
        bw = c.achieved_busbw_Bps.get(k)
        # the peak of the tier the kind's group crosses (NVLink inside a node, the NICs across nodes)
        peak = c.tier_busbw_Bps.get(k, c.link_busbw_Bps)
        ct.add_row(k, str(c.calls[k]), fmt_bytes(c.bytes_per_gpu[k]), fmt_time(c.time_s[k]), algos,
                   f"{bw / 1e9:.1f} of {peak / 1e9:.0f}" if bw else "-")
    console.print(ct)
    offload = {k: v for k, v in r.host_time_s.items() if k != ZERO3_RANK_LOOPS}
    if offload:
        parts = ", ".join(f"{k} {fmt_time(v)}" for k, v in offload.items())
        console.print(f"Offload busy time per GPU: {parts}")
    if ZERO3_RANK_LOOPS in r.host_time_s:
        console.print(f"ZeRO-3 host loops over the data-parallel ranks: {fmt_time(r.host_time_s[ZERO3_RANK_LOOPS])} "
                      "per step, before compute (reduce_scatter_coalesced, coalesced all-gathers; docs/model.md)")


def compare_table(name: str, rows: list[dict], console: Console | None = None):
    console = console or make_console()
    t = Table(title=f"{name}: ZeRO stages and offload variants (per GPU)")
    t.add_column("variant", justify="left")
    t.add_column("fits", justify="center")
    for col in ("peak/cap GiB", "host GiB/node", "step s", "tok/s/GPU", "MFU", "comm GiB", "exposed s"):
        t.add_column(col, justify="right")
    for r in rows:
        if r.get("error"):
            t.add_row(r["variant"], "[red]error[/red]", r["error"][:60], "", "", "", "", "", "")
            continue
        label = f"[bold green]* {r['variant']}[/bold green]" if r["winner"] else r["variant"]
        verdict = "[green]yes[/green]" if r["fits"] else ("[red]OOM[/red]" if not r["gpu_fits"] else "[red]host OOM[/red]")
        t.add_row(label, verdict, f"{r['peak_bytes'] / GiB:.1f}/{r['capacity_bytes'] / GiB:.0f}",
                  f"{r['host_bytes_per_node'] / GiB:.1f}" if r["host_bytes_per_node"] else "-",
                  f"{r['step_time_s']:.3g}", f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['mfu'] * 100:.1f}%",
                  f"{r['comm_bytes_per_gpu'] / GiB:.2f}", f"{r['exposed_comm_s']:.3g}")
    console.print(t)
    winners = [r for r in rows if r.get("winner")]
    if winners:
        console.print(f"* best that fits: {winners[0]['variant']}  (zsim run ... " +
                      " ".join(f"--set '{a}'" for a in winners[0]["set"]) + ")")
    else:
        console.print("[red]no variant fits; try zsim doctor[/red]")


def sweep_table(rows: list[dict], keys: list[str], console: Console | None = None, limit: int = 40):
    console = console or make_console()
    t = Table(title=f"sweep: {len(rows)} points" + (f" (first {limit})" if len(rows) > limit else ""))
    for k in keys:
        t.add_column(k.split(".")[-1])
    for col in ("fits", "step s", "tok/s/GPU", "MFU", "peak GiB"):
        t.add_column(col, justify="right")
    for r in rows[:limit]:
        vals = [str(r[k]) for k in keys]
        if not r["ok"]:
            t.add_row(*vals, "[red]failed[/red]", f"point {r['point']}: see below", "", "", "")
            continue
        t.add_row(*vals, "[green]yes[/green]" if row_fits(r) else "[red]OOM[/red]", f"{r['step_time_s']:.3g}",
                  f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['mfu'] * 100:.1f}%", f"{r['memory.peak_bytes'] / GiB:.1f}")
    console.print(t)
    # every failed point with its whole reason (a table cell would cut it), the rows past the limit too
    failed = [r for r in rows if not r["ok"]]
    if failed:
        console.print(f"failed points ({len(failed)}):", highlight=False)
    for r in failed:
        where = ", ".join(f"{k.split('.')[-1]}={r[k]}" for k in keys)
        console.print(f"  point {r['point']} ({where}): {r['error']}", highlight=False, markup=False, soft_wrap=True)


def tune_table(res, top: int, console: Console | None = None):
    console = console or make_console()
    t = Table(title=f"best configurations that fit (objective: {res.objective})")
    for col in ("#", "stage", "TP", "PP", "DP", "offload", "mb x gas", "ckpt", "knobs", "tok/s/GPU", "MFU", "peak GiB"):
        t.add_column(col, justify="right" if col in ("#", "tok/s/GPU", "MFU", "peak GiB") else "left")
    short = {"none": "-", "optimizer cpu": "opt", "optimizer+params cpu": "opt+par",
             "optimizer+params nvme": "nvme"}
    abbrev = {"reduce_bucket_size": "rb", "overlap_comm": "ov", "stage3_prefetch_bucket_size": "pf",
              "stage3_param_persistence_threshold": "pt", "stage3_max_live_parameters": "ml",
              "zero_hpz_partition_size": "hpz", "zero_quantized_weights": "qwz", "zero_quantized_gradients": "qgz"}
    for i, (c, r) in enumerate(res.ranked[:top]):
        knobs = " ".join(f"{abbrev.get(k, k)}={fmt_setting(v)}" for k, v in sorted(c.knobs.items())) or "-"
        tp = f"{c.layout.tensor}{' SP' if c.layout.sequence_parallel else ''}"
        dp = (f"{r.world_size // c.layout.sample_parallel}" + (f" EP {c.layout.expert}" if c.layout.expert > 1 else "")
              + (f" Ulysses {c.layout.sequence}" if c.layout.sequence > 1 else ""))
        t.add_row(str(i + 1), str(c.stage), tp, str(c.layout.pipeline), dp,
                  short.get(c.offload, c.offload),
                  f"{c.micro_batch}x{c.gas}",
                  c.checkpointing, knobs,
                  f"{r.tokens_per_s_per_gpu:,.0f}", f"{r.mfu * 100:.1f}%", f"{r.memory.peak_bytes / GiB:.1f}")
    console.print(t)
    if res.ranked:
        console.print("knobs: rb reduce_bucket_size, ov overlap_comm, pf stage3_prefetch_bucket_size, "
                      "pt stage3_param_persistence_threshold, ml stage3_max_live_parameters, "
                      "hpz zero_hpz_partition_size (ZeRO++ hpZ), qwz zero_quantized_weights (qwZ), "
                      "qgz zero_quantized_gradients (qgZ)")
        console.print("best: zsim run SCENARIO " + " ".join(f"--set '{a}'" for a in res.ranked[0][0].assignments()))
