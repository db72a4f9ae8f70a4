"""Candidate evaluation: build a trial's candidate, check it against the FP32 reference, time it.

An evaluator has one interface, whatever a trial runs: ``reference(batch_size)``, ``trial_params(params,
fp8_keep)`` and ``evaluate(params, on_repeat=None, fp8_keep=None) -> metrics``, plus ``fp8_plans`` and
``compile_over_budget``. :class:`InferenceEvaluator` times forward passes (tctune's graph or the model as
written); :class:`tctune.search.train.TrainingEvaluator` times training steps. The loop
(:class:`tctune.search.loop.Tuner`) holds one of them.
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import optuna
import torch

from ..calibration import load_calibration
from ..capture import Captured
from ..errors import CandidateRejected, PassError
from ..fp8_plan import (DEFAULT_MARGIN, METRIC_L2, METRIC_SCORE, FastAccumCheck, FP8Plan, choose_fast_accum,
                        choose_fastest, graph_error, keep_label, plan_graph)
from ..measure import (ErrorStats, PooledComparison, check_accuracy, compare, is_oom, precision_mode, release_memory,
                       time_call)
from ..runtime import Autocast, ChannelsLast, detach_outputs, wrap
from ..trial import FailureKind, TrialParams, apply_passes, build_trial_graph, reference_inputs
from .accuracy import CheckSet, ScoreGate, format_score, graph_key, worst
from .baselines import CastModel, OutputsTo
from .config import TuneConfig
from .results import first_line, rejection, trial_metrics

log = logging.getLogger("tctune")


class Evaluator(Protocol):
    """What the search loop asks of a candidate evaluator (see the module docstring)."""

    fp8_plans: dict
    compile_over_budget: str | None

    def reference(self, batch_size: int) -> tuple: ...

    def trial_params(self, params: dict, fp8_keep: Sequence[str] | None = None) -> TrialParams: ...

    def evaluate(self, params: dict, on_repeat: Callable[[int, float], None] | None = None,
                 fp8_keep: Sequence[str] | None = None) -> dict: ...


@dataclass
class Candidate:
    """A runnable candidate: ``module(*inputs)`` under ``precision_mode(precision)``."""

    module: Callable
    precision: str
    passes: list = field(default_factory=list)  # PassResult objects
    description: str = ""  # for people: an FP8 keep-list as tctune.fp8_plan.keep_label writes it
    fp8_keep: tuple[str, ...] | None = None  # precision fp8, tctune's graph: the keep-list it was built with
    fp8_fast_accum: bool | None = None  # precision fp8, tctune's graph: _scaled_mm's use_fast_accum


#: At most this many distinct skip reasons, of at most ``SKIP_REASON_CHARS`` characters each, are kept per pass in
#: a trial's ``passes`` user attribute (the study database holds one such list per trial).
SKIP_REASONS_KEPT = 3
SKIP_REASON_CHARS = 200


def skip_reasons(skipped: Sequence) -> list[dict]:
    """A pass's recorded skips (:class:`passes.base.Skip`: ``node``, ``reason``) grouped by reason, in order of
    first appearance: ``[{"reason": str, "nodes": how many nodes it was given for, "node": the first}]``, at most
    ``SKIP_REASONS_KEPT`` reasons, each cut to ``SKIP_REASON_CHARS`` characters."""
    out: dict[str, dict] = {}
    for sk in skipped:
        reason = sk.reason[:SKIP_REASON_CHARS]
        if reason in out:
            out[reason]["nodes"] += 1
        elif len(out) < SKIP_REASONS_KEPT:
            out[reason] = {"reason": reason, "nodes": 1, "node": sk.node}
    return list(out.values())


class InferenceEvaluator:
    """Forward-pass candidates: tctune's graph (from ``captured``) or the model as written, on ``device``.

    Args:
        cfg: run options (error limits, compile budget, FP8 keep-list).
        mf: the model file; hw: the hardware spec the passes plan for; device: where candidates run.
        model: the FP32 eval-mode model on ``device`` (the reference, and the model-as-written candidates).
        captured: the capture of ``model`` (``tctune.capture.try_capture``).
        fastest_runtime: the runtime FP8 keep-lists are timed through (None: eager).
        fp8_fast_accum: the fast-accumulation values FP8 candidates may take (``SearchSpace.fp8_fast_accum``):
            one value is used as is; ``(False, True)`` is decided once per study (:meth:`fp8_fast_accum`).

    Accuracy (see :mod:`tctune.search.accuracy`): each candidate is compared with the FP32 model on the seeded
    random inputs of every searched batch size, run at its own batch size (:class:`~tctune.search.accuracy.CheckSet`;
    through its runtime, once per graph and runtime (CUDA graphs replay the kernels of the runtime they wrap: not
    checked again), so its verdict is the same at every batch size), and on
    every real batch (``cfg.calibration``'s folder or ``mf.calibration_inputs()``; these run
    through the built module before the runtime wrapper, once per graph), its stats being the worst over both;
    then, when ``mf.score`` is given, scored (once per graph). Real batches also calibrate the fp16 overflow
    analysis of tctune's graph.

    Raises:
        UsageError, ModelFileError: bad real batches (:func:`tctune.calibration.load_calibration`), before any trial.
    """

    def __init__(self, cfg: TuneConfig, mf, hw, device: torch.device, model: torch.nn.Module, captured: Captured,
                 fastest_runtime: str | None = None, fp8_fast_accum: Sequence[bool] = (False,)):
        self.cfg, self.mf, self.hw, self.device, self.model, self.captured = cfg, mf, hw, device, model, captured
        self.fastest_compiled_runtime = fastest_runtime
        self.fp8_fast_accum_choices = tuple(fp8_fast_accum)
        self.fast_accum_checks: dict[str, FastAccumCheck] = {}  # policy -> fast-accumulation decision (auto)
        self._refs: dict[int, tuple[tuple, Any]] = {}
        self.compile_over_budget: str | None = None
        self.fp8_plans: dict[str, FP8Plan] = {}  # policy -> planned FP8 keep-list (when --fp8-keep is auto)
        self.calibration = load_calibration(mf, cfg.calibration, model, device,
                                            captured.graph_module if captured.ok else None)
        score = getattr(mf, "score", None)
        self.score_gate = (ScoreGate(score, cfg.min_score_ratio, cfg.min_score, where=mf.path.name)
                           if score is not None else None)
        self._real_stats: dict[Any, ErrorStats] = {}  # graph key -> worst stats over the real batches
        self.check_set = CheckSet(mf, cfg.batch_sizes, device, known=self._refs)
        self._check_stats: dict[Any, tuple[ErrorStats, int, int]] = {}  # (graph key, numerics) -> (stats, rows, batch)

    def calibration_inputs(self, batch_size: int) -> list[tuple]:
        """The fp16 overflow calibration of a trial at ``batch_size``: its reference inputs, then every real batch."""
        return [self.reference(batch_size)[0], *(b.inputs for b in self.calibration)]

    def reference(self, batch_size: int) -> tuple[tuple, Any]:
        """Fresh random inputs for ``batch_size`` (seeded, so every candidate sees the same) and FP32 outputs."""
        if batch_size not in self._refs:
            inputs = (self.check_set.inputs(batch_size) if batch_size in self.check_set.batch_sizes  # one copy
                      else reference_inputs(self.mf, batch_size, self.device))
            try:
                with precision_mode("fp32"), torch.inference_mode():
                    ref = self.model(*inputs)
            except Exception as exc:
                release_memory(self.device)
                if is_oom(exc):
                    raise CandidateRejected(f"the FP32 reference ran out of memory at batch size {batch_size}",
                                            FailureKind.OUT_OF_MEMORY) from exc
                raise CandidateRejected(f"the model raised at batch size {batch_size} (FP32 reference run): "
                                        f"{type(exc).__name__}: {first_line(exc)}", FailureKind.RUNTIME_ERROR) from exc
            self._refs[batch_size] = (inputs, ref)
        return self._refs[batch_size]

    def build(self, params: dict, fp8_keep: Sequence[str] | None = None,
              fp8_fast_accum: bool | None = None) -> Candidate:
        """The candidate for trial ``params`` before its runtime wrapper (``batch_size``, ``precision``,
        ``graph_passes``, ``policy``, ``memory_format``; ``runtime`` is applied by :meth:`evaluate`).
        ``fp8_keep`` / ``fp8_fast_accum``: see :meth:`keep_for` / :meth:`fast_accum_for` (a trial's recorded
        values, rebuilt)."""
        cand = self._build(params, fp8_keep, fp8_fast_accum)
        if params.get("memory_format") == "channels_last":
            module = cand.module if params["graph_passes"] else copy.deepcopy(cand.module)  # never the reference
            cand.module = ChannelsLast(module.to(memory_format=torch.channels_last))
            cand.description += ", channels-last"
        return cand

    def trial_params(self, params: dict, fp8_keep: Sequence[str] | None = None,
                     fp8_fast_accum: bool | None = None) -> TrialParams:
        """The typed parameters of trial ``params`` with its FP8 keep-list and fast accumulation resolved
        (:meth:`keep_for`, :meth:`fast_accum_for`)."""
        if not params.get("graph_passes"):
            return TrialParams.from_params(params, ())
        keep = self.keep_for(params, fp8_keep)  # first: the fast-accumulation check times the chosen keep-list
        fast = self.fast_accum_for(params, fp8_keep, fp8_fast_accum)
        return TrialParams.from_params(params, keep, fp8_fast_accum=fast)

    def _build(self, params: dict, fp8_keep: Sequence[str] | None = None,
               fp8_fast_accum: bool | None = None) -> Candidate:
        precision = params["precision"]
        runtime = params.get("runtime", "eager")
        if params["graph_passes"]:
            trial = self.trial_params(params, fp8_keep, fp8_fast_accum)
            g, results = build_trial_graph(self.captured.graph_module, self.hw, trial,
                                           self.calibration_inputs(trial.batch_size),
                                           output_dtype=self.cfg.output_dtype)
            keep, policy = trial.fp8_keep, trial.policy
            label = f"{precision} ({policy})" if precision in ("fp16", "bf16") else precision
            if precision == "fp8":
                label += f" (bf16: {keep_label(keep)})" if keep else " (every eligible linear)"
                if trial.fp8_fast_accum:
                    label += ", fast accumulation"
            return Candidate(g.to(self.device), precision, results, f"tctune graph {label}, {runtime}",
                             fp8_keep=keep if precision == "fp8" else None,
                             fp8_fast_accum=trial.fp8_fast_accum if precision == "fp8" else None)
        if precision in ("fp16", "bf16"):
            dtype = torch.float16 if precision == "fp16" else torch.bfloat16
            # Outputs follow the run's contract (TuneConfig.output_dtype): "compute" returns them as the plain
            # recipe does; "fp32" casts the low ones up inside the timed call, as tctune's graph does then.
            up = torch.float32 if self.cfg.output_dtype == "fp32" else None
            if params.get("model_cast"):  # a plain baseline: the model cast as a whole (model.half() / .to(bf16))
                return Candidate(CastModel(self.model, dtype, out_dtype=up), precision, [],
                                 f"model cast {precision} (whole model), {runtime}")
            module = Autocast(self.model, dtype, self.device.type)
            return Candidate(module if up is None else OutputsTo(module, dtype, up), precision, [],
                             f"model autocast {precision}, {runtime}")
        return Candidate(self.model, precision, [], f"model {precision}, {runtime}")

    def keep_for(self, params: dict, recorded: Sequence[str] | None = None) -> tuple[str, ...]:
        """The FP8 keep-list the graph of trial ``params`` is built with: ``()`` below precision fp8; else
        ``recorded`` (the list a finished trial measured, its ``fp8_keep`` user attribute) when given, so a rebuild
        is that graph even if this process planned differently, or :meth:`fp8_keep`."""
        if params["precision"] != "fp8":
            return ()
        if recorded is not None:
            return tuple(recorded)
        return self.fp8_keep(params.get("policy", "autocast"), params["batch_size"])

    def fp8_keep(self, policy: str, batch_size: int) -> tuple[str, ...]:
        """The FP8 keep-list for graph candidates with ``policy``: ``--fp8-keep``'s patterns, or the one planned
        once per study (a later policy reuses the first usable plan, :meth:`tctune.fp8_plan.FP8Plan.reused`) from the error of FP8 graphs on the FP32 reference inputs at ``batch_size``
        (:func:`tctune.fp8_plan.plan_fp8_keep`, aiming at 0.9 × ``--max-error-fp8``), or, when the model file
        gives ``score``, from their score shortfall (aiming at 0.9 × the allowed shortfall, 0.01 by default).

        Raises:
            CandidateRejected: no linear can run FP8 within the limit (the plan's reason).
        """
        if self.cfg.fp8_keep is not None:
            return tuple(self.cfg.fp8_keep)
        if policy not in self.fp8_plans:
            planned = next((p for p in self.fp8_plans.values() if p.usable and p.reused_from is None), None)
            if planned is not None:  # one plan per study: the keep-list is reused, the trial's own check decides
                self.fp8_plans[policy] = planned.reused(policy)
            else:
                self.fp8_plans[policy] = self._plan_fp8(policy, batch_size)
                self.fp8_plans[policy].policy = policy
            log.info("FP8 plan (%s policy): %s", policy, self.fp8_plans[policy].summary())
        plan = self.fp8_plans[policy]
        if not plan.usable:
            raise CandidateRejected(plan.reason, FailureKind.ACCURACY)
        return plan.keep

    def fast_accum_for(self, params: dict, recorded_keep: Sequence[str] | None = None,
                       recorded: bool | None = None) -> bool:
        """Whether the FP8 graph of trial ``params`` uses ``torch._scaled_mm``'s fast accumulation: False below
        precision fp8; ``recorded`` (a finished trial's ``fp8_fast_accum`` user attribute) when given; False when
        only a keep-list was recorded (a trial measured before fast accumulation was a choice); else
        :meth:`fp8_fast_accum`."""
        if params["precision"] != "fp8":
            return False
        if recorded is not None:
            return bool(recorded)
        if recorded_keep is not None:
            return False
        return self.fp8_fast_accum(params.get("policy", "autocast"), params["batch_size"])

    def fp8_fast_accum(self, policy: str, batch_size: int) -> bool:
        """Fast accumulation for graph candidates with ``policy``: the single value of
        ``SearchSpace.fp8_fast_accum`` (``--fp8-fast-accum on`` / ``off``, or a GPU where ``auto`` does not try
        it), else decided once per study (a later policy reuses it, :meth:`FastAccumCheck.reused`) by
        :func:`tctune.fp8_plan.choose_fast_accum` on the keep-list of :meth:`fp8_keep`, at ``batch_size``'s
        reference inputs, held to the FP8 plan's aim (0.9 × ``--max-error-fp8``, or of the allowed score
        shortfall) and timed through the search's fastest runtime.

        Raises:
            CandidateRejected: the FP8 plan found no usable keep-list (its reason).
        """
        choices = self.fp8_fast_accum_choices
        if len(choices) == 1:
            return bool(choices[0])
        if policy not in self.fast_accum_checks:
            first = next((c for c in self.fast_accum_checks.values() if c.reused_from is None), None)
            if first is not None:
                self.fast_accum_checks[policy] = first.reused(policy)
            else:
                keep = self.fp8_keep(policy, batch_size)
                check = self._check_fast_accum(policy, batch_size, keep)
                check.policy = policy
                self.fast_accum_checks[policy] = check
            log.info("FP8 (%s policy): %s", policy, self.fast_accum_checks[policy].summary())
        return self.fast_accum_checks[policy].kept

    def _check_fast_accum(self, policy: str, batch_size: int, keep: tuple[str, ...]) -> FastAccumCheck:
        """:func:`tctune.fp8_plan.choose_fast_accum` for the FP8 graph of ``policy`` with ``keep``: the planned
        aim, error and timing when this policy's plan chose ``keep``, else (``--fp8-keep`` given) the aim from
        the limit and both errors measured here."""
        inputs, ref = self.reference(batch_size)
        plan = self.fp8_plans.get(policy)
        planned = plan is not None and plan.usable and tuple(plan.keep) == tuple(keep)
        gate = self.score_gate
        if planned:
            target, metric, error_full = plan.target, plan.metric, plan.error
            speed_full = next((v for a, v in zip(plan.alternatives, plan.speeds)
                               if sorted(a["keep"]) == sorted(keep)), None)
        else:
            if gate is not None:
                gate.reference(self.model)
            limit = self.cfg.max_error_fp8 if gate is None else gate.allowed_shortfall
            target, metric = DEFAULT_MARGIN * limit, METRIC_L2 if gate is None else METRIC_SCORE
            error_full = speed_full = None

        def error_of(fast: bool) -> float:
            g, _ = apply_passes(self.captured.graph_module, self.hw, "fp8", policy=policy, fp8_keep=keep,
                                output_dtype=self.cfg.output_dtype, fp8_fast_accum=fast)
            g = g.to(self.device)
            score_of = None
            if gate is not None:
                key = (graph_key(TrialParams(batch_size=1, precision="fp8", graph_passes=True, policy=policy,
                                             fp8_keep=keep, fp8_fast_accum=fast)), False)  # evaluate()'s key
                score_of = lambda graph: gate.shortfall(gate.score(key, graph, "fp8")[0])  # noqa: E731
            try:
                return graph_error(g, inputs, ref, score_of)
            finally:
                g = None
                release_memory(self.device)

        if error_full is None:
            try:
                error_full = error_of(False)
            except Exception as exc:  # noqa: BLE001 - for the record only; the fast graph's own run decides
                log.info("FP8 graph without fast accumulation could not be checked: %s", first_line(exc))
        return choose_fast_accum(keep, target, lambda: error_of(True),
                                 lambda fast: self._fp8_throughput(policy, keep, inputs, fast_accum=fast),
                                 error_full=error_full, speed_full=speed_full, metric=metric)

    def _plan_fp8(self, policy: str, batch_size: int) -> FP8Plan:
        inputs, ref = self.reference(batch_size)
        limit, score_of = self.cfg.max_error_fp8, None
        gate = self.score_gate
        if gate is not None:
            gate.reference(self.model)
            limit = gate.allowed_shortfall
            if not limit > 0:
                return FP8Plan((), float("nan"), limit, 0.0, reason=(
                    f"FP8 cannot meet the score limit {format_score(gate.limit)}: it is not below the FP32 score "
                    f"{format_score(gate.fp32)}; FP8 candidates are rejected"), metric=METRIC_SCORE)

            def score_of(keep: tuple[str, ...], graph) -> float:  # cached with the trials that build this graph
                key = (graph_key(TrialParams(batch_size=1, precision="fp8", graph_passes=True, policy=policy,
                                             fp8_keep=keep)), False)  # evaluate()'s key of this graph
                return gate.shortfall(gate.score(key, graph, "fp8")[0])
        try:
            gm, hw = self.captured.graph_module, self.hw
            out = self.cfg.output_dtype
            plan = plan_graph(lambda keep, names: apply_passes(gm, hw, "fp8", names, policy=policy, fp8_keep=keep,
                                                               output_dtype=out)[0],
                              inputs, ref, limit, device=self.device, score_of=score_of)
        except (PassError, CandidateRejected):
            raise
        except Exception as exc:  # noqa: BLE001 - an FP8 graph that cannot run rejects the FP8 candidates
            raise rejection(exc, self.device, batch_size, "FP8 keep-list planning") from exc
        return choose_fastest(plan, lambda keep: self._fp8_throughput(policy, keep, inputs))

    def _fp8_throughput(self, policy: str, keep: tuple[str, ...], inputs: tuple,
                        fast_accum: bool = False) -> float | None:
        """Throughput (items/s) of the FP8 graph with ``keep`` (and ``fast_accum``) through the fastest runtime
        searched (``SearchSpace.fastest_compiled_runtime``; eager when none is compiled), or None when it fails
        (logged)."""
        runtime = self.fastest_compiled_runtime or "eager"
        fn = None
        try:
            g, _ = apply_passes(self.captured.graph_module, self.hw, "fp8", policy=policy, fp8_keep=keep,
                                output_dtype=self.cfg.output_dtype, fp8_fast_accum=fast_accum)
            with precision_mode("fp8"):
                fn, _ = wrap(g.to(self.device), runtime, inputs)
                timing = time_call(lambda: fn(*inputs), len(inputs[0]), self.device)
            return timing.throughput
        except Exception as exc:  # noqa: BLE001 - one keep-list failing leaves the others
            log.info("FP8 keep-list %s could not be timed: %s", keep_label(keep) or "(none)", first_line(exc))
            return None
        finally:
            fn = g = None
            release_memory(self.device)

    def runnable(self, params: dict, fp8_keep: Sequence[str] | None = None,
                 fp8_fast_accum: bool | None = None) -> tuple[Callable[[], Any], int, str]:
        """Trial ``params`` built and wrapped for its runtime, ready to time: ``(call, batch_size, precision)``
        where ``call()`` runs one batch on the reference inputs, to be called under
        ``tctune.measure.precision_mode(precision)`` (the side-by-side comparison). ``params`` may hold
        ``model_cast`` (:func:`tctune.search.baselines.candidate_params`). The caller drops ``call`` to free it.

        Raises:
            CandidateRejected: out of memory, or the build or compile failed.
        """
        bs = params["batch_size"]
        runtime = params.get("runtime", "eager")
        inputs, _ = self.reference(bs)
        try:
            cand = self.build(params, fp8_keep, fp8_fast_accum)
            with precision_mode(cand.precision):
                fn, _ = wrap(cand.module, runtime, inputs)
            return (lambda: fn(*inputs)), bs, cand.precision
        except CandidateRejected:
            raise
        except Exception as exc:
            raise rejection(exc, self.device, bs, f"{runtime} rebuild") from exc

    def evaluate(self, params: dict, on_repeat=None, fp8_keep: Sequence[str] | None = None,
                 fp8_fast_accum: bool | None = None) -> dict:
        """Build, check and time one candidate; returns the trial's metrics (``fp8_keep``, ``fp8_fast_accum``: see
        :meth:`build`; an FP8 graph trial records both).

        Raises:
            CandidateRejected: out of memory, NaN/inf outputs, or a broken rewrite.
        """
        bs = params["batch_size"]
        runtime = params.get("runtime", "eager")
        inputs, ref = self.reference(bs)
        if self.score_gate is not None:
            self.score_gate.reference(self.model)  # the FP32 score first: a broken score() stops the run here
        release_memory(self.device)  # what earlier candidates left (CUDA graph pools, compiled code)
        held = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        if params["graph_passes"]:  # planned once per study (FP8 keep-list, fast accumulation): not this setup
            self.trial_params(params, fp8_keep, fp8_fast_accum)
        started = time.perf_counter()
        cand = self.build(params, fp8_keep, fp8_fast_accum)
        build_s = time.perf_counter() - started  # tctune's graph: its passes (and fp16 calibration); else a wrapper
        # Peak memory is reported per candidate: the peak during its run, minus what tctune itself holds
        # (references for other batch sizes, the FP32 model), plus the inputs and, for the model as written,
        # its weights, which the candidate uses but which were allocated before it.
        own = sum(t.numel() * t.element_size() for t in inputs)
        if not params["graph_passes"] and not params.get("model_cast"):  # a cast model's copy is its own
            own += sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        compile_s = 0.0
        fn = None
        try:
            with precision_mode(cand.precision):
                fn, compile_s = wrap(cand.module, runtime, inputs)
                if runtime.startswith("inductor") and compile_s > self.cfg.compile_budget_s:
                    self.compile_over_budget = f"trial compile took {compile_s:.0f} s"
                    raise CandidateRejected(f"compile took {compile_s:.0f} s > --compile-budget {self.cfg.compile_budget_s:g} s",
                                            FailureKind.COMPILE_BUDGET)
                with torch.inference_mode():
                    out = detach_outputs(fn(*inputs))
            # the model cast as a whole and autocast share their TrialParams (precision, no passes): not their graph
            key = (graph_key(self.trial_params(params, cand.fp8_keep, cand.fp8_fast_accum)),
                   bool(params.get("model_cast")))
            # a CUDA graph replays the kernels of the runtime it wraps: the same numerics, checked once
            numerics = "eager" if runtime == "cudagraphs" else runtime.removesuffix("-cudagraphs")
            checked, check_rows, check_bs = self._check_rows((key, numerics), fn, cand.precision, bs, out, ref)
            err: ErrorStats = self._real_data(key, cand, checked)
            try:
                check_accuracy(err, cand.precision, out, max_mismatch_rate=self.cfg.max_mismatch_rate)
            except CandidateRejected as exc:
                if check_rows != bs or len(self.check_set.batch_sizes) > 1:  # say which rows decided
                    sizes = ", ".join(map(str, self.check_set.batch_sizes))
                    raise CandidateRejected(f"{exc}; judged on {check_rows} seeded random rows (the inputs of batch "
                                            f"sizes {sizes}, run {check_bs} at a time)",
                                            exc.kind or FailureKind.ACCURACY) from exc
                exc.kind = exc.kind or FailureKind.ACCURACY
                raise
            del out
            scored = self._score(key, cand, params)
            with precision_mode(cand.precision):
                timing = time_call(lambda: fn(*inputs), bs, self.device, on_repeat=on_repeat,
                                   target_repeat_s=0.1 if self.device.type == "cuda" else 0.15)
        except (CandidateRejected, optuna.TrialPruned):
            raise
        except Exception as exc:
            raise rejection(exc, self.device, bs, f"{runtime} run") from exc
        finally:
            cand.module = fn = None  # drop the candidate's weights / CUDA graph / compiled code now
            release_memory(self.device)
        peak = None
        if timing.peak_memory_mib is not None:
            peak = timing.peak_memory_mib - (held - own) / 2**20
        extra = ({} if cand.fp8_keep is None else  # export rebuilds this graph
                 {"fp8_keep": list(cand.fp8_keep), "fp8_fast_accum": bool(cand.fp8_fast_accum)})
        extra.update(check_rows=check_rows, check_batch_size=check_bs)
        extra.update(scored)
        if self.calibration:
            extra["real_batches"] = len(self.calibration)
        # setup_s: seconds from the captured graph (or the model) to a callable candidate: build_s (the passes)
        # plus compile_s (CUDA graph capture / Inductor compile, tctune.runtime.wrap); the capture is once per study
        return trial_metrics(timing, err, peak_memory_mib=peak, setup_s=build_s + compile_s, build_s=build_s,
                             compile_s=compile_s, description=cand.description,
                             passes=[{"name": r.name, "changed": r.count, **({"failed": r.notes["failed"]} if "failed" in r.notes else {}),
                                      **({"skipped": skip_reasons(r.skipped)} if r.skipped else {})}
                                     for r in cand.passes], **extra)

    def _check_rows(self, key, fn: Callable, precision: str, batch_size: int, out: Any,
                    ref: Any) -> tuple[ErrorStats, int, int]:
        """``(stats, rows, batch size)``: the candidate ``fn`` (wrapped for its runtime, built for ``batch_size``)
        compared with the FP32 model on every row of :attr:`check_set`, ``batch_size`` rows per call, pooled
        (:class:`~tctune.measure.PooledComparison`); computed once per ``key`` (graph key and runtime, a CUDA-graph
        runtime counting as the one it replays) at the first batch size it is evaluated at, then reused at every
        other. ``out``/``ref``: the candidate's and the FP32 outputs on the trial's own reference inputs (one of
        the chunks). A batch size that is not searched is judged on its own rows.

        Raises:
            CandidateRejected: the candidate raised on a chunk, or the FP32 model did.
        """
        if batch_size not in self.check_set.batch_sizes:
            return compare(out, ref), batch_size, batch_size
        if key not in self._check_stats:
            pooled = PooledComparison()
            for inputs, rows, source in self.check_set.chunks(batch_size):
                if source == batch_size:
                    pooled.add(out, ref, batch=batch_size)
                    continue
                try:
                    with precision_mode("fp32"), torch.inference_mode():
                        chunk_ref = self.model(*inputs)
                except Exception as exc:  # noqa: BLE001 - the reference itself ran on other rows
                    release_memory(self.device)
                    raise CandidateRejected(
                        f"the model raised at batch size {batch_size} on the accuracy check rows of batch size "
                        f"{source} (FP32 reference run): {type(exc).__name__}: {first_line(exc)}",
                        FailureKind.RUNTIME_ERROR) from exc
                try:
                    with precision_mode(precision), torch.inference_mode():
                        chunk_out = detach_outputs(fn(*inputs))
                except Exception as exc:  # noqa: BLE001 - this candidate fails where FP32 ran
                    raise rejection(exc, self.device, batch_size,
                                    f"the accuracy check on the rows of batch size {source}") from exc
                pooled.add(chunk_out, chunk_ref, rows=rows, batch=batch_size)
                chunk_out = chunk_ref = None
            self._check_stats[key] = (pooled.stats(), pooled.rows, batch_size)
        return self._check_stats[key]

    def _real_data(self, key, cand: Candidate, err: ErrorStats) -> ErrorStats:
        """``err`` (the random inputs' stats) merged with the candidate's worst stats over the real batches,
        computed once per graph ``key`` by running ``cand.module`` (before the runtime wrapper) on each."""
        if not self.calibration:
            return err
        if key not in self._real_stats:
            stats = None
            for b in self.calibration:
                try:
                    with precision_mode(cand.precision), torch.inference_mode():
                        out = detach_outputs(cand.module(*b.inputs))
                except Exception as exc:  # noqa: BLE001 - this candidate fails where FP32 ran
                    raise rejection(exc, self.device, len(b.inputs[0]), f"the real batch {b.source}") from exc
                s = compare(out, b.reference)
                stats = s if stats is None else worst(stats, s)
            self._real_stats[key] = stats
        return worst(err, self._real_stats[key])

    def _score(self, key, cand: Candidate, params: dict) -> dict:
        """The score metrics of the candidate (:meth:`ScoreGate.metrics`), {} without a score. The FP32 model as
        written is the reference itself: its score is the FP32 score."""
        gate = self.score_gate
        if gate is None:
            return {}
        if (params["precision"] == "fp32" and not params["graph_passes"]
                and params.get("memory_format", "contiguous") == "contiguous"):
            return gate.metrics(gate.reference(self.model), 0.0)
        value, seconds = gate.score(key, cand.module, cand.precision)
        return gate.metrics(value, seconds)


__all__ = ["Candidate", "Evaluator", "InferenceEvaluator"]
