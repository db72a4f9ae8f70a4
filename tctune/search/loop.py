"""The search loop: one Optuna study per (model, hardware, mode, search space), every candidate measured.

The study is stored by default in ``<out>/study.db`` (SQLite), so running the same command again resumes it:
finished trials are kept and new ones are added. The plain baselines (:mod:`tctune.search.baselines`: FP32
eager, autocast and the model cast as a whole at each low precision, and on a GPU ``torch.compile`` of the
fastest of those) are measured first at every searched batch size, in addition to ``--trials``; after the
trials the finalists and the best baselines are timed side by side in this process (:meth:`Tuner.side_by_side`),
and the report's speedups use only those timings, so a resumed study never divides a timing of this run by
one of an earlier run.
The :class:`Tuner` composes the parts: the :class:`~tctune.search.space.SearchSpace`, an evaluator
(:mod:`tctune.search.evaluate`: inference or training, one interface), the study storage
(:mod:`tctune.search.storage`) and the reading of results (:mod:`tctune.search.results`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import signal
import statistics
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Sequence

import optuna
import torch

from ..capture import Captured, batch_range, try_capture
from ..console import above_progress_bar
from ..errors import CandidateRejected, ModelFileError, PassError, UsageError
from ..hardware import HardwareSpec
from ..measure import is_oom, precision_mode, release_memory, time_interleaved
from ..modelfile import ModelFile, user_frame
from ..runtime import CUDA_GRAPH_RUNTIMES, RUNTIMES_CPU, RUNTIMES_GPU
from ..trial import FailureKind, TrialParams, measuring_device, reference_inputs
from .config import OBJECTIVES, TuneConfig
from .baselines import (SIDE_BY_SIDE_BLOCK_S, SIDE_BY_SIDE_ROUNDS, Baseline, ClockMonitor, candidate_params,
                        compile_baseline, plain_baselines, preference)
from .evaluate import Evaluator, InferenceEvaluator
from .results import (best_trial, confirmed_throughputs, constraint_checks, counts_as_measured, earlier_trials, fail,
                      failure_kind, first_line, resumed_words,
                      is_feasible, objective_values, outcome_words)
from .space import SearchSpace, fp8_fast_accum_choices
from .autotune import run_finalist, runtimes_note
from .storage import fail_interrupted, measured, open_study, outcome_counts, retry_interrupted
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



def side_by_side_words(entries: list[dict]) -> str:
    """The console's words for side-by-side ``entries`` (``{"trial", "baseline", "batch_size", "throughput"}``):
    ``trial N (baseline): X/s`` each, with ``at batch B`` when the entries are of several batch sizes."""
    several = len({e["batch_size"] for e in entries}) > 1

    def label(e: dict) -> str:
        return (f"trial {e['trial']}" + (f" ({e['baseline']})" if e.get("baseline") else "")
                + (f" at batch {e['batch_size']}" if several else ""))

    return "; ".join(f"{label(e)}: {e['throughput']:.4g}/s" for e in entries if e.get("throughput")) or "none timed"


def check_fp32_runs(model: torch.nn.Module, mf: ModelFile, batch_size: int, device: torch.device) -> list[str]:
    """Run the FP32 ``model`` (eval mode) once on the seeded inputs of ``batch_size`` (the smallest batch size
    searched), before the capture and the trials: a model that cannot run at all is bad input, not a search
    where no configuration qualifies. A model that raises only at larger batch sizes is the search's to find
    (those trials fail, the others run); running out of memory here is too (a lower precision may fit).

    Returns the names of the buffers that call wrote (a running mean or a call counter updated in forward, in
    eval mode): each run then starts from another state, so no two runs compare equal and every candidate, FP32
    eager included, can fail the accuracy check; a warning names them and the fix. The buffers are restored
    to their values before the call.

    Raises:
        ModelFileError: the model raised (the message names the batch size, the error and the fix).
    """
    inputs = reference_inputs(mf, batch_size, device)
    before = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        with precision_mode("fp32"), torch.no_grad():
            model(*inputs)
    except Exception as exc:  # noqa: BLE001 - any error of the model's own code is reported as its cause
        release_memory(device)
        if is_oom(exc):
            return []
        where = user_frame(exc, mf.path)
        raise ModelFileError(
            f"{mf.path.name}: the model raised in FP32 at batch {batch_size}: {type(exc).__name__}: "
            f"{first_line(exc)}" + (f"\n  at {where}" if where else "")
            + f"\n  fix: make forward run on example_inputs({batch_size}) in FP32: the error is in forward (or code it "
            "calls), or in example_inputs when it builds inputs forward cannot take"
        ) from exc
    written = []
    with torch.no_grad():
        for name, b in model.named_buffers():
            old = before.get(name)
            if old is None or (b.shape == old.shape and b.dtype == old.dtype
                               and (torch.equal(b, old) or (b.is_floating_point()
                                                            and torch.equal(b.isnan(), old.isnan())
                                                            and torch.equal(b.nan_to_num(), old.nan_to_num())))):
                continue  # unchanged (NaN where it was NaN counts as unchanged)
            written.append(name)
            if b.shape == old.shape and b.dtype == old.dtype:
                b.copy_(old)
    if written:
        log.warning("%s", state_writes_warning(written))
    return written


def state_writes_warning(written: list[str]) -> str:
    """The warning for a model whose forward writes its buffers ``written`` in eval mode."""
    names = ", ".join(written[:5]) + (f" and {len(written) - 5} more" if len(written) > 5 else "")
    return (f"the model's forward writes its buffer(s) {names} at every call (in eval mode): each run starts from "
            "another state, so runs of the same inputs differ and candidates, FP32 eager included, may fail the "
            "accuracy check\n  fix: update such state only in training (`if self.training:`), or keep it out of "
            "forward; tctune compares every candidate with FP32 eager on the same inputs")


def recorded_fp8(t) -> dict:
    """The FP8 build choices finished trial ``t`` recorded, as keyword arguments of ``evaluate`` / ``runnable`` /
    ``trial_params``: ``fp8_keep`` (its user attribute, None when absent) and ``fp8_fast_accum`` when recorded
    (a trial recorded before fast accumulation was a choice ran without it)."""
    out = {"fp8_keep": t.user_attrs.get("fp8_keep")}
    if t.user_attrs.get("fp8_fast_accum") is not None:
        out["fp8_fast_accum"] = bool(t.user_attrs["fp8_fast_accum"])
    return out


#: Relative L2 error (FP32) above which the captured graph is said to differ from the model run eagerly: the same
#: FP32 computation reordered differs by about 1e-6.
CAPTURE_MISMATCH_LIMIT = 1e-3


def capture_mismatch(model: torch.nn.Module, gm: torch.fx.GraphModule, inputs: tuple,
                     limit: float = CAPTURE_MISMATCH_LIMIT) -> str | None:
    """Whether ``torch.export``'s graph ``gm`` of ``model`` computes what ``model`` computes eagerly, both in FP32
    on ``inputs`` (e.g. the model file's batch-2 example inputs), before any tctune pass.

    A model whose ``forward`` takes another path in eager mode than under ``torch.export`` (a PyTorch fast path:
    ``nn.TransformerEncoder``'s nested tensors zero the outputs at padded positions in eager mode only; a branch
    on ``torch.compiler.is_compiling()``) gives a graph that differs from the model: then every tctune candidate
    is rejected by the accuracy check, and the exported files of an FP32 winner (the captured graph) are not the
    model as it ran.

    Returns:
        None when every floating output's relative L2 error (float64) is at most ``limit`` and every integer/bool
        output is equal, or when either call raises (the search reports that itself); else one sentence naming
        the output that differs most, its error, the consequences and the fix.
    """
    from torch.utils._pytree import keystr, tree_flatten_with_path

    try:
        with torch.no_grad(), precision_mode("fp32"):
            ref = model(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
            out = gm(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])
    except Exception as exc:  # noqa: BLE001 - a graph or model that cannot run is reported by the search
        log.debug("capture check against eager skipped: %s: %s", type(exc).__name__, exc)
        return None
    ref_leaves, _ = tree_flatten_with_path(ref)
    out_leaves = [leaf for _, leaf in tree_flatten_with_path(out)[0]]
    worst: tuple[float, str] | None = None
    for (path, r), o in zip(ref_leaves, out_leaves):
        if not (isinstance(r, torch.Tensor) and isinstance(o, torch.Tensor)) or r.shape != o.shape:
            continue
        name = keystr(path) or "the output"
        if r.is_floating_point():
            r64, o64 = r.detach().double(), o.detach().double()
            if not (torch.isfinite(r64).all() and torch.isfinite(o64).all()):
                continue  # NaN/inf: the accuracy check of every candidate reports them
            norm = float(r64.norm())
            err = float((o64 - r64).norm()) / norm if norm > 0 else float((o64 - r64).norm())
            text = f"output {name}: relative L2 error {err:.2g}"
        else:
            rate = float((o != r).double().mean()) if r.numel() else 0.0
            text = f"output {name}: {rate:.1%} of its integer elements differ"
            err = math.inf if rate > 0 else 0.0  # integer outputs must be equal
        if err > limit and (worst is None or err > worst[0]):
            worst = (err, text)
    if worst is None:
        return None
    return (f"torch.export's graph of the model differs from the model run eagerly, both in FP32 before any tctune "
            f"pass ({worst[1]} on example inputs at batch 2, limit {limit:g}): every tctune candidate runs this "
            f"graph, so the accuracy check rejects them, and the exported files of an FP32 winner (ONNX, "
            f"tctune.save) hold this graph, not the model as it ran. Likely cause: forward takes another path in eager "
            f"mode than under torch.export (e.g. nn.TransformerEncoder's nested-tensor fast path, which zeroes "
            f"padded positions in eager mode only); fix: make both take the same path (there: "
            f"nn.TransformerEncoder(..., enable_nested_tensor=False))")


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
        if "fp8" not in precisions and (cfg.fp8_keep is not None or cfg.max_error_fp8 != TuneConfig.max_error_fp8
                                        or cfg.fp8_fast_accum != TuneConfig.fp8_fast_accum):
            fast = " / --fp8-fast-accum" if cfg.fp8_fast_accum != TuneConfig.fp8_fast_accum else ""
            log.warning("precision fp8 is not searched here (it needs FP8 Tensor Cores, sm_89 or newer, a GPU to "
                        "measure on and --mode infer), so --fp8-keep / --max-error-fp8%s have no effect", fast)
        finalist = None if training or cfg.worker else runtimes_note(cfg.autotune, self.device.type, runtimes)
        if finalist:  # said once, before the trials; report.md's "Max-autotune finalist" repeats it
            log.warning("%s", finalist)
        self.model = mf.model().to(self.device)
        self.written_buffers: list[str] = []  # buffers forward writes in eval mode (:func:`check_fp32_runs`)
        self.folder_warning: str | None = None  # what tctune.optimize.warn_other_model said of the output folder
        self.model.train(training)
        if not training and not cfg.worker:  # the main process checks; its --devices workers load the same file
            self.written_buffers = check_fp32_runs(self.model, mf, min(cfg.batch_sizes), self.device)
        if training:
            self.captured = Captured(None, TRAIN_NO_PASSES)
        else:
            cap_inputs = mf.inputs(2, self.device)
            with precision_mode("fp32"):
                self.captured = try_capture(self.model, cap_inputs, mf.dynamic_shapes, mf.batched_mask())
            if self.captured.ok and not cfg.worker:  # the main process says it once; workers load the same graph
                self.captured.eager_mismatch = capture_mismatch(self.model, self.captured.graph_module, cap_inputs)
                if self.captured.eager_mismatch:
                    log.warning("%s", self.captured.eager_mismatch)
        self.out_dir = Path(cfg.out_dir)
        on_gpu_infer = self.device.type == "cuda" and not training
        self.search_space = SearchSpace(
            batch_sizes=tuple(cfg.batch_sizes), precisions=tuple(precisions), runtimes=runtimes,
            graph=self.captured.ok, mode=cfg.mode,
            policy=on_gpu_infer and self.captured.ok and any(p in ("fp16", "bf16") for p in precisions),
            memory_format=on_gpu_infer and any(isinstance(m, torch.nn.Conv2d) for m in self.model.modules()),
            fp8_fast_accum=fp8_fast_accum_choices(precisions, hw.arch, cfg.fp8_fast_accum))
        self.evaluator: Evaluator = (
            TrainingEvaluator(cfg, mf, self.device, self.model) if training else
            InferenceEvaluator(cfg, mf, hw, self.device, self.model, self.captured,
                               self.search_space.fastest_compiled_runtime,
                               fp8_fast_accum=self.search_space.fp8_fast_accum))
        self._opened = False
        self.interrupted = False
        #: Tags every trial this process measures (user attribute ``run_id``) and its side-by-side timing.
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"

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

    def untried(self, study: optuna.Study) -> int | None:
        """How many candidates of an enumerated space (at most :data:`BRUTE_FORCE_MAX`) ``study`` has not measured
        yet; None for a larger space, which is sampled and never runs out."""
        if self.space_size() > BRUTE_FORCE_MAX:
            return None
        return self.space_size() - len(self.measured(study))

    def candidate(self, **params) -> dict:
        return self.search_space.candidate(**params)

    def compiled_first(self) -> list[dict]:
        return self.search_space.compiled_first()

    def reference(self, batch_size: int):
        """The evaluator's seeded inputs (and reference) at ``batch_size``."""
        return self.evaluator.reference(batch_size)

    def trial_params(self, params: dict, fp8_keep: Sequence[str] | None = None,
                     fp8_fast_accum: bool | None = None) -> TrialParams:
        """Trial ``params`` typed, with the FP8 keep-list and fast accumulation it is built with resolved (recorded
        ones as given: a trial's ``fp8_keep`` / ``fp8_fast_accum`` user attributes)."""
        if fp8_fast_accum is None:  # the training evaluator has no FP8 (and no fast-accumulation argument)
            return self.evaluator.trial_params(params, fp8_keep)
        return self.evaluator.trial_params(params, fp8_keep, fp8_fast_accum)

    def build(self, params: dict, fp8_keep: Sequence[str] | None = None, fp8_fast_accum: bool | None = None):
        """The candidate of trial ``params`` (inference: its module before the runtime wrapper)."""
        if fp8_fast_accum is None:
            return self.evaluator.build(params, fp8_keep)
        return self.evaluator.build(params, fp8_keep, fp8_fast_accum)

    def evaluate(self, params: dict, on_repeat=None, fp8_keep: Sequence[str] | None = None,
                 fp8_fast_accum: bool | None = None) -> dict:
        """Build, check and time one candidate (the evaluator's; trials and the finalists' re-measure)."""
        if fp8_fast_accum is None:
            return self.evaluator.evaluate(params, on_repeat=on_repeat, fp8_keep=fp8_keep)
        return self.evaluator.evaluate(params, on_repeat=on_repeat, fp8_keep=fp8_keep, fp8_fast_accum=fp8_fast_accum)

    measured = staticmethod(measured)
    fail_interrupted = staticmethod(fail_interrupted)

    def retry_interrupted(self, study: optuna.Study) -> int:
        return retry_interrupted(study, self.space())

    def study_name(self) -> str:
        key = json.dumps(self.space(), sort_keys=True)
        digest = hashlib.sha1(key.encode()).hexdigest()[:8]
        cc = self.hw.compute_capability or "cpu"
        obj = "" if self.cfg.objective == "throughput" else f"-{self.cfg.objective}"
        # The output contract changes what every trial times; studies from before the option timed "fp32".
        if self.cfg.mode == "infer" and self.cfg.output_dtype != "fp32":
            obj += f"-out{self.cfg.output_dtype}"
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
            fix = (f"move or delete {self.out_dir / 'study.db'} (it is not a study this tctune can open), or give "
                   "another output folder" if self.cfg.storage is None else
                   "give an Optuna storage URL such as sqlite:///study.db or postgresql://user@host/db, and check "
                   "that the server is reachable")
            raise UsageError(
                f"cannot open the study storage {url}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}\n"
                f"  fix: {fix}") from exc
        if self.cfg.storage is None and not self._opened:
            # The default SQLite study has one tctune process (it starts any workers itself, after this):
            # a trial still RUNNING was cut off by a killed process.
            self.fail_interrupted(study, storage)
        if not self._opened:
            self.retry_interrupted(study)
            if not self.cfg.worker:
                study.set_user_attr("run_id", self.run_id)  # the run whose side-by-side timing the report uses
                # the trials of earlier runs kept in this study: said once here, and in the report (its "resumed")
                earlier = earlier_trials(study.get_trials(deepcopy=False))
                study.set_user_attr("resumed", earlier and {"run_id": self.run_id, **earlier})
                if earlier:
                    log.info("%s", resumed_words(earlier))
        self._opened = True
        fresh = not study.trials
        self.enqueue_baselines(study, self.plain_baselines())
        if fresh:
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

    # -- plain baselines ---------------------------------------------------------------------------------
    def plain_baselines(self) -> list[Baseline]:
        """The eager plain baselines of this study (:func:`tctune.search.baselines.plain_baselines`)."""
        return plain_baselines(self.search_space, self.cfg.mode)

    @staticmethod
    def baseline_trials(study: optuna.Study, states=None) -> dict[tuple[str, int], list]:
        """(baseline name, batch size) -> the study's trials of that baseline (any state unless ``states``)."""
        out: dict[tuple[str, int], list] = {}
        for t in study.get_trials(deepcopy=False, states=states):
            name = t.user_attrs.get("baseline")
            if name:
                bs = t.params.get("batch_size", (t.system_attrs.get("fixed_params") or {}).get("batch_size"))
                out.setdefault((name, bs), []).append(t)
        return out

    def enqueue_baselines(self, study: optuna.Study, baselines: list[Baseline]) -> int:
        """Enqueue each baseline the study has no trial of yet that stands (waiting, running, finished; a trial
        cut off by an interruption does not stand); returns how many were enqueued."""
        have = {k for k, ts in self.baseline_trials(study).items()
                if any(t.state in (optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING)
                       or (t.state.is_finished() and counts_as_measured(t)) for t in ts)}
        n = 0
        for b in baselines:
            if (b.name, b.params["batch_size"]) not in have:
                study.enqueue_trial(b.params, user_attrs=b.user_attrs())
                n += 1
        return n

    def compile_baselines(self, study: optuna.Study) -> list[Baseline]:
        """On a GPU, with ``inductor`` searched: ``torch.compile`` (mode default) of the fastest feasible eager
        baseline at each batch size (by its timing in the study; an exact tie goes to the simpler one,
        :func:`tctune.search.baselines.preference`), and with ``inductor-cudagraphs`` searched also
        ``torch.compile(mode="reduce-overhead")`` of it (a launch-bound model's plain answer: without it, a small CNN's
        "fastest plain baseline" was FP32 eager, 3.2× slower than tctune's CUDA-graphed winner)."""
        if self.device.type != "cuda" or "inductor" not in self.runtimes:
            return []
        eager = {(b.name, b.params["batch_size"]): b for b in self.plain_baselines()}
        best: dict[int, tuple[tuple, Baseline]] = {}
        for (name, bs), ts in self.baseline_trials(study).items():
            if (name, bs) not in eager:
                continue
            for t in ts:
                key = preference(t.user_attrs.get("throughput") or 0.0, name, bs, t.number)  # ties: the simpler
                if is_feasible(t) and (bs not in best or key < best[bs][0]):
                    best[bs] = (key, eager[(name, bs)])
        graphs = "inductor-cudagraphs" in self.runtimes
        return [c for _, (_, b) in sorted(best.items())
                for c in ([compile_baseline(b)] + ([compile_baseline(b, cudagraphs=True)] if graphs else []))]

    def pending_baselines(self, study: optuna.Study) -> int:
        """Baseline trials waiting to run."""
        return sum(len(ts) for ts in self.baseline_trials(study, (optuna.trial.TrialState.WAITING,)).values())

    def skip_reason(self, study: optuna.Study, params: dict, number: int = 1 << 62,
                    baseline: str | None = None) -> str | None:
        """Why ``params`` need not be measured: already measured, a smaller batch with the same settings
        ran out of memory, or compiles are over budget. None when it should be measured. ``params`` may hold
        ``model_cast`` (:func:`~tctune.search.baselines.candidate_params`). A plain ``baseline`` is measured
        even when a searched trial of the same candidate was (an older study's), since it is a fixed part of
        every study."""
        same_settings = {k: v for k, v in params.items() if k != "batch_size"}
        done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)
        for prev in study.get_trials(deepcopy=False, states=done + (optuna.trial.TrialState.RUNNING,)):
            if prev.number == number or not counts_as_measured(prev):
                continue
            prev_params = candidate_params(prev.params, prev.user_attrs)
            if baseline and prev.user_attrs.get("baseline") != baseline:
                prev_params = None  # only the same baseline is a duplicate of a baseline
            if prev_params == params:
                if prev.state == optuna.trial.TrialState.RUNNING:
                    if prev.number < number:  # another worker took it first
                        return f"duplicate of trial {prev.number} (being measured by another worker)"
                    continue
                what = "measured" if prev.state == optuna.trial.TrialState.COMPLETE else "failed"
                return f"duplicate of trial {prev.number} ({what}; not run again)"
            prev_params = candidate_params(prev.params, prev.user_attrs)
            if (prev.user_attrs.get("fail_kind") == FailureKind.OUT_OF_MEMORY.value and {k: v for k, v in prev_params.items() if k != "batch_size"} == same_settings
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
        baseline = trial.user_attrs.get("baseline")
        params = candidate_params({k: trial.suggest_categorical(k, v) for k, v in space.items()}, trial.user_attrs)
        trial.set_user_attr("run_id", self.run_id)
        skip = self.skip_reason(trial.study, params, trial.number, baseline=baseline)
        if skip:
            fail(trial, skip, FailureKind.SKIPPED)
            raise optuna.TrialPruned(skip)
        autotune = trial.user_attrs.get("autotune_of") is not None  # the max-autotune finalist (search.autotune)

        def on_repeat(step: int, throughput: float) -> None:
            if self.cfg.objective != "throughput" or baseline or autotune:  # never stopped early: a plain baseline,
                return  # or the max-autotune rebuild of a finalist (its compile is the cost; its timing the point)
            trial.report(throughput, step)
            if trial.should_prune():
                reason = (f"stopped early: {throughput:.4g} items/s after {step + 1} repeat(s), in the slowest "
                          "quarter of the finished searched trials at this batch size")
                trial.set_user_attr("fail_reason", reason)
                raise optuna.TrialPruned(reason)

        try:  # a rebuild carries the FP8 choices of the graph it rebuilds (recorded_fp8: the max-autotune finalist)
            metrics = self.evaluate(params, on_repeat=on_repeat,
                                    **(recorded_fp8(trial) if trial.user_attrs.get("fp8_keep") is not None else {}))
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
        """Measure the plain baselines not measured yet, then add ``cfg.trials`` searched trials to the study
        (resuming it), with a progress bar unless quiet; then (not a worker, not interrupted) the max-autotune
        finalist step (:meth:`autotune`), the finalists' re-measure (:meth:`confirm`) and (inference) the
        finalists and the best baselines timed side by side (:meth:`side_by_side`).

        The baselines (:mod:`tctune.search.baselines`) do not count in ``cfg.trials``: a fresh study runs
        ``cfg.trials`` plus one trial per baseline and batch size.

        Ctrl-C (SIGINT) once: the running trial finishes, then the study stops and the report is written.
        Twice: the running trial is abandoned (marked failed). Finished trials are always kept.
        """
        self.out_dir.mkdir(parents=True, exist_ok=True)
        optuna.logging.set_verbosity(optuna.logging.ERROR)  # tctune reports failed trials itself
        study = self.create_study()
        pending = self.pending_baselines(study)
        bar = None
        untried = self.untried(study)
        exhausted = not pending and untried is not None and untried <= 0  # a re-run with nothing left to run
        if not self.cfg.quiet and not exhausted:
            from tqdm.auto import tqdm
            bar = tqdm(total=self.cfg.trials + pending, desc="trials", unit="trial", file=sys.stderr,
                       dynamic_ncols=True)

        stop_requested = []

        def on_sigint(signum, frame):
            self.interrupted = True
            if stop_requested:
                raise KeyboardInterrupt
            stop_requested.append(True)
            log.warning("Ctrl-C: stopping after the current trial (press Ctrl-C again to abandon it)")

        finished: list[int] = []  # the trials this call ran, baselines included
        said_all = False  # "all N candidates ... were tried" said before the searched trials: not again after them

        def callback(st: optuna.Study, tr: optuna.trial.FrozenTrial) -> None:
            finished.append(tr.number)
            if stop_requested:
                st.stop()
            if tr.state == optuna.trial.TrialState.FAIL and bar is None:
                log.info("trial %d rejected: %s", tr.number, tr.user_attrs.get("fail_reason"))
            if bar is None:
                return
            best = best_trial(st)
            p = tr.params
            state = tr.state.name.lower()
            what = tr.user_attrs.get("baseline") or ("graph" if p.get("graph_passes") else "eager")
            bar.set_postfix_str(
                f"#{tr.number} {p.get('precision')} b{p.get('batch_size')} {what}: "
                f"{state}; best {best.user_attrs['throughput']:.4g}/s" if best else f"#{tr.number} {state}")
            bar.update(1)

        deadline = None if self.cfg.timeout_s is None else time.monotonic() + self.cfg.timeout_s

        def optimize(n: int, bounded: bool = True) -> None:
            """``n`` trials; ``bounded``: stop starting new ones at --timeout's deadline (the plain baselines are
            not bounded: every headline needs them, so a short --timeout never leaves one unmeasured)."""
            left = None if deadline is None or not bounded else deadline - time.monotonic()
            if n > 0 and not stop_requested and (left is None or left > 0):
                study.optimize(self.objective, n_trials=n, timeout=left, catch=(CandidateRejected,),
                               callbacks=[callback])

        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, on_sigint)
        above_bar = contextlib.ExitStack()  # while the bar is drawn, log lines print above it, not on its line
        if bar is not None:
            above_bar.enter_context(above_progress_bar(type(bar)))
        try:
            optimize(pending, bounded=False)  # the plain baselines, enqueued first
            if not self.cfg.worker:
                extra = self.enqueue_baselines(study, self.compile_baselines(study))
                if extra and bar is not None:
                    bar.total += extra
                optimize(self.pending_baselines(study), bounded=False)
            total = self.cfg.trials
            left = self.untried(study)
            if left is not None:  # an enumerated space ends when every candidate is measured
                widen = ("graph candidates are off, as the model could not be captured (above), so only the model "
                         "as written is searched" if not self.captured.ok else
                         "widen --batch-sizes or --runtimes to search more")
                if left <= 0:
                    how = ("were tried by this run's plain baselines" if not study.user_attrs.get("resumed")
                           else "were already tried")
                    log.info("all %d candidates of this search space %s (%s); nothing to add (%s)",
                             self.space_size(), how, outcome_words(outcome_counts(study)), widen)
                    said_all = True
                    total = 0
                elif left < total:
                    log.info("this search space has %d candidates, %d not tried yet (%s so far): at most %d "
                             "searched trial%s run", self.space_size(), left, outcome_words(outcome_counts(study)),
                             left, "" if left == 1 else "s")
                runnable = max(0, min(left, total))
                if bar is not None and runnable < self.cfg.trials:  # the bar's total: the trials that can run
                    bar.total -= self.cfg.trials - runnable
                    bar.refresh()
            before = len(finished)
            optimize(total)
            ran = len(finished) - before
            if ran < total and deadline is not None and time.monotonic() >= deadline and not stop_requested:
                log.info("--timeout %g s reached: %d of %d searched trial(s) ran (%s); a longer --timeout, or another run "
                         "with the same --out, adds the rest", self.cfg.timeout_s, ran, total,
                         outcome_words(outcome_counts(study)))
        except KeyboardInterrupt:
            self.interrupted = True
            log.warning("interrupted: finished trials are kept in %s; writing the report", self.storage_url())
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            if bar is not None:
                bar.close()
            above_bar.close()
        left = self.untried(study)
        if left is not None and left <= 0 and not said_all:
            log.info("every one of the %d candidates of this search space was tried: %s", self.space_size(),
                     outcome_words(outcome_counts(study)))
        if not self.interrupted and not self.cfg.worker:
            self.autotune(study, None if deadline is None else deadline - time.monotonic())
            if self.cfg.objective == "throughput":
                self.confirm(study)
            if hasattr(self.evaluator, "runnable"):  # inference; training steps keep the confirmation only
                self.side_by_side(study)
        return study

    def autotune(self, study: optuna.Study, time_left_s: float | None = None) -> dict:
        """The max-autotune finalist step (:func:`tctune.search.autotune.run_finalist`): the best tctune candidate
        through ``inductor`` / ``inductor-cudagraphs`` rebuilt through its max-autotune variant and measured as one
        more trial when ``cfg.autotune`` and the compile budget allow (``time_left_s``: seconds left before
        ``--timeout``, None without one). Stored as the study user attribute ``"autotune"`` and returned. A
        failing or over-budget compile is recorded in that trial and the record, never raised."""
        record = run_finalist(self, study, time_left_s)
        study.set_user_attr("autotune", record)
        return record

    def side_by_side_entries(self, study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
        """The trials :meth:`side_by_side` times: the finalists (throughput: the feasible trials within
        ``CONFIRM_BAND`` of the fastest, at most ``CONFIRM_TOP``, baselines included; other objectives: the
        best trial) and the fastest feasible searched (not baseline) trial, then at each of their batch sizes
        the two fastest feasible baselines and FP32 eager, then the fastest feasible baseline at any batch size and
        the fastest feasible searched trial at its batch size (a study resumed from an earlier run included: its
        trials are re-timed here, so no verdict divides numbers of two runs); each once, chosen by the trials' own
        timings. Every entry that can win has its batch size's baselines
        beside it."""
        ok = sorted((t for t in study.get_trials(deepcopy=False) if is_feasible(t)),
                    key=lambda t: -t.user_attrs["throughput"])
        if not ok:
            return []
        if self.cfg.objective == "throughput":
            fastest = ok[0].user_attrs["throughput"]
            finalists = [t for t in ok[:CONFIRM_TOP] if t.user_attrs["throughput"] >= fastest * (1 - CONFIRM_BAND)]
        else:
            finalists = [best_trial(study)]
        base = [t for t in ok if t.user_attrs.get("baseline")]
        entries = list(finalists)
        entries += [t for t in ok if not t.user_attrs.get("baseline")][:1]  # the fastest searched candidate
        for bs in dict.fromkeys(t.params["batch_size"] for t in entries):  # any of them can win: its baselines
            entries += [t for t in base if t.params["batch_size"] == bs][:2]
            fp32 = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                    if t.user_attrs.get("baseline") == "fp32_eager" and t.params["batch_size"] == bs
                    and "throughput" in t.user_attrs]
            entries += fp32[-1:]
        entries += base[:1]
        if base:  # the fastest baseline can be the answer: the fastest searched candidate at its batch size beside it
            bs = base[0].params["batch_size"]
            entries += [t for t in ok if not t.user_attrs.get("baseline") and t.params["batch_size"] == bs][:1]
        seen, out = set(), []
        for t in entries:
            if t.number not in seen:
                seen.add(t.number)
                out.append(t)
        return out

    def side_by_side(self, study: optuna.Study, rounds: int = SIDE_BY_SIDE_ROUNDS,
                     block_s: float = SIDE_BY_SIDE_BLOCK_S) -> dict | None:
        """Time the finalists and the best baselines side by side in this process (:meth:`side_by_side_entries`),
        each rebuilt (a trial's recorded FP8 keep-list as measured), ``rounds`` rounds of one block of about
        ``block_s`` s each, interleaved (:func:`tctune.measure.time_interleaved`), with the GPU's SM clock and
        throttle reasons sampled after every round (:class:`~tctune.search.baselines.ClockMonitor`).

        Stored as the study user attribute ``"side_by_side"`` and returned: ``{"run_id": this run's id,
        "after_trial": the last trial number when it ran, "rounds", "block_s", "device", "clocks": the
        ClockMonitor summary, "entries": [{"trial", "baseline": name or None, "batch_size", "throughput": batch
        size / median (items/s), "median_ms", "rounds_ms": ms per call per round, "error": why it could not be
        rebuilt or None}]}``. The report's headline uses these numbers only when ``run_id`` is the current
        run's. None when no trial is feasible. A candidate that fails to rebuild is logged and left out.
        """
        entries = self.side_by_side_entries(study)
        if not entries:
            return None
        log.info("timing %d candidates side by side (%d interleaved rounds): %s", len(entries), rounds,
                 ", ".join(f"trial {t.number}" + (f" ({t.user_attrs['baseline']})" if t.user_attrs.get("baseline") else "")
                           for t in entries))
        fns, contexts, rows = {}, {}, {}
        for t in entries:
            row = {"trial": t.number, "baseline": t.user_attrs.get("baseline"), "batch_size": t.params["batch_size"],
                   "throughput": None, "median_ms": None, "rounds_ms": [], "error": None}
            rows[t.number] = row
            try:
                fn, bs, precision = self.evaluator.runnable(candidate_params(t.params, t.user_attrs),
                                                            **recorded_fp8(t))
                fns[t.number] = fn
                contexts[t.number] = (lambda p=precision: precision_mode(p))
            except CandidateRejected as exc:
                row["error"] = first_line(exc)
                log.info("trial %d could not be rebuilt for the side-by-side timing: %s", t.number, row["error"])
        clocks = ClockMonitor(self.device)
        clocks.sample()
        try:
            timed = time_interleaved(fns, self.device, rounds=rounds, target_block_s=block_s, contexts=contexts,
                                     on_round=lambda r: clocks.sample()) if fns else {}
        except CandidateRejected as exc:
            log.warning("side-by-side timing failed: %s", first_line(exc))
            timed = {}
            for row in rows.values():
                row["error"] = row["error"] or first_line(exc)
        finally:
            fns = contexts = None
            release_memory(self.device)
        for number, ms in timed.items():
            row = rows[number]
            row["rounds_ms"] = ms
            row["median_ms"] = statistics.median(ms)
            row["throughput"] = row["batch_size"] / (row["median_ms"] / 1e3)
        result = {"run_id": self.run_id, "after_trial": max(t.number for t in study.get_trials(deepcopy=False)),
                  "rounds": rounds, "block_s": block_s, "device": str(self.device), "clocks": clocks.summary(),
                  "entries": list(rows.values())}
        study.set_user_attr("side_by_side", result)
        log.info("side by side: %s", side_by_side_words(list(rows.values())))
        return result

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
            try:  # the graph this trial measured (its keep-list, its runtime), even if a resumed run plans anew
                again = self.evaluate(candidate_params(t.params, t.user_attrs), **recorded_fp8(t))["throughput"]
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
