"""Plain baselines in every study, the side-by-side comparison, and a headline from one run's numbers (CPU)."""
import json

import optuna
import pytest
import torch

from tctune.hardware import resolve
from tctune.measure import time_interleaved
from tctune.modelfile import load_model_file
from tctune.optimize import optimize
from tctune.search import TuneConfig, Tuner, best_trial
from tctune.search.baselines import CastModel, baseline_label, candidate_params, interleaved_speedup, plain_baselines
from tctune.search.results import headline

from zoo import TINY_MODEL_FILE as TINY  # noqa: E402 - the model of the `tiny` fixture (conftest.py)


class AlwaysPrune(optuna.pruners.BasePruner):
    """Stops every trial that reports: only a trial that never asks can finish."""

    def prune(self, study, trial):
        return True


class MixedOutputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 5)
        self.register_buffer("steps", torch.tensor(3))  # an integer buffer: not cast

    def forward(self, x, ids):
        y = self.lin(x)
        return {"logits": y, "ids": ids + self.steps, "pair": (y.sum(-1), ids.bool())}


def test_cast_model_casts_a_copy_and_returns_fp32_outputs():
    torch.manual_seed(3)
    model = MixedOutputs()
    x, ids = torch.randn(4, 8) * 3, torch.randint(0, 9, (4,))
    cast = CastModel(model, torch.bfloat16)
    assert cast.model.lin.weight.dtype == torch.bfloat16 and cast.model.steps.dtype == torch.int64
    assert model.lin.weight.dtype == torch.float32  # the user's model untouched
    with torch.no_grad():
        ref, out = model(x, ids), cast(x, ids)
    assert out["logits"].dtype == out["pair"][0].dtype == torch.float32
    assert out["ids"].dtype == torch.int64 and torch.equal(out["ids"], ref["ids"])
    assert out["pair"][1].dtype == torch.bool
    rel = (out["logits"] - ref["logits"]).norm() / ref["logits"].norm()
    assert 0 < rel < 2e-2  # computed in bf16 (not equal), and close


def test_plain_baselines_cover_each_batch_and_low_precision(tiny, tmp_path):
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4, 16), quiet=True, export=False)
    t = Tuner(cfg, load_model_file(tiny), resolve(None), device=torch.device("cpu"))
    got = [(b.name, b.params["batch_size"], b.params["precision"], b.model_cast) for b in t.plain_baselines()]
    assert got == [("fp32_eager", 4, "fp32", False), ("autocast_bf16", 4, "bf16", False), ("cast_bf16", 4, "bf16", True),
                   ("fp32_eager", 16, "fp32", False), ("autocast_bf16", 16, "bf16", False), ("cast_bf16", 16, "bf16", True)]
    train = plain_baselines(t.search_space, mode="train")
    assert not any(b.model_cast for b in train)  # pure low-precision training is not a plain recipe
    assert t.compile_baselines(t.create_study()) == []  # torch.compile baselines are for a GPU
    study = t.create_study()
    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    assert [w.user_attrs.get("baseline") for w in waiting[:6]] == [g[0] for g in got]  # enqueued first
    assert waiting[2].user_attrs["model_cast"] is True
    assert t.enqueue_baselines(study, t.plain_baselines()) == 0  # not twice


@pytest.fixture(scope="module")
def pruned_run(tmp_path_factory):
    """One optimize run whose pruner stops every trial that asks it."""
    tmp = tmp_path_factory.mktemp("pruned")
    f = tmp / "tiny.py"
    f.write_text(TINY)
    mp = pytest.MonkeyPatch()
    mp.setattr("tctune.search.storage.make_pruner", lambda directions, enabled=True: AlwaysPrune())
    try:
        report = optimize(f, TuneConfig(out_dir=str(tmp / "out"), batch_sizes=(4, 8), trials=2, quiet=True,
                                        export=False, prune=True))
    finally:
        mp.undo()
    return report, tmp / "out"


def test_baselines_are_never_pruned_and_are_in_the_report_at_the_chosen_batch(pruned_run):
    report, out = pruned_run
    rows = {(b["name"], b["batch_size"]): b for b in report["baselines"]}
    assert set(rows) == {(n, bs) for n in ("fp32_eager", "autocast_bf16", "cast_bf16") for bs in (4, 8)}
    for b in report["baselines"]:
        assert b["feasible"] and b["throughput"] > 0, b  # measured fully although the pruner stops everything
        assert {"precision", "runtime", "latency_p99_ms", "peak_memory_mib", "max_rel_error", "score"} <= set(b)
    searched = [t for t in report["trials"] if not t["baseline"]]
    assert searched and all(t["state"] == "PRUNED" for t in searched)
    assert any("stopped early" in (t["fail_reason"] or "") for t in searched)  # the pruner did fire
    cast = rows[("cast_bf16", report["best"]["params"]["batch_size"])]
    assert cast["model_cast"] and cast["precision"] == "bf16" and 0 < cast["max_rel_error"] < 1e-2
    row = next(t for t in report["trials"] if t["number"] == cast["trial"])
    assert "model cast bf16" in row["description"]
    # the best is a baseline here (every searched trial was stopped), and the report says so
    best = report["best"]
    assert best["baseline_wins"] and best["baseline"] and best["speedup_vs_best_baseline"] == pytest.approx(1.0)
    assert "A plain baseline wins" in (out / "report.md").read_text()


def test_side_by_side_entries_structure_and_headline_fields(pruned_run):
    report, _ = pruned_run
    sbs = report["side_by_side"]
    assert sbs["current_run"] and sbs["run_id"] == report["best"]["run_id"]
    assert sbs["clocks"] == {"available": False, "reason": "not available (measured on the CPU)"}
    assert sbs["entries"] and all(len(e["rounds_ms"]) == sbs["rounds"] and e["median_ms"] > 0 for e in sbs["entries"])
    best = report["best"]
    by_trial = {e["trial"]: e for e in sbs["entries"]}
    assert best["trial"] in by_trial and best["chosen_on"] == "side-by-side median"
    assert best["chosen_throughput"] == by_trial[best["trial"]]["throughput"]
    fastest = max(sbs["entries"], key=lambda e: e["throughput"])
    if best["chosen_throughput"] != fastest["throughput"]:
        # BASELINE_CHOICE_RULE: a preferred plain baseline stays the answer over a plain baseline that is faster by
        # median but not measurably faster (a noisy host); a tctune candidate is never passed over.
        assert best["baseline_wins"] and fastest["baseline"], (best, fastest)
    assert best["timing"] == "side by side, this run"
    assert best["speedup_vs_fp32_eager"] == best["speedup_vs_baseline"]
    bb = best["best_baseline"]
    assert bb["batch_size"] == best["params"]["batch_size"] and bb["throughput"] == by_trial[bb["trial"]]["throughput"]


def test_interleaved_timing_alternates_and_returns_one_value_per_round():
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    out = time_interleaved(fns, torch.device("cpu"), rounds=4, warmup=1, max_iterations=1)
    assert set(out) == {"a", "b"} and all(len(v) == 4 and all(x > 0 for x in v) for v in out.values())
    from tctune.measure import CALIBRATION_CALLS

    setup = 2 * (1 + CALIBRATION_CALLS)  # each one's warm-up call and its calibration calls (sizing a block)
    assert calls[:setup] == ["a"] * (1 + CALIBRATION_CALLS) + ["b"] * (1 + CALIBRATION_CALLS)
    assert calls[setup:] == ["a", "b"] * 4  # then A B A B ...


def test_interleaved_speedup_has_a_ci_and_a_sign_test():
    base, best = [2.0, 2.2, 1.9, 2.1, 2.0, 2.05], [1.0, 1.1, 1.0, 0.95, 1.05, 1.0]
    s = interleaved_speedup(base, best, seed=1)
    assert s["speedup"] == pytest.approx(2.025 / 1.0)
    assert s["ci95"][0] <= s["speedup"] <= s["ci95"][1] and s["ci95"][0] > 1.5
    assert s["rounds"] == 6 and s["rounds_faster"] == 6 and s["p_value"] == pytest.approx(2 / 2 ** 6)
    tie = interleaved_speedup([1.0, 2.0, 1.0, 2.0], [2.0, 1.0, 2.0, 1.0])
    assert tie["p_value"] == 1.0 and tie["rounds_faster"] == 2
    with pytest.raises(ValueError, match="paired timings"):
        interleaved_speedup([1.0], [1.0, 2.0])


def _add(study, params, throughput, **attrs):
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions={k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()},
        value=throughput, user_attrs={"throughput": throughput, "max_rel_error": 0.0, **attrs}))
    return study.trials[-1].number


def test_headline_never_divides_numbers_of_two_runs():
    study = optuna.create_study(direction="maximize")
    p = {"batch_size": 8, "precision": "fp32", "graph_passes": False, "runtime": "eager"}
    old = _add(study, p, 100.0, baseline="fp32_eager", run_id="run1")
    new = _add(study, dict(p, graph_passes=True), 2800.0, run_id="run2")  # timed in a faster moment
    study.set_user_attr("side_by_side", {"run_id": "run1", "after_trial": old, "entries": [
        {"trial": old, "batch_size": 8, "throughput": 100.0, "rounds_ms": [80.0]}]})
    study.set_user_attr("run_id", "run2")  # the current run is run2: run1's side-by-side is not used
    h = headline(study)
    assert best_trial(study).number == new and h["timing"] == "first timings, same run"
    assert h["speedup_vs_best_baseline"] is None and h["speedup_vs_fp32_eager"] is None
    assert "from another run" in h["note"]
    again = _add(study, p, 1000.0, baseline="fp32_eager", run_id="run2")  # re-measured in this run
    h = headline(study)
    assert h["best_baseline"]["trial"] == again and h["speedup_vs_best_baseline"] == pytest.approx(2.8)
    # this run's side-by-side timing replaces both first timings
    study.set_user_attr("side_by_side", {"run_id": "run2", "after_trial": again, "entries": [
        {"trial": new, "batch_size": 8, "throughput": 1500.0, "rounds_ms": [5.0, 5.4, 5.2]},
        {"trial": again, "batch_size": 8, "throughput": 1000.0, "rounds_ms": [8.0, 7.9, 8.1]}]})
    h = headline(study)
    assert h["timing"] == "side by side, this run" and h["speedup_vs_best_baseline"] == pytest.approx(1.5)
    assert h["speedup_ci95"] and h["speedup_rounds"] == 3 and not h["baseline_wins"]


def test_a_plain_baseline_winning_is_the_best_and_said_so(tmp_path):
    from tctune.cli.optimize import _summary
    from tctune.report import build_report, render_markdown

    study = optuna.create_study(direction="maximize")
    p = {"batch_size": 8, "precision": "fp32", "graph_passes": False, "runtime": "eager"}
    fp32 = _add(study, p, 1000.0, baseline="fp32_eager", run_id="r", description="model fp32, eager")
    amp = _add(study, dict(p, graph_passes=True, precision="bf16"), 1100.0, run_id="r", description="tctune graph bf16")
    study.set_user_attr("run_id", "r")
    study.set_user_attr("side_by_side", {"run_id": "r", "after_trial": amp, "rounds": 3, "block_s": 0.05,
                                         "clocks": {"available": False, "reason": "not available"}, "entries": [
        {"trial": amp, "baseline": None, "batch_size": 8, "throughput": 900.0, "median_ms": 8.9, "rounds_ms": [8.9] * 3},
        {"trial": fp32, "baseline": "fp32_eager", "batch_size": 8, "throughput": 1000.0, "median_ms": 8.0,
         "rounds_ms": [8.0] * 3}]})
    assert best_trial(study).number == fp32  # slower by its first timing, faster side by side
    report = build_report(study, hardware={}, measured_on="cpu", config={"max_error": 0.01, "mode": "infer"},
                          model={"name": "m", "path": "m.py"}, passes=[], artifacts={}, capture={"ok": True})
    best = report["best"]
    assert best["baseline_wins"] and best["baseline"] == "fp32_eager" and best["speedup_vs_best_baseline"] == 1.0
    assert best["best_searched"]["trial"] == amp and best["best_searched"]["throughput"] == 900.0
    assert [b["name"] for b in report["baselines"]] == ["fp32_eager"]
    assert report["baselines"][0]["side_by_side_throughput"] == 1000.0
    md = render_markdown(report)
    assert "A plain baseline wins" in md and "Use it" in md and "keep FP32" not in md
    text = _summary(report, tmp_path)
    assert "a plain baseline wins (fp32_eager): no tctune candidate beat FP32 eager at batch 8 (0.90×, 95 % CI 0.90–0.90): use it" in text
    assert "1000 items/s (side-by-side median)" in text  # the number the choice was made on


def test_resumed_study_re_times_its_baselines_in_the_current_run(tiny, tmp_path):
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4,), trials=1, quiet=True, export=False, prune=False)
    first = Tuner(cfg, load_model_file(tiny), resolve(None), device=torch.device("cpu"))
    study = first.run()
    n_before = len(study.trials)
    base = {t.number: t for t in study.trials if t.user_attrs.get("baseline")}
    assert {t.user_attrs["run_id"] for t in base.values()} == {first.run_id}
    second = Tuner(cfg, load_model_file(tiny), resolve(None), device=torch.device("cpu"))  # same storage: resumed
    study = second.run()
    assert len([t for t in study.trials if t.user_attrs.get("baseline")]) == len(base)  # not measured again as trials
    assert len(study.trials) <= n_before + 1
    sbs = study.user_attrs["side_by_side"]
    assert study.user_attrs["run_id"] == sbs["run_id"] == second.run_id
    timed = {e["trial"]: e for e in sbs["entries"] if e["throughput"]}
    assert set(base) & set(timed)  # the earlier run's baselines re-timed in this run
    h = headline(study)
    assert h["timing"] == "side by side, this run" and h["run_id"] == second.run_id
    assert h["chosen_throughput"] == timed[best_trial(study).number]["throughput"]
    assert h["best_baseline"]["throughput"] == timed[h["best_baseline"]["trial"]]["throughput"]
    assert h["fp32_eager"]["throughput"] == timed[h["fp32_eager"]["trial"]]["throughput"]
    keys = [json.dumps(candidate_params(t.params, t.user_attrs), sort_keys=True) for t in study.trials
            if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(keys) == len(set(keys))  # no candidate measured twice


def test_compile_baseline_is_torch_compile_of_the_fastest_feasible_eager_baseline(tiny, tmp_path):
    import dataclasses

    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4, 16), quiet=True, export=False)
    t = Tuner(cfg, load_model_file(tiny), resolve(None), device=torch.device("cpu"))
    t.search_space = dataclasses.replace(t.search_space, runtimes=("eager", "inductor"))
    study = optuna.create_study(direction="maximize")
    for b, thr, err in ((0, 100.0, 0.0), (1, 300.0, 2e-2), (2, 200.0, 1e-3), (3, 50.0, 0.0), (4, 60.0, 1e-3), (5, 70.0, 1e-3)):
        base = t.plain_baselines()[b]
        study.add_trial(optuna.trial.create_trial(
            params=base.params, distributions={k: optuna.distributions.CategoricalDistribution([v])
                                               for k, v in base.params.items()},
            value=thr, user_attrs={"throughput": thr, "max_rel_error": err, **base.user_attrs()},
            constraints={"max_error": err - 1e-2}))  # autocast at batch 4 is the fastest but over --max-error
    assert t.compile_baselines(study) == []  # on the CPU: none
    t.device = torch.device("cuda")  # (nothing runs: the choice only)
    got = t.compile_baselines(study)
    assert [(b.name, b.params["batch_size"], b.params["runtime"], b.model_cast) for b in got] == [
        ("compile_cast_bf16", 4, "inductor", True), ("compile_cast_bf16", 16, "inductor", True)]
    t.search_space = dataclasses.replace(t.search_space, runtimes=("eager", "inductor", "inductor-cudagraphs"))
    got = t.compile_baselines(study)  # with CUDA graphs searched: mode="reduce-overhead" beside mode default
    assert [(b.name, b.params["batch_size"], b.params["runtime"]) for b in got] == [
        ("compile_cast_bf16", 4, "inductor"), ("compile_ro_cast_bf16", 4, "inductor-cudagraphs"),
        ("compile_cast_bf16", 16, "inductor"), ("compile_ro_cast_bf16", 16, "inductor-cudagraphs")]
    assert baseline_label("compile_ro_cast_bf16") == "torch.compile(model.to(torch.bfloat16), mode='reduce-overhead')"


def test_every_side_by_side_entry_that_can_win_has_its_batch_sizes_baselines(tiny, tmp_path):
    """A baseline at batch 8 is the fastest by its first timing, the fastest searched trial is at batch 32:
    batch 32's baselines are timed too, so whichever wins has a same-batch baseline to compare with."""
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(8, 32), quiet=True, export=False)
    t = Tuner(cfg, load_model_file(tiny), resolve(None), device=torch.device("cpu"))
    study = optuna.create_study(direction="maximize")
    p = {"batch_size": 8, "precision": "bf16", "graph_passes": False, "runtime": "eager"}
    cast8 = _add(study, p, 900.0, baseline="cast_bf16", model_cast=True)
    fp32_8 = _add(study, dict(p, precision="fp32"), 300.0, baseline="fp32_eager")
    fp32_32 = _add(study, dict(p, precision="fp32", batch_size=32), 400.0, baseline="fp32_eager")
    amp32 = _add(study, dict(p, batch_size=32), 500.0, baseline="autocast_bf16")
    graph32 = _add(study, dict(p, batch_size=32, graph_passes=True), 600.0)
    got = [tr.number for tr in t.side_by_side_entries(study)]
    assert got[0] == cast8 and set(got) == {cast8, fp32_8, fp32_32, amp32, graph32}


def test_timeout_never_leaves_a_baseline_unmeasured(tmp_path):
    """--timeout bounds the searched trials only: a headline needs every plain baseline, so even a timeout that
    has passed before the first trial leaves none of them unmeasured (a short budget on the H200 left out the
    compiled baseline and the headline compared against eager baselines only)."""
    from tctune.hardware import resolve
    from tctune.modelfile import load_model_file
    from tctune.search import TuneConfig, Tuner

    f = tmp_path / "m.py"
    f.write_text("import torch\n"
                 "def build_model():\n    torch.manual_seed(0)\n    return torch.nn.Sequential(torch.nn.Linear(8, 8))\n"
                 "def example_inputs(b):\n    return (torch.randn(b, 8),)\n")
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4,), trials=3, timeout_s=1e-9, quiet=True,
                     export=False)
    tuner = Tuner(cfg, load_model_file(f), resolve(None), device=torch.device("cpu"))
    study = tuner.run()
    done = {t.user_attrs.get("baseline") for t in study.trials if t.state.name in ("COMPLETE", "FAIL", "PRUNED")}
    assert {b.name for b in tuner.plain_baselines()} <= done
    assert not any(t.user_attrs.get("baseline") is None and t.state.name == "COMPLETE" for t in study.trials)
