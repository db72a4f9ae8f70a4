"""Load a user's model file and check it against the model-file contract.

The file is *executed*, as ``python model.py`` would execute it: only run model files you trust.

Contract:

- ``build_model() -> torch.nn.Module`` (required)
- ``example_inputs(batch_size: int) -> tuple[torch.Tensor, ...]`` (required; batch on dim 0 of every batched
  tensor; fresh random data is fine, never all zeros for parity checks). A list of tensors is taken as the
  tuple of the same tensors, and one tensor as a 1-tuple: the model is called ``model(*inputs)`` either way.
  A mapping of ``forward``'s argument names to tensors (a dict, a Hugging Face tokenizer's ``BatchEncoding``) is
  taken as those inputs by name: its tensors in the order of ``forward``'s parameters, which must be the first
  ones (:func:`mapping_inputs`)
- ``example_targets(batch_size)`` and ``loss_fn(output, targets)`` (needed for ``--mode train``)
- ``score(model) -> float`` (optional: the user's own accuracy metric, higher is better). When given it gates
  the search: it is called with the FP32 model and with each candidate's built module (tctune's graph or the
  model as written, on the measuring device, before the runtime wrapper), so it must move its own data to the
  device of the model's parameters and do its own batching (see ``tctune.search.evaluate.ScoreGate``).
- ``calibration_inputs() -> Iterable[tuple[torch.Tensor, ...]]`` (optional: real input batches, each shaped
  like ``example_inputs``' tuple with any batch size, or a mapping by ``forward``'s argument names as above;
  used beside the random inputs for the FP32 comparison,
  fp16 overflow calibration and FP8 activation scales, see :mod:`tctune.calibration`)
- ``DYNAMIC_SHAPES`` (optional module-level value) or ``dynamic_shapes()`` (optional function returning it):
  dimensions other than the batch that take any size in a range, in ``torch.export``'s own format: a tuple with
  one entry per input (None, or ``{dim: torch.export.Dim(name, min=, max=)}``) or a dict keyed by
  ``forward``'s argument names. Example: ``seq = Dim("seq", min=8, max=512)``; ``DYNAMIC_SHAPES =
  {"input_ids": {1: seq}, "attention_mask": {1: seq}}``. Dim 0 of batched inputs is always tctune's batch.
- ``BATCHED_INPUTS`` (optional): the inputs whose dim 0 is the batch, as forward argument names or input
  indices (``("input_ids", "attention_mask")`` or ``(0, 1)``). Without it, tctune compares ``example_inputs``
  at batch 2 and 3: an input whose dim 0 follows the batch size is batched, one whose dim 0 stays the same (a
  broadcast mask ``(1, 1, S, S)``, a weight-like ``(7, 2)`` tensor) or that has no dimension (a 0-d tensor)
  is not, and is passed as it is at every batch size.

Shapes are checked once, on the first call to :meth:`ModelFile.inputs`: a dimension other than the batch whose
size differs between calls of ``example_inputs`` must be declared in ``DYNAMIC_SHAPES``, else a
:class:`~tctune.errors.ModelFileError` names the input, the dimension and both sizes.

A caller of the Python API builds a :class:`ModelFile` directly and may set ``score`` and
``calibration_inputs`` to its own callables.
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

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
        dynamic_shapes: the file's ``DYNAMIC_SHAPES`` (or ``dynamic_shapes()``'s value), torch.export format
            (module docstring); None: only the batch is dynamic. The Python API sets it from its
            ``dynamic_shapes=`` argument.
        batched_inputs: the file's ``BATCHED_INPUTS`` (names or indices), or None: detected (module docstring).
    """

    path: Path
    name: str
    build_model: Callable[[], torch.nn.Module]
    example_inputs: Callable[[int], tuple]
    example_targets: Callable | None = None
    loss_fn: Callable | None = None
    score: Callable | None = None
    calibration_inputs: Callable | None = None
    dynamic_shapes: Any = None
    batched_inputs: Sequence[str | int] | None = None
    _batched: tuple[bool, ...] | None = field(default=None, init=False, repr=False, compare=False)
    _forward_names: list[str] | None = field(default=None, init=False, repr=False, compare=False)
    _forward_varargs: str | None = field(default=None, init=False, repr=False, compare=False)

    def inputs(self, batch_size: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, ...]:
        """Fresh example inputs for ``batch_size`` on ``device``, checked against the contract.

        The first call also checks the shapes (:meth:`batched_mask`).

        Raises:
            ModelFileError: not a tuple of tensors (a list of tensors or one tensor is taken as the tuple, a
                mapping by ``forward``'s argument names as :func:`mapping_inputs` orders it), dim 0 of a batched
                tensor is not ``batch_size``, or a dimension that is not declared dynamic changes between calls.
        """
        mask = self.batched_mask()
        raw = self._raw(batch_size)
        if len(raw) != len(mask):
            raise ModelFileError(f"{self.path.name}: example_inputs({batch_size}) returned {len(raw)} inputs, "
                                 f"another call {len(mask)}\n  fix: return the same inputs at every batch size")
        for i, t in enumerate(raw):
            if mask[i] and (t.dim() == 0 or t.shape[0] != batch_size):
                raise ModelFileError(
                    f"{self.path.name}: example_inputs({batch_size}) input {i} has shape {tuple(t.shape)}; "
                    f"dim 0 must be the batch ({batch_size}) for every batched input\n"
                    f"  fix: build every batched tensor with batch_size as its first dimension"
                )
        return tuple(t.to(device) for t in raw)

    def batched_mask(self) -> tuple[bool, ...]:
        """One bool per input: True where dim 0 is the batch. Computed once (cached) from ``BATCHED_INPUTS``
        or by calling ``example_inputs`` at batch 2, 3 and 2 again; the same calls check that every dimension
        other than the batch either keeps its size or is declared in ``dynamic_shapes``.

        Raises:
            ModelFileError: ``example_inputs`` fails or returns something else than tensors; no input is
                batched (dim 0 must be the batch of at least one); the calls return different numbers of inputs; ``BATCHED_INPUTS`` names an unknown input; an input's dim 0
                changes with the batch size without being the batch; an input not batched on dim 0 has another
                dimension that equals the batch size in every call (a time-major ``(T, B, F)`` input: the message
                says to put the batch first); or an undeclared dimension changes size
                (the message names the input, the dimension, the two sizes and the fix).
        """
        if self._batched is None:
            self._batched = self._check_shapes()
        return self._batched

    def forward_names(self) -> list[str]:
        """``forward``'s positional argument names of the model (builds it once if not built yet)."""
        if self._forward_names is None:
            self.model()
        return list(self._forward_names or [])

    def _declared(self, sample: tuple) -> list[dict[int, Any]]:
        from .capture import normalize_dynamic_shapes

        if self.dynamic_shapes is None:
            return [{} for _ in sample]
        names = self.forward_names() if isinstance(self.dynamic_shapes, dict) else None
        varargs = self._forward_varargs if isinstance(self.dynamic_shapes, dict) else None
        try:
            return normalize_dynamic_shapes(self.dynamic_shapes, sample, names, varargs)
        except ValueError as exc:
            raise ModelFileError(f"{self.path.name}: {exc}") from exc

    def _check_shapes(self) -> tuple[bool, ...]:
        samples = [(b, self._raw(b)) for b in (2, 3, 2)]
        counts = {len(s) for _, s in samples}
        if len(counts) != 1:
            raise ModelFileError(f"{self.path.name}: example_inputs returned {sorted(counts)} inputs in different "
                                 "calls\n  fix: return the same inputs at every batch size")
        first = samples[0][1]
        declared = self._declared(first)
        given = self._given_batched(len(first))
        names = _LazyNames(self, len(first))
        mask = []
        for i in range(len(first)):
            shapes = [(b, tuple(s[i].shape)) for b, s in samples]
            ranks = {len(sh) for _, sh in shapes}
            if len(ranks) != 1:
                raise ModelFileError(f"{self.path.name}: example_inputs input {i}{names[i]} has shapes "
                                     f"{[sh for _, sh in shapes]} in different calls (its rank changes)\n"
                                     "  fix: return tensors of the same rank at every batch size")
            follows = all(len(sh) > 0 and sh[0] == b for b, sh in shapes)
            batched = given[i] if given is not None else follows
            if given is None and not follows and len(shapes[0][1]) > 0 and 0 not in declared[i] \
                    and len({sh[0] for _, sh in shapes}) > 1:
                sizes = ", ".join(f"{sh[0]} at batch {b}" for b, sh in shapes)
                raise ModelFileError(f"{self.path.name}: example_inputs input {i}{names[i]} has dim 0 {sizes}: it "
                                     "changes with the batch size but is not the batch\n  fix: make dim 0 the "
                                     "batch size, keep it fixed, or list the batched inputs in BATCHED_INPUTS")
            mask.append(batched)
            for d in range(len(shapes[0][1])):
                if (batched and d == 0) or d in declared[i]:
                    continue
                seen = {sh[d] for _, sh in shapes}
                if len(seen) > 1 and not batched and all(sh[d] == b for b, sh in shapes):
                    raise ModelFileError(
                        f"{self.path.name}: example_inputs input {i}{names[i]} has its batch on dim {d} (shapes "
                        f"{', '.join(str(sh) for _, sh in shapes)} at batch 2, 3, 2), but tctune takes dim 0 of "
                        f"every batched input as the batch\n  fix: put the batch first: return the input with "
                        f"batch_size as dim 0 and move it back inside the model (e.g. a wrapper module whose "
                        f"forward calls the model on x.movedim(0, {d}))"
                    )
                if len(seen) > 1:
                    a, b = sorted(seen)[:2]
                    dim = f"torch.export.Dim('d{d}', min=1, max={max(seen) * 4})"
                    arg = names.arg(i)
                    example = (f"{{{arg!r}: {{{d}: {dim}}}}}" if arg else
                               "(" + ", ".join(f"{{{d}: {dim}}}" if j == i else "None" for j in range(len(first)))
                               + ("," if len(first) == 1 else "") + ")")
                    raise ModelFileError(
                        f"{self.path.name}: example_inputs input {i}{names[i]} dim {d} is {a} in one call and {b} "
                        f"in another (shapes {', '.join(str(sh) for _, sh in shapes)} at batch 2, 3, 2), but dim "
                        f"{d} is not declared dynamic: the captured graph would only accept one size\n"
                        f"  fix: declare it with torch.export.Dim in dynamic_shapes, e.g. DYNAMIC_SHAPES = "
                        f"{example}, or return the same size at every call"
                    )
        if not any(mask):
            shapes = ", ".join(str(tuple(t.shape)) for t in first)
            raise ModelFileError(f"{self.path.name}: example_inputs(2) returned shapes {shapes}: no input is batched; "
                                 "dim 0 must be the batch (2 at batch 2, 3 at batch 3) for at least one input\n"
                                 "  fix: build at least one tensor with batch_size as its first dimension")
        return tuple(mask)

    def _given_batched(self, n: int) -> list[bool] | None:
        if self.batched_inputs is None:
            return None
        spec = self.batched_inputs
        if isinstance(spec, (str, int)):
            spec = (spec,)
        names = self.forward_names() if any(isinstance(x, str) for x in spec) else []
        mask = [False] * n
        for x in spec:
            if isinstance(x, bool) or not isinstance(x, (int, str)):
                raise ModelFileError(f"{self.path.name}: BATCHED_INPUTS entries must be input indices or forward "
                                     f"argument names, got {x!r}")
            i = x if isinstance(x, int) else (names.index(x) if x in names[:n] else -1)
            if not 0 <= i < n:
                raise ModelFileError(f"{self.path.name}: BATCHED_INPUTS names {x!r}, which is not one of the {n} "
                                     f"inputs (forward's arguments: {names[:n] or 'unknown'})\n  fix: use an "
                                     f"index 0..{n - 1} or one of forward's argument names")
            mask[i] = True
        return mask

    def _raw(self, batch_size: int) -> tuple:
        """``example_inputs(batch_size)`` as a tuple of tensors (a list becomes the tuple of its tensors, one
        tensor a 1-tuple), or a ModelFileError."""
        try:
            raw = self.example_inputs(batch_size)
        except Exception as exc:  # the user's code
            raise ModelFileError(
                f"{self.path.name}: example_inputs({batch_size}) raised {type(exc).__name__}: {exc}"
                f"{_at(exc, self.path)}\n"
                f"  fix the function; expected: {SIGNATURES['example_inputs']}"
            ) from exc
        if isinstance(raw, torch.Tensor):
            raw = (raw,)
        if isinstance(raw, Mapping):  # inputs by forward's argument names
            raw = mapping_inputs(raw, self.forward_names(), f"{self.path.name}: example_inputs({batch_size})")
        if not isinstance(raw, (tuple, list)) or not raw or not all(isinstance(t, torch.Tensor) for t in raw):
            got = type(raw).__name__ if not isinstance(raw, (tuple, list)) else (
                "(" + ", ".join(type(t).__name__ for t in raw) + ")")
            def of_tensors(t) -> bool:  # a tuple / list / mapping holding tensors only
                vals = list(t.values()) if isinstance(t, Mapping) else t
                return isinstance(t, (tuple, list, Mapping)) and bool(vals) and all(
                    isinstance(v, torch.Tensor) for v in vals)

            nested = [i for i, t in enumerate(raw) if of_tensors(t)] if isinstance(raw, (tuple, list)) else []
            if nested:  # forward(self, pair) taking a tuple: one input that is itself a container
                i = nested[0]
                raise ModelFileError(
                    f"{self.path.name}: example_inputs({batch_size})'s input {i} is a {type(raw[i]).__name__} of "
                    f"tensors, not a tensor: tctune takes flat tensor inputs (model(*inputs))\n  fix: return the "
                    f"tensors flat and wrap the model in a module whose forward takes them one by one, e.g. "
                    f"def forward(self, a, b): return self.model((a, b))")
            raise ModelFileError(
                f"{self.path.name}: example_inputs({batch_size}) must return a tuple of tensors, got {got} (a list "
                f"of tensors or one tensor is accepted too)\n"
                f"  expected: {SIGNATURES['example_inputs']}"
            )
        return tuple(raw)

    def model(self) -> torch.nn.Module:
        """Call ``build_model()`` and check it returns an ``nn.Module``.

        Raises:
            ModelFileError: it raised or returned something else.
        """
        try:
            model = self.build_model()
        except Exception as exc:
            raise ModelFileError(
                f"{self.path.name}: build_model() raised {type(exc).__name__}: {exc}{_at(exc, self.path)}"
            ) from exc
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(
                f"{self.path.name}: build_model() must return a torch.nn.Module, got {type(model).__name__}\n"
                f"  expected: {SIGNATURES['build_model']}"
            )
        if self._forward_names is None:
            from .capture import forward_varargs

            self._forward_names = forward_names(model)
            self._forward_varargs = forward_varargs(model)
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
                (:func:`resize_batch`); other tensors are passed as they are. A mapping of ``forward``'s
                argument names to tensors (``{"input_ids": ids, "attention_mask": mask}``, a tokenizer's
                output), given or returned by the callable, is the tuple of its tensors in ``forward``'s order
                (:func:`mapping_inputs`).
            score, calibration, dynamic_shapes: as in a model file; set as attributes of the same name
                (``calibration`` as ``calibration_inputs``) only when given.
            name: the model's name in the report and the study (default: the module's class name).

        Raises:
            ModelFileError: ``model`` is not an ``nn.Module``, or ``example_inputs`` is neither a callable nor
                a non-empty tuple of tensors nor a mapping :func:`mapping_inputs` accepts.
        """
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(f"optimize needs a torch.nn.Module or a model file path, got {type(model).__name__}")
        label = name or type(model).__name__
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        if isinstance(example_inputs, list):
            example_inputs = tuple(example_inputs)
        if isinstance(example_inputs, Mapping):
            example_inputs = mapping_inputs(example_inputs, forward_names(model), f"{label}: example_inputs")
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
        if calibration is not None and not callable(calibration):  # batches given as a list: the contract's callable
            batches = list(calibration)
            calibration = lambda: batches  # noqa: E731
        return cls(path=Path(f"<{label}>"), name=label, build_model=lambda: model, example_inputs=make, score=score,
                   calibration_inputs=calibration, dynamic_shapes=dynamic_shapes)


def user_frame(exc: BaseException, prefer: Path | None = None) -> str | None:
    """Where the user's code raised ``exc``: ``"FILE:LINE in FUNCTION: SOURCE LINE"`` of the innermost frame of
    its traceback in ``prefer`` (the model file), else of the innermost frame outside torch, tctune, ``passes``
    and Python's standard library (a live module's own file); None when there is none (the error came from
    torch itself, e.g. a C++ kernel, with no user frame on the way)."""
    import sysconfig
    import traceback

    import passes

    skip = [str(Path(m.__file__).resolve().parent) for m in (torch, passes)]
    skip.append(str(Path(__file__).resolve().parent))  # tctune/
    skip.append(str(Path(sysconfig.get_paths()["stdlib"]).resolve()))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    where = {id(f): str(Path(f.filename).resolve()) for f in frames}
    target = str(Path(prefer).resolve()) if prefer is not None and Path(prefer).suffix == ".py" else None
    mine = ([f for f in frames if where[id(f)] == target]
            or [f for f in frames if not any(where[id(f)].startswith(d) for d in skip)])
    if not mine:
        return None
    f = mine[-1]
    return f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")


def _at(exc: BaseException, path: Path) -> str:
    """``"\\n  at WHERE"`` (:func:`user_frame`, preferring the model file ``path``) for a message, or ``""``."""
    where = user_frame(exc, path)
    return f"\n  at {where}" if where else ""


def forward_names(model: torch.nn.Module) -> list[str]:
    """The names of ``model.forward``'s positional parameters, in order (empty when it takes only ``*args``, or
    its signature cannot be read)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def mapping_inputs(inputs: Mapping, names: Sequence[str], what: str) -> tuple:
    """``inputs``, a mapping of ``forward`` argument names to tensors (a dict, a Hugging Face tokenizer's
    ``BatchEncoding``), as the tuple tctune calls the model with (``model(*inputs)``): its tensors in the order
    of ``forward``'s positional parameters ``names`` (:func:`forward_names`), whatever the mapping's own order.
    As the inputs go by position, the keys must be the first of ``names``: every parameter before the last one
    given is given too (``input_ids, attention_mask`` for ``forward(input_ids, attention_mask=None,
    token_type_ids=None)``; not ``input_ids, attention_mask`` for ``forward(input_ids, past_key_values=None,
    attention_mask=None)``).

    Args:
        inputs: the mapping; values are tensors of any shape and dtype.
        names: ``forward``'s positional parameter names, in order.
        what: the start of an error message (``"<Model>: example_inputs"``).

    Returns:
        The tuple ``(inputs[names[0]], ..., inputs[names[k]])``, ``k + 1 == len(inputs)``.

    Raises:
        ModelFileError: the mapping is empty; ``forward`` has no named positional parameters; a key is not one
            of them (a keyword-only or ``**kwargs`` argument); a parameter before the last given one is missing;
            or a value is not a tensor. The message names the keys and the fix.
    """
    keys = list(inputs)
    kind = type(inputs).__name__
    if not keys:
        raise ModelFileError(f"{what} is an empty {kind}\n  fix: map forward's argument names to tensors, e.g. "
                             f"{{'input_ids': ids}}, or pass a tuple of tensors")
    if not names:
        raise ModelFileError(f"{what} is a {kind} of named inputs ({', '.join(map(str, keys))}), but forward names "
                             f"no positional argument (forward(*args, **kwargs)), so their order is unknown\n"
                             f"  fix: pass a tuple of tensors in the order forward takes them")
    unknown = [k for k in keys if k not in names]
    if unknown:
        raise ModelFileError(f"{what}: {', '.join(map(repr, unknown))} not among forward's positional arguments "
                             f"({', '.join(names)}); tctune passes inputs by position\n  fix: key the tensors by "
                             f"those names (leave out any other), or, for a keyword-only or **kwargs argument the "
                             f"model needs, wrap it in a module whose forward takes every input by position, e.g. "
                             f"def forward(self, {', '.join(keys)}): return self.model("
                             + ", ".join([*(k for k in keys if k in names), *(f"{k}={k}" for k in unknown)])
                             + ")")
    last = max(names.index(k) for k in keys)
    missing = [n for n in names[:last] if n not in inputs]
    if missing:
        given = [n for n in names[:last + 1] if n in inputs]
        args = ", ".join(given)
        raise ModelFileError(
            f"{what} gives {args} but not {', '.join(missing)}, which forward takes before {names[last]!r}: tctune "
            f"passes inputs by position, so every argument up to the last one given is needed\n  fix: give "
            f"{', '.join(missing)} too, or wrap the model in a module whose forward takes only these inputs, e.g. "
            f"def forward(self, {args}): return self.model({', '.join(f'{n}={n}' for n in given)})")
    bad = [k for k in names[:last + 1] if not isinstance(inputs[k], torch.Tensor)]
    if bad:
        raise ModelFileError(f"{what}: {', '.join(f'{k!r} is a {type(inputs[k]).__name__}' for k in bad)}, not a "
                             f"tensor\n  fix: tensors only (a Hugging Face tokenizer returns them with "
                             f"return_tensors='pt')")
    return tuple(inputs[n] for n in names[:last + 1])


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
        here = str(p.resolve())  # the traceback holds the path as imported; compare resolved paths
        where = next((f" at line {f.lineno}" for f in reversed(tb)
                      if not f.filename.startswith("<") and str(Path(f.filename).resolve()) == here), "")
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
            better = " (higher is better)" if fn == "score" else ""
            raise ModelFileError(f"{p.name}: {fn} is a {type(obj).__name__}, not a function\n  expected: "
                                 f"{SIGNATURES[fn]}{better}")
        found[fn] = obj
    dynamic = getattr(module, "DYNAMIC_SHAPES", None)
    fn = getattr(module, "dynamic_shapes", None)
    if fn is not None:
        if dynamic is not None:
            raise ModelFileError(f"{p.name} defines both DYNAMIC_SHAPES and dynamic_shapes()\n  fix: keep one")
        if not callable(fn):
            raise ModelFileError(f"{p.name}: dynamic_shapes is a {type(fn).__name__}, not a function\n"
                                 "  fix: name the value DYNAMIC_SHAPES, or make dynamic_shapes() return it")
        try:
            dynamic = fn()
        except Exception as exc:
            raise ModelFileError(f"{p.name}: dynamic_shapes() raised {type(exc).__name__}: {exc}{_at(exc, p)}") \
                from exc
    if dynamic is not None and not isinstance(dynamic, (tuple, list, dict)):
        raise ModelFileError(f"{p.name}: DYNAMIC_SHAPES must be a tuple (one entry per input) or a dict by forward "
                             f"argument name, in torch.export's format; got {type(dynamic).__name__}")
    batched = getattr(module, "BATCHED_INPUTS", None)
    if batched is not None and not isinstance(batched, (tuple, list, str, int)):
        raise ModelFileError(f"{p.name}: BATCHED_INPUTS must be a tuple of input indices or forward argument "
                             f"names, got {type(batched).__name__}")
    return ModelFile(path=p.resolve(), name=p.stem, dynamic_shapes=dynamic, batched_inputs=batched, **found)


class _LazyNames:
    """Forward argument names for error messages, looked up (building the model once) only when one is raised."""

    def __init__(self, mf: ModelFile, n: int) -> None:
        self.mf, self.n, self._names = mf, n, None

    def arg(self, i: int) -> str:
        if self._names is None:
            try:
                self._names = self.mf.forward_names()
            except ModelFileError:
                self._names = []
        return self._names[i] if i < len(self._names) else ""

    def __getitem__(self, i: int) -> str:
        name = self.arg(i)
        return f" ({name})" if name else ""
