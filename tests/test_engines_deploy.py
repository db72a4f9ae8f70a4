"""`tctune export`: the ONNX deploy facts (which file runs where) reach the manifest, and TensorRT is built from
the file ``deploy["tensorrt"]`` names."""
import json

import pytest

import tctune.export
from tctune.cli import main

CONV = '''
import torch
def build_model():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 8 * 8, 4))
def example_inputs(batch_size):
    return (torch.randn(batch_size, 3, 8, 8),)
'''


def _config(path, precision):
    cfg = {"model": "conv", "hardware": {"name": "CPU", "arch": "cpu", "compute_capability": "", "source": "cpu",
                                         "is_gpu": False},
           "params": {"batch_size": 4, "precision": precision, "graph_passes": True}, "batch_sizes": [2, 4],
           "passes": [], "calibration": False}
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_export_manifest_carries_deploy_and_tensorrt_builds_from_it(tmp_path, monkeypatch, capsys, precision):
    pytest.importorskip("onnxruntime")
    built = []

    def fake_build(onnx_path, engine_path, **kw):  # no TensorRT here: record which file it was given
        built.append(onnx_path.name)
        engine_path.write_bytes(b"engine")
        return {"tensorrt": str(engine_path)}

    monkeypatch.setattr(tctune.export, "tensorrt_available", lambda: (True, None))
    monkeypatch.setattr(tctune.export, "build_engine", fake_build)
    model = tmp_path / "conv.py"
    model.write_text(CONV)
    out = tmp_path / "out"
    rc = main(["export", str(model), "--config", str(_config(tmp_path / "best_config.json", precision)),
               "--format", "onnx,tensorrt", "--out", str(out), "--json"])
    assert rc == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    onnx = result["formats"]["onnx"]
    manifest = json.loads((out / "model.onnx.manifest.json").read_text())
    assert manifest["deploy"] == onnx["deploy"] and manifest["deploy_reason"] == onnx["deploy_reason"]
    assert onnx["deploy"]["tensorrt"] == "model.onnx" and built == ["model.onnx"]
    ort_file = onnx["deploy"].get("onnxruntime-cpu")
    assert ort_file in ("model.onnx", "model.fp32.onnx")
    if ort_file == "model.fp32.onnx":  # onnxruntime's CPU provider cannot run the bf16 file: the FP32 twin runs
        assert precision == "bf16" and (out / "model.fp32.onnx").exists()
        twin = json.loads((out / "model.fp32.onnx.manifest.json").read_text())
        assert twin["precision"] == "fp32" and "qdq" not in twin
        assert main(["bench", str(out / "model.fp32.onnx"), "--iters", "1", "--warmup", "0"]) == 0
    else:
        assert not (out / "model.fp32.onnx").exists()
