"""Reading a study's results: which trials count, which is best, the confirmation means, the Pareto front;
and how a candidate's failure is recorded (``fail_reason`` text + ``fail_kind``, a :class:`FailureKind`)."""
from __future__ import annotations

import optuna
import torch

from ..errors import CandidateRejected
from ..measure import ErrorStats, is_oom, release_memory
from ..trial import FailureKind


def rejection(exc: BaseException, device: torch.device, batch_size: int, what: str) -> CandidateRejected:
    """The :class:`CandidateRejected` for an exception a candidate raised, after freeing its memory."""
    release_memory(device)
    if is_oom(exc):
        return CandidateRejected(f"out of memory at batch size {batch_size}", FailureKind.OUT_OF_MEMORY)
    return CandidateRejected(f"{what} failed: {type(exc).__name__}: {first_line(exc)}", FailureKind.RUNTIME_ERROR)


def failure_kind(exc: CandidateRejected) -> FailureKind:
    """The kind of a rejection: the one its raiser set, else out of memory when it was caused by one (the
    timing loop's rejection), else a runtime error."""
    if exc.kind is not None:
        return FailureKind(exc.kind)
    cause = exc.__cause__
    if cause is not None and is_oom(cause):
        return FailureKind.OUT_OF_MEMORY
    return FailureKind.RUNTIME_ERROR


def fail(trial: optuna.Trial, reason: str, kind: FailureKind) -> None:
    """Record why ``trial`` failed: ``fail_reason`` (text for the report) and ``fail_kind`` (a FailureKind value)."""
    trial.set_user_attr("fail_reason", reason)
    trial.set_user_attr("fail_kind", kind.value)


def trial_metrics(timing, err: ErrorStats, **extra) -> dict:
    """The user attributes every measured trial records (units: items/s, ms, MiB)."""
    metrics = {
        "throughput": timing.throughput,
        "latency_ms": timing.latency_ms,
        "latency_p50_ms": timing.latency_p50_ms,
        "latency_p99_ms": timing.latency_p99_ms,
        "peak_memory_mib": timing.peak_memory_mib,
        **err.to_metrics(),
        "repeats_ms": timing.repeats_ms,
    }
    metrics.update(extra)
    return metrics


def constraint_checks(metrics: dict, precision: str, cfg) -> list[tuple[str, float, str | None, FailureKind]]:
    """The constraints of a measured trial: ``(key, value, reason, kind)`` each, ``value <= 0`` when met (Optuna's
    ``Trial.set_constraint``), ``reason`` the report's text when not met (else None).

    Accuracy: when the trial has a ``score`` (the model file's ``score(model)``, see
    :class:`tctune.search.accuracy.ScoreGate`), the score gate decides (key ``min_score``: ``score_limit - score``),
    and the relative L2 error is not a constraint, for every precision; otherwise the relative L2 error against
    FP32 must be at most ``cfg.max_error`` (``cfg.max_error_fp8`` at precision fp8; key ``max_error``). Then
    ``max_latency_ms`` (p99 ms per batch) and ``max_memory_mib`` (peak MiB) when set.

    Args:
        metrics: the trial's metrics (:func:`trial_metrics`, plus ``score``/``score_limit`` when scored).
        precision: the trial's precision; cfg: the run's ``TuneConfig``.
    """
    fp8 = precision == "fp8"
    if metrics.get("score") is not None:
        accuracy = ("min_score", -metrics["score"], -metrics["score_limit"],
                    lambda v, lim: f"score {-v:.4g} < {-lim:.4g} (the score limit: "
                                   + (f"--min-score {cfg.min_score:g}" if cfg.min_score is not None else
                                      f"--min-score-ratio {cfg.min_score_ratio:g} x FP32's {metrics.get('score_fp32'):.4g}") + ")")
    else:
        limit = cfg.max_error_fp8 if fp8 else cfg.max_error
        flag = "--max-error-fp8" if fp8 else "--max-error"
        accuracy = ("max_error", metrics["max_rel_error"], limit,
                    lambda v, lim: f"relative error {v:.3g} > {flag} {lim:g}")
    limits = [accuracy,
              ("max_latency_ms", metrics.get("latency_p99_ms"), cfg.max_latency_ms,
               lambda v, lim: f"p99 latency ms {v:.3g} > --max-latency-ms {lim:g}"),
              ("max_memory_mib", metrics.get("peak_memory_mib"), cfg.max_memory_mib,
               lambda v, lim: f"peak memory MiB {v:.3g} > --max-memory-mib {lim:g}")]
    out = []
    for key, value, limit, why in limits:
        if limit is None or value is None:
            continue
        over = float(value - limit)
        kind = FailureKind.ACCURACY if key in ("max_error", "min_score") else FailureKind.CONSTRAINT
        out.append((key, over, why(value, limit) if over > 0 else None, kind))
    return out


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def objective_values(metrics: dict, objective: str) -> float | tuple[float, ...]:
    """The value(s) Optuna optimizes for ``objective`` (see :data:`OBJECTIVES`)."""
    if objective == "throughput":
        return metrics["throughput"]
    p99 = metrics["latency_p99_ms"] if metrics["latency_p99_ms"] is not None else metrics["latency_ms"]
    if objective == "latency":
        return p99
    return metrics["throughput"], p99, metrics["peak_memory_mib"] or 0.0


def counts_as_measured(t: optuna.trial.FrozenTrial) -> bool:
    """A finished trial whose result stands. A trial that failed because the process was interrupted or
    killed (no reason recorded, or "interrupted") does not: its candidate is measured again later."""
    if t.state != optuna.trial.TrialState.FAIL:
        return True
    if t.user_attrs.get("fail_kind") == FailureKind.INTERRUPTED.value:
        return False
    return bool(t.user_attrs.get("fail_reason"))


def is_feasible(t: optuna.trial.FrozenTrial) -> bool:
    """A completed, measured trial within every constraint (``--max-error``, ``--max-latency-ms``, ...)."""
    constraints = t.constraints
    return (t.state == optuna.trial.TrialState.COMPLETE and "throughput" in t.user_attrs
            and all(c <= 0 for c in constraints.values()))


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The feasible trial that is best for the study's objective, or None (a plain baseline can be it).

    Throughput and Pareto studies: the fastest median of the side-by-side timing when one ran after the
    fastest trial was measured, else the best confirmed mean, else the highest throughput (for Pareto, among the front's members all are
    reported; this is the one a throughput user would pick). Latency studies: lowest p99 latency.
    """
    ok = [t for t in study.get_trials(deepcopy=False) if is_feasible(t)]
    if not ok:
        return None
    if list(study.directions) == [optuna.study.StudyDirection.MINIMIZE]:
        return min(ok, key=lambda t: t.values[0])
    fastest = max(ok, key=lambda t: t.user_attrs["throughput"])
    sbs = side_by_side_throughputs(study)
    if sbs and fastest.number <= study.user_attrs["side_by_side"]["after_trial"] and any(t.number in sbs for t in ok):
        # timed side by side after the trials (tctune.search.loop.Tuner.side_by_side): the fastest median there,
        # among the finalists and the baselines timed with them
        return max((t for t in ok if t.number in sbs), key=lambda t: sbs[t.number])
    conf = confirmed_throughputs(study)
    if conf and fastest.number <= study.user_attrs["confirmation"]["after_trial"] and any(t.number in conf for t in ok):
        # re-measured after the trials (tctune.search.loop.Tuner.confirm): the best mean of its timings, among those candidates
        return max((t for t in ok if t.number in conf), key=lambda t: conf[t.number])
    return fastest


def confirmed_throughputs(study: optuna.Study) -> dict[int, float]:
    """Trial number -> mean throughput of its timings (first + re-measured, :meth:`tctune.search.loop.Tuner.confirm`), or {}."""
    conf = study.user_attrs.get("confirmation") or {}
    out = {}
    for number, values in (conf.get("runs") or {}).items():
        vals = [v for v in values if v]
        if vals:
            out[int(number)] = sum(vals) / len(vals)
    return out


def side_by_side_throughputs(study: optuna.Study) -> dict[int, float]:
    """Trial number -> its side-by-side median throughput (items/s, :meth:`tctune.search.loop.Tuner.side_by_side`,
    the latest run's), or {}."""
    sbs = study.user_attrs.get("side_by_side") or {}
    return {e["trial"]: e["throughput"] for e in sbs.get("entries") or [] if e.get("throughput")}


def headline(study: optuna.Study, best: optuna.trial.FrozenTrial | None = None) -> dict | None:
    """The best trial's speedups, from numbers of one run only.

    When the study's latest side-by-side timing is this run's (its ``run_id`` equals the study's ``run_id``
    user attribute, set by the run in progress) and holds the best trial, every number comes from it: the
    fastest feasible plain baseline at the best's batch size among the entries timed, FP32 eager at that
    batch, and the fastest baseline timed at any batch size; the speedup over the same-batch baseline
    carries a bootstrap 95 % CI and sign-test p-value over the rounds
    (:func:`tctune.search.baselines.interleaved_speedup`). Otherwise (an interrupted run, training) the first
    timings are divided only where both trials carry the same ``run_id`` user attribute; else the speedup is
    None and ``note`` says why.

    Returns:
        None without a best trial; else ``{"chosen_throughput", "chosen_on"`` ("side-by-side median",
        "confirmed mean" or "first timing"), ``"best_baseline"``, ``"fp32_eager"``, ``"best_baseline_any_batch"``
        (each ``{"trial", "name", "batch_size", "throughput"}`` or None), ``"best_searched"`` (the fastest
        feasible searched, not baseline, trial in the same numbers: ``{"trial", "batch_size", "throughput",
        "description"}`` or None), ``"speedup_vs_best_baseline"``,
        ``"speedup_vs_fp32_eager"``, ``"speedup_vs_best_baseline_any_batch"`` (throughput ratios, None when not
        comparable), ``"speedup_ci95"``, ``"speedup_p_value"``, ``"speedup_rounds"``, ``"timing"`` ("side by
        side, this run" or "first timings, same run"), ``"run_id"``, ``"baseline_wins"`` (the best is a plain
        baseline), ``"note"``}.
    """
    from .baselines import interleaved_speedup

    best = best or best_trial(study)
    if best is None:
        return None
    run_id = study.user_attrs.get("run_id")
    sbs = study.user_attrs.get("side_by_side") or {}
    rows = {e["trial"]: e for e in sbs.get("entries") or [] if e.get("throughput")}
    current = bool(sbs) and sbs.get("run_id") == run_id and best.number in rows
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    bs = best.params["batch_size"]
    out = {"run_id": run_id, "baseline_wins": bool(best.user_attrs.get("baseline")),
           "best_baseline_name": best.user_attrs.get("baseline"), "note": None, "speedup_ci95": None,
           "speedup_p_value": None, "speedup_rounds": None}

    def ref(t, thr):
        return None if t is None else {"trial": t.number, "name": t.user_attrs.get("baseline"),
                                       "batch_size": t.params["batch_size"], "throughput": thr}

    base = [t for t in trials.values() if t.user_attrs.get("baseline") and is_feasible(t)]
    if current:
        thr = {n: rows[n]["throughput"] for n in rows}
        out["chosen_throughput"], out["chosen_on"], out["timing"] = thr[best.number], "side-by-side median", "side by side, this run"
        timed = [t for t in base if t.number in thr]
        same = max((t for t in timed if t.params["batch_size"] == bs), key=lambda t: thr[t.number], default=None)
        fp32 = next((trials[n] for n in rows if trials[n].user_attrs.get("baseline") == "fp32_eager"
                     and trials[n].params["batch_size"] == bs), None)
        anyb = max(timed, key=lambda t: thr[t.number], default=None)
        for key, t in (("best_baseline", same), ("fp32_eager", fp32), ("best_baseline_any_batch", anyb)):
            out[key] = ref(t, thr[t.number] if t else None)
            out[f"speedup_vs_{key}"] = thr[best.number] / thr[t.number] if t else None
        if same is not None and same.number != best.number:
            stats = interleaved_speedup(rows[same.number]["rounds_ms"], rows[best.number]["rounds_ms"])
            out["speedup_ci95"], out["speedup_p_value"], out["speedup_rounds"] = (
                stats["ci95"], stats["p_value"], stats["rounds"])
        if same is None:
            out["note"] = f"no feasible plain baseline at batch {bs} was timed side by side"
        searched = max((trials[n] for n in thr if not trials[n].user_attrs.get("baseline")
                        and is_feasible(trials[n])), key=lambda t: thr[t.number], default=None)
        out["best_searched"] = None if searched is None else {
            "trial": searched.number, "batch_size": searched.params["batch_size"], "throughput": thr[searched.number],
            "description": searched.user_attrs.get("description")}
        return out
    conf = confirmed_throughputs(study)
    first = best.user_attrs["throughput"]
    out["chosen_throughput"] = conf.get(best.number, first)
    out["chosen_on"] = "confirmed mean" if best.number in conf else "first timing"
    out["timing"] = "first timings, same run"
    same_run = [t for t in base if t.user_attrs.get("run_id") == best.user_attrs.get("run_id")]
    others = len(base) - len(same_run)
    same = max((t for t in same_run if t.params["batch_size"] == bs), key=lambda t: t.user_attrs["throughput"], default=None)
    fp32 = max((t for t in same_run if t.params["batch_size"] == bs and t.user_attrs["baseline"] == "fp32_eager"),
               key=lambda t: t.user_attrs["throughput"], default=None)
    anyb = max(same_run, key=lambda t: t.user_attrs["throughput"], default=None)
    for key, t in (("best_baseline", same), ("fp32_eager", fp32), ("best_baseline_any_batch", anyb)):
        out[key] = ref(t, t.user_attrs["throughput"] if t else None)
        out[f"speedup_vs_{key}"] = first / t.user_attrs["throughput"] if t else None
    searched = max((t for t in trials.values() if not t.user_attrs.get("baseline") and is_feasible(t)
                    and t.user_attrs.get("run_id") == best.user_attrs.get("run_id")),
                   key=lambda t: t.user_attrs["throughput"], default=None)
    out["best_searched"] = None if searched is None else {
        "trial": searched.number, "batch_size": searched.params["batch_size"],
        "throughput": searched.user_attrs["throughput"], "description": searched.user_attrs.get("description")}
    if same is None:
        out["note"] = ("no plain baseline at this batch size was measured in the same run as the best trial"
                       + (f" ({others} baseline timing(s) are from another run and are not compared)" if others else "")
                       + "; run the command again to time them side by side")
    return out


def pareto_front(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Optuna's Pareto front (feasible trials only) of a multi-objective study; [] otherwise."""
    if len(study.directions) < 2:
        return []
    return [t for t in study.best_trials if is_feasible(t)]
