"""Real input shapes: a model file's ``torch.export.Dim`` beyond the batch (capture, passes, ONNX, TensorRT
profile, report), inputs that are not batched, and the error for a dimension that changes undeclared."""
from __future__ import annotations

import textwrap

import pytest
import torch

from tctune.capture import (Captured, batched_inputs, capture, dynamic_dims, normalize_dynamic_shapes,
                            resize_inputs, validation_sizes)
from tctune.errors import ModelFileError
from tctune.export.tensorrt import build_engine, profile_ranges, profile_shapes
from tctune.hardware import resolve
from tctune.modelfile import load_model_file
from tctune.trial import apply_passes, reference_inputs

# A tiny BERT-like encoder: token ids (batch, seq) plus three inputs that are not batched — a broadcast additive
# mask (1, 1, seq, seq), a weight-like (7, 2) tensor and a 0-d scale. Widths are not multiples of 8 so the
# padding passes fire when planning for a GPU.
MODEL = textwrap.dedent('''
    import torch
    from torch.export import Dim

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 20)
            self.qkv = torch.nn.Linear(20, 60)
            self.out = torch.nn.Linear(20, 20)
            self.norm = torch.nn.LayerNorm(20)
            self.head = torch.nn.Linear(20, 7)

        def forward(self, ids, mask, table, scale):
            h = self.emb(ids)
            b, s, _ = h.shape
            q, k, v = (t.reshape(b, s, 2, 10).transpose(1, 2) for t in self.qkv(h).chunk(3, dim=-1))
            a = torch.softmax(q @ k.transpose(-1, -2) / 10 ** 0.5 + mask, dim=-1) @ v
            h = self.norm(h + self.out(a.transpose(1, 2).reshape(b, s, 20)))
            return self.head(h) @ table * scale

    def build_model():
        torch.manual_seed(0)
        return Tiny()

    SEQ = 12

    def example_inputs(batch_size):
        ids = torch.randint(0, 50, (batch_size, SEQ))
        mask = torch.triu(torch.full((SEQ, SEQ), -1e4), diagonal=1)[None, None]
        return ids, mask, torch.randn(7, 2), torch.tensor(0.5)
''')

DYNAMIC = '''
seq = Dim("seq", min=2, max=64)
DYNAMIC_SHAPES = {"ids": {1: seq}, "mask": {2: seq, 3: seq}}
'''


def _write(tmp_path, text, name="tiny.py"):
    p = tmp_path / name
    p.write_text(text)
    return p


def _eager_and_graph(mf):
    model = mf.model().eval()
    gm = capture(model, mf.inputs(2), mf.dynamic_shapes, mf.batched_mask())
    return model, gm


def _at(mf, batch, seq):
    torch.manual_seed(100 + batch + seq)
    return resize_inputs(mf.inputs(batch), dynamic_dims_of_seq(), {"seq": seq})


def dynamic_dims_of_seq():
    return [{"input": 0, "dim": 1, "symbol": "seq"}, {"input": 1, "dim": 2, "symbol": "seq"},
            {"input": 1, "dim": 3, "symbol": "seq"}]


# ------------------------------------------------------------------------------------------- model file, capture


def test_model_file_declares_seq_and_the_captured_graph_runs_at_two_lengths(tmp_path):
    mf = load_model_file(_write(tmp_path, MODEL + DYNAMIC))
    assert set(mf.dynamic_shapes) == {"ids", "mask"}
    assert mf.batched_mask() == (True, False, False, False)
    model, gm = _eager_and_graph(mf)
    dims = {(d["name"], d["dim"]): d for d in dynamic_dims(gm)}
    assert dims[("ids", 0)]["symbol"] == "batch"
    assert {k: (v["symbol"], v["min"], v["max"], v["example"]) for k, v in dims.items() if k != ("ids", 0)} == {
        ("ids", 1): ("seq", 2, 64, 12), ("mask", 2): ("seq", 2, 64, 12), ("mask", 3): ("seq", 2, 64, 12)}
    assert batched_inputs(gm) == (True, False, False, False)
    info = Captured(gm).info()
    assert info["ok"] and {d["symbol"] for d in info["dynamic"]} == {"batch", "seq"}
    with torch.no_grad():
        for batch, seq in ((3, 5), (1, 40)):
            x = _at(mf, batch, seq)
            assert x[0].shape == (batch, seq) and x[1].shape == (1, 1, seq, seq)
            torch.testing.assert_close(gm(*x), model(*x))


def test_tuned_graph_keeps_seq_dynamic(tmp_path):
    """The passes (planned for an H100: padding and bf16 casts fire) run on the symbolic graph; the result runs
    at two sequence lengths within bf16's error of eager FP32."""
    mf = load_model_file(_write(tmp_path, MODEL + DYNAMIC))
    model, gm = _eager_and_graph(mf)
    tuned, results = apply_passes(gm, resolve("h100"), "bf16")
    fired = {r.name: r.count for r in results}
    assert fired.get("pad_linear_dims", 0) > 0 and fired.get("cast_precision", 0) > 0
    assert dynamic_dims(tuned) == dynamic_dims(gm)  # the shapes travel with the graph (ONNX export reads them)
    with torch.no_grad():
        for batch, seq in ((2, 7), (4, 30)):
            x = _at(mf, batch, seq)
            out, ref = tuned(*x), model(*x)
            assert out.shape == ref.shape
            torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)


def test_onnx_of_the_tuned_graph_declares_seq_and_validates_at_two_lengths(tmp_path):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    from tctune.export.onnx import export_onnx

    mf = load_model_file(_write(tmp_path, MODEL + DYNAMIC))
    model, gm = _eager_and_graph(mf)
    tuned, results = apply_passes(gm, resolve(None), "fp32")  # the tuned graph, as the export writes it
    assert {r.name: r.count for r in results}["fuse_attention"] == 1
    info = export_onnx(tuned, lambda b: mf.inputs(b), tmp_path / "tiny.onnx")
    assert info["onnx_error"] is None, info["onnx_error"]
    shapes = {v["name"]: v["shape"] for v in info["onnx_inputs"]}
    assert shapes["ids"] == ["batch", "seq"] and shapes["mask"] == [1, 1, "seq", "seq"]
    assert shapes["table"] == [7, 2] and shapes["scale"] == []
    sizes = [e.get("sizes") for e in info["onnx_validation"]]
    assert sizes == [None, None, {"seq": 6}]
    assert all(e["max_abs_error"] is not None and e["max_abs_error"] < 1e-4 for e in info["onnx_validation"])
    # and onnxruntime takes a third length the validation did not use
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "tiny.onnx"), providers=["CPUExecutionProvider"])
    x = _at(mf, 3, 41)
    got = sess.run(None, {n: t.numpy() for n, t in zip(("ids", "mask", "table", "scale"), x)})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, model(*x).numpy(), atol=1e-4, rtol=1e-4)


def test_without_dynamic_shapes_seq_is_fixed(tmp_path):
    """The same model without DYNAMIC_SHAPES: seq specializes, the graph refuses another length."""
    mf = load_model_file(_write(tmp_path, MODEL))
    _, gm = _eager_and_graph(mf)
    assert [d["symbol"] for d in dynamic_dims(gm)] == ["batch"]
    with pytest.raises(AssertionError, match=r"Guard failed: ids.size\(\)\[1\] == 12"):
        gm(*_at(mf, 2, 5))


# ----------------------------------------------------------------------------------------- non-batched inputs


def test_non_batched_inputs_are_detected_and_stay_fixed(tmp_path):
    mf = load_model_file(_write(tmp_path, MODEL))
    assert mf.batched_mask() == (True, False, False, False)
    for b in (1, 4, 9):
        ids, mask, table, scale = reference_inputs(mf, b, "cpu")
        assert ids.shape == (b, 12) and mask.shape == (1, 1, 12, 12) and table.shape == (7, 2) and scale.dim() == 0
    model, gm = _eager_and_graph(mf)
    x = reference_inputs(mf, 5, "cpu")
    with torch.no_grad():
        torch.testing.assert_close(gm(*x), model(*x))


@pytest.mark.parametrize("named", ['("ids",)', "(0,)", '"ids"'])
def test_batched_inputs_named_in_the_model_file(tmp_path, named):
    mf = load_model_file(_write(tmp_path, MODEL + f"\nBATCHED_INPUTS = {named}\n"))
    assert mf.batched_mask() == (True, False, False, False)


def test_batched_inputs_unknown_name(tmp_path):
    mf = load_model_file(_write(tmp_path, MODEL + '\nBATCHED_INPUTS = ("input_ids",)\n'))
    with pytest.raises(ModelFileError, match=r"BATCHED_INPUTS names 'input_ids'.*\n.*fix: use an index 0..3"):
        mf.inputs(2)


def test_search_measures_non_batched_inputs_fixed_and_reports_dynamic_dims(tmp_path):
    """A short CPU search of the model with a sequence Dim and its three non-batched inputs: trials complete
    at two batch sizes, and the report says which dimensions are dynamic and over what range."""
    from tctune.optimize import optimize
    from tctune.search.config import TuneConfig

    path = _write(tmp_path, MODEL + DYNAMIC)
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(2, 4), trials=4, runtimes=("eager",),
                     export=False, quiet=True)
    report = optimize(path, cfg)
    assert report["capture"]["ok"]
    dyn = {(d["name"], d["dim"]): (d["symbol"], d["min"], d["max"]) for d in report["capture"]["dynamic"]}
    assert dyn[("ids", 1)] == ("seq", 2, 64) and dyn[("mask", 3)] == ("seq", 2, 64)
    assert dyn[("ids", 0)][0] == "batch" and ("table", 0) not in dyn
    done = [t for t in report["trials"] if t["state"] == "COMPLETE"]
    assert {t["params"]["batch_size"] for t in done} == {2, 4}
    assert any(t["params"].get("graph_passes") for t in done)
    md = next((tmp_path / "out").rglob("report.md")).read_text()
    assert "ids dim 1 = seq 2..64 (example 12)" in md and "mask dim 3 = seq 2..64" in md


# ------------------------------------------------------------------------------------- undeclared dimensions


@pytest.mark.parametrize("seq_expr", ["8 + batch_size", "int(torch.randint(5, 400, ()))"])
def test_undeclared_changing_dim_is_one_clear_error_at_load(tmp_path, seq_expr):
    src = MODEL.replace("    SEQ = 12\n", "").replace("def example_inputs(batch_size):\n",
                                                         f"def example_inputs(batch_size):\n    SEQ = {seq_expr}\n")
    mf = load_model_file(_write(tmp_path, src))
    with pytest.raises(ModelFileError) as err:
        mf.inputs(2)
    msg = str(err.value)
    assert "input 0 (ids) dim 1 is " in msg and "not declared dynamic" in msg
    assert "fix: declare it with torch.export.Dim in dynamic_shapes" in msg
    assert msg.count("\n") == 1  # one error: cause line, fix line


def test_declared_changing_dim_is_accepted(tmp_path):
    src = MODEL.replace("    SEQ = 12\n", "").replace("def example_inputs(batch_size):\n",
                                                         "def example_inputs(batch_size):\n    SEQ = 8 + batch_size\n")
    mf = load_model_file(_write(tmp_path, src + DYNAMIC))
    assert mf.inputs(3)[0].shape == (3, 11)


def test_dim0_that_follows_the_batch_without_being_it(tmp_path):
    src = MODEL.replace("return ids, mask, torch.randn(7, 2)", "return ids, mask, torch.randn(2 * batch_size, 2)")
    mf = load_model_file(_write(tmp_path, src))
    with pytest.raises(ModelFileError, match=r"input 2 \(table\) has dim 0 4 at batch 2, 6 at batch 3.*not the batch"):
        mf.inputs(2)


def test_dynamic_shapes_function_and_bad_specs(tmp_path):
    mf = load_model_file(_write(tmp_path, MODEL + "\ndef dynamic_shapes():\n    return (None, None, None, None)\n"))
    assert mf.dynamic_shapes == (None, None, None, None)
    with pytest.raises(ModelFileError, match="DYNAMIC_SHAPES must be a tuple"):
        load_model_file(_write(tmp_path, MODEL + "\nDYNAMIC_SHAPES = 3\n", "bad.py"))
    mf = load_model_file(_write(tmp_path, MODEL + "\nDYNAMIC_SHAPES = ({1: Dim('s')},)\n", "short.py"))
    with pytest.raises(ModelFileError, match=r"dynamic_shapes has 1 entries for 4 input"):
        mf.inputs(2)
    x = (torch.zeros(2, 3),)
    with pytest.raises(ValueError, match="dim 5 of input 0"):
        normalize_dynamic_shapes(({5: torch.export.Dim("s")},), x)
    with pytest.raises(ValueError, match=r"names \['y'\]"):
        normalize_dynamic_shapes({"y": {1: torch.export.Dim("s")}}, x, ["x"])
    assert normalize_dynamic_shapes(([None, torch.export.Dim("s")],), x)[0].keys() == {1}


def test_resize_and_validation_sizes():
    dims = [{"input": 0, "dim": 1, "symbol": "seq", "min": 2, "max": 64, "example": 12},
            {"input": 1, "dim": 0, "symbol": "n", "min": 3, "max": 3 + 0, "example": 3}]
    assert validation_sizes(dims) == {"seq": 6}  # n's range is one size: nothing else to validate at
    ids = torch.arange(24).reshape(2, 12)
    small = resize_inputs((ids, torch.ones(3)), dims, {"seq": 5})[0]
    assert torch.equal(small, ids[:, :5])
    big = resize_inputs((ids, torch.ones(3)), dims, {"seq": 30})[0]
    assert big.shape == (2, 30) and torch.equal(big[:, 12:24], ids)


# ------------------------------------------------------------------------------------------- TensorRT profile


def test_tensorrt_profile_from_dim_ranges():
    dynamic = [{"symbol": "batch", "min": 1, "max": 65536, "example": 2},
               {"symbol": "seq", "min": 2, "max": 64, "example": 12},
               {"symbol": "seq", "min": 2, "max": 64, "example": 12},
               {"symbol": "hw", "min": 1, "max": None, "example": 32}]
    ranges, notes = profile_ranges(dynamic)
    assert ranges == {"seq": (2, 12, 64), "hw": (1, 32, 32)}
    assert len(notes) == 1 and "hw has no max" in notes[0]
    shapes = profile_shapes({"ids": ["batch", "seq"], "mask": [1, 1, "seq", "seq"], "img": (-1, 3, "hw", "hw")},
                            (1, 8, 32), ranges)
    assert shapes["ids"] == {"min": (1, 2), "opt": (8, 12), "max": (32, 64)}
    assert shapes["mask"] == {"min": (1, 1, 2, 2), "opt": (1, 1, 12, 12), "max": (1, 1, 64, 64)}
    assert shapes["img"]["max"] == (32, 3, 32, 32)
    with pytest.raises(ValueError, match="dynamic dimension 'seq', which has no range"):
        profile_shapes({"ids": ["batch", "seq"]}, (1, 8, 32))
    with pytest.raises(ValueError, match="the range of seq must be min <= opt <= max"):
        profile_shapes({"ids": ["batch", "seq"]}, (1, 8, 32), {"seq": (8, 4, 64)})
    # build_engine checks the profile before looking for TensorRT
    with pytest.raises(ValueError, match="no range"):
        build_engine("m.onnx", "m.engine", input_shapes={"ids": (-1, "seq")}, batch_sizes=(1, 8, 32))


class _PositionTable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(12, 4))

    def forward(self, x):
        return x + self.pos  # the sequence length is fixed to 12


class _Bounded(torch.nn.Module):
    def forward(self, x):
        torch._check(x.shape[1] <= 32)
        return x * 2


@pytest.mark.parametrize("model,fix", [(_PositionTable(), "seq = 12"), (_Bounded(), "seq = Dim('seq', max=32)")])
def test_declared_dim_the_model_fixes_is_one_clear_error(model, fix):
    from tctune.errors import CaptureError

    with pytest.raises(CaptureError) as err:
        capture(model, (torch.randn(2, 12, 4),), ({1: torch.export.Dim("seq", min=2, max=64)},))
    msg = str(err.value)
    assert "dynamic batch and dynamic seq" in msg and "fixes or bounds the dimension(s) seq" in msg
    assert f"torch.export suggests {fix}" in msg


def test_runner_manifest_keeps_non_batched_shapes(tmp_path):
    from tctune.export.runner import describe_inputs

    mf = load_model_file(_write(tmp_path, MODEL + DYNAMIC))
    _, gm = _eager_and_graph(mf)
    described = describe_inputs(gm, mf.inputs, ["ids", "mask", "table", "scale"], (2, 3))
    assert [d["shape"] for d in described] == [["batch", 12], [1, 1, 12, 12], [7, 2], []]
    assert described[0]["range"] == [0, 50]


def test_batch_on_another_dim_than_0_is_named_as_such(tmp_path):
    # A time-major input (T, B, F): dim 1 is the batch at every call. The error says so and asks for the batch
    # first; it does not suggest declaring the batch as a dynamic sequence-like dimension.
    src = textwrap.dedent('''
        import torch
        class TimeMajor(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(12, 4)
            def forward(self, x):
                return self.fc(x).sum(0)
        def build_model():
            return TimeMajor()
        def example_inputs(batch_size):
            return (torch.randn(10, batch_size, 12),)
    ''')
    mf = load_model_file(_write(tmp_path, src))
    with pytest.raises(ModelFileError) as err:
        mf.inputs(2)
    msg = str(err.value)
    assert "input 0 (x) has its batch on dim 1" in msg and "(10, 3, 12)" in msg
    assert "fix: put the batch first" in msg and "movedim(0, 1)" in msg
    assert "DYNAMIC_SHAPES" not in msg and msg.count("\n") == 1
