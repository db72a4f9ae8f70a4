"""Faults during a study: a killed process, out of memory, a model torch.export cannot capture, bad storage."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch

from tctune.errors import CandidateRejected, UsageError
from tctune.hardware import resolve
from tctune.measure import ErrorStats, check_accuracy
from tctune.modelfile import load_model_file
from tctune.search import TuneConfig, Tuner

HANGS_AT_32 = '''
import os, time, pathlib, torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.fc = torch.nn.Linear(16, 8)
    def forward(self, x):
        if x.shape[0] == 32 and not os.environ.get("TCTUNE_TEST_FAST") and not torch.compiler.is_compiling():
            pathlib.Path(os.environ["TCTUNE_TEST_MARKER"]).write_text("in trial")
            time.sleep(120)
        return self.fc(x)
def build_model():
    return M()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
'''


def test_sigkill_mid_trial_then_resume_keeps_finished_trials(tmp_path):
    model = tmp_path / "hangs.py"
    model.write_text(HANGS_AT_32)
    out = tmp_path / "out"
    marker = tmp_path / "marker"
    cmd = [sys.executable, "-m", "tctune", "optimize", str(model), "--out", str(out), "--batch-sizes", "8,32",
           "--trials", "4", "--quiet", "--no-export", "--no-prune"]
    env = dict(os.environ, TCTUNE_TEST_MARKER=str(marker))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300  # a hang guard: a slow host may take minutes to get there
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the batch-32 trial never started"
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    storage = f"sqlite:///{out / 'study.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    before = optuna.load_study(study_name=summary.study_name, storage=storage).trials
    finished = [t.number for t in before if t.state == optuna.trial.TrialState.COMPLETE]
    assert finished and any(t.state == optuna.trial.TrialState.RUNNING for t in before)

    r = subprocess.run(cmd, env=dict(env, TCTUNE_TEST_FAST="1"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    by_number = {t["number"]: t for t in report["trials"]}
    for n in finished:
        assert by_number[n]["state"] == "COMPLETE"
        assert by_number[n]["throughput"] == before[n].user_attrs["throughput"]
    interrupted = [t for t in report["trials"] if t["state"] == "FAIL"]
    assert len(interrupted) == 1 and "interrupted" in interrupted[0]["fail_reason"]
    assert report["study"]["n_trials"] > len(before)


OOM_AT_32 = '''
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.fc = torch.nn.Linear(16, 8)
    def forward(self, x):
        if x.shape[0] >= 32 and not torch.compiler.is_compiling():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return self.fc(x)
def build_model():
    return M()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
'''


def test_out_of_memory_is_recorded_and_the_study_goes_on(tmp_path):
    f = tmp_path / "oom.py"
    f.write_text(OOM_AT_32)
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(8, 32, 64), trials=12, quiet=True, export=False,
                     prune=False)
    tuner = Tuner(cfg, load_model_file(f), resolve(None), device=torch.device("cpu"))
    study = tuner.run()
    states = {(t.params["batch_size"], t.params["precision"], t.params["graph_passes"]): t for t in study.trials}
    ok8 = [t for k, t in states.items() if k[0] == 8 and t.state == optuna.trial.TrialState.COMPLETE]
    assert ok8, "batch 8 trials must complete"
    big = [t for t in study.trials if t.params["batch_size"] >= 32]
    assert big and all(t.state != optuna.trial.TrialState.COMPLETE for t in big)
    # The model as written runs out of memory; tctune's graph was captured for the batches the model's
    # `x.shape[0] >= 32` branch allows (1..31), so its candidates there are skipped with that reason.
    eager = [t for t in big if not t.params["graph_passes"]]
    assert eager and all("out of memory" in t.user_attrs["fail_reason"] for t in eager)
    # classified where it failed, not by its text: measured ones are out of memory, the others skipped for it
    kinds = {t.user_attrs["fail_kind"] for t in eager}
    assert "out_of_memory" in kinds and kinds <= {"out_of_memory", "skipped"}
    assert all(("out of memory" in t.user_attrs.get("fail_reason", "")
                or "accepts batch 1..31" in t.user_attrs.get("fail_reason", t.user_attrs.get("skip_reason", "")))
               for t in big if t.params["graph_passes"])


def test_nonfinite_output_is_rejected_with_count():
    out = torch.tensor([1.0, float("inf"), float("nan"), 7.0e4])
    with pytest.raises(CandidateRejected, match=r"fp16 output has 2 NaN/inf values; max finite \|x\| 7e\+04 \(fp16 max is 65504\)"):
        check_accuracy(ErrorStats(0.0, 0.0, 2), "fp16", out)


UNCAPTURABLE = '''
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.fc = torch.nn.Linear(16, 8)
    def forward(self, x):
        if x.sum() > 0:          # data-dependent control flow: torch.export cannot capture this
            return self.fc(x)
        return -self.fc(x)
def build_model():
    return M()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
'''


def test_uncapturable_model_runs_eagerly_with_the_reason(tmp_path):
    f = tmp_path / "dyn.py"
    f.write_text(UNCAPTURABLE)
    r = subprocess.run([sys.executable, "-m", "tctune", "optimize", str(f), "--out", str(tmp_path / "out"),
                        "--batch-sizes", "8", "--trials", "3", "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["capture"]["ok"] is False and "torch.export" in report["capture"]["reason"]
    assert all(not t["params"]["graph_passes"] for t in report["trials"])
    assert report["best"] is not None
    assert "could not be captured" in report["artifacts"]["onnx_error"]
    assert "Graph capture failed" in (tmp_path / "out" / "report.md").read_text()


def test_an_uncapturable_models_first_run_says_its_baselines_covered_the_space_and_why(tmp_path):
    """Capture failed, so the space is the model as written, which the plain baselines of this first run
    measured: the console said "all N candidates ... were already tried ... (widen --batch-sizes or --runtimes)"
    and then "every one of the N candidates ... was tried" (fresh-user finding)."""
    f = tmp_path / "dyn.py"
    f.write_text(UNCAPTURABLE)
    r = subprocess.run([sys.executable, "-m", "tctune", "optimize", str(f), "--out", str(tmp_path / "out"),
                        "--batch-sizes", "8", "--trials", "3"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "were tried by this run's plain baselines" in r.stderr, r.stderr
    assert "graph candidates are off, as the model could not be captured (above)" in r.stderr
    assert "already tried" not in r.stderr and "widen --batch-sizes" not in r.stderr
    assert "every one of the" not in r.stderr  # said once, not twice


def test_unreachable_storage_is_one_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tctune", "optimize", str(Path(__file__).parents[1] / "recipes" / "seed_cnn.py"),
                        "--out", str(tmp_path / "out"), "--storage", "postgresql://nobody@127.0.0.1:1/none", "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "cannot open the study storage" in r.stderr and "Traceback" not in r.stderr


def test_a_corrupt_default_study_file_names_that_file_not_a_storage_url(tmp_path):
    """Without --storage the study is OUT/study.db: a file there that is not a study got the fix for a storage
    URL ("give an Optuna storage URL ... check that the server is reachable"), which the user never gave."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "study.db").write_text("garbage")
    r = subprocess.run([sys.executable, "-m", "tctune", "optimize", str(Path(__file__).parents[1] / "recipes" / "seed_cnn.py"),
                        "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "cannot open the study storage" in r.stderr
    assert f"fix: move or delete {out / 'study.db'} (it is not a study this tctune can open), or give another output folder" in r.stderr, r.stderr
    assert "server is reachable" not in r.stderr


def test_unwritable_output_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = subprocess.run([sys.executable, "-m", "tctune", "optimize", str(Path(__file__).parents[1] / "recipes" / "seed_cnn.py"),
                        "--out", str(blocker / "sub"), "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and f"{blocker} is a file" in r.stderr and "Traceback" not in r.stderr


def test_tune_config_rejects_bad_values():
    with pytest.raises(UsageError, match="trials must be at least 1") as err:
        TuneConfig(out_dir="x", trials=0)
    assert err.value.field == "trials"
    with pytest.raises(UsageError, match="runtimes has unknown warp") as err:
        TuneConfig(out_dir="x", runtimes=("warp",))
    assert err.value.field == "runtimes"


SLOW_AT_32 = '''
import os, time, pathlib, torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.fc = torch.nn.Linear(16, 8)
    def forward(self, x):
        if x.shape[0] == 32 and not pathlib.Path(os.environ["TCTUNE_TEST_MARKER"]).exists():
            pathlib.Path(os.environ["TCTUNE_TEST_MARKER"]).write_text("in trial")
            time.sleep(3)
        return self.fc(x)
def build_model():
    return M()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
'''


def test_ctrl_c_finishes_the_current_trial_then_writes_the_report(tmp_path):
    model = tmp_path / "slow.py"
    model.write_text(SLOW_AT_32)
    out, marker = tmp_path / "out", tmp_path / "marker"
    cmd = [sys.executable, "-m", "tctune", "optimize", str(model), "--out", str(out), "--batch-sizes", "8,32",
           "--trials", "8", "--quiet", "--no-export", "--no-prune"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, TCTUNE_TEST_MARKER=str(marker)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300  # a hang guard: a slow host may take minutes to get there
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err  # interrupted: the conventional status, so scripts can tell
    assert "stopping after the current trial" in err and "Traceback" not in err
    report = json.loads((out / "report.json").read_text())
    states = [t["state"] for t in report["trials"]]
    assert states and all(s == "COMPLETE" for s in states)  # the running trial was finished, not abandoned
    assert len(states) < 8
    assert any(t["params"]["batch_size"] == 32 for t in report["trials"])
    assert report["interrupted"] is True and "interrupted" in report["artifacts"]["onnx_error"]
    if report["best"]:  # the answer so far is recommended: its best_config.json is on disk, like a finished run's
        cfg = json.loads((out / "best_config.json").read_text())
        assert cfg["recommended"]["trial"] == report["best"]["trial"]
        assert report["artifacts"]["best_config"] == str(out / "best_config.json")


RAISES_AT_32 = HANGS_AT_32.replace(
    'pathlib.Path(os.environ["TCTUNE_TEST_MARKER"]).write_text("in trial")\n            time.sleep(120)',
    'raise RuntimeError("I fail at batch 32")')


def test_model_raising_at_one_batch_size_costs_those_trials_only(tmp_path):
    f = tmp_path / "raise32.py"
    f.write_text(RAISES_AT_32)
    assert "I fail at batch 32" in RAISES_AT_32
    r = subprocess.run([sys.executable, "-m", "tctune", "optimize", str(f), "--out", str(tmp_path / "out"),
                        "--batch-sizes", "8,32", "--trials", "8", "--quiet", "--no-export", "--no-prune"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    at32 = [t for t in report["trials"] if t["params"]["batch_size"] == 32]
    assert at32 and all(t["state"] != "COMPLETE" for t in at32)
    assert all("I fail at batch 32" in (t["fail_reason"] or "") or "duplicate" in (t["fail_reason"] or "") for t in at32)
    assert report["best"]["params"]["batch_size"] == 8


def test_interrupted_candidate_is_measured_again_on_resume(tmp_path):
    """A trial cut off by a kill is failed on resume *and* its candidate queued again (the enumerating
    sampler would otherwise count it as visited)."""
    model = tmp_path / "hangs.py"
    model.write_text(HANGS_AT_32)
    out, marker = tmp_path / "out", tmp_path / "marker"
    cmd = [sys.executable, "-m", "tctune", "optimize", str(model), "--out", str(out), "--batch-sizes", "8,32",
           "--trials", "8", "--quiet", "--no-export", "--no-prune"]
    proc = subprocess.Popen(cmd, env=dict(os.environ, TCTUNE_TEST_MARKER=str(marker)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300  # a hang guard: a slow host may take minutes to get there
    while not marker.exists():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = subprocess.run(cmd, env=dict(os.environ, TCTUNE_TEST_MARKER=str(marker), TCTUNE_TEST_FAST="1"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    failed = [t for t in report["trials"] if t["state"] == "FAIL"]
    assert len(failed) == 1
    again = [t for t in report["trials"] if t["params"] == failed[0]["params"] and t["state"] == "COMPLETE"]
    assert again, "the interrupted candidate was never measured again"
