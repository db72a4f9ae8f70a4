"""The trained recipes (digits CNN, counting-task BERT) and benchmarks/trained.py, on the CPU.

Trained weights go to a temporary cache folder (``TCTUNE_CACHE_DIR``) shared by this file's tests, so each
model trains at most once here.
"""
import copy
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn", reason="scikit-learn is needed for the digits data: pip install 'tctune[test]'")

from tctune.errors import ModelFileError  # noqa: E402
from tctune.modelfile import load_model_file  # noqa: E402
from zoo import load_benchmark  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tctune_cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("TCTUNE_CACHE_DIR", str(path))
    yield path
    mp.undo()


def _load(name):
    spec = importlib.util.spec_from_file_location(f"test_trained_{name}", RECIPES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def digits():
    return _load("digits_cnn")


@pytest.fixture(scope="module")
def seq():
    return _load("seq_encoder")


@pytest.fixture(scope="module")
def digits_model(digits, cache_dir):
    return digits.build_model()


# ------------------------------------------------------------------------------------------------ digits CNN


def test_digits_split_is_fixed_and_disjoint(digits):
    x_tr, y_tr, x_te, y_te = digits.load_data()
    assert x_tr.shape == (1797 - digits.TEST_SIZE, 1, 8, 8) and x_te.shape == (digits.TEST_SIZE, 1, 8, 8)
    assert x_tr.dtype == torch.float32 and y_tr.dtype == torch.int64
    assert 0 <= float(x_tr.min()) and float(x_tr.max()) <= 1
    again = digits.load_data()
    assert torch.equal(again[0], x_tr) and torch.equal(again[3], y_te)
    assert set(y_te.tolist()) == set(range(10))  # every class in the test set
    # no test image is also a training image (the digits data has no exact duplicates across this split)
    flat_tr = {tuple(r.tolist()) for r in x_tr.flatten(1)}
    assert sum(tuple(r.tolist()) in flat_tr for r in x_te.flatten(1)) == 0


def test_digits_trains_above_90_percent_and_caches(digits, digits_model, cache_dir):
    acc = digits.score(digits_model)
    assert 0.9 < acc <= 1.0
    path = digits.cache_path()
    assert path.parent == cache_dir and path.suffix == ".safetensors" and path.is_file()
    mtime = path.stat().st_mtime_ns
    again = digits.build_model()  # loaded, not retrained
    assert path.stat().st_mtime_ns == mtime
    for (k, a), (_, b) in zip(digits_model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    assert not again.training


def test_digits_cache_key_follows_the_training_settings(digits, monkeypatch):
    before = digits.cache_path()
    monkeypatch.setitem(digits.TRAIN, "epochs", digits.TRAIN["epochs"] + 1)
    assert digits.cache_path() != before


def test_digits_unwritable_cache_warns_and_still_builds(digits, tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("TCTUNE_CACHE_DIR", str(blocker))
    monkeypatch.setitem(digits.TRAIN, "epochs", 1)
    with pytest.warns(UserWarning, match="cannot cache the trained weights.*TCTUNE_CACHE_DIR"):
        model = digits.build_model()
    assert isinstance(model, digits.DigitsCNN) and not model.training
    assert list(tmp_path.iterdir()) == [blocker]  # no temporary file left behind


def test_digits_training_is_deterministic(digits):
    a = digits.train({"epochs": 1}).state_dict()
    b = digits.train({"epochs": 1}).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_digits_untrained_model_scores_near_chance(digits):
    torch.manual_seed(0)
    assert digits.score(digits.DigitsCNN().eval()) < 0.3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_digits_score_of_a_low_precision_copy(digits, digits_model, dtype):
    low = copy.deepcopy(digits_model).to(dtype)
    logits = digits.predict(low, digits.load_data()[2][:5])
    assert logits.dtype == torch.float32 and logits.shape == (5, 10)
    acc = digits.score(low)
    assert isinstance(acc, float) and abs(acc - digits.score(digits_model)) <= 0.02


def test_digits_score_of_a_module_without_parameters(digits, digits_model):
    class Wrapper(torch.nn.Module):  # no parameter or buffer: score feeds the CPU here (no GPU)
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x)

    assert digits.score(Wrapper(lambda x: digits_model(x))) == digits.score(digits_model)


def test_digits_calibration_inputs_are_real_training_batches(digits, digits_model):
    batches = list(digits.calibration_inputs())
    assert len(batches) == digits.CALIBRATION_BATCHES
    x_train = digits.load_data()[0]
    for i, batch in enumerate(batches):
        assert isinstance(batch, tuple) and len(batch) == 1
        (x,) = batch
        assert x.shape == (64, 1, 8, 8) and x.dtype == torch.float32
        assert torch.equal(x, x_train[i * 64:(i + 1) * 64])
        assert torch.isfinite(digits_model(x)).all()


def test_digits_model_file_keeps_the_contract(cache_dir):
    mf = load_model_file(RECIPES / "digits_cnn.py")
    assert mf.score is not None and mf.loss_fn is not None
    (x,) = mf.inputs(3)
    assert x.shape == (3, 1, 8, 8) and x.dtype == torch.float32 and x.std() > 0
    model = mf.model()
    out = model(x)
    assert out.shape == (3, 10)
    assert mf.loss_fn(out, mf.example_targets(3)).dim() == 0
    assert mf.score(model) > 0.9


# ------------------------------------------------------------------------------------------------ seq encoder


def test_seq_batches_are_deterministic_balanced_and_labelled_by_the_counts(seq):
    s = seq.SIZES["tiny"]
    ids, labels = seq.make_batch(256, torch.Generator().manual_seed(7), "tiny")
    ids2, labels2 = seq.make_batch(256, torch.Generator().manual_seed(7), "tiny")
    ids3, _ = seq.make_batch(256, torch.Generator().manual_seed(8), "tiny")
    assert torch.equal(ids, ids2) and torch.equal(labels, labels2) and not torch.equal(ids, ids3)
    assert ids.shape == (256, s["seq_len"]) and ids.dtype == torch.int64 and labels.dtype == torch.int64
    assert int(labels.sum()) == 128  # exactly balanced
    assert (ids[:, 0] == seq.CLS).all() and (ids[:, 1:] != seq.CLS).all() and (ids != seq.PAD).all()
    n_a, n_b = (ids == seq.A).sum(1), (ids == seq.B).sum(1)
    assert torch.equal((n_a > n_b).long(), labels) and (n_a != n_b).all()
    diff = (n_a - n_b).abs()
    assert int(diff.min()) == 1 and int(diff.max()) <= s["max_diff"]
    lo, hi = s["count_range"]
    assert int(n_b.min()) >= lo and int(n_b.max()) <= hi
    # counting A alone does not decide it: both labels occur at the same A count
    both = [c for c in n_a.unique().tolist() if labels[n_a == c].unique().numel() == 2]
    assert both
    # positions are shuffled: A does not sit in a fixed prefix
    assert (ids[:, -5:] == seq.A).any()


def test_seq_bad_settings_name_the_constraint(seq):
    bad = dict(seq.SIZES["tiny"], count_range=(4, 20))
    with pytest.raises(ValueError, match="does not fit seq_len"):
        seq.make_batch(4, torch.Generator().manual_seed(0), bad)


def test_seq_brief_training_beats_chance_clearly(seq):
    ids, labels = seq.test_set("tiny")
    ids, labels = ids[:512], labels[:512]
    untrained = seq.accuracy(seq.make_model("tiny").eval(), ids, labels)
    assert 0.35 < untrained < 0.65
    trained = seq.accuracy(seq.train("tiny", steps=60), ids, labels)
    assert trained > 0.8


def test_seq_model_file_keeps_the_contract(monkeypatch, cache_dir):
    monkeypatch.setenv("TCTUNE_SEQ_ENCODER_SIZE", "tiny")
    mf = load_model_file(RECIPES / "seq_encoder.py")
    mod = sys.modules[f"tctune_model_{mf.name}"]
    assert mod.SIZE == "tiny" and mf.score is not None
    a, b = mf.inputs(4), mf.inputs(4)
    assert a[0].shape == (4, 32) and a[0].dtype == torch.int64 and not torch.equal(a[0], b[0])  # fresh each call
    batches = list(mod.calibration_inputs())
    assert len(batches) == mod.CALIBRATION_BATCHES
    assert all(len(t) == 1 and t[0].shape == (64, 32) and t[0].dtype == torch.int64 for t in batches)
    assert torch.equal(batches[0][0], next(iter(mod.calibration_inputs()))[0])  # the same real batches each time
    model = mf.model()  # trains the tiny size (about 10-30 s on one core) and caches it
    assert mod.cache_path().is_file() and mod.cache_path().name.startswith("seq_encoder-tiny-")
    assert model(a[0]).shape == (4, 2)
    assert mf.score(model) > 0.9
    assert mf.score(copy.deepcopy(model).to(torch.bfloat16)) > 0.9


def test_seq_unknown_size_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("TCTUNE_SEQ_ENCODER_SIZE", "huge")
    with pytest.raises(ModelFileError, match="TCTUNE_SEQ_ENCODER_SIZE='huge'.*base, tiny"):
        load_model_file(RECIPES / "seq_encoder.py")


# ------------------------------------------------------------------------------------------------ benchmark


def _bench():
    return load_benchmark("trained")


@pytest.mark.parametrize("rel_l2, score, precision, expect", [
    (5e-3, 0.98, "bf16", "both"),
    (2e-2, 0.98, "bf16", "score only"),    # over the 1e-2 L2 limit, score kept
    (2e-2, 0.98, "fp8", "both"),           # FP8's limit is 5e-2
    (5e-3, 0.90, "bf16", "L2 only"),       # logits close, task score lost
    (7e-2, 0.90, "fp8", "neither"),
])
def test_gates(rel_l2, score, precision, expect):
    bench = _bench()
    row = {"precision": precision, "score": score, "rel_l2": rel_l2, "nonfinite": 0, "throughput": 200.0}
    bench.gates(row, 0.98, 100.0)
    assert row["accepted_by"] == expect
    assert row["speedup"] == 2.0 and math.isclose(row["score_ratio"], score / 0.98)


def test_gates_reject_nonfinite_outputs_and_failed_rows():
    bench = _bench()
    row = {"precision": "fp16", "score": 0.98, "rel_l2": 0.0, "nonfinite": 3}
    bench.gates(row, 0.98, None)
    assert row["accepted_by"] == "score only" and not row["l2_gate"]
    failed = {"precision": "fp8", "error": "RuntimeError: boom"}
    bench.gates(failed, 0.98, None)
    assert failed["accepted_by"] == "neither"


@pytest.mark.slow
def test_trained_benchmark_tiny_dry_run(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("TCTUNE_SEQ_ENCODER_SIZE", "tiny")
    bench = _bench()
    assert bench.main(["--tiny", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "trained.json").read_text())
    assert [m["model"] for m in result["models"]] == ["digits_cnn", "seq_encoder"]
    for m in result["models"]:
        rows = {r["variant"]: r for r in m["rows"]}
        ref = rows["FP32 eager"]
        assert ref["rel_l2"] == 0 and ref["score_ratio"] == 1 and ref["accepted_by"] == "both"
        assert m["fp32_score"] > 0.9
        assert {"model.to(bf16)", "autocast fp16", "tctune bf16 pure", "tctune fp16 autocast"} <= set(rows)
        fp8 = [r for r in m["rows"] if r["precision"] == "fp8"]
        assert len(fp8) >= 3  # all eligible (or = planned), and the hand keep-lists
        assert "summary" in m["fp8_plan"] or "error" in m["fp8_plan"]
        for r in m["rows"]:
            if "error" in r:
                continue
            for key in ("score", "score_ratio", "rel_l2", "top1_agreement", "throughput", "l2_gate", "score_gate",
                        "accepted_by", "runtime"):
                assert key in r, (r["variant"], key)
            assert r["l2_gate"] == (r["rel_l2"] <= r["l2_limit"] and r["nonfinite"] == 0)
            assert r["score_gate"] == (r["score"] >= 0.99 * m["fp32_score"])
            assert r["throughput"] > 0
        assert sum("error" not in r for r in m["rows"]) >= len(m["rows"]) - 2
    md = (tmp_path / "trained.md").read_text()
    assert "| model | variant |" in md and "accepted by" in md and "FP8 plan" in md


@pytest.mark.slow
def test_trained_benchmark_times_eagerly_when_the_runtime_fails(tmp_path, cache_dir):
    if torch.cuda.is_available():
        pytest.skip("CUDA graphs work here: the fallback cannot be provoked this way")
    bench = _bench()  # CUDA-graph capture fails on the CPU: every row falls back to eager timing and says why
    assert bench.main(["--tiny", "--models", "digits_cnn", "--runtime", "cudagraphs", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "trained.json").read_text())["models"][0]["rows"]
    assert rows and all(r["runtime"] == "eager" and r["timing_error"].startswith("cudagraphs: ") for r in rows)
    assert all(r["throughput"] > 0 and "error" not in r for r in rows)


@pytest.mark.slow
def test_trained_benchmark_compiles_the_autocast_wrapper(cache_dir):
    # Dynamo inlines the recipe's forward under the autocast wrapper and looks its module up in sys.modules:
    # an unregistered recipe module made every autocast row fall back to eager timing.
    bench = _bench()
    recipe = bench.load_recipe("digits_cnn")
    assert sys.modules["trained_recipe_digits_cnn"] is recipe
    from tctune.runtime import Autocast

    model = recipe.build_model()
    got = bench.throughput(Autocast(model, torch.bfloat16, "cpu"), "inductor", recipe.example_inputs(8), 8,
                           torch.device("cpu"), "bf16")
    assert got["throughput"] > 0 and got["setup_s"] > 0


def test_seq_failed_training_is_refused_and_not_cached(seq, tmp_path, monkeypatch):
    monkeypatch.setenv("TCTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(seq, "SIZE", "tiny")
    monkeypatch.setitem(seq.SIZES["tiny"], "steps", 1)  # one step: the model stays at chance
    with pytest.raises(seq.TrainingFailedError, match=r"'tiny' model scored 0\.[0-8]\d* .*after 1 training "
                       r"steps.*Lower SIZES\['tiny'\]\['lr'\].*not cached"):
        seq.build_model()
    assert not seq.cache_path().exists() and list(tmp_path.iterdir()) == []


def test_gates_withhold_verdicts_for_a_model_at_chance():
    bench = _bench()
    assert not bench.is_trained(0.587, 0.5) and bench.is_trained(0.97, 0.5)
    assert not bench.is_trained(0.3, 0.1) and bench.is_trained(0.97, 0.1)
    row = {"variant": "model.to(bf16)", "precision": "bf16", "score": 0.586, "rel_l2": 5e-3, "nonfinite": 0, "throughput": 200.0}
    bench.gates(row, 0.587, 100.0, trained=False)
    assert row["accepted_by"] == bench.NOT_TRAINED and row["l2_gate"] is None and row["score_gate"] is None
    assert row["speedup"] == 2.0
    md = bench.table({"models": [{"model": "m", "rows": [row], "trained": False, "fp32_score": 0.587,
                                  "chance": 0.5, "min_trained_score": 0.75, "fp8_plan": {"summary": "-"}},
                                 {"model": "n", "rows": [], "build_error": "TrainingFailedError: boom"}]})
    assert "model not trained" in md and "MODEL NOT TRAINED: FP32 score 0.5870" in md
    assert "n: not measured: TrainingFailedError: boom" in md
