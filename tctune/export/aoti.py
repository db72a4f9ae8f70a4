"""Package the tuned graph with AOTInductor (``.pt2``) and prove the package matches PyTorch.

Why this exists: AOTInductor compiles an exported program ahead of time into a shared library inside a
``.pt2`` archive that ``torch._inductor.aoti_load_package`` runs without Python-level tracing or
``torch.compile`` warm-up: a deployable engine for PyTorch-native serving (and a C++ one via
``AOTIModelPackageLoader``).

The tuned ``GraphModule`` is re-exported with ``torch.export.export`` and one shared
``Dim("batch")`` on dim 0 of every input, compiled with ``torch._inductor.aoti_compile_and_package``
on the module's device (Triton kernels on a GPU; C++ compiled by the host compiler, gcc/clang, on the
CPU), loaded back, and compared with the module itself at two batch sizes.

Cost on the CPU machines: the seeds' SimpleCNN takes about 35 s to compile (2 shared cores, torch 2.13,
gcc 12); most of it is the C++ compile of the generated wrapper.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from tctune.capture import MAX_BATCH
from tctune.errors import ExportError
from tctune.export.onnx import _one_line, _quiet

#: Inductor options for every package (inductor's defaults). Compiling the C++ wrapper at -O0
#: (``aot_inductor.compile_wrapper_opt_level``) did not shorten the CPU compile here, so it is not set.
INDUCTOR_CONFIGS: dict[str, Any] = {}


def export_aoti(
    module_or_exported_program: torch.nn.Module | torch.export.ExportedProgram,
    make_inputs: Callable[[int], Sequence[torch.Tensor] | torch.Tensor],
    path: str | os.PathLike,
    batch_sizes: Sequence[int] = (2, 3),
    *,
    inductor_configs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Compile ``module_or_exported_program`` into an AOTInductor ``.pt2`` with a dynamic batch and validate it.

    Args:
        module_or_exported_program: the tuned fx ``GraphModule`` (or any ``nn.Module``), re-exported here
            with ``Dim("batch")`` on dim 0 of every input; or an ``ExportedProgram`` used as it is (its
            dynamic shapes are its own).
        make_inputs: ``make_inputs(batch)`` returns fresh random inputs, batch on dim 0 (e.g.
            ``(batch, 3, 32, 32)`` float32 or ``(batch, seq)`` int64); moved to the module's device.
        path: the ``.pt2`` file to write (atomically: compiled beside it, then renamed).
        batch_sizes: batch sizes to compare the package with PyTorch at (two or more); the export example
            uses the first that is at least 2, else 2.
        inductor_configs: extra ``torch._inductor.config`` options for the compile.

    Returns:
        ``aoti`` (str path), ``aoti_device`` (``"cpu"`` or ``"cuda:0"``), ``aoti_export_s`` and
        ``aoti_compile_s`` (seconds), ``aoti_validation`` (list of ``{batch_size, max_abs_error,
        rel_l2_error}``, plus ``error`` where that batch failed), ``aoti_max_abs_error`` (float, max over
        the batches that ran, or None) and ``aoti_error`` (None or a one-line reason: a batch that failed,
        i.e. the batch axis is not dynamic in the package).

    Raises:
        ExportError: ``torch.export`` cannot re-export the module with a dynamic batch, or the AOTInductor
            compile failed (e.g. no C++ compiler on a CPU machine; nothing is written then), or loading the
            package fails or crashes a child process (the package is kept, unvalidated).
        ValueError: ``batch_sizes`` has fewer than two positive ints.
    """
    sizes = tuple(int(b) for b in batch_sizes)
    if len(sizes) < 2 or any(b < 1 for b in sizes):
        raise ValueError(f"batch_sizes must be at least two positive ints, got {batch_sizes!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    if isinstance(module_or_exported_program, torch.export.ExportedProgram):
        program = module_or_exported_program
        module = program.module()
        device = _device_of(module)
        export_s = 0.0
    else:
        module = module_or_exported_program
        device = _device_of(module)
        example = _inputs(make_inputs, next((b for b in sizes if b >= 2), 2), device)
        batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
        started = time.perf_counter()
        try:
            with _quiet():
                program = torch.export.export(module, example, dynamic_shapes=tuple({0: batch} for _ in example),
                                              strict=False)
        except Exception as exc:  # noqa: BLE001 - any export failure: the package cannot be built
            raise ExportError(f"torch.export could not re-export the model with a dynamic batch for "
                              f"AOTInductor: {_one_line(exc)}\n  fix: remove hard-coded batch sizes from "
                              "forward (use x.shape[0] or -1 in reshape/view)") from exc
        export_s = time.perf_counter() - started

    configs = {**INDUCTOR_CONFIGS, **(inductor_configs or {})}
    tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    started = time.perf_counter()
    try:
        tmp = tmpdir / path.name
        try:
            with _quiet():
                torch._inductor.aoti_compile_and_package(program, package_path=str(tmp),
                                                         inductor_configs=configs or None)
        except Exception as exc:  # noqa: BLE001 - inductor raises many types (CppCompileError, ...)
            hint = ("\n  fix: install a C++ compiler (gcc or clang) and the Python headers"
                    if device.type == "cpu" and "compil" in str(exc).lower() else "")
            raise ExportError(f"AOTInductor could not compile {path.name}: {_one_line(exc)}{hint}") from exc
        compile_s = time.perf_counter() - started
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)

    crash = _load_crashes(path)
    if crash:
        raise ExportError(f"loading {path.name} with torch._inductor.aoti_load_package crashed a test process "
                          f"({crash}; torch {torch.__version__}): the package is kept but not validated\n"
                          "  fix: use the ONNX engine, or try another torch version (seen with torch 2.11 on an H200)")
    try:
        compiled = torch._inductor.aoti_load_package(str(path))
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"AOTInductor could not load the package it just wrote ({path.name}): "
                          f"{_one_line(exc)}") from exc

    result: dict[str, Any] = {
        "aoti": str(path),
        "aoti_device": str(device) if device.type == "cpu" else f"cuda:{device.index or 0}",
        "aoti_export_s": round(export_s, 3),
        "aoti_compile_s": round(compile_s, 3),
        "aoti_validation": [],
        "aoti_max_abs_error": None,
        "aoti_error": None,
    }
    problems = []
    for batch_size in sizes:
        entry = _validate(module, compiled, make_inputs, batch_size, device)
        result["aoti_validation"].append(entry)
        if "error" in entry:
            problems.append(entry["error"])
    errors = [e["max_abs_error"] for e in result["aoti_validation"] if e["max_abs_error"] is not None]
    result["aoti_max_abs_error"] = max(errors) if errors else None
    if problems:
        result["aoti_error"] = "; ".join(dict.fromkeys(problems))
    return result


def _load_crashes(path: Path, timeout_s: float = 600.0) -> str | None:
    """Load the package once in a child process first: a loader that segfaults (seen with torch 2.11 on an
    H200) then costs a clear error, not the tuning process. Returns the reason, or None when it loaded."""
    code = "import sys, torch; torch._inductor.aoti_load_package(sys.argv[1])"
    try:
        r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"no answer after {timeout_s:.0f} s"
    if r.returncode < 0:
        return f"killed by signal {-r.returncode}"
    if r.returncode:
        return f"exit status {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1][:200]}"
    return None


def _validate(module: torch.nn.Module, compiled: Callable, make_inputs: Callable, batch: int,
              device: torch.device) -> dict[str, Any]:
    """Run PyTorch and the package on the same fresh inputs at ``batch``; compare every output leaf."""
    entry: dict[str, Any] = {"batch_size": batch, "max_abs_error": None, "rel_l2_error": None}
    inputs = _inputs(make_inputs, batch, device)
    try:
        with torch.no_grad():
            expected = [t.detach().double().cpu() for t in pytree.tree_leaves(module(*inputs))]
    except Exception as exc:  # noqa: BLE001
        entry["error"] = f"batch {batch}: the PyTorch module itself fails ({_one_line(exc)})"
        return entry
    try:
        with torch.no_grad():
            got = [t.detach().double().cpu() for t in pytree.tree_leaves(compiled(*inputs))]
    except Exception as exc:  # noqa: BLE001
        entry["error"] = f"batch {batch}: the AOTInductor package fails (batch axis not dynamic?): {_one_line(exc)}"
        return entry
    if len(got) != len(expected) or any(a.shape != b.shape for a, b in zip(got, expected)):
        entry["error"] = (f"batch {batch}: output shapes differ: package {[tuple(t.shape) for t in got]}, "
                          f"PyTorch {[tuple(t.shape) for t in expected]}")
        return entry
    ref = torch.cat([t.reshape(-1) for t in expected]) if expected else torch.zeros(0, dtype=torch.float64)
    out = torch.cat([t.reshape(-1) for t in got]) if got else torch.zeros(0, dtype=torch.float64)
    diff = (out - ref).abs()
    diff = torch.where(torch.isnan(ref) & torch.isnan(out), torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=math.inf)
    max_abs = float(diff.max()) if diff.numel() else 0.0
    entry["max_abs_error"] = max_abs
    ref_norm = float(torch.linalg.vector_norm(torch.nan_to_num(ref, nan=0.0, posinf=0.0, neginf=0.0)))
    entry["rel_l2_error"] = (float(torch.linalg.vector_norm(diff)) if math.isfinite(max_abs) else math.inf) / max(ref_norm, 1e-30)
    if not math.isfinite(max_abs):
        entry["error"] = f"batch {batch}: non-finite values differ between the package and PyTorch"
    return entry


def _inputs(make_inputs: Callable, batch: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    raw = make_inputs(batch)
    raw = (raw,) if isinstance(raw, torch.Tensor) else tuple(raw)
    return tuple(t.to(device) for t in raw)


def _device_of(module: torch.nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")
