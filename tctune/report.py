"""``report.json`` and ``report.md``: what was measured, what won, and why.

Throughputs are items/s, latencies ms per batch, memory MiB. Files are written atomically (temporary
file + rename), so an interrupted run never leaves a half-written report.
"""
from __future__ import annotations

import collections
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import optuna

from .errors import clip
from .search import best_trial, is_feasible, pareto_front
from .search.autotune import autotune_lines
from .search.baselines import run_params
from .search.results import headline, resumed_words

TRIAL_FIELDS = ("throughput", "latency_ms", "latency_p50_ms", "latency_p99_ms", "repeats_ms", "peak_memory_mib", "max_rel_error", "max_abs_error", "nonfinite",
                "float_outputs", "exact_outputs", "mismatch_rate", "mismatched", "logits_outputs", "top1_agreement", "kl_divergence",
                "unchecked_outputs", "fp64_ratio", "description", "setup_s",
                "score", "score_ratio", "score_fp32", "score_limit", "score_s", "real_batches", "train_loss_rel_diff",
                "check_rows", "check_batch_size")


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; reports are for sharing
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def trial_record(t: optuna.trial.FrozenTrial) -> dict:
    """One row of ``report.json``'s ``trials``."""
    row = {"number": t.number, "state": t.state.name, "params": run_params(t.params, t.user_attrs),  # runtime as run
           "fail_reason": t.user_attrs.get("fail_reason"), "fail_kind": t.user_attrs.get("fail_kind")}
    for k in TRIAL_FIELDS:
        row[k] = t.user_attrs.get(k)
    row["feasible"] = is_feasible(t)
    row["baseline"] = t.user_attrs.get("baseline")  # a plain baseline's name (tctune.search.baselines), else None
    row["model_cast"] = bool(t.user_attrs.get("model_cast"))
    row["run_id"] = t.user_attrs.get("run_id")
    row["autotune_of"] = t.user_attrs.get("autotune_of")  # the max-autotune finalist: the trial it rebuilt
    row["score"] = t.user_attrs.get("score")
    row["passes"] = t.user_attrs.get("passes", [])
    # an FP8 graph trial's exact keep-list (what best_config.json rebuilds); its description writes it compactly
    # (tctune.fp8_plan.keep_label); None for other trials
    row["fp8_keep"] = t.user_attrs.get("fp8_keep")
    row["fp8_fast_accum"] = t.user_attrs.get("fp8_fast_accum")  # the same trials: torch._scaled_mm's use_fast_accum
    if t.state == optuna.trial.TrialState.FAIL and row["fail_reason"] is None:
        row["fail_reason"] = "trial failed or was interrupted (see the log)"
    return row


def baseline_rows(trials: list[dict], side_by_side: dict | None = None) -> list[dict]:
    """``report.json``'s ``baselines``: one row per plain baseline trial that was measured or rejected (not
    skipped or cut off), by batch size then name: ``{"name", "trial", "precision", "runtime", "batch_size",
    "model_cast", "throughput", "latency_ms", "latency_p99_ms", "peak_memory_mib", "max_rel_error", "score",
    "feasible", "fail_reason", "run_id", "side_by_side_throughput"}``; ``throughput`` is the trial's own timing
    (possibly of an earlier run: ``run_id``), ``side_by_side_throughput`` the median of this run's side-by-side
    timing when it was in it (``side_by_side``: the current run's, or None)."""
    sbs = {e["trial"]: e.get("throughput") for e in (side_by_side or {}).get("entries") or []}
    out = []
    for r in trials:
        if not r.get("baseline") or (r["state"] != "COMPLETE" and not r.get("fail_reason")) or r["state"] == "PRUNED":
            continue
        p = r["params"]
        out.append({"name": r["baseline"], "trial": r["number"], "precision": p.get("precision"),
                    "runtime": p.get("runtime", "eager"), "batch_size": p.get("batch_size"),
                    "model_cast": r.get("model_cast", False), "throughput": r["throughput"],
                    "latency_ms": r["latency_ms"], "latency_p99_ms": r["latency_p99_ms"],
                    "peak_memory_mib": r["peak_memory_mib"], "max_rel_error": r["max_rel_error"],
                    "score": r.get("score"), "feasible": r["feasible"], "fail_reason": r["fail_reason"],
                    "run_id": r.get("run_id"), "side_by_side_throughput": sbs.get(r["number"])})
    return sorted(out, key=lambda b: (b["batch_size"] or 0, b["trial"]))


def baselines(trials: list[dict]) -> dict[int, dict]:
    """FP32 eager trials by batch size, the fastest if measured twice."""
    out: dict[int, dict] = {}
    for r in trials:
        p = r["params"]
        if (r["state"] == "COMPLETE" and p.get("precision") == "fp32" and not p.get("graph_passes")
                and p.get("runtime", "eager") == "eager" and r["throughput"]):
            bs = p["batch_size"]
            if bs not in out or r["throughput"] > out[bs]["throughput"]:
                out[bs] = r
    return out


def base_trial(r: dict) -> dict | None:
    """The baseline trial row of report ``r`` (FP32 eager at the best's batch size), or None."""
    n = (r.get("baseline") or {}).get("trial")
    return next((t for t in r["trials"] if t["number"] == n), None)


#: What report.md's two throughputs of one trial are: said beside every table that shows both.
TIMINGS_NOTE = ("First timing: the trial's own measurement when it ran (possibly in an earlier run of a resumed study); "
                "side-by-side median: the median of this run's interleaved re-timing of the finalists and baselines "
                "(A B C A B C …), the number the verdict compares.")


def _headline_timing(best: dict) -> str:
    """Which timing the headline's numbers of ``report.json``'s ``best`` (``best_baseline``, ``best_searched``) are
    from: "side-by-side median" or "first timing" (:func:`tctune.search.results.headline`'s ``timing``)."""
    return "side-by-side median" if (best.get("timing") or "").startswith("side by side") else "first timing"


#: A skip reason in report.md's pass tables is cut to this many characters (``report.json`` keeps it whole).
SKIP_REASON_SHOWN = 80


def skip_cell(skipped: list[dict] | None, reasons: int = 3) -> str:
    """report.md's cell for the nodes a pass left alone and why (what ``tctune inspect`` prints), grouped by reason:
    "reason (node, +N more); …", each reason cut to ``SKIP_REASON_SHOWN`` characters, at most ``reasons`` of
    them ("+N more reasons" after). ``skipped``: the pass's ``[{"node", "reason"}]`` (``report.json``'s
    ``passes``) or a trial's grouped ``[{"reason", "nodes", "node"}]``
    (:func:`tctune.search.evaluate.skip_reasons`); empty when the pass recorded none."""
    groups: dict[str, list] = {}
    for sk in skipped or []:
        g = groups.setdefault(sk["reason"], [sk["node"], 0])
        g[1] += sk.get("nodes", 1)
    cells = []
    for reason, (node, n) in list(groups.items())[:reasons]:
        short = reason if len(reason) <= SKIP_REASON_SHOWN else reason[:SKIP_REASON_SHOWN - 1].rstrip() + "…"
        cells.append(f"{short} ({node}" + (f", +{n - 1} more" if n > 1 else "") + ")")
    if len(groups) > reasons:
        cells.append(f"+{len(groups) - reasons} more reasons")
    return "; ".join(cells).replace("|", "\\|")


def resumed_line(r: dict) -> str:
    """report.md's words for ``r["resumed"]`` (a resumed study): the earlier trials kept and how many this run added."""
    added = r["study"]["n_trials"] - r["resumed"]["trials"]
    return (f"{resumed_words(r['resumed'])}; this run added "
            + (f"{added} trial{'s' if added != 1 else ''}" if added > 0 else "none"))


def measured_this_run(r: dict, row: dict | None) -> bool:
    """Whether trial ``row`` (a ``trials`` row, or ``best``: its number under ``trial``) of report ``r`` was
    measured by the run that wrote the report: not one of the earlier runs' trials ``r["resumed"]`` kept."""
    if not row:
        return False
    n = row.get("number", row.get("trial"))
    return n not in set((r.get("resumed") or {}).get("numbers") or ())


def measurement_noise(*rows: dict | None) -> float | None:
    """Largest relative spread (max − min) / median of the repeats of the given trial rows, or None."""
    spreads = []
    for row in rows:
        reps = (row or {}).get("repeats_ms") or []
        if len(reps) >= 2:
            med = sorted(reps)[len(reps) // 2]
            spreads.append((max(reps) - min(reps)) / med if med else 0.0)
    return max(spreads) if spreads else None


#: Above this spread of a trial's repeats, or this ratio between its repeat median and its single-call p50,
#: its timing is reported as unstable (a busy machine: other processes, CPU frequency changes).
UNSTABLE_SPREAD = 0.5
UNSTABLE_RATIO = 2.0


def unstable_timing(*rows: dict | None) -> str | None:
    """Why the timing of these trial rows cannot be trusted, or None: repeats spread by more than
    ``UNSTABLE_SPREAD`` of their median, or the repeat median (``latency_ms``) and the single-call median
    (``latency_p50_ms``) disagreeing by more than ``UNSTABLE_RATIO``x and 0.05 ms."""
    spread = measurement_noise(*rows)
    if spread is not None and spread > UNSTABLE_SPREAD:
        return f"repeats spread by {spread:.0%} of their median"
    for row in rows:
        a, b = (row or {}).get("latency_ms"), (row or {}).get("latency_p50_ms")
        # (a small absolute gap is a synchronized single call's fixed overhead on a tiny GPU workload, not noise)
        if a and b and max(a, b) / min(a, b) > UNSTABLE_RATIO and abs(a - b) > 0.05:
            return (f"trial {row.get('number', row.get('trial'))}: median of repeats {a:.3g} ms vs single calls {b:.3g} ms "
                    f"({max(a, b) / min(a, b):.1f}x apart)")
    return None


def timing_warning(r: dict) -> str | None:
    """The one ``report.md`` line warning that the best's speedup over FP32 eager rests on noisy timing, or None.

    Both checks read the repeats of the best and of its FP32 eager baseline (:func:`base_trial`): **Unstable
    timing** when :func:`unstable_timing` finds them untrustworthy (it names why), else **Within measurement
    noise** when their relative spread (:func:`measurement_noise`) is at least the distance of
    ``speedup_vs_baseline`` from 1.0 (not when the best is that baseline). One line: an unstable timing is also
    within its noise, and the spread is stated once."""
    b = r.get("best")
    if not b:
        return None
    base_row = base_trial(r)
    shaky = unstable_timing(b, base_row)
    if shaky:
        return (f"**Unstable timing** ({shaky}): the machine was busy while measuring; the speedups above are not "
                "reliable. Measure again on an idle machine.")
    noise = measurement_noise(b, base_row)
    if ((base_row or {}).get("number") != b.get("trial") and noise is not None  # not when best = baseline
            and b.get("speedup_vs_baseline") and abs(b["speedup_vs_baseline"] - 1) <= noise):
        return (f"**Within measurement noise**: the repeats of the best (trial {b.get('trial')}) and of its FP32 "
                f"eager baseline (trial {(base_row or {}).get('number')}) spread by up to {noise:.0%}, more than the "
                "difference between them. Measure on a quiet machine (or more repeats) before relying on this speedup.")
    return None


def fp32_baseline_entry(trials: list[dict], side_by_side: dict | None, fp32: dict, timing: str) -> dict:
    """``report.json``'s top-level ``baseline``: FP32 eager at the best's batch size, with the same fields, and the
    same meaning of each, as its ``baselines`` entry (:func:`baseline_rows`: ``throughput``, ``latency_ms``,
    ``latency_p99_ms`` from the trial's own first timing, ``side_by_side_throughput`` the median of this run's
    side-by-side timing or None), plus ``graph_passes: False``, ``compared_throughput`` (items/s: the number the
    best's ``speedup_vs_fp32_eager`` divides by, ``fp32``'s from :func:`tctune.search.results.headline`),
    ``compared_on`` ("side-by-side median" or "first timing"), ``timing`` (the headline's), ``first_throughput``
    (= ``throughput``, the older key) and ``timings`` (each number's field -> which timing it is from)."""
    row = next(b for b in baseline_rows(trials, side_by_side) if b["trial"] == fp32["trial"])
    sbs = timing.startswith("side by side")
    first = "first timing" + (f" (run {row['run_id']})" if row.get("run_id") else "")
    return {**row, "graph_passes": False, "compared_throughput": fp32["throughput"],
            "compared_on": "side-by-side median" if sbs else "first timing", "timing": timing,
            "first_throughput": row["throughput"],
            "timings": {"throughput": first, "latency_ms": first, "latency_p99_ms": first,
                        "first_throughput": first, "side_by_side_throughput": "side-by-side median, this run",
                        "compared_throughput": "side-by-side median, this run" if sbs else first}}


def build_report(study: optuna.Study, *, hardware: dict, measured_on: str, config: dict, model: dict,
                 passes: list[dict], artifacts: dict, capture: dict, extra: dict | None = None) -> dict:
    """Assemble the report dictionary (see README, "Output files", for every field)."""
    every = study.get_trials(deepcopy=False)
    trials = [trial_record(t) for t in every if t.state != optuna.trial.TrialState.WAITING]
    not_started = sum(t.state == optuna.trial.TrialState.WAITING for t in every)
    bt = best_trial(study)
    best = None
    baseline = None
    head = headline(study, bt) if bt is not None else None
    resumed = study.user_attrs.get("resumed")
    sbs = study.user_attrs.get("side_by_side")
    current_sbs = sbs if sbs and sbs.get("run_id") == study.user_attrs.get("run_id") else None
    if bt is not None:
        best = dict(next(r for r in trials if r["number"] == bt.number))
        best = {"trial": best.pop("number"), **best}  # like every other trial reference in the report
        from .search import confirmed_throughputs
        best["confirmed_throughput"] = confirmed_throughputs(study).get(bt.number)
        for k in ("chosen_throughput", "chosen_on", "timing", "run_id", "baseline_wins", "best_baseline",
                  "best_baseline_any_batch", "speedup_vs_best_baseline", "speedup_vs_fp32_eager",
                  "speedup_vs_best_baseline_any_batch", "speedup_ci95", "speedup_p_value", "speedup_rounds",
                  "best_searched", "kind", "name", "verdict"):
            best[k] = head[k]
        best["speedup_note"] = head["note"]
        if best.get("baseline"):  # what a user calls it: "model.half() eager", "torch.compile(model.half())"
            from .search.baselines import baseline_label

            best["label"] = baseline_label(best["baseline"])
        best["speedup_vs_baseline"] = head["speedup_vs_fp32_eager"]  # the FP32 eager one (older key)
        f32 = head["fp32_eager"]
        if f32:
            baseline = fp32_baseline_entry(trials, current_sbs, f32, head["timing"])
        best["accepted_by"] = accepted_by(best, config)
    report = {
        "tctune_version": model.get("tctune_version"),
        "model": model,
        "hardware": hardware,
        "measured_on": measured_on,
        "config": config,
        "study": {"name": study.study_name, "n_trials": len(trials),
                  "n_complete": sum(r["state"] == "COMPLETE" for r in trials),
                  "n_queued_not_run": not_started},
        "capture": capture,
        "baseline": baseline,
        "baselines": baseline_rows(trials, current_sbs),
        "best_baseline_any_batch": head["best_baseline_any_batch"] if head else None,
        "side_by_side": dict(sbs, current_run=sbs is current_sbs) if sbs else None,
        "best": best,
        "pareto_front": [{"trial": t.number, "params": run_params(t.params, t.user_attrs), "throughput": t.user_attrs.get("throughput"),
                          "latency_p99_ms": t.user_attrs.get("latency_p99_ms"),
                          "peak_memory_mib": t.user_attrs.get("peak_memory_mib"),
                          "max_rel_error": t.user_attrs.get("max_rel_error")} for t in pareto_front(study)],
        "passes": passes,
        "trials": trials,
        "artifacts": artifacts,
        "confirmation": study.user_attrs.get("confirmation"),
        # the earlier runs' trials this run found in the study (tctune.search.results.earlier_trials), or None
        "resumed": resumed if resumed and resumed.get("run_id") == study.user_attrs.get("run_id") else None,
    }
    if extra:
        report.update(extra)
    return _clean(report)


def accepted_by(row: dict, config: dict) -> dict:
    """Which accuracy gate accepted trial ``row`` and by how much (``report.json``'s ``best.accepted_by``).

    ``{"gate": "score", "value", "limit", "margin", "rel_l2", "rel_l2_limit"}`` when the trial was scored (the
    score gate decides: ``margin = score - limit``, in the score's units), else ``{"gate": "relative_l2", "value",
    "limit", "margin"}`` (``margin = limit - relative L2``). ``rel_l2_limit`` is ``max_error`` (``max_error_fp8``
    at precision fp8), ``None`` when the trial had no floating output."""
    fp8 = row["params"].get("precision") == "fp8"
    l2_limit = config.get("max_error_fp8" if fp8 else "max_error")
    rel = None if row.get("float_outputs") == 0 else row.get("max_rel_error")
    if row.get("score") is not None and row.get("score_limit") is not None:
        return {"gate": "score", "value": row["score"], "limit": row["score_limit"],
                "margin": row["score"] - row["score_limit"], "rel_l2": rel, "rel_l2_limit": l2_limit}
    return {"gate": "relative_l2", "value": rel, "limit": l2_limit,
            "margin": None if rel is None or l2_limit is None else l2_limit - rel}


def gate_line(row: dict, config: dict) -> str:
    """The report.md sentence saying which gate accepted trial ``row`` and by how much, e.g. "accepted by the
    score gate: 0.9712 >= 0.99 x 0.9722 (margin 0.0086); relative L2 2.1e-02 (limit 1e-02, not deciding
    because a score is given)"."""
    a = row.get("accepted_by") or accepted_by(row, config)
    extra = ""
    if row.get("mismatch_rate") is not None:
        extra = (f"; integer/bool outputs differ in {row['mismatch_rate']:.2%} of their elements (allowed "
                 f"{config.get('max_mismatch_rate') or 0:.2%})")
    if a["gate"] == "score":
        from .search.accuracy import format_score

        rule = (f"{format_score(config['min_score'])} (min_score)" if config.get("min_score") is not None else
                f"{config.get('min_score_ratio', 0.99):g} x {format_score(row.get('score_fp32'))} (FP32 score)")
        rel = "–" if a["rel_l2"] is None else f"{a['rel_l2']:.1e}"
        lim = "" if a["rel_l2_limit"] is None else f"limit {a['rel_l2_limit']:g}, "
        return (f"accepted by the score gate: {a['value']:.4f} >= {rule} (margin {a['margin']:.4f}); relative L2 "
                f"{rel} ({lim}not deciding because a score is given){extra}")
    if a["value"] is None:
        return f"accepted by the exact checks: no floating outputs to compare (no relative L2){extra}"
    return (f"accepted by the relative-L2 gate: {a['value']:.2e} <= {a['limit']:g} (margin {a['margin']:.2e}), on "
            f"fresh random inputs{' and real batches' if row.get('real_batches') else ''}{extra}")


def _score(row: dict) -> str:
    """The trials table's score cell: ``0.9712 (0.999)`` (score, ratio to FP32), or "–"."""
    if row.get("score") is None:
        return "–"
    from .search.accuracy import format_score

    return format_score(row["score"]) + (f" ({row['score_ratio']:.3f})" if row.get("score_ratio") is not None else "")


def _fmt(v: Any, spec: str = ".4g") -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _rel_error(row: dict) -> str:
    """The relative error of a trial row for the tables: "–" when it had no floating output to compare."""
    return "–" if row.get("float_outputs") == 0 else _fmt(row.get("max_rel_error"), ".2e")


def _mismatch(row: dict) -> str:
    rate = row.get("mismatch_rate")
    return "–" if rate is None else f"{rate:.2%}"


def _top1(row: dict) -> str:
    top, kl = row.get("top1_agreement"), row.get("kl_divergence")
    return "–" if top is None else f"{top:.2%}" + (f" / {kl:.1e}" if kl is not None else "")


#: How the top-1 agreement and KL divergence are computed (:func:`tctune.measure.looks_like_logits`): by shape only,
#: so report.md says what they assume wherever it shows them.
LOGITS_NOTE = ("treating the last dim of every floating output of rank ≥ 2 as class scores (a hidden state or an "
               "image qualifies too: read them only for outputs that are class scores; reported, never a limit)")


def accuracy_summary(row: dict) -> str | None:
    """One sentence on how a trial's outputs compare with FP32 beyond the relative error, or None when
    nothing else was measured: integer/bool mismatches, top-1 agreement and KL divergence of logits-like
    outputs, outputs that could not be checked, and the FP64 ratio (see ``tctune.measure.ErrorStats``)."""
    parts = []
    if row.get("float_outputs") == 0:
        parts.append("no floating outputs (no relative error)")
    if row.get("mismatch_rate") is not None:
        parts.append(f"integer/bool outputs: {row['mismatch_rate']:.2%} of elements differ"
                     + (f" ({row['mismatched']} element{'s' if row['mismatched'] != 1 else ''})" if row.get("mismatched") else "")
                     + f" over {row.get('exact_outputs')} exact output(s)")
    if row.get("top1_agreement") is not None:
        parts.append(f"top-1 agreement {row['top1_agreement']:.2%}"
                     + (f", KL(FP32 ‖ candidate) {row['kl_divergence']:.2e} nats" if row.get("kl_divergence") is not None else "")
                     + " " + LOGITS_NOTE)
    if row.get("unchecked_outputs"):
        parts.append(f"**{row['unchecked_outputs']} output(s) not checkable** (not tensors or numbers, or not returned "
                     "by the candidate)")
    if row.get("fp64_ratio") is not None:
        parts.append(f"error against FP64 {row['fp64_ratio']:.3g}x the baseline's")
    return "; ".join(parts) if parts else None


def output_contract_line(output_dtype: str) -> str:
    """``report.md``'s one line on the output-dtype contract (``TuneConfig.output_dtype``) of every timed call."""
    if output_dtype == "fp32":
        return ("Output dtypes: fp32 — every timed call, tctune's and the plain baselines', returns the FP32 "
                "model's output dtypes (low-precision outputs cast up inside the call)")
    return ("Output dtypes: compute — every timed call, tctune's and the plain baselines', returns floating "
            "outputs in its compute precision, as model.half() / autocast return them (no up-cast copy; errors "
            "are computed in float64 after timing)")


def exported_line(r: dict) -> str | None:
    """One sentence on what ``model.onnx`` is for the best trial of report ``r`` (``artifacts.exported_graph``,
    ``tctune.deploy.EXPORTED_GRAPHS``), or None when nothing was exported for it: the model as written in FP32 (no
    tctune pass), the model cast as a whole, or tctune's rewritten graph; for a best that ran the model as written
    under autocast, it says plainly that the file is tctune's graph instead (an engine file cannot hold
    ``torch.autocast``)."""
    a, b = r.get("artifacts") or {}, r.get("best") or {}
    kind = a.get("exported_graph")
    if not b or not kind or not (a.get("onnx") or a.get("onnx_fp32")):
        return None
    p = b.get("params") or {}
    prec = p.get("precision")
    if kind == "model_as_written":
        return "the model as written in FP32: its captured graph, no tctune pass"
    if kind == "model_cast":
        return f"the model cast as a whole to {prec}, as the baseline ran it (no tctune pass)"
    if not p.get("graph_passes"):
        return (f"**tctune's rewritten graph at {prec}, not the model as written**: the best ran the model under "
                f"torch.autocast, which an engine file cannot hold, so the file casts like autocast with tctune's "
                f"passes (listed under Graph passes)")
    return f"tctune's rewritten graph at {prec}, as measured (its passes are listed under Graph passes)"


def fastest_graph_trial(trials: list[dict]) -> dict | None:
    """Of ``report.json``'s trial rows, the fastest completed one of tctune's graph (``params.graph_passes``) that
    recorded its passes: a feasible one when any is, else the fastest rejected one; None when none ran."""
    ran = [t for t in trials if t.get("state") == "COMPLETE" and (t.get("params") or {}).get("graph_passes")
           and t.get("passes") and t.get("throughput") is not None]
    if not ran:
        return None
    return max(ran, key=lambda t: (bool(t.get("feasible")), t["throughput"]))


def study_counts(study: dict, trials: list[dict] | None = None) -> str:
    """The trial counts of ``report.json``'s ``study`` in words, by state from ``trials`` (its trial rows):
    "15 trials: 11 complete, 4 stopped early by the pruner" (and "N skipped (not run)" for pruned trials
    whose ``fail_kind`` is ``skipped``, "N failed", "N still running" when any; a
    complete trial can still be over a limit: the trials table says which). Without ``trials``: the totals."""
    n = study.get("n_trials", 0)
    if not trials:
        return f"{n} trials ({study.get('n_complete', 0)} complete)"
    states = collections.Counter("SKIPPED" if t.get("state") == "PRUNED" and t.get("fail_kind") == "skipped"
                                 else t.get("state") for t in trials)
    parts = [f"{states.get('COMPLETE', 0)} complete"]
    for state, words in (("PRUNED", "stopped early by the pruner"),
                         ("SKIPPED", "skipped (not run)"), ("FAIL", "failed"), ("RUNNING", "still running")):
        if states.get(state):
            parts.append(f"{states[state]} {words}")
    return f"{n} trial{'s' if n != 1 else ''}: " + ", ".join(parts)


def accuracy_rule_line(r: dict) -> str:
    """``report.md``'s one line on which accuracy rule decided the run of report ``r``: the score gate when the
    model file gave ``score(model)`` (``r["score"]["fp32"]`` set; relative L2 then reported only), else the
    relative L2 limit (``max_error``; ``max_error_fp8`` where fp8 was searched); plus the integer/bool rule
    (inference)."""
    cfg, sc = r["config"], r.get("score") or {}
    train = cfg.get("mode") == "train"
    exact = ("" if train else  # a training step's check has gradients only
             "; integer and bool outputs " + (f"may differ in up to {cfg['max_mismatch_rate']:.2%} of their elements"
                                              if cfg.get("max_mismatch_rate") else "must match exactly"))
    where = ("of the gradients of one training step on a seeded random batch (and the real batches when given)"
             if train else "on fresh random inputs" + (" and the real batches" if r.get("real_batches") else ""))
    if sc.get("fp32") is not None:
        from .search.accuracy import format_score

        return (f"Accuracy rule: the model file's score(model) decides, for every precision: {sc.get('rule')} "
                f"(FP32 score {format_score(sc['fp32'])}" + (", after a short training run" if train else "") + "); "
                f"the relative L2 error against FP32 eager {where} is reported, not a limit{exact}; NaN/inf outputs "
                f"reject. score() ran {sc.get('calls')} time(s), {_fmt(sc.get('seconds'), '.1f')} s in all "
                f"({sc.get('cached_graphs')} graphs scored, each once)")
    searched_fp8 = any((t.get("params") or {}).get("precision") == "fp8" for t in r.get("trials") or [])
    fp8 = f" ({cfg['max_error_fp8']:g} at fp8)" if searched_fp8 and cfg.get("max_error_fp8") is not None else ""
    return f"Accuracy rule: relative L2 error ≤ {cfg['max_error']:g}{fp8} against FP32 eager {where}{exact}"


def render_markdown(r: dict) -> str:
    """``report.md``: the same facts as ``report.json``, for people."""
    hw = r["hardware"]
    lines = [f"# tctune report: {r['model']['name']}", ""]
    if r.get("unfinished_stage"):  # written before a stage after the trials; the final report has None here
        stage = r["unfinished_stage"]
        lines += [f"**{stage[0].upper() + stage[1:]} did not finish: the process ended during {stage}** (this report "
                  f"was written before it started; the trials" + (" and the export" if stage == "plots" else "")
                  + " below are complete"
                  + ("; `best_config.json` is written: `tctune export` on it exports the best configuration"
                     if (r.get("artifacts") or {}).get("best_config") and stage.startswith("export") else "")
                  + ").", ""]
    lines += [f"- Model file: `{r['model']['path']}`",
              f"- Hardware spec: {hw.get('name')} ({hw.get('arch')}, compute capability {hw.get('compute_capability') or '–'}, source {hw.get('source')})",
              f"- Measured on: {r['measured_on']}",
              f"- Study: `{r['study']['name']}`, {study_counts(r['study'], r.get('trials'))}"
              + (f"; {resumed_line(r)}" if r.get("resumed") else ""),
              "- " + accuracy_rule_line(r)]
    if r["config"].get("output_dtype"):  # a report written before the option has no contract to state
        lines.append("- " + output_contract_line(r["config"]["output_dtype"]))
    dynamic = r["capture"].get("dynamic") or []
    if any(d["symbol"] != "batch" for d in dynamic):  # capture.dynamic: tctune.capture.dynamic_dims
        lines += ["- Dynamic dimensions (measured at the example sizes): " + ", ".join(
            f"{d['name']} dim {d['dim']} = {d['symbol']} {d['min']}..{d['max'] if d['max'] is not None else '∞'}"
            + (f" (example {d['example']})" if d["symbol"] != "batch" else "") for d in dynamic)]
    if r.get("real_batches") and r["config"].get("mode") == "train":
        lines.append(f"- Real input batches: {r['real_batches']} ({r.get('real_batches_source')}), training batches of the "
                     "accuracy check beside the random one (gradients at the initial weights; with score(), the short "
                     "training run), each with example_targets(B) as targets; not timed, and no graph passes to "
                     "calibrate in --mode train")
    elif r.get("real_batches"):
        lines.append(f"- Real input batches: {r['real_batches']} ({r.get('real_batches_source')}), compared beside the "
                     "random inputs and used for fp16 overflow calibration and FP8 activation scales")
    lines.append("")
    if not r["capture"]["ok"] and r["config"].get("mode") == "train":
        lines += [f"> No graph passes in `--mode train`: {r['capture']['reason']}", ""]
    elif not r["capture"]["ok"]:
        lines += [f"> **Graph capture failed**, so no graph passes ran: {r['capture']['reason']}", ""]
    written = (r.get("model") or {}).get("writes_buffers")
    if written:
        lines += [f"> **The model's forward writes its buffers** ({', '.join(written)}) at every call in eval mode: "
                  "each run starts from another state, so runs of the same inputs differ and the accuracy verdicts "
                  "below compare runs from different states. Update such state only in training "
                  "(`if self.training:`).", ""]
    folder = (r.get("model") or {}).get("output_folder_warning")
    if folder:
        lines += [f"> **Output folder**: {folder}.", ""]
    lines += ["## Result", ""]
    b, base = r["best"], r["baseline"]
    if r.get("interrupted"):  # said once, first: every line below is the answer so far, not the search's answer
        lines += ["**The run was interrupted** (Ctrl-C or a signal) before the search finished: what follows is from "
                  "the trials that finished (they are kept), "
                  + (f"{r['study']['n_queued_not_run']} queued candidate(s) were not started, "
                     if r["study"].get("n_queued_not_run") else "")
                  + "nothing was exported"
                  + ("; `best_config.json` holds the answer so far" if (r.get("artifacts") or {}).get("best_config")
                     else "")
                  + "; running the same command again resumes.", ""]
    if b:
        p = b["params"]
        kind = "the model as written"
        if p.get("graph_passes"):
            kind = "tctune graph passes" + (", pure policy (like model.half())" if p.get("policy") == "pure" else "")
        if b.get("baseline"):
            kind = (f"plain baseline {b['baseline']}" + (f" ({b['label']})" if b.get("label") else "")
                    + (", the model cast as a whole" if b.get("model_cast") else ""))
        chosen = b.get("chosen_throughput") or b["throughput"]
        lines.append(f"Best: **{p['precision']}**, {kind}, runtime {p.get('runtime', 'eager')}, batch {p['batch_size']}: "
                     f"{_fmt(chosen)} items/s" + (f" ({b['chosen_on']})" if b.get("chosen_on") else "") + ", "
                     f"{_fmt(p['batch_size'] / chosen * 1e3 if chosen else b['latency_ms'])} ms per batch"
                     " (from the same timing), relative error " f"{_rel_error(b)}.")
        exp = exported_line(r)
        if exp:
            lines.append(f"- Exported graph: {exp}.")
        lines.append(f"- Accuracy: {gate_line(b, r['config'])}.")
        why = (b.get("verdict") or {}).get("reason")
        rule = (b.get("verdict") or {}).get("rule")
        if (b.get("kind") == "baseline" or b.get("baseline_wins")) and (b.get("verdict") or {}).get(
                "candidates_measured") is False:  # nothing was compared: no win to claim
            stop = " before the run stopped" if r.get("interrupted") else ""
            lines.append(f"- **No tctune candidate was measured{stop}**: the fastest plain baseline measured so far "
                         f"is {b.get('label') or b['baseline']} at batch {p['batch_size']}; this is not a comparison "
                         "with tctune's candidates.")
        elif b.get("kind") == "baseline" or b.get("baseline_wins"):
            srch = b.get("best_searched")
            lines.append("- **A plain baseline wins. Use it**: "
                         + (why or f"{b['baseline']} was the fastest feasible configuration; nothing tctune searched "
                                   "beat it on this machine") + ".")
            if srch:
                lines.append(f"- The fastest tctune candidate: trial {srch['trial']} at batch {srch.get('batch_size')} "
                             f"({srch.get('description') or ''}), "
                             f"{_fmt(srch['throughput'])} items/s ({_headline_timing(b)}, the same timing as the "
                             "answer's).")
        elif why:
            lines.append(f"- **tctune wins**: {why}.")
        if rule:
            lines.append(f"- The rule: {rule}.")
        acc = accuracy_summary(b)
        if acc:
            lines.append(f"- Outputs against FP32: {acc}.")
        if r["config"].get("objective") == "latency":
            lines.append(f"- p99 latency (the objective): {_fmt(b.get('latency_p99_ms'))} ms per batch.")
        lines.append("")
        bb = b.get("best_baseline")
        if bb and b.get("speedup_vs_best_baseline") is not None:
            ci, pv = b.get("speedup_ci95"), b.get("speedup_p_value")
            stats = ""
            if b.get("kind") == "baseline" and bb.get("trial") == b.get("trial"):
                stats = " (the answer is this baseline: 1.0 by definition)"
            elif ci:
                stats = (f" (95% CI {ci[0]:.2f}–{ci[1]:.2f}× over {b.get('speedup_rounds')} interleaved rounds"
                         + (f", sign-test p = {pv:.2g}" if pv is not None else "") + ")")
            lines.append(f"- Against the fastest plain baseline at the same batch ({bb['name']}, trial {bb['trial']}, "
                         f"{_fmt(bb['throughput'])} items/s, {_headline_timing(b)}): **{_fmt(b['speedup_vs_best_baseline'], '.2f')}×**{stats}.")
        if base:
            lines.append(f"- Against FP32 eager at the same batch ({base['batch_size']}): "
                         f"{_fmt(b['speedup_vs_baseline'], '.2f')}× "
                         f"({_fmt(base.get('compared_throughput', base['throughput']))} items/s, "
                         f"{base.get('compared_on', 'same timing')}).")
        anyb = b.get("best_baseline_any_batch")
        over = (anyb or {}).get("over_best")
        if over and not over.get("measurably_faster"):  # faster by its numbers, passed over by the verdict
            ci = over.get("ci95")
            how = (f"95 % CI {ci[0]:.2f}–{ci[1]:.2f}, which includes 1.0" if ci
                   else "its timing repeats overlap the answer's")
            lines.append(f"- The fastest plain baseline at any searched batch size: {anyb['name']} at batch "
                         f"{anyb['batch_size']}, {_fmt(anyb['throughput'])} items/s, {_fmt(over['speedup'], '.2f')}× "
                         f"the answer ({how}): not measurably faster, so {b.get('label') or b.get('name')} "
                         "stays the answer (plain baselines are preferred in the order FP32 eager, autocast, model "
                         "cast, torch.compile).")
        elif anyb and b.get("speedup_vs_best_baseline_any_batch") is not None:
            lines.append(f"- The fastest plain baseline at any searched batch size: {anyb['name']} at batch "
                         f"{anyb['batch_size']}, {_fmt(anyb['throughput'])} items/s (the best is "
                         f"{_fmt(b['speedup_vs_best_baseline_any_batch'], '.2f')}× it).")
        if b.get("timing"):
            lines.append(f"- Timings compared: {b['timing']}" + (f" (run {b['run_id']})" if b.get("run_id") else "") + ".")
        noisy = timing_warning(r)
        if noisy:  # once, beside the speedups and the timing they come from
            lines.append(f"- {noisy}")
        if b.get("speedup_note"):
            lines.append(f"- {b['speedup_note']}.")
        conf = (r.get("confirmation") or {}).get("runs") or {}
        if str(b.get("trial")) in conf:
            def _timings(v):
                return " → ".join(_fmt(x) if x else "failed" for x in v)
            lines.append(f"- Chosen by re-measuring (trial {b['trial']}: mean {_fmt(b.get('confirmed_throughput'))} "
                         f"items/s; first timing {_fmt(b['throughput'])} items/s): the candidates within "
                         f"{r['confirmation']['band']:.0%} of the fastest were built and timed again after the search, "
                         "and the best mean of all their timings wins: "
                         + "; ".join(f"trial {n}: {_timings(v)}" for n, v in conf.items()) + " items/s.")
        if (p["precision"] == "fp32" and not p.get("graph_passes") and p.get("runtime", "eager") == "eager"
                and not b.get("baseline_wins")):
            lines.append("- Nothing beat plain FP32 eager here: **keep FP32**.")
        if p.get("graph_passes") and r["passes"] and all(ps["changed"] == 0 for ps in r["passes"]):
            lines.append("- The passes changed nothing in this graph: any difference from the model as written "
                         "is the runtime or measurement noise.")
    else:
        lines.append(f"No trial met the limits: {failure_summary(r.get('trials', []))}. The trials table has each reason.")
    if r.get("baselines"):
        lines += ["", "## Plain baselines (measured in every study)", "",
                  "What you would try by hand: FP32 eager (the accuracy reference), autocast and the model cast as a "
                  "whole at each low precision, and on a GPU torch.compile of the fastest of those. " + TIMINGS_NOTE, "",
                  "| baseline | trial | batch | precision | runtime | first timing items/s | side-by-side median items/s | "
                  "p99 ms (first timing) | peak MiB | rel. error | feasible |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in r["baselines"]:
            lines.append(f"| {row.get('name')} | {row.get('trial')} | {row.get('batch_size')} | {row.get('precision')} | {row.get('runtime')} | "
                         f"{_fmt(row.get('throughput'))} | {_fmt(row.get('side_by_side_throughput'))} | "
                         f"{_fmt(row.get('latency_p99_ms'))} | {_fmt(row.get('peak_memory_mib'), '.0f')} | "
                         f"{_fmt(row.get('max_rel_error'), '.2e')} | {'yes' if row.get('feasible') else 'no: ' + (row.get('fail_reason') or '')} |")
    sbs = r.get("side_by_side")
    if sbs and sbs.get("entries"):
        clk = sbs.get("clocks") or {}
        clocks = (f"SM clock {clk['sm_clock_mhz']['min']}–{clk['sm_clock_mhz']['max']} MHz (max {clk.get('sm_clock_max_mhz')}), "
                  f"throttle reasons: {', '.join(clk.get('throttle_reasons') or []) or 'none'}"
                  if clk.get("available") else f"GPU clocks: {clk.get('reason', 'not recorded')}")
        lines += ["", "## Side-by-side timing", "",
                  f"{sbs['rounds']} rounds, each timing every entry once in turn (A B C A B C …), about "
                  f"{sbs['block_s'] * 1e3:.0f} ms of calls per block; median of the rounds. Run {sbs.get('run_id')}"
                  + ("" if sbs.get("current_run", True) else " (an earlier run: not used for the headline)")
                  + f". {clocks}.", "",
                  "| trial | baseline | batch | median ms | median items/s | note |", "|---|---|---|---|---|---|"]
        for e in sbs["entries"]:
            lines.append(f"| {e['trial']} | {e.get('baseline') or '–'} | {e['batch_size']} | {_fmt(e.get('median_ms'))} | "
                         f"{_fmt(e.get('throughput'))} | {e.get('error') or ''} |")
    if r.get("pareto_front"):
        lines += ["", "## Pareto front (throughput ↑, p99 latency ↓, peak memory ↓)", "",
                  "| trial | precision | graph passes | runtime | batch | items/s | p99 ms | peak MiB | rel. error |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for t in sorted(r["pareto_front"], key=lambda t: -(t["throughput"] or 0)):
            p = t["params"]
            lines.append(f"| {t['trial']} | {p.get('precision')} | {'yes' if p.get('graph_passes') else 'no'} | {p.get('runtime', 'eager')} | "
                         f"{p.get('batch_size')} | {_fmt(t['throughput'])} | {_fmt(t['latency_p99_ms'])} | "
                         f"{_fmt(t['peak_memory_mib'], '.0f')} | {_rel_error(t)} |")
    if r.get("plots"):
        lines += ["", "## Plots", ""]
        for name, path in sorted(r["plots"].items()):
            if name == "skipped":
                lines.append(f"- not drawn: {path}")
            elif str(path).endswith(".png"):
                lines.append(f"![{name}]({Path(path).name})")
            else:
                lines.append(f"- [{name}]({Path(path).name})")
    if r.get("fp8_plans"):
        lines += ["", "## FP8 keep-list (which linears stay bf16 at precision fp8)", ""]
        for policy, plan in sorted(r["fp8_plans"].items()):
            lines.append(f"- {policy} policy: {plan['summary']}")
    if r.get("fp8_fast_accum"):
        lines += ["", "## FP8 fast accumulation (torch._scaled_mm use_fast_accum)", ""]
        for policy, check in sorted(r["fp8_fast_accum"].items()):
            lines.append(f"- {policy} policy: {check['summary']}")
    if r.get("autotune"):  # tctune.search.autotune: the max-autotune finalist step
        lines += ["", "## Max-autotune finalist (Inductor mode max-autotune-no-cudagraphs)", "", *autotune_lines(r["autotune"])]
    lines += ["", "## Graph passes (at the best precision)", ""]
    if r["passes"] and b and not b["params"].get("graph_passes"):
        lines += ["The best configuration runs the model as written; these are the passes its exported graph carries.", ""]
    if r["passes"]:
        lines += ["| pass | rewrites | skipped: reason (nodes) |", "|---|---|---|"]
        for ps in r["passes"]:
            lines.append(f"| {ps['name']} | {ps['changed']} | {skip_cell(ps.get('skipped'))} |")
    else:
        lines.append("No graph passes ran for the best configuration.")
        searched = fastest_graph_trial(r["trials"]) if b and not b["params"].get("graph_passes") else None
        if searched is not None:
            p = searched["params"]
            what = (f"it is a plain baseline ({b.get('label') or b['baseline']})" if b.get("baseline")
                    else "it runs the model as written")
            lines += ["", f"The answer is the model without tctune's graph: {what}. What the passes did on the "
                      f"fastest tctune candidate, trial {searched['number']} ({p.get('precision')}, "
                      f"{p.get('runtime', 'eager')}, batch {p.get('batch_size')}, {_fmt(searched['throughput'])} "
                      "items/s first timing" + ("" if searched.get("feasible") else f"; rejected: {searched.get('fail_reason')}")
                      + "):", "", "| pass | rewrites | failed | skipped: reason (nodes) |", "|---|---|---|---|"]
            for ps in searched["passes"]:
                lines.append(f"| {ps['name']} | {ps.get('changed', '–')} | {ps.get('failed') or ''} | "
                             f"{skip_cell(ps.get('skipped'))} |")
    # setup s: the evaluator's build (tctune's graph: its passes; a cast model: its copy) + runtime setup (CUDA
    # graph capture, Inductor compile); a column that would read 0.00 on every row (eager training) is left out
    setup = any(round(t.get("setup_s") or 0.0, 2) for t in r["trials"])
    lines += ["", "## Trials", "", "Items/s and ms/batch: each trial's first timing, taken when it ran (the side-by-side "
              "medians the verdict compares are under Plain baselines and Side-by-side timing). Top-1 / KL: "
              f"{LOGITS_NOTE}.", "",
              "| # | state | precision | graph passes | runtime | batch | first timing items/s | ms/batch | peak MiB | rel. error | "
              "int mismatch | top-1 / KL | score (× FP32) | " + ("setup s (build + compile) | " if setup else "")
              + "note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if setup else "") + "---|"]
    for t in r["trials"]:
        p = t["params"]
        graph = ("yes" + (" (pure)" if p.get("policy") == "pure" else "")) if p.get("graph_passes") else "no"
        lines.append(f"| {t['number']} | {t['state'].lower()} | {p.get('precision', '–')} | {graph} | "
                     f"{p.get('runtime', 'eager')} | {p.get('batch_size', '–')} | {_fmt(t['throughput'])} | {_fmt(t['latency_ms'])} | "
                     f"{_fmt(t['peak_memory_mib'], '.0f')} | {_rel_error(t)} | {_mismatch(t)} | {_top1(t)} | {_score(t)} | "
                     + (f"{_fmt(t.get('setup_s'), '.2f')} | " if setup else "") + f"{t['fail_reason'] or ''} |")
    if not r.get("interrupted") and r["study"].get("n_queued_not_run"):  # (an interruption says it atop the Result)
        lines += ["", f"{r['study']['n_queued_not_run']} queued candidate(s) were not started (--trials or --timeout "
                      "reached); running the command again measures them."]
    a = r["artifacts"]
    lines += ["", "## Artifacts", ""]
    if a.get("onnx"):
        lines.append(f"- ONNX: `{a['onnx']}` (max abs error in onnxruntime vs PyTorch: {_fmt(a.get('onnx_max_abs_error'), '.2e')})")
    fb = a.get("export_fallback")
    stopped = r.get("interrupted")  # the artifacts' "interrupted" notes repeat the line above
    said_below = bool(fb and fb.get("best_error") and a.get("onnx_error") and fb["best_error"] in a["onnx_error"])
    # one reason for both engines (--no-export): said once
    same = bool(a.get("onnx_error") and a["onnx_error"] == a.get("tensorrt_skipped_reason") and not a.get("tensorrt"))
    if a.get("onnx_failed") and not said_below:  # the export raised: a failed artifact, its full text in the log
        lines.append(f"- **ONNX export failed**: {export_failed_line(a)}")
    elif same and not stopped and not said_below:
        lines.append(f"- Export (ONNX, TensorRT): skipped: {a['onnx_error']}")
    elif a.get("onnx_error") and not stopped and not said_below:
        lines.append(f"- ONNX note: {a['onnx_error']}")  # (the fallback line below says it otherwise)
    if a.get("onnx_note"):
        lines.append(f"- ONNX note: {a['onnx_note']}")
    if a.get("onnx_validation_limited"):  # tctune.export.onnx.plan_validation: a batch too large to validate
        lines.append(f"- ONNX validation sized to memory: {a['onnx_validation_limited']}")
    if (a.get("batch_range") or {}).get("note"):  # tctune.deploy.smallest_batch: batch 1 does not run as written
        lines.append(f"- Batch range: the engines accept batch {a['batch_range']['min']} and up: {a['batch_range']['note']}")
    if a.get("onnx_fp32"):
        lines.append(f"- ONNX, same graph in FP32 (runs in any onnxruntime): `{a['onnx_fp32']}` "
                     f"(max abs error vs PyTorch: {_fmt(a.get('onnx_fp32_max_abs_error'), '.2e')})")
    if a.get("deploy") is not None or a.get("deploy_reason"):
        where = ", ".join(f"{rt}: `{f}`" for rt, f in (a.get("deploy") or {}).items()) or "no file validated"
        lines.append(f"- Deploy: {where}" + (f" ({a['deploy_reason']})" if a.get("deploy_reason") else ""))
    fb = a.get("export_fallback")
    if fb:
        why = fb.get("best_error")
        if (a.get("onnx_failed") or {}).get("log"):
            why = f"{why}; full text in `{a['onnx_failed']['log']}`"
        if fb.get("exported_trial") is not None:
            lines.append(f"- **The best configuration (trial {fb['best_trial']}) could not be exported** "
                         f"({why}); trial {fb['exported_trial']}, the next best that exports "
                         f"({_fmt(fb.get('throughput'))} items/s), was exported to `{fb.get('dir')}`")
        else:
            others = list(dict.fromkeys(fb.get("errors") or []))
            lines.append(f"- **The best configuration (trial {fb['best_trial']}) could not be exported** "
                         f"({why}), nor trials {', '.join(map(str, fb.get('tried') or [])) or '-'}"
                         + ("" if not others or others == [fb.get("best_error")] else f" ({'; '.join(others)})"))
    if a.get("tensorrt"):
        lines.append(f"- TensorRT engine: `{a['tensorrt']}`")
    elif a.get("tensorrt_skipped_reason") and not stopped and not (same and not said_below):
        lines.append(f"- TensorRT: skipped: {a['tensorrt_skipped_reason']}")
    for k in ("best_config", "study_db"):
        if a.get(k):
            lines.append(f"- {k.replace('_', ' ')}: `{a[k]}`")
    if r.get("post_errors"):
        lines += ["", "## Errors after the trials", "",
                  "These stages failed; the trials above are kept and this report is complete otherwise.", ""]
        groups: dict[str, list[dict]] = {}
        for e in r["post_errors"]:  # one line per distinct error, naming every stage that raised it
            groups.setdefault(e["error"], []).append(e)
        for error, es in groups.items():
            lines.append(f"- {', '.join(e['stage'] for e in es)}: {error}"
                         + (f" (full text: `{es[0]['log']}`)" if es[0].get("log") else ""))
    return "\n".join(lines) + "\n"


def export_failed_line(artifacts: dict) -> str | None:
    """One line on the failed ONNX export of ``report.json``'s ``artifacts`` (its ``onnx_failed`` entry): the error
    and the log file holding its full text; None when the export did not fail."""
    f = artifacts.get("onnx_failed")
    if not f:
        return None
    where = f"full text in {f['log']}" if f.get("log") else "the error log could not be written"
    return f"{f.get('error')} ({where})"


def console_summary(report: dict, out: str | Path) -> str:
    """The one-paragraph winner summary ``tctune optimize`` prints and ``tctune.optimize(...)`` prints unless
    ``quiet``: the best configuration (precision, graph, runtime, batch, items/s, relative error), the exported
    graph, the accuracy gate that accepted it, the verdict when a plain baseline wins, its speedups over the
    fastest plain baseline and FP32 eager at the same batch (with the 95 % CI when there is one), an unstable
    timing, TensorRT's skip reason (or, when no format was exported for one reason, that reason alone, e.g.
    ``export disabled (--no-export)``), and the path of ``report.md`` with the study's counts. Plain text, lines
    joined by newlines; ``out`` is the run's output folder. With no qualifying configuration: why (the two most
    common failure reasons)."""
    out = Path(out)
    b, base = report.get("best"), report.get("baseline")
    lines = []
    if b:
        p = b["params"]
        what = 'tctune graph' if p.get('graph_passes') else 'model as written'
        if b.get("baseline"):
            what = f"plain baseline {b['baseline']}"
        chosen = b.get("chosen_throughput") or b["throughput"]  # the number the choice was made on
        lines.append(f"best: {p['precision']}, {what}, {p.get('runtime', 'eager')}, batch {p['batch_size']}: "
                     f"{chosen:.4g} items/s" + (f" ({b['chosen_on']})" if b.get("chosen_on") else "")
                     + f", rel. error {b['max_rel_error']:.2e}")
        exp = exported_line(report)
        if exp:
            lines.append(f"      exported: {exp.replace('**', '')}")
        if b.get("accepted_by"):
            lines.append(f"      {gate_line(b, report.get('config', {}))}")
        if report.get("config", {}).get("objective") == "latency" and b.get("latency_p99_ms") is not None:
            lines.append(f"      p99 latency {b['latency_p99_ms']:.4g} ms per batch (the objective)")
        why = (b.get("verdict") or {}).get("reason")
        if b.get("kind") == "baseline" or b.get("baseline_wins"):
            lines.append(f"      a plain baseline wins ({b['baseline']}): "
                         + (why or f"use {b['baseline']} (nothing tctune searched beat it here)"))
        bb = b.get("best_baseline")
        if bb and b.get("speedup_vs_best_baseline") is not None and not b.get("baseline_wins"):
            ci = b.get("speedup_ci95")
            lines.append(f"      {b['speedup_vs_best_baseline']:.2f}x the fastest plain baseline at the same batch "
                         f"({bb['name']}, {bb['throughput']:.4g} items/s"
                         + (f"; 95% CI {ci[0]:.2f}-{ci[1]:.2f}x" if ci else "") + ")")
        elif b.get("speedup_note"):
            lines.append(f"      {b['speedup_note']}")
        if base and b.get("speedup_vs_baseline"):
            lines.append(f"      {b['speedup_vs_baseline']:.2f}x FP32 eager at the same batch "
                         f"({base.get('compared_throughput', base['throughput']):.4g} items/s)")
            # (a resumed run's earlier trials had their warning in their own run; report.md keeps it)
            rows = [row for row in (b, base_trial(report)) if measured_this_run(report, row)]
            shaky = unstable_timing(*rows) if rows else None
            if shaky:
                lines.append(f"      unstable timing ({shaky}): not a reliable speedup; measure on an idle machine")
    else:
        lines.append(f"no configuration qualified: {failure_summary(report.get('trials', []))}")
    written = (report.get("model") or {}).get("writes_buffers")
    if written:  # the accuracy verdicts above compared runs that started from different states
        lines.append("      the model's forward writes its buffers (" + ", ".join(written[:5]) + "): runs of the same "
                     "inputs differ, so the accuracy verdicts are unreliable; update them only in training "
                     "(`if self.training:`)")
    a = report.get("artifacts", {})
    if a.get("onnx_failed"):
        lines.append(f"ONNX export failed: {export_failed_line(a)}")
    if report.get("interrupted"):
        lines.append("interrupted: finished trials are kept, nothing was exported; run the same command again to resume")
    elif a.get("tensorrt_skipped_reason"):
        reason = a["tensorrt_skipped_reason"]
        # one reason for every format (--no-export, --mode train): about the whole export, not TensorRT's
        whole = reason == a.get("onnx_error") and not (a.get("onnx") or a.get("onnx_fp32"))
        if not whole and not a.get("onnx_failed") and a.get("onnx_error") and not (a.get("onnx") or a.get("onnx_fp32")):
            # ONNX not written for a reason of its own (the model could not be captured): say it before TensorRT's
            lines.append(f"ONNX: {clip(' '.join(str(a['onnx_error']).split()))}")
        lines.append(reason if whole else f"TensorRT: {reason}")
    lines.append(f"report: {out / 'report.md'}  (the study: {study_counts(report['study'], report.get('trials'))})")
    return "\n".join(lines)


def write_report(report: dict, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.md`` atomically; returns their paths."""
    out = Path(out_dir)
    j, m = out / "report.json", out / "report.md"
    write_atomic(j, json.dumps(report, indent=2, default=str) + "\n")
    write_atomic(m, render_markdown(report))
    return j, m


def failure_summary(trials: list[dict], top: int = 2) -> str:
    """Why no trial qualified, in one line: the most common ``fail_reason`` texts (numbers stripped so trials
    that failed the same way count together), e.g. ``"12 of 12 trials did not qualify; most common: the
    model raised at batch size N (8 trials)"``."""
    bad = [t for t in trials if t.get("state") != "COMPLETE" or t.get("fail_reason")]
    if not trials:
        return "no trial ran"
    reasons = collections.Counter()
    example: dict[str, str] = {}
    for t in bad:
        text = (t.get("fail_reason") or t.get("state") or "unknown").splitlines()[0]
        key = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)[:160]
        reasons[key] += 1
        example.setdefault(key, text[:200])
    common = "; ".join(f"{example[k]} ({n} trial{'s' if n != 1 else ''})" for k, n in reasons.most_common(top))
    return f"{len(bad)} of {len(trials)} trials did not qualify" + (f"; most common: {common}" if common else "")
