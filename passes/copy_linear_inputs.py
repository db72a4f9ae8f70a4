"""Copy a linear's input to row-major when ATen would otherwise run it as a batched GEMM per leading index.

Why: ``aten.linear`` on an input of 3 or more dimensions (and ``aten.matmul`` of such an input with a 2-D right
operand, which lowers the same way) runs ATen's ``matmul``. That folds the leading dimensions into one
``(tokens, K) x (K, N)`` GEMM only when the fold is a view of the input (``passes._graph.rows_foldable``) or when
the weight requires grad (then it copies the input first). A frozen weight (the ``get_attr`` buffers of
``tctune.backend``'s inference graphs, ``fuse_qkv``'s fused weights) gets neither: the linear becomes a GEMM
batched over the first dimension with the weight broadcast (batch stride 0), one small GEMM per leading index.
Longformer's self-attention projections read ``hidden_states.transpose(0, 1)``, a ``(seq, batch, K)`` view of a
``(batch, seq, K)`` tensor: 512 GEMMs of ``(8 x 768) x (768 x N)`` per projection at batch 8, which cuBLAS ran
with a 192x8 tile at 178 us for the fused q/k/v GEMM on the H200, against about 10 us per projection for the
single ``(4096 x 768)`` GEMM of ``torch.compile(model.to(bf16))`` (whose weights require grad, so matmul folds
with a copy; benchmarks/results/zoo/2026-12-01-h200-profile2/AllenaiLongformerBase/profile.md and
benchmarks/NOTES.md).

How: each such linear / matmul reads ``aten.clone(x, memory_format=torch.contiguous_format)`` instead of ``x``,
the one copy plain Inductor makes for trainable weights; after it the fold is a view and the op is one GEMM.
Several such ops reading the same ``x`` share one copy. ``fuse_qkv`` (earlier in ``passes.PIPELINE``) already
copies the shared input of a fused group, so a fused linear reads a row-major copy and is left alone here; the
padding passes run before this one too, and a linear whose K they padded reads the (row-major) padded input.

Symbolic sizes (a dynamic batch or sequence): the copy is made when the fold is not *provably* a view
(``rows_foldable``); ``matmul``'s decomposition makes the same decision, so an input copied here would otherwise
be a batched GEMM. A row-major input with a dynamic batch (``(B*S*K, K, 1)`` strides) is provably foldable and
is left alone.
"""
from __future__ import annotations

import torch
from torch import fx

from passes._graph import copy_meta, fake_eval, finish, layout_note, rows_foldable
from passes.base import PassResult, PassSpec, Skip

NAME = "copy_linear_inputs"

_LINEAR = torch.ops.aten.linear.default
_MATMUL = torch.ops.aten.matmul.default
_CLONE = torch.ops.aten.clone.default


def copy_linear_inputs(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """Give every linear (and matmul with a 2-D right operand) whose input ATen cannot fold to ``(tokens, K)``
    rows without a copy a row-major copy of that input, in place.

    The op's output is unchanged (same values, shape ``(*lead, N)``, dtype and layout): only its input's layout
    changes, from a strided ``(*lead, K)`` view to a contiguous ``(*lead, K)`` tensor.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts (unused: the fold rule is the same on every target).

    Returns:
        A ``PassResult`` named ``"copy_linear_inputs"``: ``count`` is the number of linear / matmul nodes that
        now read a copy, ``changed`` their names; ``notes["copied_inputs"]`` maps each to one line with its
        input's shape and strides and the copy node's name; ``notes["checked"]`` is the number of linear /
        matmul nodes looked at (inputs of 3 or more dimensions). ``skipped`` names each op that needs a copy
        but was left alone, with the reason (no fake-tensor metadata on its input, or the copy's fake run
        failed). A row-major input is neither copied nor listed as skipped.
    """
    del spec
    result = PassResult(name=NAME, graph_module=gm)
    graph = gm.graph
    copies: dict[fx.Node, fx.Node] = {}
    copied: dict[str, str] = {}
    checked = 0
    for node in list(graph.nodes):
        x = _strided_input(node)
        if x is None:
            continue
        checked += 1
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor):
            result.skipped.append(Skip(node.name, "no fake-tensor metadata on the input (its layout is unknown)"))
            continue
        if rows_foldable(val):
            continue
        clone = copies.get(x)
        if clone is None:
            clone_val = fake_eval(_CLONE, (x,), {"memory_format": torch.contiguous_format})
            if not isinstance(clone_val, torch.Tensor):
                result.skipped.append(Skip(node.name, "fake-tensor metadata for the copy of the input failed"))
                continue
            with graph.inserting_before(node):  # the first reader in graph order: every later reader sees it
                clone = graph.call_function(_CLONE, (x,), {"memory_format": torch.contiguous_format})
            copy_meta(node, clone, clone_val)
            copies[x] = clone
        node.update_arg(0, clone)
        copied[node.name] = (f"{layout_note(x)} is not a row-major (tokens, K) view: {node.name} reads the "
                             f"contiguous copy {clone.name} (one GEMM, not a batched GEMM per leading index)")
        result.changed.append(node.name)
        result.count += 1
    result.notes["checked"] = checked
    if result.count:
        result.notes["copied_inputs"] = copied
        finish(gm)
    return result


def _strided_input(node: fx.Node) -> fx.Node | None:
    """The left operand of a linear, or of a matmul with a 2-D right operand, when it is a node of 3 or more
    dimensions (the shapes ATen's ``matmul`` may fold); None for any other node."""
    if node.op != "call_function" or node.target not in (_LINEAR, _MATMUL) or len(node.args) < 2:
        return None
    x, w = node.args[0], node.args[1]
    if not isinstance(x, fx.Node):
        return None
    x_val = x.meta.get("val")
    if isinstance(x_val, torch.Tensor) and x_val.dim() < 3:
        return None
    if node.target is _MATMUL:
        w_val = w.meta.get("val") if isinstance(w, fx.Node) else None
        if not isinstance(w_val, torch.Tensor) or w_val.dim() != 2:
            return None  # a batched right operand (or unknown): matmul does not fold, nothing to copy for
    return x


__all__ = ["copy_linear_inputs"]
