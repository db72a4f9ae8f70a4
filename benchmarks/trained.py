"""Precision verdicts on *trained* models: the task score gate against the relative-L2 gate.

Random-weight recipes have no outlier channels, so whether bf16 / fp16 / FP8 keeps a model's accuracy cannot
be read off them. This benchmark trains two models on learnable tasks (never downloaded) and, for every
precision variant, records the task score, the logits' error against FP32 and the throughput:

- ``digits_cnn`` (``recipes/digits_cnn.py``): a small CNN on scikit-learn's 8x8 digits; score = test accuracy.
- ``seq_encoder`` (``recipes/seq_encoder.py``): a 4-layer BERT classifier on the "more A than B" counting
  task; score = held-out accuracy.

Variants per model (every tctune graph built by :func:`tctune_graph`, the FP8 plan by :func:`tctune_fp8_plan`):
FP32 eager (the reference); ``model.to(bf16)`` / ``model.to(fp16)`` eager; ``torch.autocast`` bf16 / fp16;
tctune's captured graph at bf16 and fp16 with the ``pure`` and ``autocast`` policies (fp16 calibrated on a
real training batch); FP8 with every eligible linear, with the keep-list tctune's planner picks (relative-L2
aim 0.9 x 5e-2 on a real calibration batch, ``tctune.fp8_plan.plan_graph``) and with hand keep-lists
(``HAND_KEEP``).

Per variant: ``score`` (the recipe's ``score(module)``, the module run eagerly), ``score_ratio`` (to FP32's),
``rel_l2`` / ``max_abs`` of the logits on the held-out inputs against FP32 eager (``tctune.measure.compare``;
float64), ``top1_agreement`` with FP32's predictions, and ``throughput`` (items/s: the module wrapped by
``tctune.runtime.wrap`` for ``--runtime``, ``tctune.measure.time_call`` on fresh ``example_inputs``: warm-up, 5
repeats timed with CUDA events, median). The two gates: ``l2_gate`` -- ``rel_l2 <= 1e-2`` (FP8: ``<= 5e-2``),
tctune's limits; ``score_gate`` -- ``score >= 0.99 x`` the FP32 score (MLPerf's 99 % rule); ``accepted_by``
names which accept (``both``, ``score only``, ``L2 only``, ``neither``). TF32 is off for every variant.

A model whose FP32 score is near chance (below ``chance + UNTRAINED_MARGIN x (1 - chance)``, chance = 1 / number
of classes) is flagged: its entry has ``"trained": false``, its rows keep their measurements but their gates
are ``null`` and ``accepted_by`` is ``"model not trained"``, and the table says so. A recipe whose
``build_model()`` raises (the encoder refuses a training below its ``MIN_ACCURACY``) gets an entry with
``build_error`` and no rows. The FP32 score of every model is printed as it is measured.

Usage::

    timeout 570 python benchmarks/trained.py --out OUT_DIR   # on a CUDA GPU: both models, about 5-7 min (estimated)
    python benchmarks/trained.py --tiny --out /tmp/trained    # CPU dry run: tiny sizes, eager timing (about 2 min)

Writes ``OUT_DIR/trained.json`` and ``OUT_DIR/trained.md`` and prints the table. ``--budget-s``: once that
much wall time has passed, the remaining variants are timed with the ``cudagraphs`` runtime (no compile);
each row names its runtime. Trained weights are cached in ``$TCTUNE_CACHE_DIR`` (default ``~/.cache/tctune``).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from benchload import load_module

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Relative-L2 limits of the error gate (tctune's defaults: ``--max-error`` and ``--max-error-fp8``).
L2_LIMIT = {"fp8": 5e-2}
L2_LIMIT_DEFAULT = 1e-2
#: The score gate: candidate score >= this fraction of the FP32 score (MLPerf's "99 %" accuracy target).
MIN_SCORE_RATIO = 0.99
#: A model counts as *not trained* when its FP32 score is below ``chance + UNTRAINED_MARGIN * (1 - chance)``
#: (chance = 1 / number of classes, from the logits' width): 0.75 for two classes, 0.55 for ten. Its rows keep
#: their measurements but get no gate verdict (``accepted_by`` = ``"model not trained"``): a precision that
#: "keeps" a chance-level score says nothing.
UNTRAINED_MARGIN = 0.5
NOT_TRAINED = "model not trained"

#: Hand FP8 keep-lists per recipe (``fnmatch`` patterns on source module paths; the linears kept bf16).
HAND_KEEP = {
    "digits_cnn": {"fc1 bf16": ("fc1",), "fc2 bf16": ("fc2",)},
    "seq_encoder": {"FFN bf16": ("*.intermediate.dense", "*.layer.*[0-9].output.dense"),
                    "attention bf16": ("*.attention.*",)},
}
#: Throughput batch sizes (GPU, ``--tiny``).
BATCH = {"digits_cnn": (4096, 64), "seq_encoder": (256, 8)}


def tctune_graph(captured, hw, precision: str, policy: str, fp8_keep=(), calibration=None):
    """tctune's rewritten graph of ``captured`` for ``(precision, policy, fp8_keep)``: the one call into tctune's
    pass pipeline (repoint here when it moves). ``calibration``: a list of input tuples for fp16 overflow
    analysis. Returns ``(graph module, pass results)``."""
    from tctune.trial import apply_passes

    return apply_passes(captured, hw, precision, calibration=calibration, policy=policy, fp8_keep=tuple(fp8_keep))


def tctune_fp8_plan(captured, hw, inputs, ref, device, policy: str = "autocast"):
    """tctune's FP8 keep-list plan for ``captured`` on calibration ``inputs`` against FP32 outputs ``ref``."""
    from tctune.fp8_plan import plan_graph

    from tctune.trial import apply_passes

    def build(keep, names):
        return apply_passes(captured, hw, "fp8", names, policy=policy, fp8_keep=tuple(keep))[0]

    return plan_graph(build, inputs, ref, L2_LIMIT["fp8"], device=device)


def load_recipe(name: str):
    """Import ``recipes/<name>.py`` as the module ``trained_recipe_<name>`` (not through sys.path), registered in
    ``sys.modules``: Dynamo looks up the module of every function it inlines (the model's forward, under the
    autocast wrapper) there. Loaded once per process."""
    return load_module(f"trained_recipe_{name}", ROOT / "recipes" / f"{name}.py")


def heldout(name: str, recipe):
    """The held-out inputs ``score`` uses (CPU): digits' test images or the encoder's test sequences."""
    if name == "digits_cnn":
        return recipe.load_data()[2]
    return recipe.test_set()[0]


def variants(name: str, model, captured, hw, device, calib, plan):
    """``(label, precision, build())`` for every variant; ``build`` returns the module to run (FP32 inputs)."""
    from tctune.runtime import Autocast

    def cast(dtype):
        return lambda: copy.deepcopy(model).to(dtype)

    def graph(precision, policy, keep=()):
        def build():
            g, _ = tctune_graph(captured, hw, precision, policy, keep, calibration=[calib])
            return g.to(device)
        return build

    out = [("FP32 eager", "fp32", lambda: model),
           ("model.to(bf16)", "bf16", cast(torch.bfloat16)),
           ("model.to(fp16)", "fp16", cast(torch.float16)),
           ("autocast bf16", "bf16", lambda: Autocast(model, torch.bfloat16, device.type)),
           ("autocast fp16", "fp16", lambda: Autocast(model, torch.float16, device.type))]
    for prec in ("bf16", "fp16"):
        for policy in ("pure", "autocast"):
            out.append((f"tctune {prec} {policy}", prec, graph(prec, policy)))
    # FP8 keep-lists, each measured once: a hand list or "all eligible" that equals the plan's is labelled so.
    planned = tuple(sorted(plan.keep)) if plan is not None and plan.usable else None
    keeps = {(): "all eligible"}
    for label, keep in HAND_KEEP[name].items():
        keeps.setdefault(tuple(sorted(keep)), label)
    if planned is not None:
        keeps[planned] = (keeps[planned] + " = planned") if planned in keeps else \
            f"planned (bf16: {', '.join(planned)})"
    for keep, label in keeps.items():
        out.append((f"tctune fp8 {label}", "fp8", graph("fp8", "autocast", keep)))
    return out


def run_model(name: str, args, hw, device, t_start: float) -> dict:
    """Train/load ``name``, plan FP8, and measure every variant; returns the model's JSON entry."""
    from tctune.capture import capture
    from tctune.measure import compare, precision_mode, release_memory

    recipe = load_recipe(name)
    t0 = time.perf_counter()
    try:
        model = recipe.build_model().to(device).eval()
    except Exception as exc:  # noqa: BLE001 - e.g. a training that failed its recipe's accuracy check
        msg = f"{type(exc).__name__}: {exc}"
        print(f"  {name}: build_model() failed, no rows: {msg}", flush=True)
        return {"model": name, "size": getattr(recipe, "SIZE", None), "build_error": msg, "trained": False,
                "fp32_score": None, "rows": []}
    build_s = time.perf_counter() - t0
    x_held = heldout(name, recipe)
    batch = BATCH[name][1 if args.tiny else 0]
    calib = tuple(t.to(device) for t in next(iter(recipe.calibration_inputs())))
    with precision_mode("fp32"), torch.inference_mode():
        ref_logits = recipe.predict(model, x_held)
        calib_ref = model(*calib)
    captured = capture(model, calib)
    chance = 1.0 / ref_logits.shape[-1]
    min_trained = chance + UNTRAINED_MARGIN * (1 - chance)
    entry = {"model": name, "build_s": build_s, "batch_size": batch, "heldout_items": len(x_held),
             "size": getattr(recipe, "SIZE", None), "chance": chance, "min_trained_score": min_trained, "rows": []}
    plan = None
    t0 = time.perf_counter()
    try:
        with precision_mode("fp8"):
            plan = tctune_fp8_plan(captured, hw, calib, calib_ref, device)
        entry["fp8_plan"] = plan.to_dict()
    except Exception as exc:  # noqa: BLE001 - a plan that cannot run still leaves the other variants
        entry["fp8_plan"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    entry["fp8_plan_s"] = time.perf_counter() - t0
    fp32_score = fp32_tp = None
    trained = None
    for label, precision, build in variants(name, model, captured, hw, device, calib, plan):
        row = {"variant": label, "precision": precision}
        runtime = args.runtime
        if runtime != "eager" and time.perf_counter() - t_start > args.budget_s:
            runtime = "cudagraphs" if device.type == "cuda" else "eager"
        row["runtime"] = runtime
        module = None
        try:
            with precision_mode(precision):
                module = build()
                row["score"] = float(recipe.score(module))
                logits = recipe.predict(module, x_held)
            err = compare(logits, ref_logits)
            row.update(rel_l2=err.rel_l2_error, max_abs=err.max_abs_error, nonfinite=err.nonfinite,
                       top1_agreement=float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()))
            inputs = tuple(t.to(device) for t in recipe.example_inputs(batch))
            try:
                row.update(throughput(module, runtime, inputs, batch, device, precision))
            except Exception as exc:  # noqa: BLE001 - a runtime that fails: time the module without compiling
                fallback = "cudagraphs" if device.type == "cuda" and runtime != "cudagraphs" else "eager"
                row["timing_error"] = f"{runtime}: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                if args.verbose:
                    traceback.print_exc()
                row["runtime"] = runtime = fallback
                release_memory(device)
                row.update(throughput(module, runtime, inputs, batch, device, precision))
        except Exception as exc:  # noqa: BLE001 - one failing variant is a result, not the end of the run
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}" if str(exc) else type(exc).__name__
            if args.verbose:
                traceback.print_exc()
        finally:
            module = None
            release_memory(device)
        if precision == "fp32" and "score" in row:
            fp32_score, fp32_tp = row["score"], row.get("throughput")
            trained = is_trained(fp32_score, chance)
            print(f"  {name}: FP32 score {fp32_score:.4f} (chance {chance:.2f}, trained from {min_trained:.2f})"
                  + ("" if trained else f" -- {NOT_TRAINED.upper()}: no gate verdicts for its rows"), flush=True)
        gates(row, fp32_score, fp32_tp, trained=trained is not False)
        entry["rows"].append(row)
        print(f"  {name}: {label}: " + ", ".join(f"{k}={_fmt(row.get(k))}" for k in
              ("score", "rel_l2", "throughput", "accepted_by", "error") if k in row), flush=True)
    entry["fp32_score"] = fp32_score
    entry["trained"] = trained
    return entry


def is_trained(fp32_score: float, chance: float) -> bool:
    """Whether an FP32 score (in [0, 1]) is clear of ``chance`` by ``UNTRAINED_MARGIN`` of the way to 1."""
    return fp32_score >= chance + UNTRAINED_MARGIN * (1 - chance)


def throughput(module, runtime: str, inputs: tuple, batch: int, device, precision: str) -> dict:
    """``{"throughput": items/s, "latency_ms", "setup_s"}`` of ``module`` on ``inputs`` through ``runtime``
    (``tctune.runtime.wrap`` then ``tctune.measure.time_call``: warm-up, 5 repeats, median; TF32 off except tf32).
    Dynamo's caches are reset around a compiled run: the variants' modules share forward code."""
    from tctune.measure import precision_mode, time_call
    from tctune.runtime import wrap

    compiled = runtime.startswith("inductor")
    if compiled:
        torch._dynamo.reset()
    fn = None
    try:
        with precision_mode(precision):
            fn, setup_s = wrap(module, runtime, inputs)
            timing = time_call(lambda: fn(*inputs), batch, device, single_calls=0,
                               target_repeat_s=0.1 if device.type == "cuda" else 0.02, max_iterations=200)
    finally:
        fn = None
        if compiled:
            torch._dynamo.reset()
    return {"throughput": timing.throughput, "latency_ms": timing.latency_ms, "setup_s": setup_s}


def gates(row: dict, fp32_score: float | None, fp32_tp: float | None, trained: bool = True) -> None:
    """Fill ``score_ratio``, ``speedup``, ``l2_limit``, ``l2_gate``, ``score_gate`` and ``accepted_by`` of ``row``.
    ``trained=False`` (the FP32 model scores near chance, :func:`is_trained`): the ratios are filled, the gates
    are ``None`` and ``accepted_by`` is ``NOT_TRAINED``."""
    limit = L2_LIMIT.get(row["precision"], L2_LIMIT_DEFAULT)
    row["l2_limit"] = limit
    if "score" not in row or fp32_score is None:
        row.update(l2_gate=False, score_gate=False, accepted_by="neither")
        return
    row["score_ratio"] = row["score"] / fp32_score if fp32_score else math.nan
    if row.get("throughput") and fp32_tp:
        row["speedup"] = row["throughput"] / fp32_tp
    if not trained:
        row.update(l2_gate=None, score_gate=None, accepted_by=NOT_TRAINED)
        return
    row["l2_gate"] = bool(row["nonfinite"] == 0 and row["rel_l2"] <= limit)
    row["score_gate"] = bool(row["score"] >= MIN_SCORE_RATIO * fp32_score)
    row["accepted_by"] = {(True, True): "both", (False, True): "score only", (True, False): "L2 only",
                          (False, False): "neither"}[(row["l2_gate"], row["score_gate"])]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) < 1e-2:
            return f"{v:.2e}"
        return f"{v:.4f}"
    return str(v)


def table(result: dict) -> str:
    """The markdown table of every model's rows."""
    head = ("model", "variant", "runtime", "score", "score / FP32", "rel. L2", "L2 limit", "top-1 agree",
            "items/s", "x FP32", "L2 gate", "score gate", "accepted by")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in result["models"]:
        for r in m["rows"]:
            cells = (m["model"], r["variant"], r.get("runtime"), r.get("score"), r.get("score_ratio"),
                     r.get("rel_l2"), r.get("l2_limit"), r.get("top1_agreement"), r.get("throughput"),
                     r.get("speedup"), r.get("l2_gate"), r.get("score_gate"),
                     r.get("accepted_by") if "error" not in r else f"failed: {r['error'][:80]}")
            lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    for m in result["models"]:
        if m.get("build_error"):
            lines.append(f"\n{m['model']}: not measured: {m['build_error']}")
        elif m.get("trained") is False:
            lines.append(f"\n{m['model']}: {NOT_TRAINED.upper()}: FP32 score {_fmt(m['fp32_score'])} (chance "
                         f"{_fmt(m['chance'])}, needs {_fmt(m['min_trained_score'])}); its rows carry no gate verdicts")
    for m in result["models"]:
        if m.get("build_error"):
            continue
        plan = m.get("fp8_plan") or {}
        lines.append(f"\n{m['model']}: FP8 plan: {plan.get('summary') or plan.get('error')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for trained.json and trained.md")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: tiny encoder, small batches, eager timing")
    ap.add_argument("--models", default="digits_cnn,seq_encoder", help="comma-separated recipes (default both)")
    ap.add_argument("--runtime", default=None, choices=("eager", "cudagraphs", "inductor", "inductor-cudagraphs"),
                    help="tctune runtime for timing (default: inductor-cudagraphs on "
                    "a GPU, eager on the CPU or with --tiny)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="after this much wall time, time the remaining "
                    "variants with cudagraphs instead of compiling (default 330)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing variants")
    args = ap.parse_args(argv)
    if args.tiny:
        os.environ.setdefault("TCTUNE_SEQ_ENCODER_SIZE", "tiny")
    from tctune.hardware import resolve

    hw = resolve()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if args.runtime is None:
        args.runtime = "inductor-cudagraphs" if device.type == "cuda" and not args.tiny else "eager"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "hardware": hw.to_dict(), "runtime": args.runtime, "tiny": args.tiny,
              "l2_limits": {"default": L2_LIMIT_DEFAULT, **L2_LIMIT}, "min_score_ratio": MIN_SCORE_RATIO,
              "models": []}
    for name in [m for m in args.models.split(",") if m]:
        if name not in HAND_KEEP:
            ap.error(f"unknown model {name!r}; choose from {', '.join(HAND_KEEP)}")
        print(f"{name}:", flush=True)
        result["models"].append(run_model(name, args, hw, device, t_start))
        (out / "trained.json").write_text(json.dumps(result, indent=1))
    result["wall_s"] = time.perf_counter() - t_start
    (out / "trained.json").write_text(json.dumps(result, indent=1))
    md = table(result)
    (out / "trained.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
