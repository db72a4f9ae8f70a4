"""Pad ``aten.mm`` / ``addmm`` / ``bmm`` / ``matmul`` with a weight operand: N and K up to the alignment.

Why: the same cuBLAS alignment rule as for linears (``pad_linear_dims``; fp16 GEMM K=8191 vs 8192: 140 vs 646
TFLOP/s on the H200, benchmarks/NOTES.md, reference measurements) applies to GEMMs a model writes as ``x @ W``
/ ``torch.mm`` / ``torch.addmm`` / ``torch.bmm`` with a parameter ``W``; ``torch.export`` keeps those as their
own ops.

How, for ``y = op(x, W)`` with ``x: (..., M, K)``, ``W: (..., K, N)`` a ``get_attr`` tensor (the right
operand), ``y: (..., M, N)``: ``W`` is stored zero-padded to ``(..., K', N')`` under the same attribute
name (``state_dict`` keys unchanged), ``x``'s last dimension is zero-padded to ``K'`` with
``aten.constant_pad_nd`` and ``y`` sliced back to ``N`` with ``aten.slice.Tensor``; an ``addmm`` bias that
is a parameter of last dimension ``N`` gets zeros appended. ``M`` and the batch dimensions are never padded.
``N'`` / ``K'`` come from ``passes.should_pad`` (can-pad here, should-pad there). A weight read by several
GEMMs (as their right operand) is padded once for all of them.

Left alone, each with a reason: two activation operands (padding K would copy *both* operands at every
call, and no measurement says that pays: Inductor's ``pad_mm`` benchmarks it per shape, which a CPU pass
cannot), a weight as the left operand, a weight shared with a non-GEMM op, 1-D weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from passes._graph import fake_eval, finish, get_attr_value, keep_outputs_contiguous, op_name, round_up
from passes.base import PassResult, PassSpec, Skip
from passes.padding import PADDED_FLAG, pad_input_k, replace_tensor, slice_back, weight_users
from passes.should_pad import should_pad

NAME = "pad_matmul_dims"

_ADDMM = torch.ops.aten.addmm.default
#: GEMM ops and the argument index of their right operand.
_RIGHT = {
    torch.ops.aten.mm.default: 1,
    torch.ops.aten.bmm.default: 1,
    torch.ops.aten.matmul.default: 1,
    _ADDMM: 2,
}


def pad_matmul_dims(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """Pad the N and K of every mm / addmm / bmm / matmul whose right operand is a parameter, in place.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts; ``spec.align()`` is the alignment in elements, ``spec.arch`` picks the
            should-pad rules.

    Returns:
        A ``PassResult`` named ``"pad_matmul_dims"``: ``count`` GEMM nodes rewritten, ``notes["padded"]``
        maps node name to ``{"N": [old, new], "K": [old, new]}``, ``notes["should_pad"]`` the decisions.
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    result = PassResult(name=NAME, graph_module=gm)
    align = spec.align()
    gemms = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _RIGHT]
    if align <= 1:
        reason = f"alignment 1 (no Tensor Core requirement for {spec.precision} on {spec.arch})"
        result.skipped.extend(Skip(n.name, reason) for n in gemms)
        return result

    groups: dict[int, list[fx.Node]] = {}  # id(weight) -> GEMM nodes reading it as the right operand
    weights: dict[int, tuple[torch.Tensor, fx.Node]] = {}
    for node in gemms:
        idx = _RIGHT[node.target]
        operands = node.args[idx - 1 : idx + 1]
        left, right = operands
        if isinstance(left, fx.Node) and left.op == "get_attr":
            result.skipped.append(Skip(node.name, "weight is the left operand: not padded"))
            continue
        if not (isinstance(right, fx.Node) and right.op == "get_attr"):
            # Neither operand is a parameter: padding K would copy both activations at every call.
            reason = "two activation operands: K padding would copy both at every call (not measured to pay)"
            result.skipped.append(Skip(node.name, reason))
            continue
        weight = get_attr_value(gm, right.target)
        if not isinstance(weight, torch.Tensor) or weight.dim() < 2 or not weight.is_floating_point():
            result.skipped.append(Skip(node.name, "weight is not a floating tensor of 2 or more dimensions"))
            continue
        groups.setdefault(id(weight), []).append(node)
        weights[id(weight)] = (weight, right)

    padded: dict[str, dict] = {}
    decisions: dict[str, dict] = {}
    pad_cache: dict[tuple[fx.Node, int], fx.Node] = {}
    for key, nodes in groups.items():
        weight, w_node = weights[key]
        k_old, n_old = weight.shape[-2:]
        # Every reader of the weight must be one of these GEMMs, reading it as the right operand only.
        uses = weight_users(gm, weight)
        if any(u not in nodes or _operand_count(u, a) != 1 for u, a in uses):
            result.skipped.extend(Skip(n.name, "shared weight: used by a non-GEMM op, not padded") for n in nodes)
            continue
        op = op_name(nodes[0])
        n_dec = should_pad(op, {"N": n_old}, spec.precision, spec.arch, align)
        k_dec = should_pad(op, {"K": k_old}, spec.precision, spec.arch, align)
        for n in nodes:
            decisions[n.name] = {"N": n_dec._asdict(), "K": k_dec._asdict()}
        n_new = round_up(n_old, n_dec.multiple) if n_dec.pad else n_old
        k_new = round_up(k_old, k_dec.multiple) if k_dec.pad else k_old
        reasons = [d.reason for d in (n_dec, k_dec) if d.reason.startswith("can pad but should not")]
        # Preconditions on every reader: a static K on the input, a paddable bias.
        for n in nodes:
            x_val = _fake(n.args[_RIGHT[n.target] - 1])
            # Plain-int comparisons only (a SymInt comparison guards, or raises on a data-dependent size).
            if k_new != k_old and (x_val is None or x_val.dim() < 1 or not isinstance(x_val.shape[-1], int)
                                   or x_val.shape[-1] != k_old):
                reasons.append("input's last dimension is not a static K: K not padded")
                k_new = k_old
            elif k_new != k_old and free_unbacked_symbols(x_val):
                reasons.append("input has a data-dependent size: its padded shape cannot be computed; K not padded")
                k_new = k_old
            if n_new != n_old and n.target == _ADDMM and not _bias_paddable(gm, n.args[0], n_old):
                reasons.append("addmm bias is not a parameter of last dimension N used once: N not padded")
                n_new = n_old
        if n_new == n_old and k_new == k_old:
            result.skipped.extend(Skip(n.name, "; ".join(reasons) or "already aligned") for n in nodes)
            continue
        for n in nodes:
            result.skipped.extend(Skip(n.name, r) for r in reasons)

        # Rewrite: the weight once (zeros in K rows and N columns), then each reader.
        pad = (0, n_new - n_old, 0, k_new - k_old)
        replace_tensor(gm, weight, w_node.target, F.pad(weight.detach(), pad))
        for n in nodes:
            if n.target == _ADDMM and n_new != n_old:
                bias_node = n.args[0]
                if isinstance(bias_node, fx.Node) and bias_node.op == "get_attr":
                    bias = get_attr_value(gm, bias_node.target)
                    if bias.shape[-1] == n_old:
                        pad_b = [0, 0] * (bias.dim() - 1)
                        new_bias = F.pad(bias.detach(), (0, n_new - n_old, *pad_b))
                        replace_tensor(gm, bias, bias_node.target, new_bias)
            if k_new != k_old:
                pad_input_k(gm, n, n.args[_RIGHT[n.target] - 1], k_old, k_new, pad_cache)
            if n_new != n_old:
                slice_back(gm, n, n_old)
            else:
                new_val = fake_eval(n.target, n.args, n.kwargs)
                if new_val is not None:
                    n.meta["val"] = new_val
            n.meta[PADDED_FLAG] = True
            padded[n.name] = {"N": [n_old, n_new], "K": [k_old, k_new]}
            result.changed.append(n.name)
            result.count += 1

    if decisions:
        result.notes["should_pad"] = decisions
    if result.count:
        result.notes["padded"] = padded
        keep_outputs_contiguous(gm)
        finish(gm)
    return result


def _fake(value):
    return value.meta.get("val") if isinstance(value, fx.Node) else None


def _operand_count(user: fx.Node, attr: fx.Node) -> int:
    """How many times ``attr`` appears among ``user``'s inputs, counting only its right-operand slot as 1.

    Returns 1 exactly when ``attr`` is ``user``'s right operand and appears nowhere else.
    """
    if user.op != "call_function" or user.target not in _RIGHT:
        return 0
    idx = _RIGHT[user.target]
    if user.args[idx] is not attr:
        return 0
    return sum(a is attr for a in user.args) + sum(v is attr for v in user.kwargs.values())


def _bias_paddable(gm: fx.GraphModule, bias_node, n_old: int) -> bool:
    """An addmm bias can follow an N padding: a parameter, last dimension N, read by this node only.

    (A bias broadcast along N, last dimension 1, needs no padding.)
    """
    if not isinstance(bias_node, fx.Node) or bias_node.op != "get_attr":
        val = _fake(bias_node)
        return val is not None and val.dim() >= 1 and isinstance(val.shape[-1], int) and val.shape[-1] == 1
    bias = get_attr_value(gm, bias_node.target)
    if not isinstance(bias, torch.Tensor):
        return False
    if bias.dim() >= 1 and bias.shape[-1] == 1:
        return True
    return bias.dim() >= 1 and bias.shape[-1] == n_old and len(weight_users(gm, bias)) == 1


__all__ = ["pad_matmul_dims"]
