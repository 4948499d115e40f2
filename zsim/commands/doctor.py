"""zsim doctor: why a scenario runs out of memory (GPU or host), and the fixes that fit, fastest first."""
from __future__ import annotations

import shlex

from zsim.commands.common import (add_headroom_arg, add_scenario_args, add_workers_arg, headroom_fraction,
                                  scenario_overrides, workers_count)
from zsim.units import GiB


def add_parser(sub):
    p = sub.add_parser("doctor", help="diagnose an OOM and rank the config changes that make the scenario fit")
    add_scenario_args(p, optional=False)
    p.add_argument("--json", metavar="PATH", help="write the diagnosis and ranked fixes as JSON")
    p.add_argument("--top", type=int, default=10, help="print at most this many fixes (default 10)")
    add_headroom_arg(p)
    add_workers_arg(p, "simulate the candidate fixes")
    p.set_defaults(func=main)


def render(rep: dict, top: int = 10):
    d = rep["diagnosis"]
    print(f"{rep['scenario']}: peak {d['peak_bytes'] / GiB:.2f} GiB of {d['capacity_bytes'] / GiB:.2f} GiB per GPU",
          end="")
    if d["over_bytes"] > 0:
        print(f" -> OOM by {d['over_bytes'] / GiB:.2f} GiB ({100 * d['over_fraction']:.1f}% over)")
    else:
        print(f" -> fits ({-d['over_bytes'] / GiB:.2f} GiB headroom)")
    if d["host_over_bytes"] > 0:
        print(f"host memory: {d['host_over_bytes'] / GiB:.2f} GiB per node over the node's memory -> CPU OOM")
    at = d["at"]
    print(f"peak at t={d['peak_time_s'] * 1e3:.2f} ms, in {at['phase']} (micro-step {at['micro_step']}), "
          f"when '{at['op']}' allocates")
    print("at the peak: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in d["components"].items()))
    if d["pushing_over"]:
        print("pushing it over: " + ", ".join(d["pushing_over"]))
    fixes = rep["fixes"]
    base = rep["baseline"]
    tried = len(rep["tried"])
    margin = f", within {rep['headroom_fraction']:.0%} headroom" if rep.get("headroom_fraction") else ""
    print(f"\n{len(fixes)} of {tried} simulated changes fit (GPU and host{margin}), fastest first "
          f"(baseline step {base['step_time_s']:.3f} s{'' if base['fits'] else ', if it fit'}):")
    for i, f in enumerate(fixes[:top], 1):
        print(f"{i}. {f['name']}: step {f['step_time_s']:.3f} s, {f['tokens_per_s']:,.0f} tokens/s "
              f"({100 * f['throughput_change']:+.1f}%), peak {f['peak_bytes'] / GiB:.2f} GiB, "
              f"host {f['host_bytes_per_node'] / GiB:.1f} GiB/node")
        print("   " + " ".join(f"--set {shlex.quote(o)}" for o in f["overrides"]))   # pasteable into a shell
    if not fixes:
        print("no single change or pair of changes fits; try more GPUs or a smaller model")


def main(args) -> int:
    from zsim.search.doctor import doctor_file
    from zsim.report.writers import dumps, save

    from zsim.errors import ZsimInputError
    from zsim.result import fits_with_headroom

    if args.top < 0:
        raise ZsimInputError("--top", args.top, "give 0 or more")
    headroom = headroom_fraction(args.headroom)
    rep = doctor_file(args.scenario, scenario_overrides(args), workers=workers_count(args.workers))
    if headroom:
        # the fixes listed are those that fit; with a margin, those that fit inside it
        cap = rep["diagnosis"]["capacity_bytes"]
        rep["headroom_fraction"] = headroom
        rep["fixes"] = [f for f in rep["fixes"] if fits_with_headroom(f["peak_bytes"], cap, True, headroom)]
    render(rep, args.top)
    if args.json:
        save(args.json, dumps(rep))
    return 0
