"""Tests for tctune.export: ONNX export + onnxruntime validation, and the TensorRT build against a stand-in.

TensorRT cannot be installed on these machines, so ``build_engine`` is exercised with a recording fake
``tensorrt`` module injected into ``sys.modules``; what it proves is the call sequence (strongly typed
network, one profile with the right min/opt/max, engine + manifest written), not a real engine.
"""
from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from tctune.errors import ExportError
from tctune.export import build_engine, export_onnx, tensorrt_available

FP32_TOL = 1e-4  # onnxruntime vs PyTorch, fp32 end to end (reduction order differs; observed ~1e-6)


def _capture(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.fx.GraphModule:
    """tctune's capture: torch.export (non-strict) with a dynamic batch, ATen-level GraphModule."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    ep = torch.export.export(model.eval(), inputs, dynamic_shapes=tuple({0: batch} for _ in inputs),
                             strict=False)
    return ep.module()


class SimpleCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(8192, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.cls = nn.Linear(32, 5)
        self.box = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.body(x))
        return {"logits": self.cls(h), "boxes": self.box(h)}


class LowPrecisionLinear(nn.Module):
    """What the precision pass produces: weights stored in fp16/bf16, explicit casts at the edges."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 32).to(dtype)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.to(self.dtype)).float()


class IntBatch(nn.Module):
    """``int(x.shape[0])`` makes torch.export specialize the batch; eager PyTorch still takes any batch."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.reshape(int(x.shape[0]), 16))


class BertLastHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=96, max_position_embeddings=64)
        self.bert = BertModel(config).eval()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids).last_hidden_state


def _cnn_inputs(batch: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch, 3, 32, 32),)


@pytest.fixture(scope="module")
def cnn_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    torch.manual_seed(0)
    gm = _capture(SimpleCNN(), _cnn_inputs(4))
    path = tmp_path_factory.mktemp("cnn") / "model.onnx"
    return path, export_onnx(gm, _cnn_inputs, path, batch_sizes=(2, 5))


# ---------------------------------------------------------------------------------------------- ONNX


def test_export_onnx_writes_checked_file_atomically(cnn_export):
    path, result = cnn_export
    assert result["onnx"] == str(path) and path.exists()
    onnx.checker.check_model(str(path))
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx"]  # no temp folder left behind
    assert result["onnx_opset"] >= 17
    assert result["onnx_dynamic"] == "dynamic_shapes"


def test_export_onnx_batch_axis_is_symbolic(cnn_export):
    path, result = cnn_export
    graph_input = onnx.load(str(path)).graph.input[0]
    dim0 = graph_input.type.tensor_type.shape.dim[0]
    assert graph_input.name == "x"
    assert not dim0.HasField("dim_value") and dim0.dim_param == "batch"
    assert result["onnx_inputs"] == [{"name": "x", "shape": ["batch", 3, 32, 32], "dtype": "float32"}]
    assert result["onnx_outputs"] == [{"name": "output", "shape": ["batch", 10], "dtype": "float32"}]


def test_export_onnx_matches_pytorch_at_two_batch_sizes(cnn_export, ort):
    _, result = cnn_export
    assert result["onnx_error"] is None
    assert [v["batch_size"] for v in result["onnx_validation"]] == [2, 5]
    for entry in result["onnx_validation"]:
        assert 0 < entry["max_abs_error"] < FP32_TOL  # > 0: the numbers came from a real run
        assert entry["rel_l2_error"] < FP32_TOL
    assert result["onnx_max_abs_error"] == max(v["max_abs_error"] for v in result["onnx_validation"])


def test_export_onnx_keeps_dict_keys_as_output_names(tmp_path, ort):
    torch.manual_seed(0)
    make = lambda b: (torch.randn(b, 16),)  # noqa: E731
    result = export_onnx(_capture(TwoHeads(), make(4)), make, tmp_path / "heads.onnx", batch_sizes=(3, 7))
    assert [o["name"] for o in result["onnx_outputs"]] == ["logits", "boxes"]
    assert [o["shape"] for o in result["onnx_outputs"]] == [["batch", 5], ["batch", 4]]
    assert result["onnx_error"] is None and result["onnx_max_abs_error"] < FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_export_onnx_low_precision_weights_kept_and_reported(tmp_path, dtype, ort):
    torch.manual_seed(0)
    make = lambda b: (torch.randn(b, 64),)  # noqa: E731
    path = tmp_path / "low.onnx"
    result = export_onnx(_capture(LowPrecisionLinear(dtype), make(4)), make, path, batch_sizes=(2, 3))
    onnx_dtype = onnx.TensorProto.FLOAT16 if dtype == torch.float16 else onnx.TensorProto.BFLOAT16
    assert any(init.data_type == onnx_dtype for init in onnx.load(str(path)).graph.initializer)
    assert path.exists()  # kept even when onnxruntime cannot run it
    if result["onnx_error"] is None:
        assert result["onnx_max_abs_error"] is not None and result["onnx_max_abs_error"] < 1e-2
    else:  # e.g. the CPU provider has no kernel for this dtype: a clear reason, not an exception
        assert "onnxruntime" in result["onnx_error"]


def test_export_onnx_catches_frozen_batch_at_validation(tmp_path, ort):
    torch.manual_seed(0)
    make = lambda b: (torch.randn(b, 16),)  # noqa: E731
    result = export_onnx(IntBatch(), make, tmp_path / "frozen.onnx", batch_sizes=(2, 5))
    assert result["onnx_inputs"][0]["shape"] == [2, 16]
    assert "batch axis froze" in result["onnx_error"]
    first, second = result["onnx_validation"]
    assert first["max_abs_error"] < FP32_TOL and "error" not in first
    assert second["max_abs_error"] is None and "batch 5: onnxruntime run failed" in second["error"]
    assert result["onnx_max_abs_error"] == first["max_abs_error"]


@torch.library.custom_op("tctune_test::mystery", mutates_args=())
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UsesCustomOp(nn.Module):
    """A custom op with no ONNX translation: torch.onnx cannot export it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _mystery(x) + 1


def test_export_onnx_raises_when_export_fails(tmp_path):
    path = tmp_path / "bad.onnx"
    with pytest.raises(ExportError, match="torch.onnx.export .* failed for bad.onnx"):
        export_onnx(UsesCustomOp(), lambda b: (torch.randn(b, 4),), path)
    assert list(tmp_path.iterdir()) == []


def test_export_onnx_skips_cleanly_without_onnxscript(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)
    with pytest.raises(ExportError, match="needs the onnxscript package"):
        export_onnx(TwoHeads(), lambda b: (torch.randn(b, 16),), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_export_onnx_tiny_bert(tmp_path, ort):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    make = lambda b: (torch.randint(0, 1000, (b, 16), dtype=torch.int64),)  # noqa: E731
    gm = _capture(BertLastHidden(), make(4))
    result = export_onnx(gm, make, tmp_path / "bert.onnx", batch_sizes=(2, 3))
    assert result["onnx_inputs"] == [{"name": "input_ids", "shape": ["batch", 16], "dtype": "int64"}]
    assert result["onnx_outputs"][0]["shape"] == ["batch", 16, 64]
    assert result["onnx_error"] is None
    assert result["onnx_max_abs_error"] < FP32_TOL


# ------------------------------------------------------------------------------------------ TensorRT


class _FakeTensorRT(types.ModuleType):
    """A stand-in for ``tensorrt`` that records the calls build_engine makes. Inputs come from the ONNX."""

    def __init__(self, parse_ok: bool = True) -> None:
        super().__init__("tensorrt")
        self.__version__ = "10.99.0-fake"
        self.calls: dict[str, list] = {"create_network": [], "set_shape": [], "add_optimization_profile": [],
                                       "optimization_level": [], "timing_cache": []}
        fake = self

        class Logger:
            WARNING = 2

            def __init__(self, severity: int) -> None:
                self.severity = severity

        class NetworkDefinitionCreationFlag:
            STRONGLY_TYPED = 5  # any int: build_engine must shift by int(flag)

        class Tensor:
            def __init__(self, name: str) -> None:
                self.name, self.dtype = name, "DataType.FLOAT"

        class Network:
            def __init__(self) -> None:
                self.inputs: list[Tensor] = []
                self.outputs: list[Tensor] = []

            num_inputs = property(lambda self: len(self.inputs))
            num_outputs = property(lambda self: len(self.outputs))

            def get_input(self, i: int) -> Tensor:
                return self.inputs[i]

            def get_output(self, i: int) -> Tensor:
                return self.outputs[i]

        class OnnxParser:
            def __init__(self, network: Network, logger: Logger) -> None:
                self.network = network
                self.num_errors = 0 if parse_ok else 1

            def parse_from_file(self, path: str) -> bool:
                graph = onnx.load(path, load_external_data=False).graph
                self.network.inputs = [Tensor(v.name) for v in graph.input]
                self.network.outputs = [Tensor(v.name) for v in graph.output]
                return parse_ok

            def get_error(self, i: int) -> str:
                return "In node 3 (Conv): UNSUPPORTED_NODE"

        class Profile:
            def set_shape(self, name, lo, opt, hi) -> None:
                fake.calls["set_shape"].append((name, tuple(lo), tuple(opt), tuple(hi)))

        class TimingCache:
            def __init__(self, blob: bytes) -> None:
                self.blob = blob

            def serialize(self) -> bytes:
                return self.blob + b"+timings"

        class Config:
            def __init__(self) -> None:
                self.cache = None

            @property
            def builder_optimization_level(self) -> int:
                return fake.calls["optimization_level"][-1]

            @builder_optimization_level.setter
            def builder_optimization_level(self, level: int) -> None:
                fake.calls["optimization_level"].append(level)

            def add_optimization_profile(self, profile: Profile) -> int:
                fake.calls["add_optimization_profile"].append(profile)
                return 0

            def create_timing_cache(self, blob: bytes) -> TimingCache:
                fake.calls["timing_cache"].append(("load", bytes(blob)))
                return TimingCache(bytes(blob))

            def set_timing_cache(self, cache: TimingCache, ignore_mismatch: bool) -> bool:
                self.cache = cache
                return True

            def get_timing_cache(self) -> TimingCache:
                return self.cache

        class Builder:
            def __init__(self, logger: Logger) -> None:
                self.logger = logger

            def create_network(self, flags: int) -> Network:
                fake.calls["create_network"].append(flags)
                return Network()

            def create_builder_config(self) -> Config:
                return Config()

            def create_optimization_profile(self) -> Profile:
                return Profile()

            def build_serialized_network(self, network: Network, config: Config) -> bytes:
                return b"FAKE-ENGINE"

        self.Logger, self.Builder, self.OnnxParser = Logger, Builder, OnnxParser
        self.NetworkDefinitionCreationFlag = NetworkDefinitionCreationFlag


def test_build_engine_strongly_typed_one_profile(cnn_export, tmp_path, monkeypatch):
    fake = _FakeTensorRT()
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    onnx_path, _ = cnn_export
    engine = tmp_path / "model.engine"
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"old")

    result = build_engine(onnx_path, engine, input_shapes={"x": (-1, 3, 32, 32)}, batch_sizes=(1, 64, 256),
                          timing_cache=cache, optimization_level=4)

    assert result == {"tensorrt": str(engine), "tensorrt_skipped_reason": None}
    assert fake.calls["create_network"] == [1 << 5]  # STRONGLY_TYPED, nothing else
    assert fake.calls["set_shape"] == [("x", (1, 3, 32, 32), (64, 3, 32, 32), (256, 3, 32, 32))]
    assert len(fake.calls["add_optimization_profile"]) == 1
    assert fake.calls["optimization_level"] == [4]
    assert fake.calls["timing_cache"] == [("load", b"old")] and cache.read_bytes() == b"old+timings"
    assert engine.read_bytes() == b"FAKE-ENGINE"
    manifest = json.loads(Path(str(engine) + ".json").read_text())
    assert manifest["tensorrt_version"] == "10.99.0-fake"
    assert manifest["inputs"] == ["x"] and manifest["outputs"] == ["output"]
    assert manifest["profile"]["x"]["max"] == [256, 3, 32, 32]
    assert manifest["weight_dtypes"] == {"float32": 4}  # conv + linear weights and biases
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.engine", "model.engine.json", "timing.cache"]


def test_build_engine_reports_parser_errors(cnn_export, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", _FakeTensorRT(parse_ok=False))
    with pytest.raises(ExportError, match="UNSUPPORTED_NODE"):
        build_engine(cnn_export[0], tmp_path / "m.engine", input_shapes={"x": (-1, 3, 32, 32)},
                     batch_sizes=(1, 8, 16))
    assert not (tmp_path / "m.engine").exists()


def test_build_engine_skips_without_tensorrt(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # makes `import tensorrt` raise ImportError
    ok, reason = tensorrt_available()
    assert not ok and "tensorrt is not installed" in reason and "skipped" in reason
    result = build_engine(tmp_path / "m.onnx", tmp_path / "m.engine", input_shapes={"x": (-1, 4)},
                          batch_sizes=(1, 2, 4))
    assert result == {"tensorrt": None, "tensorrt_skipped_reason": reason}
    assert list(tmp_path.iterdir()) == []


def test_build_engine_writes_files_other_users_can_read(cnn_export, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", _FakeTensorRT())
    engine, cache = tmp_path / "model.engine", tmp_path / "timing.cache"
    old = os.umask(0o077)  # only an explicit chmod gives other users the read bit
    try:
        build_engine(cnn_export[0], engine, input_shapes={"x": (-1, 3, 32, 32)}, batch_sizes=(1, 2, 4),
                     timing_cache=cache)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"model.engine": 0o644, "model.engine.json": 0o644, "timing.cache": 0o644}


# ------------------------------------------------------------------ export rebuilds the measured graph

OVERFLOW_MODEL = '''
import torch
import torch.nn.functional as F


class M(torch.nn.Module):
    """fp16 overflows after `big` (activations ~1e5 > 65504); LayerNorm, softmax and the residual add are what the
    autocast policy keeps FP32 and the pure policy casts."""

    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(16, 32)
        self.small = torch.nn.Linear(32, 16)
        self.norm = torch.nn.LayerNorm(16)
        with torch.no_grad():
            self.big.weight.mul_(1e5)
            self.small.weight.mul_(3e-4)

    def forward(self, x):
        h = self.small(F.gelu(self.big(x)))
        return self.norm(h + x).softmax(-1)


def build_model():
    torch.manual_seed(0)
    return M()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 16),)
'''


@pytest.mark.parametrize("precision,policy", [("fp16", "autocast"), ("bf16", "pure")])
def test_export_from_best_config_rebuilds_the_measured_graph(tmp_path, precision, policy):
    """The graph `tctune export --config best_config.json` builds equals, node for node, the one the search
    measured: the trial's cast policy, and at fp16 the overflow keep-list from the same calibration inputs."""
    from tctune.engines import config_target, read_config, rebuild_graphs
    from tctune.hardware import resolve
    from tctune.modelfile import load_model_file
    from tctune.search import TuneConfig, Tuner

    f = tmp_path / "overflow.py"
    f.write_text(OVERFLOW_MODEL)
    hw = resolve("h100")  # plans fp16 alignment; the graphs are built (not timed) on this CPU
    # engines keep FP32 outputs whatever the search's output contract (tctune.trial.build_trial_graph): the
    # measured graph equals the rebuilt one node for node under the "fp32" contract
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4, 8), quiet=True, export=False, output_dtype="fp32")
    tuner = Tuner(cfg, load_model_file(f), hw, device=torch.device("cpu"))
    params = {"batch_size": 8, "precision": precision, "graph_passes": True, "runtime": "eager", "policy": policy}
    measured = tuner.build(params)
    trial = tuner.trial_params(params)
    cast = {r.name: r for r in measured.passes}["cast_precision"]
    if precision == "fp16":  # the case is only a test of calibration if the search's graph kept overflows FP32
        assert any(s.reason.startswith("overflow:") for s in cast.skipped)
    else:  # and only a test of the policy if the policy changed the graph
        other = tuner.build({**params, "policy": "autocast"}).module
        assert other.code != measured.module.code

    config = tmp_path / "best_config.json"
    config.write_text(json.dumps({"model": "overflow", "hardware": hw.to_dict(), **trial.to_config(params),
                                  "batch_sizes": [4, 8]}))
    read = read_config(config)
    _, graphs = rebuild_graphs(load_model_file(f), read, resolve(config_target(read)), torch.device("cpu"))

    def nodes(gm):
        return [(n.op, str(n.target), str(n.args), str(n.meta.get("val").dtype if hasattr(n.meta.get("val"), "dtype") else ""))
                for n in gm.graph.nodes]

    assert nodes(graphs.graph) == nodes(measured.module)
    assert graphs.graph.code == measured.module.code


def test_trial_params_round_trip_and_reject_bad_values():
    from tctune.errors import UsageError
    from tctune.trial import TrialParams

    t = TrialParams(batch_size=8, precision="fp8", graph_passes=True, runtime="inductor", policy="pure",
                    fp8_keep=("*.down",), calibration=True)
    assert TrialParams.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    searched = {"batch_size": 8, "precision": "fp8", "graph_passes": True, "runtime": "inductor", "policy": "pure"}
    config = json.loads(json.dumps(t.to_config(searched)))
    assert config["params"] == searched and config["fp8_keep"] == ["*.down"]
    assert TrialParams.from_config(config) == t
    assert TrialParams(batch_size=8, precision="bf16", fp8_keep=("*.down",)).fp8_keep == ()  # below fp8: none
    with pytest.raises(UsageError, match="policy must be one of") as err:
        TrialParams(batch_size=8, precision="fp16", policy="half")
    assert err.value.field == "policy"


def test_onnx_error_line_puts_the_root_cause_before_torch_onnx_advice():
    """torch.onnx wraps the cause in a long message of advice: the one-line error keeps the cause whole."""
    from tctune.export.onnx import _one_line

    try:
        try:
            raise ValueError("Cannot view a tensor with shape torch.Size([s11, 12, 4, 16]) as (s11, 12, 64)!")
        except ValueError as cause:
            raise RuntimeError("Failed to decompose the FX graph for ONNX compatibility. This is step 2/3 of "
                               "exporting the model to ONNX. Next steps: " + "advice " * 80) from cause
    except RuntimeError as exc:
        line = _one_line(exc, limit=200)
    assert line.startswith("ValueError: Cannot view a tensor with shape torch.Size([s11, 12, 4, 16]) as (s11, 12, 64)!")
    assert "(in RuntimeError: Failed to decompose the FX graph for ONNX compatibility)" in line
    assert "advice" not in line and len(line) <= 204
