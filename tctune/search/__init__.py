"""Optuna search over batch size × precision × graph passes × runtime, every candidate measured.

Modules, by job: :mod:`~tctune.search.config` (``TuneConfig``), :mod:`~tctune.search.space` (the search space),
:mod:`~tctune.search.evaluate` and :mod:`~tctune.search.train` (candidate evaluation, inference and training
behind one interface), :mod:`~tctune.search.storage` (study storage, resume, pruner),
:mod:`~tctune.search.results` (reading results) and :mod:`~tctune.search.loop` (the ``Tuner``).
"""
from __future__ import annotations

from .config import OBJECTIVES, TuneConfig
from .evaluate import Candidate, Evaluator, InferenceEvaluator
from .loop import BRUTE_FORCE_MAX, CONFIRM_BAND, CONFIRM_TOP, TRAIN_NO_PASSES, Tuner
from .results import (best_trial, confirmed_throughputs, counts_as_measured, is_feasible, objective_values,
                      pareto_front, rejection, trial_metrics)
from .space import SearchSpace
from .storage import make_pruner
from .train import TrainingEvaluator

__all__ = ["BRUTE_FORCE_MAX", "CONFIRM_BAND", "CONFIRM_TOP", "Candidate", "Evaluator", "InferenceEvaluator",
           "OBJECTIVES", "SearchSpace", "TRAIN_NO_PASSES", "TrainingEvaluator", "TuneConfig", "Tuner", "best_trial",
           "confirmed_throughputs", "counts_as_measured", "is_feasible", "make_pruner", "objective_values",
           "pareto_front", "rejection", "trial_metrics"]
