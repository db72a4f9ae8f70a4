"""Give SDPA a stride-1 last dimension on every input, so a fused attention kernel can run instead of the math
fallback.

Why: CUDA's fused ``scaled_dot_product_attention`` kernels (flash, memory-efficient, cuDNN) all refuse a query,
key, value or attention mask whose last dimension does not have stride 1 ("All fused kernels require the last
dimension of the input to have stride 1"); PyTorch then runs the math fallback, two FP32 GEMMs and a
materialized softmax for fp16 / bf16 inputs. The kernel is chosen when the graph is traced, from the layouts
the graph hands over, so ``torch.compile`` of the model inherits the fallback. T5-family models build their
relative-position bias as an embedding lookup ``(L, S, heads)`` permuted to ``(1, heads, L, S)``: the mask's last
dimension has stride ``heads``. On the H200 (bf16, ``torch.compile(model.to(bf16))``'s layouts) one such
self-attention call of MT5 at batch 32, sequence 512 took 1.27 ms in the math fallback, and 0.097 ms in cuDNN
with the same mask contiguous (``benchmarks/sdpa_why.py``; benchmarks/NOTES.md).

How: each such input of an ``aten.scaled_dot_product_attention`` node is read through
``aten.clone(x, memory_format=torch.contiguous_format)`` (:func:`passes._graph.dense_last_dim`); SDPA nodes
reading the same value share one copy. Values, shapes and dtypes are unchanged: only the layout SDPA sees
changes. The pass runs for GPU targets only (``spec.arch`` other than ``"cpu"``): PyTorch's CPU flash kernel
takes such a mask as it is (``torch._fused_sdp_choice`` picks it either way), so there the copy would buy nothing.
"""
from __future__ import annotations

import torch
from torch import fx

from passes._graph import dense_last_dim, finish, layout_note, node_arg, set_node_arg
from passes.base import PassResult, PassSpec

NAME = "dense_attention_inputs"

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
#: SDPA's tensor arguments: (position, keyword name).
_ARGS = ((0, "query"), (1, "key"), (2, "value"), (3, "attn_mask"))


def dense_attention_inputs(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """Copy every SDPA input whose last dimension may not have stride 1 to a contiguous tensor, in place.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts: ``spec.arch == "cpu"`` runs nothing (``notes["not_run"]`` says why).

    Returns:
        A ``PassResult`` named ``"dense_attention_inputs"``: ``count`` is the number of SDPA inputs now read
        through a copy, ``changed`` the SDPA node names; ``notes["copied"]`` maps each SDPA node to one line per
        copied input (argument name, shape and strides, the copy's name); ``notes["checked"]`` is the number of
        SDPA nodes looked at. Inputs without tensor metadata are left alone (not counted).
    """
    result = PassResult(name=NAME, graph_module=gm)
    if spec.arch == "cpu":
        result.notes["not_run"] = "CPU target: PyTorch's CPU flash attention takes inputs of any last-dim stride"
        return result
    copies: dict[fx.Node, fx.Node] = {}
    copied: dict[str, list[str]] = {}
    checked = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        checked += 1
        for i, name in _ARGS:
            x = node_arg(node, i, name)
            if not isinstance(x, fx.Node):
                continue
            dense = copies.get(x)
            if dense is None:
                with gm.graph.inserting_before(node):
                    dense = dense_last_dim(gm.graph, x)
                if dense is None:
                    continue
                copies[x] = dense
            set_node_arg(node, i, name, dense)
            copied.setdefault(node.name, []).append(
                f"{name}: {layout_note(x)} has a last dimension not of stride 1; reads the contiguous copy "
                f"{dense.name}")
            result.count += 1
            if node.name not in result.changed:
                result.changed.append(node.name)
    result.notes["checked"] = checked
    if result.count:
        result.notes["copied"] = copied
        finish(gm)
    return result


__all__ = ["dense_attention_inputs"]
