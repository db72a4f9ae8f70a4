"""The search loop: one Optuna study per (model, hardware, mode, search space), every candidate measured.

The study is stored by default in ``<out>/study.db`` (SQLite), so running the same command again resumes it:
finished trials are kept and new ones are added. The FP32 eager baseline at every searched batch size is
enqueued first, so the report's speedups are like-for-like (measured in the same study, on the same inputs).
The :class:`Tuner` composes the parts: the :class:`~tctune.search.space.SearchSpace`, an evaluator
(:mod:`tctune.search.evaluate`: inference or training, one interface), the study storage
(:mod:`tctune.search.storage`) and the reading of results (:mod:`tctune.search.results`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Sequence

import optuna
import torch

from ..capture import Captured, batch_range, try_capture
from ..errors import CandidateRejected, ModelFileError, PassError, UsageError
from ..hardware import HardwareSpec
from ..measure import precision_mode
from ..modelfile import ModelFile
from ..runtime import CUDA_GRAPH_RUNTIMES, RUNTIMES_CPU, RUNTIMES_GPU
from ..trial import FailureKind, TrialParams, measuring_device
from .config import OBJECTIVES, TuneConfig
from .evaluate import Evaluator, InferenceEvaluator
from .results import (best_trial, confirmed_throughputs, constraint_checks, counts_as_measured, fail, failure_kind, first_line,
                      is_feasible, objective_values)
from .space import SearchSpace
from .storage import fail_interrupted, measured, open_study, retry_interrupted
from .train import TrainingEvaluator

log = logging.getLogger("tctune")

TRAIN_NO_PASSES = ("training runs the model as written (autocast; GradScaler for fp16): tctune's graph passes "
                   "are inference rewrites and are not applied in --mode train yet")

#: Search spaces with at most this many combinations are enumerated (no candidate measured twice).
BRUTE_FORCE_MAX = 96
#: After the trials, the (at most) CONFIRM_TOP fastest feasible candidates within CONFIRM_BAND of the fastest are
#: built and timed once more, and the winner is the best by the mean of both timings. Why: on the H200 the seed
#: CNN's search took Inductor without a CUDA graph at 6.25 M img/s over Inductor + CUDA graph at 6.14 M (1.7 %
#: apart, a 0.17 ms call), and the same configuration timed again in that process ran 5.48 M
#: (benchmarks/NOTES.md): one timing of a launch-bound candidate can be 12 % off.
CONFIRM_TOP = 3
CONFIRM_BAND = 0.05



class Tuner:
    """Runs the study for one model file on one hardware spec.

    Args:
        cfg: run options.
        mf: the loaded model file.
        hw: hardware spec (detected, ``--target``, or CPU) that sets alignment and allowed precisions.
        device: where candidates are measured.
    """

    def __init__(self, cfg: TuneConfig, mf: ModelFile, hw: HardwareSpec, device: torch.device | None = None):
        self.cfg, self.mf, self.hw = cfg, mf, hw
        self.device = device or measuring_device()
        training = cfg.mode == "train"
        default = RUNTIMES_GPU if self.device.type == "cuda" else RUNTIMES_CPU
        if training:
            default = tuple(r for r in default if r not in CUDA_GRAPH_RUNTIMES)
        runtimes = tuple(cfg.runtimes or default)
        graphed = [r for r in runtimes if r in CUDA_GRAPH_RUNTIMES]
        if training and graphed:
            raise UsageError(f"runtimes {graphed[0]} is for inference; in mode train use eager or inductor",
                             field="runtimes")
        if self.device.type != "cuda" and graphed:
            raise UsageError(f"runtimes {graphed[0]} needs a CUDA GPU; this machine measures on the CPU\n"
                             f"  fix: runtimes {','.join(RUNTIMES_CPU)} (or run on a GPU machine)", field="runtimes")
        if "eager" not in runtimes:
            raise UsageError(f"runtimes {','.join(runtimes)} leaves out eager, which the FP32 eager baselines "
                             f"every result is compared with need\n  fix: runtimes eager,{','.join(runtimes)}",
                             field="runtimes")
        precisions = hw.search_precisions(measure_on_gpu=self.device.type == "cuda", training=training)
        if cfg.max_memory_mib is not None and self.device.type != "cuda":
            log.warning("--max-memory-mib limits peak CUDA memory; this run measures on the %s, where it is not "
                        "measured, so the limit is ignored", self.device.type.upper())
        if cfg.effective_batch:
            for bs in cfg.batch_sizes:
                if cfg.effective_batch % bs:
                    steps = -(-cfg.effective_batch // bs)
                    log.warning("--effective-batch %d is not a multiple of batch size %d: its optimizer steps take "
                                "%d micro-batch(es), %d samples", cfg.effective_batch, bs, steps, steps * bs)
        if "fp8" not in precisions and (cfg.fp8_keep is not None or cfg.max_error_fp8 != TuneConfig.max_error_fp8):
            log.warning("precision fp8 is not searched here (it needs FP8 Tensor Cores, sm_89 or newer, a GPU to "
                        "measure on and --mode infer), so --fp8-keep / --max-error-fp8 have no effect")
        self.model = mf.model().to(self.device)
        self.model.train(training)
        if training:
            self.captured = Captured(None, TRAIN_NO_PASSES)
        else:
            cap_inputs = mf.inputs(2, self.device)
            with precision_mode("fp32"):
                self.captured = try_capture(self.model, cap_inputs, mf.dynamic_shapes, mf.batched_mask())
        self.out_dir = Path(cfg.out_dir)
        on_gpu_infer = self.device.type == "cuda" and not training
        self.search_space = SearchSpace(
            batch_sizes=tuple(cfg.batch_sizes), precisions=tuple(precisions), runtimes=runtimes,
            graph=self.captured.ok, mode=cfg.mode,
            policy=on_gpu_infer and self.captured.ok and any(p in ("fp16", "bf16") for p in precisions),
            memory_format=on_gpu_infer and any(isinstance(m, torch.nn.Conv2d) for m in self.model.modules()))
        self.evaluator: Evaluator = (
            TrainingEvaluator(cfg, mf, self.device, self.model) if training else
            InferenceEvaluator(cfg, mf, hw, self.device, self.model, self.captured,
                               self.search_space.fastest_compiled_runtime))
        self._opened = False
        self.interrupted = False

    # -- the parts, by job ------------------------------------------------------------------------------
    @property
    def precisions(self) -> tuple[str, ...]:
        return self.search_space.precisions

    @property
    def runtimes(self) -> tuple[str, ...]:
        return self.search_space.runtimes

    @property
    def fp8_plans(self) -> dict:
        return self.evaluator.fp8_plans

    @property
    def compile_over_budget(self) -> str | None:
        return self.evaluator.compile_over_budget

    def space(self) -> dict:
        return self.search_space.space()

    def space_size(self) -> int:
        return self.search_space.size()

    def candidate(self, **params) -> dict:
        return self.search_space.candidate(**params)

    def compiled_first(self) -> list[dict]:
        return self.search_space.compiled_first()

    def reference(self, batch_size: int):
        """The evaluator's seeded inputs (and reference) at ``batch_size``."""
        return self.evaluator.reference(batch_size)

    def trial_params(self, params: dict, fp8_keep: Sequence[str] | None = None) -> TrialParams:
        """Trial ``params`` typed, with the FP8 keep-list it is built with resolved (a recorded one as given)."""
        return self.evaluator.trial_params(params, fp8_keep)

    def build(self, params: dict, fp8_keep: Sequence[str] | None = None):
        """The candidate of trial ``params`` (inference: its module before the runtime wrapper)."""
        return self.evaluator.build(params, fp8_keep)

    def evaluate(self, params: dict, on_repeat=None, fp8_keep: Sequence[str] | None = None) -> dict:
        """Build, check and time one candidate (the evaluator's; trials and the finalists' re-measure)."""
        return self.evaluator.evaluate(params, on_repeat=on_repeat, fp8_keep=fp8_keep)

    measured = staticmethod(measured)
    fail_interrupted = staticmethod(fail_interrupted)

    def retry_interrupted(self, study: optuna.Study) -> int:
        return retry_interrupted(study, self.space())

    def study_name(self) -> str:
        key = json.dumps(self.space(), sort_keys=True)
        digest = hashlib.sha1(key.encode()).hexdigest()[:8]
        cc = self.hw.compute_capability or "cpu"
        obj = "" if self.cfg.objective == "throughput" else f"-{self.cfg.objective}"
        return f"{self.mf.name}-{self.hw.arch}-{cc}-{self.device.type}-{self.cfg.mode}{obj}-{digest}"

    def storage_url(self) -> str:
        return self.cfg.storage or f"sqlite:///{(self.out_dir / 'study.db').resolve()}"

    def make_sampler(self) -> optuna.samplers.BaseSampler:
        """Small spaces are enumerated without repeats (Optuna's BruteForceSampler, random order); larger
        ones use TPE, where accuracy is a constraint (``Trial.set_constraint``) it learns from."""
        if self.space_size() <= BRUTE_FORCE_MAX:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.samplers.BruteForceSampler(seed=self.cfg.seed)
        return optuna.samplers.TPESampler(seed=self.cfg.seed, n_startup_trials=8)

    def create_study(self) -> optuna.Study:
        sampler = self.make_sampler()
        url = self.storage_url()
        if self.cfg.storage is None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            study, storage = open_study(url, self.study_name(), list(OBJECTIVES[self.cfg.objective]), sampler,
                                         prune=self.cfg.prune)
        except Exception as exc:
            raise UsageError(
                f"cannot open the study storage {url}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}\n"
                f"  fix: give an Optuna storage URL such as sqlite:///study.db or postgresql://user@host/db, "
                f"and check that the server is reachable") from exc
        if self.cfg.storage is None and not self._opened:
            # The default SQLite study has one tctune process (it starts any workers itself, after this):
            # a trial still RUNNING was cut off by a killed process.
            self.fail_interrupted(study, storage)
        if not self._opened:
            self.retry_interrupted(study)
        self._opened = True
        if not study.trials:
            for bs in self.cfg.batch_sizes:  # FP32 eager baselines, one per batch size
                study.enqueue_trial(self.candidate(batch_size=bs, precision="fp32", graph_passes=False, runtime="eager"))
            for params in self.compiled_first():
                study.enqueue_trial(params)
            if self.captured.ok:  # then tctune's graph at each low precision, largest batch
                for p in self.precisions:
                    if p != "fp32":
                        study.enqueue_trial(self.candidate(batch_size=max(self.cfg.batch_sizes), precision=p,
                                                           graph_passes=True, runtime="eager"))
                if self.search_space.policy:
                    for p in self.precisions:
                        if p in ("fp16", "bf16"):
                            study.enqueue_trial(self.candidate(batch_size=max(self.cfg.batch_sizes), precision=p,
                                                               graph_passes=True, runtime="eager", policy="pure"))
        return study

    def skip_reason(self, study: optuna.Study, params: dict, number: int = 1 << 62) -> str | None:
        """Why ``params`` need not be measured: already measured, a smaller batch with the same settings
        ran out of memory, or compiles are over budget. None when it should be measured."""
        same_settings = {k: v for k, v in params.items() if k != "batch_size"}
        done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
        for prev in study.get_trials(deepcopy=False, states=done + (optuna.trial.TrialState.RUNNING,)):
            if prev.number == number or not counts_as_measured(prev):
                continue
            if prev.params == params:
                if prev.state == optuna.trial.TrialState.RUNNING:
                    if prev.number < number:  # another worker took it first
                        return f"duplicate of trial {prev.number} (being measured by another worker)"
                    continue
                what = "measured" if prev.state == optuna.trial.TrialState.COMPLETE else "failed"
                return f"duplicate of trial {prev.number} ({what}; not run again)"
            if (prev.user_attrs.get("fail_kind") == FailureKind.OUT_OF_MEMORY.value and {k: v for k, v in prev.params.items() if k != "batch_size"} == same_settings
                    and prev.params.get("batch_size", 0) <= params["batch_size"]):
                return f"batch {prev.params['batch_size']} already ran out of memory with these settings (trial {prev.number})"
        if params.get("policy") == "pure" and (not params.get("graph_passes")
                                               or params["precision"] not in ("fp16", "bf16", "fp8")):
            # at fp8 the policy is that of the bf16 cast around the FP8 GEMMs (on the H200, BERT-base's planned
            # FP8 graph: 20,088 seq/s pure against 15,854 autocast, benchmarks/RESULTS.md)
            return "policy pure applies only to tctune's fp16/bf16/fp8 graph (this candidate equals its autocast twin)"
        if params["precision"] == "fp8" and not params.get("graph_passes"):
            return "fp8 needs tctune's graph (FP8 GEMMs are a graph rewrite; the model as written has none)"
        if params.get("graph_passes") and self.captured.ok:
            lo, hi = batch_range(self.captured.graph_module)
            if not lo <= params["batch_size"] <= hi:
                return (f"tctune's graph accepts batch {lo}..{hi} (torch.export narrowed the dynamic batch); "
                        f"batch {params['batch_size']} runs only as written")
        if params.get("runtime", "").startswith("inductor") and self.compile_over_budget:
            return f"compiles are over --compile-budget ({self.compile_over_budget})"
        return None

    def objective(self, trial: optuna.Trial) -> float:
        space = self.space()
        params = {k: trial.suggest_categorical(k, v) for k, v in space.items()}
        skip = self.skip_reason(trial.study, params, trial.number)
        if skip:
            fail(trial, skip, FailureKind.SKIPPED)
            raise optuna.TrialPruned(skip)
        def on_repeat(step: int, throughput: float) -> None:
            if self.cfg.objective != "throughput":
                return
            trial.report(throughput, step)
            if trial.should_prune():
                reason = (f"stopped early: {throughput:.4g} items/s after {step + 1} repeat(s), in the slowest "
                          "quarter of the trials so far (Optuna PercentilePruner)")
                trial.set_user_attr("fail_reason", reason)
                raise optuna.TrialPruned(reason)

        try:
            metrics = self.evaluate(params, on_repeat=on_repeat)
        except CandidateRejected as exc:
            fail(trial, str(exc), failure_kind(exc))
            raise
        except PassError as exc:
            fail(trial, str(exc), FailureKind.PASS_ERROR)
            raise CandidateRejected(str(exc), FailureKind.PASS_ERROR) from exc
        except (ModelFileError, UsageError, optuna.TrialPruned):
            raise  # the user's files or options: one clear error for the whole run; or stopped early
        except Exception as exc:  # anything else a candidate raises costs that trial, not the study
            reason = f"{type(exc).__name__}: {first_line(exc)}"
            fail(trial, reason, FailureKind.RUNTIME_ERROR)
            raise CandidateRejected(reason, FailureKind.RUNTIME_ERROR) from exc
        for k, v in metrics.items():
            trial.set_user_attr(k, v)
        over, kind = [], None
        for key, value, reason, k in constraint_checks(metrics, params["precision"], self.cfg):
            trial.set_constraint(key, value)
            if reason:
                over.append(reason)
                kind = kind or k
        if over:
            fail(trial, "; ".join(over), kind)
        return objective_values(metrics, self.cfg.objective)

    def run(self) -> optuna.Study:
        """Add ``cfg.trials`` trials to the study (resuming it), with a progress bar unless quiet.

        Ctrl-C (SIGINT) once: the running trial finishes, then the study stops and the report is written.
        Twice: the running trial is abandoned (marked failed). Finished trials are always kept.
        """
        self.out_dir.mkdir(parents=True, exist_ok=True)
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # tctune reports failed trials itself
        study = self.create_study()
        total = self.cfg.trials
        if self.space_size() <= BRUTE_FORCE_MAX:  # an enumerated space ends when every candidate is measured
            left = self.space_size() - len(self.measured(study))
            if left <= 0:
                log.info("all %d candidates of this search space are already measured; nothing to add "
                         "(widen --batch-sizes or --runtimes to search more)", self.space_size())
                return study
            if left < total:
                log.info("this search space has %d candidates, %d not measured yet: at most %d trials run, not "
                         "--trials %d", self.space_size(), left, left, total)
                total = left
        bar = None
        if not self.cfg.quiet:
            from tqdm.auto import tqdm
            bar = tqdm(total=total, desc="trials", unit="trial", file=sys.stderr, dynamic_ncols=True)

        stop_requested = []

        def on_sigint(signum, frame):
            self.interrupted = True
            if stop_requested:
                raise KeyboardInterrupt
            stop_requested.append(True)
            log.warning("Ctrl-C: stopping after the current trial (press Ctrl-C again to abandon it)")

        def callback(st: optuna.Study, tr: optuna.trial.FrozenTrial) -> None:
            if stop_requested:
                st.stop()
            if tr.state == optuna.trial.TrialState.FAIL and bar is None:
                log.info("trial %d rejected: %s", tr.number, tr.user_attrs.get("fail_reason"))
            if bar is None:
                return
            best = best_trial(st)
            p = tr.params
            state = tr.state.name.lower()
            bar.set_postfix_str(
                f"#{tr.number} {p.get('precision')} b{p.get('batch_size')} {'graph' if p.get('graph_passes') else 'eager'}: "
                f"{state}; best {best.user_attrs['throughput']:.4g}/s" if best else f"#{tr.number} {state}")
            bar.update(1)

        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            study.optimize(self.objective, n_trials=self.cfg.trials, timeout=self.cfg.timeout_s,
                           catch=(CandidateRejected,), callbacks=[callback])
        except KeyboardInterrupt:
            self.interrupted = True
            log.warning("interrupted: finished trials are kept in %s; writing the report", self.storage_url())
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            if bar is not None:
                bar.close()
        if self.space_size() <= BRUTE_FORCE_MAX and len(self.measured(study)) >= self.space_size():
            log.info("every one of the %d candidates of this search space is measured", self.space_size())
        if not self.interrupted and not self.cfg.worker and self.cfg.objective == "throughput":
            self.confirm(study)
        return study

    def confirm(self, study: optuna.Study) -> dict | None:
        """Time the fastest feasible candidates within ``CONFIRM_BAND`` of the fastest once more (at most
        ``CONFIRM_TOP``), each rebuilt; :func:`best_trial` then takes the best mean of the two timings.

        Stored as the study user attribute ``"confirmation"``: ``{"band", "after_trial", "runs": {trial number
        (str): [throughput, re-measured throughput or None, ...]}}`` (items/s; None: a re-run was rejected, e.g.
        out of memory). A resumed study adds its re-measurements to those of earlier runs, so the mean uses
        every timing taken. Nothing is stored when fewer than two candidates are within the band. A candidate
        that fails again is logged, never raised.
        """
        ok = sorted((t for t in study.get_trials(deepcopy=False) if is_feasible(t)),
                    key=lambda t: -t.user_attrs["throughput"])
        if len(ok) < 2:
            return None
        fastest = ok[0].user_attrs["throughput"]
        top = [t for t in ok[:CONFIRM_TOP] if t.user_attrs["throughput"] >= fastest * (1 - CONFIRM_BAND)]
        if len(top) < 2:
            return None
        log.info("re-measuring the %d fastest candidates (within %.0f%% of the fastest) once more", len(top),
                 CONFIRM_BAND * 100)
        runs: dict[str, list] = dict((study.user_attrs.get("confirmation") or {}).get("runs") or {})
        for t in top:
            again = None
            try:  # the graph this trial measured (its keep-list), even if a resumed run plans anew
                again = self.evaluate(dict(t.params), fp8_keep=t.user_attrs.get("fp8_keep"))["throughput"]
            except CandidateRejected as exc:  # the first timing stands; a programming error is not swallowed
                log.info("trial %d could not be re-measured: %s", t.number, first_line(exc))
            runs[str(t.number)] = [*(runs.get(str(t.number)) or [t.user_attrs["throughput"]]), again]
        conf = {"band": CONFIRM_BAND, "after_trial": max(t.number for t in study.get_trials(deepcopy=False)),
                "runs": runs}
        study.set_user_attr("confirmation", conf)
        means = confirmed_throughputs(study)
        again_ok = [str(t.number) for t in top if runs[str(t.number)][-1] is not None]
        log.info("re-measured %d of %d: %s", len(again_ok), len(top),
                 "; ".join(f"trial {n}: mean {means[int(n)]:.4g}/s" for n in again_ok) or "none")
        return conf


__all__ = ["BRUTE_FORCE_MAX", "CONFIRM_BAND", "CONFIRM_TOP", "TRAIN_NO_PASSES", "Tuner"]
