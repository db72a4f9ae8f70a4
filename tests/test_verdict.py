"""The final choice: a tctune candidate is recommended only when the side-by-side timing shows it faster than the
fastest plain baseline at its batch size with a 95 % CI above 1.0; otherwise the plain baseline is the answer."""
import random

import optuna
import pytest

from tctune.report import build_report, render_markdown
from tctune.search import best_trial
from tctune.search.baselines import baseline_label
from tctune.search.results import VERDICT_RULE, headline, verdict


def _add(study, params, throughput, **attrs):
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions={k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()},
        value=throughput, user_attrs={"throughput": throughput, "max_rel_error": 0.0, "run_id": "r", **attrs}))
    return study.trials[-1].number


def _study(speedup: float, noise: float, rounds: int = 15, seed: int = 0):
    """A study with a cast_fp16 baseline and a tctune graph at batch 64, timed side by side: each per-round ms
    is scaled by a factor spread evenly over ±``noise`` (median 1), the two entries' factors shuffled
    independently over the rounds (``seed``), so the median speedup is exactly ``speedup`` and the spread sets
    its confidence interval."""
    rng = random.Random(seed)
    study = optuna.create_study(direction="maximize")
    p = {"batch_size": 64, "precision": "fp16", "graph_passes": False, "runtime": "eager"}
    fp32 = _add(study, dict(p, precision="fp32"), 400.0, baseline="fp32_eager")
    cast = _add(study, p, 1000.0, baseline="cast_fp16", model_cast=True)
    cand = _add(study, dict(p, graph_passes=True), 1000.0 * speedup, description="tctune graph fp16")
    spread = [noise * (2 * i / (rounds - 1) - 1) for i in range(rounds)]  # -noise .. +noise, median 0
    base_f, cand_f = rng.sample(spread, rounds), rng.sample(spread, rounds)  # the rounds' order: independent
    base_ms = [64.0 * (1 + f) for f in base_f]
    cand_ms = [64.0 / speedup * (1 + f) for f in cand_f]  # median ratio exactly `speedup`
    fp32_ms = [160.0] * rounds

    def entry(n, name, ms):
        med = sorted(ms)[len(ms) // 2]
        return {"trial": n, "baseline": name, "batch_size": 64, "throughput": 64 / (med / 1e3), "median_ms": med,
                "rounds_ms": ms, "error": None}

    study.set_user_attr("run_id", "r")
    study.set_user_attr("side_by_side", {"run_id": "r", "after_trial": cand, "rounds": rounds, "block_s": 0.05,
                                         "clocks": {"available": False, "reason": "test"}, "entries": [
        entry(cand, None, cand_ms), entry(cast, "cast_fp16", base_ms), entry(fp32, "fp32_eager", fp32_ms)]})
    return study, fp32, cast, cand


def _report(study):
    return build_report(study, hardware={}, measured_on="cpu", config={"max_error": 0.01, "mode": "infer"},
                        model={"name": "m", "path": "m.py"}, passes=[], artifacts={}, capture={"ok": True})


def test_a_candidate_whose_ci_includes_one_loses_to_the_baseline(tmp_path):
    from tctune.cli.optimize import _summary

    study, _, cast, cand = _study(speedup=1.005, noise=0.05)
    sbs = {e["trial"]: e["throughput"] for e in study.user_attrs["side_by_side"]["entries"]}
    assert sbs[cand] > sbs[cast]  # faster by its median ...
    v = verdict(study)
    c = v["challenger"]
    assert c["trial"] == cand and c["ci95"][0] <= 1.0 < c["ci95"][1]  # ... but the CI includes 1.0
    assert v["kind"] == "baseline" and v["trial"].number == cast and v["name"] == "cast_fp16"
    assert best_trial(study).number == cast and v["rule"] == VERDICT_RULE
    best = _report(study)["best"]
    assert best["trial"] == cast and best["kind"] == "baseline" and best["name"] == "cast_fp16"
    assert best["speedup_vs_best_baseline"] == 1.0 and best["speedup_ci95"] is None  # by definition
    assert best["best_baseline"]["trial"] == cast
    line = (f"no tctune candidate was measurably faster than model.half() eager at batch 64 ({c['speedup']:.2f}×, "
            f"95 % CI {c['ci95'][0]:.2f}–{c['ci95'][1]:.2f}, which includes 1.0): use it")
    assert best["verdict"]["reason"] == line
    assert line in render_markdown(_report(study)) and line in _summary(_report(study), tmp_path)


def test_a_candidate_faster_with_a_tight_ci_wins():
    study, _, cast, cand = _study(speedup=1.3, noise=0.02)
    v = verdict(study)
    assert v["kind"] == "tctune" and v["trial"].number == cand and v["challenger"]["against"] == cast
    assert v["challenger"]["ci95"][0] > 1.0
    best = _report(study)["best"]
    assert best["kind"] == "tctune" and best["trial"] == cand and best["name"] == "tctune graph fp16"
    assert best["speedup_vs_best_baseline"] == pytest.approx(1.3, rel=0.05) and best["speedup_ci95"][0] > 1.0
    assert best["verdict"]["reason"].startswith(f"{best['speedup_vs_best_baseline']:.2f}× model.half() eager at batch 64")


@pytest.mark.parametrize("speedup,noise", [(0.9, 0.01), (0.99, 0.1), (1.0, 0.0), (1.005, 0.05), (1.02, 0.2),
                                           (1.3, 0.02), (2.0, 0.3)])
def test_the_final_speedup_is_never_below_one(speedup, noise):
    for seed in range(3):
        study, _, cast, cand = _study(speedup, noise, seed=seed)
        h = headline(study)
        assert h["speedup_vs_best_baseline"] >= 1.0
        if h["kind"] == "tctune":
            assert h["speedup_ci95"][0] > 1.0 and h["speedup_vs_best_baseline"] > 1.0
        else:
            assert h["speedup_vs_best_baseline"] == 1.0


def _with_baseline_at_128(study, throughput, name="autocast_bf16"):
    p = {"batch_size": 128, "precision": "bf16", "graph_passes": False, "runtime": "eager"}
    other = _add(study, p, throughput, baseline=name)
    sbs = study.user_attrs["side_by_side"]
    ms = 128 / throughput * 1e3
    sbs["entries"].append({"trial": other, "baseline": name, "batch_size": 128, "throughput": throughput,
                           "median_ms": ms, "rounds_ms": [ms] * 15, "error": None})
    sbs["after_trial"] = other
    study.set_user_attr("side_by_side", sbs)
    return other


def test_the_recommended_baseline_is_the_fastest_one_side_by_side():
    """A faster baseline at another batch is the answer; the sentence compares at its batch only."""
    study, fp32, cast, cand = _study(speedup=1.005, noise=0.05)
    other = _with_baseline_at_128(study, 1280.0)
    v = verdict(study)
    assert v["trial"].number == other and v["challenger"]["against"] == cast  # the fastest candidate's own comparison
    assert v["reason"] == ("use autocast bf16 eager at batch 128: faster side by side than every tctune candidate "
                           "(none was timed at batch 128)")
    assert headline(study)["speedup_vs_best_baseline"] == 1.0


def test_a_candidate_turned_down_at_another_batch_gets_its_own_clause():
    """The candidate at 64 is faster by its median than the answer at 128 but not measurably faster than the
    baseline at 64: the verdict names each batch with its own comparison, never one ratio across batches."""
    study, fp32, cast, cand = _study(speedup=1.005, noise=0.05)
    sbs = {e["trial"]: e["throughput"] for e in study.user_attrs["side_by_side"]["entries"]}
    other = _with_baseline_at_128(study, (sbs[cand] + sbs[cast]) / 2)  # between the two at batch 64
    v = verdict(study)
    c = v["challenger"]
    assert v["trial"].number == other and c["trial"] == cand and c["against"] == cast and c["batch_size"] == 64
    assert v["reason"] == ("use autocast bf16 eager at batch 128, the fastest plain baseline side by side (no tctune "
                           "candidate was timed at batch 128); at batch 64, the fastest tctune candidate "
                           f"(trial {cand}) was not measurably faster than model.half() eager at batch 64 "
                           f"({c['speedup']:.2f}×, 95 % CI {c['ci95'][0]:.2f}–{c['ci95'][1]:.2f}, which includes 1.0)")
    assert f"- The fastest tctune candidate: trial {cand} at batch 64 (" in render_markdown(_report(study))


def test_a_baseline_answer_is_compared_with_the_candidates_at_its_own_batch():
    """The answer at batch 128 is judged against the tctune candidate timed at 128, not the one at 64."""
    study, fp32, cast, cand = _study(speedup=0.95, noise=0.01)
    p = {"batch_size": 128, "precision": "bf16", "graph_passes": False, "runtime": "eager"}
    other = _add(study, p, 1280.0, baseline="autocast_bf16")
    at128 = _add(study, dict(p, graph_passes=True), 1250.0, description="tctune graph bf16")
    sbs = study.user_attrs["side_by_side"]
    sbs["entries"] += [
        {"trial": other, "baseline": "autocast_bf16", "batch_size": 128, "throughput": 1280.0,
         "median_ms": 100.0, "rounds_ms": [100.0 * (1 + 0.001 * (i % 3)) for i in range(15)], "error": None},
        {"trial": at128, "baseline": None, "batch_size": 128, "throughput": 1250.0,
         "median_ms": 102.4, "rounds_ms": [102.4 * (1 + 0.001 * (i % 2)) for i in range(15)], "error": None}]
    sbs["after_trial"] = at128
    study.set_user_attr("side_by_side", sbs)
    v = verdict(study)
    c = v["challenger"]
    assert v["trial"].number == other and c["trial"] == at128 and c["against"] == other
    assert c["batch_size"] == c["against_batch_size"] == 128 and c["speedup"] < 1.0
    assert v["reason"] == (f"no tctune candidate beat autocast bf16 eager at batch 128 ({c['speedup']:.2f}×, 95 % CI "
                           f"{c['ci95'][0]:.2f}–{c['ci95'][1]:.2f}): use it")
    assert "batch 64" not in v["reason"]


def test_without_a_side_by_side_timing_a_slower_candidate_is_not_recommended():
    study = optuna.create_study(direction="maximize")
    p = {"batch_size": 8, "precision": "fp32", "graph_passes": False, "runtime": "eager"}
    base = _add(study, p, 1000.0, baseline="fp32_eager")
    cand = _add(study, dict(p, graph_passes=True), 1100.0)
    assert verdict(study)["kind"] == "tctune" and best_trial(study).number == cand
    other = _add(study, dict(p, graph_passes=True, precision="bf16"), 1080.0)
    study.set_user_attr("confirmation", {"band": 0.05, "after_trial": other, "runs": {str(cand): [1100.0, 700.0],
                                                                                     str(other): [1080.0, 600.0]}})
    v = verdict(study)  # the best confirmed mean, 900, is below the baseline's 1000
    assert v["kind"] == "baseline" and v["trial"].number == base and "no confidence interval" in v["reason"]


def test_baseline_labels():
    assert baseline_label("cast_fp16") == "model.half() eager"
    assert baseline_label("cast_bf16") == "model.to(torch.bfloat16) eager"
    assert baseline_label("compile_autocast_bf16") == "torch.compile(autocast bf16)"
    assert baseline_label("fp32_eager") == "FP32 eager" and baseline_label("something") == "something"


@pytest.mark.parametrize("order", [("cast_fp16", "autocast_fp16", "compile_cast_fp16"),
                                   ("compile_cast_fp16", "cast_fp16", "autocast_fp16")])
def test_equally_fast_baselines_resolve_to_the_simpler_one_whatever_their_trial_order(order):
    """Exact ties: autocast before the model cast before torch.compile (BASELINE_PREFERENCE), not trial order."""
    study = optuna.create_study(direction="maximize")
    p = {"batch_size": 16, "precision": "fp16", "graph_passes": False, "runtime": "eager"}
    numbers = {}
    for name in order:
        numbers[name] = _add(study, dict(p, runtime="inductor" if name.startswith("compile") else "eager"), 500.0,
                             baseline=name, **({"model_cast": True} if "cast_" in name else {}))
    cand = _add(study, dict(p, graph_passes=True), 500.0)
    assert verdict(study)["trial"].number == numbers["autocast_fp16"]  # first timings tie too
    study.set_user_attr("run_id", "r")
    study.set_user_attr("side_by_side", {"run_id": "r", "after_trial": cand, "entries": [
        {"trial": n, "baseline": None, "batch_size": 16, "throughput": 500.0, "rounds_ms": [32.0] * 5}
        for n in [*numbers.values(), cand]]})
    v = verdict(study)
    assert v["kind"] == "baseline" and v["trial"].number == numbers["autocast_fp16"]
    h = headline(study)
    assert h["speedup_vs_best_baseline"] == 1.0 and h["best_baseline_any_batch"]["name"] == "autocast_fp16"


def test_preference_order():
    from tctune.search.baselines import preference

    names = ["compile_autocast_bf16", None, "cast_bf16", "autocast_bf16", "fp32_eager"]
    ranked = sorted(names, key=lambda n: preference(100.0, n, 8, 0))
    assert ranked == ["fp32_eager", "autocast_bf16", "cast_bf16", "compile_autocast_bf16", None]
    assert preference(101.0, None, 8, 0) < preference(100.0, "fp32_eager", 8, 0)  # faster first
    assert preference(100.0, "fp32_eager", 8, 5) < preference(100.0, "fp32_eager", 32, 1)  # then the smaller batch


def test_a_run_stopped_after_the_baselines_claims_no_win():
    """Only plain baselines finished (an interrupted run): the verdict says no tctune candidate was measured, and
    report.md's Result starts with the interruption instead of "A plain baseline wins"."""
    study = optuna.create_study(direction="maximize")
    p = {"batch_size": 8, "precision": "fp32", "graph_passes": False, "runtime": "eager"}
    _add(study, p, 100.0, baseline="fp32_eager")
    fast = _add(study, dict(p, precision="bf16"), 5000.0, baseline="autocast_bf16")
    v = verdict(study)
    assert v["candidates_measured"] is False and v["trial"].number == fast
    assert v["reason"] == ("no tctune candidate was measured; the fastest plain baseline measured so far is "
                           "autocast bf16 eager at batch 8")
    report = build_report(study, hardware={}, measured_on="cpu", config={"max_error": 0.01, "mode": "infer"},
                          model={"name": "m", "path": "m.py"}, passes=[], artifacts={"best_config": "b.json"},
                          capture={"ok": True}, extra={"interrupted": True})
    md = render_markdown(report)
    result = md.split("## Result", 1)[1].strip()
    assert result.startswith("**The run was interrupted**")
    assert "A plain baseline wins" not in md
    assert ("**No tctune candidate was measured before the run stopped**: the fastest plain baseline measured so "
            "far is autocast bf16 eager at batch 8") in result
    assert "`best_config.json` holds the answer so far" in md
    # once a candidate was measured (here: slower), the baseline answer is a win again
    _add(study, dict(p, graph_passes=True), 90.0, description="tctune graph fp32")
    v = verdict(study)
    assert v["candidates_measured"] is True and "was the fastest: use it" in v["reason"]


def test_the_top_level_baseline_has_the_baselines_entry_fields_each_labelled():
    """report.json's ``baseline`` is FP32 eager's ``baselines`` entry (first timing: throughput, latency_ms) plus the
    number the speedup divides by, labelled by its timing; no field mixes two timings unlabelled."""
    study, fp32, cast, cand = _study(speedup=1.3, noise=0.02)
    report = _report(study)
    base = report["baseline"]
    entry = next(b for b in report["baselines"] if b["trial"] == fp32)
    assert {k: base[k] for k in entry} == entry  # same fields, same values, same meaning
    sbs = {e["trial"]: e["throughput"] for e in study.user_attrs["side_by_side"]["entries"]}
    assert base["throughput"] == 400.0 and base["side_by_side_throughput"] == sbs[fp32]
    assert base["compared_throughput"] == sbs[fp32] and base["compared_on"] == "side-by-side median"
    assert report["best"]["speedup_vs_baseline"] == pytest.approx(sbs[cand] / base["compared_throughput"])
    assert base["timings"]["latency_ms"].startswith("first timing")
    assert base["timings"]["side_by_side_throughput"].startswith("side-by-side median")
    line = next(x for x in render_markdown(report).splitlines() if x.startswith("- Against FP32 eager"))
    assert line.endswith("items/s, side-by-side median).")


def _two_baselines(ratio: float, noise: float, rounds: int = 15, seed: int = 1, side_by_side: bool = True):
    """FP32 eager and autocast bf16 at batch 16, autocast ``ratio``× faster by its median, each per-round (or
    per-repeat) ms scaled by factors spread over ±``noise``, shuffled independently; one slower tctune candidate."""
    rng = random.Random(seed)
    spread = [noise * (2 * i / (rounds - 1) - 1) for i in range(rounds)]
    f32_ms = [100.0 * (1 + f) for f in rng.sample(spread, rounds)]
    bf_ms = [100.0 / ratio * (1 + f) for f in rng.sample(spread, rounds)]
    cand_ms = [150.0 * (1 + f) for f in rng.sample(spread, rounds)]
    study = optuna.create_study(direction="maximize")
    p = {"batch_size": 16, "precision": "fp32", "graph_passes": False, "runtime": "eager"}
    f32 = _add(study, p, 160.0, baseline="fp32_eager", repeats_ms=f32_ms)
    bf = _add(study, dict(p, precision="bf16"), 160.0 * ratio, baseline="autocast_bf16", repeats_ms=bf_ms)
    cand = _add(study, dict(p, graph_passes=True), 160.0 / 1.5, description="tctune graph", repeats_ms=cand_ms)
    if side_by_side:
        def entry(n, ms):
            med = sorted(ms)[len(ms) // 2]
            return {"trial": n, "batch_size": 16, "throughput": 16 / (med / 1e3), "rounds_ms": ms, "error": None}
        study.set_user_attr("run_id", "r")
        study.set_user_attr("side_by_side", {"run_id": "r", "after_trial": cand, "entries": [
            entry(f32, f32_ms), entry(bf, bf_ms), entry(cand, cand_ms)]})
    return study, f32, bf


@pytest.mark.parametrize("side_by_side", [True, False])
def test_a_lossy_baseline_not_measurably_faster_than_fp32_eager_is_not_recommended(side_by_side):
    """autocast bf16 is 1.01× FP32 eager by its median but within the noise: FP32 eager is the answer, and the
    sentence says why (side by side: the CI; without it: the timing repeats overlap)."""
    study, f32, bf = _two_baselines(1.01, noise=0.3, side_by_side=side_by_side)
    v = verdict(study)
    assert v["kind"] == "baseline" and v["trial"].number == f32
    assert "autocast bf16 eager" in v["reason"] and "not measurably faster than FP32 eager" in v["reason"]
    if side_by_side:
        assert "which includes 1.0" in v["reason"] and v["reason"].count("use FP32 eager at batch 16") == 1
        assert headline(study)["best_baseline"]["trial"] == f32


@pytest.mark.parametrize("side_by_side", [True, False])
def test_a_lossy_baseline_measurably_faster_than_fp32_eager_is_recommended(side_by_side):
    study, f32, bf = _two_baselines(1.5, noise=0.05, side_by_side=side_by_side)
    v = verdict(study)
    assert v["kind"] == "baseline" and v["trial"].number == bf
    assert "not measurably faster" not in v["reason"]


def test_a_feasible_candidate_not_timed_at_the_answers_batch_is_named_not_beaten():
    """A searched trial at batch 128 (e.g. of an earlier run) was not in the side-by-side timing: the sentence says
    it was not compared instead of "faster than every tctune candidate"."""
    study, fp32, cast, cand = _study(speedup=1.005, noise=0.05)
    old = _add(study, {"batch_size": 128, "precision": "bf16", "graph_passes": True, "runtime": "eager"}, 900.0,
               description="tctune graph bf16", run_id="earlier")
    other = _with_baseline_at_128(study, 1280.0)
    v = verdict(study)
    assert v["trial"].number == other
    assert v["reason"] == (f"use autocast bf16 eager at batch 128, the fastest plain baseline side by side; the "
                           f"feasible tctune candidate(s) at batch 128 (trial {old}) were not timed side by side in "
                           "this run, so they are not compared (numbers of two timings are never divided)")


def test_the_side_by_side_timing_includes_a_candidate_at_the_fastest_baselines_batch():
    """The fastest baseline can be the answer: the fastest feasible searched trial at its batch size (of any run)
    is timed beside it, even when its first timing is outside the finalists' band."""
    from types import SimpleNamespace

    from tctune.search.loop import Tuner

    study, fp32, cast, cand = _study(speedup=1.005, noise=0.05)
    p = {"batch_size": 128, "precision": "bf16", "graph_passes": False, "runtime": "eager"}
    fast = _add(study, p, 5000.0, baseline="autocast_bf16")
    slow = _add(study, dict(p, graph_passes=True), 900.0, description="tctune graph bf16", run_id="earlier")
    numbers = [t.number for t in Tuner.side_by_side_entries(SimpleNamespace(cfg=SimpleNamespace(
        objective="throughput")), study)]
    assert fast in numbers and slow in numbers and cand in numbers


@pytest.mark.parametrize("side_by_side", [True, False])
def test_the_any_batch_line_agrees_with_a_verdict_that_kept_fp32_eager(side_by_side):
    """autocast bf16 is faster by its median but not measurably: the line about the fastest baseline at any batch
    says so (its speedup over the answer, >= 1.0, and why it is not the answer), never "the best is 0.99× it"."""
    study, f32, bf = _two_baselines(1.01, noise=0.3, side_by_side=side_by_side)
    if side_by_side:
        sbs = study.user_attrs["side_by_side"]
        sbs.update(rounds=15, block_s=0.05, clocks={"available": False, "reason": "test"})
        study.set_user_attr("side_by_side", sbs)
    report = _report(study)
    best = report["best"]
    assert best["trial"] == f32 and best["best_baseline_any_batch"]["trial"] == bf
    over = best["best_baseline_any_batch"]["over_best"]
    assert over["measurably_faster"] is False and over["speedup"] > 1.0
    assert (over["ci95"] is not None and over["ci95"][0] <= 1.0 < over["ci95"][1]) == side_by_side
    line = next(x for x in render_markdown(report).splitlines()
                if x.startswith("- The fastest plain baseline at any searched batch size"))
    assert f"autocast_bf16 at batch 16, {best['best_baseline_any_batch']['throughput']:.4g} items/s, " in line
    assert f"{over['speedup']:.2f}× the answer (" in line and "not measurably faster, so FP32 eager stays the answer" in line
    assert ("which includes 1.0" in line) == side_by_side and "× it)" not in line
    assert not any(f"{r:.2f}×" in line for r in (0.97, 0.98, 0.99))  # no ratio below 1.0


def test_the_any_batch_line_of_a_measurably_faster_winner_is_unchanged():
    study, f32, bf = _two_baselines(1.5, noise=0.05, side_by_side=False)
    best = _report(study)["best"]
    assert best["trial"] == bf and "over_best" not in (best["best_baseline_any_batch"] or {})
    line = next(x for x in render_markdown(_report(study)).splitlines()
                if x.startswith("- The fastest plain baseline at any searched batch size"))
    assert line.endswith("(the best is 1.00× it).")


def test_a_baseline_answer_because_every_candidate_failed_says_why(tmp_path):
    # Every searched candidate failed (here: the user's score() raised on each graph): the verdict, the console
    # and report.md name the most common reasons, not only "no tctune candidate was timed side by side".
    from tctune.cli.optimize import _summary

    study = optuna.create_study(direction="maximize")
    p = {"batch_size": 8, "precision": "fp32", "graph_passes": False, "runtime": "eager"}
    fp32 = _add(study, p, 400.0, baseline="fp32_eager")
    for prec, extra in (("bf16", 1), ("bf16", 2), ("fp32", 3)):
        study.add_trial(optuna.trial.create_trial(
            params=dict(p, precision=prec, graph_passes=True),
            distributions={k: optuna.distributions.CategoricalDistribution([v])
                           for k, v in dict(p, precision=prec, graph_passes=True).items()},
            state=optuna.trial.TrialState.FAIL,
            user_attrs={"run_id": "r", "fail_kind": "runtime_error",
                        "fail_reason": f"score(model) raised on the {prec} candidate: KeyError: 'net{extra}'"}))
    v = verdict(study)
    assert v["kind"] == "baseline" and v["trial"].number == fp32
    assert v["reason"].endswith("; none of the 3 tctune candidates measured qualified: score(model) raised on the "
                                "bf16 candidate: KeyError: 'net1' (2 candidates); score(model) raised on the fp32 "
                                "candidate: KeyError: 'net3' (1 candidate)")
    rep = _report(study)
    assert v["reason"] in render_markdown(rep) and v["reason"] in _summary(rep, tmp_path)
    # one candidate that qualified: no such clause
    _add(study, dict(p, graph_passes=True), 300.0, description="tctune graph fp32")
    assert "none of the" not in verdict(study)["reason"]
