"""Capture a model as an ATen-level FX graph with ``torch.export`` and a dynamic batch dimension.

``torch.export.export(..., strict=False)`` keeps ops such as ``aten.linear``, ``aten.conv2d``,
``aten.layer_norm`` and ``aten.scaled_dot_product_attention`` whole, with weights as ``get_attr`` nodes
in ``ExportedProgram.module()``: the graph the passes in ``passes/`` rewrite.
"""
from __future__ import annotations

import contextlib
import copy
import io
import logging
import re
import warnings
from dataclasses import dataclass

import torch

from .errors import CaptureError

log = logging.getLogger("tctune")

#: Largest batch the captured graph accepts (torch.export needs a bound for the symbolic batch).
MAX_BATCH = 1 << 16


@dataclass
class Captured:
    """The outcome of capture: a graph module, or the reason there is none."""

    graph_module: torch.fx.GraphModule | None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.graph_module is not None


def capture(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.fx.GraphModule:
    """Export ``model`` on ``inputs`` with dim 0 of every input a shared dynamic batch.

    Args:
        model: the module in the mode it will be measured in (``eval()`` for inference).
        inputs: example inputs, each of shape ``(batch, ...)``; batch ≥ 2 so it is not specialized.

    Returns:
        ``ExportedProgram.module()``: an FX GraphModule that takes the same inputs and returns the same
        output structure as ``model``; its parameters are a deep copy (passes may rewrite them).

    Raises:
        CaptureError: torch.export failed; the message gives its first line and the fix (run eagerly).
    """
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    dynamic = tuple({0: batch} for _ in inputs)
    model = copy.deepcopy(model)
    printed = io.StringIO()
    try:
        # torch.export prints graph dumps and logs shape warnings when it fails: keep the user's terminal clean.
        with warnings.catch_warnings(), _quiet_torch_logs(), contextlib.redirect_stdout(printed), \
                contextlib.redirect_stderr(printed):
            warnings.simplefilter("ignore")
            ep = torch.export.export(model, tuple(inputs), dynamic_shapes=dynamic, strict=False)
        return ep.module()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(
            f"torch.export could not capture the model with a dynamic batch: {type(exc).__name__}: {first[:300]}"
            + _hint(str(exc), printed.getvalue())
        ) from exc


_WHERE = re.compile(r"# File: (\S+?:\d+) in \w+, code: (.*)")


def _hint(message: str, printed: str) -> str:
    """Plain words and a fix for the usual reasons torch.export fails, with the user's line where known."""
    where = _WHERE.search(printed) or _WHERE.search(message)
    at = f" at {where.group(1)} (`{where.group(2).strip()}`)" if where else ""
    if "data-dependent" in message or "DataDependent" in message:
        return (f"\n  cause: Python control flow on tensor *values*{at}\n"
                "  fix: use torch.where / torch.cond instead of `if` on a tensor (tctune runs the model eagerly meanwhile)")
    if "Constraints violated" in message and "batch" in message:
        return (f"\n  cause: the model fixes the batch size{at} (a branch on x.shape[0], or a hard-coded batch in "
                "view/reshape/expand)\n  fix: use x.shape[0] or -1 (tctune runs the model eagerly meanwhile)")
    return ""


@contextlib.contextmanager
def _quiet_torch_logs():
    names = ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._dynamo", "torch._export")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def try_capture(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> Captured:
    """Like :func:`capture` but returns the reason instead of raising (the tuner then runs eagerly)."""
    try:
        return Captured(capture(model, inputs))
    except CaptureError as exc:
        log.debug("%s; tctune will run the model eagerly without graph passes", exc)
        return Captured(None, str(exc))
