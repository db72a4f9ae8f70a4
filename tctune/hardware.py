"""The hardware model: which NVIDIA GPU tctune runs on (or plans for), described as plain data.

Every later stage reads a :class:`HardwareSpec`: the search space (which precisions to try), the graph passes
(alignment in elements per dtype and the generation, read by ``passes.policy.pass_spec``), and the report. Tensor Core
generations are data, one frozen :class:`ArchSpec` each (tinygrad style); no stage branches on GPU names.

Where a spec comes from:

- ``detect()`` asks the CUDA driver through cuda-python (``cuda.bindings.driver``; ``cuda.cuda`` on
  cuda-python older than 12.6) and adds NVML facts (max SM clock, power limit, driver version) where
  ``pynvml`` (package nvidia-ml-py) is present. Without cuda-python it falls back to ``torch.cuda``. It never
  raises; with no driver or no GPU it returns ``[]`` and :func:`no_gpu_reason` says why.
- ``resolve(target)`` builds a spec from ``--target`` (``"h100"``, ``"sm_90"``, ``"9.0"``...) without any GPU,
  so a CPU machine can plan for a GPU; without a target it picks the detected GPU, else the CPU.

Sources: Tensor Core precisions per generation from NVIDIA's architecture whitepapers (Volta V100, Turing,
Ampere GA100, Ada, Hopper H100, Blackwell); alignment from NVIDIA's Deep Learning Performance Guide, "Matrix
Multiplication Background User's Guide", section "Tensor Core Requirements" (GEMM dimensions M, N, K and conv
channel counts that are multiples of 16 bytes: 8 fp16/bf16 elements, 4 tf32, 16 int8/fp8); SM counts and
memory sizes in :data:`TARGETS` from NVIDIA's product datasheets.
"""
from __future__ import annotations

import logging
import platform
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

from tctune.errors import HardwareError, UsageError

logger = logging.getLogger(__name__)

__all__ = [
    "ArchSpec",
    "HardwareSpec",
    "Target",
    "ARCHS",
    "TARGETS",
    "arch_for",
    "detect",
    "resolve",
    "describe",
    "no_gpu_reason",
]

# --------------------------------------------------------------------------------------------------------------
# Architectures as data
# --------------------------------------------------------------------------------------------------------------

#: Tensor Core alignment in *elements* per dtype: 16 bytes of each GEMM dimension (M, N, K) and of conv
#: channel counts. Source: NVIDIA Deep Learning Performance Guide, "Matrix Multiplication Background User's
#: Guide", Tensor Core requirements. fp4 (Blackwell) is not in that table and is left out on purpose.
_ALIGNMENT = {"fp16": 8, "bf16": 8, "tf32": 4, "fp8": 16, "int8": 16}

#: Bytes per element, for the alignment table in :func:`describe`.
_BYTES = {"fp16": 2, "bf16": 2, "tf32": 4, "fp8": 1, "int8": 1, "fp4": 0.5}


@dataclass(frozen=True)
class ArchSpec:
    """One Tensor Core generation, as data.

    Attributes:
        name: ``"Volta"``, ``"Turing"``, ``"Ampere"``, ``"Ada"``, ``"Hopper"`` or ``"Blackwell"``.
        compute_capabilities: the ``"major.minor"`` compute capabilities of this generation, e.g.
            ``("8.0", "8.6", "8.7")``.
        tensor_core_precisions: input precisions the Tensor Cores take (``"tf32"``, ``"fp16"``, ``"bf16"``,
            ``"int8"``, ``"fp8"``, ``"fp4"``); source: NVIDIA architecture whitepapers.
        alignment: elements per dtype that GEMM dimensions (M, N, K) and conv channels should be a multiple of
            for Tensor Core kernels, restricted to this generation's precisions. Source: NVIDIA Deep Learning
            Performance Guide, "Matrix Multiplication Background User's Guide", Tensor Core requirements
            (16 bytes: 8 fp16/bf16, 4 tf32, 16 int8/fp8).
        exact: False when this spec was chosen for a compute capability tctune does not know (a newer chip
            described by the nearest older generation); see :func:`arch_for`.
    """

    name: str
    compute_capabilities: tuple[str, ...]
    tensor_core_precisions: tuple[str, ...]
    alignment: dict = field(hash=False)
    exact: bool = True

    @property
    def min_cc(self) -> tuple[int, int]:
        """The oldest compute capability of this generation, as ``(major, minor)``."""
        return min(_parse_cc(cc) for cc in self.compute_capabilities)


def _arch(name: str, ccs: tuple[str, ...], precisions: tuple[str, ...]) -> ArchSpec:
    return ArchSpec(name, ccs, precisions, {k: v for k, v in _ALIGNMENT.items() if k in precisions})


#: Known Tensor Core generations, oldest first.
ARCHS: tuple[ArchSpec, ...] = (
    _arch("Volta", ("7.0", "7.2"), ("fp16",)),
    _arch("Turing", ("7.5",), ("fp16", "int8")),
    _arch("Ampere", ("8.0", "8.6", "8.7"), ("tf32", "fp16", "bf16", "int8")),
    _arch("Ada", ("8.9",), ("tf32", "fp16", "bf16", "int8", "fp8")),
    _arch("Hopper", ("9.0",), ("tf32", "fp16", "bf16", "int8", "fp8")),
    _arch("Blackwell", ("10.0", "10.3", "11.0", "12.0", "12.1"), ("tf32", "fp16", "bf16", "int8", "fp8", "fp4")),
)

#: Names of generations without Tensor Cores, for error messages (major version -> name).
_OLD_ARCH_NAMES = {1: "Tesla", 2: "Fermi", 3: "Kepler", 5: "Maxwell", 6: "Pascal"}

_MIN_CC = (7, 0)


def _parse_cc(cc: str) -> tuple[int, int]:
    """``"8.6"`` -> ``(8, 6)``; raises ValueError on anything else."""
    major, _, minor = str(cc).strip().partition(".")
    if not major.isdigit() or not minor.isdigit():
        raise ValueError(f"not a compute capability: {cc!r} (expected 'major.minor', e.g. '9.0')")
    return int(major), int(minor)


def _cc_str(major: int, minor: int) -> str:
    return f"{major}.{minor}"


def _old_arch_name(cc: tuple[int, int]) -> str:
    return _OLD_ARCH_NAMES.get(cc[0], "pre-Volta")


def arch_for(compute_capability: str, *, device_name: str = "") -> ArchSpec:
    """The Tensor Core generation of a compute capability.

    Args:
        compute_capability: ``"major.minor"``, e.g. ``"9.0"``.
        device_name: the GPU's name, only used in the error message.

    Returns:
        The :class:`ArchSpec` whose ``compute_capabilities`` contain it. A capability newer than any tctune
        knows (or between known ones) gets the nearest known older generation, returned with ``exact=False``
        and a logged warning: its Tensor Cores do at least what that generation's did.

    Raises:
        HardwareError: below 7.0 (no Tensor Cores), or not a compute capability at all.
    """
    try:
        cc = _parse_cc(compute_capability)
    except ValueError as exc:
        raise HardwareError(str(exc)) from None
    if cc < _MIN_CC:
        what = ", ".join(x for x in (device_name, _old_arch_name(cc)) if x)
        raise HardwareError(
            f"tctune needs compute capability 7.0 or newer (Volta); found {_cc_str(*cc)} ({what}), "
            f"which has no Tensor Cores"
        )
    for arch in ARCHS:
        if _cc_str(*cc) in arch.compute_capabilities:
            return arch
    older = [arch for arch in ARCHS if arch.min_cc <= cc]
    nearest = older[-1]
    logger.warning(
        "compute capability %s is not known to tctune; treating it as %s (%s)",
        _cc_str(*cc), nearest.name, ", ".join(nearest.compute_capabilities),
    )
    return replace(nearest, exact=False)


# --------------------------------------------------------------------------------------------------------------
# Planning targets
# --------------------------------------------------------------------------------------------------------------


class Target(NamedTuple):
    """A GPU tctune can plan for without having it (``--target NAME``). Memory is nominal (datasheet) MiB."""

    name: str
    compute_capability: str
    sm_count: int
    memory_mib: int


def _gib(n: float) -> int:
    return int(n * 1024)


#: ``--target`` names -> (marketing name, compute capability, SM count, memory in MiB). Source: NVIDIA
#: datasheets (V100, T4, A100, A10, L4, L40S, H100, H200, B200, GeForce RTX 3090/4090/5090); A10G from AWS's
#: G5 documentation. Pre-Volta entries exist only so that ``--target p100`` explains why it is refused.
TARGETS: dict[str, Target] = {
    "p100": Target("NVIDIA Tesla P100", "6.0", 56, _gib(16)),
    "v100": Target("NVIDIA V100 (32 GB)", "7.0", 80, _gib(32)),
    "v100-16gb": Target("NVIDIA V100 (16 GB)", "7.0", 80, _gib(16)),
    "t4": Target("NVIDIA T4", "7.5", 40, _gib(16)),
    "a100": Target("NVIDIA A100 (80 GB)", "8.0", 108, _gib(80)),
    "a100-40gb": Target("NVIDIA A100 (40 GB)", "8.0", 108, _gib(40)),
    "a10": Target("NVIDIA A10", "8.6", 72, _gib(24)),
    "a10g": Target("NVIDIA A10G", "8.6", 80, _gib(24)),
    "rtx3090": Target("NVIDIA GeForce RTX 3090", "8.6", 82, _gib(24)),
    "l4": Target("NVIDIA L4", "8.9", 58, _gib(24)),
    "l40s": Target("NVIDIA L40S", "8.9", 142, _gib(48)),
    "rtx4090": Target("NVIDIA GeForce RTX 4090", "8.9", 128, _gib(24)),
    "h100": Target("NVIDIA H100 SXM (80 GB)", "9.0", 132, _gib(80)),
    "h100-pcie": Target("NVIDIA H100 PCIe (80 GB)", "9.0", 114, _gib(80)),
    "h200": Target("NVIDIA H200", "9.0", 132, _gib(141)),
    "b200": Target("NVIDIA B200", "10.0", 148, _gib(180)),
    "rtx5090": Target("NVIDIA GeForce RTX 5090", "12.0", 170, _gib(32)),
}


# --------------------------------------------------------------------------------------------------------------
# HardwareSpec
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HardwareSpec:
    """The machine a study measures on, or the GPU it plans for (``--target``).

    Attributes:
        name: ``"NVIDIA H200"``, or ``"CPU (x86_64)"``.
        arch: an :class:`ArchSpec` name, ``"cpu"``, or the pre-Volta generation name of a detected GPU that
            tctune cannot use (``"Pascal"``; :func:`resolve` refuses it).
        compute_capability: ``"9.0"``; ``""`` for the CPU.
        source: ``"cuda-python"``, ``"torch"`` (detected), ``"target"`` (``--target``) or ``"cpu"``.
        sm_count: streaming multiprocessors; None when unknown (``--target sm_90``, the CPU).
        memory_mib: total device memory in MiB; None when unknown.
        tensor_core_precisions: precisions the Tensor Cores take; ``()`` for the CPU.
        alignment: elements per dtype for Tensor Core GEMMs/convs (see :class:`ArchSpec`); ``{}`` for the CPU.
        device_index: CUDA ordinal (as the process sees it, after ``CUDA_VISIBLE_DEVICES``); None otherwise.
        clock_mhz: max SM clock in MHz, from NVML where present.
        power_limit_w: enforced power limit in W, from NVML where present.
        driver_version: the display driver version from NVML (``"580.95.05"``); without NVML the CUDA version
            the driver supports (``"CUDA 13.0"``).
        notes: caveats for the report, e.g. a compute capability tctune does not know.
    """

    name: str
    arch: str
    compute_capability: str
    source: str
    sm_count: int | None
    memory_mib: int | None
    tensor_core_precisions: tuple[str, ...]
    alignment: dict = field(hash=False)
    device_index: int | None = None
    clock_mhz: int | None = None
    power_limit_w: float | None = None
    driver_version: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def is_gpu(self) -> bool:
        """True for a detected or targeted GPU, False for the CPU."""
        return self.source != "cpu"

    def search_precisions(self, measure_on_gpu: bool, training: bool = False) -> tuple[str, ...]:
        """Compute precisions the tuner may search, in the order to try them.

        Args:
            measure_on_gpu: True when candidates are timed on this GPU. False on a CPU machine, including when
                planning for a ``--target`` GPU from a CPU.

        Returns:
            On a GPU: ``"fp32"``, then ``"tf32"`` (Ampere and newer), ``"fp16"`` (Volta and newer), ``"bf16"``
            (Ampere and newer), ``"fp8"`` (Ada and newer, inference only: E4M3 GEMMs via ``torch._scaled_mm``,
            everything else bf16). Measuring on the CPU: ``("fp32", "bf16")`` (the CPU has bf16 kernels but
            no useful fp16 or tf32).
        """
        if not self.is_gpu or not measure_on_gpu:
            return ("fp32", "bf16")
        wanted = ("tf32", "fp16", "bf16") if training else ("tf32", "fp16", "bf16", "fp8")
        return ("fp32",) + tuple(p for p in wanted if p in self.tensor_core_precisions)

    def to_dict(self) -> dict:
        """Every field, JSON-ready (tuples become lists), plus ``is_gpu``."""
        d = asdict(self)
        d["tensor_core_precisions"] = list(self.tensor_core_precisions)
        d["alignment"] = dict(self.alignment)
        d["notes"] = list(self.notes)
        d["is_gpu"] = self.is_gpu
        return d


def _gpu_spec(
    name: str,
    cc: tuple[int, int],
    source: str,
    sm_count: int | None,
    memory_mib: int | None,
    **extra,
) -> HardwareSpec:
    """A GPU spec; a pre-Volta GPU gets its generation name and no Tensor Cores (``resolve`` refuses it)."""
    notes: list[str] = list(extra.pop("notes", ()))
    if cc < _MIN_CC:
        return HardwareSpec(
            name, _old_arch_name(cc), _cc_str(*cc), source, sm_count, memory_mib, (), {},
            notes=tuple(notes + ["no Tensor Cores: tctune needs compute capability 7.0 or newer"]), **extra,
        )
    arch = arch_for(_cc_str(*cc), device_name=name)
    if not arch.exact:
        notes.append(
            f"compute capability {_cc_str(*cc)} is newer than tctune knows; assuming {arch.name} "
            f"({', '.join(arch.compute_capabilities)}) Tensor Cores"
        )
    return HardwareSpec(
        name, arch.name, _cc_str(*cc), source, sm_count, memory_mib, arch.tensor_core_precisions,
        dict(arch.alignment), notes=tuple(notes), **extra,
    )


def _cpu_spec() -> HardwareSpec:
    cpu = platform.processor() or platform.machine() or "unknown"
    return HardwareSpec(f"CPU ({cpu})", "cpu", "", "cpu", None, None, (), {})


# --------------------------------------------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------------------------------------------

#: Seconds the driver probe may take before detection gives up (a wedged driver must not hang the CLI).
_PROBE_TIMEOUT_S = 60.0

_last_reason: str | None = None


def _import_driver():
    """The cuda-python driver module: ``cuda.bindings.driver`` (>= 12.6), else ``cuda.cuda`` (older)."""
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
        return driver
    except ImportError:
        pass
    from cuda import cuda as driver  # cuda-python < 12.6; raises ImportError when cuda-python is missing
    return driver


def _err_name(driver, err) -> str:
    name = getattr(err, "name", None)
    if name is None:
        try:
            res, s = driver.cuGetErrorName(err)
            name = s.decode() if isinstance(s, bytes) else str(s)
        except Exception:  # noqa: BLE001 - only decoration for a message
            name = str(err)
    try:
        return f"{name} ({int(err)})"
    except (TypeError, ValueError):
        return str(name)


def _decode(raw) -> str:
    if isinstance(raw, (bytes, bytearray)):
        raw = bytes(raw).split(b"\x00", 1)[0].decode(errors="replace")
    return str(raw).split("\x00", 1)[0].strip()


def _parse_bus_id(bus_id) -> tuple[int, int, int, int] | None:
    """``"0000:65:00.0"`` or NVML's ``"00000000:65:00.0"`` -> ``(domain, bus, device, function)``."""
    try:
        text = _decode(bus_id)
        domain, bus, rest = text.split(":")
        dev, fn = rest.split(".")
        return int(domain, 16), int(bus, 16), int(dev, 16), int(fn, 16)
    except (ValueError, AttributeError):
        return None


class _DriverError(Exception):
    """A driver call failed; the message is the reason :func:`no_gpu_reason` reports."""


def _probe_cuda_python(driver) -> list[dict]:
    """Raw facts per device from the CUDA driver API. Raises _DriverError with a readable reason."""

    def call(fn_name: str, *args):
        out = getattr(driver, fn_name)(*args)
        err, rest = out[0], out[1:]
        if err != driver.CUresult.CUDA_SUCCESS:
            raise _DriverError(f"{fn_name} failed: {_err_name(driver, err)}")
        return rest[0] if len(rest) == 1 else rest

    try:
        call("cuInit", 0)
    except _DriverError:
        raise
    except Exception as exc:  # noqa: BLE001 - cuda-python raises when libcuda.so cannot be loaded
        if "NotFound" in type(exc).__name__ or "libcuda" in str(exc) or "driver" in str(exc).lower():
            logger.debug("cuInit: %s", exc)
            raise _DriverError("NVIDIA driver library libcuda.so not found") from None
        raise _DriverError(f"cuInit raised {type(exc).__name__}: {exc}") from None

    attr = driver.CUdevice_attribute
    version = None
    if hasattr(driver, "cuDriverGetVersion"):
        try:
            v = int(call("cuDriverGetVersion"))
            version = f"CUDA {v // 1000}.{(v % 1000) // 10}"
        except Exception:  # noqa: BLE001 - optional fact
            pass
    devices = []
    for ordinal in range(int(call("cuDeviceGetCount"))):
        dev = call("cuDeviceGet", ordinal)
        info = {
            "index": ordinal,
            "name": _decode(call("cuDeviceGetName", 256, dev)),
            "cc": (
                int(call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)),
                int(call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)),
            ),
            "sm_count": int(call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)),
            "memory_mib": int(call("cuDeviceTotalMem", dev)) // (1 << 20),
            "bus_id": None,
            "driver_version": version,
        }
        if hasattr(driver, "cuDeviceGetPCIBusId"):
            try:
                info["bus_id"] = _parse_bus_id(call("cuDeviceGetPCIBusId", 32, dev))
            except Exception:  # noqa: BLE001 - only used to match NVML devices
                pass
        devices.append(info)
    return devices


def _probe_torch() -> list[dict]:
    """Raw facts per device from ``torch.cuda``. Raises _DriverError with a readable reason."""
    try:
        import torch
    except ImportError as exc:
        raise _DriverError(f"torch not importable: {exc}") from None
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            raise _DriverError(f"torch {torch.__version__} is a CPU-only build")
        raise _DriverError("torch.cuda.is_available() is False")
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bus_id = None
        if all(hasattr(p, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
            bus_id = (int(p.pci_domain_id), int(p.pci_bus_id), int(p.pci_device_id), 0)
        devices.append({
            "index": i,
            "name": p.name,
            "cc": (int(p.major), int(p.minor)),
            "sm_count": int(p.multi_processor_count),
            "memory_mib": int(p.total_memory) // (1 << 20),
            "bus_id": bus_id,
            "driver_version": None,
        })
    return devices


def _nvml_facts(devices: list[dict]) -> None:
    """Add max SM clock, power limit and driver version from NVML, matching devices by PCI bus id.

    CUDA and NVML number devices differently (CUDA orders fastest first and honours CUDA_VISIBLE_DEVICES), so
    devices are matched by PCI address; without one, by index only when both see the same number of devices.
    Silently does nothing when pynvml or the NVML library is missing.
    """
    try:
        import pynvml
    except ImportError:
        return
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVML is optional
        logger.debug("NVML unavailable: %s", exc)
        return
    try:
        try:
            driver_version = _decode(pynvml.nvmlSystemGetDriverVersion())
        except Exception:  # noqa: BLE001
            driver_version = None
        handles = {}
        count = int(pynvml.nvmlDeviceGetCount())
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                handles[_parse_bus_id(pynvml.nvmlDeviceGetPciInfo(h).busId)] = h
            except Exception:  # noqa: BLE001
                pass
            handles.setdefault(("index", i), h)
        for d in devices:
            h = handles.get(d.get("bus_id")) if d.get("bus_id") else None
            if h is None and len(devices) == count:
                h = handles.get(("index", d["index"]))
            if driver_version:
                d["driver_version"] = driver_version
            if h is None:
                continue
            try:
                d["clock_mhz"] = int(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM))
            except Exception:  # noqa: BLE001 - not supported on every board
                pass
            for fn in ("nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimit"):
                try:
                    d["power_limit_w"] = int(getattr(pynvml, fn)(h)) / 1000.0  # NVML reports milliwatts
                    break
                except Exception:  # noqa: BLE001
                    continue
    except Exception as exc:  # noqa: BLE001 - NVML is optional
        logger.debug("NVML query failed: %s", exc)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _detect_raw() -> tuple[str, list[dict], str]:
    """(source, devices, reason when there are none)."""
    reasons = []
    try:
        driver = _import_driver()
    except ImportError as exc:
        driver = None
        reasons.append(f"cuda-python not installed ({exc})")
    if driver is not None:
        try:
            devices = _probe_cuda_python(driver)
        except _DriverError as exc:
            reasons.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - an unexpected binding; try torch instead
            reasons.append(f"cuda-python probe failed: {type(exc).__name__}: {exc}")
        else:
            if not devices:
                return "cuda-python", [], "the CUDA driver reports 0 devices (check CUDA_VISIBLE_DEVICES)"
            return "cuda-python", devices, ""
    try:
        devices = _probe_torch()
    except _DriverError as exc:
        reasons.append(str(exc))
    except Exception as exc:  # noqa: BLE001
        reasons.append(f"torch.cuda probe failed: {type(exc).__name__}: {exc}")
    else:
        if devices:
            return "torch", devices, ""
        reasons.append("torch.cuda reports 0 devices")
    return "", [], "; ".join(reasons)


def detect() -> list[HardwareSpec]:
    """All NVIDIA GPUs this process can use, in CUDA ordinal order.

    Tries cuda-python's driver API first (source ``"cuda-python"``), then ``torch.cuda`` (source ``"torch"``),
    and adds NVML's max SM clock, power limit and driver version where pynvml is present. Pre-Volta GPUs are
    listed (with ``tensor_core_precisions == ()``) so that ``tctune detect`` can say why they are refused.

    Returns:
        One :class:`HardwareSpec` per device; ``[]`` when there is no driver, no GPU, or the driver does not
        answer within a minute. Never raises; :func:`no_gpu_reason` says why the list is empty.
    """
    global _last_reason
    box: dict = {}

    def work() -> None:
        try:
            source, devices, reason = _detect_raw()
            if devices:
                _nvml_facts(devices)
            box["result"] = (source, devices, reason)
        except BaseException as exc:  # noqa: BLE001 - detect() never raises
            box["result"] = ("", [], f"detection failed: {type(exc).__name__}: {exc}")

    # A daemon thread so that a wedged driver (cuInit blocking forever) cannot hang tctune.
    thread = threading.Thread(target=work, name="tctune-detect", daemon=True)
    thread.start()
    thread.join(_PROBE_TIMEOUT_S)
    if thread.is_alive():
        _last_reason = f"the NVIDIA driver did not answer within {_PROBE_TIMEOUT_S:.0f} s"
        logger.warning("GPU detection timed out: %s", _last_reason)
        return []
    source, devices, reason = box["result"]
    specs = []
    for d in devices:
        try:
            specs.append(_gpu_spec(
                d["name"], d["cc"], source, d["sm_count"], d["memory_mib"],
                device_index=d["index"], clock_mhz=d.get("clock_mhz"), power_limit_w=d.get("power_limit_w"),
                driver_version=d.get("driver_version"),
            ))
        except Exception as exc:  # noqa: BLE001 - one odd device must not hide the others
            logger.warning("skipping GPU %s (%s): %s", d.get("index"), d.get("name"), exc)
    _last_reason = "" if specs else (reason or "no usable device found")
    if not specs:
        logger.info("no NVIDIA GPU found: %s", _last_reason)
    return specs


def no_gpu_reason() -> str:
    """Why the last :func:`detect` found no GPU (``""`` when it found some); runs detect() if it never ran."""
    if _last_reason is None:
        detect()
    return _last_reason or ""


# --------------------------------------------------------------------------------------------------------------
# Resolving --target / the machine
# --------------------------------------------------------------------------------------------------------------


def _parse_sm(text: str) -> tuple[int, int] | None:
    """``"sm_90"``, ``"sm90"``, ``"sm_90a"``, ``"90"``, ``"100"``, ``"9.0"`` -> ``(major, minor)``; else None."""
    t = text.strip().lower()
    if "." in t:
        try:
            return _parse_cc(t)
        except ValueError:
            return None
    for prefix in ("sm_", "sm", "compute_"):
        if t.startswith(prefix):
            t = t[len(prefix):]
            break
    t = t.rstrip("af")  # arch-specific (sm_90a) and family (sm_100f) suffixes name the same chip
    if t.isdigit() and len(t) in (2, 3):
        return int(t[:-1]), int(t[-1])
    return None


def _target_spec(target: str) -> HardwareSpec:
    key = target.strip().lower()
    if key in TARGETS:
        t = TARGETS[key]
        cc = _parse_cc(t.compute_capability)
        if cc < _MIN_CC:
            arch_for(t.compute_capability, device_name=t.name)  # raises HardwareError
        return _gpu_spec(t.name, cc, "target", t.sm_count, t.memory_mib)
    cc = _parse_sm(key)
    if cc is None:
        names = ", ".join(k for k, t in TARGETS.items() if _parse_cc(t.compute_capability) >= _MIN_CC)
        raise UsageError(
            f"unknown target {target!r}; use a GPU name ({names}) or a compute capability as sm_XY, "
            f"XY or X.Y (e.g. sm_90, 90, 9.0)", field="target"
        )
    if cc < _MIN_CC:
        arch_for(_cc_str(*cc))  # raises HardwareError
    spec = _gpu_spec(f"sm_{cc[0]}{cc[1]}", cc, "target", None, None)
    return replace(spec, name=f"{spec.name} ({spec.arch})")


def _torch_runs_on(cc: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch build compiled for ``arch_list`` (``torch.cuda.get_arch_list()``) runs on ``cc``.

    A cubin ``sm_XY`` runs on the same major version with minor >= Y; PTX ``compute_XY`` JIT-compiles for any
    capability >= X.Y.
    """
    for entry in arch_list:
        kind, _, num = entry.partition("_")
        parsed = _parse_sm(num)
        if parsed is None:
            continue
        if kind == "sm" and parsed[0] == cc[0] and parsed[1] <= cc[1]:
            return True
        if kind == "compute" and parsed <= cc:
            return True
    return False


def _check_torch_supports(spec: HardwareSpec) -> None:
    """Raise HardwareError when the installed torch has no kernels for this GPU (e.g. Volta on CUDA 13)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return
        arch_list = list(torch.cuda.get_arch_list())
        version = torch.__version__
        cuda = torch.version.cuda
    except Exception:  # noqa: BLE001 - a torch that cannot answer is judged later, when it runs
        return
    cc = _parse_cc(spec.compute_capability)
    if not arch_list or _torch_runs_on(cc, arch_list):
        return
    sm = f"sm_{cc[0]}{cc[1]}"
    if cc[0] == 7 and cc[1] < 5:
        fix = (
            "CUDA 13 dropped Volta; install a torch built with CUDA 12.6, e.g. "
            "`pip install torch --index-url https://download.pytorch.org/whl/cu126`"
        )
    else:
        fix = "install a torch build whose CUDA version supports this GPU (see https://pytorch.org/get-started)"
    raise HardwareError(
        f"{spec.name} (compute capability {spec.compute_capability}, {spec.arch}) is not supported by this "
        f"torch build: torch {version} (CUDA {cuda}) was compiled for {', '.join(arch_list)} and not {sm}; {fix}"
    )


def resolve(target: str | None = None, device_index: int = 0) -> HardwareSpec:
    """The hardware a run measures on or plans for.

    Args:
        target: ``--target``: a :data:`TARGETS` name (case-insensitive, e.g. ``"h100"``) or a compute capability
            (``"sm_90"``, ``"sm90"``, ``"90"``, ``"9.0"``). None: the machine itself.
        device_index: CUDA ordinal of the GPU to use when ``target`` is None.

    Returns:
        With a target: a spec with source ``"target"`` (SM count and memory known only for named targets).
        Without: the detected GPU at ``device_index``, else a CPU spec (source ``"cpu"``).

    Raises:
        UsageError: unknown target name, or ``device_index`` out of range.
        HardwareError: compute capability below 7.0, or the installed torch has no kernels for the GPU
            (a Volta GPU on a CUDA 13 torch build).
    """
    if target is not None and str(target).strip():
        return _target_spec(str(target))
    gpus = detect()
    if not gpus:
        return _cpu_spec()
    if not 0 <= device_index < len(gpus):
        raise UsageError(f"GPU index {device_index} out of range: found {len(gpus)} GPU(s) (0..{len(gpus) - 1})")
    spec = gpus[device_index]
    arch_for(spec.compute_capability, device_name=spec.name)  # HardwareError below 7.0
    _check_torch_supports(spec)
    return spec


# --------------------------------------------------------------------------------------------------------------
# Text for `tctune detect`
# --------------------------------------------------------------------------------------------------------------


def _describe_one(spec: HardwareSpec) -> list[str]:
    if not spec.is_gpu:
        return [
            f"{spec.name}: no Tensor Cores; candidates are timed on the CPU "
            f"(precisions searched: {', '.join(spec.search_precisions(False))})."
        ]
    head = spec.name if spec.device_index is None else f"GPU {spec.device_index}: {spec.name}"
    lines = [f"{head}  [source: {spec.source}]"]
    rows = [("compute capability", f"{spec.compute_capability} ({spec.arch})")]
    if spec.sm_count is not None:
        rows.append(("SMs", str(spec.sm_count)))
    if spec.memory_mib is not None:
        rows.append(("memory", f"{spec.memory_mib:,} MiB ({spec.memory_mib / 1024:.1f} GiB)"))
    if spec.clock_mhz is not None:
        rows.append(("max SM clock", f"{spec.clock_mhz} MHz"))
    if spec.power_limit_w is not None:
        rows.append(("power limit", f"{spec.power_limit_w:g} W"))
    if spec.driver_version:
        rows.append(("driver", spec.driver_version))
    tcp = ", ".join(spec.tensor_core_precisions) or "none (tctune needs compute capability 7.0 or newer)"
    rows.append(("Tensor Cores", tcp))
    lines += [f"  {k:<19} {v}" for k, v in rows]
    if spec.alignment:
        lines.append("  alignment (GEMM N and K and conv channels should be multiples of; M never matters):")
        lines.append(f"    {'dtype':<6} {'elements':>8} {'bytes':>6}")
        for dtype, n in spec.alignment.items():
            lines.append(f"    {dtype:<6} {n:>8} {n * _BYTES.get(dtype, 0):>6g}")
    lines += [f"  note: {n}" for n in spec.notes]
    return lines


def describe(specs: list[HardwareSpec]) -> str:
    """Human-readable text for ``tctune detect``: one block per spec, or a sentence when there is none.

    Args:
        specs: usually :func:`detect`'s list (a :func:`resolve` result works too).

    Returns:
        Multi-line text: name, compute capability and architecture, SMs, memory (MiB), max SM clock (MHz) and
        power limit (W) when known, Tensor Core precisions, and the alignment table (elements and bytes per
        dtype). For ``[]``: "No NVIDIA GPU found (reason). tctune will measure on the CPU; ...".
    """
    if not specs:
        reason = no_gpu_reason() or "none detected"
        return (
            f"No NVIDIA GPU found ({reason}). tctune will measure on the CPU; "
            f"use --target NAME to plan for a GPU."
        )
    blocks = ["\n".join(_describe_one(s)) for s in specs]
    return "\n\n".join(blocks)
