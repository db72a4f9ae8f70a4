"""Manifests and the generated standalone ``runner.py`` for tctune's inference engines.

Why this exists: an engine file alone does not say what to feed it. Each artifact gets a manifest
(``<artifact>.manifest.json``: input names, shapes with ``"batch"`` for dim 0, dtypes, the value range of
integer inputs such as token ids, the batch sizes it was validated at, its cache key) and a ``runner.py``
beside it that times it with nothing but the engine's own runtime: onnxruntime + numpy for ``.onnx``
(no torch, no tctune), tensorrt + cuda-python for ``.engine``, torch's AOTInductor loader for ``.pt2``.

The runner's text is ``_runner_template.py`` in this package, copied with its default artifact filled in;
``tctune bench`` imports the same template, so the command and the generated script time alike.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tctune.errors import ExportError

TEMPLATE = Path(__file__).with_name("_runner_template.py")
MANIFEST_SUFFIX = ".manifest.json"
RUNNER_NAME = "runner.py"
#: Mode bits of a manifest (as of every other artifact) and of the runner script.
MANIFEST_MODE, RUNNER_MODE = 0o644, 0o755

_NUMPY_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
                 torch.bfloat16: "bfloat16", torch.int64: "int64", torch.int32: "int32", torch.int16: "int16",
                 torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}


def manifest_path(artifact_path: str | os.PathLike) -> Path:
    """``model.onnx`` -> ``model.onnx.manifest.json`` (beside it)."""
    return Path(str(artifact_path) + MANIFEST_SUFFIX)


def read_manifest(artifact_path: str | os.PathLike) -> dict | None:
    """The manifest beside ``artifact_path``, or None when there is none (or it is not valid JSON)."""
    path = manifest_path(artifact_path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def describe_inputs(
    module: torch.nn.Module | None,
    make_inputs: Callable[[int], Sequence[torch.Tensor] | torch.Tensor],
    names: Sequence[str],
    batch_sizes: Sequence[int] = (2, 3),
) -> list[dict[str, Any]]:
    """``{name, shape, dtype[, range]}`` for each input, from fresh example inputs at ``batch_sizes``.

    Args:
        module: the (captured) graph module the inputs feed, used to bound integer inputs that go straight
            into an embedding (``range`` = ``[0, num_embeddings)``); None: no such bound.
        make_inputs: ``make_inputs(batch)`` returns the model's inputs, batch on dim 0.
        names: one name per input (the ONNX/forward names).
        batch_sizes: batches to draw examples at; integer ranges cover every value seen.

    Returns:
        One dict per input: ``shape`` with ``"batch"`` for dim 0 (e.g. ``["batch", 128]``; an input the
        capture recorded as not batched, ``module.meta["tctune_batched"]``, keeps its own shape, e.g. ``[1, 1,
        128, 128]``; other dynamic dimensions are given at the example's size), ``dtype`` a numpy
        name (``"float32"``, ``"int64"``), and for integer inputs ``range: [low, high)``: ``[0,
        num_embeddings)`` where the input indexes an embedding, else ``[min seen, max seen + 1)``.
    """
    samples = [_as_tuple(make_inputs(int(b))) for b in batch_sizes]
    vocab = _embedding_bounds(module) if module is not None else {}
    batched = getattr(module, "meta", {}).get("tctune_batched") if module is not None else None
    described = []
    for i, (name, example) in enumerate(zip(names, samples[0])):
        if batched is not None and i < len(batched) and not batched[i]:  # not batched: the same at every batch
            shape: list[Any] = [int(d) for d in example.shape]
        else:
            shape = ["batch", *(int(d) for d in example.shape[1:])]
        entry: dict[str, Any] = {"name": name, "shape": shape,
                                 "dtype": _NUMPY_DTYPES.get(example.dtype, str(example.dtype).replace("torch.", ""))}
        if not example.is_floating_point() and example.dtype != torch.bool:
            lo = min(int(s[i].min()) for s in samples)
            hi = max(int(s[i].max()) for s in samples) + 1
            if i in vocab:
                lo, hi = 0, vocab[i]
            entry["range"] = [lo, hi]
        described.append(entry)
    return described


def write_manifest(artifact_path: str | os.PathLike, manifest: dict) -> Path:
    """Write ``manifest`` as ``<artifact>.manifest.json`` (atomically, mode 0o644); returns its path."""
    path = manifest_path(artifact_path)
    _write_atomically(path, json.dumps(manifest, indent=2, default=str) + "\n")
    return path


def write_runner(artifact_path: str | os.PathLike, manifest: dict) -> Path:
    """Write the manifest and a standalone ``runner.py`` beside ``artifact_path``.

    The runner times the artifact it was written for by default (any artifact with a manifest when given
    one: ``python runner.py model.pt2``). It imports only numpy plus the engine's runtime. Both files are
    written atomically and readable by other users: the manifest with mode 0o644, ``runner.py`` 0o755.

    Args:
        artifact_path: the ``.onnx``, ``.engine`` or ``.pt2`` file.
        manifest: needs ``inputs`` (list of ``{name, shape, dtype[, range]}``, see :func:`describe_inputs`)
            and ``batch_sizes`` (``{min, opt, max}``); ``format``, ``device`` and anything else is kept.

    Returns:
        The path of ``runner.py``.

    Raises:
        ExportError: the manifest lacks ``inputs``, or the artifact does not exist.
    """
    artifact = Path(artifact_path)
    if not artifact.exists():
        raise ExportError(f"cannot write a runner for {artifact}: the file does not exist")
    if not isinstance(manifest.get("inputs"), list) or not manifest["inputs"]:
        raise ExportError(f"the manifest for {artifact.name} has no 'inputs' list; the runner needs the "
                          "input names, shapes and dtypes")
    write_manifest(artifact, manifest)
    text = TEMPLATE.read_text(encoding="utf-8").replace("__DEFAULT_ARTIFACT__", artifact.name)
    runner = artifact.parent / RUNNER_NAME
    _write_atomically(runner, text, RUNNER_MODE)
    return runner


# ------------------------------------------------------------------------------------------- helpers


def _embedding_bounds(module: torch.nn.Module) -> dict[int, int]:
    """Input index -> ``num_embeddings`` for placeholders used directly as indices of ``aten.embedding``."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return {}
    bounds: dict[int, int] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        for user in node.users:
            if user.op != "call_function" or "embedding" not in str(user.target) or len(user.args) < 2:
                continue
            weight, indices = user.args[0], user.args[1]
            if indices is not node or getattr(weight, "op", None) != "get_attr":
                continue
            try:
                tensor = _get_attr(module, weight.target)
            except AttributeError:
                continue
            size = int(tensor.shape[0])
            bounds[index] = min(bounds.get(index, size), size)
    return bounds


def _get_attr(module: torch.nn.Module, target: str) -> torch.Tensor:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _as_tuple(inputs: Any) -> tuple[torch.Tensor, ...]:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


def _write_atomically(path: Path, text: str, mode: int = MANIFEST_MODE) -> None:
    """Write through a temporary file beside ``path`` and ``os.replace``; ``mode`` set before the rename
    (mkstemp creates 0o600, which other users cannot read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
