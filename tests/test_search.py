"""Search logic on the CPU: objectives, constraints, Pareto front, enumeration without repeats."""
import dataclasses
import json

import optuna
import pytest
import torch

from tctune.hardware import resolve
from tctune.modelfile import load_model_file
from tctune.optimize import optimize
from tctune.search import TuneConfig, Tuner, best_trial

from zoo import TINY_MODEL_FILE as TINY  # noqa: E402 - the model of the `tiny` fixture (conftest.py)


def tuner(tiny, tmp_path, **kw):
    # prune=False: these tests assert which candidates complete; early stopping on a noisy CPU would make
    # that a matter of timing (the pruner has its own test below).
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4, 16), quiet=True, export=False, prune=False, **kw)
    return Tuner(cfg, load_model_file(tiny), resolve(None), device=torch.device("cpu"))


def test_small_space_is_enumerated_without_repeats(tiny, tmp_path):
    from tctune.search.baselines import candidate_params

    t = tuner(tiny, tmp_path, trials=20)
    study = t.run()
    # the model cast as a whole (a plain baseline) has its autocast twin's searched params: the candidate differs
    keys = [json.dumps(candidate_params(tr.params, tr.user_attrs), sort_keys=True) for tr in study.trials]
    assert len(keys) == len(set(keys))
    assert len({json.dumps(tr.params, sort_keys=True) for tr in study.trials}) == t.space_size() == 8


def test_pareto_report_has_front_and_plots(tiny, tmp_path):
    report = optimize(tiny, TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4, 16), trials=8, quiet=True,
                                       export=False, objective="pareto"))
    front = report["pareto_front"]
    assert front
    for row in front:
        assert {"params", "throughput", "latency_p99_ms", "peak_memory_mib", "max_rel_error"} <= set(row)
    assert "Pareto front" in (tmp_path / "out" / "report.md").read_text()
    assert report["plots"].get("pareto_png") or "matplotlib" in report["plots"].get("skipped", "")


def test_latency_objective_picks_lowest_p99(tiny, tmp_path):
    t = tuner(tiny, tmp_path, trials=8, objective="latency")
    study = t.run()
    best = best_trial(study)
    feasible = [tr for tr in study.trials if tr.state == optuna.trial.TrialState.COMPLETE]
    assert best.values[0] == min(tr.values[0] for tr in feasible)
    assert best.values[0] == best.user_attrs["latency_p99_ms"]


def test_max_latency_constraint_makes_trials_infeasible(tiny, tmp_path):
    t = tuner(tiny, tmp_path, trials=4, max_latency_ms=1e-6)
    study = t.run()
    assert best_trial(study) is None
    assert all("p99 latency" in tr.user_attrs["fail_reason"] for tr in study.trials
               if tr.state == optuna.trial.TrialState.COMPLETE)


def test_max_error_constraint_rejects_inaccurate_precision(tiny, tmp_path):
    t = tuner(tiny, tmp_path, trials=8, max_error=1e-9)
    study = t.run()
    best = best_trial(study)
    assert best.params["precision"] == "fp32"
    low = [tr for tr in study.trials if tr.params["precision"] == "bf16" and tr.state == optuna.trial.TrialState.COMPLETE]
    assert low and all("relative error" in tr.user_attrs["fail_reason"] for tr in low)
    assert all(tr.user_attrs["fail_kind"] == "accuracy" for tr in low)


TRAINABLE = TINY + '''
def example_targets(batch_size):
    return torch.randint(0, 12, (batch_size,))
def loss_fn(output, targets):
    return torch.nn.functional.cross_entropy(output, targets)
'''


def test_train_mode_measures_steps_with_accumulation(tmp_path):
    f = tmp_path / "trainable.py"
    f.write_text(TRAINABLE)
    report = optimize(f, TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4, 8), trials=4, quiet=True,
                                    mode="train", effective_batch=16))
    done = [t for t in report["trials"] if t["state"] == "COMPLETE"]
    assert len(done) == 4
    assert all(not t["params"]["graph_passes"] for t in report["trials"])
    assert "train step" in done[0]["description"] and "x 4 accumulation" in " ".join(t["description"] for t in done)
    fp32 = [t for t in done if t["params"]["precision"] == "fp32"]
    assert fp32 and all(t["max_rel_error"] == 0 for t in fp32)  # same initial weights, same inputs: identical grads
    bf16 = [t for t in done if t["params"]["precision"] == "bf16"]
    assert bf16 and all(0 < t["max_rel_error"] < 5e-2 for t in bf16)
    assert "no engines in --mode train" in report["artifacts"]["onnx_error"]
    assert "not applied in --mode train" in report["capture"]["reason"]


def test_train_mode_needs_loss_fn(tiny, tmp_path):
    from tctune.errors import ModelFileError
    with pytest.raises(ModelFileError, match=r"(?s)needs example_targets\(\) and loss_fn\(\).*def loss_fn"):
        optimize(tiny, TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4,), trials=1, quiet=True, mode="train"))


def test_apply_passes_calibration_keeps_overflowing_modules_fp32():
    """At fp16, calibration inputs make the overflow analysis keep a module FP32 (named in the skip reason)."""
    import zoo
    from tctune.trial import apply_passes

    model, gm, entry = zoo.build("overflow_mlp")
    h100 = resolve("h100")
    x = entry.example_inputs(5)
    plain, _ = apply_passes(gm, h100, "fp16")
    calibrated, results = apply_passes(gm, h100, "fp16", calibration=[entry.example_inputs(4)])
    with torch.no_grad():
        assert not torch.isfinite(plain(*x)).all()  # without the analysis fp16 overflows
        assert torch.isfinite(calibrated(*x)).all()
    cast = {r.name: r for r in results}["cast_precision"]
    assert any(s.reason.startswith("overflow:") and "module" in s.reason for s in cast.skipped)


def test_policy_dimension_measures_pure_graphs_and_prunes_twins(tiny, tmp_path, monkeypatch):
    """The cast policy (searched on GPUs) as it runs: "pure" only for the fp16/bf16 graph, else pruned."""
    t = tuner(tiny, tmp_path, trials=16)
    t.search_space = dataclasses.replace(t.search_space, policy=True)
    study = t.run()
    assert t.space()["policy"] == ["autocast", "pure"]
    pure = [tr for tr in study.trials if tr.params.get("policy") == "pure"]
    measured = [tr for tr in pure if tr.state == optuna.trial.TrialState.COMPLETE]
    assert measured and all(tr.params["graph_passes"] and tr.params["precision"] == "bf16" for tr in measured)
    assert all("(pure)" in tr.user_attrs["description"] for tr in measured)
    twins = [tr for tr in pure if tr.state == optuna.trial.TrialState.PRUNED]
    assert twins and all("policy pure applies only" in tr.user_attrs["fail_reason"] for tr in twins)


def test_compiled_graph_candidates_are_measured_right_after_the_fp32_baselines(tiny, tmp_path, monkeypatch):
    """The likely winner on a GPU (graph + Inductor, pure policy) is enqueued before TPE's random draws."""
    t = tuner(tiny, tmp_path, trials=1, runtimes=("eager", "inductor"))
    t.search_space = dataclasses.replace(t.search_space, policy=True)
    study = t.create_study()

    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    queued = [tr.system_attrs["fixed_params"] for tr in waiting]
    # the plain baselines first (FP32 eager, autocast and the cast model at each batch size), then the compiled graphs
    nb = len(t.plain_baselines())
    assert [tr.user_attrs.get("baseline") for tr in waiting[:nb]] == [b.name for b in t.plain_baselines()]
    assert [q["precision"] for q in queued[:nb] if q["precision"] == "fp32"] == ["fp32", "fp32"]  # one per batch size
    assert queued[0]["precision"] == "fp32"
    low = [p for p in t.precisions if p in ("fp16", "bf16", "fp8")]
    assert low  # the CPU searches bf16
    assert queued[nb:nb + len(low)] == [{"batch_size": 16, "precision": p, "graph_passes": True, "runtime": "inductor",
                                       "policy": "pure"} for p in low]
    t.search_space = dataclasses.replace(t.search_space, memory_format=True,
                                         precisions=("fp32", "fp16", "fp8"))  # as on an H200
    assert [(c["precision"], c["policy"], c["memory_format"]) for c in t.compiled_first()] == [
        ("fp16", "pure", "contiguous"), ("fp16", "pure", "channels_last"), ("fp8", "pure", "contiguous")]
    # the FP8 graph's bf16 part follows the policy too: pure FP8 is a candidate, not a pruned twin
    assert t.skip_reason(study, {"batch_size": 16, "precision": "fp8", "graph_passes": True, "runtime": "eager",
                                 "policy": "pure"}) is None
    assert "policy pure applies only" in t.skip_reason(study, {"batch_size": 16, "precision": "tf32",
                                                               "graph_passes": True, "runtime": "eager", "policy": "pure"})
    # nothing compiled to enqueue without a compiled runtime, in training, or without a captured graph
    assert tuner(tiny, tmp_path / "b", runtimes=("eager",)).compiled_first() == []


def _finished(study, number_params, throughput):
    study.add_trial(optuna.trial.create_trial(
        params=number_params, distributions={k: optuna.distributions.CategoricalDistribution([v])
                                             for k, v in number_params.items()},
        value=throughput, user_attrs={"throughput": throughput, "max_rel_error": 0.0}))


def test_confirmation_re_measures_the_close_candidates_and_best_takes_the_mean(tiny, tmp_path, monkeypatch):
    """A launch-bound winner by 2 % that times 12 % slower once more loses to the runner-up (seed CNN, H200)."""
    t = tuner(tiny, tmp_path)
    study = optuna.create_study(direction="maximize")
    _finished(study, {"runtime": "inductor"}, 6.25)
    _finished(study, {"runtime": "inductor-cudagraphs"}, 6.14)
    _finished(study, {"runtime": "eager"}, 5.0)  # 20 % slower: not re-measured
    again = {"inductor": 5.48, "inductor-cudagraphs": 6.11}
    calls = []

    def evaluate(params, on_repeat=None, fp8_keep=None):
        calls.append(params["runtime"])
        return {"throughput": again[params["runtime"]]}

    monkeypatch.setattr(t, "evaluate", evaluate)
    assert best_trial(study).params["runtime"] == "inductor"

    conf = t.confirm(study)

    assert calls == ["inductor", "inductor-cudagraphs"]
    assert conf["runs"] == {"0": [6.25, 5.48], "1": [6.14, 6.11]} and study.user_attrs["confirmation"] == conf
    assert best_trial(study).params["runtime"] == "inductor-cudagraphs"
    # a resumed study adds its re-measurements to the earlier ones: the mean uses every timing
    again = {"inductor": 7.5, "inductor-cudagraphs": 6.0}
    conf = t.confirm(study)
    assert conf["runs"] == {"0": [6.25, 5.48, 7.5], "1": [6.14, 6.11, 6.0]}
    assert best_trial(study).params["runtime"] == "inductor"  # mean 6.41 against 6.08
    # a faster trial added after the confirmation (a resumed study) is not hidden by it
    _finished(study, {"runtime": "cudagraphs"}, 7.0)
    assert best_trial(study).params["runtime"] == "cudagraphs"


def test_confirmation_re_measures_at_most_confirm_top_candidates(tiny, tmp_path, monkeypatch):
    """Four candidates within the band: only the CONFIRM_TOP (3) fastest are re-measured, fastest first."""
    from tctune.search.loop import CONFIRM_TOP

    t = tuner(tiny, tmp_path)
    study = optuna.create_study(direction="maximize")
    for runtime, throughput in (("a", 10.0), ("b", 9.9), ("c", 9.8), ("d", 9.7)):
        _finished(study, {"runtime": runtime}, throughput)
    calls = []

    def evaluate(params, on_repeat=None, fp8_keep=None):
        calls.append(params["runtime"])
        return {"throughput": 9.0}

    monkeypatch.setattr(t, "evaluate", evaluate)
    conf = t.confirm(study)
    assert CONFIRM_TOP == 3 and calls == ["a", "b", "c"] and sorted(conf["runs"]) == ["0", "1", "2"]


def test_pruned_candidates_count_as_measured_like_the_enumerating_sampler_counts_them():
    """A resumed enumerated study must not promise trials for candidates that were stopped early (the
    enumerating sampler never proposes them again: the extra trial could only be a duplicate)."""
    study = optuna.create_study(direction="maximize")
    dist = {"runtime": optuna.distributions.CategoricalDistribution(["a", "b"])}
    study.add_trial(optuna.trial.create_trial(params={"runtime": "a"}, distributions=dist,
                                              state=optuna.trial.TrialState.PRUNED,
                                              user_attrs={"fail_reason": "stopped early: clearly slower"}))
    study.add_trial(optuna.trial.create_trial(params={"runtime": "b"}, distributions=dist, value=1.0))
    assert Tuner.measured(study) == {'{"runtime": "a"}', '{"runtime": "b"}'}


def test_confirmation_keeps_a_failed_re_run_at_its_first_timing_and_skips_clear_winners(tiny, tmp_path, monkeypatch):
    from tctune.errors import CandidateRejected
    t = tuner(tiny, tmp_path)
    study = optuna.create_study(direction="maximize")
    _finished(study, {"runtime": "a"}, 10.0)
    _finished(study, {"runtime": "b"}, 9.8)

    def evaluate(params, on_repeat=None, fp8_keep=None):
        if params["runtime"] == "a":
            raise CandidateRejected("out of memory")
        return {"throughput": 9.0}

    monkeypatch.setattr(t, "evaluate", evaluate)
    conf = t.confirm(study)
    assert conf["runs"] == {"0": [10.0, None], "1": [9.8, 9.0]} and best_trial(study).params["runtime"] == "a"

    clear = optuna.create_study(direction="maximize")
    _finished(clear, {"runtime": "a"}, 10.0)
    _finished(clear, {"runtime": "b"}, 9.0)  # 10 % behind: nothing to confirm
    assert t.confirm(clear) is None and "confirmation" not in clear.user_attrs


def _every_feasible_trial_is_a_finalist(monkeypatch):
    """Every feasible trial within the confirmation band and under its cap: re-measured, then timed side by side.

    With the default cap (CONFIRM_TOP, 3) which trials are finalists, and so whether the answer side by side is
    one of them or the fastest searched trial timed beside them, follows the CPU's timing noise; with every
    feasible trial a finalist the answer is always a re-measured trial. The cap itself is tested on fixed
    timings (test_confirmation_re_measures_at_most_confirm_top_candidates)."""
    monkeypatch.setattr("tctune.search.loop.CONFIRM_BAND", 1.0)
    monkeypatch.setattr("tctune.search.loop.CONFIRM_TOP", 1000)


def test_run_confirms_and_the_report_says_so(tiny, tmp_path, monkeypatch):
    _every_feasible_trial_is_a_finalist(monkeypatch)
    report = optimize(tiny, TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4, 16), trials=4, quiet=True,
                                       export=False, prune=False))
    conf = report["confirmation"]
    feasible = [t for t in report["trials"] if t["feasible"]]
    assert len(feasible) >= 3 and conf and sorted(conf["runs"]) == sorted(str(t["number"]) for t in feasible)
    assert all(len(v) == 2 and v[1] and v[1] > 0 for v in conf["runs"].values())
    md = (tmp_path / "out" / "report.md").read_text()
    # the choice is then made side by side among the finalists and the best plain baselines
    assert report["best"]["chosen_on"] == "side-by-side median"
    assert str(report["best"]["trial"]) in conf["runs"]  # every feasible trial was re-measured: the answer too
    assert "Chosen by re-measuring" in md and report["best"]["confirmed_throughput"] > 0
    if report["best"]["baseline"]:
        assert "A plain baseline wins" in md


def test_pruner_stops_a_clearly_slower_candidate():
    """Intermediate throughput is reported per repeat; a candidate in the slowest quarter stops early."""
    from tctune.search import make_pruner

    study = optuna.create_study(direction="maximize", pruner=make_pruner(["maximize"]))
    assert isinstance(make_pruner(["maximize", "minimize", "minimize"]), optuna.pruners.NopPruner)
    for i in range(6):  # six finished trials at ~1000 items/s
        tr = study.ask()
        for step in range(4):
            tr.report(1000.0 + i, step)
        study.tell(tr, 1000.0 + i)
    slow = study.ask()
    slow.report(10.0, 0)
    assert not slow.should_prune()  # one repeat is not enough evidence (warm-up step)
    slow.report(10.0, 1)
    assert slow.should_prune()
    fast = study.ask()
    fast.report(5000.0, 0)
    fast.report(5000.0, 1)
    assert not fast.should_prune()


def test_train_step_on_bert_base_recipe_contract():
    """recipes/bert_base.py is also a fine-tuning step: targets match the encoder output and the loss is scalar."""
    from pathlib import Path
    mf = load_model_file(Path(__file__).parents[1] / "recipes" / "bert_base.py")
    assert mf.example_targets is not None and mf.loss_fn is not None
    out = torch.randn(2, 128, 768)
    loss = mf.loss_fn(out, mf.example_targets(2))
    assert loss.dim() == 0 and torch.isfinite(loss)


CONV = '''
import torch
def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 5))
def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 6, 6),)
'''


def test_memory_format_dimension_runs_channels_last(tmp_path, monkeypatch):
    """Channels-last (searched for conv nets on GPUs) converts weights and inputs and keeps the numbers."""
    f = tmp_path / "conv.py"
    f.write_text(CONV)
    t = tuner(f, tmp_path, trials=16)
    t.search_space = dataclasses.replace(t.search_space, memory_format=True)
    study = t.run()
    nhwc = [tr for tr in study.trials if tr.params.get("memory_format") == "channels_last"
            and tr.state == optuna.trial.TrialState.COMPLETE]
    assert nhwc and all("channels-last" in tr.user_attrs["description"] for tr in nhwc)
    fp32 = [tr for tr in nhwc if tr.params["precision"] == "fp32"]
    assert fp32 and all(tr.user_attrs["max_rel_error"] < 1e-5 for tr in fp32)
    # the reference model itself was never converted
    assert next(t.model.parameters()).is_contiguous()


@pytest.mark.parametrize("runtime", ["cudagraphs", "inductor-cudagraphs"])
def test_cuda_graph_runtimes_need_a_gpu_and_inference(tiny, tmp_path, runtime):
    from tctune.errors import UsageError

    with pytest.raises(UsageError, match=f"runtimes {runtime} needs a CUDA GPU") as err:
        tuner(tiny, tmp_path, runtimes=(runtime,))
    assert err.value.field == "runtimes"
    with pytest.raises(UsageError, match=f"runtimes {runtime} is for inference"):
        tuner(tiny, tmp_path, runtimes=(runtime,), mode="train")


def test_runtimes_without_eager_say_the_baselines_need_it(tiny, tmp_path, caplog):
    from tctune.errors import UsageError

    with pytest.raises(UsageError, match="(?s)leaves out eager.*fix: runtimes eager,inductor"):
        tuner(tiny, tmp_path, runtimes=("inductor",))
    with caplog.at_level("WARNING", logger="tctune"):
        tuner(tiny, tmp_path, fp8_keep=("*.fc",))  # the CPU never searches fp8
    assert "--fp8-keep / --max-error-fp8 have no effect" in caplog.text


def test_effective_batch_not_a_multiple_is_said(tiny, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="tctune"):
        tuner(tiny, tmp_path, mode="train", effective_batch=6)  # batch sizes 4 and 16
    assert "--effective-batch 6 is not a multiple of batch size 4: its optimizer steps take 2 micro-batch(es), 8 samples" in caplog.text
    assert "batch size 16: its optimizer steps take 1 micro-batch(es), 16 samples" in caplog.text


def test_default_runtimes_per_device():
    from tctune.runtime import ALL_RUNTIMES, CUDA_GRAPH_RUNTIMES, RUNTIMES_CPU, RUNTIMES_GPU

    assert RUNTIMES_CPU == ("eager",)
    assert "inductor-cudagraphs" in RUNTIMES_GPU and set(RUNTIMES_GPU) <= set(ALL_RUNTIMES)
    assert set(CUDA_GRAPH_RUNTIMES) <= set(ALL_RUNTIMES)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_inductor_cudagraphs_matches_eager_on_gpu():
    from tctune.runtime import wrap

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda().eval()
    x = torch.randn(8, 64, device="cuda")
    fn, setup_s = wrap(model, "inductor-cudagraphs", (x,))
    y = torch.randn(8, 64, device="cuda")  # fresh values into the static input buffer
    with torch.no_grad():
        torch.testing.assert_close(fn(y).clone(), model(y), rtol=1e-4, atol=1e-4)
    assert setup_s > 0


def test_unstable_timing_is_flagged():
    from tctune.report import unstable_timing

    steady = {"number": 1, "repeats_ms": [1.0, 1.02, 0.99], "latency_ms": 1.0, "latency_p50_ms": 1.05}
    assert unstable_timing(steady, steady) is None
    spread = {"number": 2, "repeats_ms": [0.02, 1.1, 0.5], "latency_ms": 0.5, "latency_p50_ms": 0.5}
    assert "spread" in unstable_timing(steady, spread)
    apart = {"number": 3, "repeats_ms": [15.0, 15.1, 15.0], "latency_ms": 15.0, "latency_p50_ms": 0.02}
    assert "trial 3" in unstable_timing(apart)
    tiny_gpu = {"number": 4, "repeats_ms": [0.010, 0.010], "latency_ms": 0.010, "latency_p50_ms": 0.030}
    assert unstable_timing(tiny_gpu) is None  # 3x apart but 0.02 ms: a synchronized call's fixed cost


def _report(**over):
    r = {"hardware": {}, "model": {"name": "m", "path": "m.py"}, "measured_on": "cpu",
         "study": {"name": "s", "n_trials": 1, "n_complete": 1}, "config": {"max_error": 0.01, "mode": "infer"},
         "capture": {"ok": True}, "best": None, "baseline": None, "passes": [], "trials": [], "artifacts": {}}
    r.update(over)
    return r


def test_report_says_train_mode_has_no_passes_rather_than_a_failed_capture():
    from tctune.report import render_markdown
    from tctune.search import TRAIN_NO_PASSES

    md = render_markdown(_report(config={"max_error": 0.01, "mode": "train"},
                                 capture={"ok": False, "reason": TRAIN_NO_PASSES}))
    assert "No graph passes in `--mode train`" in md and "Graph capture failed" not in md
    assert "Graph capture failed" in render_markdown(_report(capture={"ok": False, "reason": "export failed"}))


def test_latency_objective_reports_p99():
    from tctune.report import render_markdown

    best = {"params": {"precision": "bf16", "batch_size": 8, "graph_passes": False}, "throughput": 100.0,
            "latency_ms": 2.0, "latency_p99_ms": 3.5, "max_rel_error": 1e-3}
    md = render_markdown(_report(config={"max_error": 0.01, "mode": "infer", "objective": "latency"}, best=best))
    assert "p99 latency (the objective): 3.5 ms per batch" in md


def test_enumerated_space_says_how_many_trials_run_then_that_all_are_measured(tiny, tmp_path, caplog):
    import re

    t = tuner(tiny, tmp_path, trials=50)
    n = t.space_size()
    with caplog.at_level("INFO", logger="tctune"):
        study = t.run()
    # the plain baselines ran first (not counted in --trials): they measured some of the candidates
    left = n - len({json.dumps(tr.params, sort_keys=True) for tr in study.trials if tr.user_attrs.get("baseline")})
    assert 0 < left < n
    assert (f"this search space has {n} candidates, {left} not tried yet ({n - left} measured so far): at most "
            f"{left} searched trials run") in caplog.text
    assert "--trials" not in caplog.text  # the library names no flag (the user may not have given one)
    before = len(study.trials)
    caplog.clear()
    with caplog.at_level("INFO", logger="tctune"):
        study = tuner(tiny, tmp_path, trials=50).run()
    assert f"all {n} candidates of this search space were already tried ({n} measured)" in caplog.text
    assert len(study.trials) == before  # nothing added


def test_a_resumed_study_says_a_pruned_candidate_was_stopped_early_not_measured(tiny, tmp_path, caplog):
    """A pruned trial is final, as in Optuna (its samplers never propose it again), so a resumed run does not run
    it again; the console and the report call it stopped early by the pruner, never measured."""
    from optuna.distributions import CategoricalDistribution

    from tctune.report import study_counts, trial_record

    t = tuner(tiny, tmp_path, trials=50)
    n = t.space_size()
    study = t.create_study()
    space = t.space()
    params = t.candidate(batch_size=16, precision="fp32", graph_passes=True, runtime="eager")
    study.add_trial(optuna.trial.create_trial(
        state=optuna.trial.TrialState.PRUNED, params=params, intermediate_values={0: 1.0, 1: 1.0},
        distributions={k: CategoricalDistribution(space[k]) for k in params},
        user_attrs={"fail_reason": "stopped early: 1 items/s after 2 repeat(s), in the slowest quarter"}))
    with caplog.at_level("INFO", logger="tctune"):
        study = t.run()
    key = json.dumps(params, sort_keys=True)
    assert sum(json.dumps(tr.params, sort_keys=True) == key for tr in study.trials) == 1  # not run again
    assert f"every one of the {n} candidates of this search space was tried: {n - 1} measured, 1 stopped early " \
           "by the pruner (a partial measurement" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="tctune"):
        study = tuner(tiny, tmp_path, trials=50).run()
    assert f"all {n} candidates of this search space were already tried ({n - 1} measured, 1 stopped early by " \
           "the pruner" in caplog.text
    assert "are already measured" not in caplog.text
    rows = [trial_record(tr) for tr in study.trials]
    counts = study_counts({"n_trials": len(rows)}, rows)
    assert "1 stopped early by the pruner" in counts and "skipped" not in counts


def test_noise_line_names_its_two_trials_and_is_not_said_when_the_best_is_the_baseline():
    from tctune.report import render_markdown

    base = {"number": 0, "state": "COMPLETE", "params": {"precision": "fp32", "batch_size": 8, "graph_passes": False},
            "throughput": 100.0,
            "latency_ms": 2.0, "max_rel_error": 0.0, "repeats_ms": [2.0, 2.1, 2.2]}
    best = {"number": 3, "state": "COMPLETE", "params": {"precision": "bf16", "batch_size": 8, "graph_passes": False},
            "throughput": 104.0,
            "latency_ms": 1.9, "max_rel_error": 1e-3, "repeats_ms": [1.8, 1.9, 2.1], "speedup_vs_baseline": 1.04}
    from tctune.report import TRIAL_FIELDS
    for row in (base, best):  # the trials table reads every field
        for k in (*TRIAL_FIELDS, "fail_reason"):
            row.setdefault(k, None)
    baseline = {"trial": 0, "batch_size": 8, "throughput": 100.0}
    md = render_markdown(_report(best=dict(best, trial=3), baseline=baseline, trials=[base, best]))  # best.trial: its number
    assert "the repeats of the best (trial 3) and of its FP32 eager baseline (trial 0)" in md
    same = dict(base, trial=0, speedup_vs_baseline=1.0)
    assert "Within measurement noise" not in render_markdown(_report(best=same, baseline=baseline, trials=[base]))


@pytest.mark.parametrize("mode", ["infer", "train"])
def test_finalists_are_re_measured_in_both_modes(tmp_path, monkeypatch, mode):
    """Every finalist is timed again after the trials, whatever the evaluator (inference or training step), and
    the report holds each re-measured throughput (a rejected re-run would leave None there)."""
    _every_feasible_trial_is_a_finalist(monkeypatch)
    f = tmp_path / "trainable.py"
    f.write_text(TRAINABLE)
    report = optimize(f, TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4, 8), trials=4, quiet=True,
                                    export=False, prune=False, mode=mode))
    conf = report["confirmation"]
    feasible = [t for t in report["trials"] if t["feasible"]]
    assert len(feasible) >= 3 and conf and sorted(conf["runs"]) == sorted(str(t["number"]) for t in feasible)
    assert all(len(v) == 2 and v[1] is not None and v[1] > 0 for v in conf["runs"].values()), conf
    assert str(report["best"]["trial"]) in conf["runs"] and report["best"]["confirmed_throughput"] > 0
    # inference: chosen side by side among the finalists and the plain baselines; training: on the confirmed means
    assert report["best"]["chosen_on"] == ("side-by-side median" if mode == "infer" else "confirmed mean")


def test_best_line_gives_the_latency_of_the_timing_it_was_chosen_on():
    """The "Best:" line's ms per batch comes from the same timing as its items/s (the side-by-side median), not
    from the trial's first timing (fresh-user finding: 6265 items/s beside 160 ms per batch at batch 8)."""
    from tctune.report import render_markdown

    best = {"params": {"precision": "fp32", "batch_size": 8, "graph_passes": False}, "throughput": 50.0,
            "chosen_throughput": 6400.0, "chosen_on": "side-by-side median", "latency_ms": 160.0,
            "max_rel_error": 0.0}
    md = render_markdown(_report(config={"max_error": 0.01, "mode": "infer"}, best=best))
    assert "6400 items/s (side-by-side median), 1.25 ms per batch" in md


def test_a_candidates_setup_time_is_its_build_plus_its_runtime_setup(tiny, tmp_path):
    """setup_s (report.md's setup column) is measured: building tctune's graph (its passes) plus the runtime's
    setup, which is none for eager; it was always 0.0 for eager candidates."""
    t = tuner(tiny, tmp_path)
    m = t.evaluate(t.candidate(batch_size=4, precision="fp32", graph_passes=True, runtime="eager"))
    assert m["compile_s"] == 0.0 and m["build_s"] > 0 and m["setup_s"] == m["build_s"] + m["compile_s"]


def test_a_model_that_fails_at_one_batch_size_is_counted_honestly(tmp_path, caplog):
    """The candidates at the batch size the model cannot run fail; the closing line counts them as failed, not as
    measured (it said "every one of the N candidates ... is measured")."""
    from tctune.search.storage import outcome_counts

    f = tmp_path / "small_only.py"
    f.write_text("import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                 "        self.fc = torch.nn.Linear(6, 3)\n    def forward(self, x):\n"
                 "        if x.shape[0] > 8:\n            raise ValueError('at most 8 rows')\n        return self.fc(x)\n"
                 "def build_model():\n    return M()\ndef example_inputs(b):\n    return (torch.randn(b, 6),)\n")
    t = tuner(f, tmp_path, trials=50)
    with caplog.at_level("INFO", logger="tctune"):
        study = t.run()
    counts = outcome_counts(study)
    assert counts["failed"] >= 1 and counts["measured"] >= 1
    words = f"{counts['measured']} measured, {counts['failed']} failed"
    assert f"every one of the {t.space_size()} candidates of this search space was tried: {words}" in caplog.text
    assert "is measured" not in caplog.text
