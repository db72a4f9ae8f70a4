"""Export a (captured, pass-rewritten) module to ONNX and prove the file matches PyTorch.

Why this exists: ONNX is the hand-off format for every deployment engine tctune produces. TensorRT 10/11
builds *strongly typed* networks, so the precision chosen by the graph passes (fp16/bf16 weights, explicit
casts) must already be in the ONNX graph; this module writes that graph with a symbolic batch axis and
checks it with onnxruntime before anything downstream consumes it.

Device policy: the module is exported on the device it lives on (its inputs are moved there); the
validation runs PyTorch on that same device and onnxruntime on the CPU execution provider with CPU numpy
copies of the same inputs, so it works on the CPU-only machines and on the GPU machine alike (the
benchmark host's onnxruntime has only the CPU provider).

Exporter: ``torch.onnx.export(..., dynamo=True)`` (the torch.export-based exporter). Its progress output
and log lines are kept off stdout/stderr; the warnings it raises are returned in ``onnx_warnings``.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import math
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils import _pytree as pytree

from tctune.errors import ExportError

#: Weights above this size go to an external ``<file>.data`` next to the model: protobuf caps one file at
#: 2 GiB, and the graph itself needs room too.
EXTERNAL_DATA_BYTES = 1 << 30

#: Loggers whose INFO/WARNING lines (e.g. "torchvision is not installed. Skipping torchvision::nms") are
#: silenced while exporting.
_NOISY_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes",
                  "torch._dynamo", "onnxscript")

_MAX_WARNINGS = 10

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # torch.onnx colours its messages


def export_onnx(
    module: torch.nn.Module,
    make_inputs: Callable[[int], Sequence[torch.Tensor] | torch.Tensor],
    path: str | os.PathLike,
    *,
    batch_sizes: tuple[int, int] = (2, 3),
    opset: int | None = None,
    validate: bool = True,
) -> dict[str, Any]:
    """Export ``module`` to ONNX with a symbolic batch axis, check it, and validate it with onnxruntime.

    Every input gets dim 0 bound to one shared ``torch.export.Dim("batch")``. If the dynamo exporter
    rejects ``dynamic_shapes``, the export is retried once with ``dynamic_axes`` (``onnx_dynamic`` says
    which was used). The file is written atomically: the export goes to a temporary folder beside
    ``path`` and is moved into place with ``os.replace`` only after ``onnx.checker`` accepts it.

    The exported graph is then run by onnxruntime (CPUExecutionProvider) on fresh inputs at both batch
    sizes and compared with the module's own output (PyTorch, on the module's device). A batch axis that
    froze to a constant, an onnxruntime session that cannot be created (e.g. no bf16 kernel on the CPU
    provider) or a run that fails is recorded in ``onnx_error``; it does not raise, and the file is kept.

    Args:
        module: the model to export, in inference mode (an fx ``GraphModule`` from
            ``torch.export.export(...).module()`` after the graph passes, or any ``nn.Module``). It takes
            the user's inputs and returns a tensor, a tuple/list or a dict of tensors.
        make_inputs: ``make_inputs(batch_size)`` returns fresh random inputs, batch on dim 0 of each
            (e.g. ``(batch, 3, 32, 32)`` float32 or ``(batch, seq)`` int64).
        path: the ``.onnx`` file to write. Weights over 1 GiB go to ``<path>.data`` beside it.
        batch_sizes: two batch sizes to validate at. The export example uses the first one that is at
            least 2 (size-1 examples make torch.export specialize the axis), else 2.
        opset: ONNX opset version; ``None`` takes the exporter's default (18-20 depending on torch).
        validate: False skips the onnxruntime runs (``onnx_validation`` stays empty, ``onnx_max_abs_error``
            None); the checker and the frozen-batch check still run. For callers that rewrite the file
            before validating it (``tctune.export.onnx_fp8``).

    Returns:
        A dict: ``onnx`` (str path), ``onnx_opset`` (int), ``onnx_max_abs_error`` (float, max over the
        batch sizes that ran, or ``None`` if none ran), ``onnx_validation`` (list of ``{batch_size,
        max_abs_error, rel_l2_error}``, plus ``error`` where that batch failed), ``onnx_error`` (``None`` or
        a one-line reason), ``onnx_inputs`` / ``onnx_outputs`` (lists of ``{name, shape, dtype}``, dim 0
        shown as ``"batch"`` when symbolic, an int when it froze), ``onnx_dynamic`` (``"dynamic_shapes"``
        or ``"dynamic_axes"``), ``onnx_export_s`` (seconds) and ``onnx_warnings`` (unique warning lines
        from the exporter, at most 10).

    Raises:
        ExportError: onnxscript is missing, the module fails on its own example inputs, the exporter
            failed, or it produced a file that ``onnx.checker`` rejects; the message names the cause. Nothing is written to ``path`` then.
        ValueError: ``batch_sizes`` is not two positive ints.
    """
    import onnx

    try:
        import onnxscript  # noqa: F401 - torch.onnx's dynamo exporter is built on it
    except ImportError as exc:
        raise ExportError("torch.onnx.export(dynamo=True) needs the onnxscript package "
                          "(pip install onnxscript); ONNX export not possible") from exc
    path = Path(path)
    batch_sizes = _check_batch_sizes(batch_sizes)
    path.parent.mkdir(parents=True, exist_ok=True)
    device = _module_device(module)

    export_batch = next((b for b in batch_sizes if b >= 2), 2)
    example = _to_device(_as_tuple(make_inputs(export_batch)), device)
    input_names = _input_names(module, len(example))
    try:
        with torch.no_grad():
            sample_output = module(*example)
    except Exception as exc:  # noqa: BLE001 - nothing to export if the module cannot run its own inputs
        raise ExportError(f"the module fails on make_inputs({export_batch}) before export: "
                          f"{_one_line(exc)}") from exc
    output_names = _output_names(sample_output)

    started = time.perf_counter()
    dynamic, caught = _export_atomically(module, example, path, input_names, output_names, opset)
    if isinstance(module, torch.fx.GraphModule):  # torch.export fixed the mode at capture; train() is moot
        caught = [w for w in caught if "in training mode" not in w]
    export_s = time.perf_counter() - started

    proto = onnx.load(str(path), load_external_data=False)
    result: dict[str, Any] = {
        "onnx": str(path),
        "onnx_opset": _opset_of(proto),
        "onnx_max_abs_error": None,
        "onnx_validation": [],
        "onnx_error": None,
        "onnx_inputs": [_describe_value(v) for v in proto.graph.input],
        "onnx_outputs": [_describe_value(v) for v in proto.graph.output],
        "onnx_dynamic": dynamic,
        "onnx_export_s": round(export_s, 3),
        "onnx_warnings": caught,
    }
    del proto

    problems: list[str] = []
    frozen = [f"{v['name']}={v['shape'][0]}" for v in result["onnx_inputs"]
              if v["shape"] and isinstance(v["shape"][0], int)]
    if frozen:
        problems.append(
            "batch axis froze in the ONNX graph (dim 0 of input " + ", ".join(frozen)
            + " is a constant, not 'batch'); the graph specializes the batch size, e.g. a hard-coded "
            "reshape or a static capture")

    session, reason = _ort_session(path) if validate else (None, "")
    if validate and session is None:
        problems.append(reason)
    elif validate:
        for batch in batch_sizes:
            entry = _validate_batch(module, make_inputs, batch, device, input_names, session)
            result["onnx_validation"].append(entry)
            if "error" in entry:
                problems.append(entry["error"])
        errors = [e["max_abs_error"] for e in result["onnx_validation"] if e["max_abs_error"] is not None]
        result["onnx_max_abs_error"] = max(errors) if errors else None

    if problems:
        result["onnx_error"] = "; ".join(dict.fromkeys(problems))
    return result


# --------------------------------------------------------------------------------------------- export


def _export_atomically(module: torch.nn.Module, example: tuple[torch.Tensor, ...], path: Path,
                       input_names: list[str], output_names: list[str],
                       opset: int | None) -> tuple[str, list[str]]:
    """Export into a temporary folder beside ``path``, check the file, then move it into place."""
    import onnx

    external = _weight_bytes(module) > EXTERNAL_DATA_BYTES
    tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        tmp = tmpdir / path.name
        common = dict(input_names=input_names, output_names=output_names, opset_version=opset,
                      dynamo=True, external_data=external, verbose=False, report=False)
        batch = torch.export.Dim("batch")
        dynamic_shapes = tuple({0: batch} for _ in example)
        dynamic_axes = {name: {0: "batch"} for name in input_names}
        with _quiet() as caught:
            try:
                torch.onnx.export(module, example, str(tmp), dynamic_shapes=dynamic_shapes, **common)
                dynamic = "dynamic_shapes"
            except Exception as first:  # noqa: BLE001 - any exporter failure: retry the legacy spelling
                _clear(tmpdir)
                try:
                    torch.onnx.export(module, example, str(tmp), dynamic_axes=dynamic_axes, **common)
                    dynamic = "dynamic_axes"
                except Exception as second:  # noqa: BLE001
                    raise ExportError(
                        f"torch.onnx.export (dynamo) failed for {path.name}: {_one_line(first)}"
                        + ("" if _one_line(second) == _one_line(first)
                           else f" (retry with dynamic_axes: {_one_line(second)})")) from first
        if not tmp.exists():
            raise ExportError(f"torch.onnx.export (dynamo) wrote no file for {path.name}")
        try:
            onnx.checker.check_model(str(tmp))  # by path: works above 2 GiB and with external data
        except Exception as exc:  # noqa: BLE001 - onnx raises ValidationError and friends
            raise ExportError(f"onnx.checker rejected the exported {path.name}: {_one_line(exc)}") from exc

        publish(tmpdir, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return dynamic, caught


def publish(tmpdir: Path, path: Path) -> None:
    """Move a model written as ``tmpdir / path.name`` (and its external-data files) to ``path``: the data
    first, the model last, so a reader never sees a model without its data; a stale ``<name>.data`` from an
    earlier export that this one does not have is removed."""
    produced = {p.name for p in tmpdir.iterdir()}
    for name in sorted(produced - {path.name}):
        os.replace(tmpdir / name, path.parent / name)
    stale = path.parent / (path.name + ".data")
    if stale.name not in produced and stale.exists():
        stale.unlink()
    os.replace(tmpdir / path.name, path)


@contextlib.contextmanager
def _quiet() -> Iterator[list[str]]:
    """Silence the exporter: stdout/stderr captured, noisy loggers at ERROR, warnings recorded."""
    caught: list[str] = []
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as records, \
                contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("always")
            try:
                yield caught
            finally:
                for w in records:
                    line = f"{w.category.__name__}: {_one_line(str(w.message), 200)}"
                    if line not in caught and len(caught) < _MAX_WARNINGS:
                        caught.append(line)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _clear(folder: Path) -> None:
    for item in folder.iterdir():
        if item.is_dir():
            shutil.rmtree(item, ignore_errors=True)
        else:
            item.unlink()


# ----------------------------------------------------------------------------------------- validation


def _ort_session(path: Path, basic_optimizations: bool = False) -> tuple[Any, str]:
    """An onnxruntime CPU session for ``path``, or ``(None, reason)``.

    ``basic_optimizations``: graph optimization level ``ORT_ENABLE_BASIC`` instead of the default (all). The
    FP8 Q/DQ export needs it: onnxruntime's level-2 fusions mishandle float8 Q/DQ on the CPU provider. In
    1.32 ``ReluQuantFusion`` deletes a ``Relu`` that feeds a float8 ``QuantizeLinear`` as if float8's zero
    point 0 were the bottom of the range (uint8 logic): relative L2 error 0.29 instead of 0.01. In 1.30 the
    DQ + MatMul fusion into ``MatMulIntegerToFloat`` rejects float8 and the session is not created.
    """
    try:
        import onnxruntime as ort
    except ImportError:
        return None, "onnxruntime is not installed; ONNX validation skipped"
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    if basic_optimizations:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]), ""
    except Exception as exc:  # noqa: BLE001 - e.g. NOT_IMPLEMENTED: no bf16 kernel on the CPU provider
        return None, f"onnxruntime (CPUExecutionProvider) cannot load the model: {_one_line(exc)}"


def _validate_batch(module: torch.nn.Module, make_inputs: Callable, batch: int, device: torch.device,
                    input_names: list[str], session: Any) -> dict[str, Any]:
    """Run PyTorch and onnxruntime on the same fresh inputs at ``batch``; compare every output."""
    entry: dict[str, Any] = {"batch_size": batch, "max_abs_error": None, "rel_l2_error": None}
    inputs = _as_tuple(make_inputs(batch))
    try:
        with torch.no_grad():
            expected = [t.detach().cpu() for t in pytree.tree_leaves(module(*_to_device(inputs, device)))]
    except Exception as exc:  # noqa: BLE001 - e.g. a static capture's guard "x.size()[0] == 4"
        entry["error"] = (f"batch {batch}: the PyTorch module itself fails ({_one_line(exc)}); "
                          "its batch axis is not dynamic")
        return entry

    wanted = {i.name for i in session.get_inputs()}
    feeds = {name: _to_numpy(t) for name, t in zip(input_names, inputs) if name in wanted}
    try:
        got = session.run(None, feeds)
    except Exception as exc:  # noqa: BLE001 - ORT raises InvalidArgument/Fail/RuntimeException
        msg = _one_line(exc)
        hint = (" (the batch axis froze to a constant)"
                if re.search(r"invalid dimensions|shape|reshape|dimension", msg, re.I) else "")
        entry["error"] = f"batch {batch}: onnxruntime run failed{hint}: {msg}"
        return entry

    if len(got) != len(expected):
        entry["error"] = f"batch {batch}: onnxruntime returned {len(got)} outputs, PyTorch {len(expected)}"
        return entry
    for i, (want, have) in enumerate(zip(expected, got)):
        if tuple(want.shape) != tuple(have.shape):
            entry["error"] = (f"batch {batch}: output {i} has shape {tuple(have.shape)} in onnxruntime but "
                              f"{tuple(want.shape)} in PyTorch (the batch axis froze to a constant)")
            return entry

    ref = np.concatenate([t.to(torch.float64).reshape(-1).numpy() for t in expected]) if expected else np.zeros(0)
    out = np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in got]) if got else np.zeros(0)
    both_nan = np.isnan(ref) & np.isnan(out)
    diff = np.where(both_nan, 0.0, np.abs(out - ref))
    diff = np.where(np.isnan(diff), np.inf, diff)  # NaN in one side only, or inf - inf
    max_abs = float(diff.max()) if diff.size else 0.0
    ref_norm = float(np.linalg.norm(np.where(np.isfinite(ref), ref, 0.0)))
    err_norm = float(np.sqrt(np.sum(diff ** 2))) if math.isfinite(max_abs) else math.inf
    entry["max_abs_error"] = max_abs
    entry["rel_l2_error"] = err_norm / max(ref_norm, 1e-30)
    if not math.isfinite(max_abs):
        entry["error"] = f"batch {batch}: non-finite values differ between onnxruntime and PyTorch"
    return entry


def validate_onnx(
    module: torch.nn.Module,
    make_inputs: Callable[[int], Sequence[torch.Tensor] | torch.Tensor],
    path: str | os.PathLike,
    batch_sizes: Sequence[int],
) -> list[dict[str, Any]]:
    """Validate an existing ONNX file against ``module`` at more batch sizes (as :func:`export_onnx` does).

    Args:
        module: the module the file was exported from.
        make_inputs: ``make_inputs(batch_size)`` returns fresh random inputs, batch on dim 0.
        path: the ``.onnx`` file.
        batch_sizes: any number of positive ints.

    Returns:
        One ``{batch_size, max_abs_error, rel_l2_error}`` per batch size, plus ``error`` where it failed;
        a single ``{batch_size: None, ..., error}`` entry when onnxruntime cannot load the file.
    """
    path = Path(path)
    device = _module_device(module)
    count = len(_as_tuple(make_inputs(max(1, int(batch_sizes[0]) if batch_sizes else 1))))
    session, reason = _ort_session(path)
    if session is None:
        return [{"batch_size": None, "max_abs_error": None, "rel_l2_error": None, "error": reason}]
    names = _input_names(module, count)
    return [_validate_batch(module, make_inputs, int(b), device, names, session) for b in batch_sizes]


# ------------------------------------------------------------------------------------------- helpers


def _check_batch_sizes(batch_sizes: Sequence[int]) -> tuple[int, int]:
    sizes = tuple(batch_sizes)
    if len(sizes) != 2 or not all(isinstance(b, int) and b >= 1 for b in sizes):
        raise ValueError(f"batch_sizes must be two positive ints, got {batch_sizes!r}")
    return sizes  # type: ignore[return-value]


def _as_tuple(inputs: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    return tuple(inputs)


def _to_device(inputs: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bf16; the user's inputs are fp32/int64 by contract
        t = t.float()
    return t.numpy()


def _module_device(module: torch.nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def _weight_bytes(module: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _input_names(module: torch.nn.Module, count: int) -> list[str]:
    """Names from ``forward``'s signature ("x", "input_ids", ...), else ``input_0``, ``input_1``, ..."""
    try:
        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    if len(params) >= count:
        names = [p.name for p in params[:count]]
    else:
        names = ["input" if count == 1 else f"input_{i}" for i in range(count)]
    return _unique([_sanitize(n) for n in names])


def _output_names(output: Any) -> list[str]:
    """Dict keys for a flat dict; ``output`` for one tensor; ``output_0``, ``output_1``, ... otherwise."""
    leaves_with_paths, _ = pytree.tree_flatten_with_path(output)
    if isinstance(output, dict) and all(len(p) == 1 for p, _ in leaves_with_paths):
        names = [str(path[0].key) for path, _ in leaves_with_paths]
    elif len(leaves_with_paths) == 1 and isinstance(output, torch.Tensor):
        names = ["output"]
    else:
        names = [f"output_{i}" for i in range(len(leaves_with_paths))]
    return _unique([_sanitize(n) for n in names])


def _sanitize(name: str) -> str:
    name = re.sub(r"[^0-9A-Za-z_.]", "_", name)
    return name or "_"


def _unique(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        candidate, k = name, 1
        while candidate in out:
            candidate, k = f"{name}_{k}", k + 1
        out.append(candidate)
    return out


def _opset_of(proto: Any) -> int:
    for entry in proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return -1


_DTYPE_NAMES = {"FLOAT": "float32", "DOUBLE": "float64", "FLOAT16": "float16", "BFLOAT16": "bfloat16"}


def _describe_value(value: Any) -> dict[str, Any]:
    """``{name, shape, dtype}`` of an ONNX graph input/output; a symbolic dim 0 reads ``"batch"``."""
    import onnx

    tensor_type = value.type.tensor_type
    shape: list[Any] = []
    for i, dim in enumerate(tensor_type.shape.dim):
        if dim.HasField("dim_value"):
            shape.append(int(dim.dim_value))
        elif i == 0:
            shape.append("batch")
        else:
            shape.append(dim.dim_param or "?")
    raw = onnx.TensorProto.DataType.Name(tensor_type.elem_type)
    return {"name": value.name, "shape": shape, "dtype": _DTYPE_NAMES.get(raw, raw.lower())}


def _one_line(message: Any, limit: int = 400) -> str:
    """One line of at most ``limit`` characters; for an exception, its type and its root cause too."""
    if isinstance(message, BaseException):
        root = message
        while root.__cause__ is not None and root.__cause__ is not root:
            root = root.__cause__
        text = str(message).strip()
        if root is not message:  # torch.onnx wraps the cause in pages of advice: keep its first line only
            text = (text.splitlines() or [""])[0] + f" <- {type(root).__name__}: {root}"
        text = f"{type(message).__name__}: {text}"
    else:
        text = str(message)
    text = " ".join(_ANSI.sub("", text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
