"""A winning plain baseline that ran the model as written in FP32 (``fp32_eager``, or its ``torch.compile``) is
exported as that model: the captured FP32 graph with no tctune pass (here: no fused QKV projection, no fused
attention), and ``report.md`` / the console say what the exported file is. ``tctune export`` rebuilds the same.

CPU, eager runtime, tiny budgets; the winner is forced through ``best_trial`` (a seam: the winner is timing, not
under test here).
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import onnx
import pytest
import torch

import tctune.optimize  # noqa: F401 - the pipeline module, patched below through sys.modules
from tctune import measure
from tctune.modelfile import ModelFile
from tctune.search import TuneConfig


class Attention(torch.nn.Module):
    """Three projections of one input (tctune's ``fuse_qkv`` fuses them, ``fuse_attention`` the softmax block)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(32, 32) for _ in range(3))
        self.o = torch.nn.Linear(32, 10)

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 32 ** 0.5, dim=-1) @ self.v(x)
        return self.o(a)


def _inputs(b: int) -> tuple[torch.Tensor]:
    return (torch.randn(b, 6, 32),)


def _optimize(model, out, winner: str):
    from tctune.optimize import optimize_model
    from tctune.search import results

    def best(study, *a, **k):
        return next(t for t in study.trials if results.is_feasible(t) and t.user_attrs.get("baseline") == winner)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tctune.search.evaluate.time_call",
                   functools.partial(measure.time_call, repeats=1, single_calls=2, max_iterations=3, warmup=1))
        mp.setattr(sys.modules["tctune.optimize"], "best_trial", best)
        mp.setattr(sys.modules["tctune.report"], "best_trial", best)
        cfg = TuneConfig(out_dir=str(out), batch_sizes=(4,), trials=1, runtimes=("eager",), quiet=True)
        return optimize_model(ModelFile.from_module(model, _inputs), cfg)


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    torch.manual_seed(0)
    model = Attention().eval()
    return model, _optimize(model, tmp_path_factory.mktemp("fp32"), "fp32_eager")


def test_the_fp32_graph_has_passes_that_fire():
    """The premise: tctune's export pipeline rewrites this model at fp32 (else the test below could not fail)."""
    from tctune.capture import capture
    from tctune.deploy import export_graphs
    from tctune.hardware import resolve
    from tctune.trial import TrialParams

    gm = capture(Attention().eval(), _inputs(2))
    fired = {r.name for r in export_graphs(gm, resolve(None), TrialParams(batch_size=4, precision="fp32"), None).results
             if r.changed}
    assert "fuse_qkv" in fired


def test_a_winning_fp32_eager_exports_the_model_as_written(fp32_run):
    model, opt = fp32_run
    report, out = opt.report, Path(opt.tuner.cfg.out_dir)
    assert report["best"]["baseline"] == "fp32_eager"
    assert report["passes"] == []  # no tctune pass in what was exported
    arts = report["artifacts"]
    assert arts["onnx"] and arts["exported_graph"] == "model_as_written"
    shapes = sorted(tuple(sorted(i.dims)) for i in onnx.load(arts["onnx"]).graph.initializer if len(i.dims) == 2)
    # q, k, v stay three 32x32 weights (a fused QKV projection would be one 96x32 weight); ONNX may transpose them
    assert shapes == sorted(tuple(sorted(p.shape)) for p in model.parameters() if p.dim() == 2)
    md = (out / "report.md").read_text()
    assert "- Exported graph: the model as written in FP32: its captured graph, no tctune pass." in md
    assert "No graph passes ran for the best configuration." in md
    searched = [t for t in report["trials"] if t["state"] == "COMPLETE" and t["params"].get("graph_passes")]
    if searched:  # what the passes did on the searched candidates is not hidden behind the baseline's answer
        assert "The answer is the model without tctune's graph: it is a plain baseline" in md
    assert json.loads((out / "best_config.json").read_text())["passes"] == []


def test_the_fp32_onnx_matches_the_model_on_fresh_inputs(fp32_run):
    ort = pytest.importorskip("onnxruntime")
    model, opt = fp32_run
    sess = ort.InferenceSession(opt.report["artifacts"]["onnx"], providers=["CPUExecutionProvider"])
    x = torch.randn(5, 6, 32)
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = model(x).numpy()
    assert abs(got - want).max() < 1e-4


def test_the_console_says_what_was_exported(fp32_run):
    from tctune.cli.optimize import _summary

    _, opt = fp32_run
    text = _summary(opt.report, Path(opt.tuner.cfg.out_dir))
    assert "exported: the model as written in FP32: its captured graph, no tctune pass" in text


def test_tctune_export_rebuilds_the_model_as_written(tmp_path):
    from tctune.engines import rebuild_graphs
    from tctune.hardware import resolve
    from tctune.modelfile import load_model_file

    f = tmp_path / "attn.py"
    f.write_text("import torch\n"
                 f"{__import__('inspect').getsource(Attention)}\n"
                 "def build_model():\n"
                 "    torch.manual_seed(0)\n"
                 "    return Attention()\n"
                 "def example_inputs(batch_size):\n"
                 "    return (torch.randn(batch_size, 6, 32),)\n")
    mf = load_model_file(f)
    cfg = {"params": {"batch_size": 4, "precision": "fp32", "graph_passes": False, "runtime": "eager"},
           "batch_sizes": [4]}
    _, graphs = rebuild_graphs(mf, cfg, resolve(None), torch.device("cpu"))
    assert graphs.results == [] and graphs.graph is graphs.onnx_graph
    linears = [n for n in graphs.graph.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert len(linears) == 4  # q, k, v and o, unfused
    _, rewritten = rebuild_graphs(mf, {**cfg, "params": {**cfg["params"], "graph_passes": True}}, resolve(None),
                                  torch.device("cpu"))
    assert any(r.changed for r in rewritten.results if r.name == "fuse_qkv")  # tctune's graph still fuses
