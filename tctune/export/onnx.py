"""Export a (captured, pass-rewritten) module to ONNX and prove the file matches PyTorch.

Why this exists: ONNX is the hand-off format for every deployment engine tctune produces. TensorRT 10/11
builds *strongly typed* networks, so the precision chosen by the graph passes (fp16/bf16 weights, explicit
casts) must already be in the ONNX graph; this module writes that graph with a symbolic batch axis and
checks it with onnxruntime before anything downstream consumes it.

Device policy: the module is exported on the device it lives on (its inputs are moved there); the
validation runs PyTorch on that same device and onnxruntime with CPU numpy copies of the same inputs, on
the CUDA execution provider where ``onnxruntime-gpu`` is installed and torch sees a GPU, else on the CPU
execution provider (``onnx_provider`` says which ran).

Validity: a file is exported only when ``onnx.checker.check_model(full_check=True)`` (type and shape
inference) accepts it. A typed graph that is invalid at the requested opset (seen: a bfloat16 ``Conv`` at
opset 20; ONNX allows bfloat16 ``Conv`` from opset 22) is re-exported at the lowest opset whose operator
schemas accept its dtypes; where none does, :class:`InvalidOnnxError` is raised and nothing is written.
"Invalid ONNX" is kept apart from "this onnxruntime provider has no kernel for this dtype" (``onnx_load``):
the second file is valid (e.g. for TensorRT), and :func:`export_onnx_deployable` then writes the FP32 twin
and says which file to deploy on which runtime.

onnxruntime is optional (``pip install 'tctune[onnx]'`` or ``'tctune[onnx-gpu]'``; the two wheels cannot be
installed side by side): without it the file is still exported and checked, and ``onnx_validation_skipped``
says that the onnxruntime runs were skipped and how to install it.

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

from tctune.errors import ExportError, clip

#: Weights above this size go to an external ``<file>.data`` next to the model: protobuf caps one file at
#: 2 GiB, and the graph itself needs room too.
EXTERNAL_DATA_BYTES = 1 << 30

#: Loggers whose INFO/WARNING lines (e.g. "torchvision is not installed. Skipping torchvision::nms") are
#: silenced while exporting.
_NOISY_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes",
                  "torch._dynamo", "onnxscript")

_MAX_WARNINGS = 10

_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # torch.onnx colours its messages

#: The one line a result carries when onnxruntime cannot be imported.
ORT_MISSING = ("onnxruntime is not installed: ONNX validation skipped (fix: pip install 'tctune[onnx]', or "
               "'tctune[onnx-gpu]' for the CUDA execution provider)")

#: Mode bits of every file tctune publishes (ONNX, external data, manifests, engines); ``runner.py`` gets 0o755.
ARTIFACT_MODE = 0o644


class InvalidOnnxError(ExportError):
    """The exporter's graph is not valid ONNX (``onnx.checker`` with ``full_check`` rejects it) at every opset
    tried, e.g. a dtype an operator's schema does not accept. Nothing is written to the target path."""


def load_onnxruntime() -> Any:
    """``import onnxruntime`` (the ``onnxruntime`` or ``onnxruntime-gpu`` wheel: both install this module).

    The single place tctune imports it for validation, so that a missing install is one clear line
    (:data:`ORT_MISSING`) and tests can simulate it.

    Raises:
        ImportError: neither wheel is installed (or the install is broken).
    """
    import onnxruntime

    return onnxruntime


def ort_providers(ort: Any) -> list[str]:
    """Execution providers to validate with: ``["CUDAExecutionProvider", "CPUExecutionProvider"]`` where the
    installed onnxruntime has the CUDA provider (``onnxruntime-gpu``) and torch sees a GPU, else the CPU one."""
    available = list(ort.get_available_providers())
    if "CUDAExecutionProvider" in available and torch.cuda.is_available():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def export_onnx(
    module: torch.nn.Module,
    make_inputs: Callable[[int], Sequence[torch.Tensor] | torch.Tensor],
    path: str | os.PathLike,
    *,
    batch_sizes: tuple[int, int] = (2, 3),
    opset: int | None = None,
    validate: bool = True,
    dynamic: Sequence[dict] | None = None,
) -> dict[str, Any]:
    """Export ``module`` to ONNX with a symbolic batch axis, check it, and validate it with onnxruntime.

    Every input gets dim 0 bound to one shared ``torch.export.Dim("batch")``; with ``dynamic`` (or a graph
    from ``tctune.capture.capture``, which records its dynamic dimensions in ``module.meta``), only the batched
    inputs get it, and the model's other dynamic dimensions (sequence length, image size) become symbolic ONNX
    axes named after their ``Dim``, validated at the example size and at a second size (inputs cut or tiled
    along that dimension, ``tctune.capture.resize_inputs``). If the dynamo exporter
    rejects ``dynamic_shapes``, the export is retried once with ``dynamic_axes`` (``onnx_dynamic`` says
    which was used). The file is written atomically: the export goes to a temporary folder beside
    ``path`` and is moved into place with ``os.replace`` (mode 0o644) only after ``onnx.checker`` with
    ``full_check=True`` accepts it. When the checker rejects an operator's input dtype at the opset
    written (e.g. bfloat16 ``Conv`` below opset 22), the graph is re-exported at the lowest opset whose
    schemas accept every such dtype (``onnx_opset_reason`` says why); if no opset up to the newest one the
    installed ``onnx`` knows does, or the exporter cannot write it, :class:`InvalidOnnxError` is raised.

    Output names: a single tensor is ``output``; dict (and ``ModelOutput``-like) outputs keep their keys in
    the flattened order, nested keys joined with ``.`` (``{"a": x, "cache": {"k": k}}`` -> ``a``,
    ``cache.k``); sequence positions are ``output_0``, ``output_1``, ... at the top level and ``.0``,
    ``.1`` below it.

    The exported graph is then run by onnxruntime (see :func:`ort_providers` for the provider) on fresh
    inputs at both batch sizes and compared with the module's own output (PyTorch, on the module's device).
    A batch axis that froze to a constant, an onnxruntime session that cannot be created or a run that
    fails is recorded in ``onnx_error``; it does not raise, and the file is kept. Without onnxruntime the
    runs are skipped (``onnx_validation_skipped``, not an error).

    Args:
        module: the model to export, in inference mode (an fx ``GraphModule`` from
            ``torch.export.export(...).module()`` after the graph passes, or any ``nn.Module``). It takes
            the user's inputs and returns a tensor, or a (nested) tuple/list/dict of tensors.
        make_inputs: ``make_inputs(batch_size)`` returns fresh random inputs, batch on dim 0 of each
            (e.g. ``(batch, 3, 32, 32)`` float32 or ``(batch, seq)`` int64).
        path: the ``.onnx`` file to write. Weights over 1 GiB go to ``<path>.data`` beside it.
        batch_sizes: two batch sizes to validate at. The export example uses the first one that is at
            least 2 (size-1 examples make torch.export specialize the axis), else 2. Each validation holds
            several host copies of the outputs at that size: :func:`plan_validation` picks sizes that fit.
        opset: the lowest ONNX opset to write; ``None`` takes the exporter's default (18-20 depending on
            torch). Raised automatically where the typed graph needs a newer one (see above).
        validate: False skips the onnxruntime runs (``onnx_validation`` stays empty, ``onnx_max_abs_error``
            and ``onnx_load`` None); the checker and the frozen-batch check still run. For callers that
            rewrite the file before validating it (``tctune.export.onnx_fp8``).
        dynamic: the dynamic input dimensions (``tctune.capture.dynamic_dims``: ``{input, dim, symbol, min,
            max, example}`` each); None: read them from ``module.meta`` where the capture recorded them,
            else dim 0 of every input is the batch and nothing else is dynamic.

    Returns:
        A dict: ``onnx`` (str path), ``onnx_opset`` (int), ``onnx_opset_reason`` (``None``, or why the opset
        was raised, e.g. ``"opset 20 -> 22: Conv accepts tensor(bfloat16) from opset 22"``),
        ``onnx_max_abs_error`` (float, max over the batch sizes that ran, or ``None`` if none ran),
        ``onnx_validation`` (list of ``{batch_size, max_abs_error, rel_l2_error}``, plus ``error`` where
        that batch failed; entries for another size of a dynamic dimension carry ``sizes``, e.g.
        ``{"seq": 5}``), ``onnx_error`` (``None`` or a one-line reason), ``onnx_load`` (``"ok"``;
        ``"no_kernel"``: valid ONNX, but the provider has no kernel for an op at its dtype;
        ``"invalid"``: onnxruntime calls the graph invalid; ``"failed"``: another load error;
        ``"skipped"``: onnxruntime is not installed; ``None`` when ``validate`` is False),
        ``onnx_provider`` (the execution provider that loaded it, e.g. ``"CPUExecutionProvider"``, or
        ``None``), ``onnx_validation_skipped`` (``None`` or :data:`ORT_MISSING`, also put in ``onnx_note``),
        ``onnx_inputs`` / ``onnx_outputs`` (lists of ``{name, shape, dtype}``, dim 0 shown as ``"batch"``
        when symbolic, an int when it froze; an input's other dynamic dimensions by their symbol, e.g.
        ``"seq"``), ``onnx_dynamic_dims`` (the ``dynamic`` entries used, ``[]`` when only the batch is
        dynamic the default way), ``onnx_dynamic`` (``"dynamic_shapes"`` or
        ``"dynamic_axes"``), ``onnx_export_s`` (seconds) and ``onnx_warnings`` (unique warning lines from
        the exporter, at most 10).

    Raises:
        InvalidOnnxError: ``onnx.checker`` (full check) rejects the exported graph at every opset tried.
        ExportError: onnxscript is missing, the module fails on its own example inputs, or the exporter
            failed; the message names the cause. Nothing is written to ``path`` then.
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
    output_names = _output_names(sample_output, taken=input_names)
    if dynamic is None and isinstance(module, torch.fx.GraphModule) and "tctune_dynamic" in module.meta:
        from ..capture import dynamic_dims

        dynamic = dynamic_dims(module)
    dynamic = [dict(d) for d in dynamic] if dynamic is not None else None
    specs = _dynamic_specs(dynamic, len(example))

    started = time.perf_counter()
    mode, caught, opset_reason = _export_atomically(module, example, path, input_names, output_names, opset,
                                                    specs)
    if isinstance(module, torch.fx.GraphModule):  # torch.export fixed the mode at capture; train() is moot
        caught = [w for w in caught if "in training mode" not in w]
    export_s = time.perf_counter() - started

    proto = onnx.load(str(path), load_external_data=False)
    result: dict[str, Any] = {
        "onnx": str(path),
        "onnx_opset": _opset_of(proto),
        "onnx_opset_reason": opset_reason,
        "onnx_max_abs_error": None,
        "onnx_validation": [],
        "onnx_error": None,
        "onnx_load": None,
        "onnx_provider": None,
        "onnx_validation_skipped": None,
        "onnx_inputs": [_describe_value(v) for v in proto.graph.input],
        "onnx_outputs": [_describe_value(v) for v in proto.graph.output],
        "onnx_dynamic": mode,
        "onnx_dynamic_dims": dynamic or [],
        "onnx_export_s": round(export_s, 3),
        "onnx_warnings": caught,
    }
    del proto

    problems: list[str] = []
    batched = _batched_from(dynamic, len(example))
    frozen = [f"{v['name']}={v['shape'][0]}" for i, v in enumerate(result["onnx_inputs"])
              if v["shape"] and isinstance(v["shape"][0], int) and (i >= len(batched) or batched[i])]
    for i, v in enumerate(result["onnx_inputs"]):
        if v["shape"] and i < len(batched) and not batched[i] and v["shape"][0] == "batch":
            v["shape"][0] = "?"
    for d in dynamic or []:
        if d["input"] >= len(result["onnx_inputs"]) or d["symbol"] == "batch":
            continue
        entry = result["onnx_inputs"][d["input"]]
        if d["dim"] < len(entry["shape"]):
            if isinstance(entry["shape"][d["dim"]], int):
                problems.append(f"dynamic dimension {d['symbol']} froze in the ONNX graph (dim {d['dim']} of input "
                                f"{entry['name']} is {entry['shape'][d['dim']]})")
            else:
                entry["shape"][d["dim"]] = d["symbol"]
    if frozen:
        problems.append(
            "batch axis froze in the ONNX graph (dim 0 of input " + ", ".join(frozen)
            + " is a constant, not 'batch'); the graph specializes the batch size, e.g. a hard-coded "
            "reshape or a static capture")

    if validate:
        load = ort_load(path)
        result["onnx_load"], result["onnx_provider"] = load["status"], load["provider"]
        if load["status"] == "skipped":
            result["onnx_validation_skipped"] = result["onnx_note"] = load["reason"]
        elif load["session"] is None:
            problems.append(load["reason"])
        else:
            for batch in batch_sizes:
                entry = _validate_batch(module, make_inputs, batch, device, input_names, load["session"])
                result["onnx_validation"].append(entry)
                if "error" in entry:
                    problems.append(entry["error"])
            for symbol, size in _other_sizes(dynamic).items():
                from ..capture import resize_inputs

                def resized(b: int, _s: dict = {symbol: size}) -> tuple:
                    return resize_inputs(_as_tuple(make_inputs(b)), dynamic, _s)

                entry = _validate_batch(module, resized, batch_sizes[0], device, input_names, load["session"])
                entry["sizes"] = {symbol: size}
                result["onnx_validation"].append(entry)
                if "error" in entry:
                    problems.append(f"{symbol}={size}: {entry['error']}")
            errors = [e["max_abs_error"] for e in result["onnx_validation"] if e["max_abs_error"] is not None]
            result["onnx_max_abs_error"] = max(errors) if errors else None
        del load

    if problems:
        result["onnx_error"] = "; ".join(dict.fromkeys(problems))
    return result


def export_onnx_deployable(
    module: torch.nn.Module,
    make_inputs: Callable[[int], Sequence[torch.Tensor] | torch.Tensor],
    path: str | os.PathLike,
    *,
    fp32_module: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
    batch_sizes: tuple[int, int] = (2, 3),
    opset: int | None = None,
) -> dict[str, Any]:
    """:func:`export_onnx` for a typed (fp16/bf16) graph, plus an FP32 twin where the typed file cannot run.

    The typed graph goes to ``path``. When it is invalid ONNX at every opset (:class:`InvalidOnnxError`:
    nothing is written to ``path``, ``onnx`` is None and ``onnx_error`` starts with ``"not exported:"``), or
    is valid but onnxruntime cannot load it on the provider it was validated on (``onnx_load`` is
    ``"no_kernel"`` or ``"invalid"``), ``fp32_module`` is exported and validated as
    ``<stem>.fp32.onnx`` beside it. :func:`deployment` then says which file to deploy on which runtime.

    Args:
        module: the graph at its tuned precision (see :func:`export_onnx`).
        make_inputs: ``make_inputs(batch_size)`` returns fresh random inputs, batch on dim 0.
        path: the ``.onnx`` file for the typed graph (e.g. ``out/model.onnx``).
        fp32_module: the same graph at FP32 (same inputs and outputs), or a zero-argument callable that
            builds it (called only when the twin is needed); None: no twin.
        batch_sizes: two batch sizes to validate at (both files).
        opset: the lowest opset to write (see :func:`export_onnx`).

    Returns:
        :func:`export_onnx`'s dict for the typed file (when it was not written: ``onnx`` None,
        ``onnx_invalid`` the :class:`InvalidOnnxError` message, and ``onnx_inputs`` / ``onnx_outputs`` taken
        from the twin), plus ``onnx_fp32`` (str path or None), ``onnx_fp32_max_abs_error`` (float or None),
        ``onnx_fp32_error`` (None or one line), ``onnx_fp32_validation`` (list, as ``onnx_validation``),
        ``onnx_fp32_load`` / ``onnx_fp32_provider`` (as ``onnx_load`` / ``onnx_provider``, when the twin was
        exported), and :func:`deployment`'s ``deploy`` and ``deploy_reason``. No twin is written when
        onnxruntime is not installed (nothing to decide with) or the typed file ran.

    Raises:
        ExportError: the typed export failed for another reason than invalid ONNX (see :func:`export_onnx`).
        ValueError: ``batch_sizes`` is not two positive ints.
    """
    path = Path(path)
    try:
        info = export_onnx(module, make_inputs, path, batch_sizes=batch_sizes, opset=opset)
    except InvalidOnnxError as exc:
        info = {"onnx": None, "onnx_max_abs_error": None, "onnx_validation": [], "onnx_load": None,
                "onnx_provider": None, "onnx_error": f"not exported: {exc}", "onnx_invalid": str(exc)}
    info.update(onnx_fp32=None, onnx_fp32_max_abs_error=None, onnx_fp32_error=None, onnx_fp32_validation=[])
    needs_twin = info.get("onnx") is None or info.get("onnx_load") in ("no_kernel", "invalid")
    if needs_twin and fp32_module is not None:
        twin = path.with_name(path.stem + ".fp32.onnx")
        try:
            graph = fp32_module if isinstance(fp32_module, torch.nn.Module) else fp32_module()
            info32 = export_onnx(graph, make_inputs, twin, batch_sizes=batch_sizes, opset=opset)
            info.update(onnx_fp32=info32["onnx"], onnx_fp32_max_abs_error=info32["onnx_max_abs_error"],
                        onnx_fp32_error=info32["onnx_error"], onnx_fp32_validation=info32["onnx_validation"],
                        onnx_fp32_load=info32["onnx_load"], onnx_fp32_provider=info32["onnx_provider"])
            if info.get("onnx_inputs") is None:  # the typed file was not written: describe the one that was
                info.update(onnx_inputs=info32["onnx_inputs"], onnx_outputs=info32["onnx_outputs"])
        except ExportError as exc:
            info["onnx_fp32_error"] = str(exc)
    info.update(deployment(info))
    return info


def deployment(info: dict[str, Any]) -> dict[str, Any]:
    """Which ONNX file to deploy on which runtime, from an export result.

    Args:
        info: the dict of :func:`export_onnx`, :func:`export_onnx_deployable` or
            ``tctune.export.onnx_fp8.export_onnx_fp8`` (its ``onnx_fp8.validated_on`` is read).

    Returns:
        ``{"deploy": {runtime: file name}, "deploy_reason": str}``. Runtimes: ``"tensorrt"`` (strongly typed:
        the typed file whenever it is valid ONNX; TensorRT itself is not run here), and
        ``"onnxruntime-cpu"`` or ``"onnxruntime-cuda"`` for the provider the validation ran on: the file
        that loaded there and matched PyTorch. A runtime is left out where no file qualifies (e.g. no
        onnxruntime installed); ``deploy_reason`` says why, in one line. File names are relative to the
        folder of the files (``"model.onnx"``, ``"model.fp32.onnx"``).
    """
    typed, twin = info.get("onnx"), info.get("onnx_fp32")
    typed_name = Path(typed).name if typed else None
    twin_name = Path(twin).name if twin else None
    fp8 = info.get("onnx_fp8") or {}
    deploy: dict[str, str] = {}
    reasons: list[str] = []

    def runtime_key(provider: str | None) -> str:
        return "onnxruntime-cuda" if provider == "CUDAExecutionProvider" else "onnxruntime-cpu"

    if typed_name:
        deploy["tensorrt"] = typed_name
    if fp8:  # export_onnx_fp8: validated on the file itself or on its FP32 twin with the same Q/DQ
        ok = not info.get("onnx_error")
        if fp8.get("validated_on") == "model" and ok:
            deploy["onnxruntime-cpu"] = typed_name
            reasons.append(f"{typed_name} ran in onnxruntime and matched the PyTorch graph")
        elif fp8.get("validated_on") == "fp32 twin" and twin_name and ok:
            deploy["onnxruntime-cpu"] = twin_name
            reasons.append(f"onnxruntime cannot run {typed_name}; {twin_name} (same Q/DQ in FP32) ran and matched")
        else:
            why = info.get("onnx_error") or info.get("onnx_validation_skipped") or "not run"
            reasons.append(f"no ONNX file was validated in onnxruntime ({why})")
        return {"deploy": deploy, "deploy_reason": "; ".join(reasons)}

    load = info.get("onnx_load")
    runtime = runtime_key(info.get("onnx_provider"))
    typed_ran = typed_name and load == "ok" and not info.get("onnx_error")
    if not typed_name:
        reasons.append(info.get("onnx_error") or "the typed graph was not exported")
    elif load == "skipped":
        reasons.append(f"{typed_name} is valid ONNX (onnx.checker full_check) but was not run: "
                       f"{info.get('onnx_validation_skipped') or ORT_MISSING}")
    elif typed_ran:
        deploy[runtime] = typed_name
        err = info.get("onnx_max_abs_error")
        reasons.append(f"{typed_name} is valid ONNX and ran in onnxruntime ({info.get('onnx_provider')})"
                       + (f" within max abs error {err:.2e} of PyTorch" if err is not None else ""))
    elif load in ("no_kernel", "invalid"):
        reasons.append(f"{typed_name} is valid ONNX (onnx.checker full_check) for TensorRT, but "
                       f"{info.get('onnx_error')}")
    else:
        reasons.append(f"{typed_name}: {info.get('onnx_error') or 'not validated'}")

    twin_ran = (twin_name and info.get("onnx_fp32_load") == "ok" and not info.get("onnx_fp32_error"))
    if twin_ran and not typed_ran:
        deploy[runtime_key(info.get("onnx_fp32_provider"))] = twin_name
        if not typed_name:
            deploy["tensorrt"] = twin_name  # FP32: the typed graph had no valid ONNX form
        err = info.get("onnx_fp32_max_abs_error")
        reasons.append(f"{twin_name} (the same graph in FP32) ran in onnxruntime ({info.get('onnx_fp32_provider')})"
                       + (f" within max abs error {err:.2e} of PyTorch" if err is not None else ""))
    elif twin_name and not typed_ran:
        reasons.append(f"{twin_name}: {info.get('onnx_fp32_error') or 'not validated'}")
    return {"deploy": deploy, "deploy_reason": "; ".join(reasons)}


# --------------------------------------------------------------------------------------------- export


def _dynamic_specs(dynamic: Sequence[dict] | None, count: int) -> list[dict[int, str]] | None:
    """One ``{dim: symbol}`` per input from ``dynamic`` entries; None: dim 0 of every input is the batch."""
    if dynamic is None:
        return None
    specs: list[dict[int, str]] = [{} for _ in range(count)]
    for d in dynamic:
        if d["input"] < count:
            specs[d["input"]][int(d["dim"])] = str(d["symbol"])
    return specs


def _batched_from(dynamic: Sequence[dict] | None, count: int) -> list[bool]:
    if dynamic is None:
        return [True] * count
    return [any(d["input"] == i and d["dim"] == 0 and d["symbol"] == "batch" for d in dynamic) for i in range(count)]


def _other_sizes(dynamic: Sequence[dict] | None) -> dict[str, int]:
    if not dynamic:
        return {}
    from ..capture import validation_sizes

    return validation_sizes(dynamic)


def _torch_dims(dynamic_specs: list[dict[int, str]] | None, count: int,
                ranges: dict[str, tuple[int, int | None]] | None = None) -> tuple:
    """``dynamic_shapes`` for ``torch.onnx.export``: one ``torch.export.Dim`` per symbol, shared."""
    if dynamic_specs is None:
        batch = torch.export.Dim("batch")
        return tuple({0: batch} for _ in range(count))
    made: dict[str, Any] = {}
    out = []
    for spec in dynamic_specs:
        entry = {}
        for dim, sym in spec.items():
            if sym not in made:
                lo, hi = (ranges or {}).get(sym, (None, None))
                kwargs = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
                made[sym] = torch.export.Dim(re.sub(r"\W", "_", sym), **kwargs)
            entry[dim] = made[sym]
        out.append(entry or None)
    return tuple(out)


def _export_atomically(module: torch.nn.Module, example: tuple[torch.Tensor, ...], path: Path,
                       input_names: list[str], output_names: list[str],
                       opset: int | None, specs: list[dict[int, str]] | None = None) -> tuple[str, list[str], str | None]:
    """Export into a temporary folder beside ``path``, check the file (full check), then move it into place.

    Returns ``(dynamic, warnings, opset_reason)``; raises InvalidOnnxError when no opset gives a valid file.
    """
    import onnx

    external = _weight_bytes(module) > EXTERNAL_DATA_BYTES
    tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    opset_reason = None
    try:
        tmp = tmpdir / path.name
        dynamic, caught = _export_once(module, example, tmp, path, input_names, output_names, opset, external,
                                       specs)
        tried: list[int] = []
        while True:
            try:
                onnx.checker.check_model(str(tmp), full_check=True)  # by path: works above 2 GiB / external data
                break
            except Exception as exc:  # noqa: BLE001 - onnx raises ValidationError / InferenceError
                rejected = _one_line(exc)
            proto = onnx.load(str(tmp), load_external_data=False)
            current = _opset_of(proto)
            tried.append(current)
            needed, why, impossible = _needed_opset(proto, current)
            del proto
            base = (f"{path.name} is not valid ONNX: onnx.checker (full_check) rejects the exported graph at "
                    f"opset {current} ({rejected})")
            if impossible:
                raise InvalidOnnxError(f"{base}; no opset up to {onnx.defs.onnx_opset_version()} accepts "
                                       + "; ".join(impossible))
            if needed is None or needed in tried or len(tried) > 3:
                raise InvalidOnnxError(base)
            _clear(tmpdir)
            try:
                dynamic, more = _export_once(module, example, tmp, path, input_names, output_names, needed, external,
                                             specs)
            except ExportError as exc:
                raise InvalidOnnxError(f"{base}; {'; '.join(why)}, and torch.onnx could not write opset {needed}: "
                                       f"{exc}") from exc
            caught += [w for w in more if w not in caught]
            opset_reason = f"opset {tried[0]} -> {needed}: " + "; ".join(why)
        publish(tmpdir, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return dynamic, caught, opset_reason


def _export_once(module: torch.nn.Module, example: tuple[torch.Tensor, ...], tmp: Path, path: Path,
                 input_names: list[str], output_names: list[str], opset: int | None,
                 external: bool, specs: list[dict[int, str]] | None = None) -> tuple[str, list[str]]:
    """One ``torch.onnx.export`` to ``tmp`` (``dynamic_shapes``, else ``dynamic_axes``); ExportError on failure.
    ``specs``: one ``{dim: symbol}`` per input (:func:`_dynamic_specs`); None: dim 0 of every input is the batch."""
    common = dict(input_names=input_names, output_names=output_names, opset_version=opset,
                  dynamo=True, external_data=external, verbose=False, report=False)
    dynamic_shapes = _torch_dims(specs, len(example))
    if specs is None:
        dynamic_axes = {name: {0: "batch"} for name in input_names}
    else:
        dynamic_axes = {name: dict(spec) for name, spec in zip(input_names, specs) if spec}
    with _quiet() as caught:
        try:
            torch.onnx.export(module, example, str(tmp), dynamic_shapes=dynamic_shapes, **common)
            dynamic = "dynamic_shapes"
        except Exception as first:  # noqa: BLE001 - any exporter failure: retry the legacy spelling
            _clear(tmp.parent)
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
    return dynamic, caught


def _needed_opset(proto: Any, current: int) -> tuple[int | None, list[str], list[str]]:
    """The lowest opset above ``current`` whose schemas accept every node's input dtypes.

    Input dtypes come from the graph's inputs, initializers and ``value_info`` (the dynamo exporter writes
    them); nodes of other domains and inputs of unknown type are not judged. Returns ``(opset or None,
    reasons, impossible)``: ``reasons`` like ``"Conv accepts tensor(bfloat16) from opset 22"``,
    ``impossible`` for nodes no opset up to ``onnx.defs.onnx_opset_version()`` accepts.
    """
    import onnx

    highest = onnx.defs.onnx_opset_version()
    types: dict[str, int] = {}
    for value in [*proto.graph.input, *proto.graph.value_info, *proto.graph.output]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    for init in proto.graph.initializer:
        types[init.name] = init.data_type
    needed: int | None = None
    reasons: dict[str, str] = {}
    impossible: dict[str, str] = {}
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        bad = _rejected_dtypes(node, types, current)
        if not bad:
            continue
        label = f"{node.op_type} ({', '.join(bad)})"
        for version in range(current + 1, highest + 1):
            if not _rejected_dtypes(node, types, version):
                needed = max(needed or version, version)
                reasons.setdefault(label, f"{node.op_type} accepts {', '.join(bad)} from opset {version}")
                break
        else:
            impossible.setdefault(label, f"{node.op_type} with {', '.join(bad)}")
    return needed, list(reasons.values()), list(impossible.values())


def _rejected_dtypes(node: Any, types: dict[str, int], version: int) -> list[str]:
    """Input types (``"tensor(bfloat16)"``) of ``node`` that its schema at opset ``version`` does not allow."""
    import onnx

    try:
        schema = onnx.defs.get_schema(node.op_type, version, "")
    except Exception:  # noqa: BLE001 - SchemaError: the op does not exist at this opset
        return ["(no such operator)"]
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    formals = list(schema.inputs)
    bad: list[str] = []
    for i, name in enumerate(node.input):
        if not name or name not in types or not formals:
            continue
        if i < len(formals):
            formal = formals[i]
        elif formals[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
            formal = formals[-1]
        else:
            continue
        type_str = f"tensor({onnx.TensorProto.DataType.Name(types[name]).lower()})"
        accepted = allowed.get(formal.type_str, {formal.type_str})
        if type_str not in accepted and type_str not in bad:
            bad.append(type_str)
    return bad


def publish(tmpdir: Path, path: Path) -> None:
    """Move a model written as ``tmpdir / path.name`` (and its external-data files) to ``path``: the data
    first, the model last, so a reader never sees a model without its data; a stale ``<name>.data`` from an
    earlier export that this one does not have is removed. Every file moved gets mode 0o644
    (:data:`ARTIFACT_MODE`), readable by other users as the other artifacts are."""
    produced = {p.name for p in tmpdir.iterdir()}
    for name in sorted(produced - {path.name}):
        os.chmod(tmpdir / name, ARTIFACT_MODE)
        os.replace(tmpdir / name, path.parent / name)
    stale = path.parent / (path.name + ".data")
    if stale.name not in produced and stale.exists():
        stale.unlink()
    os.chmod(tmpdir / path.name, ARTIFACT_MODE)
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


def ort_load(path: str | os.PathLike, basic_optimizations: bool = False) -> dict[str, Any]:
    """Create an onnxruntime session for ``path`` and classify what happened.

    Args:
        path: an ``.onnx`` file.
        basic_optimizations: graph optimization level ``ORT_ENABLE_BASIC`` instead of the default (all). The
            FP8 Q/DQ export needs it: onnxruntime's level-2 fusions mishandle float8 Q/DQ on the CPU provider.
            In 1.32 ``ReluQuantFusion`` deletes a ``Relu`` that feeds a float8 ``QuantizeLinear`` as if
            float8's zero point 0 were the bottom of the range (uint8 logic): relative L2 error 0.29 instead
            of 0.01. In 1.30 the DQ + MatMul fusion into ``MatMulIntegerToFloat`` rejects float8 and the
            session is not created.

    Returns:
        ``{"session", "status", "provider", "reason"}``: ``status`` ``"ok"`` (``session`` set, ``provider``
        the first provider it got, ``reason`` ""), ``"skipped"`` (onnxruntime not importable, ``reason``
        :data:`ORT_MISSING`), ``"no_kernel"`` (onnxruntime's NOT_IMPLEMENTED: the provider has no kernel
        for an op at its dtype, e.g. "Could not find an implementation for Conv(22)"), ``"invalid"``
        (INVALID_GRAPH / INVALID_PROTOBUF: onnxruntime's own type check rejects the model) or ``"failed"``
        (anything else); ``reason`` is one line that contains "cannot load the model" for the last three.
    """
    try:
        ort = load_onnxruntime()
    except ImportError:
        return {"session": None, "status": "skipped", "provider": None, "reason": ORT_MISSING}
    except Exception as exc:  # noqa: BLE001 - a broken install (missing CUDA libraries...) also means "skip"
        return {"session": None, "status": "skipped", "provider": None,
                "reason": f"onnxruntime failed to import ({_one_line(exc, 200)}): ONNX validation skipped "
                          "(fix: pip install 'tctune[onnx]' or 'tctune[onnx-gpu]', not both)"}
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    if basic_optimizations:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    providers = ort_providers(ort)
    try:
        session = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as exc:  # noqa: BLE001 - pybind11 classes NotImplemented, InvalidGraph, Fail, ...
        kind, text = type(exc).__name__, str(exc)
        detail = _one_line(text.split(" : ")[-1] if "[ONNXRuntimeError]" in text else exc, 300)
        where = f"onnxruntime ({providers[0]}) cannot load the model"
        if kind == "NotImplemented" or "NOT_IMPLEMENTED" in text:
            status, why = "no_kernel", f"{where}: the provider has no kernel for an op at its dtype"
        elif kind in ("InvalidGraph", "InvalidProtobuf") or "INVALID_GRAPH" in text or "INVALID_PROTOBUF" in text:
            status, why = "invalid", f"{where}: it rejects the graph as invalid"
        else:
            status, why = "failed", where
        return {"session": None, "status": status, "provider": providers[0], "reason": f"{why} ({detail})"}
    return {"session": session, "status": "ok", "provider": session.get_providers()[0], "reason": ""}


def _ort_session(path: Path, basic_optimizations: bool = False) -> tuple[Any, str]:
    """An onnxruntime session for ``path``, or ``(None, reason)``; see :func:`ort_load`."""
    load = ort_load(path, basic_optimizations)
    return load["session"], load["reason"]


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
        a single ``{batch_size: None, ..., error}`` entry when onnxruntime cannot load the file, and a single
        ``{batch_size: None, ..., skipped: ORT_MISSING}`` entry (no ``error``) when onnxruntime is not
        installed.
    """
    path = Path(path)
    device = _module_device(module)
    count = len(_as_tuple(make_inputs(max(1, int(batch_sizes[0]) if batch_sizes else 1))))
    load = ort_load(path)
    session = load["session"]
    if session is None:
        outcome = "skipped" if load["status"] == "skipped" else "error"
        return [{"batch_size": None, "max_abs_error": None, "rel_l2_error": None, outcome: load["reason"]}]
    names = _input_names(module, count)
    return [_validate_batch(module, make_inputs, int(b), device, names, session) for b in batch_sizes]


#: The largest reference outputs (bytes, counted at 4 bytes an element at least) one validation batch may have
#: whatever the memory: a validation run holds about ten copies of them on the host (PyTorch's outputs, onnxruntime's,
#: float64 copies of both and their difference) beside onnxruntime's own activations.
VALIDATION_OUTPUT_CAP = 2 << 30
#: ... and at most this fraction of the host memory available when the validation is planned (the same ten copies,
#: and onnxruntime's arena, with room to spare).
VALIDATION_MEMORY_FRACTION = 1 / 16
#: The small batch sizes a skipped batch is replaced with, in this order, so that two distinct batch sizes (the
#: symbolic batch axis) are still validated.
SMALL_VALIDATION_BATCHES = (1, 3, 2, 5)


def host_memory_available() -> int | None:
    """Bytes of host memory available now: ``psutil.virtual_memory().available`` where psutil is installed,
    else ``os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")`` (free pages, without the page cache: lower,
    so safer), else None (the platform has neither)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - not installed, or no reading on this platform
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def validation_output_limit() -> tuple[int, str]:
    """The largest reference outputs (bytes) one validation batch may have, and what set it: the smaller of
    :data:`VALIDATION_OUTPUT_CAP` and :data:`VALIDATION_MEMORY_FRACTION` of :func:`host_memory_available`."""
    cap = int(VALIDATION_OUTPUT_CAP)
    available = host_memory_available()
    if available is not None and available * VALIDATION_MEMORY_FRACTION < cap:
        return int(available * VALIDATION_MEMORY_FRACTION), (
            f"1/{round(1 / VALIDATION_MEMORY_FRACTION)} of the {_gb(available)} of host memory available")
    return cap, "the fixed cap for one validation batch"


def output_nbytes(outputs: Any) -> int:
    """Bytes of every tensor leaf of ``outputs``, an element counted at ``max(element_size, 4)`` (the comparison
    works in wider types than fp16/bf16/fp8)."""
    return sum(t.numel() * max(t.element_size(), 4) for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor))


def plan_validation(wanted: Sequence[int], bytes_per_item: float | None,
                    limit: int | None = None, smallest: int = 1) -> tuple[tuple[int, ...], str | None]:
    """The batch sizes to validate an ONNX export at, sized to memory.

    A batch size of ``wanted`` whose reference outputs (``bytes_per_item * batch``) exceed ``limit`` is not
    validated (it only checks the same symbolic batch axis again, at a size that may not fit on the host; seen:
    GPT-2's logits at batch 128 are 26.3 GB in FP32, and the host ran out of memory). Batch ``smallest`` is always
    kept. While fewer than two distinct sizes are kept (``min(2, len(set(wanted)))``), the first of ``smallest``,
    then :data:`SMALL_VALIDATION_BATCHES` above it, then ``smallest + 1`` not kept yet is added.

    Args:
        wanted: the batch sizes the caller would validate at, in its order (the first >= 2 is the export example).
        bytes_per_item: bytes of the reference outputs per batch item (:func:`output_nbytes` of the outputs at a
            batch size, divided by it); None: unknown, so only sizes up to ``max(SMALL_VALIDATION_BATCHES)`` (or
            ``smallest + 1`` when larger) are validated.
        limit: bytes; None: :func:`validation_output_limit`.
        smallest: the smallest batch size the export claims (``tctune.deploy.smallest_batch``): no substitute is
            below it.

    Returns:
        ``(sizes, note)``: the sizes (``wanted``'s kept ones in order, then the substitutes) and None when all were
        kept, else one line, e.g. ``"outputs at batch 128 are 26.3 GB, over the 2.1 GB validation limit (the fixed
        cap for one validation batch): validated at batches 1 and 3"``.

    Raises:
        ValueError: ``wanted`` is empty or not positive ints.
    """
    sizes = list(dict.fromkeys(int(b) for b in wanted))
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"wanted must be positive batch sizes, got {wanted!r}")
    limit, why = (limit, "the limit given") if limit is not None else validation_output_limit()

    def fits(b: int) -> bool:
        if bytes_per_item is None:
            return b <= max(*SMALL_VALIDATION_BATCHES, smallest + 1)
        return b == smallest or bytes_per_item * b <= limit

    kept = [b for b in sizes if fits(b)]
    skipped = [b for b in sizes if not fits(b)]
    for b in dict.fromkeys((smallest, *(s for s in SMALL_VALIDATION_BATCHES if s > smallest), smallest + 1)):
        if len(kept) >= min(2, len(sizes)):
            break
        if b not in kept and fits(b):
            kept.append(b)
    if not skipped:
        return tuple(kept), None
    done = sorted(kept)
    at = " and ".join(map(str, done)) if len(done) <= 2 else ", ".join(map(str, done[:-1])) + f" and {done[-1]}"
    if bytes_per_item is None:
        said = f"the size of the outputs is unknown, so batch {', '.join(map(str, skipped))} was not validated"
    else:
        said = "; ".join(f"outputs at batch {b} are {_gb(bytes_per_item * b)}" for b in skipped)
        said += f", over the {_gb(limit)} validation limit ({why})"
    return tuple(kept), f"{said}: validated at batch{'es' if len(done) > 1 else ''} {at}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{int(n)} bytes"


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


def _output_names(output: Any, taken: Sequence[str] = ()) -> list[str]:
    """ONNX output names in the pytree's flattened order (the order the exporter writes the outputs in).

    A name that is already ``taken`` (an input's: ONNX values are named once, so an output ``ids`` beside an input
    ``ids`` would make the graph invalid) gets the suffix ``_out`` (``ids_out``).

    One tensor: ``output``. Otherwise each leaf's key path joined with ``.``: dict keys (and attribute names
    of registered dataclass-like outputs) as written, sequence positions as ``output_<i>`` at the top level
    and ``<i>`` below it. ``{"zeros": a, "cache": {"k": k, "v": v}}`` -> ``zeros, cache.k, cache.v``;
    ``(a, b)`` -> ``output_0, output_1``; ``(a, {"k": k})`` -> ``output_0, output_1.k``.
    """
    if isinstance(output, torch.Tensor):
        return ["output"]
    leaves_with_paths, _ = pytree.tree_flatten_with_path(output)
    names = []
    for key_path, _ in leaves_with_paths:
        parts = [_key_name(k) for k in key_path]
        if key_path and isinstance(key_path[0], pytree.SequenceKey):
            parts[0] = f"output_{parts[0]}"
        names.append(".".join(parts) or "output")
    names = [_sanitize(n) for n in names]
    return _unique([f"{n}_out" if n in taken else n for n in names], taken)


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):  # MappingKey, SequenceKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _sanitize(name: str) -> str:
    name = re.sub(r"[^0-9A-Za-z_.]", "_", name)
    return name or "_"


def _unique(names: list[str], taken: Sequence[str] = ()) -> list[str]:
    out: list[str] = []
    for name in names:
        candidate, k = name, 1
        while candidate in out or candidate in taken:
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
        if root is not message:
            # torch.onnx wraps the cause in pages of advice: the cause first (the part that says what failed),
            # then the wrapper's first sentence, so a cut drops the advice, not the cause.
            first = (text.splitlines() or [""])[0]
            first = first.split(". ")[0].rstrip(".")
            cause = (str(root).strip().splitlines() or [""])[0]
            text = f"{type(root).__name__}: {cause} (in {type(message).__name__}: {first})"
        else:
            text = f"{type(message).__name__}: {text}"
    else:
        text = str(message)
    text = " ".join(_ANSI.sub("", text).split())
    return clip(text, limit)
