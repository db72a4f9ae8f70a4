"""``--mode train``: tune a training step (forward, loss, backward, optimizer step).

The metrics are those of the seed article: samples/s, step time and peak memory. Precisions:

- fp32 (TF32 off) and tf32: plain FP32 training.
- bf16: ``torch.autocast`` without a loss scaler (bf16 has FP32's exponent range).
- fp16: ``torch.autocast`` with ``torch.amp.GradScaler``; a step whose gradients overflow is skipped by the
  scaler. Skipped steps are counted; a configuration that skips more than half its timed steps is rejected.

Accuracy: the candidate's gradients after one step on fresh random inputs, from the same initial weights,
against FP32 gradients (relative L2 error of all parameters' gradients concatenated into one vector). Each trial starts from a fresh copy of
the initial model and optimizer, so earlier trials' updates do not leak into it.

The optimizer is the model file's ``make_optimizer(params)`` if it defines one, else
``torch.optim.Adam(params, lr=1e-3)`` (the seed article's choice).
"""
from __future__ import annotations

import copy
import math
import time
from typing import Any

import optuna
import torch

from ..errors import CandidateRejected, ModelFileError
from ..measure import compare, precision_mode, time_call
from ..modelfile import SIGNATURES
from ..trial import FailureKind, TrialParams, reference_inputs
from .results import rejection, trial_metrics

LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_trainable(mf) -> None:
    """Raises ModelFileError (naming what to add) when the model file lacks what ``--mode train`` needs."""
    missing = [fn for fn in ("example_targets", "loss_fn") if getattr(mf, fn) is None]
    if missing:
        sigs = "\n".join(f"  add: {SIGNATURES[fn]}" for fn in missing)
        raise ModelFileError(f"{mf.path.name}: --mode train needs {' and '.join(f'{m}()' for m in missing)}\n{sigs}")


class TrainingEvaluator:
    """Training-step candidates (the evaluator interface of :mod:`tctune.search.evaluate`).

    Args:
        cfg: run options (``effective_batch``); mf: the model file (with ``example_targets`` and ``loss_fn``);
        device: where steps run; model: the model on ``device`` (its initial weights start every trial).

    Its first reference step raises ModelFileError when the model file lacks ``example_targets`` or ``loss_fn``
    (``tctune optimize`` checks that before anything runs: :func:`check_trainable`).
    """

    def __init__(self, cfg, mf, device: torch.device, model: torch.nn.Module):
        self.cfg, self.mf, self.device, self.model = cfg, mf, device, model
        self.initial_state = copy.deepcopy(self.model.state_dict())
        self._refs: dict[int, tuple] = {}
        self.fp8_plans: dict = {}  # precision fp8 is not searched in training
        self.compile_over_budget: str | None = None

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

    def reference(self, batch_size: int):
        """Inputs, targets and the FP32 gradients of one step from the initial weights."""
        if batch_size not in self._refs:
            check_trainable(self.mf)
            inputs = reference_inputs(self.mf, batch_size, self.device)
            targets = self.targets(batch_size)
            model = self.fresh_model()
            try:
                with precision_mode("fp32"):
                    loss = self.mf.loss_fn(model(*inputs), targets)
                    loss.backward()
            except Exception as exc:
                raise rejection(exc, self.device, batch_size, "the FP32 reference step") from exc
            grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
            self._refs[batch_size] = ((inputs, targets), grads)
        return self._refs[batch_size]

    def evaluate(self, params: dict, on_repeat=None, fp8_keep=None) -> dict:
        """Build, check and time one training step; the evaluator interface's signature (``fp8_keep``
        is unused: precision fp8 is not searched in training).

        Raises:
            CandidateRejected: out of memory, a non-finite loss or gradients, or GradScaler skipping most steps.
        """
        bs, precision, runtime = params["batch_size"], params["precision"], params.get("runtime", "eager")
        (inputs, targets), ref_grads = self.reference(bs)
        accum = self.accumulation(bs)
        model = self.fresh_model()
        opt = self.optimizer(model)
        dtype = LOW.get(precision)
        scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None
        fwd = torch.compile(model) if runtime.startswith("inductor") else model
        skipped = {"steps": 0, "skipped": 0}

        def forward_backward():
            with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
                loss = self.mf.loss_fn(fwd(*inputs), targets) / accum
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
                opt.zero_grad(set_to_none=True)
                loss = forward_backward()
                if not torch.isfinite(loss.detach()).all():
                    raise CandidateRejected(f"{precision} training loss is not finite ({float(loss):.3g})", FailureKind.ACCURACY)
                scale = scaler.get_scale() if scaler else 1.0
                grads = [p.grad.detach().float() / (scale * 1.0) * accum for p in model.parameters() if p.grad is not None]
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                setup_s = time.perf_counter() - t0 if runtime.startswith("inductor") else 0.0
                err = compare(torch.cat([g.flatten() for g in grads]), torch.cat([g.float().flatten() for g in ref_grads]))
                opt.zero_grad(set_to_none=True)
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
            timed_steps=skipped["steps"])
