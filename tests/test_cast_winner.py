"""A winning plain baseline that casts the model as a whole (``model.half()`` / ``model.to(torch.bfloat16)``,
trial user attribute ``model_cast``) is what tctune exports, recommends and returns: the cast model's graph in
``model.onnx`` (every floating initializer in the low dtype), ``best_config.json`` naming it, and a
``TunedModule`` whose parameters are in the low dtype, through save / load. An autocast winner still exports
tctune's graph of the model as written, as before.

CPU, eager runtime, tiny budgets; which trial wins is forced through ``best_trial`` (a seam: the winner is
timing, not under test here).
"""
from __future__ import annotations

import copy
import functools
import json
import sys
from pathlib import Path

import onnx
import pytest
import torch

import tctune
import tctune.optimize  # noqa: F401 - the pipeline module, patched below through sys.modules
from tctune import measure
from tctune.modelfile import ModelFile
from tctune.search import TuneConfig
from tctune.search.baselines import CastModel

LOW = {onnx.TensorProto.FLOAT16: torch.float16, onnx.TensorProto.BFLOAT16: torch.bfloat16}


from zoo import TwoHeads  # noqa: E402 - dict / nested-tuple outputs, buffers, a tied embedding
from zoo import two_heads_inputs as _inputs  # noqa: E402


def _leaves(out):
    return torch.utils._pytree.tree_leaves(out)


def _pick(mp, name: str):
    """Make plain baseline ``name`` the search's winner (the pipeline and the report agree on it)."""
    from tctune.search import results

    def best(study, *a, **k):
        return next(t for t in study.trials if results.is_feasible(t) and t.user_attrs.get("baseline") == name)

    mp.setattr(sys.modules["tctune.optimize"], "best_trial", best)
    mp.setattr(sys.modules["tctune.report"], "best_trial", best)


def _optimize(model, out, contract: str, winner: str):
    from tctune.optimize import optimize_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tctune.search.evaluate.time_call",
                   functools.partial(measure.time_call, repeats=1, single_calls=2, max_iterations=3, warmup=1))
        _pick(mp, winner)
        mf = ModelFile.from_module(model, _inputs)
        cfg = TuneConfig(out_dir=str(out), batch_sizes=(4,), trials=1, runtimes=("eager",), quiet=True,
                         output_dtype=contract)
        return optimize_model(mf, cfg)


@pytest.fixture(scope="module")
def cast_runs(tmp_path_factory):
    torch.manual_seed(0)
    model = TwoHeads().eval()
    runs = {c: _optimize(model, tmp_path_factory.mktemp(c), c, "cast_bf16") for c in ("compute", "fp32")}
    return model, runs


def _initializers(path):
    proto = onnx.load(str(path))
    return proto, [i for i in proto.graph.initializer
                   if i.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
                   and len(i.dims) > 0]


@pytest.mark.parametrize("contract", ["compute", "fp32"])
def test_a_winning_model_cast_exports_the_cast_model_graph(cast_runs, contract):
    _, runs = cast_runs
    opt = runs[contract]
    report, out = opt.report, opt.tuner.cfg.out_dir
    assert report["best"]["baseline"] == "cast_bf16" and report["best"]["model_cast"]
    assert report["best"]["label"] == "model.to(torch.bfloat16) eager"
    assert report["passes"] == []  # the cast model carries no tctune pass
    arts = report["artifacts"]
    assert arts["onnx"] and arts["exported_trial"] == report["best"]["trial"]
    proto, inits = _initializers(arts["onnx"])
    # every floating weight (the tied embedding / head, the linear, the buffers) is bf16: the cast model, not
    # an autocast graph, which keeps FP32 weights and casts them per op
    assert inits and {i.data_type for i in inits} == {onnx.TensorProto.BFLOAT16}
    names = [i.name for i in proto.graph.input]
    assert names == ["ids", "feats"]  # the model's argument names, not the wrapper's
    assert proto.graph.input[1].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # FP32 in, cast inside
    outs = {o.name: o.type.tensor_type.elem_type for o in proto.graph.output}
    # bf16 outputs are written FP32 under either contract (numpy has no bfloat16), and the report says so
    assert set(outs.values()) == {onnx.TensorProto.FLOAT}
    assert ("onnx_outputs_note" in arts) == (contract == "compute")
    cfg = json.loads((Path(out) / "best_config.json").read_text())
    assert cfg["model_cast"] is True and cfg["output_dtype"] == contract
    assert cfg["recommended"] == {"kind": "baseline", "name": "cast_bf16", "trial": report["best"]["trial"],
                                  "label": "model.to(torch.bfloat16) eager"}
    assert "policy" not in cfg["params"] or cfg["params"]["policy"] == "autocast"  # its measured params


def test_the_cast_onnx_runs_like_the_cast_model(cast_runs):
    """The exported graph computes what ``CastModel`` (the measured baseline) computes, on fresh inputs."""
    ort = pytest.importorskip("onnxruntime")
    model, runs = cast_runs
    arts = runs["fp32"].report["artifacts"]
    x = _inputs(5, 21)
    with torch.no_grad():
        want = _leaves(CastModel(model, torch.bfloat16, out_dtype=torch.float32)(*x))
    try:
        sess = ort.InferenceSession(arts["onnx"], providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - no bf16 kernel on this provider: the FP32 twin was written
        assert arts["onnx_load"] in ("no_kernel", "invalid") and arts["onnx_fp32"], exc
        return
    got = sess.run(None, {"ids": x[0].numpy(), "feats": x[1].numpy()})
    for g, w in zip(got, want):
        assert torch.allclose(torch.from_numpy(g), w, rtol=2e-2, atol=2e-2)


def test_the_tuned_module_is_the_cast_model_and_survives_save_and_load(cast_runs, tmp_path):
    from tctune.tuned import from_search

    model, runs = cast_runs
    for contract, want_dtype in (("compute", torch.bfloat16), ("fp32", torch.float32)):
        tuned = from_search(runs[contract])
        assert tuned.cast == "bf16" and tuned.autocast is None and tuned.manifest["cast"] == "bf16"
        params = dict(tuned.graph.named_parameters())
        assert params and all(p.dtype == torch.bfloat16 for p in params.values())
        assert tuned.graph.shift.dtype == torch.bfloat16 and tuned.graph.scale.dtype == torch.bfloat16
        assert tuned.graph.head.weight is tuned.graph.emb.weight  # still tied
        assert set(tuned.state_dict()) == set(model.state_dict())  # the original key names
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the user's model untouched
        x = _inputs(7, 31)
        out = tuned(*x)
        with torch.no_grad():
            ref = CastModel(model, torch.bfloat16, out_dtype=None if contract == "compute" else torch.float32)(*x)
        assert set(out) == {"logits", "extra"} and isinstance(out["extra"], tuple)
        for o, r in zip(_leaves(out), _leaves(ref)):
            assert o.dtype == want_dtype and torch.equal(o, r)  # exactly what model.to(bf16) returns
        loaded = tctune.load(tctune.save(tuned, tmp_path / f"{contract}.pt2"))
        assert loaded.cast == "bf16" and loaded.manifest["cast"] == "bf16"
        assert all(p.dtype == torch.bfloat16 for p in loaded.graph.parameters())
        assert loaded.manifest["inputs"][1]["dtype"] == "float32"  # the user still passes FP32 inputs
        back = loaded(*x)
        for o, b in zip(_leaves(out), _leaves(back)):
            assert b.dtype == want_dtype and torch.allclose(o.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_a_compile_baseline_of_the_cast_model_is_recommended_and_returned_as_compiled(cast_runs, tmp_path, monkeypatch):
    """``compile_cast_bf16`` (torch.compile of ``model.to(torch.bfloat16)``; on the GPU only, so its trial is made
    here from the eager one): best_config names it, and the TunedModule is the cast model through torch.compile."""
    from tctune.optimize import Optimized, write_best_config
    from tctune.tuned import from_search

    model, runs = cast_runs
    opt = runs["compute"]
    t = copy.deepcopy(opt.best)
    t.params = {**t.params, "runtime": "inductor"}
    t.user_attrs = {**t.user_attrs, "baseline": "compile_cast_bf16"}
    write_best_config(tmp_path / "best_config.json", opt.tuner, t, [], "s")
    cfg = json.loads((tmp_path / "best_config.json").read_text())
    assert cfg["recommended"]["label"] == "torch.compile(model.to(torch.bfloat16))" and cfg["model_cast"] is True
    assert cfg["params"]["runtime"] == "inductor"
    calls = []

    def fake_compile(fn, mode=None, dynamic=None):
        calls.append(mode)
        return fn  # what is compiled is under test, not Inductor itself

    monkeypatch.setattr(torch, "compile", fake_compile)
    tuned = from_search(Optimized(opt.report, opt.tuner, t))
    assert (tuned.runtime, tuned.cast, tuned.config.precision) == ("inductor", "bf16", "bf16")
    x = _inputs(3, 41)
    out = tuned(*x)
    assert calls == ["default"]
    with torch.no_grad():
        ref = CastModel(model, torch.bfloat16, out_dtype=None)(*x)
    assert all(o.dtype == torch.bfloat16 and torch.equal(o, r) for o, r in zip(_leaves(out), _leaves(ref)))


def test_the_fp16_cast_graph_keeps_fp16_outputs_under_compute():
    """fp16 (numpy has float16): the cast graph returns its outputs in fp16 under ``"compute"``, FP32 under
    ``"fp32"``; every floating parameter is fp16; the captured dynamic batch carries over."""
    from tctune.capture import capture, dynamic_dims
    from tctune.deploy import cast_export_graphs

    torch.manual_seed(3)
    model = TwoHeads().eval()
    gm = capture(model, _inputs(2))
    for contract, want in (("compute", torch.float16), ("fp32", torch.float32)):
        g = cast_export_graphs(model, gm, "fp16", _inputs(2), contract).onnx_graph
        assert all(p.dtype == torch.float16 for p in g.parameters())
        assert dynamic_dims(g) == dynamic_dims(gm)
        x = _inputs(5, 51)
        with torch.no_grad():
            out = g(*x)
        assert out["logits"].shape == (5, 6, 50) and out["logits"].dtype == want
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_an_autocast_winner_still_exports_tctune_graph_of_the_model_as_written(tmp_path):
    torch.manual_seed(0)
    model = TwoHeads().eval()
    opt = _optimize(model, tmp_path / "a", "compute", "autocast_bf16")
    report = opt.report
    assert report["best"]["baseline"] == "autocast_bf16" and not report["best"]["model_cast"]
    assert report["passes"] and all("model as written" in p["note"] for p in report["passes"])
    cfg = json.loads((tmp_path / "a" / "best_config.json").read_text())
    assert "model_cast" not in cfg and cfg["recommended"]["label"] == "autocast bf16 eager"
    _, inits = _initializers(report["artifacts"]["onnx"] or report["artifacts"]["onnx_fp32"])
    # tctune's autocast-policy graph: the GEMM weights low, the ops autocast runs in FP32 (the buffer added
    # after the activation) keep FP32 constants; the cast model has none (test above)
    assert {onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16} <= {i.data_type for i in inits}
    assert report["artifacts"]["exported_graph"] == "tctune_graph"  # and the answer says so plainly
    assert ("- Exported graph: **tctune's rewritten graph at bf16, not the model as written**"
            in (tmp_path / "a" / "report.md").read_text())


def test_tctune_export_rebuilds_the_cast_model_from_best_config(tmp_path):
    """``tctune export --config best_config.json`` of a ``model_cast`` winner rebuilds the cast model's graph."""
    from tctune.engines import rebuild_graphs
    from tctune.hardware import resolve
    from tctune.modelfile import load_model_file

    f = tmp_path / "mlp.py"
    f.write_text("import torch\n"
                 "def build_model():\n"
                 "    torch.manual_seed(0)\n"
                 "    return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 2))\n"
                 "def example_inputs(batch_size):\n"
                 "    return (torch.randn(batch_size, 10),)\n")
    mf = load_model_file(f)
    cfg = {"params": {"batch_size": 4, "precision": "fp16", "graph_passes": False, "runtime": "eager"},
           "model_cast": True, "output_dtype": "compute", "batch_sizes": [4]}
    trial, graphs = rebuild_graphs(mf, cfg, resolve(None), torch.device("cpu"))
    assert trial.precision == "fp16" and graphs.results == [] and graphs.fp8 is None
    assert all(p.dtype == torch.float16 for p in graphs.onnx_graph.parameters())
    x = torch.randn(3, 10)
    out = graphs.onnx_graph(x)
    with torch.no_grad():
        ref = mf.model().half()(x.half())
    assert out.dtype == torch.float16 and torch.equal(out, ref)
    _, plain = rebuild_graphs(mf, {**cfg, "model_cast": False}, resolve(None), torch.device("cpu"))
    assert plain.results  # without the flag: tctune's graph of the model as written, as before
