"""zsim plot: pictures from zsim's own output files (sweep, compare, run, trace)."""
from __future__ import annotations

from pathlib import Path

KINDS = ("scaling", "throughput", "curves", "memory", "timeline", "memory-timeline")


def add_parser(sub):
    p = sub.add_parser("plot", help="plot a sweep/compare/run JSON or CSV, or a trace")
    p.add_argument("results", metavar="RESULTS", help="sweep CSV/JSON, compare JSON, run JSON or trace JSON")
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--out", required=True, metavar="PATH", help="output image (.png or .svg)")
    p.add_argument("--title", help="figure title (default: from the input file name)")
    p.add_argument("--x", metavar="KEY", help="--kind curves: the swept key on the x axis (e.g. "
                   "hardware.override.inter_node.nic_bw_Gbps); a curve per combination of the other swept keys")
    p.set_defaults(func=main)


def _extract(reader, args, *inputs):
    """A reader of zsim's own output (plots.*_data) on a file of the right kind but not of the
    shape zsim writes (a column missing, a text where a number belongs): one line naming it."""
    from zsim.errors import ZsimInputError
    try:
        data = reader(*inputs)
    except (KeyError, IndexError) as exc:
        raise ZsimInputError("RESULTS", args.results, f"lacks {exc} that a --kind {args.kind} plot reads; give the "
                             "file zsim wrote") from None
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ZsimInputError("RESULTS", args.results, f"has a value of the wrong type for a --kind {args.kind} "
                             f"plot ({exc}); give the file zsim wrote") from None
    if not data:
        raise ZsimInputError("RESULTS", args.results, f"holds nothing a --kind {args.kind} plot can draw; give the "
                             "file zsim wrote")
    return data


def main(args) -> int:
    from zsim.report import plots

    plots.check_image_path(args.out, "--out")
    have, data = plots.load_results(args.results)
    title = args.title or Path(args.results).stem
    if args.kind == "scaling":
        plots._need(args.kind, have, ("rows",))
        plots.scaling_plot(_extract(plots.scaling_data, args, data), title, args.out, plots.failed_points(data))
    elif args.kind == "curves":
        plots._need(args.kind, have, ("rows",))
        if not args.x:
            from zsim.errors import ZsimInputError
            raise ZsimInputError("--x", None, "--kind curves needs the swept key for its x axis, e.g. "
                                 "--x hardware.nodes")
        plots.curves_plot(_extract(plots.curves_data, args, data, args.x), title, args.out)
    elif args.kind == "throughput":
        plots._need(args.kind, have, ("rows",))
        plots.throughput_plot(_extract(plots.throughput_data, args, data), title, args.out)
    elif args.kind == "memory":
        plots._need(args.kind, have, ("rows", "run"))
        plots.memory_plot(_extract(plots.memory_data, args, have, data), title, args.out)
    elif args.kind == "timeline":
        plots._need(args.kind, have, ("trace",))
        plots.timeline_plot(_extract(plots.timeline_data, args, data), title, args.out)
    else:
        plots._need(args.kind, have, ("trace",))
        plots.memory_timeline_plot(_extract(plots.memory_timeline_data, args, data), title, args.out)
    return 0
