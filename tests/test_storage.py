"""Study storage: the pruner's percentile, and one run per study at a time (the study lock)."""
import os
import socket
import subprocess
import sys
import time

import numpy as np
import optuna
import pytest

from tctune.search.storage import PRUNE_BELOW_PERCENTILE, make_pruner


def _study_with(values, pruner):
    """A maximized study whose finished trials reported ``values`` at steps 0 and 1 (throughput per repeat)."""
    study = optuna.create_study(direction="maximize", pruner=pruner)
    for v in values:
        tr = study.ask()
        tr.report(v, 0)
        tr.report(v, 1)
        study.tell(tr, v)
    return study


def _stopped(study, value) -> bool:
    tr = study.ask()
    tr.report(value, 0)
    tr.report(value, 1)
    stop = tr.should_prune()
    study.tell(tr, state=optuna.trial.TrialState.PRUNED)
    return stop


def test_pruner_stops_only_the_slowest_quarter():
    """Below the 25th percentile of the finished trials' throughput stops; between it and the 75th goes on
    (``PercentilePruner(25)`` on a maximized objective stopped everything below the 75th)."""
    rng = np.random.default_rng(3)
    finished = list(rng.uniform(100.0, 900.0, size=8))
    q25, q75 = np.percentile(finished, 25), np.percentile(finished, 75)
    study = _study_with(finished, make_pruner(["maximize"]))
    probes = [q25 * 0.5, q25 * 0.99, q25 * 1.01, (q25 + q75) / 2, q75 * 0.99, q75 * 1.5]
    stopped = {p: _stopped(study, p) for p in probes}
    assert stopped == {p: p < q25 for p in probes}, (q25, q75, stopped)
    # the earlier setting, PercentilePruner(25), stops the middle half too: the documented behaviour differs
    old = _study_with(finished, optuna.pruners.PercentilePruner(25.0, n_startup_trials=6, n_warmup_steps=1))
    assert _stopped(old, (q25 + q75) / 2)
    assert PRUNE_BELOW_PERCENTILE == 25.0


def test_pruner_agrees_with_optunas_percentile_on_random_studies():
    """For random studies the pruner stops exactly the candidates whose throughput is below numpy's 25th
    percentile of the finished trials (Optuna's own rule, ``np.nanpercentile`` of the step's values)."""
    rng = np.random.default_rng(7)
    for _ in range(5):
        finished = list(rng.lognormal(7.0, 1.0, size=int(rng.integers(6, 15))))
        q25 = np.percentile(finished, PRUNE_BELOW_PERCENTILE)
        study = _study_with(finished, make_pruner(["maximize"]))
        for v in rng.lognormal(7.0, 1.0, size=6):
            assert _stopped(study, float(v)) == (v < q25)
            finished_now = [t.intermediate_values[1] for t in study.trials
                            if t.state == optuna.trial.TrialState.COMPLETE]
            assert finished_now == finished  # pruned probes never move the percentile


def test_pruner_waits_for_six_trials_and_a_second_repeat():
    study = _study_with([1000.0] * 5, make_pruner(["maximize"]))
    assert not _stopped(study, 1.0)  # five finished trials: no pruning yet
    study = _study_with([1000.0] * 6, make_pruner(["maximize"]))
    tr = study.ask()
    tr.report(1.0, 0)
    assert not tr.should_prune()  # the first repeat is a warm-up step
    tr.report(1.0, 1)
    assert tr.should_prune()


def test_no_pruner_for_other_objectives_or_when_disabled():
    assert isinstance(make_pruner(["maximize", "minimize", "minimize"]), optuna.pruners.NopPruner)
    assert isinstance(make_pruner(["minimize"]), optuna.pruners.NopPruner)
    assert isinstance(make_pruner(["maximize"], enabled=False), optuna.pruners.NopPruner)
