"""tctune's exceptions: one root, one subclass per stage.

Every error a user can cause carries a message that names the cause and the fix; the CLI prints that
message alone (no traceback unless ``--debug``) and exits non-zero.
"""
from __future__ import annotations

import os

#: The file in an output folder that holds the full text (traceback, C++ backtrace) of each error a stage
#: recorded instead of stopping on it (``tctune optimize``'s stages after the trials, ``tctune export``'s
#: AOTInductor package); the console and the report carry one line each.
ERROR_LOG = "tctune_errors.log"


class TctuneError(Exception):
    """Root of every error tctune raises on purpose."""


class ModelFileError(TctuneError):
    """The model file is missing, unreadable, or breaks the model-file contract (``tctune/modelfile.py``)."""


class CaptureError(TctuneError):
    """torch.export could not capture the model; the model runs eagerly without graph passes."""


class PassError(TctuneError):
    """A graph pass failed; the message names the pass and the passes that ran before it."""


class CandidateRejected(TctuneError):
    """A candidate configuration is illegal or inaccurate, e.g. 'fp16 output has 3 inf values'.

    Attributes:
        kind: a ``tctune.trial.FailureKind`` value when the raiser knows it, else None (the search classifies).
    """

    def __init__(self, message: str = "", kind=None):
        super().__init__(message)
        self.kind = kind


class ExportError(TctuneError):
    """An engine (ONNX, TensorRT, AOTInductor) could not be built or did not match PyTorch."""


class HardwareError(TctuneError):
    """The GPU or ``--target`` is unknown or unsupported (e.g. compute capability below 7.0)."""


class UsageError(TctuneError):
    """An option has an invalid value.

    Attributes:
        field: the option's name in the library (a ``TuneConfig`` field such as ``"batch_sizes"``), or None.
            The library's messages name the field where they mean the option (and only there: the CLI rewrites
            every occurrence of the field name to its flag, ``--batch-sizes``).
    """

    def __init__(self, message: str = "", field: str | None = None):
        super().__init__(message)
        self.field = field


def append_error_log(folder: str | os.PathLike, stage: str, exc: BaseException) -> str:
    """Append ``exc``'s full traceback (chained causes included) to ``folder/``:data:`ERROR_LOG` under a
    ``=== <UTC time> stage <stage>`` header; returns the file's path.

    Raises:
        OSError: the file cannot be written (the caller keeps its one-line message).
    """
    import traceback
    from datetime import datetime, timezone

    path = os.path.join(os.fspath(folder), ERROR_LOG)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(f"=== {datetime.now(timezone.utc).isoformat(timespec='seconds')} stage {stage}\n")
        handle.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) + "\n")
    return path


def clip(line: str, limit: int = 300) -> str:
    """``line`` cut to at most ``limit`` characters (plus " ...") at a sentence's or word's end: a message cut
    mid-word reads as a bug in tctune. ``line`` unchanged when it fits."""
    if len(line) <= limit:
        return line
    head = line[:limit]
    end = max(head.rfind(". "), head.rfind(": "), head.rfind("; "))
    if end >= limit // 3:
        return head[:end + 1] + " ..."
    space = head.rfind(" ")
    return (head[:space] if space > 0 else head) + " ..."


def did_you_mean(word: str, choices, prefix: str = "") -> str:
    """``" (did you mean 'x'?)"`` naming the choice closest to ``word`` (``difflib.get_close_matches``, cutoff
    0.6; each choice written with ``prefix``, e.g. ``"--"`` for a flag), or ``""`` when none is close."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {prefix}{close[0]}?)" if prefix else f" (did you mean {close[0]!r}?)"

