"""Tests for ``tctune export`` / ``tctune bench``, the manifest + generated runner, AOTInductor and the cache.

Configs are written by hand in the ``best_config.json`` format ``tctune optimize`` writes (CPU hardware,
fp32), so no study runs here. TensorRT cannot be installed on these machines: the ``tensorrt`` format is
checked only for its skip message (the build itself is covered against a stand-in in test_export.py).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tctune.cli import main
from tctune.errors import ExportError
from tctune.export import cache
from tctune.export.runner import describe_inputs, write_runner

ROOT = Path(__file__).resolve().parents[1]
SEED_CNN = ROOT / "recipes" / "seed_cnn.py"
FP32_TOL = 1e-4  # engine vs PyTorch, fp32 end to end (observed ~1e-6)

BERT_TINY = textwrap.dedent('''
    import torch
    from transformers import BertConfig, BertModel

    class Encoder(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids):
            return self.bert(input_ids=input_ids).last_hidden_state

    def build_model():
        torch.manual_seed(0)
        cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                         vocab_size=1000, max_position_embeddings=64)
        return Encoder(BertModel(cfg, add_pooling_layer=False))

    def example_inputs(batch_size):
        return (torch.randint(0, 1000, (batch_size, 16)),)
''')

FROZEN = textwrap.dedent('''
    import torch

    class Frozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.fc(x.reshape(4, 16))  # hard-coded batch of 4

    def build_model():
        torch.manual_seed(0)
        return Frozen()

    def example_inputs(batch_size):
        return (torch.randn(batch_size, 16),)
''')


def _config(path: Path, batch_size: int = 8, batch_sizes=(8, 16), precision: str = "fp32",
            model: str = "seed_cnn") -> Path:
    """A best_config.json as ``tctune optimize`` writes it for the model file named ``model``, tuned on this CPU."""
    cfg = {"model": model, "hardware": {"name": "CPU (x86_64)", "arch": "cpu", "compute_capability": "",
                                      "source": "cpu", "is_gpu": False},
           "params": {"batch_size": batch_size, "precision": precision, "graph_passes": True},
           "batch_sizes": list(batch_sizes), "passes": [], "tctune_version": "0.1.0"}
    path.write_text(json.dumps(cfg))
    return path


def _export(capsys, *argv) -> tuple[int, str, str]:
    rc = main(["export", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def seed_export(tmp_path_factory):
    """Seed CNN exported once to ONNX (+ the tensorrt skip): (out folder, config path); its console output is
    kept in ``stdout.txt`` beside the out folder."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("seed")
    cfg = _config(root / "best_config.json")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["export", str(SEED_CNN), "--config", str(cfg), "--format", "onnx,tensorrt", "--out",
                   str(root / "out")])
    (root / "stdout.txt").write_text(printed.getvalue())
    assert rc == 0
    return root / "out", cfg


def test_a_first_build_into_an_empty_folder_gives_no_reason_for_not_reusing(seed_export):
    # Nothing was there to reuse: the console says "built", not "not reused: model.onnx has no manifest".
    out, _ = seed_export
    stdout = (out.parent / "stdout.txt").read_text()
    assert "onnx      built" in stdout and "not reused" not in stdout
    manifest = json.loads((out / "model.onnx.manifest.json").read_text())
    assert "rebuilt" not in manifest["result"]


# ------------------------------------------------------------------------------------------------ export


def test_export_seed_cnn_writes_validated_onnx_manifest_and_runner(seed_export, ort):
    out, _ = seed_export
    manifest = json.loads((out / "model.onnx.manifest.json").read_text())
    assert manifest["inputs"] == [{"name": "x", "shape": ["batch", 3, 32, 32], "dtype": "float32"}]
    assert manifest["batch_sizes"] == {"min": 1, "opt": 8, "max": 16}
    validated = {v["batch_size"]: v["max_abs_error"] for v in manifest["result"]["onnx_validation"]}
    assert set(validated) == {1, 8, 16} and max(validated.values()) < FP32_TOL
    assert len(manifest["cache_key"]["digest"]) == 64 and manifest["cache_key"]["precision"] == "fp32"
    runner = (out / "runner.py").read_text()
    assert 'DEFAULT_ARTIFACT = "model.onnx"' in runner
    assert "import tctune" not in runner and "\nimport torch" not in runner  # torch only inside the .pt2 loader


def test_export_tensorrt_prints_skip_reason_without_tensorrt(seed_export, capsys):
    pytest.importorskip("onnx")
    from tctune.export import tensorrt_available

    if tensorrt_available()[0]:
        pytest.skip("tensorrt is installed here: the skip path is not taken")
    out, cfg = seed_export
    rc, stdout, _ = _export(capsys, SEED_CNN, "--config", cfg, "--format", "onnx,tensorrt", "--out", out)
    assert rc == 0
    assert "tensorrt  skipped: tensorrt is not installed" in stdout
    assert not (out / "model.engine").exists()


def test_bench_onnx_prints_table_and_json(seed_export, capsys, ort):
    out, _ = seed_export
    assert main(["bench", str(out / "model.onnx"), "--batch", "1,8", "--iters", "3", "--warmup", "1"]) == 0
    table = capsys.readouterr().out
    assert "median ms" in table and "items/s" in table and table.count("model.onnx") == 2
    assert main(["bench", str(out / "model.onnx"), "--iters", "3", "--warmup", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["batch_size"] == 8 and row["format"] == "onnx" and row["latency_ms"] > 0 and row["throughput"] > 0
    if row["device"] == "CPUExecutionProvider":  # one measurement on the CPU, labelled so
        assert row["timing"] == "device-resident" and "same measurement" in row["timing_note"]


def test_bench_engine_without_tensorrt_is_a_clear_error(seed_export, tmp_path, capsys):
    from tctune.export import tensorrt_available

    if tensorrt_available()[0]:
        pytest.skip("tensorrt is installed here")
    out, _ = seed_export
    engine = tmp_path / "model.engine"
    engine.write_bytes(b"not an engine")
    shutil.copy(out / "model.onnx.manifest.json", tmp_path / "model.engine.manifest.json")
    assert main(["bench", str(engine), "--iters", "1"]) == 1
    err = capsys.readouterr().err
    assert "tensorrt is not installed" in err and "fix:" in err and "Traceback" not in err


def test_bench_without_manifest_names_the_fix(tmp_path, capsys):
    onnx_file = tmp_path / "m.onnx"
    onnx_file.write_bytes(b"")
    assert main(["bench", str(onnx_file)]) == 2
    assert "no manifest" in capsys.readouterr().err


def test_export_bert_records_int_range_from_embedding(tmp_path, capsys, ort):
    pytest.importorskip("transformers")
    model_file = tmp_path / "bert_tiny.py"
    model_file.write_text(BERT_TINY)
    cfg = _config(tmp_path / "best_config.json", batch_size=4, batch_sizes=(2, 4), model="bert_tiny")
    rc, stdout, err = _export(capsys, model_file, "--config", cfg, "--format", "onnx", "--out", tmp_path / "out")
    assert rc == 0, err
    manifest = json.loads((tmp_path / "out" / "model.onnx.manifest.json").read_text())
    assert manifest["inputs"] == [{"name": "input_ids", "shape": ["batch", 16], "dtype": "int64", "range": [0, 1000]}]
    assert manifest["result"]["onnx_max_abs_error"] < FP32_TOL
    assert main(["bench", str(tmp_path / "out" / "model.onnx"), "--batch", "2", "--iters", "2", "--warmup", "1"]) == 0
    assert "model.onnx" in capsys.readouterr().out


def test_describe_inputs_without_embedding_uses_max_seen():
    make = lambda b: (torch.randint(3, 7, (b, 5)), torch.randn(b, 2))  # noqa: E731
    described = describe_inputs(None, make, ["ids", "feats"], (64, 64))
    assert described[0] == {"name": "ids", "shape": ["batch", 5], "dtype": "int64", "range": [3, 7]}
    assert described[1] == {"name": "feats", "shape": ["batch", 2], "dtype": "float32"}


def test_export_frozen_batch_fails_with_clear_message(tmp_path, capsys):
    model_file = tmp_path / "frozen.py"
    model_file.write_text(FROZEN)
    cfg = _config(tmp_path / "best_config.json", model="frozen")
    rc, _, err = _export(capsys, model_file, "--config", cfg, "--format", "onnx", "--out", tmp_path / "out")
    assert rc != 0
    assert "batch" in err and "fix: make the batch dimension dynamic" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "model.onnx").exists()


class _IntBatch(torch.nn.Module):
    """Eager PyTorch takes any batch; the ONNX export freezes it (``int(x.shape[0])``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x.reshape(int(x.shape[0]), 16))


def test_onnx_axis_frozen_in_export_raises_export_error(tmp_path):
    from tctune.engines import _build_onnx

    with pytest.raises(ExportError, match=r"(?s)batch axis froze.*fix: make the batch dimension dynamic"):
        _build_onnx(_IntBatch().eval(), lambda b: (torch.randn(b, 16),), tmp_path / "model.onnx", (1, 2, 5))


def test_export_bad_config_is_usage_error(tmp_path, capsys):
    bad = tmp_path / "best_config.json"
    bad.write_text('{"params": {}}')
    rc, _, err = _export(capsys, SEED_CNN, "--config", bad, "--format", "onnx")
    assert rc == 2 and "params.batch_size" in err and "fix:" in err


# ------------------------------------------------------------------------------------------------ cache


def test_export_reuses_matching_artifact_and_rebuilds_on_changed_key(seed_export, tmp_path, capsys):
    out, cfg = seed_export
    before = (out / "model.onnx").stat().st_mtime_ns
    rc, stdout, _ = _export(capsys, SEED_CNN, "--config", cfg, "--format", "onnx", "--out", out)
    assert rc == 0 and "onnx      reused" in stdout
    assert (out / "model.onnx").stat().st_mtime_ns == before

    changed = _config(tmp_path / "best_config.json", batch_size=8, batch_sizes=(8, 32))  # new largest batch
    rc, stdout, _ = _export(capsys, SEED_CNN, "--config", changed, "--format", "onnx", "--out", out)
    assert rc == 0 and "onnx      built" in stdout
    assert "not reused: model.onnx's batch_sizes differ from this build's" in stdout  # says why it rebuilt
    manifest = json.loads((out / "model.onnx.manifest.json").read_text())
    assert manifest["cache_key"]["batch_sizes"]["max"] == 32


def test_stale_reason_names_what_differs(tmp_path):
    """A rebuild says why the artifact there was not reused: other weights (an unseeded build_model()), or the
    key fields that differ; nothing when there is no artifact or the key matches."""
    inputs = [{"name": "x", "shape": ["batch", 4], "dtype": "float32"}]
    sizes = {"min": 1, "opt": 8, "max": 16}
    a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)  # two draws of random weights
    with torch.no_grad():
        b.weight.copy_(a.weight + torch.rand_like(a.weight) + 0.1)
        b.bias.copy_(a.bias)
    key_a = cache.artifact_key(a, fmt="onnx", precision="fp32", inputs=inputs, batch_sizes=sizes,
                               compute_capability=None)
    artifact = tmp_path / "model.onnx"
    assert cache.stale_reason(artifact, key_a) is None  # nothing there
    artifact.write_bytes(b"onnx")
    assert cache.stale_reason(artifact, key_a) == "model.onnx has no manifest with a cache key beside it"
    (tmp_path / "model.onnx.manifest.json").write_text(json.dumps({"cache_key": key_a}))
    assert cache.stale_reason(artifact, key_a) is None and cache.cached(artifact, key_a) is not None
    key_b = cache.artifact_key(b, fmt="onnx", precision="fp32", inputs=inputs, batch_sizes=sizes,
                               compute_capability=None)
    assert cache.cached(artifact, key_b) is None
    assert cache.stale_reason(artifact, key_b).startswith("model.onnx's graph or weights differ from this build's "
                                                         "(a build_model() that draws random weights")
    key_c = cache.artifact_key(a, fmt="onnx", precision="fp32", inputs=inputs, batch_sizes={**sizes, "max": 32},
                               compute_capability=None)
    assert cache.stale_reason(artifact, key_c) == "model.onnx's batch_sizes differ from this build's"


def test_graph_hash_follows_weights_not_identity():
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 2)
    b = torch.nn.Linear(4, 2)
    b.load_state_dict(a.state_dict())
    assert cache.graph_hash(a) == cache.graph_hash(b)
    with torch.no_grad():
        b.weight[0, 0] += 1.0
    assert cache.graph_hash(a) != cache.graph_hash(b)


def test_artifact_key_changes_with_precision_and_capability():
    m = torch.nn.Linear(4, 2)
    common = dict(fmt="tensorrt", inputs=[{"name": "x", "shape": ["batch", 4], "dtype": "float32"}],
                  batch_sizes={"min": 1, "opt": 8, "max": 16})
    k = cache.artifact_key(m, precision="fp16", compute_capability="9.0", **common)
    assert k["digest"] == cache.artifact_key(m, precision="fp16", compute_capability="9.0", **common)["digest"]
    assert k["digest"] != cache.artifact_key(m, precision="bf16", compute_capability="9.0", **common)["digest"]
    assert k["digest"] != cache.artifact_key(m, precision="fp16", compute_capability="8.0", **common)["digest"]
    assert "torch" in k["versions"] and "tensorrt" in k["versions"]


# ------------------------------------------------------------------------------------------------ runner


def test_write_runner_refuses_manifest_without_inputs(tmp_path):
    artifact = tmp_path / "model.onnx"
    artifact.write_bytes(b"")
    with pytest.raises(ExportError, match="no 'inputs'"):
        write_runner(artifact, {"batch_sizes": {"opt": 1}})


@pytest.fixture(scope="session")
def bare_venv(tmp_path_factory):
    """A fresh venv with only onnxruntime and numpy (no torch, no tctune); about 12 s to create here."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", "onnxruntime", "numpy"],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"pip could not install onnxruntime+numpy into a fresh venv: {done.stderr[-300:]}")
    return py


@pytest.mark.slow
def test_generated_onnx_runner_runs_in_bare_venv(seed_export, bare_venv):
    out, _ = seed_export
    probe = subprocess.run([str(bare_venv), "-c", "import torch"], capture_output=True)
    assert probe.returncode != 0  # really no torch there
    done = subprocess.run([str(bare_venv), str(out / "runner.py"), "--batch", "4", "--iters", "5", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=out.parent)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert row["batch_size"] == 4 and row["latency_ms"] > 0 and row["throughput"] > 0
    text = subprocess.run([str(bare_venv), str(out / "runner.py"), "--iters", "2"], capture_output=True,
                          text=True, timeout=120)
    assert text.returncode == 0 and "latency" in text.stdout and "items/s" in text.stdout


# ------------------------------------------------------------------------------------------------ AOTInductor


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="AOTInductor on the CPU compiles C++: no g++/clang++ on this machine")
def test_aoti_seed_cnn_package_matches_pytorch(tmp_path, capsys):
    cfg = _config(tmp_path / "best_config.json", batch_size=4, batch_sizes=(4, 8))
    started = time.perf_counter()
    rc, stdout, err = _export(capsys, SEED_CNN, "--config", cfg, "--format", "aoti", "--out", tmp_path / "out")
    elapsed = time.perf_counter() - started
    assert rc == 0, err
    pt2 = tmp_path / "out" / "model.pt2"
    manifest = json.loads((tmp_path / "out" / "model.pt2.manifest.json").read_text())
    checked = {v["batch_size"]: v["max_abs_error"] for v in manifest["result"]["aoti_validation"]}
    assert set(checked) == {4, 1} and max(checked.values()) < FP32_TOL
    print(f"AOTInductor export of the seed CNN: {elapsed:.1f} s (compile {manifest['result']['aoti_compile_s']} s)")

    # independent check: the package against the eager model at a batch it was not validated at
    sys.path.insert(0, str(SEED_CNN.parent))
    try:
        import seed_cnn
    finally:
        sys.path.remove(str(SEED_CNN.parent))
    model = seed_cnn.build_model().eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        got = torch._inductor.aoti_load_package(str(pt2))(x)
        torch.testing.assert_close(got, model(x), rtol=1.3e-6, atol=FP32_TOL)

    capsys.readouterr()
    assert main(["bench", str(pt2), "--batch", "2", "--iters", "2", "--warmup", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "aoti"


def test_aoti_loader_crash_is_reported_not_fatal(tmp_path, monkeypatch):
    """A loader that segfaults (torch 2.11 on an H200) is caught in a child process and named."""
    from tctune.export import aoti

    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nkill -SEGV $$\n")
    fake_python.chmod(0o755)
    monkeypatch.setattr(aoti.sys, "executable", str(fake_python))
    assert aoti._load_crashes(tmp_path / "model.pt2") == "killed by signal 11"
    ok_python = tmp_path / "ok"
    ok_python.write_text("#!/bin/sh\nexit 0\n")
    ok_python.chmod(0o755)
    monkeypatch.setattr(aoti.sys, "executable", str(ok_python))
    assert aoti._load_crashes(tmp_path / "model.pt2") is None


@pytest.mark.parametrize("edit,match", [
    ({"params": {"batch_size": 8, "precision": "fp64", "graph_passes": True}}, "params.precision 'fp64'"),
    ({"params": {"batch_size": 8, "precision": "fp8", "graph_passes": False}}, "fp8 needs tctune's graph"),
    ({"params": {"batch_size": 8, "precision": "fp32", "graph_passes": True}, "hardware": "H100"},
     "the config's hardware must be"),
])
def test_export_rejects_bad_config_values(tmp_path, edit, match, capsys):
    cfg = tmp_path / "best_config.json"
    cfg.write_text(json.dumps(edit))
    rc = main(["export", str(SEED_CNN), "--config", str(cfg), "--format", "onnx", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and match in err and "Traceback" not in err


def test_bench_bad_batch_names_its_own_flag(tmp_path, capsys):
    f = tmp_path / "m.onnx"
    f.write_bytes(b"x")
    assert main(["bench", str(f), "--batch", "0"]) == 2
    assert "invalid --batch '0'" in capsys.readouterr().err


@pytest.mark.parametrize("names", [{"model": "tiny_tx", "model_path": "/runs/tiny_tx.py"},
                                   {"model_path": "/runs/tiny_tx.py"}])
def test_export_rejects_a_config_tuned_for_another_model(tmp_path, capsys, names):
    """A config whose model name (or, without one, the stem of its model_path) is not the model file's stem:
    one error naming both (exit 2), nothing built; the same file under another folder is accepted."""
    cfg = json.loads(_config(tmp_path / "best_config.json").read_text())
    cfg.pop("model")
    cfg.update(names)
    (tmp_path / "best_config.json").write_text(json.dumps(cfg))
    rc, stdout, err = _export(capsys, SEED_CNN, "--config", tmp_path / "best_config.json", "--format", "onnx",
                              "--out", tmp_path / "out")
    assert rc == 2 and stdout == ""
    assert "was tuned for the model 'tiny_tx'" in err and "not seed_cnn.py" in err and "fix: pass the model file" in err
    assert "Traceback" not in err and not (tmp_path / "out" / "model.onnx").exists()


def test_check_config_model_compares_names_not_folders():
    from tctune.engines import check_config_model
    from tctune.errors import UsageError
    from tctune.modelfile import load_model_file

    mf = load_model_file(SEED_CNN)
    check_config_model({"model": "seed_cnn", "model_path": "/elsewhere/seed_cnn.py"}, mf, "c.json")  # moved: fine
    check_config_model({}, mf, "c.json")  # a config naming no model is not checked
    with pytest.raises(UsageError, match=r"tuned for the model 'conv_two' \(/x/conv_two\.py\), not seed_cnn\.py"):
        check_config_model({"model": "conv_two", "model_path": "/x/conv_two.py"}, mf, "c.json")
