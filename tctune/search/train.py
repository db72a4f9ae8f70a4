"""``--mode train``: tune a training step (forward, loss, backward, optimizer step).

The metrics are those of the seed article: samples/s, step time and peak memory. Precisions:

- fp32 (TF32 off) and tf32: plain FP32 training.
- bf16: ``torch.autocast`` without a loss scaler (bf16 has FP32's exponent range).
- fp16: ``torch.autocast`` with ``torch.amp.GradScaler``; a step whose gradients overflow is skipped by the
  scaler. Skipped steps are counted; a configuration that skips more than half its timed steps is rejected.

Accuracy, on the check batches: the seeded random batch of ``example_inputs`` at the trial's batch size, then every
real batch (``--calibration DIR``, the model file's ``calibration_inputs()`` or the API's ``calibration``; each paired
with ``example_targets(B)`` for its batch size B, since real batches hold inputs only):

- gradients: on each check batch, the candidate's gradients at the initial weights against FP32's (relative L2
  error of all parameters' gradients concatenated into one vector); the trial's error statistics are the worst
  over the batches, judged by ``--max-error`` as before;
- score (when the model file gives ``score(model)``): a short training run, one optimizer step per check batch in
  that order, from the initial weights, at the candidate's precision (through its runtime) and in FP32 (the
  reference run, once per batch size); then ``score`` of both trained models, in eval mode under FP32 numerics,
  and the score gate of inference (:class:`tctune.search.accuracy.ScoreGate`: ``--min-score-ratio`` x the
  FP32-trained score, or ``--min-score``) decides feasibility. Scores are cached per precision and batch size
  (the runtime does not change what a precision computes); the largest relative difference of the per-step
  losses from the reference run's is recorded as ``train_loss_rel_diff``.

Every forward of the check is seeded, so dropout draws the same masks in the reference and the candidate. Each
trial starts from a fresh copy of the initial model and optimizer, so earlier trials' updates do not leak into it.
Real batches are not used for timing (the random batch is timed), and tctune's graph passes (fp16 overflow
calibration, FP8 scales) do not run in training.

The optimizer is the model file's ``make_optimizer(params)`` if it defines one, else
``torch.optim.Adam(params, lr=1e-3)`` (the seed article's choice).
"""
from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import torch

from ..calibration import FIX_SHAPES, expected, load_calibration
from ..errors import CandidateRejected, ModelFileError, UsageError
from ..measure import compare, precision_mode, time_call
from ..modelfile import SIGNATURES
from ..trial import FailureKind, TrialParams, reference_inputs
from .accuracy import ScoreGate, graph_key, worst
from .results import first_line, rejection, trial_metrics

log = logging.getLogger("tctune")

LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}

#: The seed set before each forward of the accuracy check and the short training run (dropout masks).
CHECK_SEED = 0


@dataclass
class CheckBatch:
    """One batch of the training accuracy check: ``inputs`` (on the device, batch on dim 0), ``targets``
    (``example_targets(B)``) and ``source`` (``the random inputs`` or the real batch's file / index)."""

    inputs: tuple
    targets: Any
    source: str


class TrainScoreGates:
    """The score gate of ``--mode train``: one :class:`ScoreGate` per batch size, since the FP32-trained reference
    a candidate is held against was trained on that batch size's check batches.

    Attributes:
        gates: batch size -> its gate (``fp32``: the FP32-trained reference's score).
    """

    def __init__(self, score, min_score_ratio: float, min_score: float | None, where: str):
        self.fn, self.min_score_ratio, self.min_score, self.where = score, min_score_ratio, min_score, where
        self.gates: dict[int, ScoreGate] = {}

    def gate(self, batch_size: int) -> ScoreGate:
        if batch_size not in self.gates:
            self.gates[batch_size] = ScoreGate(self.fn, self.min_score_ratio, self.min_score, where=self.where)
        return self.gates[batch_size]

    def to_dict(self) -> dict:
        """``report.json``'s ``score``, as :meth:`ScoreGate.to_dict` (``fp32``/``limit``: the first batch size's),
        with calls, seconds and cached graphs summed over the batch sizes, plus ``fp32_by_batch_size``."""
        done = {bs: g for bs, g in self.gates.items() if g.fp32 is not None}
        first = next(iter(done.values()), None) or ScoreGate(self.fn, self.min_score_ratio, self.min_score, self.where)
        out = first.to_dict()
        out.update(calls=sum(g.calls for g in self.gates.values()),
                   seconds=sum(g.seconds for g in self.gates.values()),
                   cached_graphs=sum(len(g.cache) for g in self.gates.values()),
                   fp32_by_batch_size={str(bs): g.fp32 for bs, g in done.items()})
        if done and self.min_score is None:
            out["rule"] = (f"score >= {self.min_score_ratio:g} x the FP32-trained reference's score after the same "
                           "steps (" + "; ".join(f"batch {bs}: {g.fp32:.4g} -> {g.limit:.4g}" for bs, g in done.items())
                           + ")")
        return out


def check_trainable(mf) -> None:
    """Raises ModelFileError (naming what to add) when the model file lacks what ``--mode train`` needs."""
    missing = [fn for fn in ("example_targets", "loss_fn") if getattr(mf, fn) is None]
    if missing:
        sigs = "\n".join(f"  add: {SIGNATURES[fn]}" for fn in missing)
        raise ModelFileError(f"{mf.path.name}: --mode train needs {' and '.join(f'{m}()' for m in missing)}\n{sigs}")


class TrainingEvaluator:
    """Training-step candidates (the evaluator interface of :mod:`tctune.search.evaluate`).

    Args:
        cfg: run options (``effective_batch``, ``calibration``, ``min_score_ratio``, ``min_score``); mf: the model
        file (with ``example_targets`` and ``loss_fn``; ``score`` and ``calibration_inputs`` optional); device:
        where steps run; model: the model on ``device`` (its initial weights start every trial).

    Accuracy: see the module docstring. Attributes ``calibration`` (the real batches) and ``score_gate``
    (:class:`TrainScoreGates`, None without ``score``) are what ``report.json`` reads, as for inference.

    Raises:
        UsageError, ModelFileError: bad real batches, before any trial: what
            :func:`tctune.calibration.load_calibration` rejects (run in eval mode, like inference), or a batch on
            which the FP32 training step (forward, ``loss_fn`` with ``example_targets(B)``, backward) raises.
            Its first reference step raises ModelFileError when the model file lacks ``example_targets`` or
            ``loss_fn`` (``tctune optimize`` checks that before anything runs: :func:`check_trainable`).
    """

    def __init__(self, cfg, mf, device: torch.device, model: torch.nn.Module):
        self.cfg, self.mf, self.device, self.model = cfg, mf, device, model
        self.initial_state = copy.deepcopy(self.model.state_dict())
        self._refs: dict[int, tuple] = {}
        self.fp8_plans: dict = {}  # precision fp8 is not searched in training
        self.compile_over_budget: str | None = None
        was_training = model.training
        model.eval()  # checked as in inference: each real batch runs once through the FP32 model
        try:
            self.calibration = load_calibration(mf, cfg.calibration, model, device)
        finally:
            model.train(was_training)
        for b in self.calibration:
            b.reference = None  # the training check compares gradients, not these outputs
        if self.calibration:
            log.info("--mode train: %d real batch(es) join the accuracy check's training batches, each with "
                     "example_targets(B) as its targets (real batches hold inputs only)", len(self.calibration))
        score = getattr(mf, "score", None)
        self.score_gate = (TrainScoreGates(score, cfg.min_score_ratio, cfg.min_score, mf.path.name)
                           if score is not None else None)
        self._runs: dict[tuple[int, Any], float] = {}  # (batch size, graph key) -> train_loss_rel_diff
        self._real: list[tuple[CheckBatch, torch.Tensor]] | None = None  # see _real_reference
        if self.calibration:
            self._real_reference()  # a real batch the training step cannot take stops the run before any trial

    def trial_params(self, params: dict, fp8_keep=None) -> TrialParams:
        """The typed parameters of trial ``params`` (no FP8 keep-list: fp8 is not searched in training)."""
        return TrialParams.from_params(params)

    def targets(self, batch_size: int) -> Any:
        try:
            t = self.mf.example_targets(batch_size)
        except Exception as exc:
            raise ModelFileError(f"{self.mf.path.name}: example_targets({batch_size}) raised {type(exc).__name__}: {exc}") from exc
        return t.to(self.device) if isinstance(t, torch.Tensor) else t

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        make = getattr(self.mf, "make_optimizer", None)
        return make(model.parameters()) if make else torch.optim.Adam(model.parameters(), lr=1e-3)

    def fresh_model(self) -> torch.nn.Module:
        m = copy.deepcopy(self.model)
        m.load_state_dict(self.initial_state)
        return m.train()

    def accumulation(self, batch_size: int) -> int:
        return max(1, math.ceil(self.cfg.effective_batch / batch_size)) if self.cfg.effective_batch else 1

    def check_batches(self, batch_size: int) -> list[CheckBatch]:
        """The accuracy check's batches at ``batch_size``: the seeded random inputs, then every real batch."""
        out = [CheckBatch(reference_inputs(self.mf, batch_size, self.device), None, "the random inputs")]
        out[0].targets = self.targets(batch_size)
        return out + [b for b, _ in self._real_reference()]

    def _real_reference(self) -> list[tuple[CheckBatch, torch.Tensor]]:
        """Each real batch (targets ``example_targets(B)``, seeded) with its FP32 gradients at the initial weights,
        computed once: they do not depend on the trial's batch size."""
        if self._real is None:
            check_trainable(self.mf)
            self._real = []
            model = self.fresh_model()
            for b in self.calibration:
                torch.manual_seed(CHECK_SEED + len(b.inputs[0]))
                batch = CheckBatch(b.inputs, self.targets(len(b.inputs[0])), f"the real batch {b.source}")
                try:
                    grads = self._fp32_grads(model, batch)
                except Exception as exc:  # noqa: BLE001 - the user's data, model or loss_fn
                    raise self._bad_real_batch(batch, exc) from None
                self._real.append((batch, grads))
        return self._real

    def _fp32_grads(self, model: torch.nn.Module, b: CheckBatch) -> torch.Tensor:
        """The FP32 gradients of ``loss_fn`` on ``b`` at ``model``'s weights (one float32 vector; seeded)."""
        model.zero_grad(set_to_none=True)
        with precision_mode("fp32"):
            torch.manual_seed(CHECK_SEED)
            loss = self.mf.loss_fn(model(*b.inputs), b.targets)
            loss.backward()
        return torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.grad is not None])

    def reference(self, batch_size: int):
        """``((inputs, targets), grads)`` of the random batch at ``batch_size`` (the timed inputs), computed with
        :attr:`_refs`' full entry: every check batch (:meth:`check_batches`) and its FP32 gradients at the initial
        weights (one float32 vector each), and, with a score, the FP32-trained reference's losses and score.

        Raises:
            ModelFileError: no ``example_targets``/``loss_fn``; ModelFileError / UsageError: a real batch on which
                the FP32 training step raises (naming the batch and the expected inputs); CandidateRejected: the
                random batch's FP32 step failed (out of memory, the model raised).
        """
        ref = self._reference(batch_size)
        return ref[0], ref[1][0]

    def _reference(self, batch_size: int):
        if batch_size not in self._refs:
            check_trainable(self.mf)
            batches = self.check_batches(batch_size)
            real = [g for _, g in self._real_reference()]
            model = self.fresh_model()
            try:
                grads = [self._fp32_grads(model, batches[0]), *real]
            except Exception as exc:
                raise rejection(exc, self.device, batch_size, "the FP32 reference step") from exc
            run = None
            if self.score_gate is not None:
                model.load_state_dict(self.initial_state)
                losses = self._train_run(model, model, "fp32", batches)
                gate = self.score_gate.gate(batch_size)
                model.eval()
                gate.reference(model)  # raises ModelFileError when score() fails on it
                run = losses
            self._refs[batch_size] = ((batches[0].inputs, batches[0].targets), grads, batches, run)
        return self._refs[batch_size]

    def _bad_real_batch(self, b: CheckBatch, exc: BaseException) -> Exception:
        """The error for a real batch on which the FP32 training step raised (like inference's bad data)."""
        shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in b.inputs)
        source = b.source.removeprefix("the real batch ")
        torch.manual_seed(0)
        want = expected(self.mf.inputs(2, "cpu"))
        msg = (f"the FP32 training step (model, loss_fn with example_targets({len(b.inputs[0])})) raised "
               f"{type(exc).__name__} on it: {first_line(exc)[:200]}\n  its inputs: {shapes}; expected {want} "
               f"(shapes other than the batch as in example_inputs)\n  fix: {FIX_SHAPES}")
        if self.cfg.calibration is not None:
            return UsageError(f"calibration file {Path(self.cfg.calibration).expanduser() / source}: {msg}",
                              field="calibration")
        return ModelFileError(f"{self.mf.path.name}: {source}: {msg}")

    def _train_run(self, model: torch.nn.Module, fwd, precision: str, batches: list[CheckBatch]) -> list[float]:
        """The short training run of the score check: from ``model``'s current (initial) weights, with a fresh
        optimizer (and GradScaler at fp16), one step per batch of ``batches`` through ``fwd``; returns the losses
        (FP32 numbers, one per step). ``model`` is left trained, in train mode."""
        opt = self.optimizer(model)
        dtype = LOW.get(precision)
        scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None
        losses = []
        with precision_mode(precision):
            for b in batches:
                opt.zero_grad(set_to_none=True)
                torch.manual_seed(CHECK_SEED)
                with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
                    loss = self.mf.loss_fn(fwd(*b.inputs), b.targets)
                (scaler.scale(loss) if scaler else loss).backward()
                losses.append(float(loss.detach().float()))
                if scaler:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
            opt.zero_grad(set_to_none=True)
        return losses

    def _score(self, params: dict, model: torch.nn.Module, fwd) -> dict:
        """The score metrics of trial ``params`` (:meth:`ScoreGate.metrics` plus ``train_loss_rel_diff``), {}
        without a score. Runs the candidate's short training run (:meth:`_train_run`) from the initial weights
        into ``model`` (reset to them first) unless the score of this precision at this batch size is cached,
        then scores ``model`` in eval mode. The FP32 eager candidate is the reference run itself."""
        if self.score_gate is None:
            return {}
        bs, precision = params["batch_size"], params["precision"]
        _, _, batches, ref_losses = self._reference(bs)
        gate = self.score_gate.gate(bs)
        if precision == "fp32" and params.get("runtime", "eager") == "eager":
            return {**gate.metrics(gate.fp32, 0.0), "train_loss_rel_diff": 0.0}
        key = graph_key(self.trial_params(params))
        if key not in gate.cache:
            model.load_state_dict(self.initial_state)
            losses = self._train_run(model, fwd, precision, batches)
            self._runs[(bs, key)] = max(abs(c - r) / (abs(r) or 1.0) for c, r in zip(losses, ref_losses))
            model.eval()
            try:
                value, seconds = gate.score(key, model, precision, numerics="fp32")
            finally:
                model.train()
        else:
            value, seconds = gate.score(key, model, precision, numerics="fp32")
        return {**gate.metrics(value, seconds), "train_loss_rel_diff": self._runs.get((bs, key))}

    def evaluate(self, params: dict, on_repeat=None, fp8_keep=None) -> dict:
        """Build, check and time one training step; the evaluator interface's signature (``fp8_keep``
        is unused: precision fp8 is not searched in training).

        Raises:
            CandidateRejected: out of memory, a non-finite loss or gradients, or GradScaler skipping most steps.
        """
        bs, precision, runtime = params["batch_size"], params["precision"], params.get("runtime", "eager")
        (inputs, targets), ref_grads, batches, _ = self._reference(bs)
        accum = self.accumulation(bs)
        model = self.fresh_model()
        opt = self.optimizer(model)
        dtype = LOW.get(precision)
        scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None
        fwd = torch.compile(model) if runtime.startswith("inductor") else model
        skipped = {"steps": 0, "skipped": 0}

        def forward_backward(x=inputs, y=targets):
            with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
                loss = self.mf.loss_fn(fwd(*x), y) / accum
            (scaler.scale(loss) if scaler else loss).backward()
            return loss

        def step():
            for _ in range(accum):
                forward_backward()
            if scaler:
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                skipped["skipped"] += int(scaler.get_scale() < before)
            else:
                opt.step()
            skipped["steps"] += 1
            opt.zero_grad(set_to_none=True)

        try:
            with precision_mode(precision):
                t0 = time.perf_counter()
                setup_s, err = 0.0, None
                for i, b in enumerate(batches):  # gradients at the initial weights, each against FP32's
                    opt.zero_grad(set_to_none=True)
                    torch.manual_seed(CHECK_SEED)
                    loss = forward_backward(b.inputs, b.targets)
                    if not torch.isfinite(loss.detach()).all():
                        on = f" on {b.source}" if i else ""
                        raise CandidateRejected(f"{precision} training loss is not finite{on} ({float(loss):.3g})",
                                                FailureKind.ACCURACY)
                    scale = scaler.get_scale() if scaler else 1.0
                    grads = [p.grad.detach().float() / (scale * 1.0) * accum for p in model.parameters() if p.grad is not None]
                    if i == 0:
                        if self.device.type == "cuda":
                            torch.cuda.synchronize(self.device)
                        setup_s = time.perf_counter() - t0 if runtime.startswith("inductor") else 0.0
                    e = compare(torch.cat([g.flatten() for g in grads]), ref_grads[i])
                    err = e if err is None else worst(err, e)
                opt.zero_grad(set_to_none=True)
            scored = {} if err.nonfinite else self._score(params, model, fwd)
            with precision_mode(precision):
                timing = time_call(step, bs * accum, self.device, grad=True, single_calls=10, on_repeat=on_repeat,
                                   target_repeat_s=0.1 if self.device.type == "cuda" else 0.15)
        except (CandidateRejected, optuna.TrialPruned):
            raise
        except Exception as exc:
            raise rejection(exc, self.device, bs, f"{runtime} training step") from exc
        if scaler and skipped["steps"] and skipped["skipped"] * 2 > skipped["steps"]:
            raise CandidateRejected(f"GradScaler skipped {skipped['skipped']} of {skipped['steps']} fp16 steps (gradients overflow)",
                                   FailureKind.ACCURACY)
        if err.nonfinite:
            raise CandidateRejected(f"{precision} gradients hold {err.nonfinite} NaN/inf values", FailureKind.ACCURACY)
        return trial_metrics(
            timing, err, passes=[], setup_s=setup_s,
            description=f"train step {precision}{' + GradScaler' if scaler else ''}, {runtime}, "
                        f"micro-batch {bs} x {accum} accumulation",
            accumulation_steps=accum, scaler_skipped_steps=skipped["skipped"] if scaler else None,
            timed_steps=skipped["steps"], **scored, **({"real_batches": len(self.calibration)} if self.calibration else {}))
