"""``tctune bench`` / the generated runner: device-resident timing (IO binding) on a GPU by default, copy-inclusive
timing labelled as such, and the CPU's single measurement labelled. The GPU path runs on a stand-in onnxruntime
(no GPU here); timing values are not tested."""
import json
import sys
import types

import numpy as np
import pytest

from tctune.export import _runner_template as rt


class FakeOrt:
    """Just enough of onnxruntime's API for the runner: sessions, IO binding, OrtValue."""

    def __init__(self, providers):
        self.providers = providers
        self.calls = {"run": 0, "run_with_iobinding": 0}
        self.bound_inputs, self.bound_outputs, self.ortvalues = {}, {}, []
        fake = self

        class SessionOptions:
            log_severity_level = 0
            graph_optimization_level = None

        class OrtValue:
            def __init__(self, array, device, device_id):
                self.array, self.device, self.device_id = array, device, device_id

            @staticmethod
            def ortvalue_from_numpy(array, device="cpu", device_id=0):
                value = OrtValue(array, device, device_id)
                fake.ortvalues.append(value)
                return value

        class IOBinding:
            def bind_ortvalue_input(self, name, value):
                fake.bound_inputs[name] = value

            def bind_output(self, name, device="cpu", device_id=0):
                fake.bound_outputs[name] = (device, device_id)

        class Arg:
            def __init__(self, name):
                self.name = name

        class InferenceSession:
            def __init__(self, path, options, providers):
                self.providers = [p for p in providers if p in fake.providers]

            def get_inputs(self):
                return [Arg("x")]

            def get_outputs(self):
                return [Arg("output")]

            def get_providers(self):
                return self.providers

            def get_provider_options(self):
                return {p: ({"device_id": "0"} if p == "CUDAExecutionProvider" else {}) for p in self.providers}

            def io_binding(self):
                return IOBinding()

            def run(self, names, feeds):
                fake.calls["run"] += 1
                assert set(feeds) == {"x"}
                return [np.zeros((feeds["x"].shape[0], 8), np.float32)]

            def run_with_iobinding(self, binding):
                fake.calls["run_with_iobinding"] += 1

        self.module = types.SimpleNamespace(
            get_available_providers=lambda: list(providers), SessionOptions=SessionOptions, OrtValue=OrtValue,
            InferenceSession=InferenceSession,
            GraphOptimizationLevel=types.SimpleNamespace(ORT_ENABLE_BASIC=1))


@pytest.fixture
def artifact(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"stand-in")
    manifest = {"format": "onnx", "precision": "fp16", "inputs": [{"name": "x", "shape": ["batch", 16], "dtype": "float32"}],
                "batch_sizes": {"min": 1, "opt": 4, "max": 8}}
    (tmp_path / "model.onnx.manifest.json").write_text(json.dumps(manifest))
    return str(path)


def _fake(monkeypatch, providers):
    fake = FakeOrt(providers)
    monkeypatch.setitem(sys.modules, "onnxruntime", fake.module)
    return fake


def test_gpu_default_is_device_resident_through_io_binding(artifact, monkeypatch):
    fake = _fake(monkeypatch, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    row = rt.time_artifact(artifact, iters=4, warmup=2)
    assert row["timing"] == "device-resident" and row["timing_note"] is None
    assert row["device"] == "CUDAExecutionProvider"
    assert fake.calls == {"run": 0, "run_with_iobinding": 6}  # every call timed on device-bound inputs
    x = fake.bound_inputs["x"]
    assert (x.device, x.device_id) == ("cuda", 0) and x.array.shape == (4, 16)
    np.testing.assert_array_equal(x.array, rt.make_feeds(json.load(open(artifact + ".manifest.json")), 4)["x"])
    assert fake.bound_outputs == {"output": ("cuda", 0)}  # outputs stay on the GPU
    assert len(fake.ortvalues) == 1  # inputs copied to the device once, not per call


def test_host_copies_on_a_gpu_are_labelled_as_such(artifact, monkeypatch):
    fake = _fake(monkeypatch, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    row = rt.time_artifact(artifact, iters=3, warmup=1, timing="host-copies")
    assert row["timing"] == "host-copies" and "copies" in row["timing_note"]
    assert fake.calls == {"run": 4, "run_with_iobinding": 0} and not fake.ortvalues


@pytest.mark.parametrize("timing", [None, "device-resident", "host-copies"])
def test_cpu_provider_is_one_measurement_and_says_so(artifact, monkeypatch, timing):
    fake = _fake(monkeypatch, ["CPUExecutionProvider"])
    row = rt.time_artifact(artifact, iters=2, warmup=1, timing=timing)
    assert row["timing"] == (timing or "device-resident") and row["timing_note"] == rt.CPU_TIMING_NOTE
    assert fake.calls == {"run": 3, "run_with_iobinding": 0}


def test_bad_timing_is_a_clear_error(artifact, monkeypatch):
    _fake(monkeypatch, ["CPUExecutionProvider"])
    with pytest.raises(rt.RunnerError, match="--timing must be one of device-resident, host-copies"):
        rt.time_artifact(artifact, iters=1, timing="resident")


def test_bench_command_labels_its_rows(artifact, monkeypatch, capsys):
    """`tctune bench` passes --timing through and prints the label column and the note."""
    from tctune.cli import main

    _fake(monkeypatch, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert main(["bench", artifact, "--iters", "2", "--warmup", "0", "--timing", "host-copies", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["timing"] == "host-copies"
    assert main(["bench", artifact, "--iters", "2", "--warmup", "0"]) == 0
    table = capsys.readouterr().out
    header = table.splitlines()[0].split()
    assert header[:4] == ["artifact", "format", "device", "timing"]
    assert "device-resident" in table.splitlines()[2]


def test_runner_script_prints_the_label(artifact, monkeypatch, capsys):
    _fake(monkeypatch, ["CPUExecutionProvider"])
    assert rt.main([artifact, "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "device-resident timing (runs on the CPU" in out
    assert rt.main([artifact, "--iters", "1", "--warmup", "0", "--timing", "host-copies", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["timing"] == "host-copies"
