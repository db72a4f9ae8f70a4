"""The batch range an export claims starts where the model as written runs: batch 1 when it runs there, else the
smallest searched batch size that runs; the graph's Dim("batch") starts there, and the validation runs at it, in
``tctune optimize`` and in ``tctune export``."""
import json

import pytest
import torch

from tctune.capture import batch_range, capture, dynamic_dims, export_dynamic_shapes
from tctune.cli import main
from tctune.deploy import claim_batch_from, smallest_batch
from tctune.export.onnx import plan_validation
from tctune.hardware import resolve
from tctune.trial import apply_passes

# torch.export drops the assert: the captured graph runs at batch 1 (and would be claimed from 1), the model does not.
NEEDS_TWO = '''
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)
    def forward(self, x):
        assert x.shape[0] > 1, "this model needs batch > 1"
        return self.fc(x)
def build_model():
    return M().eval()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
'''

# Normalizes over the batch as BatchNorm does in training mode: batch 1 raises as written.
BATCH_STATS = '''
import torch
import torch.nn.functional as F
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)
    def forward(self, x):
        return F.batch_norm(self.fc(x), None, None, training=True)
def build_model():
    return M().eval()
def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
'''

PLAIN = NEEDS_TWO.replace('        assert x.shape[0] > 1, "this model needs batch > 1"\n', "")


def _raise_below(n):
    def run(b):
        if b < n:
            raise ValueError(f"needs batch >= {n}")
    return run


def test_smallest_batch_is_1_where_the_model_runs_there_else_the_smallest_searched_that_runs():
    assert smallest_batch(_raise_below(1), (8, 4)) == (1, None)
    lo, note = smallest_batch(_raise_below(2), (8, 4))
    assert lo == 4 and "batch 1: ValueError: needs batch >= 2" in note and "starts at 4" in note
    lo, note = smallest_batch(_raise_below(6), (8, 4))  # batch 4 raises too: the next searched size
    assert lo == 8 and "batch 1" in note and "batch 4" in note
    lo, note = smallest_batch(_raise_below(100), (8, 4))
    assert lo == 4 and "every batch size tried" in note


def test_claim_batch_from_raises_the_graph_batch_min_and_leaves_the_capture_alone():
    model = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
    gm = capture(model, (torch.randn(2, 16),))
    g, _ = apply_passes(gm, resolve(None), "fp32")
    assert batch_range(g)[0] == 1
    claim_batch_from(g, 4)
    assert batch_range(g) == (4, batch_range(gm)[1])
    assert [d["min"] for d in dynamic_dims(g) if d["symbol"] == "batch"] == [4]
    assert export_dynamic_shapes(g)[0][0].min == 4
    assert batch_range(gm)[0] == 1 and [d["min"] for d in dynamic_dims(gm)] == [1]  # the capture keeps its range
    assert claim_batch_from(torch.nn.Linear(2, 2), 4) is not None  # a module without the meta: unchanged


def test_plan_validation_substitutes_nothing_below_the_smallest_claimed_batch():
    sizes, note = plan_validation((64, 8), 100.0, limit=16 * 100, smallest=8)
    assert sizes == (8, 9) and "batch 64" in note
    assert plan_validation((64, 8), None, limit=1 << 40, smallest=8)[0] == (8, 9)
    assert plan_validation((128, 3), 100.0, limit=3 * 100) == plan_validation((128, 3), 100.0, limit=3 * 100, smallest=1)


@pytest.mark.parametrize("text, raised", [(NEEDS_TWO, "AssertionError: this model needs batch > 1"),
                                          (BATCH_STATS, "ValueError: Expected more than 1 value per channel")])
def test_optimize_and_export_claim_and_validate_from_the_smallest_batch_that_runs(tmp_path, text, raised):
    f = tmp_path / "m.py"
    f.write_text(text)
    out = tmp_path / "out"
    assert main(["optimize", str(f), "--out", str(out), "--batch-sizes", "4,8", "--trials", "2", "--quiet",
                 "--no-prune"]) == 0
    report = json.loads((out / "report.json").read_text())
    a = report["artifacts"]
    br = a["batch_range"]
    assert (br["min"], br["max"]) == (4, 8) and raised in br["note"] and "starts at 4" in br["note"]
    assert min(a["onnx_validation_batches"]) == 4 and br["validated"] == a["onnx_validation_batches"]
    runs = [r for r in (a["onnx_validation"], a.get("onnx_fp32_validation")) if r]
    assert runs and all(4 in [e["batch_size"] for e in r] and min(e["batch_size"] for e in r) == 4 for r in runs)
    assert [d["min"] for d in a["onnx_dynamic_dims"] if d["symbol"] == "batch"] == [4]
    assert "- Batch range: the engines accept batch 4 and up: the model as written raised at batch 1" in \
        (out / "report.md").read_text()

    res = tmp_path / "exported"
    assert main(["export", str(f), "--config", str(out / "best_config.json"), "--format", "onnx",
                 "--out", str(res)]) == 0
    manifest = json.loads((res / "model.onnx.manifest.json").read_text())
    assert manifest["batch_sizes"]["min"] == 4
    runs = [r for r in (manifest["result"]["onnx_validation"], manifest["result"].get("onnx_fp32_validation")) if r]
    assert runs and all(min(e["batch_size"] for e in r) == 4 for r in runs)


def test_a_model_that_runs_at_batch_1_is_claimed_and_validated_from_1(tmp_path):
    f = tmp_path / "plain.py"
    f.write_text(PLAIN)
    out = tmp_path / "out"
    assert main(["optimize", str(f), "--out", str(out), "--batch-sizes", "4,8", "--trials", "2", "--quiet",
                 "--no-prune"]) == 0
    a = json.loads((out / "report.json").read_text())["artifacts"]
    assert (a["batch_range"]["min"], a["batch_range"]["note"]) == (1, None)
    assert 1 in a["onnx_validation_batches"]
    assert "Batch range" not in (out / "report.md").read_text()
