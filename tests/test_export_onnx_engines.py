"""ONNX files that run: valid typed graphs (lowest valid opset), the FP32 twin and ``deploy``, output names,
artifact permissions, and onnxruntime as an optional extra (missing install, CUDA provider choice)."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

import tctune.export.onnx as tonnx
from tctune.export import _runner_template as rt
from tctune.export import deployment, export_onnx, export_onnx_deployable, validate_onnx
from tctune.export.onnx import ORT_MISSING, InvalidOnnxError, ort_load, ort_providers
from tctune.export.runner import manifest_path, write_runner

FP32_TOL = 1e-4  # onnxruntime vs PyTorch, fp32 end to end (observed ~1e-7 on these nets)


class ConvNet(nn.Module):
    """What the precision pass produces for a small CNN: weights in ``dtype``, casts at the edges."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1).to(dtype)
        self.fc = nn.Linear(8, 4).to(dtype)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x.to(self.dtype))).mean((2, 3))
        return self.fc(h).float()


def _twins() -> tuple[ConvNet, ConvNet]:
    """The bf16 net and its FP32 twin with the same (bf16-rounded) weights."""
    torch.manual_seed(0)
    low = ConvNet(torch.bfloat16).eval()
    fp32 = ConvNet(torch.float32).eval()
    fp32.load_state_dict({k: v.float() for k, v in low.state_dict().items()})
    return low, fp32


def _images(batch: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, 3, 8, 8),)


@pytest.fixture(scope="module")
def bf16_conv(tmp_path_factory: pytest.TempPathFactory, ort) -> tuple[Path, dict, ConvNet]:
    # (ort: validating the file and writing the FP32 twin when the provider cannot load it need onnxruntime)
    low, fp32 = _twins()
    path = tmp_path_factory.mktemp("bf16conv") / "model.onnx"
    built: list[int] = []

    def make_fp32() -> nn.Module:
        built.append(1)
        return fp32

    info = export_onnx_deployable(low, _images, path, fp32_module=make_fp32, opset=20, batch_sizes=(2, 5))
    info["_twin_built"] = len(built)
    return path, info, fp32


# ------------------------------------------------------------------------------- valid typed ONNX, twin


def test_bf16_conv_is_written_at_an_opset_where_it_is_valid(bf16_conv):
    path, info, _ = bf16_conv
    assert info["onnx"] == str(path)
    assert info["onnx_opset"] >= 22  # ONNX allows bfloat16 Conv from opset 22
    assert "opset 20 -> " in info["onnx_opset_reason"]
    assert "Conv accepts tensor(bfloat16) from opset 22" in info["onnx_opset_reason"]
    onnx.checker.check_model(str(path), full_check=True)
    conv_weight = next(i for i in onnx.load(str(path)).graph.initializer if i.name == "conv.weight")
    assert conv_weight.data_type == onnx.TensorProto.BFLOAT16  # the precision stays in the file


def test_bf16_conv_deploy_names_the_file_that_runs_where(bf16_conv, ort):
    path, info, fp32 = bf16_conv
    assert info["deploy"]["tensorrt"] == "model.onnx"
    if info["onnx_load"] == "ok":  # an onnxruntime with bf16 Conv on this provider: the typed file serves it
        assert info["onnx_error"] is None and info["deploy"]["onnxruntime-cpu"] == "model.onnx"
        assert info["onnx_fp32"] is None and info["_twin_built"] == 0
        return
    assert info["onnx_load"] == "no_kernel"  # valid ONNX, only the provider lacks the kernel
    assert "cannot load the model: the provider has no kernel" in info["onnx_error"]
    assert "Conv" in info["onnx_error"]
    twin = path.with_name("model.fp32.onnx")
    assert info["onnx_fp32"] == str(twin) and twin.exists() and info["_twin_built"] == 1
    assert info["onnx_fp32_error"] is None and info["onnx_fp32_max_abs_error"] < FP32_TOL
    assert info["deploy"]["onnxruntime-cpu"] == "model.fp32.onnx"
    assert "model.fp32.onnx" in info["deploy_reason"] and "no kernel" in info["deploy_reason"]
    # the twin really is the same graph in FP32: run it here on fresh inputs
    x = torch.randn(3, 3, 8, 8)
    got = ort.InferenceSession(str(twin), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        want = fp32(x).numpy()
    assert 0 < np.abs(want).max() and np.abs(got - want).max() < FP32_TOL


def test_ort_load_tells_invalid_onnx_from_missing_kernel(bf16_conv, tmp_path):
    path, info, _ = bf16_conv
    valid = ort_load(path)
    assert valid["status"] == info["onnx_load"] and valid["provider"] == "CPUExecutionProvider"
    model = onnx.load(str(path))
    for entry in model.opset_import:  # the same graph declared at opset 20, where bf16 Conv is not ONNX
        if entry.domain in ("", "ai.onnx"):
            entry.version = 20
    invalid_path = tmp_path / "opset20.onnx"
    onnx.save(model, str(invalid_path))
    with pytest.raises(Exception, match="bfloat16"):
        onnx.checker.check_model(str(invalid_path), full_check=True)
    invalid = ort_load(invalid_path)
    assert invalid["session"] is None and invalid["status"] == "invalid"
    assert "cannot load the model: it rejects the graph as invalid" in invalid["reason"]


def test_no_valid_opset_means_not_exported_and_the_fp32_twin_deploys(tmp_path, monkeypatch, ort):
    low, fp32 = _twins()
    monkeypatch.setattr(onnx.defs, "onnx_opset_version", lambda: 21)  # an onnx that knows no opset >= 22
    path = tmp_path / "model.onnx"
    with pytest.raises(InvalidOnnxError, match=r"not valid ONNX.*no opset up to 21 accepts Conv with tensor\(bfloat16\)"):
        export_onnx(low, _images, path, opset=20)
    assert list(tmp_path.iterdir()) == []  # nothing published, no temporary folder left

    info = export_onnx_deployable(low, _images, path, fp32_module=fp32, opset=20)
    assert not path.exists() and info["onnx"] is None
    assert info["onnx_error"].startswith("not exported: model.onnx is not valid ONNX")
    assert info["onnx_fp32"] == str(tmp_path / "model.fp32.onnx") and info["onnx_fp32_max_abs_error"] < FP32_TOL
    assert info["deploy"] == {"tensorrt": "model.fp32.onnx", "onnxruntime-cpu": "model.fp32.onnx"}
    assert info["onnx_inputs"] == [{"name": "x", "shape": ["batch", 3, 8, 8], "dtype": "float32"}]


def test_fp32_graph_deploys_itself_without_a_twin(tmp_path, ort):
    _, fp32 = _twins()
    info = export_onnx_deployable(fp32, _images, tmp_path / "model.onnx",
                                  fp32_module=lambda: pytest.fail("the twin must not be built"))
    assert info["onnx_opset_reason"] is None and info["onnx_load"] == "ok"
    assert info["deploy"] == {"tensorrt": "model.onnx", "onnxruntime-cpu": "model.onnx"}
    assert info["onnx_fp32"] is None and sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_deployment_of_an_fp8_result_uses_its_validated_file():
    base = {"onnx": "/o/model.onnx", "onnx_fp32": "/o/model.fp32.onnx", "onnx_error": None}
    twin = deployment({**base, "onnx_fp8": {"validated_on": "fp32 twin"}})
    assert twin["deploy"] == {"tensorrt": "model.onnx", "onnxruntime-cpu": "model.fp32.onnx"}
    model = deployment({**base, "onnx_fp32": None, "onnx_fp8": {"validated_on": "model"}})
    assert model["deploy"] == {"tensorrt": "model.onnx", "onnxruntime-cpu": "model.onnx"}
    failed = deployment({**base, "onnx_error": "batch 3: relative L2 error 0.2", "onnx_fp8": {"validated_on": "model"}})
    assert failed["deploy"] == {"tensorrt": "model.onnx"} and "relative L2 error 0.2" in failed["deploy_reason"]


# ------------------------------------------------------------------------------------------ output names


class NestedDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(6, 6)
        self.v = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> dict:
        return {"zeros": torch.zeros_like(x) + 0 * x, "ones": torch.ones_like(x) + 0 * x,
                "cache": {"k": self.k(x), "v": self.v(x)}, "scores": torch.tanh(x).sum(-1)}


def test_dict_outputs_keep_their_names_and_read_back_by_name(tmp_path, ort):
    torch.manual_seed(0)
    make = lambda b: (torch.randn(b, 6),)  # noqa: E731
    model = NestedDict().eval()
    path = tmp_path / "nested.onnx"
    info = export_onnx(model, make, path, batch_sizes=(2, 3))
    names = ["zeros", "ones", "cache.k", "cache.v", "scores"]
    assert [o["name"] for o in info["onnx_outputs"]] == names and info["onnx_error"] is None
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == names
    x = torch.randn(4, 6)
    with torch.no_grad():
        want = model(x)
    for name, expected in (("cache.v", want["cache"]["v"]), ("scores", want["scores"]), ("ones", want["ones"]),
                           ("cache.k", want["cache"]["k"])):
        (got,) = session.run([name], {"x": x.numpy()})
        assert got.shape == tuple(expected.shape)
        assert np.abs(got - expected.numpy()).max() < FP32_TOL, name


class IdsOut(nn.Module):
    """An output named like an input (``ids`` in, ``{"logits", "ids"}`` out): ONNX names each value once."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, ids: torch.Tensor) -> dict:
        logits = self.head(self.emb(ids).mean(1))
        return {"logits": logits, "ids": logits.argmax(-1)}


def test_an_output_named_like_an_input_is_renamed_and_exports(tmp_path, ort):
    torch.manual_seed(0)
    make = lambda b: (torch.randint(0, 50, (b, 7)),)  # noqa: E731
    model = IdsOut().eval()
    path = tmp_path / "ids.onnx"
    info = export_onnx(model, make, path, batch_sizes=(2, 3))
    assert info["onnx_error"] is None
    assert [o["name"] for o in info["onnx_outputs"]] == ["logits", "ids_out"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randint(0, 50, (4, 7))
    (got,) = session.run(["ids_out"], {"ids": x.numpy()})
    with torch.no_grad():
        assert (got == model(x)["ids"].numpy()).all()


def test_output_names_of_tuples_and_nested_sequences():
    t = torch.zeros(1)
    assert tonnx._output_names(t) == ["output"]
    assert tonnx._output_names((t, t)) == ["output_0", "output_1"]
    assert tonnx._output_names((t, {"k": t, "v": [t, t]})) == ["output_0", "output_1.k", "output_1.v.0",
                                                                "output_1.v.1"]
    assert tonnx._output_names({"a b": t, "c": {"d": t}}) == ["a_b", "c.d"]


# ------------------------------------------------------------------------------------------- permissions


@pytest.fixture()
def strict_umask():
    """umask 077: a file gets other users' read bit only if tctune sets it explicitly."""
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_onnx_manifest_and_runner_are_readable_by_other_users(tmp_path, strict_umask):
    make = lambda b: (torch.randn(b, 6),)  # noqa: E731
    path = tmp_path / "model.onnx"
    info = export_onnx(NestedDict().eval(), make, path)
    manifest = {"inputs": [{"name": "x", "shape": ["batch", 6], "dtype": "float32"}],
                "batch_sizes": {"min": 1, "opt": 2, "max": 4}, "format": "onnx"}
    runner = write_runner(path, manifest)
    assert info["onnx"] == str(path) and _mode(path) == 0o644
    assert _mode(manifest_path(path)) == 0o644
    assert _mode(runner) == 0o755


# ------------------------------------------------------------------------------- onnxruntime as an extra


def _no_onnxruntime() -> None:
    raise ImportError("No module named 'onnxruntime'")


def test_without_onnxruntime_export_runs_and_says_validation_was_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(tonnx, "load_onnxruntime", _no_onnxruntime)
    _, fp32 = _twins()
    low, _ = _twins()
    path = tmp_path / "model.onnx"
    info = export_onnx_deployable(low, _images, path, fp32_module=fp32)
    assert path.exists() and info["onnx"] == str(path)
    onnx.checker.check_model(str(path), full_check=True)  # still exported and checked
    assert info["onnx_error"] is None and info["onnx_load"] == "skipped"
    assert info["onnx_validation"] == [] and info["onnx_max_abs_error"] is None
    assert info["onnx_validation_skipped"] == ORT_MISSING == info["onnx_note"]
    assert "ONNX validation skipped" in ORT_MISSING and "pip install 'tctune[onnx]'" in ORT_MISSING
    assert info["onnx_fp32"] is None  # nothing to decide the twin with
    assert info["deploy"] == {"tensorrt": "model.onnx"} and ORT_MISSING in info["deploy_reason"]
    entries = validate_onnx(low, _images, path, [1, 4])
    assert entries == [{"batch_size": None, "max_abs_error": None, "rel_l2_error": None, "skipped": ORT_MISSING}]


class _FakeSession:
    def __init__(self, path: str, options: object, providers: list[str]) -> None:
        self.providers = providers

    def get_providers(self) -> list[str]:
        return list(self.providers)


def _fake_ort(available: list[str]) -> types.ModuleType:
    fake = types.ModuleType("onnxruntime")
    fake.get_available_providers = lambda: list(available)
    fake.SessionOptions = lambda: types.SimpleNamespace()
    fake.GraphOptimizationLevel = types.SimpleNamespace(ORT_ENABLE_BASIC=1)
    fake.InferenceSession = _FakeSession
    return fake


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "no-gpu"])
def test_cuda_provider_first_with_onnxruntime_gpu_and_a_gpu(tmp_path, monkeypatch, gpu):
    fake = _fake_ort(["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(tonnx, "load_onnxruntime", lambda: fake)
    expected = ["CUDAExecutionProvider", "CPUExecutionProvider"] if gpu else ["CPUExecutionProvider"]
    assert ort_providers(fake) == expected
    load = ort_load(tmp_path / "m.onnx")
    assert load["status"] == "ok" and load["session"].providers == expected and load["provider"] == expected[0]
    assert ort_providers(_fake_ort(["CPUExecutionProvider"])) == ["CPUExecutionProvider"]


def test_deploy_key_follows_the_provider_that_ran():
    info = {"onnx": "/o/model.onnx", "onnx_load": "ok", "onnx_provider": "CUDAExecutionProvider",
            "onnx_error": None, "onnx_max_abs_error": 1e-3}
    assert deployment(info)["deploy"] == {"tensorrt": "model.onnx", "onnxruntime-cuda": "model.onnx"}


def test_runner_points_to_the_deployable_file_when_onnxruntime_cannot_load(bf16_conv):
    path, info, _ = bf16_conv
    if info["onnx_load"] == "ok":
        pytest.skip("this onnxruntime runs bf16 Conv on the CPU: nothing to point to")
    manifest = {"inputs": [{"name": "x", "shape": ["batch", 3, 8, 8], "dtype": "float32"}],
                "deploy": info["deploy"]}
    with pytest.raises(rt.RunnerError, match=r"recommends model\.fp32\.onnx"):
        rt.load_onnx(str(path), manifest, "CPUExecutionProvider")


def test_onnxruntime_is_an_extra_not_a_core_dependency():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("onnxruntime") for d in project["dependencies"])
    extras = project["optional-dependencies"]
    assert [d.split(">")[0] for d in extras["onnx"]] == ["onnxruntime"]
    assert [d.split(">")[0] for d in extras["onnx-gpu"]] == ["onnxruntime-gpu"]
    # [test] forces neither wheel (both install the module onnxruntime): the install commands add the one wanted
    assert not any(d.startswith("onnxruntime") for d in extras["test"])
    root = Path(__file__).parents[1]
    readme = (root / "README.md").read_text()
    assert 'pip install -e ".[test,onnx]"' in readme and '".[test,onnx-gpu]"' in readme
    assert 'pip install -q -e ".[test,onnx]"' in (root / ".ci" / "run").read_text()  # CI runs the ONNX tests


def test_a_test_needing_onnxruntime_skips_naming_the_extra_to_install(monkeypatch):
    """Without onnxruntime (neither wheel installed) the ``ort`` fixture's check skips, saying which extra to add."""
    from zoo import onnxruntime_or_skip

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # what `import onnxruntime` meets without the wheel
    with pytest.raises(pytest.skip.Exception, match=r"onnxruntime is not installed.*pip install -e '\.\[test,onnx\]'"):
        onnxruntime_or_skip()


def test_tctune_imports_without_onnxruntime():
    code = ("import sys; sys.modules['onnxruntime'] = None\n"
            "import tctune.export, tctune.export.onnx as o\n"
            "try:\n    o.load_onnxruntime()\nexcept ImportError:\n    print('seam raises ImportError')\n"
            "print(o.ort_load('missing.onnx')['status'])")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["seam raises ImportError", "skipped"]


class ConvThenFP8Linear(nn.Module):
    """A conv stem (stays bf16 at fp8) in front of an FP8-eligible linear (16 -> 64)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.fc1 = nn.Linear(16, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(torch.relu(self.conv(x)).mean((2, 3)))))


def test_fp8_export_with_a_bf16_conv_is_valid_onnx(tmp_path, ort):
    """The FP8 export asks for opset 19; its bf16 Conv is ONNX only from 22, so the file is written at 22."""
    from passes import PassSpec
    from tctune.export.onnx_fp8 import build_fp8_graphs, export_onnx_fp8

    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=1, max=4096)
    gm = torch.export.export(ConvThenFP8Linear().eval(), _images(2), dynamic_shapes=({0: batch},),
                             strict=False).module()
    graphs = build_fp8_graphs(gm, PassSpec(precision="fp8", fp8_scaling="tensor"), ())
    path = tmp_path / "model.onnx"
    info = export_onnx_fp8(graphs, _images, path, batch_sizes=(1, 4))
    assert info["onnx_opset"] >= 22 and "Conv accepts tensor(bfloat16) from opset 22" in info["onnx_opset_reason"]
    onnx.checker.check_model(str(path), full_check=True)
    assert [q["weight"] for q in info["onnx_fp8"]["quantized"]] == ["fc1.weight"]
    assert info["onnx_error"] is None and info["onnx_max_rel_l2_error"] < 5e-2  # tctune's FP8 tolerance
    assert deployment(info)["deploy"]["tensorrt"] == "model.onnx"
