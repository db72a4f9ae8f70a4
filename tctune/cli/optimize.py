"""``tctune optimize``: the command-line side of :func:`tctune.optimize.optimize`."""
from __future__ import annotations

import argparse
from pathlib import Path

from .common import parse_batch_sizes, parse_devices, parse_fp8_keep, parse_runtimes
from ..search.autotune import AUTOTUNE_COMPILE_FACTOR

EPILOG_OPTIMIZE = """\
The model file is executed as `python model.py` would execute it: only optimize files you trust.
It must define:
  build_model() -> torch.nn.Module
  example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]   (batch on dim 0, fresh random data)
and may define score(model) -> float (your own accuracy metric, higher is better: when given, it decides
which precisions are accurate enough, see --min-score-ratio) and calibration_inputs() -> iterable of input
tuples (real data, see --calibration).

What is searched: batch size x precision (those the hardware allows: fp32, tf32, fp16, bf16 on a GPU,
plus fp8 E4M3 GEMMs on sm_89 and newer for inference; fp32 and bf16 on the CPU) x graph passes on/off
(off = the model as written, with torch.autocast for fp16/bf16) x runtime (eager; cudagraphs, inductor and
inductor-cudagraphs on a GPU; compile time is reported); on a GPU also the cast policy of tctune's graph
(autocast: FP32 keep-list, residual adds and embeddings; pure: everything low, like model.half()) and, for
conv nets, the memory format (contiguous or channels-last). Every candidate is timed (CUDA events on a GPU,
perf_counter on the CPU; warm-up, median of repeats) and compared with FP32 eager on the same fresh random
inputs (and on real batches: --calibration); a candidate whose relative L2 error exceeds --max-error
(--max-error-fp8 for fp8) is never chosen, unless the model file gives score(model): then the score decides
(at least --min-score-ratio x the FP32 score). Plain baselines are measured first at
every batch size, in addition to --trials: FP32 eager, autocast and the model cast as a whole (model.half(),
.to(bfloat16)) at each low precision, and on a GPU torch.compile of the fastest of those; then tctune's graph
through the fastest compiled runtime at each low precision. After the trials, with --autotune auto|on, the best
tctune candidate through Inductor is rebuilt with Inductor's max-autotune as one more trial; then the fastest
candidates within 5% are timed once more, then the finalists and the
best baselines are timed side by side (interleaved rounds) and the fastest median wins; the speedup is against the fastest plain baseline at the same batch
size, with a 95% confidence interval. The study is
kept in OUT/study.db: running the same command again adds trials to it.

Outputs in OUT (default tctune_out/<model name>/): report.json, report.md, study.db,
best_config.json, model.onnx (validated in onnxruntime), model.engine (only where TensorRT is
installed).

examples:
  tctune optimize recipes/seed_cnn.py
  tctune optimize recipes/bert_base.py --batch-sizes 32,128 --trials 24 --out runs/bert
  tctune optimize model.py --target h100 --batch-sizes 16-256   (plan alignment for an H100)
"""



def register(sub) -> str:
    """Add the ``optimize`` subcommand; returns its name."""
    o = sub.add_parser("optimize", help="search and measure the fastest accurate configuration of a model file",
                       description="Tune MODEL_FILE for this machine's GPU (or CPU) and write a report and engines.",
                       epilog=EPILOG_OPTIMIZE, formatter_class=argparse.RawDescriptionHelpFormatter)
    o.add_argument("model_file", metavar="MODEL_FILE", help="Python file defining build_model() and example_inputs(batch_size) (it is executed)")
    o.add_argument("--out", metavar="DIR", help="output folder (default: tctune_out/<model name>)")
    o.add_argument("--batch-sizes", default="8,32,128", metavar="LIST",
                   help="batch sizes to search: 8,32,128 or a range 16-256 (doubling from 16, 256 included); default %(default)s")
    o.add_argument("--trials", type=int, default=16, metavar="N", help="searched trials to add to the study in this run, besides the plain baselines (default %(default)s)")
    o.add_argument("--timeout", type=float, metavar="SECONDS", help="stop starting new searched trials after this long (the plain baselines always run; default: no time limit; --trials bounds the run)")
    o.add_argument("--max-error", type=float, default=1e-2, metavar="E",
                   help="largest relative L2 error against FP32 eager a result may have, a fraction below 1 "
                        "(0.02 = 2 %%; default %(default)g)")
    o.add_argument("--mode", choices=("infer", "train"), default="infer",
                   help="infer: forward passes; train: forward, loss_fn, backward, optimizer step (needs "
                        "example_targets and loss_fn in the model file); default %(default)s")
    o.add_argument("--effective-batch", type=int, metavar="N",
                   help="train: samples per optimizer step, by gradient accumulation over the searched micro-batch sizes")
    o.add_argument("--objective", choices=("throughput", "latency", "pareto"), default="throughput",
                   help="throughput (items/s), latency (p99 ms per batch) or pareto (throughput, p99 latency and "
                        "peak memory together; the report lists the Pareto front); default %(default)s")
    o.add_argument("--max-latency-ms", type=float, metavar="MS", help="constraint: p99 latency per batch at most this")
    o.add_argument("--max-memory-mib", type=float, metavar="MIB", help="constraint: peak CUDA memory at most this")
    o.add_argument("--max-error-fp8", type=float, default=5e-2, metavar="E",
                   help="the same limit for FP8 candidates (Ada/Hopper and newer), a fraction below 1, default %(default)g")
    o.add_argument("--min-score-ratio", type=float, default=0.99, metavar="R",
                   help="with score(model) in the model file: a candidate's score must be at least R x the FP32 "
                        "score (default %(default)g, MLPerf's 99%% rule); the score then decides accuracy for every "
                        "precision and --max-error / --max-error-fp8 are reported, not deciding (NaN/inf and "
                        "integer mismatches still reject)")
    o.add_argument("--min-score", type=float, metavar="S",
                   help="with score(model): the lowest score a candidate may have (instead of --min-score-ratio)")
    o.add_argument("--max-mismatch-rate", type=float, default=0.0, metavar="F",
                   help="fraction (0 to 1) of the elements of integer/bool outputs (class ids, counts) that may "
                        "differ from FP32 (default %(default)g: exact)")
    o.add_argument("--output-dtype", choices=("compute", "fp32"), default="compute",
                   help="the dtype of floating outputs in every timed call, the same for tctune's candidates and "
                        "the plain baselines: compute (default): the candidate's compute precision, as "
                        "model.half() / autocast return them (no up-cast copy); fp32: the FP32 model's dtypes, the "
                        "up-cast timed inside each call. Accuracy is compared in float64 either way")
    o.add_argument("--calibration", metavar="DIR",
                   help="folder of real input batches, one .safetensors or .npz file each (keys input_0, input_1, "
                        "... or forward's argument names; read in sorted order, never unpickled): compared beside "
                        "the random inputs, and used for fp16 overflow calibration and FP8 activation scales; in "
                        "--mode train, training batches of the gradient and score check, with example_targets(B) "
                        "(default: the model file's calibration_inputs(), if any)")
    o.add_argument("--fp8-keep", default="auto", metavar="PATTERNS",
                   help="FP8 keep-list: linears kept in bf16 at precision fp8. auto (default): planned by measuring "
                        "which groups of linears (e.g. every layer's FFN down projection) cost the most error, "
                        "then timing up to three keep-lists whose error is under 0.9 x --max-error-fp8 and keeping "
                        "the fastest; none: every eligible linear in FP8; or comma-separated fnmatch patterns on "
                        "module paths, e.g. '*.output.dense,lm_head'")
    o.add_argument("--fp8-fast-accum", default="auto", choices=("auto", "on", "off"),
                   help="torch._scaled_mm's fast accumulation for the FP8 GEMMs (Hopper: faster, less precise "
                        "accumulation). auto (default): on Ada/Hopper, once the FP8 keep-list is chosen, its graph "
                        "is checked with fast accumulation against 0.9 x --max-error-fp8 (or the score limit) and "
                        "timed, and kept when at least 1%% faster; on: always; off: never. The FP8 ONNX/TensorRT "
                        "export has no such switch (TensorRT chooses its own accumulation); the PyTorch graph and "
                        "AOTInductor keep it")
    o.add_argument("--target", metavar="NAME", help="plan for this GPU (sm_XX, h100, a100, ...): its alignment; measuring stays on this machine")
    o.add_argument("--storage", metavar="URL", help="Optuna storage URL to share a study (default: sqlite file OUT/study.db)")
    o.add_argument("--devices", metavar="LIST",
                   help="GPU indices, e.g. 0,1: one worker process per GPU on the same study (this process "
                        "measures on the first); the study is shared through --storage or OUT/study.db")
    o.add_argument("--seed", type=int, default=0, help="sampler seed, 0 to 4294967295 (default %(default)s)")
    o.add_argument("--runtimes", metavar="LIST",
                   help="execution backends to search: eager, cudagraphs, inductor, inductor-max-autotune, "
                        "inductor-cudagraphs (Inductor's code replayed as a CUDA graph), "
                        "inductor-max-autotune-cudagraphs "
                        "(default: eager,cudagraphs,inductor,inductor-cudagraphs on a GPU; eager on the CPU; "
                        "max-autotune can instead be tried on the finalist, see --autotune)")
    o.add_argument("--compile-budget", type=float, default=300.0, metavar="SECONDS",
                   help="an Inductor compile slower than this rejects its trial and stops further compiles (default %(default)g)")
    o.add_argument("--autotune", default="off", choices=("auto", "on", "off"),
                   help="Inductor max-autotune (Triton GEMM/conv kernels benchmarked per shape, epilogues fused; "
                        "a much longer compile) for the finalist: after the trials, the best tctune candidate "
                        "through inductor or inductor-cudagraphs is rebuilt with max-autotune and measured as one "
                        "more trial, kept only if it wins. off (default): never (on the H200, ResNet-50's max-autotune "
                        "compile ran over 230 s against 4.6 s for the default one); auto: on a CUDA GPU, when "
                        f"{AUTOTUNE_COMPILE_FACTOR:g} x that "
                        "candidate's default compile (an estimate of the max-autotune compile) fits in "
                        "--compile-budget and in the time left before --timeout; on: whenever there is such a "
                        "candidate, whatever the estimate (for a model served long enough to repay a long compile; the "
                        "compile still counts against --compile-budget). It needs inductor or inductor-cudagraphs "
                        "in --runtimes (the CPU's default is eager only: --runtimes eager,inductor); "
                        "report.md's \"Max-autotune finalist\" says what it cost and gave")
    o.add_argument("--no-prune", action="store_true",
                   help="measure every candidate fully (default: one in the slowest quarter so far stops early)")
    o.add_argument("--no-export", action="store_true", help="skip ONNX/TensorRT export")
    o.add_argument("--quiet", "-q", action="store_true", help="no progress bar or log lines; only the summary")
    o.add_argument("--debug", action="store_true", help="show tracebacks")
    o.add_argument("--worker-config", metavar="JSON", help=argparse.SUPPRESS)  # a worker's TuneConfig (--devices)
    return "optimize"


def _summary(report: dict, out: Path) -> str:
    """The winner summary printed after a run (:func:`tctune.report.console_summary`)."""
    from ..report import console_summary

    return console_summary(report, out)


def config_from_args(args) -> "TuneConfig":
    """The ``TuneConfig`` of the parsed ``optimize`` options; a worker's (``--worker-config``) as sent.

    Raises:
        UsageError: a bad option value (naming the field; ``tctune.cli.main`` prints it as the flag).
    """
    from ..search import TuneConfig

    if args.worker_config:
        return TuneConfig.from_json(args.worker_config)
    out = Path(args.out) if args.out else Path("tctune_out") / Path(args.model_file).stem
    return TuneConfig(out_dir=str(out), batch_sizes=parse_batch_sizes(args.batch_sizes), trials=args.trials,
                      timeout_s=args.timeout, max_error=args.max_error, max_error_fp8=args.max_error_fp8,
                      target=args.target, storage=args.storage, seed=args.seed, export=not args.no_export,
                      quiet=args.quiet, runtimes=parse_runtimes(args.runtimes), compile_budget_s=args.compile_budget,
                      objective=args.objective, mode=args.mode, effective_batch=args.effective_batch,
                      prune=not args.no_prune, devices=parse_devices(args.devices) if args.devices else None,
                      max_latency_ms=args.max_latency_ms, max_memory_mib=args.max_memory_mib,
                      fp8_keep=parse_fp8_keep(args.fp8_keep), min_score_ratio=args.min_score_ratio,
                      min_score=args.min_score, max_mismatch_rate=args.max_mismatch_rate,
                      calibration=args.calibration, output_dtype=args.output_dtype,
                      fp8_fast_accum=args.fp8_fast_accum, autotune=args.autotune)


def run(args) -> int:
    from ..optimize import optimize

    cfg = config_from_args(args)
    report = optimize(args.model_file, cfg)
    if not cfg.worker:
        print(_summary(report, Path(cfg.out_dir)))
    if report.get("interrupted"):
        return 130
    if (report.get("artifacts") or {}).get("onnx_failed"):
        return 1  # the export of the answer failed, as `tctune export` exits on a failed format
    return 0 if report.get("best") or cfg.worker else 1  # nothing qualified: a non-zero status scripts can see
