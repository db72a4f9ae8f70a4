"""After the trials: a failing re-measure, export or plot is recorded in the report (never fatal, no C++
backtrace on the console), the ONNX deploy facts reach report and manifest, and a best configuration that
cannot be exported gets the next-best exportable one beside it."""
import json

import pytest

import tctune.export.onnx as onnx_export
from tctune.cli import main

TINY = '''
import torch
def build_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
'''

#: What torch's C++ errors look like: one line, then the backtrace.
CPP_ERROR = ("Cannot call numel() on tensor with symbolic sizes/strides\n"
             "Exception raised from throw_cannot_call_with_symbolic at /pytorch/c10/core/TensorImpl.cpp:291\n"
             "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f in libc10.so)\n"
             "frame #1: c10::TensorImpl::throw_cannot_call_with_symbolic(char const*) const + 0x9c\n")


@pytest.fixture
def model(tmp_path):
    f = tmp_path / "tiny.py"
    f.write_text(TINY)
    return f


def _run(model, out, *extra):
    return main(["optimize", str(model), "--out", str(out), "--batch-sizes", "4,16", "--trials", "8", "--quiet",
                 "--no-prune", *extra])


def test_failures_after_the_trials_are_recorded_and_the_report_is_written(model, tmp_path, monkeypatch, capsys):
    """Export (a C++ error), plots and the finalists' re-measure all raise: exit 1 (a configuration qualified but
    its export failed), report.json lists each stage's one-line error, the full text is in tctune_errors.log, the
    console has no backtrace."""
    import tctune.plots
    from tctune.search import Tuner

    def broken_export(*a, **k):
        raise RuntimeError(CPP_ERROR)

    def broken_plots(*a, **k):
        raise ValueError("plot backend exploded")

    def broken_confirm(self, study):
        raise RuntimeError("re-measure exploded")

    monkeypatch.setattr(onnx_export, "export_onnx_deployable", broken_export)
    monkeypatch.setattr(tctune.plots, "write_plots", broken_plots)
    monkeypatch.setattr(Tuner, "confirm", broken_confirm)
    out = tmp_path / "out"
    assert _run(model, out) == 1
    report = json.loads((out / "report.json").read_text())
    stages = {e["stage"]: e for e in report["post_errors"]}
    assert report["artifacts"]["onnx_failed"]["log"] == str(out / "tctune_errors.log")
    assert {"export", "plots", "re-measure"} <= set(stages)
    exp = stages["export"]
    assert exp["error"] == "RuntimeError: Cannot call numel() on tensor with symbolic sizes/strides"
    assert exp["log"] == str(out / "tctune_errors.log")
    log_text = (out / "tctune_errors.log").read_text()
    assert "frame #1: c10::TensorImpl" in log_text and "plot backend exploded" in log_text
    captured = capsys.readouterr()
    assert "frame #" not in captured.err + captured.out and "Traceback" not in captured.err
    assert "export failed: RuntimeError: Cannot call numel()" in captured.err and "tctune_errors.log" in captured.err
    assert report["best"] is not None and report["artifacts"]["onnx"] is None
    assert report["artifacts"]["onnx_error"].startswith("not exported: RuntimeError: Cannot call numel()")
    # the next-best trials were tried and failed the same way: recorded, the report names the best trial
    fb = report["artifacts"]["export_fallback"]
    assert fb["best_trial"] == report["best"]["trial"] and fb["exported_trial"] is None and fb["tried"]
    assert all(f"export (fallback trial {n})" in stages for n in fb["tried"])
    md = (out / "report.md").read_text()
    assert "## Errors after the trials" in md and "re-measure exploded" in md and "could not be exported" in md
    assert (out / "best_config.json").exists()
    # said once on the console, grouped in the report, and no empty folder left by the failed fallbacks
    assert captured.err.count("Cannot call numel()") == 1
    assert md.count("Cannot call numel()") == 2  # the errors section (all stages on one line) and the fallback line
    assert all(stages[f"export (fallback trial {n})"]["same_as"] == "export" for n in fb["tried"])
    assert fb["errors"] and not list(out.glob("exportable_trial_*"))


def test_best_that_cannot_be_exported_gets_the_next_best_exportable_beside_it(model, tmp_path, monkeypatch, capsys):
    """The best trial's export fails on a batch-size guard; the next-best feasible trial exports into its own
    folder, console and report name both, and the exit status is 1 (the answer itself was not exported)."""
    real = onnx_export.export_onnx_deployable
    out = tmp_path / "out"

    def guarded_export(module, make_inputs, path, **kw):
        if path.parent == out:  # the best trial's export (the fallbacks write into subfolders)
            raise onnx_export.ExportError("Guard failed: x.size()[0] <= 8 (a guard on the batch size)")
        return real(module, make_inputs, path, **kw)

    monkeypatch.setattr(onnx_export, "export_onnx_deployable", guarded_export)
    assert _run(model, out) == 1
    report = json.loads((out / "report.json").read_text())
    a = report["artifacts"]
    fb = a["export_fallback"]
    assert a["onnx"] is None and "Guard failed" in a["onnx_error"] and a["exported_trial"] is None
    assert fb["best_trial"] == report["best"]["trial"] and "Guard failed" in fb["best_error"]
    assert fb["exported_trial"] is not None and fb["exported_trial"] != fb["best_trial"]
    by_number = {t["number"]: t for t in report["trials"]}
    assert by_number[fb["exported_trial"]]["state"] == "COMPLETE" and fb["params"] == by_number[fb["exported_trial"]]["params"]
    folder = out / f"exportable_trial_{fb['exported_trial']}"
    assert fb["dir"] == str(folder) and (folder / "model.onnx").exists() and fb["artifacts"]["onnx"] == str(folder / "model.onnx")
    cfg = json.loads((folder / "best_config.json").read_text())
    assert cfg["params"]["batch_size"] == fb["params"]["batch_size"]
    assert json.loads((out / "best_config.json").read_text())["params"] == report["best"]["params"]  # the winner's
    assert not report["post_errors"]  # an ExportError is the export's own result, not a crash
    err = capsys.readouterr().err
    assert f"best configuration (trial {fb['best_trial']}) could not be exported" in err
    assert f"exported trial {fb['exported_trial']}" in err
    md = (out / "report.md").read_text()
    assert f"trial {fb['exported_trial']}, the next best that exports" in md


def test_an_onnx_failure_in_optimize_is_logged_in_full_named_and_exits_1(model, tmp_path, monkeypatch, capsys):
    """An ONNX export failure of the answer is recorded as `tctune export` records one
    (tctune.engines.failed_format): the full text (past the one-line cut, chained cause included) in
    tctune_errors.log, the console and report.md name the log, report.json has the failed artifact, exit 1."""
    tail = "the operator aten::weird_op has no ONNX symbolic; " * 12 + "END-OF-FULL-TEXT"

    def broken(module, make_inputs, path, **kw):
        try:
            raise RuntimeError(tail)
        except RuntimeError as cause:
            raise onnx_export.ExportError(f"torch.onnx.export (dynamo) failed for {path.name}: {tail[:300]}") from cause

    monkeypatch.setattr(onnx_export, "export_onnx_deployable", broken)
    out = tmp_path / "out"
    assert _run(model, out) == 1
    log_file = out / "tctune_errors.log"
    text = log_file.read_text()
    assert "stage export onnx" in text and "END-OF-FULL-TEXT" in text
    report = json.loads((out / "report.json").read_text())
    failed = report["artifacts"]["onnx_failed"]
    assert failed["status"] == "failed" and failed["log"] == str(log_file)
    assert failed["error"].startswith("ExportError: torch.onnx.export (dynamo) failed for model.onnx")
    assert not report["post_errors"]  # recorded as the export's result, not as a crashed stage
    printed = capsys.readouterr()
    assert "ONNX export failed: ExportError: torch.onnx.export (dynamo) failed" in printed.out
    assert f"(full text in {log_file})" in printed.out
    assert f"full text in `{log_file}`" in (out / "report.md").read_text()


def test_deploy_facts_reach_report_manifest_and_markdown(model, tmp_path):
    """A bf16 best on the CPU: the typed model.onnx (TensorRT) and, where onnxruntime cannot run it, the FP32
    twin; report.json, report.md and the runner manifest say which file to deploy where."""
    out = tmp_path / "out"
    assert main(["optimize", str(model), "--out", str(out), "--batch-sizes", "4", "--trials", "4", "--quiet",
                 "--no-prune"]) == 0
    report = json.loads((out / "report.json").read_text())
    a = report["artifacts"]
    assert isinstance(a["deploy"], dict) and a["deploy_reason"]
    assert a["exported_trial"] == report["best"]["trial"] and "export_fallback" not in a
    assert a["deploy"].get("tensorrt") == "model.onnx"
    assert any(k.startswith("onnxruntime") for k in a["deploy"])
    manifest = json.loads((out / "model.onnx.manifest.json").read_text())
    assert manifest["deploy"] == a["deploy"] and manifest["deploy_reason"] == a["deploy_reason"]
    md = (out / "report.md").read_text()
    assert "- Deploy: tensorrt: `model.onnx`" in md


def test_an_interrupted_run_says_so_once_and_blames_neither_tensorrt_nor_the_budget():
    from pathlib import Path

    import optuna

    from tctune.cli.optimize import _summary
    from tctune.report import build_report, render_markdown

    study = optuna.create_study(direction="maximize")
    p = {"batch_size": 8, "precision": "fp32", "graph_passes": False, "runtime": "eager"}
    study.add_trial(optuna.trial.create_trial(
        params=p, distributions={k: optuna.distributions.CategoricalDistribution([v]) for k, v in p.items()},
        value=100.0, user_attrs={"throughput": 100.0, "max_rel_error": 0.0, "baseline": "fp32_eager"}))
    study.enqueue_trial(dict(p, batch_size=32))  # queued, never started: the run was stopped
    artifacts = {"onnx_error": "not exported: the run was interrupted (run the command again to resume)",
                 "tensorrt_skipped_reason": "the run was interrupted"}  # what optimize records on Ctrl-C
    report = build_report(study, hardware={}, measured_on="cpu", config={"max_error": 0.01, "mode": "infer"},
                          model={"name": "m", "path": "m.py"}, passes=[], artifacts=artifacts, capture={"ok": True},
                          extra={"interrupted": True})
    md, text = render_markdown(report), _summary(report, Path("out"))  # (tmp_path's name has the word in it)
    assert md.lower().count("interrupted") == 1 and "1 queued candidate(s) were not started" in md
    assert "--trials or --timeout" not in md and "TensorRT" not in md
    assert text.lower().count("interrupted") == 1 and "TensorRT" not in text and "--trials" not in text
    finished = build_report(study, hardware={}, measured_on="cpu", config={"max_error": 0.01, "mode": "infer"},
                            model={"name": "m", "path": "m.py"}, passes=[], artifacts={}, capture={"ok": True},
                            extra={"interrupted": False})
    assert "(--trials or --timeout reached)" in render_markdown(finished)  # a run that ended on its budget
