"""Load a user's model file and check it against the model-file contract.

The file is *executed*, as ``python model.py`` would execute it: only run model files you trust.

Contract:

- ``build_model() -> torch.nn.Module`` (required)
- ``example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]`` (required; batch on dim 0 of every tensor;
  fresh random data is fine, never all zeros for parity checks)
- ``example_targets(batch_size)`` and ``loss_fn(output, targets)`` (needed for ``--mode train``)
- ``score(model) -> float`` (optional: the user's own accuracy metric, higher is better). When given it gates
  the search: it is called with the FP32 model and with each candidate's built module (tctune's graph or the
  model as written, on the measuring device, before the runtime wrapper), so it must move its own data to the
  device of the model's parameters and do its own batching (see ``tctune.search.evaluate.ScoreGate``).
- ``calibration_inputs() -> Iterable[tuple[torch.Tensor, ...]]`` (optional: real input batches, each shaped
  like ``example_inputs``' tuple with any batch size; used beside the random inputs for the FP32 comparison,
  fp16 overflow calibration and FP8 activation scales, see :mod:`tctune.calibration`)

A caller of the Python API builds a :class:`ModelFile` directly and may set ``score`` and
``calibration_inputs`` to its own callables.
"""
from __future__ import annotations

import importlib.util
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .errors import ModelFileError

SIGNATURES = {
    "build_model": "def build_model() -> torch.nn.Module",
    "example_inputs": "def example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]",
    "example_targets": "def example_targets(batch_size: int) -> torch.Tensor",
    "loss_fn": "def loss_fn(output, targets) -> torch.Tensor",
    "score": "def score(model: torch.nn.Module) -> float",
    "calibration_inputs": "def calibration_inputs() -> Iterable[tuple[torch.Tensor, ...]]",
}


@dataclass
class ModelFile:
    """A loaded, checked model file.

    Attributes:
        path: absolute path of the file.
        name: the model's name (file stem), used for the output folder.
        build_model: the file's ``build_model``.
        example_inputs: the file's ``example_inputs``.
        example_targets, loss_fn, score, calibration_inputs: the optional functions, or None.
    """

    path: Path
    name: str
    build_model: Callable[[], torch.nn.Module]
    example_inputs: Callable[[int], tuple]
    example_targets: Callable | None = None
    loss_fn: Callable | None = None
    score: Callable | None = None
    calibration_inputs: Callable | None = None

    def inputs(self, batch_size: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, ...]:
        """Fresh example inputs for ``batch_size`` on ``device``, checked against the contract.

        Raises:
            ModelFileError: not a tuple of tensors, or dim 0 of a tensor is not ``batch_size``.
        """
        try:
            raw = self.example_inputs(batch_size)
        except Exception as exc:  # the user's code
            raise ModelFileError(
                f"{self.path.name}: example_inputs({batch_size}) raised {type(exc).__name__}: {exc}\n"
                f"  fix the function; expected: {SIGNATURES['example_inputs']}"
            ) from exc
        if isinstance(raw, torch.Tensor):
            raw = (raw,)
        if not isinstance(raw, (tuple, list)) or not raw or not all(isinstance(t, torch.Tensor) for t in raw):
            got = type(raw).__name__ if not isinstance(raw, (tuple, list)) else (
                "(" + ", ".join(type(t).__name__ for t in raw) + ")")
            raise ModelFileError(
                f"{self.path.name}: example_inputs({batch_size}) must return a tuple of tensors, got {got}\n"
                f"  expected: {SIGNATURES['example_inputs']}"
            )
        for i, t in enumerate(raw):
            if t.dim() == 0 or t.shape[0] != batch_size:
                raise ModelFileError(
                    f"{self.path.name}: example_inputs({batch_size}) input {i} has shape {tuple(t.shape)}; "
                    f"dim 0 must be the batch ({batch_size}) for every input\n"
                    f"  fix: build every tensor with batch_size as its first dimension"
                )
        return tuple(t.to(device) for t in raw)

    def model(self) -> torch.nn.Module:
        """Call ``build_model()`` and check it returns an ``nn.Module``.

        Raises:
            ModelFileError: it raised or returned something else.
        """
        try:
            model = self.build_model()
        except Exception as exc:
            raise ModelFileError(
                f"{self.path.name}: build_model() raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(
                f"{self.path.name}: build_model() must return a torch.nn.Module, got {type(model).__name__}\n"
                f"  expected: {SIGNATURES['build_model']}"
            )
        return model


def load_model_file(path: str | Path) -> ModelFile:
    """Import ``path`` as a module (executing it) and check the contract.

    Args:
        path: a ``.py`` file.

    Returns:
        The checked :class:`ModelFile`.

    Raises:
        ModelFileError: missing/unreadable file, not Python, syntax error, an exception at import, or a
            required function missing or not callable. The message names the cause and the fix.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}\n  fix: pass the path of a .py file that defines build_model() and example_inputs(batch_size)")
    if p.is_dir():
        raise ModelFileError(f"{p} is a folder, not a model file\n  fix: pass the path of a .py file")
    if p.suffix != ".py":
        raise ModelFileError(f"{p.name} is not a Python file (.py expected)\n  fix: write build_model() and example_inputs(batch_size) in a .py file")
    try:
        source = p.read_bytes()
    except OSError as exc:
        raise ModelFileError(f"cannot read {p}: {exc.strerror}\n  fix: check the file's permissions") from exc
    try:
        compile(source, str(p), "exec")
    except SyntaxError as exc:
        raise ModelFileError(
            f"{p.name}, line {exc.lineno}: syntax error: {exc.msg}\n  fix: the file must run with `python {p.name}`"
        ) from exc
    except ValueError as exc:  # e.g. null bytes: not Python at all
        raise ModelFileError(f"{p.name} is not Python source ({exc})") from exc

    mod_name = f"tctune_model_{p.stem}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"cannot import {p}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    sys.path.insert(0, str(p.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(mod_name, None)
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = traceback.extract_tb(exc.__traceback__)
        where = next((f" at line {f.lineno}" for f in reversed(tb) if f.filename == str(p)), "")
        raise ModelFileError(
            f"{p.name} raised {type(exc).__name__}{where} while being imported: {exc}\n"
            f"  fix: the file must import cleanly with `python {p.name}`"
        ) from exc
    finally:
        sys.path.remove(str(p.parent.resolve()))

    found = {}
    for fn in ("build_model", "example_inputs", "example_targets", "loss_fn", "score", "calibration_inputs"):
        obj = getattr(module, fn, None)
        if obj is None:
            if fn in ("build_model", "example_inputs"):
                raise ModelFileError(
                    f"{p.name} does not define {fn}()\n  add: {SIGNATURES[fn]}"
                )
            continue
        if not callable(obj):
            raise ModelFileError(f"{p.name}: {fn} is a {type(obj).__name__}, not a function\n  expected: {SIGNATURES[fn]}")
        found[fn] = obj
    return ModelFile(path=p.resolve(), name=p.stem, **found)
