"""Several tctune processes on one Optuna study (--storage): nothing lost, nothing measured twice."""
import json
import os
import subprocess
import sys

import optuna
import pytest

import dataclasses

from tctune.cli import parse_devices, parser
from tctune.cli.optimize import config_from_args
from tctune.errors import UsageError
from tctune.optimize import check_devices, worker_command, worker_config
from tctune.search import TuneConfig

TINY = '''
import torch
def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 12))
def example_inputs(batch_size):
    return (torch.randn(batch_size, 24),)
'''

PG_URL = os.environ.get("TCTUNE_TEST_POSTGRES_URL")
REQUIRED = os.environ.get("TCTUNE_REQUIRE_POSTGRES") == "1"  # set by .ci/run, which starts the server


def test_postgres_is_available_where_required():
    if REQUIRED:
        assert PG_URL, ".ci/run must start PostgreSQL and set TCTUNE_TEST_POSTGRES_URL"


@pytest.mark.skipif(not PG_URL, reason="no PostgreSQL server: set TCTUNE_TEST_POSTGRES_URL (.ci/run starts one)")
def test_two_workers_share_one_postgres_study(tmp_path):
    model = tmp_path / f"tiny_shared_{os.getpid()}.py"
    model.write_text(TINY)
    url = _fresh_database(PG_URL, f"tctune_test_{os.getpid()}")  # empty: the workers race to create the tables
    procs = []
    for seed in (0, 1):
        cmd = [sys.executable, "-m", "tctune", "optimize", str(model), "--storage", url, "--out", str(tmp_path / f"w{seed}"),
               "--batch-sizes", "4,16", "--trials", "4", "--seed", str(seed), "--quiet", "--no-export"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    report = json.loads((tmp_path / "w0" / "report.json").read_text())
    study = optuna.load_study(study_name=report["study"]["name"], storage=url)
    from tctune.search.baselines import candidate_params

    trials = study.trials
    # the plain baselines (6 per run here: 3 per batch size) are enqueued once by whichever process opened the
    # study first, and run besides --trials; a twin enqueued in a race is skipped as a duplicate. The space has
    # 8 candidates (2 batch sizes x fp32/bf16 x graph or model); the baselines measure the 4 model-as-written
    # ones, so the two workers between them must measure the other 4: none lost, whoever ran it
    measured = {json.dumps(candidate_params(t.params, t.user_attrs), sort_keys=True) for t in trials
                if not t.user_attrs.get("baseline") and (t.state == optuna.trial.TrialState.COMPLETE or
                                                         t.user_attrs.get("fail_reason", "").startswith("stopped early"))}
    assert len(measured) == 4
    assert len({(t.user_attrs["baseline"], t.params["batch_size"]) for t in trials if t.user_attrs.get("baseline")}) == 6
    complete = [json.dumps(candidate_params(t.params, t.user_attrs), sort_keys=True) for t in trials
                if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == len(set(complete))  # nothing measured twice
    assert len(complete) >= 4
    for t in trials:
        assert t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        if t.state == optuna.trial.TrialState.PRUNED:  # skipped as another worker's twin, or stopped early
            reason = t.user_attrs["fail_reason"]
            assert "duplicate" in reason or reason.startswith("stopped early"), reason
    optuna.delete_study(study_name=study.study_name, storage=url)


def _fresh_database(server_url: str, name: str) -> str:
    """Create an empty database ``name`` on the server (dropping an old one) and return its URL."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sqlalchemy.text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return server_url.rsplit("/", 1)[0] + "/" + name


def test_worker_config_round_trips_through_the_cli_as_json():
    """A worker receives the TuneConfig itself (JSON), not an argv rebuilt option by option."""
    cfg = TuneConfig(out_dir="o", batch_sizes=(8, 32), trials=5, max_error=0.02, target="h100", seed=3,
                     objective="pareto", max_latency_ms=4.5, runtimes=("eager", "inductor"), compile_budget_s=60.0,
                     fp8_keep=("*.down",), devices=(0, 1), prune=False)
    sent = worker_config(cfg, "sqlite:///x.db", 2)
    cmd = worker_command("m.py", sent)
    args = parser().parse_args(cmd[cmd.index("optimize"):])
    got = config_from_args(args)
    assert got == sent
    assert got.worker and got.storage == "sqlite:///x.db" and got.seed == 5 and got.devices is None
    assert not got.export and got.quiet
    assert dataclasses.replace(got, storage=None, worker=False, seed=3, devices=(0, 1), export=True,
                               quiet=False) == cfg


def test_devices_need_cuda_here():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UsageError, match="devices needs CUDA") as err:
        check_devices(TuneConfig(out_dir="o", devices=(0, 1)))
    assert err.value.field == "devices"
    with pytest.raises(UsageError):
        parse_devices("0,x")
