"""Reading a study's results: which trials count, which is best, the confirmation means, the Pareto front;
and how a candidate's failure is recorded (``fail_reason`` text + ``fail_kind``, a :class:`FailureKind`)."""
from __future__ import annotations

import optuna
import torch

from ..errors import CandidateRejected, clip
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
    from .accuracy import format_score

    fp8 = precision == "fp8"
    if metrics.get("score") is not None:
        accuracy = ("min_score", -metrics["score"], -metrics["score_limit"],
                    lambda v, lim: f"score {format_score(-v)} < {format_score(-lim)} (the score limit: "
                                   + (f"--min-score {cfg.min_score:g}" if cfg.min_score is not None else
                                      f"--min-score-ratio {cfg.min_score_ratio:g} x FP32's "
                                      f"{format_score(metrics.get('score_fp32'))}") + ")")
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
    return clip((str(exc).strip().splitlines() or [""])[0])


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


#: What became of a candidate, in the order one outcome outranks another when a candidate has several trials
#: (:func:`trial_outcome`): timed to the end, failed with a recorded reason, stopped early by the pruner after
#: a partial measurement, not run (a duplicate, a twin, a batch the graph does not accept).
OUTCOMES = ("measured", "failed", "pruned", "skipped")

#: :data:`OUTCOMES` in words for the console and ``report.md``.
OUTCOME_WORDS = {"measured": "measured", "failed": "failed",
                 "pruned": "stopped early by the pruner (a partial measurement: slower than the finished trials "
                           "at its batch size; not run again)",
                 "skipped": "skipped (not run: a duplicate, a twin, or a combination that does not apply)"}


def trial_outcome(t: optuna.trial.FrozenTrial) -> str | None:
    """One of :data:`OUTCOMES` for a finished trial whose result stands (:func:`counts_as_measured`); None for
    a waiting, running or interrupted one. A pruned trial is final, as in Optuna (its samplers never propose
    it again): it is reported as stopped early, never as measured."""
    if not t.state.is_finished() or not counts_as_measured(t):
        return None
    if t.state == optuna.trial.TrialState.COMPLETE:
        return "measured"
    if t.state == optuna.trial.TrialState.FAIL:
        return "failed"
    return "skipped" if t.user_attrs.get("fail_kind") == FailureKind.SKIPPED.value else "pruned"


def outcome_words(counts: dict[str, int]) -> str:
    """``counts`` (outcome -> number, :data:`OUTCOMES`) in words, zero counts left out, e.g. "3 measured,
    1 failed"; "none decided" when all are zero."""
    parts = [f"{counts[k]} {OUTCOME_WORDS[k]}" for k in OUTCOMES if counts.get(k)]
    return ", ".join(parts) or "none decided"


#: :data:`OUTCOMES` in a few words, for one-line counts (the resumed-run line).
OUTCOME_SHORT = {"measured": "measured", "failed": "failed", "pruned": "stopped early", "skipped": "skipped"}


def earlier_trials(trials) -> dict | None:
    """What a study already holds when a run opens it (the trials of earlier runs in the same storage), or None
    when it holds no finished trial whose result stands.

    Args:
        trials: the study's trials when the run opened it (``FrozenTrial``), after trials cut off by a killed
            process were marked failed ("interrupted": not counted, their candidates are measured again).

    Returns:
        ``{"trials": N, "outcomes": {outcome: count}, "numbers": [the N trial numbers]}``, each trial counted
        once by :func:`trial_outcome` (so the counts add up to N). Every other trial of the study is measured by
        the run that opened it (a candidate an earlier run queued but did not start included).
    """
    counts: dict[str, int] = {}
    numbers = []
    for t in trials:
        outcome = trial_outcome(t)
        if outcome is not None:
            counts[outcome] = counts.get(outcome, 0) + 1
            numbers.append(t.number)
    if not counts:
        return None
    return {"trials": len(numbers), "outcomes": {k: counts[k] for k in OUTCOMES if k in counts},
            "numbers": sorted(numbers)}


def resumed_words(record: dict) -> str:
    """:func:`earlier_trials`'s record in one line, e.g. "resumed: 15 earlier trials kept (12 measured, 2 failed,
    1 stopped early)"."""
    n = record["trials"]
    parts = ", ".join(f"{c} {OUTCOME_SHORT[k]}" for k, c in record["outcomes"].items() if c)
    return f"resumed: {n} earlier trial{'s' if n != 1 else ''} kept ({parts})"


def is_feasible(t: optuna.trial.FrozenTrial) -> bool:
    """A completed, measured trial within every constraint (``--max-error``, ``--max-latency-ms``, ...)."""
    constraints = t.constraints
    return (t.state == optuna.trial.TrialState.COMPLETE and "throughput" in t.user_attrs
            and all(c <= 0 for c in constraints.values()))


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The recommended trial: :func:`verdict`'s ``trial`` (a plain baseline can be it), or None when no trial is
    feasible."""
    v = verdict(study)
    return None if v is None else v["trial"]


#: The rule that decides whether a tctune candidate beats the plain baselines (``report.json``'s
#: ``best.verdict.rule``). The bootstrap percentile interval is the one :func:`tctune.search.baselines.interleaved_speedup`
#: computes (Efron & Tibshirani, "An Introduction to the Bootstrap", 1993, ch. 13); a lower bound above 1.0
#: is the usual "the interval excludes no change" reading of a 95 % interval.
VERDICT_RULE = ("a tctune candidate wins only when its side-by-side median is faster than the fastest feasible plain "
                "baseline at the same batch size and the bootstrap 95 % confidence interval of that speedup lies "
                "above 1.0; otherwise the fastest plain baseline is the answer, unless it is not measurably "
                "faster than a preferred one at its batch size by the same rule (FP32 eager < autocast < model "
                "cast < torch.compile), which is then the answer")
VERDICT_RULE_NO_CI = ("no side-by-side timing (training, or a run stopped before it): a tctune candidate wins only when "
                      "its throughput is above that of every plain baseline measured in the same run at its batch "
                      "size (a point estimate, no confidence interval); otherwise that baseline is the answer, "
                      "unless its timing repeats overlap those of a preferred baseline at its batch size (FP32 eager "
                      "< autocast < model cast < torch.compile), which is then the answer")


def _label(name: str | None) -> str:
    from .baselines import baseline_label

    return baseline_label(name) if name else "a tctune candidate"


def verdict(study: optuna.Study) -> dict | None:
    """The final choice of a study: a tctune candidate only when it beats the plain baselines, else the plain
    baseline.

    Throughput and Pareto studies with a side-by-side timing taken after the fastest feasible trial was measured
    (:meth:`tctune.search.loop.Tuner.side_by_side`): the feasible entries timed there are taken fastest median
    first (ties: :func:`tctune.search.baselines.preference`, a plain baseline before a searched candidate, FP32
    eager < autocast < model cast < torch.compile); the first plain baseline reached is the answer, and a
    searched candidate reached before it wins only when :data:`VERDICT_RULE` holds against the fastest feasible
    baseline timed at its batch size (per-round ms, :func:`tctune.search.baselines.interleaved_speedup`; where no
    feasible baseline was timed at its batch size, against the fastest timed at any, per item). Without such a timing: the best re-measured mean
    (:meth:`~tctune.search.loop.Tuner.confirm`), else the highest first timing, with :data:`VERDICT_RULE_NO_CI`.
    Latency studies: the lowest p99 latency (every baseline is a candidate of the same objective; no speedup test).

    Returns:
        None when no trial is feasible; else ``{"trial": FrozenTrial, "kind": "tctune" | "baseline", "name":
        the baseline's name (e.g. ``cast_fp16``), else the candidate's description, "rule": the rule applied,
        "candidates_measured": :func:`candidates_measured` (when False the reason says that no tctune candidate was
        measured, not that a baseline won), "reason": one line saying why (e.g. "no tctune candidate was measurably
        faster than model.half() eager at batch 64 (1.01×, 95 % CI 0.98–1.04, which includes 1.0): use it"; "... beat ..." when the median is not
        above 1.0). For a plain baseline answer the sentence compares at the answer's batch size; a faster
        candidate turned down at another batch size is a second clause naming its own batch and comparison, so
        no ratio mixes two batch sizes. "challenger":
        the fastest searched candidate the rule turned down (else the fastest at the answer's batch size, else
        the fastest timed),
        ``{"trial", "batch_size", "description",
        "against", "against_name", "against_batch_size", "speedup", "ci95", "p_value", "rounds"}`` (for a tctune
        winner: its own comparison), or None}``.
    """
    ok = [t for t in study.get_trials(deepcopy=False) if is_feasible(t)]
    if not ok:
        return None

    measured = candidates_measured(study)

    def result(t, rule, reason, challenger=None):
        base = t.user_attrs.get("baseline")
        name = base or t.user_attrs.get("description") or f"tctune trial {t.number}"
        why_none = no_candidate_qualified(study) if base and measured else None
        if why_none:  # a baseline answer because every searched candidate failed: say why, not only "use it"
            reason = f"{reason}; {why_none}"
        return {"trial": t, "kind": "baseline" if base else "tctune", "name": name, "rule": rule,
                "reason": reason, "challenger": challenger, "candidates_measured": measured}

    if list(study.directions) == [optuna.study.StudyDirection.MINIMIZE]:
        t = min(ok, key=lambda t: t.values[0])
        return result(t, "latency: the lowest p99 latency among the feasible trials, plain baselines included",
                      f"the lowest p99 latency: {_label(t.user_attrs.get('baseline') or 'tctune')} at batch "
                      f"{t.params['batch_size']}")
    fastest = min(ok, key=lambda t: _pref(t, t.user_attrs["throughput"]))
    sbs = study.user_attrs.get("side_by_side") or {}
    rows = {e["trial"]: e for e in sbs.get("entries") or [] if e.get("throughput") and e.get("rounds_ms")}
    timed = sorted((t for t in ok if t.number in rows), key=lambda t: _pref(t, rows[t.number]["throughput"]))
    if timed and fastest.number <= sbs.get("after_trial", -1):
        return _side_by_side_verdict(timed, rows, result, ok)
    conf = confirmed_throughputs(study)
    chosen = {t.number: conf.get(t.number, t.user_attrs["throughput"]) for t in ok}
    if conf and fastest.number <= study.user_attrs["confirmation"]["after_trial"] and any(t.number in conf for t in ok):
        best = min((t for t in ok if t.number in conf), key=lambda t: _pref(t, conf[t.number]))
    else:
        best = fastest
    if best.user_attrs.get("baseline"):
        fastest_base = best
        best, _ = preferred_baseline(best, ok)
        if best is not fastest_base:
            return result(best, VERDICT_RULE_NO_CI, f"{_label(fastest_base.user_attrs['baseline'])} at batch "
                                                    f"{best.params.get('batch_size')} had the highest throughput but was "
                                                    f"not measurably faster than {_label(best.user_attrs['baseline'])} "
                                                    "(the ranges of their timing repeats overlap): use "
                                                    f"{_label(best.user_attrs['baseline'])}"
                                                    + ("" if measured else "; no tctune candidate was measured"))
    if best.user_attrs.get("baseline") and not measured:
        return result(best, VERDICT_RULE_NO_CI, "no tctune candidate was measured; the fastest plain baseline "
                                                f"measured so far is {_label(best.user_attrs['baseline'])} at batch "
                                                f"{best.params.get('batch_size')}")
    if best.user_attrs.get("baseline"):
        return result(best, VERDICT_RULE_NO_CI, f"{_label(best.user_attrs['baseline'])} at batch "
                                                f"{best.params.get('batch_size')} was the fastest: use it")
    bs = best.params.get("batch_size")
    same = min((t for t in ok if t.user_attrs.get("baseline") and t.params["batch_size"] == bs
                and t.user_attrs.get("run_id") == best.user_attrs.get("run_id")),
               key=lambda t: _pref(t, chosen[t.number]), default=None)
    if same is not None and chosen[same.number] >= chosen[best.number]:
        ratio = chosen[best.number] / chosen[same.number]
        return result(same, VERDICT_RULE_NO_CI,
                      f"no tctune candidate beat {_label(same.user_attrs['baseline'])} at batch {bs} "
                      f"({ratio:.2f}×, no confidence interval: not timed side by side): use it",
                      {"trial": best.number, "batch_size": bs, "description": best.user_attrs.get("description"),
                       "against": same.number, "against_name": same.user_attrs["baseline"],
                       "against_batch_size": bs, "speedup": ratio,
                       "ci95": None, "p_value": None, "rounds": None})
    return result(best, VERDICT_RULE_NO_CI, "faster than every plain baseline of the same run at its batch size"
                  if same is not None else "no plain baseline of the same run at its batch size to compare with")


def no_candidate_qualified(study: optuna.Study, top: int = 2) -> str | None:
    """Why no tctune candidate (a trial that is not a plain baseline) qualified, in one clause, when every such
    trial with a result failed or was rejected with a recorded ``fail_reason``, e.g. ``"none of the 4 tctune
    candidates qualified: score(model) raised on the bf16 candidate: KeyError: 'x' (3 candidates); ... (1 candidate)"``
    (reasons that differ only in numbers count together; the most common ``top``; a count, not a ratio: "(2x)"
    after "relative error 0.48 > max_error 0.01" read as twice the limit); None when one qualified
    or none failed with a reason (e.g. all stopped early by the pruner)."""
    import re
    from collections import Counter

    searched = [t for t in study.get_trials(deepcopy=False)
                if not t.user_attrs.get("baseline") and counts_as_measured(t)
                and t.state != optuna.trial.TrialState.PRUNED]
    if not searched or any(is_feasible(t) for t in searched):
        return None
    reasons: Counter = Counter()
    example: dict[str, str] = {}
    for t in searched:
        text = ((t.user_attrs.get("fail_reason") or "").strip().splitlines() or [""])[0]
        if text:
            key = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", text)[:160]
            reasons[key] += 1
            example.setdefault(key, text[:200])
    if not reasons:
        return None
    n = len(searched)
    return (f"none of the {n} tctune candidate{'s' if n != 1 else ''} measured qualified: "
            + "; ".join(f"{example[k]} ({c} candidate{'s' if c != 1 else ''})" for k, c in reasons.most_common(top)))


def candidates_measured(study: optuna.Study) -> bool:
    """Whether any tctune candidate (a trial that is not a plain baseline) finished being measured: completed,
    pruned, or failed with a recorded reason (:func:`counts_as_measured`). False when a run stopped (Ctrl-C, a
    signal, ``--timeout``) after only plain baselines ran: a baseline answer then wins over nothing."""
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    return any(not t.user_attrs.get("baseline") and t.state in done and counts_as_measured(t)
               for t in study.get_trials(deepcopy=False))


def _pref(t: optuna.trial.FrozenTrial, throughput: float) -> tuple:
    """:func:`tctune.search.baselines.preference` of trial ``t`` at ``throughput``: best first, ties deterministic."""
    from .baselines import preference

    return preference(throughput, t.user_attrs.get("baseline"), t.params.get("batch_size", 0), t.number)


#: How one plain baseline is chosen over another at the same batch size (``report.json``'s verdict sentence names
#: the comparison when the fastest is not the answer).
BASELINE_CHOICE_RULE = ("among the feasible plain baselines at one batch size, a lower-precision or more complex one "
                        "(FP32 eager < autocast < model cast < torch.compile) replaces a preferred one only when it is "
                        "measurably faster: side by side, the bootstrap 95 % CI of its speedup lies above 1.0; "
                        "without side-by-side rounds for both, its slowest timing repeat is faster than the preferred "
                        "one's fastest, and without repeats, a higher throughput")


def _measurably_faster(inc: optuna.trial.FrozenTrial, ch: optuna.trial.FrozenTrial,
                       rows: dict) -> tuple[bool, dict | None]:
    """Whether baseline ``ch`` is measurably faster than baseline ``inc`` (same batch size) by
    :data:`BASELINE_CHOICE_RULE`; the second item is the side-by-side statistics
    (:func:`tctune.search.baselines.interleaved_speedup`) when both have rounds in ``rows``, else None."""
    from .baselines import interleaved_speedup

    a, b = rows.get(inc.number), rows.get(ch.number)
    if a and b and a.get("rounds_ms") and b.get("rounds_ms"):
        n = min(len(a["rounds_ms"]), len(b["rounds_ms"]))
        stats = interleaved_speedup(a["rounds_ms"][:n], b["rounds_ms"][:n])
        return stats["speedup"] > 1.0 and stats["ci95"][0] > 1.0, stats
    ra, rb = inc.user_attrs.get("repeats_ms"), ch.user_attrs.get("repeats_ms")
    if ra and rb:  # unpaired repeats of each first timing (ms per call at the same batch size): ranges apart
        return max(rb) < min(ra), None
    return ch.user_attrs["throughput"] > inc.user_attrs["throughput"], None


def preferred_baseline(fastest: optuna.trial.FrozenTrial, feasible: list, rows: dict | None = None
                       ) -> tuple[optuna.trial.FrozenTrial, dict | None]:
    """The plain baseline :data:`BASELINE_CHOICE_RULE` chooses at the batch size of baseline ``fastest``.

    The feasible baselines at that batch size (and, without side-by-side rows, of ``fastest``'s run) are walked in
    :data:`tctune.search.baselines.BASELINE_PREFERENCE` order (then faster first); each replaces the current choice
    only when measurably faster than it.

    Args:
        fastest: the fastest feasible plain baseline (a trial with the ``baseline`` user attribute).
        feasible: the feasible trials to choose among (others are ignored).
        rows: the side-by-side entries by trial number (``rounds_ms``: ms per call per round), or None.

    Returns:
        ``(chosen trial, stats)``: ``stats`` is ``{"speedup", "ci95", "against"}`` of ``fastest`` over the chosen
        trial when they differ and side-by-side rounds exist for both (else None).
    """
    from .baselines import baseline_rank

    rows = rows or {}
    bs = fastest.params["batch_size"]
    group = [t for t in feasible if t.user_attrs.get("baseline") and t.params.get("batch_size") == bs
             and (t.number in rows if fastest.number in rows else
                  t.user_attrs.get("run_id") == fastest.user_attrs.get("run_id"))]
    if fastest not in group:
        group.append(fastest)

    def speed(t):
        return rows[t.number]["throughput"] if t.number in rows else t.user_attrs["throughput"]

    group.sort(key=lambda t: (baseline_rank(t.user_attrs["baseline"]), -speed(t), t.number))
    chosen = group[0]
    for t in group[1:]:
        if _measurably_faster(chosen, t, rows)[0]:
            chosen = t
    if chosen.number == fastest.number:
        return chosen, None
    _, stats = _measurably_faster(chosen, fastest, rows)
    return chosen, stats


def _side_by_side_verdict(timed: list, rows: dict, result, feasible: list = ()) -> dict:
    """:func:`verdict` on a side-by-side timing: ``timed`` the feasible timed trials, fastest median first;
    ``rows`` the timing's entries by trial number; ``feasible`` every feasible trial (a feasible searched trial
    that was not timed is named as not compared, never as beaten)."""
    from .baselines import interleaved_speedup

    def per_item(t):
        return [ms / t.params["batch_size"] for ms in rows[t.number]["rounds_ms"]]

    base = [t for t in timed if t.user_attrs.get("baseline")]

    def against(t):
        """Candidate ``t`` against the fastest baseline timed at its batch size (else at any, per item)."""
        bs = t.params["batch_size"]
        ref = next((b for b in base if b.params["batch_size"] == bs), None) or (base[0] if base else None)
        if ref is None:
            return None
        n = min(len(rows[ref.number]["rounds_ms"]), len(rows[t.number]["rounds_ms"]))
        stats = interleaved_speedup(per_item(ref)[:n], per_item(t)[:n])
        return {"trial": t.number, "batch_size": bs, "description": t.user_attrs.get("description"),
                "against": ref.number, "against_name": ref.user_attrs["baseline"],
                "against_batch_size": ref.params["batch_size"], "speedup": stats["speedup"],
                "ci95": stats["ci95"], "p_value": stats["p_value"], "rounds": stats["rounds"]}

    def where(c):
        bs = c["against_batch_size"]
        return f"at batch {bs}" if bs == c["batch_size"] else f"at batch {bs} (none feasible at {c['batch_size']}; per item)"

    def ci(c):
        return f"{c['speedup']:.2f}×, 95 % CI {c['ci95'][0]:.2f}–{c['ci95'][1]:.2f}"

    challenger = None
    for t in timed:
        if t.user_attrs.get("baseline"):
            # The answer is t. The sentence compares at t's batch size only; a candidate turned down at another batch
            # size gets its own clause, naming its batch (never one ratio of numbers from two batch sizes).
            name, bs = t.user_attrs["baseline"], t.params["batch_size"]
            if challenger is None and not any(not s.user_attrs.get("baseline") for s in timed):
                answer, pref = preferred_baseline(t, timed, rows)
                return result(answer, VERDICT_RULE, f"no tctune candidate was timed side by side: use "
                                                    f"{_label(answer.user_attrs['baseline'])} at batch {bs}"
                              + ("" if pref is None else f" ({_label(name)} was not measurably faster than "
                                 f"{_label(answer.user_attrs['baseline'])}: "
                                 f"{pref['speedup']:.2f}×, 95 % CI {pref['ci95'][0]:.2f}–{pref['ci95'][1]:.2f})"))
            here = (challenger if challenger is not None and challenger["against"] == t.number else
                    next((against(s) for s in timed if not s.user_attrs.get("baseline")
                          and s.params["batch_size"] == bs), None))
            answer, pref = preferred_baseline(t, timed, rows)
            untimed = [u for u in feasible if not u.user_attrs.get("baseline") and u.number not in rows
                       and u.params.get("batch_size") == bs]
            if answer is not t:  # the fastest baseline is not measurably faster than a preferred one at its batch
                if here is None:
                    reason = (f"{_label(name)} was the fastest plain baseline side by side at batch {bs} (no tctune "
                              "candidate was timed there)")
                else:
                    reason = ("no tctune candidate was " + ("measurably faster than " if here["speedup"] > 1.0
                                                             else "faster than ")
                              + f"{_label(name)} at batch {bs} ({ci(here)}"
                              + (", which includes 1.0)" if here["speedup"] > 1.0 else ")"))
                pick = _label(answer.user_attrs["baseline"])
                reason += (f"; use {pick} at batch {bs}: {_label(name)} was not measurably faster than {pick} "
                           f"({pref['speedup']:.2f}×, 95 % CI {pref['ci95'][0]:.2f}–{pref['ci95'][1]:.2f}, which "
                           "includes 1.0), and plain baselines are preferred in the order FP32 eager, autocast, model "
                           "cast, torch.compile")
            elif here is None and untimed:
                reason = (f"use {_label(name)} at batch {bs}, the fastest plain baseline side by side; the feasible "
                          f"tctune candidate(s) at batch {bs} (trial {', '.join(str(u.number) for u in untimed)}) "
                          "were not timed side by side in this run, so they are not compared (numbers of two "
                          "timings are never divided)")
            elif here is None and challenger is None:
                reason = (f"use {_label(name)} at batch {bs}: faster side by side than every tctune candidate (none "
                          f"was timed at batch {bs})")
            elif here is None:
                reason = (f"use {_label(name)} at batch {bs}, the fastest plain baseline side by side (no tctune "
                          f"candidate was timed at batch {bs})")
            elif here["speedup"] > 1.0:  # faster by its median, but the interval says the difference may be noise
                reason = (f"no tctune candidate was measurably faster than {_label(name)} at batch {bs} "
                          f"({ci(here)}, which includes 1.0): use it")
            else:
                reason = f"no tctune candidate beat {_label(name)} at batch {bs} ({ci(here)}): use it"
            if challenger is not None and challenger is not here:
                c = challenger
                reason += (f"; at batch {c['batch_size']}, the fastest tctune candidate (trial {c['trial']}) was "
                           + ("not measurably faster than " if c["speedup"] > 1.0 else "not faster than ")
                           + f"{_label(c['against_name'])} {where(c)} ({ci(c)}"
                           + (", which includes 1.0)" if c["speedup"] > 1.0 else ")"))
            return result(answer, VERDICT_RULE, reason, challenger or here
                          or next(against(s) for s in timed if not s.user_attrs.get("baseline")))
        c = against(t)
        if c is None:
            return result(t, VERDICT_RULE, "no feasible plain baseline was timed side by side to compare with")
        if c["speedup"] > 1.0 and c["ci95"][0] > 1.0:
            return result(t, VERDICT_RULE, f"{c['speedup']:.2f}× {_label(c['against_name'])} {where(c)} "
                                           f"(95 % CI {c['ci95'][0]:.2f}–{c['ci95'][1]:.2f}× over {c['rounds']} "
                                           "interleaved rounds)", c)
        challenger = challenger or c  # the fastest searched candidate the rule turned down
    return result(timed[0], VERDICT_RULE, "the fastest side by side")  # not reached: a baseline follows a turned-down one


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
    v = verdict(study)
    best = best or (v["trial"] if v else None)
    if best is None:
        return None
    if v is None or v["trial"].number != best.number:  # a trial the caller chose: described, not judged
        name = best.user_attrs.get("baseline")
        v = {"kind": "baseline" if name else "tctune", "name": name or best.user_attrs.get("description"),
             "rule": None, "reason": None, "challenger": None, "candidates_measured": candidates_measured(study)}
    out = _headline_numbers(study, best)
    out.update(kind=v["kind"], name=v["name"],
               verdict={"rule": v["rule"], "reason": v["reason"], "challenger": v["challenger"],
                        "candidates_measured": v["candidates_measured"]})
    if v["kind"] == "baseline":  # the answer is the plain baseline itself: 1.0 by definition
        out["best_baseline"] = {"trial": best.number, "name": v["name"], "batch_size": best.params["batch_size"],
                                "throughput": out["chosen_throughput"]}
        out["speedup_vs_best_baseline"] = 1.0
        out["speedup_ci95"] = out["speedup_p_value"] = out["speedup_rounds"] = None
        _passed_over(study, best, out)
    return out


def _passed_over(study: optuna.Study, best: optuna.trial.FrozenTrial, out: dict) -> None:
    """When the answer is a plain baseline and the fastest plain baseline at any batch size is another one at the
    same batch, faster by its numbers (``speedup_vs_best_baseline_any_batch`` below 1.0) but not measurably faster
    by :data:`BASELINE_CHOICE_RULE` (:func:`preferred_baseline` passed it over), add ``over_best`` to
    ``out["best_baseline_any_batch"]``: ``{"speedup"`` (its throughput over the answer's, >= 1.0), ``"ci95"``
    (side-by-side bootstrap 95 % CI, or None), ``"measurably_faster": False}``, so the report states the
    comparison the verdict made instead of a ratio below 1.0."""
    anyb, ratio = out.get("best_baseline_any_batch"), out.get("speedup_vs_best_baseline_any_batch")
    if (not anyb or anyb["trial"] == best.number or ratio is None or ratio >= 1.0
            or anyb["batch_size"] != best.params["batch_size"]):
        return
    sbs = study.user_attrs.get("side_by_side") or {}
    rows = ({e["trial"]: e for e in sbs.get("entries") or [] if e.get("throughput")}
            if out.get("timing", "").startswith("side by side") else {})
    other = next(t for t in study.get_trials(deepcopy=False) if t.number == anyb["trial"])
    faster, stats = _measurably_faster(best, other, rows)
    if not faster:
        anyb["over_best"] = {"speedup": 1.0 / ratio, "ci95": stats["ci95"] if stats else None,
                             "measurably_faster": False}


def _headline_numbers(study: optuna.Study, best: optuna.trial.FrozenTrial) -> dict:
    """:func:`headline`'s numbers for ``best``, before the verdict's fields."""
    from .baselines import interleaved_speedup

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
        same = min((t for t in timed if t.params["batch_size"] == bs), key=lambda t: _pref(t, thr[t.number]), default=None)
        fp32 = next((trials[n] for n in rows if trials[n].user_attrs.get("baseline") == "fp32_eager"
                     and trials[n].params["batch_size"] == bs), None)
        anyb = min(timed, key=lambda t: _pref(t, thr[t.number]), default=None)
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
    same = min((t for t in same_run if t.params["batch_size"] == bs), key=lambda t: _pref(t, t.user_attrs["throughput"]),
               default=None)
    fp32 = max((t for t in same_run if t.params["batch_size"] == bs and t.user_attrs["baseline"] == "fp32_eager"),
               key=lambda t: t.user_attrs["throughput"], default=None)
    anyb = min(same_run, key=lambda t: _pref(t, t.user_attrs["throughput"]), default=None)
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
