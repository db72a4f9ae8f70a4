"""A run that resumes a study: said once (console and report.md) with the earlier trials' outcomes, and its
console summary warns of unstable timing only for the trials it measured itself."""
import re

import optuna

from tctune.optimize import optimize
from tctune.report import TRIAL_FIELDS, console_summary, render_markdown
from tctune.search import TuneConfig
from tctune.search.results import earlier_trials, resumed_words


def _cfg(out, **kw):
    return TuneConfig(**{"out_dir": str(out), "batch_sizes": (4,), "trials": 2, "quiet": True, "export": False,
                         "prune": False, **kw})


def test_second_run_on_one_out_says_it_resumed_once_with_the_earlier_outcomes(tiny, tmp_path, caplog):
    out = tmp_path / "out"
    with caplog.at_level("INFO", logger="tctune"):
        first = optimize(tiny, _cfg(out))
    assert "resumed:" not in caplog.text and first["resumed"] is None  # a fresh study
    assert "resumed:" not in (out / "report.md").read_text()
    n = first["study"]["n_trials"]
    states = [t["state"] if t["fail_kind"] != "skipped" else "SKIPPED" for t in first["trials"]]
    caplog.clear()
    with caplog.at_level("INFO", logger="tctune"):
        second = optimize(tiny, _cfg(out, trials=1))
    counts = {"measured": states.count("COMPLETE"), "failed": states.count("FAIL"),
              "stopped early": states.count("PRUNED"), "skipped": states.count("SKIPPED")}
    words = ", ".join(f"{c} {w}" for w, c in counts.items() if c)
    line = f"resumed: {n} earlier trial{'s' if n != 1 else ''} kept ({words})"
    assert caplog.text.count("resumed:") == 1 and line in caplog.text
    assert second["resumed"]["trials"] == n and second["resumed"]["numbers"] == [t["number"] for t in first["trials"]]
    md = (out / "report.md").read_text()
    study_line = next(x for x in md.splitlines() if x.startswith("- Study:"))
    assert line in study_line
    added = second["study"]["n_trials"] - n
    assert study_line.endswith(f"this run added {added} trial{'s' if added != 1 else ''}" if added else
                               "this run added none")


def _make(number, state, attrs):
    t = optuna.trial.create_trial(state=state, value=1.0 if state == optuna.trial.TrialState.COMPLETE else None,
                                  user_attrs=attrs)
    t.number = number
    return t


def test_earlier_trials_counts_each_trial_by_its_outcome_and_leaves_out_interrupted_ones():
    S = optuna.trial.TrialState
    trials = [_make(0, S.COMPLETE, {}), _make(1, S.FAIL, {"fail_reason": "too slow"}),
              _make(2, S.PRUNED, {"fail_reason": "stopped early"}), _make(3, S.COMPLETE, {}),
              _make(4, S.FAIL, {"fail_reason": "interrupted", "fail_kind": "interrupted"}),  # measured again
              _make(5, S.WAITING, {})]  # queued, not run: this run measures it
    rec = earlier_trials(trials)
    assert rec == {"trials": 4, "outcomes": {"measured": 2, "failed": 1, "pruned": 1}, "numbers": [0, 1, 2, 3]}
    assert resumed_words(rec) == "resumed: 4 earlier trials kept (2 measured, 1 failed, 1 stopped early)"
    assert earlier_trials([_make(0, S.WAITING, {})]) is None


def _row(number, **kw):
    row = {"number": number, "state": "COMPLETE", "params": {"precision": "fp32", "batch_size": 8,
                                                             "graph_passes": False, "runtime": "eager"},
           "throughput": 100.0, "latency_ms": 10.0, "latency_p50_ms": 1.0,  # 10x apart: unstable
           "max_rel_error": 0.0, "repeats_ms": [10.0, 10.1], "fail_reason": None}
    row.update(kw)
    for k in TRIAL_FIELDS:  # the trials table reads every field
        row.setdefault(k, None)
    return row


def _report(resumed):
    base, best = _row(0), _row(3, params={"precision": "bf16", "batch_size": 8, "graph_passes": False})
    return {"hardware": {}, "model": {"name": "m", "path": "m.py"}, "measured_on": "cpu",
            "study": {"name": "s", "n_trials": 2, "n_complete": 2}, "config": {"max_error": 0.01, "mode": "infer"},
            "capture": {"ok": True}, "passes": [], "trials": [base, best], "artifacts": {}, "resumed": resumed,
            "best": {**{k: v for k, v in best.items() if k != "number"}, "trial": 3, "speedup_vs_baseline": 1.5},
            "baseline": {"trial": 0, "batch_size": 8, "throughput": 100.0}}


def test_unstable_timing_of_earlier_runs_trials_is_not_printed_again_but_stays_in_the_report(tmp_path):
    fresh = console_summary(_report(None), tmp_path)
    assert re.search(r"unstable timing \(trial \d+: median of repeats", fresh)  # measured in this run: warned
    old = {"run_id": "r2", "trials": 2, "outcomes": {"measured": 2}, "numbers": [0, 3]}
    resumed = console_summary(_report(old), tmp_path)
    assert "unstable timing" not in resumed  # both trials are an earlier run's: warned in that run
    assert "**Unstable timing**" in render_markdown(_report(old))  # report.md keeps it
    partly = console_summary(_report({**old, "numbers": [3]}), tmp_path)  # the FP32 baseline is this run's
    assert "unstable timing (trial 0: median of repeats" in partly


def test_a_run_into_a_folder_holding_another_models_report_warns_once(tmp_path, caplog):
    import json
    from types import SimpleNamespace

    from tctune.optimize import warn_other_model

    mine = SimpleNamespace(name="int_outputs", path=tmp_path / "int_outputs.py")
    assert warn_other_model(tmp_path, mine) is None  # a new folder
    (tmp_path / "report.json").write_text(json.dumps({"model": {"name": "int_outputs", "path": str(mine.path)}}))
    assert warn_other_model(tmp_path, mine) is None  # this model's own report: a resumed run
    (tmp_path / "report.json").write_text(json.dumps({"model": {"name": "two_dtypes", "path": "/m/two_dtypes.py"}}))
    with caplog.at_level("WARNING", logger="tctune"):
        msg = warn_other_model(tmp_path, mine)
    assert msg == (f"{tmp_path} holds the report of another model, two_dtypes (/m/two_dtypes.py): this run of "
                   "int_outputs replaces its report.md, report.json and best_config.json (its study stays in "
                   "study.db); use another output folder to keep both")
    assert caplog.text.count("holds the report of another model") == 1
    (tmp_path / "model.onnx").write_text("x")
    (tmp_path / "runner.py").write_text("x")
    assert warn_other_model(tmp_path, mine, export=False).endswith(
        "replaces its report.md, report.json and best_config.json (its study stays in study.db); the exported files "
        "there stay, as this run exports nothing: model.onnx, runner.py; use another output folder to keep both")
    # exporting, the files of names this run does not write stay too (a model.pt2 of the other model): named
    assert warn_other_model(tmp_path, mine).endswith(
        "(its study stays in study.db); the exported files there stay unless this run's export writes the same "
        "names: model.onnx, runner.py; use another output folder to keep both")
    (tmp_path / "report.json").write_text(json.dumps({"model": {"name": "int_outputs", "path": str(mine.path)}}))
    assert warn_other_model(tmp_path, mine) is None  # this model's own folder, exporting again: nothing stale
    with caplog.at_level("WARNING", logger="tctune"):
        msg = warn_other_model(tmp_path, mine, export=False)  # this model's earlier export stays beside a new config
    assert msg == (f"{tmp_path} holds exported files of an earlier run of int_outputs (model.onnx, runner.py): "
                   "this run exports nothing, so they may not match the best_config.json it writes; rebuild them "
                   f"with `tctune export {mine.path} --config {tmp_path / 'best_config.json'}`, or run with the export on")
    spaced = SimpleNamespace(name="int_outputs", path=tmp_path / "my dir" / "int_outputs.py")  # pasted as printed
    (tmp_path / "report.json").write_text(json.dumps({"model": {"name": "int_outputs", "path": str(spaced.path)}}))
    assert f"`tctune export '{spaced.path}' --config " in warn_other_model(tmp_path, spaced, export=False)
    live = SimpleNamespace(name="Sequential", path="<Sequential>")  # tctune.optimize(module, ...): no file
    (tmp_path / "report.json").write_text(json.dumps({"model": {"name": "Sequential", "path": "<Sequential>"}}))
    assert warn_other_model(tmp_path, live, export=False).endswith(
        "may not match the best_config.json it writes; run with the export on")
    (tmp_path / "report.json").write_text("{not json")
    assert warn_other_model(tmp_path, mine) is None  # an unreadable report: nothing to say


def test_the_output_folder_warning_is_in_report_md_and_json_too(tiny, tmp_path):
    """The warning that the folder holds another model's report was console-only: report.md, the file a reader
    keeps, did not say that the folder had held another model's results."""
    import json

    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"model": {"name": "other_model", "path": "/m/other_model.py"}}))
    (out / "model.onnx").write_text("x")
    report = optimize(tiny, _cfg(out, trials=1))
    said = report["model"]["output_folder_warning"]
    assert said.startswith(f"{out} holds the report of another model, other_model (/m/other_model.py)")
    assert "the exported files there stay, as this run exports nothing: model.onnx" in said
    assert f"> **Output folder**: {said}." in (out / "report.md").read_text()
    again = optimize(tiny, _cfg(out, trials=1, export=True))  # this model's folder now, exporting: nothing to say
    assert again["model"]["output_folder_warning"] is None
    assert "**Output folder**" not in (out / "report.md").read_text()


def test_best_config_carries_the_side_by_side_number_the_report_quotes(tiny, tmp_path):
    """best_config.json's ``throughput`` is the answer's first timing (a fresh user saw 80,803 items/s there
    against 1,002 in the console and report.md, the side-by-side median on a loaded machine); the quoted number is
    now beside it, the same as report.json's side-by-side entry of that trial."""
    import json

    out = tmp_path / "out"
    report = optimize(tiny, _cfg(out, trials=2))
    cfg = json.loads((out / "best_config.json").read_text())
    entries = {e["trial"]: e["throughput"] for e in (report["side_by_side"] or {}).get("entries") or []}
    assert report["best"]["trial"] in entries  # the answer was timed side by side in this run
    assert cfg["side_by_side_throughput"] == entries[report["best"]["trial"]]
    assert cfg["throughput"] == report["best"]["throughput"]  # the first timing, as documented



def test_the_side_by_side_line_names_batch_sizes_when_its_entries_differ():
    """The console's side-by-side line listed trials without their batch size: "trial 3 (fp32_eager): 2007/s;
    ... trial 6 (fp32_eager): 8033/s" could not be told apart (fresh-user finding)."""
    from tctune.search.loop import side_by_side_words

    two = [{"trial": 3, "baseline": "fp32_eager", "batch_size": 8, "throughput": 2007.0},
           {"trial": 6, "baseline": "fp32_eager", "batch_size": 32, "throughput": 8033.0},
           {"trial": 9, "baseline": None, "batch_size": 32, "throughput": 9100.0}]
    assert side_by_side_words(two) == ("trial 3 (fp32_eager) at batch 8: 2007/s; trial 6 (fp32_eager) at batch 32: "
                                       "8033/s; trial 9 at batch 32: 9100/s")
    one = [dict(e, batch_size=32) for e in two]
    assert side_by_side_words(one) == "trial 3 (fp32_eager): 2007/s; trial 6 (fp32_eager): 8033/s; trial 9: 9100/s"
    assert side_by_side_words([dict(two[0], throughput=None)]) == "none timed"
