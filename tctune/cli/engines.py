"""``tctune export`` and ``tctune bench``: the command-line side of :mod:`tctune.engines`."""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from ..engines import FORMATS, bench_artifact, export_artifacts
from ..errors import ExportError, UsageError
from .common import parse_batch_sizes

EPILOG_EXPORT = """\
The model file is executed as `python model.py` would execute it: only export files you trust.
CONFIG is the best_config.json that `tctune optimize` wrote; its params (batch_size, precision,
graph_passes), batch_sizes and hardware decide the graph passes and the batch sizes validated.

Outputs in OUT (default: the config's folder): model.onnx (and model.fp32.onnx, the same graph in FP32,
when onnxruntime cannot run the fp16/bf16 file), model.engine (TensorRT installed only), model.pt2, a
<artifact>.manifest.json beside each, and runner.py (standalone: `python runner.py model.onnx --batch 8`
needs only onnxruntime and numpy); the console lists every file written. An artifact whose manifest has
the same cache key (graph + weights, precision, shapes, compute capability, torch/onnx/TensorRT versions)
is reused. A failed ONNX export or AOTInductor package is reported with the file holding its full error
(OUT/tctune_errors.log); the other formats are still written (TensorRT, which builds from the ONNX file, is
skipped when that failed), and the exit status is 1.

examples:
  tctune export recipes/seed_cnn.py --config tctune_out/seed_cnn/best_config.json
  tctune export model.py --config best_config.json --format onnx --out engines/
"""


# ------------------------------------------------------------------------------------------------ argparse


def register(subparsers) -> tuple[str, str]:
    """Add the ``export`` and ``bench`` subcommands; returns their names (``run`` dispatches on ``args.command``)."""
    e = subparsers.add_parser("export", help="build ONNX / TensorRT / AOTInductor engines from a best_config.json",
                              description="Rebuild the tuned graph of MODEL_FILE from CONFIG and write deployable "
                                          "engines, each validated against PyTorch, with a manifest and a runner.",
                              epilog=EPILOG_EXPORT, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("model_file", metavar="MODEL_FILE", help="the model file that was tuned (it is executed)")
    e.add_argument("--config", required=True, metavar="CONFIG", help="best_config.json from `tctune optimize`")
    e.add_argument("--format", default=",".join(FORMATS), metavar="LIST",
                   help="comma list of onnx, tensorrt, aoti (default %(default)s)")
    e.add_argument("--out", metavar="DIR", help="output folder (default: the config's folder)")
    e.add_argument("--force", action="store_true", help="rebuild even when a cached artifact matches")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.add_argument("--debug", action="store_true", help="show tracebacks")

    b = subparsers.add_parser("bench", help="time an engine (.onnx, .engine, .pt2) written by `tctune export`",
                              description="Time ARTIFACT on random inputs of the shapes in its manifest: warm-up, "
                                          "then timed calls; median latency (ms) and throughput (items/s).")
    b.add_argument("artifact", metavar="ARTIFACT", nargs="+", help="one or more .onnx / .engine / .pt2 files")
    b.add_argument("--batch", metavar="LIST", help="batch size(s), e.g. 1,8,32 (default: the tuned batch)")
    b.add_argument("--iters", type=int, default=50, metavar="N", help="timed calls (default %(default)s)")
    b.add_argument("--warmup", type=int, default=10, metavar="N", help="untimed calls first (default %(default)s)")
    b.add_argument("--provider", metavar="NAME", help="onnxruntime execution provider (default: CUDA if present, else CPU)")
    b.add_argument("--timing", choices=("device-resident", "host-copies"),
                   help="device-resident: inputs copied to the GPU once, outputs left there, each call the engine's "
                        "synchronized run (IO binding for onnxruntime), as the search times candidates (default on a "
                        "GPU); host-copies: numpy in and out on every call. The same on the CPU")
    b.add_argument("--json", action="store_true", help="print the rows as JSON")
    b.add_argument("--debug", action="store_true", help="show tracebacks")
    return ("export", "bench")


def run(args) -> int:
    """Dispatch ``export`` / ``bench``."""
    if args.command == "bench":
        return _cmd_bench(args)
    return _cmd_export(args)


def parse_formats(text: str) -> tuple[str, ...]:
    """``"onnx,aoti"`` -> ``("onnx", "aoti")``.

    Raises:
        UsageError: an unknown or empty format list.
    """
    items = [f.strip().lower() for f in text.split(",") if f.strip()]
    aliases = {"trt": "tensorrt", "pt2": "aoti", "aotinductor": "aoti"}
    items = [aliases.get(f, f) for f in items]
    bad = [f for f in items if f not in FORMATS]
    if bad or not items:
        raise UsageError(f"invalid --format {text!r}\n  fix: a comma list of {', '.join(FORMATS)}")
    return tuple(dict.fromkeys(items))


def _cmd_export(args) -> int:
    formats = parse_formats(args.format)
    result = export_artifacts(args.model_file, args.config, formats, args.out, force=args.force)
    failed = any(r.get("status") == "failed" for r in result["formats"].values())
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return 1 if failed else 0
    print(export_summary(result, formats))
    return 1 if failed else 0


def export_summary(result: dict, formats) -> str:
    """The console text of ``tctune export``: one line per format (built / reused / skipped / failed, the path,
    the validation's max abs error), the FP32 twin ``model.fp32.onnx`` with which file deploys where, a failed
    format's one-line error and the file with its full text, the runner command, and every file written."""
    pad = " " * 12
    lines = [f"{result['model']}: {result['precision']} on {result['hardware']}, batch "
             f"{result['batch_sizes']['min']}/{result['batch_sizes']['opt']}/{result['batch_sizes']['max']} "
             f"(min/tuned/max) -> {result['out']}"]
    for fmt in formats:
        r = result["formats"].get(fmt, {})
        if r.get("status") == "skipped":
            lines.append(f"  {fmt:9s} skipped: {r.get('reason')}")
            continue
        if r.get("status") == "failed":
            lines.append(f"  {fmt:9s} failed: {r.get('error')}")
            lines.append(f"{pad}full error: {r['log']}" if r.get("log") else
                         f"{pad}full error: not written (the output folder is not writable); rerun with --debug")
            if r.get("path"):
                lines.append(f"{pad}kept, not validated: {r['path']}")
            continue
        err = r.get(f"{fmt}_max_abs_error")
        detail = f", max abs error vs PyTorch {err:.2e}" if isinstance(err, float) else ""
        took = f" in {r['seconds']:.1f} s" if "seconds" in r and str(r.get("status")).startswith("built") else ""
        lines.append(f"  {fmt:9s} {r.get('status')}{took}: {r.get('path')}{detail}")
        if r.get("rebuilt"):  # an artifact was there but its cache key differs: say why it was not reused
            lines.append(f"{pad}not reused: {r['rebuilt']}")
        twin = r.get("onnx_fp32") if fmt == "onnx" else None
        if twin and Path(twin).name != Path(str(r.get("path"))).name:
            terr = r.get("onnx_fp32_max_abs_error")
            lines.append(f"{pad}also {twin}: the same graph in FP32"
                         + (f", max abs error vs PyTorch {terr:.2e}" if isinstance(terr, float) else ""))
        if fmt == "onnx" and (twin or r.get("onnx_error")) and r.get("deploy") is not None:
            where = ", ".join(f"{rt} runs {name}" for rt, name in r["deploy"].items()) or "no file validated"
            lines.append(f"{pad}deploy: {where}" + (f" ({r['deploy_reason']})" if r.get("deploy_reason") else ""))
        if fmt == "onnx" and r.get("onnx_note"):
            lines.append(f"{pad}note: {r['onnx_note']}")
    runners = {r.get("runner") for r in result["formats"].values() if r.get("runner")}
    for runner in sorted(runners):
        lines.append(f"  runner:   python {shlex.quote(str(runner))} [ARTIFACT] --batch N --iters N")
    written = list(dict.fromkeys(f for r in result["formats"].values() for f in r.get("files") or []))
    if written:
        lines.append(f"  written:  {', '.join(Path(f).name for f in written)} (in {result['out']})")
    return "\n".join(lines)


def _bench_in_child(artifact: str, args) -> list[dict]:
    """Run ``tctune bench ARTIFACT --json`` in a child process; its rows, or its error as ExportError."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tctune", "bench", str(artifact), "--json", "--iters", str(args.iters),
           "--warmup", str(args.warmup)]
    if args.batch:
        cmd += ["--batch", args.batch]
    if args.provider:
        cmd += ["--provider", args.provider]
    if args.timing:
        cmd += ["--timing", args.timing]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        msg = r.stderr.strip().removeprefix("tctune: error: ") or f"exit status {r.returncode}"
        raise (UsageError if r.returncode == 2 else ExportError)(msg)
    rows = json.loads(r.stdout)
    return rows if isinstance(rows, list) else [rows]


def _cmd_bench(args) -> int:
    try:
        batches = list(parse_batch_sizes(args.batch)) if args.batch else [None]
    except UsageError:
        raise UsageError(f"invalid --batch {args.batch!r}\n  fix: a positive integer, a comma list (1,8,32) or a range "
                         "LO-HI (1-64: doubling from 1, 64 included)") from None
    if len(args.artifact) > 1:
        # Each artifact in a process of its own: runtimes (onnxruntime's thread pool, torch's) left alive by
        # one would otherwise slow the next one down (seen: a .pt2 timed 300x slower after an .onnx).
        rows = [row for a in args.artifact for row in _bench_in_child(a, args)]
    else:
        rows = [bench_artifact(args.artifact[0], b, args.iters, args.warmup, args.provider, timing=args.timing)
                for b in batches]
    if args.json:
        print(json.dumps(rows if len(rows) > 1 else rows[0], indent=2))
        return 0
    header = ("artifact", "format", "device", "timing", "batch", "median ms", "p90 ms", "items/s")
    table = [header] + [(r["artifact"], r["format"], r["device"], r.get("timing", "?"), str(r["batch_size"]),
                         f"{r['latency_ms']:.3f}", f"{r['latency_p90_ms']:.3f}", f"{r['throughput']:.1f}") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for n, row in enumerate(table):
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print(f"({rows[0]['iters']} timed calls after {rows[0]['warmup']} warm-up; wall clock per synchronized call)")
    for note in dict.fromkeys(f"{r.get('timing')}: {r['timing_note']}" for r in rows if r.get("timing_note")):
        print(f"({note})")
    return 0
