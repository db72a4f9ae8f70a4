"""The runs after the trials cannot lose the search, and the ONNX validation is sized to host memory.

A process killed during the export (the host's out-of-memory killer: SIGKILL, no Python cleanup) still leaves a
valid ``report.json`` / ``report.md`` / ``best_config.json`` of the search that says the export did not finish; a
batch whose outputs are over the validation limit is not validated (batch 1 and a small one are), and the
artifacts say which and why, in ``tctune optimize`` and in ``tctune export``."""
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tctune.export.onnx as onnx_export
from tctune.cli import main
from tctune.export.onnx import output_nbytes, plan_validation

ROOT = Path(__file__).resolve().parents[1]

TINY = '''
import torch
def build_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
'''
#: TINY's outputs: 8 float32 per item.
ITEM_BYTES = 8 * 4


@pytest.fixture
def model(tmp_path):
    f = tmp_path / "tiny.py"
    f.write_text(TINY)
    return f


# ------------------------------------------------------------------------------------------ plan_validation


def test_plan_keeps_every_batch_whose_outputs_fit():
    assert plan_validation((128, 3), 100.0, limit=128 * 100) == ((128, 3), None)
    assert plan_validation((1, 128, 3), 100.0, limit=128 * 100) == ((1, 128, 3), None)


def test_plan_skips_the_tuned_batch_over_the_limit_with_its_size():
    per_item = 1024 * 50257 * 4  # a GPT-2 sequence's FP32 logits
    sizes, note = plan_validation((128, 3), per_item, limit=2 << 30)
    assert sorted(sizes) == [1, 3] and sizes[0] == 3  # the export example (first >= 2) is the small batch
    assert note.startswith("outputs at batch 128 are 26.3 GB, over the 2.1 GB validation limit")
    assert note.endswith("validated at batches 1 and 3")
    sizes, note = plan_validation((1, 128, 512), per_item, limit=2 << 30)
    assert sizes == (1, 3) and "batch 128 are 26.3 GB" in note and "batch 512 are 105.4 GB" in note


def test_plan_with_unknown_output_size_validates_small_batches_only():
    sizes, note = plan_validation((128, 3), None, limit=1 << 40)
    assert sorted(sizes) == [1, 3] and "unknown" in note and "128" in note
    with pytest.raises(ValueError, match="positive"):
        plan_validation((), 10.0)


def test_limit_is_the_cap_or_a_fraction_of_available_memory(monkeypatch):
    monkeypatch.setattr(onnx_export, "host_memory_available", lambda: 64 << 30)
    assert onnx_export.validation_output_limit()[0] == onnx_export.VALIDATION_OUTPUT_CAP  # 64 GiB / 16 > 2 GiB
    monkeypatch.setattr(onnx_export, "host_memory_available", lambda: 8 << 30)
    limit, why = onnx_export.validation_output_limit()
    assert limit == (8 << 30) // 16 and "1/16" in why
    monkeypatch.undo()
    got = onnx_export.host_memory_available()
    assert got is None or got > 0


def test_output_nbytes_counts_low_precision_at_four_bytes():
    outs = {"a": torch.zeros(2, 3), "b": (torch.zeros(4, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float64))}
    assert output_nbytes(outs) == 6 * 4 + 4 * 4 + 8


# ------------------------------------------------------------------------------- tctune optimize / export


def test_optimize_skips_validation_at_a_tuned_batch_over_the_limit(model, tmp_path, monkeypatch, ort):
    """Outputs at either searched batch (4, 16) are over the limit, batch 3's are not: the export validates at
    1 and 3 (both files where a twin is written) and report.json / report.md say why."""
    monkeypatch.setattr(onnx_export, "VALIDATION_OUTPUT_CAP", 3 * ITEM_BYTES)
    out = tmp_path / "out"
    assert main(["optimize", str(model), "--out", str(out), "--batch-sizes", "4,16", "--trials", "4", "--quiet",
                 "--no-prune"]) == 0
    report = json.loads((out / "report.json").read_text())
    a, bs = report["artifacts"], report["best"]["params"]["batch_size"]
    assert a["onnx_validation_batches"] == [1, 3]
    assert a["onnx_validation_limited"].startswith(f"outputs at batch {bs} are {bs * ITEM_BYTES} bytes, over the")
    assert a["onnx_validation_limited"].endswith("validated at batches 1 and 3")
    # model.onnx's runs, or (a typed best onnxruntime has no kernel for) its FP32 twin's: at the same sizes
    runs = [r for r in (a["onnx_validation"], a.get("onnx_fp32_validation")) if r]
    assert runs and all(sorted(e["batch_size"] for e in r) == [1, 3] for r in runs)
    assert all(e["max_abs_error"] is not None for r in runs for e in r)
    assert f"- ONNX validation sized to memory: outputs at batch {bs}" in (out / "report.md").read_text()
    assert report["unfinished_stage"] is None and a["export"] == "finished"
    assert "did not finish" not in (out / "report.md").read_text()

    # `tctune export` of the same best_config.json: the same sizing (tuned and largest skipped)
    res = tmp_path / "exported"
    assert main(["export", str(model), "--config", str(out / "best_config.json"), "--format", "onnx",
                 "--out", str(res)]) == 0
    manifest = json.loads((res / "model.onnx.manifest.json").read_text())
    result = manifest["result"]
    runs = [r for r in (result["onnx_validation"], result.get("onnx_fp32_validation")) if r]
    assert runs and all(sorted(e["batch_size"] for e in r) == [1, 3] for r in runs)
    assert f"outputs at batch {bs} are" in result["onnx_validation_limited"]


def test_export_validates_the_tuned_batch_when_it_fits(model, tmp_path, ort):
    out = tmp_path / "out"
    assert main(["optimize", str(model), "--out", str(out), "--batch-sizes", "4,16", "--trials", "4", "--quiet",
                 "--no-prune"]) == 0
    a = json.loads((out / "report.json").read_text())["artifacts"]
    bs = json.loads((out / "report.json").read_text())["best"]["params"]["batch_size"]
    assert a["onnx_validation_limited"] is None and bs in a["onnx_validation_batches"]
    runs = [r for r in (a["onnx_validation"], a.get("onnx_fp32_validation")) if r]
    assert runs and all(bs in [e["batch_size"] for e in r] for r in runs)


KILLED_IN_STAGE = textwrap.dedent('''
    import importlib, os, signal, sys
    pipeline = importlib.import_module("tctune.optimize")  # the module (tctune.optimize is also a function)
    from tctune.search import Tuner
    def killed(*args, **kwargs):  # what the out-of-memory killer does: no exception, no cleanup
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[3] == "export":
        pipeline.export_best = killed
    else:
        Tuner.confirm = killed
    from tctune.cli import main
    sys.exit(main(["optimize", sys.argv[1], "--out", sys.argv[2], "--batch-sizes", "4,16", "--trials", "4",
                   "--quiet", "--no-prune"]))
''')


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")
@pytest.mark.parametrize("stage", ["export", "re-measure"])
def test_a_process_killed_after_the_trials_leaves_a_valid_report_of_the_search(model, tmp_path, stage):
    out = tmp_path / "out"
    script = tmp_path / "killed.py"
    script.write_text(KILLED_IN_STAGE)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(script), str(model), str(out), stage], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())  # valid JSON: written atomically before the stage
    assert report["unfinished_stage"] == stage
    best = report["best"]
    assert best is not None and best["trial"] in {t["number"] for t in report["trials"] if t["state"] == "COMPLETE"}
    assert report["baselines"] and best["speedup_vs_fp32_eager"] is not None
    assert report["artifacts"]["onnx"] is None
    md = (out / "report.md").read_text()
    assert f"did not finish: the process ended during {stage}**" in md
    if stage == "export":  # after the search and its timing: the export is pending, best_config.json written
        assert report["artifacts"]["export"] == "in progress" and "**Export did not finish" in md
        cfg = json.loads((out / "best_config.json").read_text())
        assert cfg["params"] == best["params"] and cfg["recommended"]["trial"] == best["trial"]
    else:
        assert "export" not in report["artifacts"] and not (out / "best_config.json").exists()


def test_a_side_by_side_timing_that_raises_is_recorded_and_the_run_finishes(model, tmp_path, monkeypatch):
    from tctune.search import Tuner

    def broken(self, study):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(Tuner, "side_by_side", broken)
    out = tmp_path / "out"
    assert main(["optimize", str(model), "--out", str(out), "--batch-sizes", "4,16", "--trials", "4", "--quiet",
                 "--no-prune"]) == 0
    report = json.loads((out / "report.json").read_text())
    stages = {e["stage"]: e["error"] for e in report["post_errors"]}
    assert stages == {"side-by-side timing": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    assert report["best"] is not None and report["artifacts"]["export"] == "finished"
    assert report["unfinished_stage"] is None and (report["artifacts"]["onnx"] or report["artifacts"].get("onnx_fp32"))


def test_tctune_export_sizes_its_validations_from_the_outputs_at_batch_1():
    from tctune.engines import _output_bytes_per_item

    assert _output_bytes_per_item(torch.nn.Linear(16, 8), lambda b: (torch.randn(b, 16),)) == ITEM_BYTES

    def broken(x):
        raise RuntimeError("no kernel")

    assert _output_bytes_per_item(broken, lambda b: (torch.randn(b, 16),)) is None
