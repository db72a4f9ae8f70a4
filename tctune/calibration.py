"""Real input batches: the model file's ``calibration_inputs()`` or a folder of ``.safetensors`` / ``.npz`` files.

Real batches are used beside the seeded random inputs of ``example_inputs``:

- the FP32-reference comparison: each candidate is also run on every real batch and compared with the FP32
  model's outputs on it; the trial's error statistics are the worst over the random and the real inputs;
- the fp16 overflow calibration of tctune's graph (``passes.build_graph``'s ``calibration``): a node that
  overflows fp16 on real data stays FP32 even when random data does not reach its range;
- the static activation scales of the FP8 ONNX export.

Folder format (one file = one batch = one tuple of input tensors, read in sorted file-name order):

- ``.safetensors`` (read with ``safetensors.torch.load_file``) or ``.npz`` (``numpy.load(allow_pickle=False)``:
  object arrays are refused, nothing is unpickled); the suffix in any case (``.NPZ``). Other entries of the folder
  (files of other suffixes, subfolders) are not read and are named in one warning of the ``tctune`` logger;
  hidden entries (a name starting with ``.``, e.g. ``.DS_Store``) are skipped without one. A folder without a
  batch file is an error that names what it holds.
- Keys ``input_0``, ``input_1``, ... (the position in ``example_inputs``' tuple), or the names of the model's
  ``forward`` parameters (``input_ids``, ``attention_mask``, ...).
- Each tensor has the dtype and rank of the matching ``example_inputs`` tensor; dim 0 is the batch (any size,
  the same for every tensor of the file). Other dims must be ones the model (and tctune's captured graph,
  which has a dynamic batch only) accepts: every batch is run once in FP32 before any trial.

Any problem raises one error naming the file (or the ``calibration_inputs()`` batch) and the expected shapes
and dtypes, before the search starts.
"""
from __future__ import annotations

import inspect
import logging
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from .errors import ModelFileError, UsageError

log = logging.getLogger("tctune")

#: File suffixes read from a calibration folder.
SUFFIXES = (".safetensors", ".npz")
#: The ``fix:`` lines of the errors on bad real batches (:func:`check_batch`, :func:`load_calibration`).
FIX_KEYS = "name the arrays input_0, input_1, ... in the order of example_inputs (or as forward's arguments)"
FIX_BATCH = "make each batch a tuple with one tensor per example_inputs tensor, in the same order"
FIX_SHAPES = ("give each tensor the shape example_inputs(B) gives it, with any batch size B in dim 0 (other "
              "dimensions as in example_inputs), or leave this batch out")
#: The ``fix:`` line of the error on a batch file that cannot be read (``{want}``: :func:`expected`).
FIX_FILE = ("a batch file holds one numeric array per input, named input_0, input_1, ... ({want}): write it with "
            "numpy.savez(path, input_0=x0, ...) or safetensors.torch.save_file({{'input_0': x0, ...}}, path), "
            "or move the file out of the folder")
#: How many ignored folder entries a message names before it says "and N more".
NAMED_IGNORED = 8


@dataclass
class CalibrationBatch:
    """One real input batch.

    Attributes:
        source: where it came from: a file name, or ``calibration_inputs() batch <i>`` (0-based).
        inputs: the input tuple, on the measuring device (batch on dim 0).
        reference: the FP32 model's outputs on ``inputs`` (filled by :func:`load_calibration`).
    """

    source: str
    inputs: tuple[torch.Tensor, ...]
    reference: Any = None


def input_names(model: torch.nn.Module) -> list[str]:
    """The names of ``model.forward``'s positional parameters, in order (empty when it takes ``*args``)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def expected(example: Sequence[torch.Tensor]) -> str:
    """``input_0: float32 (B, 1, 8, 8)``-style description of ``example`` (B: any batch size)."""
    return ", ".join(f"input_{i}: {str(t.dtype).replace('torch.', '')} (B{''.join(', ' + str(s) for s in t.shape[1:])})"
                     for i, t in enumerate(example))


class _Unreadable(Exception):
    """A batch file that cannot be read; the message is the cause in plain words."""


#: The first bytes of a zip archive (an ``.npz`` is one: a local file header, or an empty archive's end record).
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
#: The first bytes of a single ``.npy`` array (``numpy.save``).
_NPY_MAGIC = b"\x93NUMPY"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _read_npz(path: Path) -> dict[str, torch.Tensor]:
    import numpy as np

    with path.open("rb") as fh:
        head = fh.read(8)
    if head.startswith(_NPY_MAGIC):
        raise _Unreadable("it is a single .npy array (numpy.save), not an .npz archive of named arrays")
    if head[:4] not in _ZIP_MAGIC:
        raise _Unreadable(f"it is not an .npz archive (a zip of .npy arrays): it starts with the bytes {head[:4]!r}, "
                          "so it is another format or was damaged")
    try:
        data = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as exc:
        raise _Unreadable(f"it is a damaged .npz (zip) archive, e.g. truncated while written ({_first_line(exc)})") from None
    out = {}
    with data:
        for k in data.files:
            try:
                arr = data[k]
            except ValueError as exc:
                if "allow_pickle" in str(exc) or "Object arrays" in str(exc):
                    raise _Unreadable(f"its array {k!r} holds Python objects (dtype object), which are refused: "
                                      "reading them would unpickle them, which can run code") from None
                raise _Unreadable(f"its array {k!r} cannot be read ({_first_line(exc)})") from None
            except (zipfile.BadZipFile, EOFError, OSError) as exc:
                raise _Unreadable(f"its array {k!r} is damaged, e.g. truncated while written ({_first_line(exc)})") from None
            try:
                out[k] = torch.from_numpy(np.ascontiguousarray(arr))
            except TypeError:
                raise _Unreadable(f"its array {k!r} has dtype {arr.dtype}, which is not a tensor dtype (numbers "
                                  "and bools only)") from None
    return out


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    """The named tensors of one batch file; raises :class:`_Unreadable` with the cause when it cannot be read."""
    if path.stat().st_size == 0:
        raise _Unreadable("the file is empty (0 bytes)")
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path)))
        except Exception as exc:  # noqa: BLE001 - safetensors' own error class; any damage
            raise _Unreadable(f"it is not a valid safetensors file ({_first_line(exc)})") from None
    return _read_npz(path)


def _named(entries: Sequence[Path]) -> str:
    names = [e.name + ("/" if e.is_dir() else "") for e in entries]
    more = len(names) - NAMED_IGNORED
    return ", ".join(names[:NAMED_IGNORED]) + (f" and {more} more" if more > 0 else "")


def read_folder(folder: str | Path, example: Sequence[torch.Tensor], names: Sequence[str] = ()) -> list[CalibrationBatch]:
    """The batches of a calibration folder, in sorted file-name order, checked against ``example``.

    Args:
        folder: a folder of ``.safetensors`` / ``.npz`` files (see the module docstring).
        example: one ``example_inputs`` tuple (dtypes and ranks to match; batch size irrelevant).
        names: the model's input names (:func:`input_names`), accepted as keys besides ``input_<i>``.

    Returns:
        One :class:`CalibrationBatch` per file (on the CPU, ``reference`` None).

    Raises:
        UsageError (field ``calibration``): no such folder, no batch file in it (the message names what the
            folder holds), or a file that cannot be read (the message names the file and the cause: empty, not an
            ``.npz`` / safetensors file, a damaged archive, an object array), has other keys, or holds a tensor of
            another dtype or rank than ``example`` (the message names the file and the expected inputs).

    Other entries of the folder are named in one warning (``tctune`` logger); hidden ones are skipped.
    """
    p = Path(folder).expanduser()
    want = expected(example)
    if not p.is_dir():
        raise UsageError(f"calibration {p}: not a folder\n  fix: a folder of .safetensors or .npz files, one batch "
                         f"each, with keys input_0, input_1, ... ({want})", field="calibration")
    entries = sorted(e for e in p.iterdir() if not e.name.startswith("."))
    files = [f for f in entries if f.suffix.lower() in SUFFIXES and f.is_file()]
    ignored = [e for e in entries if e not in files]
    if not files:
        held = f" (it holds {_named(ignored)}, none of them a batch file)" if ignored else " (it is empty)"
        raise UsageError(f"calibration {p} holds no .safetensors or .npz file{held}\n  fix: put one .safetensors or "
                         f".npz file per batch in it, with keys input_0, input_1, ... ({want})", field="calibration")
    if ignored:
        log.warning("calibration %s: not read (not .safetensors / .npz batch files): %s", p, _named(ignored))
    out = []
    for f in files:
        try:
            data = _read_file(f)
        except (_Unreadable, OSError) as exc:
            cause = str(exc) if isinstance(exc, _Unreadable) else _first_line(exc)
            raise UsageError(f"calibration file {f}: cannot be read: {cause}\n  fix: {FIX_FILE.format(want=want)}",
                             field="calibration") from None
        out.append(CalibrationBatch(f.name, _order(data, example, names, f)))
    for b in out:
        check_batch(b, example, lambda msg: UsageError(f"calibration file {p / b.source}: {msg}", field="calibration"))
    return out


def _order(data: dict[str, torch.Tensor], example: Sequence[torch.Tensor], names: Sequence[str], f: Path) -> tuple:
    n = len(example)
    positional = [f"input_{i}" for i in range(n)]
    named = list(names[:n])
    for keys in (positional, named):
        if keys and set(keys) == set(data):
            return tuple(data[k] for k in keys)
    alt = f" or {', '.join(named)}" if len(named) == n else ""
    raise UsageError(f"calibration file {f}: has keys {', '.join(sorted(data)) or '(none)'}; expected exactly "
                     f"{', '.join(positional)}{alt} ({expected(example)})\n  fix: {FIX_KEYS}", field="calibration")


def check_batch(batch: CalibrationBatch, example: Sequence[torch.Tensor], error) -> None:
    """Raise ``error(message)`` when ``batch.inputs`` is not a tuple of tensors like ``example`` (count, dtype,
    rank, one batch size); the message lists the expected inputs."""
    want = expected(example)
    x = batch.inputs
    if not isinstance(x, tuple) or not all(isinstance(t, torch.Tensor) for t in x):
        raise error(f"is a {type(x).__name__}, not a tuple of tensors; expected {want}\n  fix: {FIX_BATCH}")
    if len(x) != len(example):
        raise error(f"has {len(x)} input tensor(s), the model takes {len(example)}: {want}\n  fix: {FIX_BATCH}")
    for i, (t, e) in enumerate(zip(x, example)):
        dtype = str(e.dtype).replace('torch.', '')
        if t.dtype != e.dtype:
            raise error(f"input_{i} is {str(t.dtype).replace('torch.', '')}, expected {dtype}; expected {want}\n"
                        f"  fix: store input_{i} as {dtype} (numpy: .astype(numpy.{dtype}); torch: .to(torch.{dtype}))")
        if t.dim() != e.dim():
            raise error(f"input_{i} has shape {tuple(t.shape)} (rank {t.dim()}), expected rank {e.dim()}; expected {want}"
                        f"\n  fix: {FIX_SHAPES}")
    if len({t.shape[0] for t in x}) != 1:
        raise error(f"its inputs have different batch sizes {[t.shape[0] for t in x]} (dim 0); expected {want}"
                    "\n  fix: give every tensor of one batch the same size in dim 0")


def from_model_file(mf, example: Sequence[torch.Tensor]) -> list[CalibrationBatch]:
    """The batches of ``mf.calibration_inputs()`` (on the CPU, as given), checked against ``example``. A batch
    that is a mapping by ``forward``'s argument names is taken in ``forward``'s order
    (:func:`tctune.modelfile.mapping_inputs`).

    Raises:
        ModelFileError: the function raised, did not return an iterable, or a batch is not like ``example``.
    """
    what = f"{mf.path.name}: calibration_inputs()"
    try:
        batches = [(b,) if isinstance(b, torch.Tensor) else b for b in mf.calibration_inputs()]
    except Exception as exc:  # the user's code
        raise ModelFileError(f"{what} raised {type(exc).__name__}: {exc}\n  expected: "
                             "def calibration_inputs() -> Iterable[tuple[torch.Tensor, ...]]\n  fix: make "
                             "calibration_inputs() return its batches without raising (call it on its own to see "
                             "the full error), or remove it") from exc
    out = []
    for i, b in enumerate(batches):
        if isinstance(b, Mapping):  # a batch by forward's argument names, as example_inputs may give it
            from .modelfile import mapping_inputs

            b = mapping_inputs(b, mf.forward_names(), f"{what} batch {i}")
        batch = CalibrationBatch(f"calibration_inputs() batch {i}", tuple(b) if isinstance(b, list) else b)
        check_batch(batch, example, lambda msg, i=i: ModelFileError(f"{what} batch {i} {msg}"))
        out.append(batch)
    return out


def load_calibration(mf, folder: str | Path | None, model: torch.nn.Module, device: torch.device,
                     graph: torch.nn.Module | None = None) -> list[CalibrationBatch]:
    """The real batches of a run, on ``device``, each run once in FP32 (its ``reference``).

    Args:
        mf: the model file (``calibration_inputs`` used when ``folder`` is None).
        folder: ``--calibration``'s folder, or None.
        model: the FP32 eval-mode model on ``device``.
        graph: tctune's captured graph, when there is one: each batch must run through it too (its non-batch
            dims are those of the capture).

    Returns:
        The batches (empty when there are none).

    Raises:
        UsageError / ModelFileError: see :func:`read_folder` / :func:`from_model_file`; or a batch on which the
            FP32 model or the captured graph raises (naming the batch and the expected inputs).
    """
    if folder is None and getattr(mf, "calibration_inputs", None) is None:
        return []
    torch.manual_seed(0)
    example = mf.inputs(2, "cpu")
    if folder is not None:
        root = Path(folder).expanduser()
        batches = read_folder(root, example, input_names(model))

        def error(msg):
            return UsageError(msg, field="calibration")

        def where(source):
            return f"calibration file {root / source}"
    else:
        batches = from_model_file(mf, example)
        error = ModelFileError

        def where(source):
            return f"{mf.path.name}: {source}"
    from .measure import precision_mode

    for b in batches:
        b.inputs = tuple(t.to(device) for t in b.inputs)
        for what, fn in (("the FP32 model", model), ("tctune's captured graph (dynamic batch only)", graph)):
            if fn is None:
                continue
            try:
                with precision_mode("fp32"), torch.inference_mode():
                    out = fn(*b.inputs)
            except Exception as exc:  # noqa: BLE001 - the user's data or model
                shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in b.inputs)
                raise error(f"{where(b.source)}: {what} raised {type(exc).__name__} on it: "
                            f"{(str(exc).strip().splitlines() or [''])[0][:200]}\n  its inputs: {shapes}; expected "
                            f"{expected(example)} (shapes other than the batch as in example_inputs)\n"
                            f"  fix: {FIX_SHAPES}") from None
            if fn is model:
                b.reference = out
    return batches


__all__ = ["CalibrationBatch", "FIX_BATCH", "FIX_FILE", "FIX_KEYS", "FIX_SHAPES", "SUFFIXES", "check_batch", "expected", "from_model_file", "input_names",
           "load_calibration", "read_folder"]
