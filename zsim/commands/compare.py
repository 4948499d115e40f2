"""zsim compare: ZeRO stages 0-3, the offload variants and, across nodes, ZeRO++ hpZ of one
scenario, side by side."""
from __future__ import annotations


from zsim.commands.common import add_scenario_args, add_width_arg, scenario_overrides, table_width

NONE = ("deepspeed.zero_optimization.offload_optimizer={device: none}",
        "deepspeed.zero_optimization.offload_param={device: none}")
OPT_CPU = "deepspeed.zero_optimization.offload_optimizer={device: cpu, pin_memory: true}"
PARAM_CPU = "deepspeed.zero_optimization.offload_param={device: cpu, pin_memory: true}"
OPT_NVME = "deepspeed.zero_optimization.offload_optimizer={device: nvme, nvme_path: /local_nvme, pin_memory: true}"
PARAM_NVME = "deepspeed.zero_optimization.offload_param={device: nvme, nvme_path: /local_nvme, pin_memory: true}"


def stage(n: int) -> str:
    return f"deepspeed.zero_optimization.stage={n}"


def hpz(size: int) -> str:
    return f"deepspeed.zero_optimization.zero_hpz_partition_size={size}"


def qwz(on: bool) -> str:
    return f"deepspeed.zero_optimization.zero_quantized_weights={'true' if on else 'false'}"


def qgz(on: bool) -> str:
    return f"deepspeed.zero_optimization.zero_quantized_gradients={'true' if on else 'false'}"


def variants(has_nvme: bool, gpus_per_node: int = 1, nodes: int = 1) -> list[tuple[str, str, tuple[str, ...]]]:
    """(label, offload mode, assignments). Offload modes group the bars of the plot. Across nodes,
    ZeRO-3 with hpZ over each node (see [Note: hpZ secondary partitions]) and ZeRO++ (hpZ, qwZ's
    quantized gathers and qgZ's quantized gradient reduction: see [Note: qwZ quantized gathers],
    see [Note: qgZ quantized gradient reduction]) join them; every other variant runs without ZeRO++."""
    plain = (hpz(1), qwz(False), qgz(False))
    out: list[tuple[str, str, tuple[str, ...]]] = [(f"ZeRO-{n}", "none", (stage(n),) + plain + NONE) for n in range(4)]
    if nodes > 1 and gpus_per_node > 1:
        out.append((f"ZeRO-3 + hpZ ({gpus_per_node} GPUs a node)", "none (hpZ)",
                    (stage(3), hpz(gpus_per_node), qwz(False), qgz(False)) + NONE))
        out.append((f"ZeRO++ (hpZ {gpus_per_node} + qwZ + qgZ)", "none (ZeRO++)",
                    (stage(3), hpz(gpus_per_node), qwz(True), qgz(True)) + NONE))
    out += [
        ("ZeRO-2 + CPU optimizer", "optimizer cpu", (stage(2),) + plain + (OPT_CPU, NONE[1])),
        ("ZeRO-3 + CPU optimizer", "optimizer cpu", (stage(3),) + plain + (OPT_CPU, NONE[1])),
        ("ZeRO-3 + CPU optimizer + params", "optimizer+params cpu", (stage(3),) + plain + (OPT_CPU, PARAM_CPU)),
    ]
    if has_nvme:
        out.append(("ZeRO-3 + NVMe optimizer + params", "optimizer+params nvme",
                    (stage(3),) + plain + (OPT_NVME, PARAM_NVME)))
    return out


def compare_rows(base) -> list[dict]:
    from zsim.search.variants import Variant
    sc = base.scenario(())
    rows = []
    cl = sc.cluster
    for label, mode, assignments in variants(cl.profile.nvme.drives_per_node > 0, cl.gpus_per_node, cl.nodes):
        out = base.run(Variant(label, assignments))
        row = {"variant": label, "stage": int(assignments[0].rsplit("=", 1)[1]), "offload": mode,
               "set": list(assignments), "error": out.error}
        r = out.result
        if r is not None:
            mem = r.memory
            row.update({
                "fits": r.fits, "gpu_fits": mem.fits, "host_fits": mem.host.fits,
                "peak_bytes": mem.peak_bytes, "capacity_bytes": mem.capacity_bytes,
                "host_bytes_per_node": mem.host.bytes_per_node,
                "step_time_s": r.step_time_s, "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu,
                "mfu": r.mfu, "comm_bytes_per_gpu": r.comm.total_bytes_per_gpu,
                "exposed_comm_s": r.comm.exposed_time_s, "breakdown": mem.breakdown,
            })
        else:
            row.update({"fits": False})
        rows.append(row)
    ok = [r for r in rows if r.get("fits")]
    best = max(ok, key=lambda r: r["tokens_per_s_per_gpu"]) if ok else None
    for r in rows:
        r["winner"] = r is best
    return rows


def add_parser(sub):
    p = sub.add_parser("compare", help="ZeRO stages 0-3, offload variants and (across nodes) ZeRO++ hpZ side by side")
    add_scenario_args(p)
    p.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    p.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    p.add_argument("--plot", metavar="PATH", help="PNG/SVG: throughput bars and memory breakdown vs capacity")
    p.add_argument("--quiet", action="store_true", help="no table on the terminal")
    add_width_arg(p)
    p.set_defaults(func=main)


def main(args) -> int:
    from zsim.search.variants import Base
    from zsim.report.table import compare_table
    from zsim.report.writers import dumps, rows_csv, save

    width = table_width(args.width)
    base = Base.load(args.scenario, scenario_overrides(args))
    if args.plot:
        from zsim.report.plots import check_image_path
        check_image_path(args.plot, "--plot")
    rows = compare_rows(base)
    if not args.quiet:
        from zsim.report.table import make_console
        compare_table(base.name, rows, make_console(width))
    if args.json:
        save(args.json, dumps(rows))
    if args.csv:
        save(args.csv, rows_csv([{k: v for k, v in r.items() if k != "breakdown"} for r in rows]))
    if args.plot:
        from zsim.report.plots import compare_plot
        compare_plot(rows, base.name, args.plot)
    return 0
