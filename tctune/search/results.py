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
    """The feasible trial that is best for the study's objective, or None.

    Throughput and Pareto studies: highest throughput (for Pareto, among the front's members all are
    reported; this is the one a throughput user would pick). Latency studies: lowest p99 latency.
    """
    ok = [t for t in study.get_trials(deepcopy=False) if is_feasible(t)]
    if not ok:
        return None
    if list(study.directions) == [optuna.study.StudyDirection.MINIMIZE]:
        return min(ok, key=lambda t: t.values[0])
    fastest = max(ok, key=lambda t: t.user_attrs["throughput"])
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


def pareto_front(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Optuna's Pareto front (feasible trials only) of a multi-objective study; [] otherwise."""
    if len(study.directions) < 2:
        return []
    return [t for t in study.best_trials if is_feasible(t)]
