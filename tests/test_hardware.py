"""Tests for tctune.hardware: targets, detection (with a fake cuda-python driver), and the text for `detect`."""
from __future__ import annotations

import json
import sys
import types
from enum import IntEnum

import pytest

from passes.base import PassSpec
from passes.policy import pass_spec
from tctune import hardware
from tctune.errors import HardwareError, UsageError


# ---------------------------------------------------------------------------------------------------- targets


def test_resolve_h100_is_hopper():
    spec = hardware.resolve("h100")

    assert spec.arch == "Hopper"
    assert spec.compute_capability == "9.0"
    assert spec.source == "target"
    assert spec.sm_count == 132
    assert "fp8" in spec.tensor_core_precisions
    assert spec.alignment["fp16"] == 8
    assert spec.alignment["tf32"] == 4
    assert spec.alignment["fp8"] == 16


@pytest.mark.parametrize("target", ["sm_86", "sm86", "86", "8.6", "SM_86"])
def test_resolve_sm_forms_ampere(target):
    spec = hardware.resolve(target)

    assert spec.arch == "Ampere"
    assert spec.compute_capability == "8.6"
    assert spec.sm_count is None


def test_resolve_three_digit_sm_is_blackwell():
    assert hardware.resolve("sm_100").arch == "Blackwell"
    assert hardware.resolve("sm_90a").compute_capability == "9.0"


@pytest.mark.parametrize("target", ["V100", "v100", " v100 "])
def test_resolve_case_insensitive(target):
    spec = hardware.resolve(target)

    assert spec.arch == "Volta"
    assert spec.tensor_core_precisions == ("fp16",)
    assert spec.alignment == {"fp16": 8}


@pytest.mark.parametrize("target", ["p100", "sm_60", "6.1"])
def test_resolve_pre_volta_raises(target):
    with pytest.raises(HardwareError, match=r"7\.0"):
        hardware.resolve(target)


def test_resolve_unknown_name_lists_valid_names():
    with pytest.raises(UsageError) as info:
        hardware.resolve("h900x")

    msg = str(info.value)
    assert "h100" in msg and "a100" in msg and "sm_" in msg


@pytest.mark.parametrize("name", sorted(set(hardware.TARGETS) - {"p100"}))
def test_every_target_resolves(name):
    spec = hardware.resolve(name)

    assert spec.is_gpu and spec.sm_count and spec.memory_mib
    assert set(spec.alignment) <= set(spec.tensor_core_precisions)


def test_alignment_restricted_to_arch_precisions():
    turing = hardware.arch_for("7.5")
    ampere = hardware.arch_for("8.0")

    assert turing.alignment == {"fp16": 8, "int8": 16}
    assert ampere.alignment == {"fp16": 8, "bf16": 8, "tf32": 4, "int8": 16}
    assert "fp8" in hardware.arch_for("8.9").tensor_core_precisions


def test_arch_for_unknown_newer_uses_nearest_older_flagged():
    arch = hardware.arch_for("15.0")

    assert arch.name == "Blackwell"
    assert arch.exact is False
    assert hardware.arch_for("9.0").exact is True


def test_arch_for_pre_volta_message():
    with pytest.raises(HardwareError, match=r"needs compute capability 7\.0 or newer \(Volta\); found 6\.0"):
        hardware.arch_for("6.0")


# ---------------------------------------------------------------------------------------------- spec methods


@pytest.fixture
def cpu(monkeypatch):
    """The CPU spec resolve() gives on a machine without GPUs (forced, so this also holds on a GPU machine)."""
    monkeypatch.setattr(hardware, "detect", lambda: [])
    return hardware.resolve()


def test_search_precisions_cpu(cpu):
    assert cpu.source == "cpu" and not cpu.is_gpu
    assert cpu.search_precisions(measure_on_gpu=False) == ("fp32", "bf16")
    assert cpu.search_precisions(measure_on_gpu=True) == ("fp32", "bf16")


def test_search_precisions_h100():
    h100 = hardware.resolve("h100")

    assert h100.search_precisions(measure_on_gpu=True) == ("fp32", "tf32", "fp16", "bf16", "fp8")
    assert h100.search_precisions(measure_on_gpu=True, training=True) == ("fp32", "tf32", "fp16", "bf16")
    assert h100.search_precisions(measure_on_gpu=False) == ("fp32", "bf16")


def test_search_precisions_ampere_has_no_fp8():
    assert "fp8" not in hardware.resolve("a100").search_precisions(measure_on_gpu=True)


def test_pass_spec_fp8_scaling_by_arch():
    assert pass_spec(hardware.resolve("h100"), "fp8").fp8_scaling == "row"
    assert pass_spec(hardware.resolve("b200"), "fp8").fp8_scaling == "tensor"


def test_search_precisions_volta_has_no_bf16_or_tf32():
    assert hardware.resolve("v100").search_precisions(measure_on_gpu=True) == ("fp32", "fp16")


def test_pass_spec_carries_alignment():
    spec = pass_spec(hardware.resolve("a100"), "fp16", training=True)

    assert isinstance(spec, PassSpec)
    assert spec.align("fp16") == 8 and spec.align("tf32") == 4
    assert spec.arch == "Ampere" and spec.training is True


def test_pass_spec_cpu_has_no_alignment(cpu):
    spec = pass_spec(cpu, "bf16")

    assert spec.alignment == {} and spec.arch == "cpu"


def test_to_dict_is_json_serializable(cpu):
    for spec in (hardware.resolve("h200"), cpu):
        d = json.loads(json.dumps(spec.to_dict()))
        assert d["name"] == spec.name
        assert d["compute_capability"] == spec.compute_capability
        assert set(d) >= {"arch", "source", "sm_count", "memory_mib", "tensor_core_precisions", "alignment",
                          "device_index", "clock_mhz", "power_limit_w", "driver_version"}


# ---------------------------------------------------------------------------------------------- detection


def test_detect_returns_a_list_without_raising():
    specs = hardware.detect()  # [] on CPU machines; the real GPUs on a GPU machine

    assert isinstance(specs, list)
    assert all(s.source in ("cuda-python", "torch") for s in specs)
    assert bool(hardware.no_gpu_reason()) == (not specs)


def test_describe_empty_says_no_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "_last_reason", "NVIDIA driver library libcuda.so not found")
    text = hardware.describe([])

    assert text.startswith("No NVIDIA GPU found (")
    assert "--target NAME" in text


def test_describe_lists_alignment_table():
    text = hardware.describe([hardware.resolve("h100")])

    assert "9.0 (Hopper)" in text and "132" in text
    assert "fp8" in text and "elements" in text


class _CUresult(IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_NO_DEVICE = 100


class _Attr(IntEnum):
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


def _fake_driver(devices, init_error=_CUresult.CUDA_SUCCESS):
    """A stand-in for cuda.bindings.driver: functions return (CUresult, value...) tuples like cuda-python's."""
    ok = _CUresult.CUDA_SUCCESS
    attrs = {
        _Attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: lambda d: d["cc"][0],
        _Attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: lambda d: d["cc"][1],
        _Attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: lambda d: d["sms"],
    }
    mod = types.ModuleType("fake_driver")
    mod.CUresult = _CUresult
    mod.CUdevice_attribute = _Attr
    mod.cuInit = lambda flags: (init_error,)
    mod.cuDriverGetVersion = lambda: (ok, 13000)
    mod.cuDeviceGetCount = lambda: (ok, len(devices))
    mod.cuDeviceGet = lambda i: (ok, i)
    mod.cuDeviceGetName = lambda n, dev: (ok, devices[dev]["name"].encode() + b"\x00" * 8)
    mod.cuDeviceGetAttribute = lambda a, dev: (ok, attrs[a](devices[dev]))
    mod.cuDeviceTotalMem = lambda dev: (ok, devices[dev]["mib"] << 20)
    mod.cuDeviceGetPCIBusId = lambda n, dev: (ok, f"0000:{dev + 0x10:02x}:00.0".encode())
    return mod


_H200 = {"name": "NVIDIA H200", "cc": (9, 0), "sms": 132, "mib": 143771}


@pytest.fixture
def no_torch_fallback(monkeypatch):
    """Fake-driver tests must not see a real GPU through the torch fallback when run on a GPU machine."""

    def no_torch():
        raise hardware._DriverError("torch fallback disabled in this test")

    monkeypatch.setattr(hardware, "_probe_torch", no_torch)


@pytest.fixture
def no_nvml(monkeypatch, no_torch_fallback):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError


def _install_bindings(monkeypatch, driver):
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)


def test_detect_cuda_python_branch_builds_spec(monkeypatch, no_nvml):
    devices = [_H200, {"name": "Tesla V100-SXM2-32GB", "cc": (7, 0), "sms": 80, "mib": 32510}]
    _install_bindings(monkeypatch, _fake_driver(devices))

    specs = hardware.detect()

    assert [s.source for s in specs] == ["cuda-python", "cuda-python"]
    h200 = specs[0]
    assert h200.name == "NVIDIA H200" and h200.arch == "Hopper" and h200.compute_capability == "9.0"
    assert h200.sm_count == 132 and h200.memory_mib == 143771 and h200.device_index == 0
    assert h200.alignment["fp8"] == 16
    assert h200.driver_version == "CUDA 13.0"
    assert specs[1].arch == "Volta" and specs[1].device_index == 1
    assert hardware.no_gpu_reason() == ""
    assert "GPU 0: NVIDIA H200" in hardware.describe(specs)


def test_detect_legacy_cuda_cuda_import_path(monkeypatch, no_nvml):
    cuda = types.ModuleType("cuda")
    cuda.cuda = _fake_driver([_H200])
    monkeypatch.setitem(sys.modules, "cuda", cuda)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # cuda-python < 12.6 has no cuda.bindings

    specs = hardware.detect()

    assert len(specs) == 1 and specs[0].source == "cuda-python" and specs[0].arch == "Hopper"


def test_detect_records_cuinit_error(monkeypatch, no_nvml):
    _install_bindings(monkeypatch, _fake_driver([], init_error=_CUresult.CUDA_ERROR_NO_DEVICE))

    assert hardware.detect() == []
    assert "CUDA_ERROR_NO_DEVICE" in hardware.no_gpu_reason()
    assert "CUDA_ERROR_NO_DEVICE" in hardware.describe([])


def test_detect_adds_nvml_facts_by_bus_id(monkeypatch, no_torch_fallback):
    _install_bindings(monkeypatch, _fake_driver([_H200]))
    nvml = types.ModuleType("pynvml")
    nvml.NVML_CLOCK_SM = 1
    nvml.nvmlInit = lambda: None
    nvml.nvmlShutdown = lambda: None
    nvml.nvmlSystemGetDriverVersion = lambda: "580.95.05"
    nvml.nvmlDeviceGetCount = lambda: 1
    nvml.nvmlDeviceGetHandleByIndex = lambda i: f"handle{i}"
    nvml.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=b"00000000:10:00.0")
    nvml.nvmlDeviceGetMaxClockInfo = lambda h, clock: 1980
    nvml.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700000
    monkeypatch.setitem(sys.modules, "pynvml", nvml)

    (spec,) = hardware.detect()

    assert spec.clock_mhz == 1980 and spec.power_limit_w == 700.0 and spec.driver_version == "580.95.05"
    assert "1980 MHz" in hardware.describe([spec])


def test_resolve_detected_pre_volta_gpu_raises(monkeypatch, no_nvml):
    _install_bindings(monkeypatch, _fake_driver([{"name": "Tesla P100", "cc": (6, 0), "sms": 56, "mib": 16280}]))

    (spec,) = hardware.detect()
    assert spec.arch == "Pascal" and spec.tensor_core_precisions == ()
    with pytest.raises(HardwareError, match=r"7\.0 or newer.*Tesla P100"):
        hardware.resolve()


def test_resolve_picks_detected_gpu_and_checks_index(monkeypatch, no_nvml):
    _install_bindings(monkeypatch, _fake_driver([_H200]))

    assert hardware.resolve().name == "NVIDIA H200"
    with pytest.raises(UsageError, match="out of range"):
        hardware.resolve(device_index=3)


def test_resolve_volta_on_torch_without_sm70_raises(monkeypatch, no_nvml):
    import torch

    _install_bindings(monkeypatch, _fake_driver([{"name": "Tesla V100", "cc": (7, 0), "sms": 80, "mib": 32510}]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"])

    with pytest.raises(HardwareError, match=r"sm_70.*cu126"):
        hardware.resolve()


def test_torch_runs_on_rules():
    assert hardware._torch_runs_on((8, 6), ["sm_80"])  # same major, newer minor: cubin runs
    assert not hardware._torch_runs_on((7, 0), ["sm_75", "sm_80"])
    assert hardware._torch_runs_on((7, 0), ["compute_70"])  # PTX JIT
    assert hardware._torch_runs_on((9, 0), ["sm_80", "sm_90a"])
