"""Load a user's model file and check it against the model-file contract.

The file is *executed*, as ``python model.py`` would execute it: only run model files you trust.

Contract:

- ``build_model() -> torch.nn.Module`` (required)
- ``example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]`` (required; batch on dim 0 of every tensor;
  fresh random data is fine, never all zeros for parity checks)
- ``example_targets(batch_size)`` and ``loss_fn(output, targets)`` (needed for ``--mode train``)
- ``score(model) -> float`` (optional: the user's own accuracy metric, higher is better)
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
}


@dataclass
class ModelFile:
    """A loaded, checked model file.

    Attributes:
        path: absolute path of the file.
        name: the model's name (file stem), used for the output folder.
        build_model: the file's ``build_model``.
        example_inputs: the file's ``example_inputs``.
        example_targets, loss_fn, score: the optional functions, or None.
    """

    path: Path
    name: str
    build_model: Callable[[], torch.nn.Module]
    example_inputs: Callable[[int], tuple]
    example_targets: Callable | None = None
    loss_fn: Callable | None = None
    score: Callable | None = None

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

    @classmethod
    def from_module(cls, model: torch.nn.Module, example_inputs, score: Callable | None = None,
                    calibration=None, dynamic_shapes=None, name: str | None = None) -> "ModelFile":
        """A model file built from a live module (``tctune.optimize(model, example_inputs)``).

        Args:
            model: the module; ``build_model()`` returns this object (the tuner puts it in eval mode on the
                measuring device).
            example_inputs: a callable ``batch_size -> tuple of tensors``, or one tuple of tensors (a single
                tensor is a 1-tuple). From a tuple, the inputs of another batch size repeat its rows cyclically
                (or keep the first ``batch_size``) along dim 0 of every tensor whose dim 0 is the tuple's batch
                (:func:`resize_batch`); other tensors are passed as they are.
            score, calibration, dynamic_shapes: as in a model file; set as attributes of the same name
                (``calibration`` as ``calibration_inputs``) only when given.
            name: the model's name in the report and the study (default: the module's class name).

        Raises:
            ModelFileError: ``model`` is not an ``nn.Module``, or ``example_inputs`` is neither a callable nor
                a non-empty tuple of tensors.
        """
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(f"optimize needs a torch.nn.Module or a model file path, got {type(model).__name__}")
        label = name or type(model).__name__
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        if isinstance(example_inputs, list):
            example_inputs = tuple(example_inputs)
        if isinstance(example_inputs, tuple):
            if not example_inputs or not all(isinstance(t, torch.Tensor) for t in example_inputs):
                raise ModelFileError(
                    f"{label}: example_inputs must be a tuple of tensors or a function batch_size -> tuple, got "
                    "(" + ", ".join(type(t).__name__ for t in example_inputs) + ")")
            fixed = example_inputs
            make = lambda batch_size: resize_batch(fixed, batch_size)  # noqa: E731
        elif callable(example_inputs):
            make = example_inputs
        else:
            raise ModelFileError(f"{label}: example_inputs must be a tuple of tensors or a function "
                                 f"batch_size -> tuple, got {type(example_inputs).__name__}")
        mf = cls(path=Path(f"<{label}>"), name=label, build_model=lambda: model, example_inputs=make, score=score)
        if calibration is not None:
            mf.calibration_inputs = calibration  # type: ignore[attr-defined]
        if dynamic_shapes is not None:
            mf.dynamic_shapes = dynamic_shapes  # type: ignore[attr-defined]
        return mf


def example_batch(inputs: tuple) -> int | None:
    """The batch of an example tuple: dim 0 of its first tensor with at least one dimension (None: no such)."""
    return next((t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)


def resize_batch(inputs: tuple, batch_size: int) -> tuple:
    """``inputs`` at ``batch_size``: every tensor whose dim 0 is the tuple's batch (:func:`example_batch`) keeps
    its first ``batch_size`` rows, or repeats its rows cyclically up to ``batch_size`` (rows ``0..B-1, 0..``);
    other tensors are returned as they are. Shapes otherwise unchanged, dtypes and devices kept."""
    b = example_batch(inputs)
    out = []
    for t in inputs:
        if b is None or not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != b:
            out.append(t)
        elif batch_size <= b:
            out.append(t[:batch_size].clone())
        else:
            out.append(t.repeat(-(-batch_size // b), *([1] * (t.dim() - 1)))[:batch_size].clone())
    return tuple(out)


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
    for fn in ("build_model", "example_inputs", "example_targets", "loss_fn", "score"):
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
