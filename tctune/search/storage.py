"""Study storage: opening (or resuming) a study in an Optuna storage, its pruner, and the bookkeeping of
trials a killed or interrupted process left behind."""
from __future__ import annotations

import collections
import json
import logging
import os
import socket
import threading
import time
import uuid
import warnings
from datetime import datetime, timezone
from pathlib import Path

import optuna

from ..errors import UsageError
from ..trial import FailureKind
from .results import OUTCOMES, counts_as_measured, trial_outcome

log = logging.getLogger("tctune")


#: Share of the trials measured so far whose throughput a running candidate must reach to go on: one below
#: this percentile (the slowest quarter) stops early.
PRUNE_BELOW_PERCENTILE = 25.0


#: Finished searched trials at the candidate's batch size before the pruner stops anything.
PRUNE_STARTUP_TRIALS = 6


class ComparablePercentilePruner(optuna.pruners.BasePruner):
    """Stops a running candidate whose best throughput so far is below the ``below``-th percentile of the
    throughput the *comparable* finished trials reported at the same repeat (step).

    Comparable: finished (COMPLETE) trials that are not plain baselines (``user_attrs["baseline"]``: they report
    no intermediate values and are never stopped) and that ran at the candidate's batch size (items/s at batch 8
    and at batch 128 are different quantities). Nothing is stopped before ``n_startup_trials`` such trials exist,
    or before step ``n_warmup_steps`` (the first repeat is a warm-up). Otherwise the rule of Optuna's
    ``PercentilePruner`` on a maximized objective: ``max(intermediate values so far) < np.nanpercentile(the
    comparable trials' values at this step, below)``; a NaN best is stopped. Optuna's own pruner counted every
    finished trial (baselines included) towards its start-up and compared across batch sizes, so in a small study
    the second searched trial was already judged against one trial at another batch size.
    """

    def __init__(self, below: float, n_startup_trials: int, n_warmup_steps: int) -> None:
        self.below, self.n_startup_trials, self.n_warmup_steps = below, n_startup_trials, n_warmup_steps

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        import math

        import numpy as np

        step = trial.last_step
        if step is None or step < self.n_warmup_steps:
            return False
        batch = trial.params.get("batch_size")
        peers = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                 if not t.user_attrs.get("baseline") and t.params.get("batch_size") == batch]
        if len(peers) < self.n_startup_trials:
            return False
        values = [t.intermediate_values[step] for t in peers if step in t.intermediate_values]
        if not values:
            return False
        best = max(trial.intermediate_values.values())
        if math.isnan(best):
            return True
        return bool(best < np.nanpercentile(np.asarray(values, dtype=float), self.below))


def make_pruner(directions: list[str], enabled: bool = True) -> optuna.pruners.BasePruner:
    """A candidate whose throughput after its first repeats is below the 25th percentile of the comparable
    trials measured so far (:data:`PRUNE_BELOW_PERCENTILE`: the slowest quarter; comparable: searched, finished,
    at its batch size, :class:`ComparablePercentilePruner`) stops early; throughput studies only (Optuna does not
    prune multi-objective studies). Pruning starts after :data:`PRUNE_STARTUP_TRIALS` comparable finished trials
    and from the second repeat (step 1).
    """
    if enabled and directions == ["maximize"]:
        return ComparablePercentilePruner(PRUNE_BELOW_PERCENTILE, n_startup_trials=PRUNE_STARTUP_TRIALS,
                                          n_warmup_steps=1)
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


#: The lock file in the output folder while a ``tctune optimize`` runs its default SQLite study there.
LOCK_NAME = "tctune.lock"
#: Seconds between rewrites of the lock's ``heartbeat`` (a daemon thread of the holder).
HEARTBEAT_S = 30.0
#: A lock whose heartbeat is older than this is stale even where its process cannot be checked (another host
#: sharing the folder): ten missed heartbeats.
STALE_AFTER_S = 10 * HEARTBEAT_S


class StudyInUseError(UsageError):
    """Another live ``tctune optimize`` holds the output folder's study lock (:class:`StudyLock`).

    Attributes:
        holder: the lock file's record: ``pid`` (int), ``host`` (str), ``started`` (ISO 8601, UTC),
            ``heartbeat`` (Unix seconds of its last sign of life).
    """

    def __init__(self, message: str, holder: dict):
        super().__init__(message, field="out_dir")
        self.holder = holder


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (``kill(pid, 0)``; a process of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


class StudyLock:
    """One ``tctune optimize`` per output folder at a time: a lock file ``<out>/tctune.lock``.

    Two runs on the same default SQLite study break each other (the second marks the first's running trial
    failed as interrupted, and the first then dies telling Optuna about it), and they write the same
    ``report.json`` and engines. The lock file holds ``{"pid", "host", "started", "heartbeat", "token"}``
    (``started`` ISO 8601 UTC, ``heartbeat`` Unix seconds, rewritten every :data:`HEARTBEAT_S` by a daemon
    thread). It is created with ``O_CREAT | O_EXCL``, so of two processes starting at once exactly one gets
    it. A lock is stale, and is taken over with a warning, when its process no longer exists on this host or
    its heartbeat is older than :data:`STALE_AFTER_S` (a process on another host, or a stopped one).

    Not used with a shared storage URL (several workers on one study are the design there) nor in the worker
    processes of ``devices``, which run under their parent's lock.

    Args:
        out_dir: the output folder (created by the caller).
    """

    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / LOCK_NAME
        self.token = uuid.uuid4().hex
        self.record: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> dict | None:
        """The lock file's record, or None when there is none (an unreadable file reads as ``{}``)."""
        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def stale_reason(self, holder: dict, now: float | None = None) -> str | None:
        """Why ``holder`` no longer holds the lock (its process is gone, or its heartbeat is too old), else None."""
        now = time.time() if now is None else now
        pid, host = holder.get("pid"), holder.get("host")
        if not isinstance(pid, int) or not host:
            return "the lock file is unreadable"
        if host == socket.gethostname() and not _pid_alive(pid):
            return f"process {pid} on {host} no longer exists"
        beat = holder.get("heartbeat")
        if not isinstance(beat, (int, float)) or now - beat > STALE_AFTER_S:
            age = f"{now - beat:.0f} s" if isinstance(beat, (int, float)) else "unknown"
            return f"its last heartbeat is {age} old (more than {STALE_AFTER_S:.0f} s)"
        return None

    def describe(self, holder: dict) -> str:
        return (f"process {holder.get('pid', '?')} on {holder.get('host', '?')}, started "
                f"{holder.get('started', '?')}")

    def check(self) -> None:
        """Raise :class:`StudyInUseError` when a live holder has the lock; touches nothing.

        Raises:
            StudyInUseError: naming the holder (process id, host, start time) and the fix.
        """
        holder = self.holder()
        if holder is not None and holder.get("token") != self.token and self.stale_reason(holder) is None:
            raise StudyInUseError(
                f"out_dir {self.path.parent} is in use by another tctune optimize ({self.describe(holder)}); "
                f"two runs on one study break each other\n  fix: wait for it to finish, stop it (kill "
                f"{holder.get('pid')}), or give another out_dir", holder)

    def acquire(self) -> "StudyLock":
        """Take the lock (a stale one with a warning) and start the heartbeat; returns self.

        Raises:
            StudyInUseError: a live process holds it.
        """
        for _ in range(5):
            self.check()
            holder = self.holder()
            if holder is not None:
                reason = self.stale_reason(holder)
                if (self.holder() or {}).get("token") != holder.get("token"):
                    continue  # another process took it over first: check the new holder
                log.warning("taking over the stale study lock %s of %s: %s", self.path, self.describe(holder), reason)
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
            now = time.time()
            self.record = {"pid": os.getpid(), "host": socket.gethostname(),
                           "started": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
                           "heartbeat": now, "token": self.token}
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:  # another process got it between our check and now: check it again
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(self.record, handle)
            self._thread = threading.Thread(target=self._beat, name="tctune-study-lock", daemon=True)
            self._thread.start()
            return self
        self.check()
        raise AssertionError("unreachable: the lock changed hands five times")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if (self.holder() or {}).get("token") != self.token:
                return  # taken over (we were thought dead): do not write over the new holder
            self.record["heartbeat"] = time.time()
            tmp = self.path.with_name(f".{LOCK_NAME}.{self.token}")
            try:
                tmp.write_text(json.dumps(self.record), encoding="utf-8")
                os.replace(tmp, self.path)
            except OSError as exc:
                log.debug("study lock heartbeat not written: %s", exc)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still this process's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.record is not None and (self.holder() or {}).get("token") == self.token:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        self.record = None

    def __enter__(self) -> "StudyLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


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


def candidate_outcomes(study: optuna.Study) -> dict[str, str]:
    """Each decided candidate (its parameters as canonical JSON) -> what became of it
    (:func:`~tctune.search.results.trial_outcome`; of several trials of one candidate the first of
    ``measured``, ``failed``, ``pruned``, ``skipped``). The keys are :func:`measured`."""
    rank = {k: i for i, k in enumerate(OUTCOMES)}
    out: dict[str, str] = {}
    for t in study.get_trials(deepcopy=False):
        outcome = trial_outcome(t)
        if outcome is None:
            continue
        key = json.dumps(t.params, sort_keys=True)
        if key not in out or rank[outcome] < rank[out[key]]:
            out[key] = outcome
    return out


def outcome_counts(study: optuna.Study) -> collections.Counter:
    """How many decided candidates ended each way (:func:`candidate_outcomes`): outcome -> count."""
    return collections.Counter(candidate_outcomes(study).values())


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
