"""The max-autotune finalist: Inductor's ``max-autotune`` tried once, on the candidate most likely to gain from it.

Inductor's mode ``max-autotune-no-cudagraphs`` benchmarks Triton GEMM / convolution templates for every distinct
shape and can fuse epilogues (a GELU into the FC GEMM) that the default mode leaves as separate kernels; its
compile takes far longer than the default one. So it is not a runtime every trial may sample. After the trials
(:meth:`tctune.search.loop.Tuner.run`, inference only, before the finalists' re-measure and the side-by-side
timing), the best feasible tctune candidate that ran through ``inductor`` or ``inductor-cudagraphs``
(:func:`autotune_source`) is rebuilt through that runtime's max-autotune variant
(``tctune.runtime.MAX_AUTOTUNE_VARIANT``: ``inductor-max-autotune`` / ``inductor-max-autotune-cudagraphs``) and
measured as one more trial of the study (:func:`run_finalist`): same parameters, its runtime in the user
attribute ``runtime`` (:func:`tctune.search.baselines.run_params`) and the rebuilt trial's number in
``autotune_of``. From then on it is a trial like any other: re-measured when close to the fastest, timed side
by side, the answer when it wins, exported and resumed with its runtime. Those rebuilds compile the same graph
with the same options again: Inductor's FX graph cache and its local autotuning cache (both on by default,
``torch._inductor.config.fx_graph_cache`` / ``autotune_local_cache``) make them cache hits, not a second
autotuning.

Whether it runs is :func:`decide`'s rule (``TuneConfig.autotune``). The step records what happened in the study
user attribute ``"autotune"`` (:func:`run_finalist`'s record), and ``report.json`` / ``report.md`` show it
(:func:`autotune_report`, :func:`autotune_lines`). A failed or over-budget max-autotune compile costs that one
trial (recorded with its reason), never the run.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import optuna

from ..errors import CandidateRejected
from ..runtime import MAX_AUTOTUNE_VARIANT
from ..trial import FailureKind
from .baselines import candidate_params, run_params
from .results import counts_as_measured, fail, first_line, is_feasible

log = logging.getLogger("tctune")

#: ``--autotune auto``'s estimate of a max-autotune compile: this many times the same candidate's default-mode
#: compile (its trial's ``compile_s``). From one H200 measurement (torch 2.11, benchmarks/NOTES.md, 2026-12-02):
#: ResNet-50 at batch 128, fp16 channels-last, default compile 4.6 s, max-autotune compile still running after
#: 230 s (stopped by the run's time limit: Triton convolution templates benchmarked one shape after another,
#: ~9-12 s each) -- a ratio above 50; 100 keeps ``auto`` to models whose default compile is at most 3 s under the
#: default 300 s ``--compile-budget``. A lower bound from one model, not a law: GEMM-only models may autotune
#: faster. A warm Inductor cache makes the default compile look cheaper than a cold one, so the estimate can be
#: low; the compile itself is still bounded by ``--compile-budget`` (an over-budget compile rejects the trial once
#: it ends: Inductor's compile cannot be stopped midway).
AUTOTUNE_COMPILE_FACTOR = 100.0


def compile_seconds(attrs: dict) -> float | None:
    """A trial's compile seconds: its ``compile_s`` user attribute (CUDA-graph capture or Inductor compile, the
    graph's build left out), or ``setup_s`` for trials recorded before ``compile_s`` existed."""
    value = attrs.get("compile_s")
    return attrs.get("setup_s") if value is None else value


@dataclass(frozen=True)
class Decision:
    """Whether the max-autotune finalist step runs: ``run``, the one-line ``reason`` (for the log and the report)
    and ``estimate_s``, the estimated max-autotune compile in seconds (None where none was estimated)."""

    run: bool
    reason: str
    estimate_s: float | None = None


def autotune_source(study: optuna.Study, objective: str = "throughput") -> optuna.trial.FrozenTrial | None:
    """The trial the step rebuilds: among the feasible trials of tctune's graph (``graph_passes``, not a plain
    baseline, not a max-autotune rebuild itself) that ran through a runtime of ``MAX_AUTOTUNE_VARIANT``
    (``inductor``, ``inductor-cudagraphs``), the best by ``objective``: the lowest p99 latency (ms per batch) for
    ``"latency"``, else the highest throughput (items/s; ``"pareto"`` too). None when there is none."""
    ok = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
          if is_feasible(t) and not t.user_attrs.get("baseline") and t.user_attrs.get("autotune_of") is None
          and t.params.get("graph_passes") and run_params(t.params, t.user_attrs).get("runtime") in MAX_AUTOTUNE_VARIANT]
    if not ok:
        return None
    if objective == "latency":
        def key(t):
            p99 = t.user_attrs.get("latency_p99_ms")
            return (p99 if p99 is not None else t.user_attrs.get("latency_ms") or float("inf"), t.number)
    else:
        def key(t):
            return (-t.user_attrs["throughput"], t.number)
    return min(ok, key=key)


def runtimes_note(mode: str, device_type: str, runtimes: tuple[str, ...] | None) -> str | None:
    """Why the max-autotune finalist can have nothing to rebuild whatever the trials measure: ``mode`` asks for it
    (``"on"``; ``"auto"`` on a CUDA GPU, the only place ``auto`` runs it) and none of the searched ``runtimes`` is
    ``inductor`` or ``inductor-cudagraphs`` (the keys of ``MAX_AUTOTUNE_VARIANT``; the CPU's default runtimes are
    ``eager`` only). One line naming the fix (``--runtimes`` with ``inductor`` added), or None when the runtimes
    hold one, ``mode`` is ``"off"``, or ``runtimes`` is None (not known)."""
    if runtimes is None or mode == "off" or (mode == "auto" and device_type != "cuda"):
        return None
    if any(r in MAX_AUTOTUNE_VARIANT for r in runtimes):
        return None
    return (f"--autotune {mode}: the max-autotune finalist is the best tctune candidate through inductor or "
            f"inductor-cudagraphs, rebuilt with max-autotune, and the runtimes searched here "
            f"({', '.join(runtimes)}) include neither, so there is none to rebuild; fix: add one, e.g. --runtimes "
            f"{','.join([*runtimes, 'inductor'])}")


def decide(mode: str, device_type: str, training: bool, source: optuna.trial.FrozenTrial | None,
           compile_budget_s: float, time_left_s: float | None = None,
           over_budget: str | None = None, runtimes: tuple[str, ...] | None = None) -> Decision:
    """Whether the max-autotune finalist step runs.

    Args:
        mode: ``TuneConfig.autotune``: ``"off"`` never; ``"on"`` whenever there is a ``source``; ``"auto"`` on a
            CUDA GPU when the estimated compile, :data:`AUTOTUNE_COMPILE_FACTOR` × the source's default-mode
            compile seconds (its ``compile_s`` user attribute), is at most ``compile_budget_s`` and at most
            ``time_left_s``, and no compile of this run went over the budget (``over_budget``).
        device_type: where candidates are measured (``"cuda"``, ``"cpu"``).
        training: ``--mode train`` (the step is for inference only).
        source: :func:`autotune_source`'s trial, or None.
        compile_budget_s: ``--compile-budget`` (seconds, per compile).
        time_left_s: seconds left before ``--timeout`` (None: no timeout).
        over_budget: the evaluator's ``compile_over_budget`` (why compiles stopped), or None.
        runtimes: the runtimes the trials search (None: not known); without ``inductor`` or
            ``inductor-cudagraphs`` among them the reason is :func:`runtimes_note`'s, naming the fix.

    Returns:
        A :class:`Decision`; ``reason`` names the rule that decided.
    """
    if mode == "off":
        return Decision(False, "--autotune off")
    if training:
        return Decision(False, "the max-autotune finalist is for inference; --mode train does not run it")
    if mode == "auto" and device_type != "cuda":
        anyway = "--autotune on runs it anyway"
        if runtimes_note("on", device_type, runtimes):  # on would have nothing to rebuild either
            anyway = f"--autotune on with --runtimes {','.join([*runtimes, 'inductor'])} runs it anyway"
        return Decision(False, f"--autotune auto runs it on a CUDA GPU only (max-autotune's Triton templates); this run "
                               f"measures on the {device_type.upper()} ({anyway})")
    note = runtimes_note(mode, device_type, runtimes)
    if note:
        return Decision(False, note)
    if source is None:
        return Decision(False, "no feasible tctune candidate ran through inductor or inductor-cudagraphs")
    compile_s = compile_seconds(source.user_attrs)
    estimate = None if compile_s is None else AUTOTUNE_COMPILE_FACTOR * float(compile_s)
    if mode == "on":
        return Decision(True, "--autotune on", estimate)
    if over_budget:
        return Decision(False, f"compiles are over --compile-budget ({over_budget})")
    if estimate is None:
        return Decision(False, f"trial {source.number} recorded no compile time to estimate the max-autotune compile from")
    what = (f"estimated max-autotune compile {estimate:.0f} s ({AUTOTUNE_COMPILE_FACTOR:g} × trial {source.number}'s "
            f"default compile, {float(compile_s):.1f} s)")
    if estimate > compile_budget_s:
        return Decision(False, f"{what} is over --compile-budget {compile_budget_s:g} s", estimate)
    if time_left_s is not None and estimate > time_left_s:
        return Decision(False, f"{what} is over the {max(time_left_s, 0.0):.0f} s left before --timeout", estimate)
    return Decision(True, f"{what} is within --compile-budget {compile_budget_s:g} s", estimate)


def _measure(tuner, study: optuna.Study, source: optuna.trial.FrozenTrial, runtime: str) -> optuna.trial.FrozenTrial:
    """Run ``tuner.objective`` on a new trial with ``source``'s parameters and distributions, ``runtime`` in its
    ``runtime`` user attribute (and ``source``'s recorded FP8 keep-list and fast accumulation, so the graph is the
    one ``source`` measured); returns the finished trial. The trial is created directly in the study's storage
    (``study.ask`` would start a queued trial instead) and finished with ``study.tell``: COMPLETE with its values,
    FAIL when rejected (its ``fail_reason``), PRUNED when skipped. KeyboardInterrupt marks it failed (interrupted)
    and is raised again; any other exception is recorded as its failure."""
    attrs = {"runtime": runtime, "autotune_of": source.number}
    for k in ("fp8_keep", "fp8_fast_accum"):
        if source.user_attrs.get(k) is not None:
            attrs[k] = source.user_attrs[k]
    template = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, params=dict(source.params),
                                         distributions=dict(source.distributions), user_attrs=attrs)
    trial_id = study._storage.create_new_trial(study._study_id, template_trial=template)
    trial = optuna.Trial(study, trial_id)
    try:
        values = tuner.objective(trial)
    except CandidateRejected:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)  # the objective recorded why
    except optuna.TrialPruned:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    except KeyboardInterrupt:
        fail(trial, "interrupted", FailureKind.INTERRUPTED)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        raise
    except Exception as exc:  # noqa: BLE001 - anything else the rebuild raises costs this trial, not the run
        fail(trial, f"{type(exc).__name__}: {first_line(exc)}", FailureKind.RUNTIME_ERROR)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    else:
        study.tell(trial, values)
    return study._storage.get_trial(trial_id)


def run_finalist(tuner, study: optuna.Study, time_left_s: float | None = None) -> dict:
    """The max-autotune finalist step on ``tuner``'s ``study`` (a :class:`tctune.search.loop.Tuner`; call it
    after the trials). Decides (:func:`decide`), then measures :func:`autotune_source`'s trial through its
    runtime's max-autotune variant as a new trial, unless the study already has that candidate measured (a resumed
    run: that trial is reported, nothing is compiled).

    Returns:
        The record stored as the study user attribute ``"autotune"``: ``{"mode", "ran": whether a max-autotune
        trial was measured now, "reason": the decision's reason, "result": "not run" | "faster" | "slower" |
        "rejected" (measured, outside a constraint) | "over budget" | "failed" | "skipped", "error": the trial's
        fail reason or None, "source_trial", "source_runtime", "source_throughput" (items/s), "source_compile_s",
        "runtime", "trial" (the max-autotune trial's number or None), "reused" (an earlier run's trial),
        "throughput" (items/s, its own timing), "speedup_vs_source" (its throughput / the source's),
        "compile_s" (its compile, seconds; None when it was rejected before recording one), "step_s" (the whole
        step, seconds), "estimate_s", "factor" (:data:`AUTOTUNE_COMPILE_FACTOR`), "budget_s"
        (``--compile-budget``), "run_id" (the tuner's run)}``.
    """
    cfg = tuner.cfg
    source = autotune_source(study, cfg.objective)
    runtimes = tuple(getattr(tuner, "runtimes", None) or ()) or None
    decision = decide(cfg.autotune, tuner.device.type, cfg.mode == "train", source, cfg.compile_budget_s,
                      time_left_s, tuner.compile_over_budget, runtimes)
    src = run_params(source.params, source.user_attrs) if source is not None else {}
    record = {"mode": cfg.autotune, "ran": False, "reason": decision.reason, "result": "not run", "error": None,
              "source_trial": source.number if source is not None else None, "source_runtime": src.get("runtime"),
              "source_throughput": source.user_attrs.get("throughput") if source is not None else None,
              "source_compile_s": compile_seconds(source.user_attrs) if source is not None else None,
              "runtime": MAX_AUTOTUNE_VARIANT.get(src.get("runtime")), "trial": None, "reused": False,
              "throughput": None, "speedup_vs_source": None, "compile_s": None, "step_s": None,
              "estimate_s": decision.estimate_s, "factor": AUTOTUNE_COMPILE_FACTOR, "budget_s": cfg.compile_budget_s,
              "run_id": tuner.run_id}
    if not decision.run:
        if decision.reason == runtimes_note(cfg.autotune, tuner.device.type, runtimes):
            log.debug("max-autotune finalist not run: %s", decision.reason)  # the tuner warned at its start
        else:
            log.info("max-autotune finalist not run: %s", decision.reason)
        return record
    wanted = dict(src, runtime=record["runtime"])
    earlier = next((t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,
                                                                        optuna.trial.TrialState.FAIL))
                    if counts_as_measured(t) and candidate_params(t.params, t.user_attrs) == wanted), None)
    started = time.perf_counter()
    if earlier is not None:
        t, record["reused"] = earlier, True
        log.info("max-autotune finalist: trial %d already measured trial %d through %s", t.number, source.number,
                 record["runtime"])
    else:
        log.info("max-autotune finalist: rebuilding trial %d through %s (%s)", source.number, record["runtime"],
                 decision.reason)
        t = _measure(tuner, study, source, record["runtime"])
        record["ran"] = True
    record.update(trial=t.number, step_s=None if record["reused"] else time.perf_counter() - started,
                  compile_s=compile_seconds(t.user_attrs), throughput=t.user_attrs.get("throughput"),
                  error=t.user_attrs.get("fail_reason"))
    base = record["source_throughput"]
    if record["throughput"] and base:
        record["speedup_vs_source"] = record["throughput"] / base
    if t.state == optuna.trial.TrialState.COMPLETE and is_feasible(t):
        record["result"] = "faster" if (record["speedup_vs_source"] or 0.0) > 1.0 else "slower"
    elif t.state == optuna.trial.TrialState.COMPLETE:
        record["result"] = "rejected"
    elif t.user_attrs.get("fail_kind") == FailureKind.COMPILE_BUDGET.value:
        record["result"] = "over budget"
    elif t.user_attrs.get("fail_kind") == FailureKind.SKIPPED.value or t.state == optuna.trial.TrialState.PRUNED:
        record["result"] = "skipped"
    else:
        record["result"] = "failed"
    speed = f", {record['speedup_vs_source']:.3f}× trial {source.number}" if record["speedup_vs_source"] else ""
    log.info("max-autotune finalist: trial %d %s%s%s", t.number, record["result"], speed,
             f": {record['error']}" if record["error"] else "")
    return record


def autotune_report(study: optuna.Study, best_number: int | None) -> dict | None:
    """``report.json``'s ``autotune``: the study's ``"autotune"`` record of this run (None when the step was not
    reached in this run: a worker, an interrupted run, or a record left by an earlier run), with ``kept`` (the
    max-autotune trial is the recommended trial ``best_number``) and ``result`` final: ``"kept"`` when kept,
    ``"not kept"`` when it was measured but is not the recommended configuration (whether its own first timing
    was faster or slower than its source's: the re-measure and the side-by-side timing decide, not that one
    timing), else the step's result (rejected, over budget, failed, skipped)."""
    rec = study.user_attrs.get("autotune")
    if not rec or rec.get("run_id") != study.user_attrs.get("run_id"):
        return None
    out = dict(rec)
    out["kept"] = rec.get("trial") is not None and rec.get("trial") == best_number
    if out["kept"]:
        out["result"] = "kept"
    elif rec.get("result") in ("faster", "slower"):
        out["result"] = "not kept"
    return out


def autotune_lines(rec: dict | None) -> list[str]:
    """``report.md``'s lines for ``report.json``'s ``autotune`` record (:func:`autotune_report`); [] without one."""
    if not rec:
        return []
    if rec.get("trial") is None:
        reason = str(rec.get("reason"))  # a reason that is the mode itself ("--autotune off") is not said twice
        return [f"- Not run: {reason}" + ("" if "--autotune" in reason else f" (--autotune {rec.get('mode')})") + "."]

    def s(v, spec=".1f"):
        return "–" if v is None else format(v, spec)

    what = (f"Trial {rec['trial']} is trial {rec['source_trial']} rebuilt through {rec['runtime']} (its runtime: "
            f"{rec['source_runtime']})" + (", measured by an earlier run" if rec.get("reused") else "")
            + f"; why: {rec.get('reason')}.")
    cost = (f"- Compile {s(rec.get('compile_s'))} s (trial {rec['source_trial']}'s default compile "
            f"{s(rec.get('source_compile_s'))} s; estimate {s(rec.get('estimate_s'), '.0f')} s = "
            f"{rec.get('factor', AUTOTUNE_COMPILE_FACTOR):g} × that, an estimate; --compile-budget "
            f"{rec.get('budget_s'):g} s)" + (f", the whole step {s(rec.get('step_s'))} s" if rec.get("step_s") else "")
            + ".")
    result = {"kept": "kept: it is the recommended configuration",
              "not kept": "measured, re-timed and compared like any other trial; not the recommended configuration",
              "slower": "slower than its source in its own trial's timing",
              "rejected": "measured, but outside a constraint",
              "over budget": "over --compile-budget: not kept", "failed": "failed: not kept",
              "skipped": "skipped"}.get(rec.get("result"), str(rec.get("result")))
    timing = ""
    if rec.get("throughput"):
        timing = (f" ({rec['throughput']:.4g} items/s against {rec['source_throughput']:.4g}, "
                  f"{rec['speedup_vs_source']:.3f}×, each its own trial's timing)" if rec.get("speedup_vs_source") else
                  f" ({rec['throughput']:.4g} items/s)")
    return [f"- {what}", cost, f"- Result: **{result}**{timing}" + (f": {rec['error']}" if rec.get("error") else "") + "."]


__all__ = ["AUTOTUNE_COMPILE_FACTOR", "Decision", "autotune_lines", "autotune_report", "autotune_source", "decide",
           "run_finalist", "runtimes_note"]
