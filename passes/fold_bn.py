"""Fold eval-mode batch norm into the convolution that feeds it.

Why: in inference, ``batch_norm(conv(x, W, b))`` with frozen running statistics is an affine map per output
channel, so it can be absorbed into the convolution's weight and bias: one kernel instead of two, one less
full read and write of the activation, and a graph TensorRT / Inductor see as a plain conv (+ epilogue).
For each output channel ``c``, with ``s = gamma / sqrt(running_var + eps)``::

    W'[c] = W[c] * s[c]            b'[c] = (b[c] - running_mean[c]) * s[c] + beta[c]

This holds per output channel, so grouped and depthwise convolutions need nothing special. The fold is
eval-only: in training BN uses batch statistics and updates its running ones.

Weights are replaced (never mutated: the exported module shares tensors with the eager model) under the same
attribute names; a conv without bias gains one stored as the non-persistent buffer ``<conv>.bias_bnfolded``
(``state_dict`` keys stay those of the user's model).
The BN's own attributes stay on the module, unused, so ``state_dict`` keeps all its keys.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from passes._graph import (
    add_constant,
    alias_targets,
    copy_meta,
    fake_from_tensor,
    finish,
    get_attr_value,
    set_attr_tensor,
    unique_attr_name,
)
from passes.base import PassResult, PassSpec, Skip

NAME = "fold_conv_batchnorm"

_aten = torch.ops.aten
_CONVS = {_aten.conv1d.default, _aten.conv2d.default, _aten.conv3d.default}
_CONV_PADDING_STR = {
    getattr(getattr(_aten, name), "padding", None) for name in ("conv1d", "conv2d", "conv3d")
} - {None}
_TRANSPOSED = {
    getattr(getattr(_aten, name), overload, None)
    for name in ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
    for overload in ("default", "input")
} - {None}
_BN = _aten.batch_norm.default
_BN_NO_TRAINING = _aten._native_batch_norm_legit_no_training.default


def fold_conv_batchnorm(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """Fold every eval-mode ``batch_norm`` that follows a convolution into that convolution, in place.

    Handles ``aten.conv{1,2,3}d`` (and ``aten.convolution`` with ``transposed=False``) feeding
    ``aten.batch_norm`` (``training=False``) or ``aten._native_batch_norm_legit_no_training`` (output 0).
    Shapes: conv weight ``(C_out, C_in / groups, *kernel)``, BN parameters and statistics ``(C_out,)``.
    The folded weight and bias keep the conv weight's dtype (the arithmetic is done in float64).

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts; nothing is folded when ``spec.training`` is True.

    Returns:
        A ``PassResult`` named ``"fold_conv_batchnorm"``; ``count`` is the number of BNs folded,
        ``changed`` the names of the convolutions that absorbed them, ``notes["folded"]`` maps BN node name to
        conv node name, and ``skipped`` lists every BN left alone with its reason.
    """
    result = PassResult(name=NAME, graph_module=gm)
    bns = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (_BN, _BN_NO_TRAINING)]
    folded: dict[str, str] = {}

    for bn in bns:
        # Folding replaces batch statistics by running ones: only valid for inference graphs.
        if spec.training:
            result.skipped.append(Skip(bn.name, "spec.training is True: BN folding is eval-only"))
            continue
        params = _bn_params(bn)
        # Without running statistics BN always uses batch statistics.
        if params["mean"] is None or params["var"] is None:
            result.skipped.append(Skip(bn.name, "running stats are None"))
            continue
        # aten.batch_norm in training mode normalises with batch statistics.
        if params["training"]:
            result.skipped.append(Skip(bn.name, "BN training flag is True"))
            continue
        conv = bn.args[0]
        if not isinstance(conv, fx.Node) or conv.op != "call_function":
            result.skipped.append(Skip(bn.name, "input is not a convolution"))
            continue
        # A transposed convolution's weight is (C_in, C_out / groups, ...): not handled by this pass.
        if conv.target in _TRANSPOSED or (conv.target == _aten.convolution.default and conv.args[6]):
            result.skipped.append(Skip(bn.name, "transposed convolution"))
            continue
        if conv.target not in _CONVS | _CONV_PADDING_STR | {_aten.convolution.default}:
            result.skipped.append(Skip(bn.name, "input is not a convolution"))
            continue
        # Other users of the conv output need the un-normalised values.
        if len(conv.users) != 1:
            result.skipped.append(Skip(bn.name, "conv output has other users"))
            continue
        # For the tuple-returning variant only output 0 (the normalised tensor) may be used.
        if bn.target == _BN_NO_TRAINING and not all(
            u.target is operator.getitem and (u.args[1] == 0 or not u.users) for u in bn.users
        ):
            result.skipped.append(Skip(bn.name, "BN statistics outputs are used"))
            continue
        w_node = conv.args[1]
        b_node = conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")
        if not _is_attr(w_node) or (b_node is not None and not _is_attr(b_node)):
            result.skipped.append(Skip(bn.name, "conv weight is not a get_attr"))
            continue
        tensors = {k: params[k] for k in ("weight", "bias", "mean", "var")}
        if not all(v is None or _is_attr(v) for v in tensors.values()):
            result.skipped.append(Skip(bn.name, "BN parameters are not get_attr constants"))
            continue
        weight = get_attr_value(gm, w_node.target)
        bias = get_attr_value(gm, b_node.target) if b_node is not None else None
        # A weight read elsewhere must keep its values; fold into fresh attributes instead of in place.
        w_shared = _attr_users(gm, weight) > 1
        b_shared = bias is not None and _attr_users(gm, bias) > 1

        stats = {k: (get_attr_value(gm, v.target) if v is not None else None) for k, v in tensors.items()}
        new_weight, new_bias = _fold(weight, bias, stats, params["eps"])

        w_target = unique_attr_name(gm, w_node.target + "_bnfolded") if w_shared else w_node.target
        if w_shared:
            set_attr_tensor(gm, w_target, new_weight)
            with gm.graph.inserting_before(conv):
                new_w_node = gm.graph.get_attr(w_target)
            copy_meta(w_node, new_w_node, fake_from_tensor(w_node.meta.get("val"), new_weight))
            conv.replace_input_with(w_node, new_w_node)
        else:
            for target in alias_targets(gm, weight) or [w_target]:
                set_attr_tensor(gm, target, new_weight)

        if b_node is not None and not b_shared:
            for target in alias_targets(gm, bias) or [b_node.target]:
                set_attr_tensor(gm, target, new_bias)
        else:
            base = (b_node.target if b_node is not None else _bias_name(w_node.target)) + "_bnfolded"
            b_target = unique_attr_name(gm, base)
            add_constant(gm, b_target, new_bias)  # a new tensor: no new state_dict key
            with gm.graph.inserting_before(conv):
                new_b_node = gm.graph.get_attr(b_target)
            copy_meta(w_node, new_b_node, fake_from_tensor(w_node.meta.get("val"), new_bias))
            args = list(conv.args) + [None] * (3 - len(conv.args))
            args[2] = new_b_node
            conv.args = tuple(args)
            conv.kwargs = {k: v for k, v in conv.kwargs.items() if k != "bias"}

        # Route the BN's users to the conv; the BN (and its getitems) become dead.
        if bn.target == _BN_NO_TRAINING:
            for user in list(bn.users):
                if user.args[1] == 0:
                    user.replace_all_uses_with(conv)
                gm.graph.erase_node(user)
        else:
            bn.replace_all_uses_with(conv)
        gm.graph.erase_node(bn)
        folded[bn.name] = conv.name
        result.changed.append(conv.name)
        result.count += 1

    if result.count:
        result.notes["folded"] = folded
        finish(gm)
    return result


def _bn_params(bn: fx.Node) -> dict:
    """The BN node's weight, bias, running mean/var nodes, training flag and eps, for either BN variant."""
    a = list(bn.args)
    if bn.target == _BN:
        # batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
        names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
        defaults = (None, None, None, None, None, False, 0.1, 1e-5)
    else:
        # _native_batch_norm_legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps)
        names = ("input", "weight", "bias", "running_mean", "running_var", "momentum", "eps")
        defaults = (None, None, None, None, None, 0.1, 1e-5)
    values = {n: (a[i] if i < len(a) else bn.kwargs.get(n, d)) for i, (n, d) in enumerate(zip(names, defaults))}
    return {
        "weight": values["weight"], "bias": values["bias"], "mean": values["running_mean"],
        "var": values["running_var"], "training": bool(values.get("training", False)), "eps": float(values["eps"]),
    }


def _fold(
    weight: torch.Tensor, bias: torch.Tensor | None, stats: dict, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Folded ``(weight, bias)``: ``(C_out, C_in/groups, *k)`` and ``(C_out,)``, in ``weight``'s dtype."""
    c_out = weight.shape[0]
    f64 = dict(dtype=torch.float64, device=weight.device)
    gamma = stats["weight"].detach().to(**f64) if stats["weight"] is not None else torch.ones(c_out, **f64)
    beta = stats["bias"].detach().to(**f64) if stats["bias"] is not None else torch.zeros(c_out, **f64)
    b = bias.detach().to(**f64) if bias is not None else torch.zeros(c_out, **f64)
    scale = gamma / torch.sqrt(stats["var"].detach().to(**f64) + eps)
    new_weight = weight.detach().to(**f64) * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    new_bias = (b - stats["mean"].detach().to(**f64)) * scale + beta
    out_dtype = bias.dtype if bias is not None else weight.dtype
    return new_weight.to(weight.dtype), new_bias.to(out_dtype)


def _is_attr(node: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr"


def _attr_users(gm: fx.GraphModule, tensor: torch.Tensor) -> int:
    """How many nodes read ``tensor`` through any ``get_attr`` (any alias)."""
    return sum(
        len(n.users) for n in gm.graph.nodes if n.op == "get_attr" and get_attr_value(gm, n.target) is tensor
    )


def _bias_name(weight_target: str) -> str:
    """``conv1.weight`` -> ``conv1.bias``; any other name -> ``<name>_bias``."""
    if weight_target.endswith(".weight") or weight_target == "weight":
        return weight_target[: -len("weight")] + "bias"
    return weight_target + "_bias"


__all__ = ["fold_conv_batchnorm"]
