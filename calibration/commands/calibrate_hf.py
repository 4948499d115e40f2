"""`zsim calibrate --hf-layer`: time the user's own Hugging Face decoder layer on this device and
fit a profile's compute figures so zsim's layer matches it (docs/calibration.md, "Your own
model"). Measurement: calibration/harness/hf_layer.py (torch, transformers); fit:
calibration/harness/fit_hf_layer.py. transformers is the `hf` extra, imported only here and only
when measuring; `--from-run` refits committed records without torch or transformers.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import sys
from itertools import product
from pathlib import Path

from zsim.errors import ZsimInputError

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
# the options of a harness run that mean nothing here (one process, no collective)
_HARNESS_ONLY = ("quick", "nproc_per_node", "backend", "max_size", "io_path", "layer", "hooks", "timeout",
                 "pool_collectives")
_MAX_SHAPE = 1 << 20


def add_arguments(p) -> None:
    g = p.add_argument_group("your own Hugging Face model (--hf-layer)")
    g.add_argument("--hf-layer", action="store_true",
                   help="time one decoder layer of your HF model (transformers, random weights, nothing downloaded) "
                        "per module kind on this device and fit the compute figures of --base to it")
    g.add_argument("--model", default=None, metavar="CONFIG",
                   help="with --hf-layer: a config.json, a config.json preset of scenarios/models, or a scenario YAML")
    g.add_argument("--seq-len", default=None, metavar="S[,S...]", help="with --hf-layer: sequence length(s)")
    g.add_argument("--micro-batch", default=None, metavar="B[,B...]", help="with --hf-layer: micro-batch size(s)")
    g.add_argument("--attn-implementation", default=None, choices=ATTN_IMPLEMENTATIONS,
                   help="with --hf-layer: HF's attn_implementation (default sdpa, as transformers picks with torch "
                        ">= 2.1; eager where the scenario turns flash attention off)")
    g.add_argument("--reps", default=None, metavar="N", help="with --hf-layer: timed repetitions per unit (default 10)")


def _ints(text, field: str) -> list[int]:
    try:
        vals = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ZsimInputError(field, text, "give positive integers, e.g. 512 or 512,1024") from None
    if not vals or min(vals) <= 0 or max(vals) > _MAX_SHAPE:
        raise ZsimInputError(field, text, f"give positive integers up to {_MAX_SHAPE:,}, e.g. 512,1024")
    return sorted(set(vals))


def resolve_model(args) -> dict:
    """{config, name, seq_lens, micro_batches, dtype, attn, base} from --model / --scenario and the flags."""
    from zsim.config.hf_config import model_files

    src = args.model or args.scenario
    if not src:
        raise ZsimInputError("--model", "missing", "--hf-layer needs --model CONFIG.json (or a preset, or a scenario)")
    seq, mb, dtype, base, attn = None, None, None, args.base, args.attn_implementation
    if str(src).endswith((".yaml", ".yml")):
        from zsim.config.scenario import load_raw, load_scenario
        sc = load_scenario(src)
        model_raw = load_raw(Path(src)).get("model") or {}
        hf = model_raw.get("hf_config")
        preset = model_raw.get("preset")
        if hf:
            path = Path(hf)
        elif isinstance(preset, str) and preset in model_files():
            path = model_files()[preset]
        else:
            raise ZsimInputError("--model", src, "the scenario's model is not a Hugging Face config (no model.hf_config "
                                 "or config.json preset); give --model CONFIG.json")
        seq, mb, dtype = [sc.seq_len], [sc.micro_batch_size], sc.precision
        base = base or sc.hardware.profile
        attn = attn or ("sdpa" if sc.training.flash_attention else "eager")
    elif str(src) in model_files():
        path = model_files()[str(src)]
    else:
        path = Path(src)
        if not path.is_file():
            names = ", ".join(model_files())
            raise ZsimInputError("--model", src, f"no such file; give a config.json, a preset ({names}) or a scenario")
    from zsim.inputs import parse_json, read_text
    config = parse_json(read_text(path, "--model", "a Hugging Face config.json"), "--model", str(path))
    if not isinstance(config, dict):
        raise ZsimInputError("--model", str(path), "a config.json is a JSON object")
    if args.seq_len is not None:
        seq = _ints(args.seq_len, "--seq-len")
    if args.micro_batch is not None:
        mb = _ints(args.micro_batch, "--micro-batch")
    if args.dtype is not None:
        from calibration.commands.calibrate import parse_dtypes
        dtypes = parse_dtypes(args.dtype)
        if len(dtypes) != 1:
            raise ZsimInputError("--dtype", args.dtype, "--hf-layer fits one precision; give one dtype")
        dtype = dtypes[0]
    if not base:
        raise ZsimInputError("--base", "missing", "--hf-layer refits the compute figures of a profile: pass --base "
                             "PROFILE (e.g. dgx-h100 on an H100, cpu-gloo-localhost on a CPU)")
    reps = 10 if args.reps is None else int(_ints(args.reps, "--reps")[0])
    return {"config": config, "name": path.name if path.name != "config.json" else str(path), "seq_lens": seq or [512],
            "micro_batches": mb or [1], "dtype": dtype or "bf16", "attn": attn or "sdpa", "base": base, "reps": reps}


def model_spec(config: dict, name: str):
    from zsim.config.hf_config import model_from_hf
    from zsim.schema import build
    from zsim.specs.model import ModelSpec
    return build(ModelSpec, model_from_hf(config, name), "--model")


def timed_layer_index(spec) -> int:
    """The layer timed: a MoE model's first sparse block (DeepSeek's first blocks are dense), else 0."""
    if spec.moe is None:
        return 0
    return next(i for i in range(spec.layers) if spec.is_moe_layer(i))


def pricings(spec, shapes, dtype: str, attn: str, layer: int) -> dict:
    from calibration.harness.fit_hf_layer import Pricing
    from zsim.workload.transformer import build_workload
    out = {}
    for s, b in shapes:
        # the real layer runs transformers' modeling code: zsim's side prices it as training.kernels hf
        # with the same attn_implementation (zsim/workload/hf_kernels.py)
        wl = build_workload(spec, micro_batch_size=b, seq_len=s, precision=dtype, flash_attention=attn != "eager",
                            dropout=False, kernels="hf", attn_implementation=attn)
        out[(s, b)] = Pricing(wl.layer_modules(layer), spec.is_moe_layer(layer), dtype)
    return out


def fit_profile(out_name: str, doc: dict, base: str) -> tuple[dict, dict]:
    """(profile mapping, fit report) from a records document (records.json)."""
    from calibration.harness.fit import _round
    from calibration.harness.fit_hf_layer import fit, measured_groups
    from zsim.config.profile import load_profile, read_profile_mapping
    from zsim.specs.hardware import DTYPE_COMPUTE_FIELDS

    prov, plan = doc["provenance"], doc["plan"]
    dtype, attn = plan["dtype"], plan["attn_implementation"]
    spec = model_spec(plan["config"], plan["model"])
    shapes = [tuple(x) for x in plan["shapes"]]
    base_gpu = load_profile(base).gpu
    gpu = base_gpu.for_dtype(dtype)
    measured = measured_groups(doc["records"])
    result = fit(measured, pricings(spec, shapes, dtype, attn, plan["layer_idx"]), gpu, base_gpu.for_dtype("fp32"),
                 getattr(gpu, f"peak_tflops_{dtype}"))
    data, _ = read_profile_mapping(base)
    profile = copy.deepcopy(data)
    g = profile["gpu"]
    fields = _round(result["fields"])
    entry = (g.get("by_dtype") or {}).get(dtype)
    if entry is not None:   # the dtype has its own figures in the base: refit those
        entry.update({k: v for k, v in fields.items() if k in DTYPE_COMPUTE_FIELDS})
    else:
        g.update(fields)
    shapes_text = ", ".join(f"s{s}-b{b}" for s, b in shapes)
    profile["name"] = out_name
    profile["description"] = (f"{base} with its {dtype} compute fitted to a measured {plan['model']} decoder layer "
                              f"(zsim calibrate --hf-layer)")
    profile["provenance"] = {**{k: str(v) for k, v in sorted(prov.items())},
                             "method": "zsim calibrate --hf-layer (calibration/harness/fit_hf_layer.py)",
                             "base_profile": base, "model": plan["model"], "model_type": str(plan["config"].get("model_type")),
                             "layer_index": str(plan["layer_idx"]), "shapes": shapes_text, "compute_dtype": dtype,
                             "attn_implementation": attn,
                             "fit_rms_error_before": f"{result['rms_error_before']:.4f}",
                             "fit_rms_error": f"{result['rms_error']:.4f}"}
    report = {"base_profile": base, "fields": result["fields"], "peak_tflops": getattr(gpu, f"peak_tflops_{dtype}"),
              "scales": result["scales"], "rms_error_before": result["rms_error_before"],
              "rms_error": result["rms_error"], "residuals_before": result["residuals_before"],
              "residuals": result["residuals"]}
    return profile, report


def _header(profile: dict, report: dict, run_rel: str) -> str:
    p = profile["provenance"]
    lines = [f"# {profile['name']}: {p['base_profile']} with its {p['compute_dtype']} compute figures fitted by "
             "`zsim calibrate --hf-layer`, not hand-written.",
             f"# {p.get('date')} on {p.get('hosts')}: {p.get('gpu')}, torch {p.get('torch')}, transformers "
             f"{p.get('transformers')}, attn_implementation {p['attn_implementation']}.",
             f"# Measured: one {p['model']} decoder layer (layer {p['layer_index']}, random weights) at {p['shapes']}, "
             "per module kind; raw records and residuals: " + run_rel + " (records.json, fit_report.json).",
             "# Method: calibration/harness/fit_hf_layer.py (scales of zsim's GEMM, attention, memory-bound and launch",
             f"# times, least squares). RMS relative error {100 * report['rms_error_before']:.1f}% with {p['base_profile']}'s "
             f"figures, {100 * report['rms_error']:.1f}% fitted."]
    for r in report["residuals"]:
        if r["group"] == "layer" and r["error"] is not None:
            lines.append(f"# layer s{r['seq_len']}-b{r['micro_batch']} {r['pass']}: measured {r['measured_s'] * 1e3:.3f} ms, "
                         f"zsim {r['predicted_s'] * 1e3:.3f} ms ({100 * r['error']:+.1f}%)")
    return "\n".join(lines) + "\n"


def write_outputs(args, root: Path, doc: dict, base: str, profile_path: Path, run_dir: Path) -> dict:
    from calibration.harness.launch import _dump_profile, write_atomic
    from zsim.schema import build
    from zsim.specs.hardware import HardwareProfile

    profile, report = fit_profile(args.out, doc, base)
    build(HardwareProfile, profile, str(profile_path))   # refuse to write a profile zsim cannot load
    run_rel = f"calibration/runs/{run_dir.name}"
    write_atomic(run_dir / "records.json", json.dumps(doc, indent=1, sort_keys=True) + "\n")
    write_atomic(run_dir / "fit_report.json", json.dumps(report, indent=1, sort_keys=True) + "\n")
    write_atomic(profile_path, _header(profile, report, run_rel) + _dump_profile(profile))
    for r in report["residuals"]:
        before = next(x for x in report["residuals_before"] if all(x[k] == r[k] for k in
                                                                   ("seq_len", "micro_batch", "group", "pass")))
        if r["error"] is None:
            continue
        print(f"  s{r['seq_len']}-b{r['micro_batch']} {r['group']} {r['pass']}: measured {r['measured_s'] * 1e3:.3f} ms, "
              f"zsim {r['predicted_s'] * 1e3:.3f} ms ({100 * r['error']:+.1f}%; {base}: {100 * before['error']:+.1f}%)"
              + ("" if r["fitted"] else " [not fitted]"), file=sys.stderr)
    print(f"zsim calibrate --hf-layer: RMS relative error {100 * report['rms_error_before']:.1f}% with {base}, "
          f"{100 * report['rms_error']:.1f}% fitted", file=sys.stderr)
    return report


def main(args) -> int:
    from calibration.commands.calibrate import _NAME
    for opt in _HARNESS_ONLY:
        v = getattr(args, opt, None)
        if v not in (None, False, []):
            raise ZsimInputError(f"--{opt.replace('_', '-')}", v, "is an option of the harness run; --hf-layer times "
                                 "one layer in this process: drop it")
    if not _NAME.match(args.out or "") or args.out.endswith((".yaml", ".yml")):
        raise ZsimInputError("--out", args.out, "use a plain name of letters, digits, '.', '_' or '-'")
    root = Path(args.root).resolve() if args.root else Path(__file__).resolve().parents[2]
    profile_path = root / "hardware_profiles" / f"{args.out}.yaml"
    run_dir = root / "calibration" / "runs" / args.out
    if not args.force:
        for p in (profile_path, run_dir / "records.json"):
            if p.exists() and not (args.from_run and p == run_dir / "records.json"
                                   and Path(args.from_run).resolve() == run_dir.resolve()):
                raise ZsimInputError("--out", args.out, f"{p} exists; pass --force to overwrite it or choose another name")
    if args.from_run:
        from calibration.harness.pool import read_json
        doc = read_json(Path(args.from_run) / "records.json", "--from-run", args.from_run)
        if doc.get("plan", {}).get("mode") != "hf_layer" or doc.get("status") != "complete":
            raise ZsimInputError("--from-run", args.from_run, "not a complete `zsim calibrate --hf-layer` run")
        base = args.base or doc["provenance"].get("base_profile")
        write_outputs(args, root, doc, base, profile_path, run_dir)
        print(f"wrote {profile_path} and {run_dir}/", file=sys.stderr)
        return 0
    m = resolve_model(args)
    spec = model_spec(m["config"], m["name"])   # refuse what zsim cannot model before measuring
    from zsim.config.profile import load_profile
    load_profile(m["base"])
    for mod, extra in (("torch", "calibration"), ("transformers", "hf")):
        if importlib.util.find_spec(mod) is None:
            raise ZsimInputError("--hf-layer", f"{mod} not installed", f"pip install torch==2.13.0 first, then "
                                 f"pip install -e '.[calibration,hf]' (the `{extra}` extra)")
    from calibration.harness import hf_layer
    layer = timed_layer_index(spec)
    shapes = list(product(m["seq_lens"], m["micro_batches"]))
    print(f"zsim calibrate --hf-layer: {m['name']} layer {layer}, {len(shapes)} shapes, {m['dtype']}, "
          f"{m['attn']}, results in {run_dir}", file=sys.stderr)
    cuda = hf_layer.torch.cuda.is_available()
    records = hf_layer.measure(m["config"], shapes, m["dtype"], m["attn"], layer, reps=m["reps"], warmup=2,
                               min_rep_s=0.002 if cuda else 0.005)
    plan = {"mode": "hf_layer", "model": m["name"], "config": m["config"], "shapes": [list(x) for x in shapes],
            "dtype": m["dtype"], "attn_implementation": m["attn"], "layer_idx": layer, "reps": m["reps"]}
    doc = {"format": 1, "status": "complete", "error": "", "plan": plan,
           "provenance": {**hf_layer.provenance(m["attn"]), "base_profile": m["base"]}, "records": records}
    write_outputs(args, root, doc, m["base"], profile_path, run_dir)
    print(f"wrote {profile_path} and {run_dir}/ ({len(records)} records)", file=sys.stderr)
    return 0
