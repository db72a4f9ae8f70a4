"""report.md's header and counts, the console summary's counts, and reprs a user reads: which accuracy rule
decides (stated once), scores printed with their decimals, pruned trials not read as failures, and a
``TrialParams`` that shows calibration only where it applies."""
from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from tctune.report import accuracy_rule_line, build_report, render_markdown, study_counts
from tctune.search.accuracy import ScoreGate, format_score
from tctune.trial import TrialParams


def _study(states=("COMPLETE",) * 3 + ("PRUNED",) * 2, score=None):
    study = optuna.create_study(direction="maximize")
    for i, state in enumerate(states):
        params = {"batch_size": 8, "precision": "fp32" if i == 0 else "bf16", "graph_passes": i > 1, "runtime": "eager"}
        dist = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
        attrs = {"run_id": "r", "max_rel_error": 1e-3 * i, "float_outputs": 1, "description": f"trial {i}"}
        if i == 0:
            attrs["baseline"] = "fp32_eager"
        if score is not None:
            attrs.update(score=score, score_ratio=1.0, score_fp32=score, score_limit=0.99 * score)
        if state == "COMPLETE":
            attrs["throughput"] = 100.0 + i
            study.add_trial(optuna.trial.create_trial(params=params, distributions=dist, value=100.0 + i,
                                                      user_attrs=attrs))
        else:
            study.add_trial(optuna.trial.create_trial(params=params, distributions=dist, user_attrs=attrs,
                                                      state=getattr(optuna.trial.TrialState, state)))
    study.set_user_attr("run_id", "r")
    return study


def _report(study, **extra):
    return build_report(study, hardware={"name": "cpu"}, measured_on="cpu",
                        config={"max_error": 0.01, "max_error_fp8": 0.05, "mode": "infer", "max_mismatch_rate": 0.0,
                                "min_score_ratio": 0.99},
                        model={"name": "m", "path": "m.py"}, passes=[], artifacts={}, capture={"ok": True},
                        extra=extra or None)


def test_format_score_keeps_the_decimals_of_an_integral_score():
    assert format_score(1.0) == "1.000" and format_score(100.0) == "100.0" and format_score(1234.0) == "1234"
    assert format_score(0.97123) == "0.9712" and format_score(0.95) == "0.95" and format_score(-2.0) == "-2.000"
    assert format_score(None) == "–"
    gate = ScoreGate(lambda m: 1.0, min_score_ratio=0.99)
    gate.fp32 = 1.0
    assert gate.rule() == "score >= 0.99 x 1.000 (FP32) = 0.99"


def test_the_header_states_the_deciding_rule_once_relative_l2():
    r = _report(_study())
    line = accuracy_rule_line(r)
    assert line == ("Accuracy rule: relative L2 error ≤ 0.01 against FP32 eager on fresh random inputs; integer and "
                    "bool outputs must match exactly")  # no fp8 limit where no fp8 was searched
    md = render_markdown(r)
    assert f"- {line}" in md and "Accuracy limit" not in md and "Score gate:" not in md


def test_the_header_states_the_deciding_rule_once_score():
    score = {"fp32": 1.0, "rule": "score >= 0.99 x 1.000 (FP32) = 0.99", "calls": 3, "seconds": 1.5,
             "cached_graphs": 3}
    r = _report(_study(score=1.0), score=score)
    md = render_markdown(r)
    head = md.split("## Result")[0]
    assert ("- Accuracy rule: the model file's score(model) decides, for every precision: score >= 0.99 x 1.000 "
            "(FP32) = 0.99 (FP32 score 1.000); the relative L2 error against FP32 eager on fresh random inputs is "
            "reported, not a limit;") in head
    assert "≤ 0.01" not in head and "reported, not deciding" not in head  # the L2 limit is not stated as a rule
    assert " 1 " not in head and "(1)" not in head  # no bare "1" for the FP32 score
    trials = md.split("## Trials")[1]
    assert "| 1.000 (1.000) |" in trials  # the score column: score (ratio to FP32)


def test_pruned_trials_are_not_read_as_failures(tmp_path):
    from tctune.cli.optimize import _summary

    r = _report(_study(states=("COMPLETE",) * 3 + ("PRUNED",) * 2 + ("FAIL",)))
    assert study_counts(r["study"], r["trials"]) == "6 trials: 3 complete, 2 stopped early by the pruner, 1 failed"
    assert "6 trials: 3 complete, 2 stopped early by the pruner, 1 failed" in render_markdown(r)
    assert "(the study: 6 trials: 3 complete, 2 stopped early by the pruner, 1 failed)" in _summary(r, tmp_path)
    assert study_counts({"n_trials": 1, "n_complete": 1}, None) == "1 trials (1 complete)"


def test_a_skipped_trial_is_not_counted_as_stopped_by_the_pruner():
    rows = [{"state": "COMPLETE"}, {"state": "PRUNED", "fail_kind": None},
            {"state": "PRUNED", "fail_kind": "skipped"}, {"state": "PRUNED", "fail_kind": "skipped"}]
    assert study_counts({"n_trials": 4}, rows) == "4 trials: 1 complete, 1 stopped early by the pruner, 2 skipped (not run)"


def test_trial_params_repr_shows_calibration_only_where_it_applies():
    assert repr(TrialParams(batch_size=8, precision="fp32")) == (
        "TrialParams(batch_size=8, precision='fp32', graph_passes=False, runtime='eager', policy='autocast', "
        "memory_format='contiguous')")
    assert "calibration" not in repr(TrialParams(batch_size=8, precision="bf16", graph_passes=True))
    assert "calibration" not in repr(TrialParams(batch_size=8, precision="fp16"))  # the model as written: no build
    assert repr(TrialParams(batch_size=8, precision="fp16", graph_passes=True, calibration=False)).endswith(
        "calibration=False)")
    fp8 = TrialParams(batch_size=8, precision="fp8", graph_passes=True, fp8_keep=("lm_head",))
    assert "fp8_keep=('lm_head',)" in repr(fp8) and "calibration" not in repr(fp8)
    assert TrialParams.from_dict(TrialParams(batch_size=8, precision="fp16").to_dict()).calibration is True


def _noisy_study(repeats_ms, speedups=(1.0, 1.01, 1.02)):
    """FP32 eager (trial 0), autocast bf16 (trial 1) and a tctune graph (trial 2), all at batch 8 and with the
    same repeats; throughputs 100 x ``speedups``."""
    study = optuna.create_study(direction="maximize")
    for i, sp in enumerate(speedups):
        params = {"batch_size": 8, "precision": "fp32" if i == 0 else "bf16", "graph_passes": i > 1,
                  "runtime": "eager"}
        dist = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
        med = sorted(repeats_ms)[len(repeats_ms) // 2]
        attrs = {"run_id": "r", "max_rel_error": 1e-3 * i, "float_outputs": 1, "description": f"trial {i}",
                 "repeats_ms": list(repeats_ms), "latency_ms": med, "latency_p50_ms": med, "throughput": 100.0 * sp}
        if i < 2:
            attrs["baseline"] = ("fp32_eager", "autocast_bf16")[i]
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dist, value=100.0 * sp,
                                                  user_attrs=attrs))
    study.set_user_attr("run_id", "r")
    return study


@pytest.mark.parametrize("repeats,warning", [
    ([10.0, 18.0, 9.0, 25.0, 11.0], "**Unstable timing** (repeats spread by 145% of their median)"),
    ([10.0, 10.2, 9.9, 10.1, 10.0], "**Within measurement noise**: the repeats of the best (trial 2) and of its FP32 "
                                    "eager baseline (trial 0) spread by up to 3%"),
])
def test_a_noisy_timing_is_warned_about_once_beside_the_speedups(repeats, warning):
    md = render_markdown(_report(_noisy_study(repeats)))
    result = md.split("## Result")[1].split("\n## ")[0]
    assert md.count("spread by") == 1 and warning in result, result  # the spread is stated once
    lines = result.splitlines()
    at = next(i for i, line in enumerate(lines) if warning in line)
    assert lines[at - 1].startswith("- Timings compared:")  # right after the speedups and their timing


def test_a_steady_timing_gets_no_noise_warning():
    md = render_markdown(_report(_noisy_study([10.0, 10.02, 9.99, 10.01, 10.0], speedups=(1.0, 1.1, 1.3))))
    assert "spread by" not in md and "Unstable timing" not in md


def test_console_and_report_md_give_fp32_eager_the_same_throughput(tmp_path):
    """The console's "x FP32 eager" line divides by the number report.md shows (``compared_throughput``: the
    side-by-side median when there is one), not FP32 eager's first timing."""
    from tctune.report import console_summary

    r = _report(_study(states=("COMPLETE",) * 3))
    base = r["baseline"]
    assert base and r["best"].get("speedup_vs_baseline")
    base["compared_throughput"] = 951.1 if base["throughput"] != 951.1 else 952.2
    shown = f"{base['compared_throughput']:.4g} items/s"
    assert f"FP32 eager at the same batch ({shown})" in console_summary(r, tmp_path)
    assert f"{base['throughput']:.4g} items/s)" not in console_summary(r, tmp_path).split("FP32 eager")[-1]


@pytest.mark.parametrize("artifacts,line", [
    ({"onnx_error": "export disabled (--no-export)", "tensorrt_skipped_reason": "export disabled (--no-export)"},
     "export disabled (--no-export)"),
    ({"onnx": "model.onnx", "tensorrt_skipped_reason": "tensorrt is not installed"},
     "TensorRT: tensorrt is not installed"),
    ({"onnx_error": "not exported: the model could not be captured (x)", "tensorrt_skipped_reason":
      "no ONNX to build from"}, "TensorRT: no ONNX to build from"),
    # why there is no ONNX file, said before TensorRT's consequence of it
    ({"onnx_error": "not exported: the model could not be captured (x)", "tensorrt_skipped_reason":
      "no ONNX to build from"}, "ONNX: not exported: the model could not be captured (x)"),
])
def test_the_console_labels_a_skip_reason_tensorrt_only_when_it_is_tensorrts_own(tmp_path, artifacts, line):
    from tctune.report import console_summary

    r = _report(_study(states=("COMPLETE",) * 3))
    r["artifacts"] = artifacts
    assert line in console_summary(r, tmp_path).splitlines()


@pytest.mark.parametrize("artifacts,lines", [
    ({"onnx_error": "export disabled (--no-export)", "tensorrt_skipped_reason": "export disabled (--no-export)"},
     ["- Export (ONNX, TensorRT): skipped: export disabled (--no-export)"]),
    ({"onnx_error": "not exported: the model could not be captured (x)", "tensorrt_skipped_reason":
      "no ONNX to build from"},
     ["- ONNX note: not exported: the model could not be captured (x)", "- TensorRT: skipped: no ONNX to build from"]),
])
def test_report_md_says_a_reason_both_engines_share_once(artifacts, lines):
    r = _report(_study(states=("COMPLETE",) * 3))
    r["artifacts"] = artifacts
    md = render_markdown(r).split("## Artifacts")[1].split("\n## ")[0]
    got = [line for line in md.splitlines() if line.startswith("- ")]
    assert got == lines, got
    assert md.count(artifacts["tensorrt_skipped_reason"]) == 1


def _baseline_wins_study(setup=(0.0, 0.42)):
    """Trial 0: FP32 eager (a plain baseline, the fastest); trial 1: tctune's graph, slower, with its passes."""
    study = optuna.create_study(direction="maximize")
    for i, (graph, tput) in enumerate(((False, 200.0), (True, 150.0))):
        params = {"batch_size": 8, "precision": "fp32", "graph_passes": graph, "runtime": "eager"}
        dist = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
        attrs = {"run_id": "r", "max_rel_error": 1e-6 * i, "float_outputs": 1, "description": f"trial {i}",
                 "throughput": tput, "setup_s": setup[i],
                 "passes": [{"name": "fuse_qkv", "changed": 2}, {"name": "pad_linear", "changed": 0}] if graph else []}
        if not graph:
            attrs["baseline"] = "fp32_eager"
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dist, value=tput, user_attrs=attrs))
    study.set_user_attr("run_id", "r")
    return study


def test_a_winning_plain_baseline_still_shows_what_the_passes_did_on_the_fastest_tctune_candidate():
    r = _report(_baseline_wins_study())
    assert r["best"]["baseline"] == "fp32_eager" and r["passes"] == []
    md = render_markdown(r)
    section = md[md.index("## Graph passes"):md.index("## Trials")]
    assert "No graph passes ran for the best configuration." in section
    assert "The answer is the model without tctune's graph: it is a plain baseline" in section
    assert "fastest tctune candidate, trial 1 (fp32, eager, batch 8, 150 items/s first timing)" in section
    assert "| fuse_qkv | 2 |" in section and "| pad_linear | 0 |" in section


def test_the_setup_column_holds_each_trials_build_and_compile_seconds_or_is_left_out():
    md = render_markdown(_report(_baseline_wins_study()))
    trials = md[md.index("## Trials"):md.index("## Artifacts")]
    assert "setup s (build + compile)" in trials and "| 0.42 |" in trials
    md = render_markdown(_report(_baseline_wins_study(setup=(0.0, 0.0))))
    assert "setup s" not in md[md.index("## Trials"):]  # never a column of zeros


def test_failure_summary_counts_trials_not_a_ratio():
    """"relative error 0.48 > max_error 0.01 (2x)" read as twice the limit: the count names what it counts."""
    from tctune.report import failure_summary

    trials = [{"state": "COMPLETE", "fail_reason": "relative error 0.48 > max_error 0.01"},
              {"state": "COMPLETE", "fail_reason": "relative error 0.31 > max_error 0.01"},
              {"state": "FAIL", "fail_reason": "eager run failed: RuntimeError: boom"},
              {"state": "COMPLETE", "fail_reason": None}]
    text = failure_summary(trials)
    assert text == ("3 of 4 trials did not qualify; most common: relative error 0.48 > max_error 0.01 (2 trials); "
                    "eager run failed: RuntimeError: boom (1 trial)")


def test_a_model_that_writes_its_buffers_is_said_in_the_verdict_and_report_md(tmp_path):
    """A winner exists, yet its accuracy verdict compared runs from different states: the console's verdict and
    report.md say so (before: only report.json's model.writes_buffers, and the console only when nothing
    qualified)."""
    from tctune.report import console_summary

    r = build_report(_study(states=("COMPLETE",) * 3), hardware={"name": "cpu"}, measured_on="cpu",
                     config={"max_error": 0.01, "max_error_fp8": 0.05, "mode": "infer", "max_mismatch_rate": 0.0,
                             "min_score_ratio": 0.99},
                     model={"name": "m", "path": "m.py", "writes_buffers": ["running"]}, passes=[], artifacts={},
                     capture={"ok": True})
    assert r["best"] is not None
    assert "forward writes its buffers (running): runs of the same inputs differ" in console_summary(r, tmp_path)
    assert "**The model's forward writes its buffers** (running)" in render_markdown(r)
    plain = _report(_study(states=("COMPLETE",) * 3))
    assert "writes its buffers" not in console_summary(plain, tmp_path) + render_markdown(plain)
