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


def test_export_console_lists_the_fp32_twin_and_every_file_written(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    model = tmp_path / "conv.py"
    model.write_text(CONV)
    out = tmp_path / "out"
    rc = main(["export", str(model), "--config", str(_config(tmp_path / "best_config.json", "bf16")),
               "--format", "onnx", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    manifest = json.loads((out / "model.onnx.manifest.json").read_text())
    twin = manifest["result"]["onnx_fp32"]
    if not twin:  # this onnxruntime runs the bf16 file itself: no twin to name
        pytest.skip("onnxruntime's CPU provider ran the bf16 ONNX file here: no model.fp32.onnx was written")
    assert f"also {out / 'model.fp32.onnx'}: the same graph in FP32" in text, text
    assert "deploy: tensorrt runs model.onnx, onnxruntime-cpu runs model.fp32.onnx (" in text, text
    written = next(line for line in text.splitlines() if line.strip().startswith("written:"))
    names = written.split("written:")[1].split(" (in ")[0].strip().split(", ")
    assert sorted(names) == sorted(p.name for p in out.iterdir()), (names, list(out.iterdir()))  # every file


def test_export_aoti_failure_keeps_the_other_formats_and_names_the_full_error(tmp_path, capsys, monkeypatch):
    import tctune.export.aoti as aoti
    from tctune.errors import ExportError

    def broken(*a, **k):  # a compile error whose detail (the compiler's output) is on later lines
        try:
            raise RuntimeError("C++ compile error\n/tmp/x.cpp:12: error: 'foo' was not declared in this scope")
        except RuntimeError as exc:
            raise ExportError("AOTInductor could not compile model.pt2: C++ compile error") from exc

    monkeypatch.setattr(aoti, "export_aoti", broken)
    model = tmp_path / "conv.py"
    model.write_text(CONV)
    out = tmp_path / "out"
    rc = main(["export", str(model), "--config", str(_config(tmp_path / "best_config.json", "fp32")),
               "--format", "onnx,aoti", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1  # a format failed: scripts see it
    log = out / "tctune_errors.log"
    assert "  aoti      failed: ExportError: AOTInductor could not compile model.pt2: C++ compile error" in text, text
    assert f"full error: {log}" in text
    full = log.read_text()
    assert "stage export aoti" in full and "'foo' was not declared in this scope" in full  # the whole chain
    assert "  onnx      built" in text and (out / "model.onnx").exists()  # the ONNX file is still reported
    assert "model.onnx, model.onnx.manifest.json, runner.py" in text and "model.pt2" not in text.split("written:")[1]
    capsys.readouterr()
    rc = main(["export", str(model), "--config", str(tmp_path / "best_config.json"), "--format", "aoti",
               "--out", str(out), "--json"])
    entry = json.loads(capsys.readouterr().out)["formats"]["aoti"]
    assert rc == 1 and entry["status"] == "failed" and entry["log"] == str(log) and entry["files"] == []


def test_export_onnx_failure_still_builds_aoti_and_skips_tensorrt(tmp_path, capsys, monkeypatch):
    """An ONNX export failure (a graph torch.onnx cannot export) is recorded like an AOTInductor one: the AOTInductor package is still built, TensorRT (which builds from the ONNX file) is skipped
    with the reason, the exit status is 1."""
    import tctune.engines as engines
    from tctune.errors import ExportError

    def broken(*a, **k):
        raise ExportError("torch.onnx.export failed for model.onnx: unsupported operator")

    monkeypatch.setattr(engines, "_build_onnx", broken)
    model = tmp_path / "conv.py"
    model.write_text(CONV)
    out = tmp_path / "out"
    rc = main(["export", str(model), "--config", str(_config(tmp_path / "best_config.json", "fp32")),
               "--format", "onnx,tensorrt,aoti", "--out", str(out), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 1
    formats = result["formats"]
    assert formats["onnx"]["status"] == "failed" and "unsupported operator" in formats["onnx"]["error"]
    assert formats["tensorrt"]["status"] == "skipped" and "ONNX export it builds from failed" in formats["tensorrt"]["reason"]
    assert formats["aoti"]["status"] == "built" and (out / "model.pt2").exists()
