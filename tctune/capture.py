"""Capture a model as an ATen-level FX graph with ``torch.export`` and a dynamic batch dimension.

``torch.export.export(..., strict=False)`` keeps ops such as ``aten.linear``, ``aten.conv2d``,
``aten.layer_norm`` and ``aten.scaled_dot_product_attention`` whole, with weights as ``get_attr`` nodes
in ``ExportedProgram.module()``: the graph the passes in ``passes/`` rewrite.
"""
from __future__ import annotations

import copy
import logging
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
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(model, tuple(inputs), dynamic_shapes=dynamic, strict=False)
        return ep.module()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(
            f"torch.export could not capture the model with a dynamic batch: {type(exc).__name__}: {first[:300]}"
        ) from exc


def try_capture(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> Captured:
    """Like :func:`capture` but returns the reason instead of raising (the tuner then runs eagerly)."""
    try:
        return Captured(capture(model, inputs))
    except CaptureError as exc:
        log.warning("%s; tctune will run the model eagerly without graph passes", exc)
        return Captured(None, str(exc))
