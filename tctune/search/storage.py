"""Study storage: opening (or resuming) a study in an Optuna storage, its pruner, and the bookkeeping of
trials a killed or interrupted process left behind."""
from __future__ import annotations

import json
import logging
import time
import warnings

import optuna

from ..trial import FailureKind
from .results import counts_as_measured

log = logging.getLogger("tctune")


def make_pruner(directions: list[str], enabled: bool = True) -> optuna.pruners.BasePruner:
    """A candidate whose throughput after its first repeats is below the slowest quarter of the trials
    measured so far stops early (throughput studies; Optuna does not prune multi-objective studies)."""
    if enabled and directions == ["maximize"]:
        return optuna.pruners.PercentilePruner(25.0, n_startup_trials=6, n_warmup_steps=1)
    return optuna.pruners.NopPruner()


def open_study(url: str, name: str, directions: list[str], sampler, attempts: int = 5, prune: bool = True):
    """Create or load study ``name`` in the storage at ``url``; returns ``(study, storage)``.

    Several workers starting at once race to create the storage's tables (PostgreSQL: a unique-constraint
    violation in its catalog) and the study (``DuplicatedStudyError``): the losers wait and try again, and
    then find what the winner created.
    """
    import sqlalchemy.exc

    for attempt in range(1, attempts + 1):
        try:
            if url.startswith(("sqlite:", "postgresql", "mysql")):
                # A heartbeat lets any worker fail the trials of a worker that was killed (shared studies).
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    storage = optuna.storages.RDBStorage(url, heartbeat_interval=30, grace_period=120)
            else:
                storage = url
            study = optuna.create_study(study_name=name, storage=storage, directions=directions, sampler=sampler,
                                        pruner=make_pruner(directions, prune), load_if_exists=True)
            return study, storage
        except (optuna.exceptions.DuplicatedStudyError, sqlalchemy.exc.IntegrityError):
            if attempt == attempts:
                raise
            time.sleep(0.3 * attempt)
    raise AssertionError("unreachable")


def fail_interrupted(study: optuna.Study, storage) -> int:
    """Mark the study's RUNNING trials FAIL with the reason "interrupted"; returns how many."""
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    if not running:
        return 0
    sid = storage.get_study_id_from_name(study.study_name)
    for t in running:
        tid = storage.get_trial_id_from_study_id_trial_number(sid, t.number)
        storage.set_trial_user_attr(tid, "fail_reason", "interrupted: the process ended during this trial")
        storage.set_trial_user_attr(tid, "fail_kind", FailureKind.INTERRUPTED.value)
        storage.set_trial_state_values(tid, optuna.trial.TrialState.FAIL)
    log.warning("marked %d interrupted trial(s) as failed; finished trials are kept", len(running))
    return len(running)


def measured(study: optuna.Study) -> set[str]:
    """Parameter sets already decided (complete, failed, or pruned: stopped early as clearly slower, or a
    twin not measured), as canonical JSON strings. Pruned ones count because the enumerating sampler never
    proposes them again either; without them a resumed run promised trials that could only be duplicates."""
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED)
    return {json.dumps(t.params, sort_keys=True) for t in study.get_trials(deepcopy=False)
            if t.state in done and counts_as_measured(t)}


def retry_interrupted(study: optuna.Study, space: dict) -> int:
    """Enqueue again the candidates whose only trials were cut off (Ctrl-C, a killed process): the
    enumerating sampler counts them as visited, so without this they would never be measured. ``space``: the
    study's search space (a candidate outside it is not enqueued)."""
    done = measured(study)
    waiting = {json.dumps(t.params, sort_keys=True)
               for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))}
    n = 0
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,)):
        key = json.dumps(t.params, sort_keys=True)
        if counts_as_measured(t) or key in done or key in waiting or t.user_attrs.get("baseline"):
            continue  # (a plain baseline is enqueued again as one by tctune.search.loop.Tuner.enqueue_baselines)
        if any(t.params.get(k) not in v for k, v in space.items()):
            continue
        study.enqueue_trial(dict(t.params))
        waiting.add(key)
        n += 1
    if n:
        log.info("%d interrupted candidate(s) queued to be measured again", n)
    return n
