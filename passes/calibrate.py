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
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import torch
from torch import fx

#: Largest finite value per low dtype (IEEE 754 binary16; bfloat16 has float32's exponent range).
FINITE_MAX: dict[str, float] = {"fp16": 65504.0, "bf16": float(torch.finfo(torch.bfloat16).max)}
#: ``node.meta`` key holding a node's calibrated max |x| (set by ``calibrate_ranges``).
MAX_ABS_META = "tctune_max_abs"


class _RangeRecorder(fx.Interpreter):
    """Runs the graph node by node and keeps the running max |x| of every floating tensor output."""

    def __init__(self, gm: fx.GraphModule, ranges: dict[str, float]) -> None:
        super().__init__(gm)
        self.ranges = ranges

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        peak = _max_abs(out)
        if peak is not None:
            self.ranges[n.name] = max(self.ranges.get(n.name, 0.0), peak)
        return out


def _max_abs(value: Any) -> float | None:
    """Max |x| over the floating tensors in ``value`` (nested lists/tuples), None when there are none."""
    tensors = [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    peaks = [t.detach().abs().max().item() for t in tensors if t.is_floating_point() and t.numel()]
    return max(peaks) if peaks else None


def calibrate_ranges(gm: fx.GraphModule, inputs_list: Iterable[Sequence[torch.Tensor]]) -> dict[str, float]:
    """Run ``gm`` in FP32 over calibration inputs and record each node's max |activation|.

    Args:
        gm: an ATen-level graph module (FP32 weights), typically right before ``cast_precision``.
        inputs_list: calibration batches; each is the positional inputs of one call, e.g.
            ``[(ids,), (ids2,)]`` for a ``(batch, seq)`` int64 input.

    Returns:
        ``{node name: max |x|}`` over every node with a floating tensor output (float; ``inf`` / ``nan``
        if the FP32 run itself produced them), the max taken over all batches. The same values are stored
        in ``node.meta["tctune_max_abs"]``.

    Raises:
        Whatever the graph raises on an input of the wrong shape or dtype.
    """
    ranges: dict[str, float] = {}
    with torch.no_grad():
        for inputs in inputs_list:
            _RangeRecorder(gm, ranges).run(*inputs)
    for node in gm.graph.nodes:
        if node.name in ranges:
            node.meta[MAX_ABS_META] = ranges[node.name]
    return ranges


def overflow_nodes(ranges: dict[str, float], precision: str, margin: float = 2.0) -> frozenset:
    """Names of the nodes whose calibrated max |x| exceeds the low dtype's finite range / ``margin``.

    Args:
        ranges: ``calibrate_ranges``'s result.
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
    return frozenset(name for name, peak in ranges.items() if math.isnan(peak) or peak > limit / margin)


def source_module(node: fx.Node) -> str | None:
    """The dotted path of the innermost module ``node`` came from (``node.meta["nn_module_stack"]``)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if isinstance(v, tuple) and v and v[0]]
    return paths[-1] if paths else None


__all__ = ["FINITE_MAX", "MAX_ABS_META", "calibrate_ranges", "overflow_nodes", "source_module"]
