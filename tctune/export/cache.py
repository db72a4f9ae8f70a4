"""Cache keys for exported engines: rebuild only when something that shapes the artifact changed.

Why this exists: an ONNX export takes seconds, an AOTInductor compile tens of seconds on a CPU and a
TensorRT build minutes. ``tctune export`` writes the key into each artifact's manifest and reuses an
artifact whose manifest carries the same key.

The key covers what determines the artifact's bytes and behaviour: the graph (``gm.code``, every
parameter/buffer's name, shape and dtype, and a hash of the weight bytes), the format, the precision,
the input shapes/dtypes and batch sizes (ONNX validation sizes, the TensorRT profile), the compute
capability it is built for, and the torch / onnx / TensorRT versions that build it. The format and the
tctune version are in it too, so an upgrade rebuilds.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from tctune import __version__
from tctune.export.runner import read_manifest

#: Bump when the meaning of an artifact changes (e.g. a new manifest field that old artifacts lack).
KEY_VERSION = 1


def graph_hash(gm: torch.nn.Module) -> str:
    """sha256 of a module's code, its parameter/buffer names, shapes and dtypes, and its weight bytes.

    Args:
        gm: an fx ``GraphModule`` (its generated ``code`` is hashed) or any ``nn.Module`` (its ``repr``).

    Returns:
        64 hex characters; equal for two graphs with the same code and bitwise-equal weights.
    """
    h = hashlib.sha256()
    h.update((getattr(gm, "code", None) or repr(gm)).encode())
    tensors = dict(gm.named_parameters(remove_duplicate=False))
    tensors.update(gm.named_buffers(remove_duplicate=False))
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        data = t.detach().to("cpu").contiguous()
        if data.numel():
            h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tool_versions(fmt: str) -> dict[str, str | None]:
    """Versions of the tools that build ``fmt`` (``"onnx"``, ``"tensorrt"``, ``"aoti"``)."""
    versions: dict[str, str | None] = {"torch": torch.__version__, "tctune": __version__}
    if fmt in ("onnx", "tensorrt"):
        versions["onnx"] = _version_of("onnx")
        versions["onnxscript"] = _version_of("onnxscript")
    if fmt == "tensorrt":
        try:  # the wheel may be tensorrt, tensorrt-cu12, tensorrt-cu13...: ask the module
            import tensorrt

            versions["tensorrt"] = getattr(tensorrt, "__version__", "unknown")
        except Exception:  # noqa: BLE001 - not installed or broken: no engine is built then
            versions["tensorrt"] = None
    return versions


def artifact_key(gm: torch.nn.Module, *, fmt: str, precision: str, inputs: list[dict],
                 batch_sizes: dict[str, int], compute_capability: str | None,
                 graph_digest: str | None = None, extra: dict | None = None) -> dict[str, Any]:
    """The cache key of one artifact, as a JSON-ready dict with its own ``digest``.

    Args:
        gm: the graph being exported (after the passes).
        fmt: ``"onnx"``, ``"tensorrt"`` or ``"aoti"``.
        precision: the config's precision (``"fp32"``, ``"bf16"``, ...).
        inputs: ``{name, shape, dtype}`` per input (dim 0 ``"batch"``).
        batch_sizes: ``{min, opt, max}`` the artifact is validated/built for.
        compute_capability: ``"9.0"`` for a GPU build, ``None``/``""`` for the CPU.
        graph_digest: :func:`graph_hash` of ``gm`` when already computed.
        extra: anything else that shapes the artifact (e.g. the device of an AOTInductor package).
    """
    key = {
        "key_version": KEY_VERSION,
        "format": fmt,
        "graph": graph_digest or graph_hash(gm),
        "precision": precision,
        "inputs": [{k: v for k, v in i.items() if k in ("name", "shape", "dtype")} for i in inputs],
        "batch_sizes": dict(batch_sizes),
        "compute_capability": compute_capability or None,
        "versions": tool_versions(fmt),
        **({"extra": extra} if extra else {}),
    }
    key["digest"] = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    return key


def cached(artifact_path, key: dict) -> dict | None:
    """The existing manifest of ``artifact_path`` when the file exists and its key's digest equals ``key``'s.

    Returns:
        The manifest (with its ``result`` from the build that wrote it), or None: rebuild.
    """
    from pathlib import Path

    if not Path(artifact_path).exists():
        return None
    manifest = read_manifest(artifact_path)
    if not manifest or (manifest.get("cache_key") or {}).get("digest") != key["digest"]:
        return None
    return manifest


def stale_reason(artifact_path, key: dict) -> str | None:
    """Why the artifact at ``artifact_path`` was not reused for ``key`` (:func:`cached` returned None), in words
    for the console; None when there is no artifact there (nothing to reuse) or its key matches.

    Returns:
        e.g. ``"model.onnx's graph or weights differ from this build's ..."`` or ``"its versions differ"``.
    """
    from pathlib import Path

    path = Path(artifact_path)
    if not path.exists():
        return None
    old = (read_manifest(path) or {}).get("cache_key")
    if not isinstance(old, dict):
        return f"{path.name} has no manifest with a cache key beside it"
    if old.get("digest") == key.get("digest"):
        return None
    fields = [k for k in sorted(set(old) | set(key)) if k != "digest" and old.get(k) != key.get(k)]
    if "graph" in fields:
        return (f"{path.name}'s graph or weights differ from this build's (a build_model() that draws random "
                "weights without a fixed seed gives other weights every time the file runs)")
    return f"{path.name}'s {', '.join(fields) or 'cache key'} differ from this build's"


def _version_of(package: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version(package)
    except PackageNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a broken install counts as absent
        return None
