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


# ------------------------------------------------------------------------------------------------ study lock

from tctune.search.storage import LOCK_NAME, STALE_AFTER_S, StudyInUseError, StudyLock  # noqa: E402

TINY = '''
import torch
def build_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
'''

HANGS = '''
import os, time, pathlib, torch
class M(torch.nn.Module):
    calls = 0  # two eager calls come before the study (the captured graph's check against eager, the FP32
    # check); the trial's calls come after them
    def __init__(self):
        super().__init__(); self.fc = torch.nn.Linear(16, 8)
    def forward(self, x):
        if not torch.compiler.is_compiling():
            M.calls += 1
        if not torch.compiler.is_compiling() and M.calls > 2 and os.environ.get("TCTUNE_TEST_MARKER"):
            pathlib.Path(os.environ["TCTUNE_TEST_MARKER"]).write_text("in trial")
            time.sleep(600)  # outlasts the second run however slow the host (the test kills it)
        return self.fc(x)
def build_model():
    return M()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
'''


def _holder(pid, host=None, heartbeat=None):
    return {"pid": pid, "host": host or socket.gethostname(), "started": "2026-01-02T03:04:05+00:00",
            "heartbeat": time.time() if heartbeat is None else heartbeat, "token": "other"}


def _write_lock(out, record):
    import json
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_NAME).write_text(json.dumps(record))


def _cfg(out, **kw):
    from tctune.search import TuneConfig
    return TuneConfig(out_dir=str(out), batch_sizes=(4,), trials=2, quiet=True, export=False, prune=False, **kw)


@pytest.fixture
def live_process():
    """Another live process on this host (its pid is what a holder's lock file names)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # killed after the test
    yield proc
    proc.kill()
    proc.wait()


def test_second_run_is_refused_before_touching_the_study(tmp_path, live_process):
    """A lock held by a live process: optimize stops with one line naming the holder; no study.db appears."""
    from tctune.optimize import optimize

    model, out = tmp_path / "tiny.py", tmp_path / "out"
    model.write_text(TINY)
    _write_lock(out, _holder(live_process.pid))
    with pytest.raises(StudyInUseError) as err:
        optimize(model, _cfg(out))
    text = str(err.value)
    assert str(live_process.pid) in text and socket.gethostname() in text and "2026-01-02T03:04:05" in text
    assert err.value.field == "out_dir" and err.value.holder["pid"] == live_process.pid
    assert not (out / "study.db").exists() and not (out / "report.json").exists()
    assert (out / LOCK_NAME).exists()  # the holder's lock is left alone


def test_two_real_runs_on_one_out_the_second_exits_naming_the_first(tmp_path):
    """Two `tctune optimize` processes on one --out: the second exits 2 with one line; the first finishes."""
    model, out, marker = tmp_path / "hangs.py", tmp_path / "out", tmp_path / "marker"
    model.write_text(HANGS)
    cmd = [sys.executable, "-m", "tctune", "optimize", str(model), "--out", str(out), "--batch-sizes", "4",
           "--trials", "1", "--quiet", "--no-export", "--no-prune"]
    first = subprocess.Popen(cmd, env=dict(os.environ, TCTUNE_TEST_MARKER=str(marker)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300  # a hang guard: a slow host may take minutes to get there
        while not marker.exists():
            assert first.poll() is None, first.communicate()
            assert time.time() < deadline, "the first run's trial never started"
            time.sleep(0.1)
        trials_before = _trial_states(out)
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr
        lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
        assert lines[0].startswith("tctune: error: --out ") and f"process {first.pid} on {socket.gethostname()}" in lines[0]
        assert "Traceback" not in second.stderr
        assert _trial_states(out) == trials_before and "RUNNING" in trials_before  # the first run's trial untouched
    finally:
        first.kill()
        first.wait()


def _trial_states(out):
    storage = f"sqlite:///{out / 'study.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    return [t.state.name for t in optuna.load_study(study_name=summary.study_name, storage=storage).trials]


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(tmp_path, _holder(dead.pid))
    lock = StudyLock(tmp_path)
    with caplog.at_level("WARNING", logger="tctune"):
        lock.acquire()
    try:
        assert any("stale study lock" in r.getMessage() and f"process {dead.pid}" in r.getMessage()
                   and "no longer exists" in r.getMessage() for r in caplog.records)
        assert lock.holder()["pid"] == os.getpid() and lock.holder()["token"] == lock.token
    finally:
        lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_of_another_host_is_stale_only_when_its_heartbeat_is_old(tmp_path, live_process):
    lock = StudyLock(tmp_path)
    fresh = _holder(live_process.pid, host="elsewhere.example")
    assert lock.stale_reason(fresh) is None
    old = _holder(live_process.pid, host="elsewhere.example", heartbeat=time.time() - STALE_AFTER_S - 5)
    assert "heartbeat" in lock.stale_reason(old)
    assert lock.stale_reason(_holder(live_process.pid)) is None  # live here, beating
    _write_lock(tmp_path, fresh)
    with pytest.raises(StudyInUseError):
        lock.acquire()
    _write_lock(tmp_path, old)
    lock.acquire()
    lock.release()


def test_two_locks_in_one_folder_exclude_each_other(tmp_path):
    a, b = StudyLock(tmp_path), StudyLock(tmp_path)
    a.acquire()
    try:
        with pytest.raises(StudyInUseError, match=f"process {os.getpid()}"):
            b.acquire()
    finally:
        a.release()
    b.acquire()  # released: free again
    b.release()


def test_storage_url_runs_are_not_locked(tmp_path, live_process):
    """With --storage (a shared study, several workers by design) a held lock in --out does not stop a run."""
    from tctune.optimize import optimize

    model, out = tmp_path / "tiny.py", tmp_path / "out"
    model.write_text(TINY)
    _write_lock(out, _holder(live_process.pid))
    report = optimize(model, _cfg(out, storage=f"sqlite:///{tmp_path / 'shared.db'}"))
    assert report["study"]["n_trials"] >= 1 and (out / "report.json").exists()
    assert (out / LOCK_NAME).exists() and "other" in (out / LOCK_NAME).read_text()  # not ours: left alone


def test_a_finished_run_releases_its_lock(tmp_path):
    from tctune.optimize import optimize

    model, out = tmp_path / "tiny.py", tmp_path / "out"
    model.write_text(TINY)
    optimize(model, _cfg(out))
    assert not (out / LOCK_NAME).exists()
    optimize(model, _cfg(out))  # the same command again resumes


def _finish(study, value, baseline=None):
    tr = study.ask()
    tr.suggest_categorical("batch_size", [8, 128])
    if baseline:
        tr.set_user_attr("baseline", baseline)
    else:
        tr.report(value, 0)
        tr.report(value, 1)
    study.tell(tr, value)


def _probe(study, value) -> bool:
    tr = study.ask()
    tr.suggest_categorical("batch_size", [8, 128])
    tr.report(value, 0)
    tr.report(value, 1)
    stop = tr.should_prune()
    study.tell(tr, state=optuna.trial.TrialState.PRUNED)
    return stop


def _fixed_batch_sampler(batches):
    """A sampler that hands out ``batch_size`` from ``batches`` in order (the search's own sampler decides it)."""
    order = iter(batches)

    class Fixed(optuna.samplers.RandomSampler):
        def sample_independent(self, study, trial, name, dist):
            return next(order)

    return Fixed()


def test_pruner_ignores_plain_baselines_and_other_batch_sizes():
    """Plain baselines (no intermediate values, never stopped) and trials at another batch size do not count
    towards the start-up, and a candidate is judged only against searched trials at its own batch size: Optuna's
    PercentilePruner counted both, so the second searched trial of a small study was judged against one trial at
    another batch size."""
    batches = [8] * 6 + [128] * 6 + [8]
    study = optuna.create_study(direction="maximize", pruner=make_pruner(["maximize"]),
                                sampler=_fixed_batch_sampler(batches))
    for _ in range(6):
        _finish(study, 100.0, baseline="fp32_eager")  # six finished baselines at batch 8
    for _ in range(6):
        _finish(study, 5000.0)  # six searched trials at batch 128, far faster per item
    assert not _probe(study, 10.0)  # batch 8: no comparable finished trial yet, however slow

    batches = [8] * 6 + [8, 8]
    study = optuna.create_study(direction="maximize", pruner=make_pruner(["maximize"]),
                                sampler=_fixed_batch_sampler(batches))
    for v in (900.0, 1000.0, 1100.0, 1200.0, 1300.0, 1400.0):
        _finish(study, v)  # six searched trials at batch 8
    assert _probe(study, 10.0)  # the slowest quarter of its peers: stopped
    assert not _probe(study, 1250.0)
