"""Overflow analysis: find the values a low-precision graph cannot hold, from calibration runs in FP32.

Why: fp16's largest finite value is 65504. A model whose activations exceed it (large weights, un-normalized
residual streams, some attention logits) produces inf / NaN at fp16 even though each op is "safe" by the
keep-list; the nodes found here run in FP32 as well (``PassSpec.fp32_nodes``). bf16 has fp32's exponent
range (largest finite 3.39e38), so it essentially never overflows.

Use, on the graph *as the precision pass will see it* (after the padding passes, before ``cast_precision``,
so node names match)::

    ranges = calibrate_ranges(gm, [example_inputs(8) for _ in range(4)])
    spec = dataclasses.replace(spec, fp32_nodes=overflow_nodes(ranges, spec.precision))
    cast_precision(gm, spec)   # those nodes, and the ops reading them, stay FP32

``calibrate_ranges`` also stores each node's max |x| in ``node.meta["tctune_max_abs"]`` so the precision pass
can quote it in its skip reason (``"overflow: max |x| 7.1e4 > 65504/2 at fp16 (module encoder.layer.3...)"``).

Non-finite values. The max is taken over the *finite* values only. An infinity the FP32 run itself produces
(a deliberate ``masked_fill(mask, float("-inf"))``, ``nn.MultiheadAttention``'s key-padding mask) is no
overflow: fp16 and bf16 hold +-inf, so keeping the op in FP32 would change nothing; the finite values beside it
still decide. A NaN in the FP32 run (a softmax over a row masked entirely with -inf) says nothing about range:
it is ignored too. Both are recorded in ``node.meta["tctune_nonfinite"]`` (``"inf"`` or ``"nan"``) and in
``CalibrationRanges.nonfinite``; :func:`ignored_reasons` words them for a report.
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterable, Sequence

import torch
from torch import fx

#: Largest finite value per low dtype (IEEE 754 binary16; bfloat16 has float32's exponent range).
FINITE_MAX: dict[str, float] = {"fp16": 65504.0, "bf16": float(torch.finfo(torch.bfloat16).max)}
#: ``node.meta`` key holding a node's calibrated max |x| over finite values (set by ``calibrate_ranges``).
MAX_ABS_META = "tctune_max_abs"
#: ``node.meta`` key set by ``calibrate_ranges`` when a node's FP32 output held ``"inf"`` or ``"nan"``.
NONFINITE_META = "tctune_nonfinite"


class CalibrationRanges(dict):
    """``{node name: max |x| over finite values}`` plus ``nonfinite``: ``{node name: "inf" | "nan"}`` for the
    nodes whose FP32 output also held infinities or NaN (``"nan"`` wins when both were seen)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.nonfinite: dict[str, str] = {}


class _RangeRecorder(fx.Interpreter):
    """Runs the graph node by node and keeps the running max |x| of every floating tensor output."""

    def __init__(self, gm: fx.GraphModule, ranges: CalibrationRanges) -> None:
        super().__init__(gm)
        self.ranges = ranges

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        stats = _max_abs(out)
        if stats is not None:
            peak, kind = stats
            self.ranges[n.name] = max(self.ranges.get(n.name, 0.0), peak)
            if kind is not None and self.ranges.nonfinite.get(n.name) != "nan":
                self.ranges.nonfinite[n.name] = kind
        return out


def _max_abs(value: Any) -> tuple[float, str | None] | None:
    """(max |x| over the finite values, ``"nan"`` / ``"inf"`` / None for the non-finite ones seen) over the
    floating tensors in ``value`` (nested lists/tuples); None when there are none."""
    tensors = [t.detach() for t in torch.utils._pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not tensors:
        return None
    peak, kind = 0.0, None
    for t in tensors:
        finite = torch.isfinite(t)
        if bool(finite.all()):
            peak = max(peak, t.abs().max().item())
            continue
        if bool(finite.any()):
            peak = max(peak, t.abs().masked_fill(~finite, 0).max().item())
        kind = "nan" if kind == "nan" or bool(torch.isnan(t).any()) else "inf"
    return peak, kind


def calibrate_ranges(gm: fx.GraphModule, inputs_list: Iterable[Sequence[torch.Tensor]]) -> CalibrationRanges:
    """Run ``gm`` in FP32 over calibration inputs and record each node's max |activation|.

    Args:
        gm: an ATen-level graph module (FP32 weights), typically right before ``cast_precision``.
        inputs_list: calibration batches; each is the positional inputs of one call, e.g.
            ``[(ids,), (ids2,)]`` for a ``(batch, seq)`` int64 input.

    Returns:
        A :class:`CalibrationRanges`: ``{node name: max |x|}`` over every node with a floating tensor output,
        the max taken over the finite values of all batches (0.0 when a node held none), stored in
        ``node.meta["tctune_max_abs"]`` too; ``.nonfinite`` names the nodes whose FP32 output held infinities
        or NaN (also in ``node.meta["tctune_nonfinite"]``; see the module docstring).

    Raises:
        Whatever the graph raises on an input of the wrong shape or dtype.
    """
    ranges = CalibrationRanges()
    with torch.no_grad():
        for inputs in inputs_list:
            _RangeRecorder(gm, ranges).run(*inputs)
    for node in gm.graph.nodes:
        if node.name in ranges:
            node.meta[MAX_ABS_META] = ranges[node.name]
        if node.name in ranges.nonfinite:
            node.meta[NONFINITE_META] = ranges.nonfinite[node.name]
        else:
            node.meta.pop(NONFINITE_META, None)
    return ranges


def overflow_nodes(ranges: dict[str, float], precision: str, margin: float = 2.0) -> frozenset:
    """Names of the nodes whose calibrated max |x| exceeds the low dtype's finite range / ``margin``.

    Infinite and NaN values never make a node overflow (module docstring): a plain dict whose value is ``inf``
    or ``nan`` (no finite max known) gives no overflow for that node; see :func:`ignored_reasons`.

    Args:
        ranges: ``calibrate_ranges``'s result (or a plain ``{name: max |x|}`` dict).
        precision: ``"fp16"`` (limit 65504), ``"bf16"`` (limit 3.39e38: essentially never), or ``"fp32"`` /
            ``"tf32"`` (nothing overflows: empty set).
        margin: head-room factor (default 2: a value seen at 40000 in calibration may reach 65504 on
            other inputs).

    Returns:
        A frozenset of node names for ``PassSpec.fp32_nodes`` (pass ``margin`` as ``overflow_margin``).

    Raises:
        ValueError: ``margin`` is not positive.
    """
    if margin <= 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    limit = FINITE_MAX.get(precision)
    if limit is None:
        return frozenset()
    return frozenset(name for name, peak in ranges.items() if math.isfinite(peak) and peak > limit / margin)


def ignored_reasons(ranges: dict[str, float]) -> dict[str, str]:
    """``{node name: reason}`` for the calibration statistics ``overflow_nodes`` did not treat as overflow.

    ``"calibration: FP32 run gave NaN here; ignored for overflow"`` or ``"calibration: FP32 run gave +-inf here
    (kept as inf in the low dtype); finite max |x| 3.2e+01 decides"``. Reads
    ``ranges.nonfinite`` when ``ranges`` is a :class:`CalibrationRanges`, else the ``inf`` / ``nan`` values.
    """
    kinds = dict(getattr(ranges, "nonfinite", {}) or {})
    for name, peak in ranges.items():
        if not math.isfinite(peak):
            kinds.setdefault(name, "nan" if math.isnan(peak) else "inf")
    out: dict[str, str] = {}
    for name, kind in kinds.items():
        if kind == "nan":
            out[name] = "calibration: FP32 run gave NaN here; ignored for overflow"
        else:
            peak = ranges.get(name, float("inf"))
            tail = f"finite max |x| {peak:.1e} decides" if math.isfinite(peak) else "no finite max known"
            out[name] = f"calibration: FP32 run gave +-inf here (kept as inf in the low dtype); {tail}"
    return out


def source_module(node: fx.Node) -> str | None:
    """The dotted path of the innermost module ``node`` came from (``node.meta["nn_module_stack"]``), as
    ``model.named_modules()`` names it: ``"encoder.layer.0.attention"``. Dynamo's spelling of the same path
    (``"L['self'].encoder.layer[0]._modules['attention']"``, which a graph compiled through ``torch.compile``
    carries) is rewritten to that form; None when the node has no module but the root."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if isinstance(v, tuple) and v and v[0]]
    path = module_path(paths[-1]) if paths else ""
    return path or None


#: Dynamo's root of a module path (a local ``L['self']``, a global ``G['model']``) and its item accesses
#: (``._modules['x']``, ``[0]``, ``['key']``).
_DYNAMO_ROOT = re.compile(r"^[LG]\[['\"][^'\"]*['\"]\]\.?")
_DYNAMO_ITEM = re.compile(r"(?:\.?_(?:modules|parameters|buffers))?\[['\"]?([^\]'\"]*)['\"]?\]")


def module_path(path: str) -> str:
    """``path`` (an ``nn_module_stack`` entry) in ``named_modules()`` form: Dynamo's root (``L['self']``,
    ``G['model']``) dropped and its item accesses written as dotted names (``._modules['h'][0]`` -> ``.h.0``);
    other paths unchanged."""
    path = _DYNAMO_ROOT.sub("", path)
    path = _DYNAMO_ITEM.sub(lambda m: "." + m.group(1), path)
    return path.lstrip(".")


__all__ = ["CalibrationRanges", "FINITE_MAX", "MAX_ABS_META", "NONFINITE_META", "calibrate_ranges",
           "ignored_reasons", "module_path", "overflow_nodes", "source_module"]
