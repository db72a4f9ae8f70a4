"""``--mode train``'s accuracy contract on the CPU: real batches (``calibration_inputs()``, ``--calibration``) join
the gradient check as training batches, and ``score(model)`` gates the candidates after a short training run
against the FP32-trained reference (cached per precision and batch size, recorded like inference's)."""
import json

import numpy as np
import optuna
import pytest
import torch

from tctune.errors import ModelFileError, UsageError
from tctune.hardware import resolve
from tctune.modelfile import load_model_file
from tctune.optimize import optimize
from tctune.search import TuneConfig, Tuner, best_trial
from tctune.search import loop as loop_mod
from tctune.search import train as train_mod
from tctune.search.results import constraint_checks

# A recipe-like classifier: its forward records the batch size and whether gradients are on (the spy on what
# data reaches training); score() is minus the cross-entropy on fixed labelled data (higher is better) and
# records the model it was given; calibration_inputs() gives two real batches of 5 rows (no searched batch
# size is 5, so a forward of 5 rows is a real batch).
TRAIN_FILE = '''
import torch
import torch.nn.functional as F
FORWARDS = []
SCORED = []
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(24, 40)
        self.fc2 = torch.nn.Linear(40, 12)
    def forward(self, x):
        FORWARDS.append((x.shape[0], torch.is_grad_enabled()))
        return self.fc2(F.gelu(self.fc1(x)))
def build_model():
    torch.manual_seed(0)
    return Net()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 24),)
def example_targets(batch_size):
    return torch.randint(0, 12, (batch_size,))
def loss_fn(output, targets):
    return F.cross_entropy(output, targets)
_G = torch.Generator().manual_seed(3)
_X = torch.randn(64, 24, generator=_G)
_Y = torch.randint(0, 12, (64,), generator=_G)
def score(model):
    SCORED.append((isinstance(model, torch.nn.Module), model.training))
    return -float(F.cross_entropy(model(_X), _Y))
'''
REAL = '''
def calibration_inputs():
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(5, 24, generator=g) * 3,), (torch.randn(5, 24, generator=g),)]
'''


def _tuner(tmp_path, text, batch_sizes=(4,), **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    f = tmp_path / "trainable.py"
    f.write_text(text)
    mf = load_model_file(f)
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=batch_sizes, quiet=True, export=False,
                     prune=False, mode="train", **kw)
    return Tuner(cfg, mf, resolve(None), device=torch.device("cpu")), mf


def _g(mf):
    """The model file's module globals (its spies and data)."""
    return mf.build_model.__globals__


def _complete(study):
    return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]


def test_real_batches_are_training_batches_of_the_gradient_check(tmp_path, monkeypatch):
    compared = []
    real_compare = train_mod.compare
    monkeypatch.setattr(train_mod, "compare", lambda a, b: compared.append(a.numel()) or real_compare(a, b))
    monkeypatch.setattr(loop_mod, "CONFIRM_BAND", 10.0)
    t, mf = _tuner(tmp_path, TRAIN_FILE + REAL, trials=2)
    # before any trial: checked once in FP32 eval mode (as in inference), then their FP32 gradients
    assert _g(mf)["FORWARDS"] == [(5, False), (5, False), (5, True), (5, True)]
    _g(mf)["FORWARDS"].clear()
    study = t.run()
    done = _complete(study)
    assert len(done) == 2
    # every candidate's check and the FP32 reference ran both real batches with gradients on
    real_steps = [n for n, grad in _g(mf)["FORWARDS"] if n == 5 and grad]
    assert len(real_steps) >= 2 * (len(done) + 1)
    # one gradient comparison per check batch (the random one and the two real ones) for every evaluation: each
    # trial and each re-measure of the confirmation step (the band is widened so that both are re-measured
    # whatever the host's timing noise; with the default band the count depended on it)
    confirmed = sum(len(r) - 1 for r in study.user_attrs["confirmation"]["runs"].values())
    assert confirmed == len(done)
    assert len(compared) == 3 * (len(done) + confirmed)
    for tr in done:
        assert tr.user_attrs["real_batches"] == 2
    bf16 = [tr for tr in done if tr.params["precision"] == "bf16"]
    assert bf16 and all(0 < tr.user_attrs["max_rel_error"] < 5e-2 for tr in bf16)
    assert all(tr.user_attrs["max_rel_error"] == 0 for tr in done if tr.params["precision"] == "fp32")


def test_a_real_batch_decides_the_gradient_error(tmp_path):
    """The worst batch sets the error: real rows 1000x the random ones make bf16's gradients far worse than on
    the random inputs alone (GELU saturates, the logits' softmax is one-hot), so the real batch is measured."""
    huge = '''
def calibration_inputs():
    return [(torch.randn(5, 24, generator=torch.Generator().manual_seed(1)) * 1000,)]
'''
    errs = {}
    for name, text in (("random", TRAIN_FILE), ("real", TRAIN_FILE + huge)):
        t, _ = _tuner(tmp_path / name, text, trials=1)
        m = t.evaluator.evaluate({"batch_size": 4, "precision": "bf16", "graph_passes": False, "runtime": "eager"})
        errs[name] = m["max_rel_error"]
    assert errs["real"] > errs["random"]


def test_score_is_computed_after_the_short_training_run_and_cached(tmp_path):
    t, mf = _tuner(tmp_path, TRAIN_FILE + REAL, batch_sizes=(4, 8))
    runs = {(bs, p): t.evaluator.evaluate({"batch_size": bs, "precision": p, "graph_passes": False, "runtime": "eager"})
            for bs in (4, 8) for p in ("fp32", "bf16")}
    gates = t.evaluator.score_gate.gates
    assert sorted(gates) == [4, 8]
    for (bs, precision), a in runs.items():
        gate = gates[bs]
        assert a["score_fp32"] == gate.fp32 and a["score_limit"] == pytest.approx(gate.fp32 - 0.01 * abs(gate.fp32))
        if precision == "fp32":  # the FP32 eager candidate is the reference run itself
            assert a["score"] == gate.fp32 and a["train_loss_rel_diff"] == 0.0
        else:
            assert a["score"] != gate.fp32 and a["score_ratio"] == pytest.approx(a["score"] / gate.fp32)
            assert 0 < a["train_loss_rel_diff"] < 5e-2 and a["score_s"] > 0
    # the trained weights differ from the initial ones: the score saw a trained model
    with torch.no_grad():
        init = -float(torch.nn.functional.cross_entropy(mf.model()(_g(mf)["_X"]), _g(mf)["_Y"]))
    assert all(g.fp32 != pytest.approx(init, abs=1e-7) for g in gates.values())
    # a usable nn.Module in eval mode; once per batch size's reference and once per bf16 candidate
    assert _g(mf)["SCORED"] == [(True, False)] * 4
    assert sum(g.calls for g in gates.values()) == 4 and sum(len(g.cache) for g in gates.values()) == 2
    # re-measuring a scored candidate uses the cache
    again = t.evaluator.evaluate({"batch_size": 4, "precision": "bf16", "graph_passes": False, "runtime": "eager"})
    assert again["score"] == runs[4, "bf16"]["score"] and again["score_s"] == 0.0
    assert len(_g(mf)["SCORED"]) == 4


def test_a_candidate_whose_trained_model_scores_low_is_infeasible(tmp_path, monkeypatch):
    real_run = train_mod.TrainingEvaluator._train_run

    def spoiled(self, model, fwd, precision, batches):  # bf16 training that learns the wrong thing
        losses = real_run(self, model, fwd, precision, batches)
        if precision == "bf16":
            with torch.no_grad():
                model.fc2.weight.mul_(-30.0)
        return losses

    monkeypatch.setattr(train_mod.TrainingEvaluator, "_train_run", spoiled)
    t, _ = _tuner(tmp_path, TRAIN_FILE, trials=2)
    study = t.run()
    done = _complete(study)
    bf16 = [tr for tr in done if tr.params["precision"] == "bf16"]
    assert bf16
    for tr in bf16:
        assert tr.user_attrs["max_rel_error"] < 5e-2  # the gradient check alone would accept it
        assert tr.user_attrs["score"] < tr.user_attrs["score_limit"]
        assert tr.user_attrs["fail_kind"] == "accuracy"
        assert "score" in tr.user_attrs["fail_reason"] and "--min-score-ratio 0.99" in tr.user_attrs["fail_reason"]
    assert best_trial(study).params["precision"] == "fp32"


def test_min_score_absolute_rejects_a_candidate_below_it(tmp_path):
    t, _ = _tuner(tmp_path, TRAIN_FILE, min_score=0.0)  # minus a cross-entropy is always below 0
    m = t.evaluator.evaluate({"batch_size": 4, "precision": "bf16", "graph_passes": False, "runtime": "eager"})
    assert m["score_limit"] == 0.0
    (key, over, reason, kind), = [c for c in constraint_checks(m, "bf16", t.cfg) if c[0] in ("min_score", "max_error")]
    assert key == "min_score" and over > 0 and "--min-score 0" in reason and kind.value == "accuracy"


def test_train_report_shows_the_score_gate_and_real_batches(tmp_path):
    f = tmp_path / "trainable.py"
    f.write_text(TRAIN_FILE + REAL)
    optimize(f, TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4,), trials=2, quiet=True, mode="train",
                           export=False, prune=False))
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["score"]["calls"] == 2 and set(report["score"]["fp32_by_batch_size"]) == {"4"}
    assert "FP32-trained reference" in report["score"]["rule"] and report["real_batches"] == 2
    rows = [r for r in report["trials"] if r["state"] == "COMPLETE"]
    assert rows and all(r["score"] is not None and r["score_limit"] is not None for r in rows)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Accuracy rule: the model file's score(model) decides" in md and "FP32-trained reference" in md
    assert "after a short training run" in md and "Score gate" not in md  # the rule is stated once
    assert "training batches of the accuracy check" in md and "example_targets(B)" in md
    assert "gradients of one training step" in md and "FP32 eager on fresh random inputs" not in md
    assert "integer and bool outputs must match" not in md  # a training step's check compares gradients only


def test_bad_calibration_data_in_train_mode_gets_the_inference_error(tmp_path):
    bad_dtype = '''
def calibration_inputs():
    yield (torch.randn(4, 24),)
    yield (torch.randn(4, 24).double(),)
'''
    with pytest.raises(ModelFileError, match=r"calibration_inputs\(\) batch 1 input_0 is float64, expected float32"):
        _tuner(tmp_path / "a", TRAIN_FILE + bad_dtype)
    d = tmp_path / "calib"
    d.mkdir()
    np.savez(d / "bad.npz", input_0=np.random.randn(4, 7).astype(np.float32))
    with pytest.raises(UsageError, match=r"bad\.npz: the FP32 model raised RuntimeError(?s:.*)input_0: float32 \(B, 24\)") as e:
        _tuner(tmp_path / "b", TRAIN_FILE, calibration=str(d))
    assert e.value.field == "calibration"


def test_a_real_batch_the_loss_rejects_names_the_batch(tmp_path):
    """Forward runs, but loss_fn with example_targets(B) raises on it: one error naming the batch, before trials."""
    text = TRAIN_FILE.replace("return F.cross_entropy(output, targets)",
                              "assert output.shape[0] != 5, 'five rows'\n    return F.cross_entropy(output, targets)")
    with pytest.raises(ModelFileError, match=r"trainable\.py: calibration_inputs\(\) batch 0: the FP32 training step "
                                             r"(?s:.*)AssertionError on it: five rows(?s:.*)expected input_0: float32 \(B, 24\)"):
        _tuner(tmp_path, text + REAL)
    d = tmp_path / "calib"
    d.mkdir()
    np.savez(d / "five.npz", input_0=np.random.randn(5, 24).astype(np.float32))
    with pytest.raises(UsageError, match=r"calib/five\.npz: the FP32 training step") as e:
        _tuner(tmp_path / "folder", text, calibration=str(d))
    assert e.value.field == "calibration"


def test_api_takes_a_calibration_folder_with_a_model_file(tmp_path, monkeypatch):
    """``tctune.optimize(path, calibration=DIR)`` is ``--calibration DIR`` (it used to be refused as live-module only)."""
    import sys

    import tctune
    import tctune.tuned as tuned_mod

    opt_mod = sys.modules["tctune.optimize"]  # the submodule (the package attribute is the API function)

    seen = {}
    monkeypatch.setattr(opt_mod, "optimize_model", lambda mf, cfg: seen.setdefault("cfg", cfg))
    monkeypatch.setattr(tuned_mod, "from_search", lambda result, keep_low: result)
    f = tmp_path / "trainable.py"
    f.write_text(TRAIN_FILE)
    cfg = tctune.optimize(f, calibration=tmp_path / "calib", mode="train", out=tmp_path / "out")
    assert cfg.calibration == str(tmp_path / "calib") and cfg.mode == "train"
    with pytest.raises(TypeError, match="score are for a live module"):
        tctune.optimize(f, score=lambda m: 1.0)
