"""The terminal report (rich)."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

GiB = 1024**3


def _time(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _bytes(b: float) -> str:
    if b >= GiB:
        return f"{b / GiB:.2f} GiB"
    return f"{b / 2**20:.1f} MiB"


def render(result: dict, console: Console | None = None):
    console = console or Console()
    r = result
    head = (f"[bold]{r['scenario']}[/bold]: ZeRO stage {r['stage']}, {r['world_size']} GPUs "
            f"({r['nodes']} x {r['gpus_per_node']} {r['hardware_profile']}), {r['precision']}, "
            f"{r['n_params'] / 1e9:.2f} B params, micro-batch {r['micro_batch_size']} x GAS "
            f"{r['gradient_accumulation_steps']} -> global batch {r['global_batch_size']} x {r['seq_len']} tokens")
    console.print(head)
    for w in r.get("warnings", []):
        console.print(f"[yellow]warning: {w}[/yellow]")
    perf = Table(title="Speed", show_header=False)
    perf.add_column("metric")
    perf.add_column("value", justify="right")
    perf.add_row("step time", _time(r["step_time_s"]))
    perf.add_row("samples/s", f"{r['samples_per_s']:,.2f}")
    perf.add_row("tokens/s", f"{r['tokens_per_s']:,.0f}")
    perf.add_row("tokens/s per GPU", f"{r['tokens_per_s_per_gpu']:,.1f}")
    perf.add_row("TFLOP/s per GPU (model)", f"{r['tflops_per_gpu']:.1f}")
    perf.add_row("MFU / HFU", f"{r['mfu'] * 100:.1f}% / {r['hfu'] * 100:.1f}%")
    perf.add_row("compute time", _time(r["compute_time_s"]))
    perf.add_row("exposed communication", _time(r["comm"]["exposed_time_s"]))
    console.print(perf)
    mem = r["memory"]
    verdict = "[green]fits[/green]" if mem["fits"] else "[bold red]OOM[/bold red]"
    mt = Table(title=f"Peak memory per GPU: {_bytes(mem['peak_bytes'])} of {_bytes(mem['capacity_bytes'])} -> {verdict}")
    mt.add_column("component")
    mt.add_column("at peak", justify="right")
    mt.add_column("share", justify="right")
    for name, b in sorted(mem["breakdown"].items(), key=lambda kv: -kv[1]):
        mt.add_row(name, _bytes(b), f"{100 * b / mem['peak_bytes']:.1f}%")
    console.print(mt)
    host = mem["host"]
    if host["bytes_per_node"] > 0:
        hv = "[green]fits[/green]" if host["fits"] else "[bold red]host OOM[/bold red]"
        parts = ", ".join(f"{k} {_bytes(v)}" for k, v in host["breakdown"].items())
        console.print(f"Host memory per node: {_bytes(host['bytes_per_node'])} of {_bytes(host['capacity_bytes'])} "
                      f"-> {hv} ({parts})")
    ct = Table(title="Communication per GPU per step")
    ct.add_column("collective")
    ct.add_column("calls", justify="right")
    ct.add_column("bytes sent", justify="right")
    ct.add_column("busy time", justify="right")
    c = r["comm"]
    for k in sorted(c["bytes_per_gpu"]):
        ct.add_row(k, str(c["calls"][k]), _bytes(c["bytes_per_gpu"][k]), _time(c["time_s"][k]))
    console.print(ct)
    if r.get("host_time_s"):
        parts = ", ".join(f"{k} {_time(v)}" for k, v in r["host_time_s"].items())
        console.print(f"Offload busy time per GPU: {parts}")
