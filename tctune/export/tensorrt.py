"""Build a TensorRT engine from tctune's ONNX file, when the ``tensorrt`` package is importable.

Why this exists: TensorRT is the fastest deployment target on NVIDIA GPUs, and TensorRT 10/11 take the
precision from the network itself (strongly typed networks; TRT 11 removed the FP16 builder flag). The
graph passes already put fp16/bf16 weights and explicit casts into the ONNX, so the build here sets no
precision flag: it parses the ONNX into a STRONGLY_TYPED network, adds one optimization profile for the
batch axis (and the model's other dynamic dimensions, :func:`profile_shapes`) and serializes the engine.

FP8: the FP8 ONNX (``tctune.export.onnx_fp8``) carries float8e4m3fn QuantizeLinear/DequantizeLinear pairs
(opset 19) with bf16 scales; a strongly typed network takes the FP8 GEMMs from those Q/DQ nodes (explicit
quantization), so no ``BuilderFlag.FP8`` / ``INT8`` / ``BF16`` flag is set or needed here (in a strongly
typed network such flags are not allowed anyway). TensorRT older than 10 (no ``STRONGLY_TYPED`` flag) builds
a weakly typed network, which needs ``BuilderFlag.FP8`` for float8 Q/DQ: such versions are not supported for
FP8 models. The manifest's ``weight_dtypes`` counts the ``float8e4m3fn`` initializers.

Not run in tctune's own test machines: TensorRT cannot be installed there. The code follows TensorRT's
documented Python API (``Builder``, ``create_network``, ``OnnxParser.parse_from_file``,
``create_optimization_profile``/``set_shape``, ``builder_optimization_level``, timing cache,
``build_serialized_network``) and is tested against a recording stand-in module.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

from tctune.errors import ExportError

SKIP_REASON = "tensorrt is not installed (pip install 'tctune[tensorrt]'); engine build skipped"


def tensorrt_available() -> tuple[bool, str]:
    """Whether ``import tensorrt`` works.

    Returns:
        ``(True, "")``, or ``(False, reason)`` where ``reason`` says how to install it and that the engine
        build is skipped.
    """
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False, SKIP_REASON
    except Exception as exc:  # noqa: BLE001 - a broken install (e.g. missing libnvinfer) also means "skip"
        return False, f"tensorrt failed to import ({type(exc).__name__}: {exc}); engine build skipped"
    return True, ""


def build_engine(
    onnx_path: str | os.PathLike,
    engine_path: str | os.PathLike,
    *,
    input_shapes: dict[str, tuple[int, ...]],
    batch_sizes: tuple[int, int, int],
    timing_cache: str | os.PathLike | None = None,
    optimization_level: int = 3,
    dim_ranges: dict[str, tuple[int, int, int]] | None = None,
) -> dict[str, Any]:
    """Build a strongly typed TensorRT engine from ``onnx_path`` and write it with a JSON manifest.

    Args:
        onnx_path: the ONNX file from :func:`tctune.export.export_onnx` or
            :func:`tctune.export.export_onnx_fp8` (its precision, float8 Q/DQ included, is the engine's).
        engine_path: the ``.engine`` file to write (atomically); ``<engine_path>.json`` gets the manifest.
        input_shapes: ONNX input name -> shape with ``-1`` (or ``"batch"``) for the batch axis and a symbol
            name for another dynamic dimension, e.g. ``{"x": (-1, 3, 32, 32)}`` or ``{"input_ids": (-1,
            "seq")}`` (the ``shape`` of ``export_onnx``'s ``onnx_inputs``).
        batch_sizes: ``(min, opt, max)`` batch of the single optimization profile.
        dim_ranges: symbol -> ``(min, opt, max)`` size for the other dynamic dimensions
            (:func:`profile_ranges`); needed for every symbol in ``input_shapes``.
        timing_cache: a timing-cache file to load (if it exists) and to save after the build; ``None``
            builds without a persistent cache.
        optimization_level: ``builder_optimization_level`` 0-5 (TensorRT's default is 3).

    Returns:
        ``{"tensorrt": str path or None, "tensorrt_skipped_reason": str or None}``; with TensorRT missing,
        ``{"tensorrt": None, "tensorrt_skipped_reason": reason}`` (no exception).

    Raises:
        ExportError: the ONNX parser reported errors (each listed), ``input_shapes`` does not match the
            network's inputs, or the builder returned no engine.
        ValueError: ``batch_sizes`` is not ``min <= opt <= max`` positive ints, or a symbol has no range.
    """
    profile_shapes(input_shapes, batch_sizes, dim_ranges)  # argument errors before the TensorRT check
    ok, reason = tensorrt_available()
    if not ok:
        return {"tensorrt": None, "tensorrt_skipped_reason": reason}
    import tensorrt as trt

    lo, opt, hi = (int(b) for b in batch_sizes)
    if not 1 <= lo <= opt <= hi:
        raise ValueError(f"batch_sizes must be min <= opt <= max, all >= 1; got {batch_sizes!r}")
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # TRT 10: opt in to strong typing; TRT 11: always strongly typed, the flag is kept and ignored.
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    flags = 0 if strongly_typed is None else 1 << int(strongly_typed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # reads external data beside the file too
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise ExportError(f"TensorRT's ONNX parser rejected {onnx_path.name}: " + " | ".join(errors))

    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    outputs = [network.get_output(i) for i in range(network.num_outputs)]
    missing = sorted({t.name for t in inputs} - set(input_shapes))
    if missing:
        raise ExportError(f"input_shapes lacks the network inputs {missing}; it has {sorted(input_shapes)}")

    config = builder.create_builder_config()
    config.builder_optimization_level = int(optimization_level)
    profile = builder.create_optimization_profile()
    shapes = profile_shapes({t.name: input_shapes[t.name] for t in inputs}, (lo, opt, hi), dim_ranges)
    for tensor in inputs:
        s = shapes[tensor.name]
        profile.set_shape(tensor.name, s["min"], s["opt"], s["max"])
    config.add_optimization_profile(profile)

    cache_path = Path(timing_cache) if timing_cache is not None else None
    if cache_path is not None:
        blob = cache_path.read_bytes() if cache_path.exists() else b""
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, False)  # False: refuse a cache from another GPU/TRT

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT could not build an engine from {onnx_path.name} (see its log above)")
    _write_atomically(engine_path, memoryview(serialized).tobytes())
    if cache_path is not None:
        _write_atomically(cache_path, memoryview(config.get_timing_cache().serialize()).tobytes())

    manifest = {
        "tensorrt_version": getattr(trt, "__version__", "unknown"),
        "onnx": str(onnx_path),
        "precision": "strongly typed: taken from the ONNX graph (no builder precision flags)",
        "weight_dtypes": _weight_dtypes(onnx_path),
        "input_dtypes": {t.name: str(t.dtype) for t in inputs},
        "output_dtypes": {t.name: str(t.dtype) for t in outputs},
        "inputs": [t.name for t in inputs],
        "outputs": [t.name for t in outputs],
        "profile": shapes,
        "batch_sizes": {"min": lo, "opt": opt, "max": hi},
        "dim_ranges": {k: {"min": v[0], "opt": v[1], "max": v[2]} for k, v in (dim_ranges or {}).items()},
        "optimization_level": int(optimization_level),
        "timing_cache": str(cache_path) if cache_path is not None else None,
        "compute_capability": _compute_capability(),
    }
    _write_atomically(Path(str(engine_path) + ".json"), (json.dumps(manifest, indent=2) + "\n").encode())
    return {"tensorrt": str(engine_path), "tensorrt_skipped_reason": None}


def profile_ranges(dynamic: Sequence[dict]) -> tuple[dict[str, tuple[int, int, int]], list[str]]:
    """The optimization profile's ``(min, opt, max)`` of each dynamic dimension other than the batch.

    Args:
        dynamic: ``tctune.capture.dynamic_dims`` entries (``symbol``, ``min``, ``max`` from the model file's
            ``torch.export.Dim``, ``example``: the size the search measured at).

    Returns:
        ``(ranges, notes)``: ``ranges[symbol] = (min, opt, max)`` with min the Dim's min (at least 1), opt the
        example size (the shape the search measured) and max the Dim's max; a Dim without a max gets the
        example size as max (a TensorRT profile needs a finite one) and a line in ``notes`` saying so.
    """
    ranges: dict[str, tuple[int, int, int]] = {}
    notes: list[str] = []
    for d in dynamic:
        sym = d["symbol"]
        if sym == "batch" or sym in ranges:
            continue
        lo = max(1, int(d["min"]))
        opt = int(d["example"])
        if d.get("max") is None:
            hi = opt
            notes.append(f"{sym} has no max in its torch.export.Dim: the TensorRT profile stops at the example size "
                         f"{opt}; declare Dim({sym!r}, max=...) to build for longer inputs")
        else:
            hi = int(d["max"])
        opt = min(max(opt, lo), hi)
        ranges[sym] = (lo, opt, hi)
    return ranges, notes


def profile_shapes(input_shapes: dict[str, Sequence[int | str]], batch_sizes: tuple[int, int, int],
                   dim_ranges: dict[str, tuple[int, int, int]] | None = None) -> dict[str, dict[str, tuple[int, ...]]]:
    """The ``min`` / ``opt`` / ``max`` shape of each input in the optimization profile.

    Args:
        input_shapes: input name -> shape; an entry is a fixed size (int ≥ 0), ``-1`` or ``"batch"`` for the
            batch, or a symbol name (``"seq"``) for another dynamic dimension.
        batch_sizes: ``(min, opt, max)`` batch.
        dim_ranges: symbol -> ``(min, opt, max)`` (:func:`profile_ranges`).

    Returns:
        ``{name: {"min": shape, "opt": shape, "max": shape}}`` with every entry an int.

    Raises:
        ValueError: ``batch_sizes`` or a range is not ``1 <= min <= opt <= max``, or a symbol has no range.
    """
    ranges = {"batch": tuple(int(b) for b in batch_sizes)}
    for sym, r in (dim_ranges or {}).items():
        ranges[sym] = tuple(int(x) for x in r)
    for sym, r in ranges.items():
        if len(r) != 3 or not 1 <= r[0] <= r[1] <= r[2]:
            what = "batch_sizes" if sym == "batch" else f"the range of {sym}"
            raise ValueError(f"{what} must be min <= opt <= max, all >= 1; got {r!r}")
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in input_shapes.items():
        per = {}
        for k, key in enumerate(("min", "opt", "max")):
            dims = []
            for d in shape:
                sym = "batch" if d == -1 else d
                if isinstance(sym, str):
                    if sym not in ranges:
                        raise ValueError(f"input {name} has the dynamic dimension {sym!r}, which has no range in "
                                         f"dim_ranges ({sorted(ranges)})\n  fix: pass dim_ranges[{sym!r}] = "
                                         "(min, opt, max)")
                    dims.append(ranges[sym][k])
                else:
                    dims.append(int(sym))
            per[key] = tuple(dims)
        out[name] = per
    return out


def _with_batch(shape: tuple[int, ...], batch: int) -> tuple[int, ...]:
    """``shape`` with its ``-1`` (batch) entries set to ``batch``."""
    return tuple(batch if d == -1 else int(d) for d in shape)


def _weight_dtypes(onnx_path: Path) -> dict[str, int]:
    """Floating-point initializer count per dtype (e.g. ``{"float16": 12, "float32": 4}``): precision hint."""
    try:
        import onnx

        proto = onnx.load(str(onnx_path), load_external_data=False)
    except Exception:  # noqa: BLE001 - informative only
        return {}
    counts: dict[str, int] = {}
    for init in proto.graph.initializer:
        name = onnx.TensorProto.DataType.Name(init.data_type).lower()
        name = {"float": "float32", "double": "float64"}.get(name, name)
        if name.startswith(("float", "bfloat")):  # int initializers are shapes and indices, not weights
            counts[name] = counts.get(name, 0) + 1
    return counts


def _compute_capability() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}.{minor}"
    except Exception:  # noqa: BLE001 - the manifest is informative; never fail the build over it
        pass
    return None


def _write_atomically(path: Path, data: bytes) -> None:
    """Write through a temporary file and ``os.replace``, with mode 0o644 like every other artifact
    (mkstemp creates 0o600, which other users cannot read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
