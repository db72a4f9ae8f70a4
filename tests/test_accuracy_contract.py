"""The accuracy contract on the CPU: score(model) gates the search (cached per graph), the score limits, FP8
judged by the score, the per-layer FP8 keep-list, real input batches (folder and calibration_inputs()), and the
report's score fields and gate line."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import optuna
import pytest
import torch

from tctune.calibration import load_calibration, read_folder
from tctune.errors import CandidateRejected, ModelFileError, UsageError
from tctune.fp8_plan import METRIC_SCORE, plan_fp8_keep
from tctune.hardware import resolve
from tctune.measure import ErrorStats
from tctune.modelfile import load_model_file
from tctune.report import accepted_by, gate_line
from tctune.search import TuneConfig, Tuner, best_trial
from tctune.search.accuracy import ScoreGate, worst
from tctune.search.results import constraint_checks
from tctune.trial import FailureKind

ROOT = Path(__file__).resolve().parents[1]

# Logits of 10 classes all within ~1e-3 of 10.0: in bf16 (8 mantissa bits, spacing 0.0625 at 10) they round
# onto one or two values, so the argmax is mostly a tie broken by index, while the relative L2 error of the
# logits stays about 3e-3 (under the 1e-2 limit). score() is the agreement of the argmax with the FP32 model's on
# fixed data: 1.0 for FP32, far lower for bf16.
NEAR_TIED = '''
import torch
CALLS = []
def build_model():
    torch.manual_seed(0)
    m = torch.nn.Linear(16, 10)
    with torch.no_grad():
        m.weight.mul_(1e-3)
        m.bias.fill_(10.0)
    return m.eval()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
_X = torch.randn(256, 16, generator=torch.Generator().manual_seed(7))
with torch.no_grad():
    _LABELS = build_model()(_X).argmax(-1)
def score(model):
    CALLS.append(type(model).__name__)
    with torch.inference_mode():
        return float((model(_X).float().argmax(-1) == _LABELS).float().mean())
'''


def _write(tmp_path, name, text):
    f = tmp_path / f"{name}.py"
    f.write_text(text)
    return f


def test_near_tied_logits_do_not_win_at_bf16_and_score_is_cached_per_graph(tmp_path):
    f = _write(tmp_path, "near_tied", NEAR_TIED)
    mf = load_model_file(f)
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(8, 16), trials=8, quiet=True, export=False,
                     prune=False)
    t = Tuner(cfg, mf, resolve(None), device=torch.device("cpu"))
    study = t.run()
    done = [tr for tr in study.trials if tr.state == optuna.trial.TrialState.COMPLETE]
    low = [tr for tr in done if tr.params["precision"] == "bf16"]
    assert low, "bf16 candidates must be measured"
    for tr in low:
        # the relative-L2 gate alone would have accepted them ...
        assert tr.user_attrs["max_rel_error"] < 1e-2
        # ... the score gate rejects them
        assert tr.user_attrs["score_ratio"] < 0.9
        assert "score" in tr.user_attrs["fail_reason"] and tr.user_attrs["fail_kind"] == "accuracy"
    assert best_trial(study).params["precision"] == "fp32"
    for tr in done:
        assert tr.user_attrs["score_fp32"] == 1.0 and tr.user_attrs["score_limit"] == pytest.approx(0.99)
    # one call for the FP32 reference, then one per built graph whatever the batch size or re-measure:
    # fp32 graph, bf16 graph, bf16 autocast, the model cast to bf16 as a whole (its own graph, not autocast's;
    # the FP32 model as written is the reference itself)
    graphs = ({(tr.params["precision"], tr.params["graph_passes"], bool(tr.user_attrs.get("model_cast")))
               for tr in done} - {("fp32", False, False)})
    calls = mf.score.__globals__["CALLS"]
    assert len(calls) == 1 + len(graphs) == t.evaluator.score_gate.calls
    assert len(done) > len(calls)  # several trials per graph: the cache answered the rest
    assert sum(tr.user_attrs["score_s"] > 0 for tr in done) == len(graphs)


def test_score_limits_ratio_absolute_and_negative_scores():
    gate = ScoreGate(lambda m: 0.0)
    gate.fp32 = 0.8
    assert gate.limit == pytest.approx(0.792) and gate.allowed_shortfall == pytest.approx(0.01)
    gate.fp32 = -2.0  # a negative score (e.g. minus a loss): the limit is below it, not above
    assert gate.limit == pytest.approx(-2.02)
    assert ScoreGate(lambda m: 0.0, min_score=0.5).limit == 0.5

    cfg = TuneConfig(out_dir="x")
    row = {"max_rel_error": 3e-2, "latency_p99_ms": 1.0, "peak_memory_mib": None, "score": 0.95,
           "score_limit": 0.96, "score_fp32": 0.97}
    (key, value, reason, kind), = constraint_checks(row, "bf16", cfg)
    assert key == "min_score" and value == pytest.approx(0.01) and "score 0.95 < 0.96" in reason
    assert kind.value == "accuracy"
    row["score"] = 0.961
    (key, value, reason, _), = constraint_checks(row, "bf16", cfg)
    assert value <= 0 and reason is None  # rel. L2 3e-2 is over max_error 1e-2 but does not decide
    cfg_abs = TuneConfig(out_dir="x", min_score=0.9)
    row.update(score=0.85, score_limit=0.9)
    assert "--min-score 0.9" in constraint_checks(row, "bf16", cfg_abs)[0][2]
    for bad in ({"min_score_ratio": 0.0}, {"min_score_ratio": 1.5}, {"min_score": math.inf},
                {"max_mismatch_rate": 2.0}):
        with pytest.raises(UsageError) as e:
            TuneConfig(out_dir="x", **bad)
        assert e.value.field == next(iter(bad))
    with pytest.raises(UsageError, match="both given") as e:  # the absolute limit would silently win
        TuneConfig(out_dir="x", min_score=0.9, min_score_ratio=0.95)
    assert e.value.field == "min_score" and "fix: give one of them" in str(e.value)
    assert TuneConfig(out_dir="x", min_score=0.9).min_score == 0.9  # with the ratio at its default: fine



@pytest.mark.parametrize("returned, accepted", [
    (0.5, 0.5), (3, 3.0), (np.float32(0.25), 0.25), (torch.tensor(0.75), 0.75), (torch.tensor([0.5]), 0.5),
    (None, "returned None"), (True, "returned True"), ("0.9", "returned the str '0.9'"),
    (torch.ones(3), "tensor of shape (3,)"), ([0.5], "returned a list"),
])
def test_score_must_return_one_number(returned, accepted):
    # A number or a one-element tensor is the score; anything else (a score() without return, a formatted
    # string, a per-class tensor) is one error saying what it returned, not "score raised" and not a silent cast.
    model = torch.nn.Linear(2, 2)
    gate = ScoreGate(lambda m: returned, where="m.py")
    if not isinstance(accepted, str):
        assert gate.reference(model) == pytest.approx(accepted)
        assert gate.score("g", model, "bf16")[0] == pytest.approx(accepted)
        return
    with pytest.raises(ModelFileError) as e:
        gate.reference(model)
    msg = str(e.value)
    assert msg.startswith("m.py: score(model) ") and accepted in msg and "must be one number for the FP32 model" in msg
    assert "raised" not in msg and "fix: return one number" in msg
    with pytest.raises(CandidateRejected, match="must be one number for the bf16 candidate") as e:
        ScoreGate(lambda m: returned).score("g", model, "bf16")
    assert e.value.kind == FailureKind.RUNTIME_ERROR


def test_fp8_is_judged_by_the_score_where_relative_l2_rejects():
    cfg = TuneConfig(out_dir="x")
    fp8 = {"max_rel_error": 7e-2, "latency_p99_ms": None, "peak_memory_mib": None}  # over max_error_fp8 5e-2
    (key, value, reason, _), = constraint_checks(fp8, "fp8", cfg)
    assert key == "max_error" and value > 0 and "--max-error-fp8" in reason
    scored = dict(fp8, score=0.970, score_limit=0.9625, score_fp32=0.9722)
    (key, value, reason, _), = constraint_checks(scored, "fp8", cfg)
    assert key == "min_score" and value < 0 and reason is None
    line = gate_line({"params": {"precision": "fp8"}, **scored}, cfg.to_dict())
    assert line.startswith("accepted by the score gate: 0.9700 >= 0.99 x 0.9722 (FP32 score) (margin 0.0075)")
    assert "relative L2 7.0e-02 (limit 0.05, not deciding because a score is given)" in line
    a = accepted_by({"params": {"precision": "bf16"}, "max_rel_error": 2e-3, "float_outputs": 1}, cfg.to_dict())
    assert a == {"gate": "relative_l2", "value": 2e-3, "limit": 1e-2, "margin": pytest.approx(8e-3)}


def test_fp8_planner_uses_the_score_shortfall_and_releases_single_layers():
    roles = {"l.*.a": 2.0, "l.*.b": 2.0}
    layers = {"l.0.a": 1.0, "l.1.a": 1.0, "l.0.b": 1.0, "l.1.b": 1.0}
    calls = []

    def shortfall(keep):  # only layer 1's "a" linear costs score in FP8
        calls.append(keep)
        fp8 = [p for p in layers if not any(p == k or __import__("fnmatch").fnmatchcase(p, k) for k in keep)]
        return 0.02 if "l.1.a" in fp8 else 0.001

    plan = plan_fp8_keep(roles, shortfall, 0.01, layers=layers, metric=METRIC_SCORE)
    assert plan.keep == ("l.1.a",) and plan.fp8_flop_share == pytest.approx(0.75)
    assert plan.usable and plan.error <= plan.target and plan.metric == METRIC_SCORE
    assert any(s.get("release_layer") == "l.0.a" for s in plan.steps)
    assert "score shortfall" in plan.summary()
    # without layers the role-level plan keeps the whole role (half the FLOPs)
    whole = plan_fp8_keep(roles, shortfall, 0.01, metric=METRIC_SCORE)
    assert whole.keep == ("l.*.a",) and whole.fp8_flop_share == pytest.approx(0.5)


def test_evaluator_plans_fp8_on_the_allowed_score_shortfall(tmp_path, monkeypatch):
    f = _write(tmp_path, "near_tied", NEAR_TIED)
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4,), quiet=True, export=False, min_score_ratio=0.95)
    t = Tuner(cfg, load_model_file(f), resolve("h200"), device=torch.device("cpu"))
    seen = {}

    def fake_plan_graph(build, inputs, ref, max_error, **kw):
        seen.update(max_error=max_error, **kw)
        shortfall = kw["score_of"]((), t.model)  # the FP32 model under "fp8": no shortfall
        return plan_fp8_keep({"fc": 1.0}, lambda keep: shortfall, max_error, metric=METRIC_SCORE)

    monkeypatch.setattr("tctune.search.evaluate.plan_graph", fake_plan_graph)
    assert t.evaluator.fp8_keep("autocast", 4) == ()
    assert seen["max_error"] == pytest.approx(0.05) and t.fp8_plans["autocast"].metric == METRIC_SCORE
    assert t.evaluator.score_gate.calls == 2  # the FP32 reference, then the one FP8 graph (cached for its trial)


# ---------------------------------------------------------------------------------------------- real data
TWO_INPUTS = '''
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)
    def forward(self, x, ids):
        return self.fc(x) + ids.float().unsqueeze(-1)
def build_model():
    torch.manual_seed(0)
    return M().eval()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 6), torch.randint(0, 5, (batch_size,)))
'''


def _two_inputs(tmp_path):
    mf = load_model_file(_write(tmp_path, "two", TWO_INPUTS))
    return mf, mf.model()


def test_calibration_folder_reads_npz_and_safetensors_in_sorted_order(tmp_path):
    from safetensors.torch import save_file

    mf, model = _two_inputs(tmp_path)
    d = tmp_path / "calib"
    d.mkdir()
    a = (torch.randn(5, 6), torch.randint(0, 5, (5,)))
    b = (torch.randn(3, 6), torch.randint(0, 5, (3,)))
    np.savez(d / "b.npz", x=b[0].numpy(), ids=b[1].numpy())  # forward's argument names
    save_file({"input_0": a[0], "input_1": a[1]}, str(d / "a.safetensors"))
    (d / "notes.txt").write_text("ignored")
    batches = load_calibration(mf, d, model, torch.device("cpu"))
    assert [x.source for x in batches] == ["a.safetensors", "b.npz"]
    for got, want in zip(batches, (a, b)):
        assert all(torch.equal(g, w) for g, w in zip(got.inputs, want))
        assert torch.equal(got.reference, model(*want))


@pytest.mark.parametrize("case,match", [
    ("dtype", r"bad\.npz: input_1 is float32, expected int64"),
    ("rank", r"bad\.npz: input_0 has shape \(4, 6, 1\) \(rank 3\), expected rank 2"),
    ("keys", r"bad\.npz: has keys a, b; expected exactly input_0, input_1 or x, ids"),
    ("fails", r"bad\.npz: the FP32 model raised RuntimeError"),
    ("pickle", r"bad\.npz: cannot be read"),
])
def test_bad_calibration_data_gets_one_error_naming_the_file_and_the_expected_inputs(tmp_path, case, match):
    mf, model = _two_inputs(tmp_path)
    d = tmp_path / "calib"
    d.mkdir()
    x, ids = np.random.randn(4, 6).astype(np.float32), np.arange(4, dtype=np.int64)
    data = {"dtype": {"input_0": x, "input_1": ids.astype(np.float32)},
            "rank": {"input_0": x[..., None], "input_1": ids},
            "keys": {"a": x, "b": ids},
            "fails": {"input_0": np.random.randn(4, 7).astype(np.float32), "input_1": ids},
            "pickle": {"input_0": np.array([{"a": 1}], dtype=object), "input_1": ids}}[case]
    np.savez(d / "bad.npz", **data)
    with pytest.raises(UsageError, match=match) as e:
        load_calibration(mf, d, model, torch.device("cpu"))
    assert e.value.field == "calibration"
    if case != "pickle":
        assert "input_0: float32 (B, 6), input_1: int64 (B)" in str(e.value)
    assert str(e.value).count("\n  fix: ") == 1  # one fix line, as every other input error has


def test_missing_or_empty_calibration_folder(tmp_path):
    mf, model = _two_inputs(tmp_path)
    ex = mf.inputs(2)
    with pytest.raises(UsageError, match="not a folder"):
        read_folder(tmp_path / "nope", ex)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="holds no .safetensors or .npz file"):
        read_folder(tmp_path / "empty", ex)


def test_calibration_inputs_function_errors_name_the_batch(tmp_path):
    f = _write(tmp_path, "ci", TWO_INPUTS + '''
def calibration_inputs():
    yield (torch.randn(4, 6), torch.randint(0, 5, (4,)))
    yield (torch.randn(4, 6).double(), torch.randint(0, 5, (4,)))
''')
    mf = load_model_file(f)
    with pytest.raises(ModelFileError, match=r"ci\.py: calibration_inputs\(\) batch 1 input_0 is float64, expected float32") as e:
        load_calibration(mf, None, mf.model(), torch.device("cpu"))
    assert "\n  fix: store input_0 as float32" in str(e.value)


# A model whose first linear reaches 10 * sum(x): under 80 on example_inputs (uniform [0, 1)), about 80,000 on
# its real data (x = 1000), over fp16's 65504.
OVERFLOW = '''
import torch
def build_model():
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        m[0].weight.fill_(10.0); m[0].bias.zero_()
        m[2].weight.fill_(1e-4); m[2].bias.zero_()
    return m.eval()
def example_inputs(batch_size):
    return (torch.rand(batch_size, 8),)
'''
REAL = '''
def calibration_inputs():
    return [(torch.full((4, 8), 1000.0),)]
'''


@pytest.mark.parametrize("real", [False, True])
def test_real_batches_drive_the_fp16_overflow_calibration(tmp_path, real):
    f = _write(tmp_path, "overflow", OVERFLOW + (REAL if real else ""))
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4,), quiet=True, export=False)
    t = Tuner(cfg, load_model_file(f), resolve("h100"), device=torch.device("cpu"))
    cand = t.build({"batch_size": 4, "precision": "fp16", "graph_passes": True, "runtime": "eager"})
    cast = next(r for r in cand.passes if r.name == "cast_precision")
    kept = [s for s in cast.skipped if s.reason.startswith("overflow:")]
    assert bool(kept) == real  # random data alone never overflows: the keep-list comes from the real batch
    with torch.inference_mode():
        out = cand.module(torch.full((4, 8), 1000.0))
    assert torch.isfinite(out).all() == real


def test_real_batches_are_compared_beside_the_random_ones():
    a = ErrorStats(max_abs_error=0.1, rel_l2_error=1e-3, nonfinite=0, float_outputs=1, logits_outputs=1,
                   top1_agreement=1.0, kl_divergence=1e-4)
    b = ErrorStats(max_abs_error=0.01, rel_l2_error=2e-2, nonfinite=1, float_outputs=1, exact_outputs=1,
                   mismatch_rate=0.25, mismatched=2, logits_outputs=1, top1_agreement=0.5, kl_divergence=None)
    w = worst(a, b)
    assert (w.max_abs_error, w.rel_l2_error, w.nonfinite, w.mismatch_rate, w.mismatched) == (0.1, 2e-2, 1, 0.25, 2)
    assert (w.top1_agreement, w.kl_divergence) == (0.5, 1e-4)


# ---------------------------------------------------------------------------------------------- end to end
def test_optimize_digits_cnn_reports_score_fields(tmp_path):
    pytest.importorskip("sklearn", reason="scikit-learn is needed for the digits data")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "tctune", "optimize", str(ROOT / "recipes" / "digits_cnn.py"), "--out",
                        str(out), "--batch-sizes", "32", "--trials", "2", "--no-export", "--quiet", "--no-prune",
                        "--min-score-ratio", "0.98"],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["min_score_ratio"] == 0.98
    s = report["score"]
    assert 0.9 < s["fp32"] <= 1 and s["limit"] == pytest.approx(0.98 * s["fp32"]) and s["calls"] >= 1
    assert report["real_batches"] == 4 and report["real_batches_source"] == "calibration_inputs()"
    done = [t for t in report["trials"] if t["state"] == "COMPLETE"]
    assert done and all(t["score"] is not None and t["score_ratio"] is not None for t in done)
    assert report["best"]["accepted_by"]["gate"] == "score"
    md = (out / "report.md").read_text()
    assert "accepted by the score gate" in md and "score (× FP32)" in md
    assert "accepted by the score gate" in r.stdout


@pytest.mark.parametrize("args,match", [
    (["--min-score-ratio", "1.5"], "--min-score-ratio must be in (0, 1]"),
    (["--max-mismatch-rate", "-1"], "--max-mismatch-rate must be a fraction in [0, 1]"),
    (["--calibration", "no_such_folder"], "--calibration no_such_folder: not a folder"),
    (["--min-score", "0.5", "--min-score-ratio", "0.9"], "--min-score and --min-score-ratio are both given"),
])
def test_cli_flags_reach_the_config_and_name_themselves_in_errors(tmp_path, args, match):
    f = _write(tmp_path, "two", TWO_INPUTS)
    r = subprocess.run([sys.executable, "-m", "tctune", "optimize", str(f), "--out", str(tmp_path / "out"), "--quiet",
                        "--no-export", "--batch-sizes", "4", "--trials", "1", *args],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_export_rebuild_calibrates_fp16_on_the_same_real_batches(tmp_path):
    from tctune.engines import rebuild_graphs

    f = _write(tmp_path, "overflow", OVERFLOW + REAL)
    cfg = {"params": {"batch_size": 4, "precision": "fp16", "graph_passes": True, "runtime": "eager"},
           "calibration": True}
    _, graphs = rebuild_graphs(load_model_file(f), cfg, resolve("h100"), torch.device("cpu"))
    with torch.inference_mode():
        assert torch.isfinite(graphs.graph(torch.full((4, 8), 1000.0))).all()


def test_a_score_that_calls_the_model_by_keyword_scores_every_wrapper():
    # Hugging Face users call a model by keyword (model(input_ids=..., attention_mask=...)). The autocast baseline
    # and a channels-last candidate hand score() a wrapper: it takes keywords as the model does, and runs them
    # under autocast / in channels-last as it does positional inputs.
    from tctune.runtime import Autocast, ChannelsLast

    class KwModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)

        def forward(self, pixels, scale):
            self.seen = (torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None,
                         pixels.is_contiguous(memory_format=torch.channels_last))
            return self.conv(pixels).abs().mean((1, 2, 3)) * scale

    torch.manual_seed(0)
    model = KwModel().eval()
    x, s = torch.randn(2, 3, 8, 8), torch.rand(2) + 0.5

    def score(m):
        return float(m(pixels=x, scale=s).float().sum())

    gate = ScoreGate(score)
    ref = gate.reference(model)
    assert model.seen == (None, False)
    low, _ = gate.score("autocast", Autocast(model, torch.bfloat16, "cpu"), "bf16")
    assert model.seen == (torch.bfloat16, False) and low == pytest.approx(ref, rel=5e-2) and low != ref
    nhwc, _ = gate.score("channels_last", ChannelsLast(model), "fp32")
    assert model.seen == (None, True) and nhwc == pytest.approx(ref, rel=1e-5)
