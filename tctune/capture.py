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
from typing import Any

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
    model = copy.deepcopy(model)
    named = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    try:
        ep = _export(model, inputs, named)
    except Exception as exc:
        message = str(exc)
        if "Constraints violated" not in message:
            raise _capture_error(exc) from exc
        # The model (or an op's meta function, e.g. a 32-bit-indexing check on a large image batch) bounds the
        # batch below MAX_BATCH. Dim.DYNAMIC lets export narrow the range instead of failing; a batch it pins
        # to one value is still an error.
        try:
            ep = _export(model, inputs, torch.export.Dim.DYNAMIC)
        except Exception:
            raise _capture_error(exc) from exc  # the named-batch error reads better ("(batch)")
        lo, hi = _batch_range(ep)
        if lo is None or not _only_bounds(ep):
            raise _capture_error(exc) from exc
        if lo > 1:  # Dim.DYNAMIC starts at 2; a named Dim with the narrowed max keeps batch 1 (best effort)
            try:
                ep = _export(model, inputs, torch.export.Dim("batch", min=1, max=hi))
                lo = 1
            except Exception:  # noqa: BLE001 - keep the Dim.DYNAMIC program
                pass
        log.info("torch.export bounded the dynamic batch: tctune's graph accepts batch %s..%s", lo, hi)
    else:
        lo, hi = _batch_range(ep)
    gm = ep.module()
    gm.meta["tctune_batch_range"] = (lo if lo is not None else 1, hi if hi is not None else MAX_BATCH)
    return gm


def batch_range(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """``(min, max)`` batch a graph from :func:`capture` accepts (export may narrow it below ``MAX_BATCH``)."""
    return tuple(gm.meta.get("tctune_batch_range", (1, MAX_BATCH)))  # type: ignore[return-value]


def _export(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], batch: Any):
    dynamic = tuple({0: batch} for _ in inputs)
    printed = io.StringIO()
    try:
        # torch.export prints graph dumps and logs shape warnings when it fails: keep the user's terminal clean.
        with warnings.catch_warnings(), _quiet_torch_logs(), contextlib.redirect_stdout(printed), \
                contextlib.redirect_stderr(printed):
            warnings.simplefilter("ignore")
            return torch.export.export(model, tuple(inputs), dynamic_shapes=dynamic, strict=False)
    except Exception as exc:
        exc._tctune_printed = printed.getvalue()  # type: ignore[attr-defined]
        raise


def _capture_error(exc: BaseException) -> CaptureError:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return CaptureError(
        f"torch.export could not capture the model with a dynamic batch: {type(exc).__name__}: {first[:300]}"
        + _hint(text, getattr(exc, "_tctune_printed", ""))
    )


def _batch_range(ep) -> tuple[int | None, int | None]:
    """The range of the first input's dim 0 in an ExportedProgram; ``(None, None)`` when it is a constant."""
    user_inputs = _user_input_names(ep)
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in user_inputs:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        size = val.shape[0]
        if not isinstance(size, torch.SymInt):
            return None, None
        vr = ep.range_constraints.get(size.node.expr)
        if vr is None:
            return 1, MAX_BATCH
        return _as_int(vr.lower, 1), min(_as_int(vr.upper, MAX_BATCH), MAX_BATCH)
    return None, None


def _only_bounds(ep) -> bool:
    """Whether the exported program's input guards are bounds only (``size <= 1000``, ``size < 32``), which
    :func:`batch_range` describes. A guard like ``size != 32`` (a model branching on one batch size) is a hole
    in the range that the tuner could not see: such a model is not captured."""
    guards = getattr(ep, "_guards_code", None) or []  # torch >= 2.9; absent: the range is all there is
    return all(("!=" not in g and "==" not in g) for g in guards)


def _as_int(bound: Any, default: int) -> int:
    try:
        return int(bound)
    except Exception:  # noqa: BLE001 - sympy's oo / int_oo raise TypeError, OverflowError or AttributeError
        return default


def _user_input_names(ep) -> set[str]:
    from torch.export.graph_signature import InputKind

    return {spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT}


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
    # torch logs a failing fake-tensor op at ERROR level with its traceback, through a handler bound to the
    # terminal's stderr (not redirectable): tctune reports the failure itself, in one message.
    names = ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._dynamo", "torch._export",
             "torch._subclasses.fake_tensor")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
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
