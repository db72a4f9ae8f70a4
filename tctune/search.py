"""Optuna search over batch size × precision × graph passes, every candidate measured.

One study per (model, hardware, mode, search space), stored by default in ``<out>/study.db`` (SQLite), so
running the same command again resumes it: finished trials are kept and new ones are added. The FP32
eager baseline at every searched batch size is enqueued first, so the report's speedups are like-for-like
(measured in the same study, on the same inputs).
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import optuna
import torch

from passes import run_pipeline
from passes.base import PassFailure

from .capture import try_capture
from .errors import CandidateRejected, PassError, UsageError
from .hardware import HardwareSpec
from .measure import (ErrorStats, check_accuracy, compare, is_oom, precision_mode, release_memory,
                      time_call)
from .modelfile import ModelFile

log = logging.getLogger("tctune")

#: Seed for the fresh random inputs of each batch size (all candidates at one batch see the same inputs).
INPUT_SEED = 1234


@dataclass(frozen=True)
class TuneConfig:
    """Options of one ``tctune optimize`` run (serialized into ``report.json``).

    Attributes:
        batch_sizes: batch sizes to search (items per call).
        trials: trials to add to the study in this run (≥ 1).
        timeout_s: stop starting new trials after this many seconds (None: no limit).
        max_error: largest relative L2 error against the FP32 reference a candidate may have.
        target: ``--target`` name or ``sm_XX`` (plan for that GPU's alignment); None: the detected device.
        storage: Optuna storage URL; None: ``sqlite:///<out>/study.db``.
        seed: sampler seed.
        out_dir: output folder.
        export: build ONNX (and TensorRT where importable) for the best configuration.
        quiet: no progress bar.
    """

    out_dir: str
    batch_sizes: tuple[int, ...] = (8, 32, 128)
    trials: int = 16
    timeout_s: float | None = None
    max_error: float = 1e-2
    target: str | None = None
    storage: str | None = None
    seed: int = 0
    export: bool = True
    quiet: bool = False

    def __post_init__(self) -> None:
        if not self.batch_sizes or any((not isinstance(b, int)) or b < 1 for b in self.batch_sizes):
            raise UsageError(f"--batch-sizes must be positive integers, got {self.batch_sizes!r}")
        if self.trials < 1:
            raise UsageError(f"--trials must be at least 1, got {self.trials}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise UsageError(f"--timeout must be a positive number of seconds, got {self.timeout_s}")
        if not (self.max_error > 0):
            raise UsageError(f"--max-error must be positive, got {self.max_error}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Candidate:
    """A runnable candidate: ``module(*inputs)`` under ``precision_mode(precision)``."""

    module: Callable
    precision: str
    passes: list = field(default_factory=list)  # PassResult objects
    description: str = ""


def measuring_device() -> torch.device:
    """``cuda:0`` when torch sees a GPU, else the CPU."""
    return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")


def apply_passes(gm: torch.fx.GraphModule, hw: HardwareSpec, precision: str) -> tuple[torch.fx.GraphModule, list]:
    """Deep-copy ``gm`` and run the pass pipeline for ``(hw, precision)``.

    Raises:
        PassError: a pass failed (the message names it and the passes before it).
    """
    with warnings.catch_warnings():  # deepcopy of an exported module warns about pytree internals
        warnings.simplefilter("ignore", FutureWarning)
        g = copy.deepcopy(gm)
    try:
        results = run_pipeline(g, hw.pass_spec(precision))
    except PassFailure as exc:
        raise PassError(str(exc)) from exc
    return g, results


class _Autocast(torch.nn.Module):
    """Plain AMP: the user's eager model under ``torch.autocast`` (the baseline users try by hand)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, device_type: str):
        super().__init__()
        self.model, self.dtype, self.device_type = model, dtype, device_type

    def forward(self, *args):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.model(*args)


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
        self.model = mf.model().eval().to(self.device)
        self.precisions = hw.search_precisions(measure_on_gpu=self.device.type == "cuda")
        cap_inputs = mf.inputs(2, self.device)
        with precision_mode("fp32"):
            self.captured = try_capture(self.model, cap_inputs)
        self._refs: dict[int, tuple[tuple, Any]] = {}
        self.out_dir = Path(cfg.out_dir)

    # -- search space ---------------------------------------------------------------------------------
    @property
    def pass_choices(self) -> list[bool]:
        return [True, False] if self.captured.ok else [False]

    def space(self) -> dict:
        return {"batch_size": list(self.cfg.batch_sizes), "precision": list(self.precisions),
                "graph_passes": self.pass_choices}

    def study_name(self) -> str:
        key = json.dumps(self.space(), sort_keys=True)
        digest = hashlib.sha1(key.encode()).hexdigest()[:8]
        cc = self.hw.compute_capability or "cpu"
        return f"{self.mf.name}-{self.hw.arch}-{cc}-{self.device.type}-infer-{digest}"

    def storage_url(self) -> str:
        return self.cfg.storage or f"sqlite:///{(self.out_dir / 'study.db').resolve()}"

    # -- candidates -------------------------------------------------------------------------------------
    def reference(self, batch_size: int) -> tuple[tuple, Any]:
        """Fresh random inputs for ``batch_size`` (seeded, so every candidate sees the same) and FP32 outputs."""
        if batch_size not in self._refs:
            torch.manual_seed(INPUT_SEED + batch_size)
            inputs = self.mf.inputs(batch_size, self.device)
            try:
                with precision_mode("fp32"), torch.inference_mode():
                    ref = self.model(*inputs)
            except Exception as exc:
                if is_oom(exc):
                    release_memory(self.device)
                    raise CandidateRejected(f"the FP32 reference ran out of memory at batch size {batch_size}") from exc
                raise
            self._refs[batch_size] = (inputs, ref)
        return self._refs[batch_size]

    def build(self, params: dict) -> Candidate:
        """The runnable candidate for trial ``params`` (``batch_size``, ``precision``, ``graph_passes``)."""
        precision = params["precision"]
        if params["graph_passes"]:
            g, results = apply_passes(self.captured.graph_module, self.hw, precision)
            return Candidate(g.to(self.device), precision, results, f"tctune graph, {precision}")
        if precision in ("fp16", "bf16"):
            dtype = torch.float16 if precision == "fp16" else torch.bfloat16
            return Candidate(_Autocast(self.model, dtype, self.device.type), precision, [], f"eager autocast {precision}")
        return Candidate(self.model, precision, [], f"eager {precision}")

    def evaluate(self, params: dict) -> dict:
        """Build, check and time one candidate; returns the trial's metrics.

        Raises:
            CandidateRejected: out of memory, NaN/inf outputs, or a broken rewrite.
        """
        bs = params["batch_size"]
        inputs, ref = self.reference(bs)
        cand = self.build(params)
        try:
            with precision_mode(cand.precision), torch.inference_mode():
                out = cand.module(*inputs)
            err: ErrorStats = compare(out, ref)
            check_accuracy(err, cand.precision, out)
            del out
            with precision_mode(cand.precision):
                timing = time_call(lambda: cand.module(*inputs), bs, self.device,
                                   target_repeat_s=0.1 if self.device.type == "cuda" else 0.15)
        except Exception as exc:
            if is_oom(exc):
                release_memory(self.device)
                raise CandidateRejected(f"out of memory at batch size {bs}") from exc
            raise
        finally:
            del cand.module
        return {
            "throughput": timing.throughput,
            "latency_ms": timing.latency_ms,
            "peak_memory_mib": timing.peak_memory_mib,
            "max_rel_error": err.rel_l2_error,
            "max_abs_error": err.max_abs_error,
            "nonfinite": err.nonfinite,
            "repeats_ms": timing.repeats_ms,
            "passes": [{"name": r.name, "changed": r.count} for r in cand.passes],
            "description": cand.description,
        }

    # -- study ------------------------------------------------------------------------------------------
    def create_study(self) -> optuna.Study:
        # Accuracy is a constraint (Trial.set_constraint): TPE learns from infeasible trials without choosing them.
        sampler = optuna.samplers.TPESampler(seed=self.cfg.seed, n_startup_trials=4)
        study = optuna.create_study(study_name=self.study_name(), storage=self.storage_url(),
                                    direction="maximize", sampler=sampler, load_if_exists=True)
        if not study.trials:
            for bs in self.cfg.batch_sizes:  # FP32 eager baselines, one per batch size
                study.enqueue_trial({"batch_size": bs, "precision": "fp32", "graph_passes": False})
            if self.captured.ok:  # then tctune's graph at each low precision, largest batch
                for p in self.precisions:
                    if p != "fp32":
                        study.enqueue_trial({"batch_size": max(self.cfg.batch_sizes), "precision": p,
                                             "graph_passes": True})
        return study

    def objective(self, trial: optuna.Trial) -> float:
        space = self.space()
        params = {k: trial.suggest_categorical(k, v) for k, v in space.items()}
        for prev in trial.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if prev.params == params:
                trial.set_user_attr("fail_reason", f"duplicate of trial {prev.number} (not measured again)")
                raise optuna.TrialPruned()
        try:
            metrics = self.evaluate(params)
        except CandidateRejected as exc:
            trial.set_user_attr("fail_reason", str(exc))
            raise
        except PassError as exc:
            trial.set_user_attr("fail_reason", str(exc))
            raise CandidateRejected(str(exc)) from exc
        for k, v in metrics.items():
            trial.set_user_attr(k, v)
        feasible = metrics["max_rel_error"] <= self.cfg.max_error
        trial.set_constraint("max_error", metrics["max_rel_error"] - self.cfg.max_error)
        if not feasible:
            trial.set_user_attr("fail_reason", f"relative error {metrics['max_rel_error']:.3g} > --max-error {self.cfg.max_error:g}")
        return metrics["throughput"]

    def run(self) -> optuna.Study:
        """Add ``cfg.trials`` trials to the study (resuming it), with a progress bar unless quiet.

        A Ctrl-C stops after marking the running trial failed; finished trials are kept.
        """
        self.out_dir.mkdir(parents=True, exist_ok=True)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = self.create_study()
        bar = None
        if not self.cfg.quiet:
            from tqdm.auto import tqdm
            bar = tqdm(total=self.cfg.trials, desc="trials", unit="trial", file=sys.stderr, dynamic_ncols=True)

        def callback(st: optuna.Study, tr: optuna.trial.FrozenTrial) -> None:
            if bar is None:
                return
            best = best_trial(st)
            p = tr.params
            state = tr.state.name.lower()
            bar.set_postfix_str(
                f"#{tr.number} {p.get('precision')} b{p.get('batch_size')} {'graph' if p.get('graph_passes') else 'eager'}: "
                f"{state}; best {best.user_attrs['throughput']:.4g}/s" if best else f"#{tr.number} {state}")
            bar.update(1)

        try:
            study.optimize(self.objective, n_trials=self.cfg.trials, timeout=self.cfg.timeout_s,
                           catch=(CandidateRejected,), callbacks=[callback])
        except KeyboardInterrupt:
            log.warning("interrupted: finished trials are kept in %s; writing the report", self.storage_url())
        finally:
            if bar is not None:
                bar.close()
        return study


def is_feasible(t: optuna.trial.FrozenTrial) -> bool:
    """A completed trial whose error is within ``--max-error``."""
    constraints = t.constraints
    return (t.state == optuna.trial.TrialState.COMPLETE and "throughput" in t.user_attrs
            and bool(constraints) and all(c <= 0 for c in constraints.values()))


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The feasible trial with the highest throughput, or None."""
    ok = [t for t in study.get_trials(deepcopy=False) if is_feasible(t)]
    return max(ok, key=lambda t: t.user_attrs["throughput"]) if ok else None
