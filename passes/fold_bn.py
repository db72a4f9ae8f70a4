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

Frozen affine maps are the same fold, recognised by their arithmetic rather than a module name: a conv
whose output feeds only a chain of ``mul`` / ``div`` / ``add`` / ``sub`` ops by per-channel constants
(torchvision's ``FrozenBatchNorm2d``: ``x * scale + bias`` with ``scale = w * (rv + eps).rsqrt()`` and
``bias = b - rm * scale`` computed from buffers in the graph; a LayerScale; a batch norm written by hand).
The constants' subgraph (``get_attr`` tensors and pure ATen ops, nothing that reads a graph input) is
evaluated once in float64, and with ``a[c] * conv(x) + d[c]`` for the whole chain::

    W'[c] = W[c] * a[c]            b'[c] = b[c] * a[c] + d[c]

Left alone, with a reason: a conv output with other users, an operand that reads a graph input, an
operand not of a per-channel shape, an op that changes the dtype, division by a zero entry, transposed
convolutions, training specs.
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

    Then folds per-channel constant affine chains after a convolution (module docstring), e.g. torchvision's
    ``FrozenBatchNorm2d``.

    Returns:
        A ``PassResult`` named ``"fold_conv_batchnorm"``; ``count`` is the number of BNs and affine chains
        folded, ``changed`` the names of the convolutions that absorbed them, ``notes["folded"]`` maps BN node
        name to conv node name, ``notes["folded_affine"]`` conv node name to the affine ops it absorbed, and
        ``skipped`` lists every BN and affine candidate left alone with its reason.
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
        stats = {k: (get_attr_value(gm, v.target) if v is not None else None) for k, v in tensors.items()}
        new_weight, new_bias = _fold(weight, bias, stats, params["eps"])

        _store_folded(gm, conv, w_node, b_node, new_weight, new_bias)

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

    # Frozen affine maps after a conv: ``conv(x) * scale + shift`` with per-channel constants (torchvision's
    # FrozenBatchNorm2d, a LayerScale, a BN written out by hand): the same fold, recognised by its arithmetic.
    affine: dict[str, list[str]] = {}
    for conv in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _ALL_CONVS]:
        folded_ops = _fold_affine_chain(gm, conv, spec, result)
        if folded_ops:
            affine[conv.name] = folded_ops
            result.changed.append(conv.name)
            result.count += 1

    if result.count:
        if folded:
            result.notes["folded"] = folded
        if affine:
            result.notes["folded_affine"] = affine
        finish(gm)
    return result


def _fold_affine_chain(gm: fx.GraphModule, conv: fx.Node, spec: PassSpec, result: PassResult) -> list[str]:
    """Fold the chain of per-channel affine ops (mul / div / add / sub by constants) that follows ``conv``.

    The chain starts at ``conv``'s only user and runs while each node is an affine op with one operand the
    chain and the other a per-channel constant (a Python number, or a tensor computed from ``get_attr`` nodes
    only, evaluated here in float64) broadcasting as ``(C_out, 1, ..., 1)`` against the conv output, and has
    one user (the last may have several). With ``y = a[c] * conv(x) + d[c]`` for the whole chain::

        W'[c] = W[c] * a[c]        b'[c] = b[c] * a[c] + d[c]

    Returns the names of the ops folded (empty: nothing folded; a candidate left alone is recorded in
    ``result.skipped`` with its reason). A candidate is a conv with a user that is such an op with a constant
    or per-channel-shaped operand; residual adds of full activations are not candidates.
    """
    candidates = [u for u in conv.users if _affine_operand(conv, u) is not None]
    if not candidates:
        return []
    first = candidates[0]
    why = _conv_refusal(gm, conv)
    if why is None and spec.training:
        why = "spec.training is True: folding is eval-only"
    if why is None and len(conv.users) != 1:
        why = "conv output has other users"
    out_val = conv.meta.get("val")
    weight = get_attr_value(gm, conv.args[1].target) if why is None else None
    if why is None and not isinstance(out_val, torch.Tensor):
        why = "no fake-tensor metadata on the conv output"
    if why is not None:
        # A per-channel op whose operand reads a graph input is reported as that, not as the conv's problem.
        result.skipped.append(Skip(first.name, _operand_refusal(gm, conv, first) or why))
        return []

    c_out = weight.shape[0]
    out_dim = out_val.dim()
    channel_axis = out_dim - (weight.dim() - 1)  # 1 for a batched input, 0 for an unbatched one
    f64 = dict(dtype=torch.float64, device=weight.device)
    scale, shift = torch.ones(c_out, **f64), torch.zeros(c_out, **f64)
    chain: list[fx.Node] = []
    node = conv
    while len(node.users) == 1:
        (user,) = node.users
        pos = _affine_operand(node, user)
        if pos is None:
            break
        value, reason = _constant(gm, user.args[1 - pos], {})
        vec = None
        if reason is None:
            vec = _per_channel(value, out_dim, channel_axis, c_out, f64)
            if vec is None:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
                reason = f"operand of shape {shape} is not per-channel for a conv output of {c_out} channels"
        user_val = user.meta.get("val")
        if reason is None and (not isinstance(user_val, torch.Tensor) or user_val.dtype != out_val.dtype):
            reason = "the op changes the conv output's dtype (or has no fake-tensor metadata)"
        if reason is None:
            step = _affine_step(user, pos, vec, user.kwargs.get("alpha", 1))
            if step is None:
                reason = "division by zero or an unsupported keyword (rounding_mode)"
        if reason is not None:
            if not chain:
                result.skipped.append(Skip(user.name, reason))
            break
        a, d = step
        scale, shift = scale * a, shift * a + d
        chain.append(user)
        node = user
    if not chain:
        return []

    w_node = conv.args[1]
    b_node = conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")
    bias = get_attr_value(gm, b_node.target) if b_node is not None else None
    b = bias.detach().to(**f64) if bias is not None else torch.zeros(c_out, **f64)
    new_weight = (weight.detach().to(**f64) * scale.reshape(-1, *([1] * (weight.dim() - 1)))).to(weight.dtype)
    new_bias = (b * scale + shift).to(bias.dtype if bias is not None else weight.dtype)
    _store_folded(gm, conv, w_node, b_node, new_weight, new_bias)
    chain[-1].replace_all_uses_with(conv)
    for op in reversed(chain):
        gm.graph.erase_node(op)
    return [op.name for op in chain]


_ALL_CONVS = _CONVS | _CONV_PADDING_STR | {_aten.convolution.default}
#: Affine ops by overload packet: the chain may be either operand of mul / add, the left one of div / sub
#: (``sub(c, chain)`` is affine too: ``c - chain``).
_AFFINE_OPS = {
    "mul": (_aten.mul.Tensor, _aten.mul.Scalar),
    "div": (_aten.div.Tensor, _aten.div.Scalar),
    "add": (_aten.add.Tensor, _aten.add.Scalar),
    "sub": (_aten.sub.Tensor, _aten.sub.Scalar),
}
_AFFINE_TARGETS = {t: name for name, ts in _AFFINE_OPS.items() for t in ts}


def _conv_refusal(gm: fx.GraphModule, conv: fx.Node) -> str | None:
    """Why ``conv``'s weight cannot absorb a per-channel affine map (None: it can)."""
    if conv.target in _TRANSPOSED or (conv.target == _aten.convolution.default and conv.args[6]):
        return "transposed convolution"
    w_node = conv.args[1]
    b_node = conv.args[2] if len(conv.args) > 2 else conv.kwargs.get("bias")
    if not _is_attr(w_node) or (b_node is not None and not _is_attr(b_node)):
        return "conv weight is not a get_attr"
    weight = get_attr_value(gm, w_node.target)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() < 3:
        return "conv weight is not a floating tensor of 3 or more dimensions"
    return None


def _affine_operand(chain: fx.Node, user: fx.Node) -> int | None:
    """Index (0 or 1) of ``chain`` among ``user``'s two operands when ``user`` is an affine op that reads
    ``chain`` once and whose other operand is a number or a node of a per-channel shape; else None."""
    if user.op != "call_function" or user.target not in _AFFINE_TARGETS or len(user.args) != 2:
        return None
    if set(user.kwargs) - {"alpha"}:
        return None
    lhs, rhs = user.args
    if (lhs is chain) == (rhs is chain):
        return None
    pos = 0 if lhs is chain else 1
    if pos == 1 and _AFFINE_TARGETS[user.target] == "div":
        return None  # c / x is not affine in x
    other = user.args[1 - pos]
    if isinstance(other, bool) or not isinstance(other, (int, float, fx.Node)):
        return None
    if isinstance(other, fx.Node):
        ov, cv = other.meta.get("val"), chain.meta.get("val")
        if not isinstance(ov, torch.Tensor) or not isinstance(cv, torch.Tensor) or ov.dim() > cv.dim():
            return None
        # Per-channel shaped (every dimension but one statically 1), or computed from module tensors alone: a
        # full activation (a residual add) is no candidate.
        if sum(not (isinstance(s, int) and s == 1) for s in ov.shape) > 1 and not _reads_only_attrs(other):
            return None
    return pos


def _reads_only_attrs(node: fx.Node) -> bool:
    """Whether every input ``node`` is computed from is a ``get_attr`` (no graph input among them)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            return False
        stack.extend(n.all_input_nodes)
    return True


def _operand_refusal(gm: fx.GraphModule, conv: fx.Node, user: fx.Node) -> str | None:
    pos = _affine_operand(conv, user)
    if pos is None:
        return None
    _, reason = _constant(gm, user.args[1 - pos], {})
    return reason


def _evaluable(node: fx.Node) -> bool:
    """Whether ``node`` is an ATen op that may be evaluated once at rewrite time (not random, not mutating)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return True


def _constant(gm: fx.GraphModule, arg, cache: dict) -> tuple[object, str | None]:
    """``(value, None)`` when ``arg`` is a number or a node computed from ``get_attr`` tensors only (floating
    tensors evaluated in float64), else ``(None, reason)``."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return torch.tensor(float(arg), dtype=torch.float64), None
    if not isinstance(arg, fx.Node):
        return None, "operand is not a tensor or a number"
    if arg in cache:
        return cache[arg]
    if arg.op == "get_attr":
        value = get_attr_value(gm, arg.target)
        if not isinstance(value, torch.Tensor):
            out = (None, f"operand {arg.name} is not a tensor")
        else:
            out = (value.detach().to(torch.float64) if value.is_floating_point() else value.detach(), None)
    elif arg.op == "placeholder":
        out = (None, f"per-channel operand is not a constant: it reads graph input {arg.name}")
    elif arg.op != "call_function" or not _evaluable(arg):
        out = (None, f"per-channel operand is not a constant: {arg.name} is not a pure ATen op")
    else:
        out = None
        values = {}
        for inp in arg.all_input_nodes:
            v, why = _constant(gm, inp, cache)
            if why is not None:
                out = (None, why)
                break
            values[inp] = v
        if out is None:
            args = torch.fx.node.map_arg(arg.args, lambda n: values[n])
            kwargs = torch.fx.node.map_arg(arg.kwargs, lambda n: values[n])
            try:
                out = (arg.target(*args, **kwargs), None)
            except Exception as exc:  # noqa: BLE001 - an operand that cannot be evaluated is not folded
                out = (None, f"per-channel operand {arg.name} could not be evaluated: {type(exc).__name__}")
            if out[1] is None and not isinstance(out[0], torch.Tensor):
                out = (None, f"per-channel operand {arg.name} is not a tensor")
    cache[arg] = out
    return out


def _per_channel(value, out_dim: int, channel_axis: int, c_out: int, f64: dict) -> torch.Tensor | None:
    """``value`` as a ``(C_out,)`` float64 vector when it broadcasts against a conv output of ``out_dim``
    dimensions as ``(C_out, 1, ..., 1)`` at ``channel_axis`` (or is a scalar); else None."""
    if not isinstance(value, torch.Tensor) or value.dim() > out_dim or value.is_complex():
        return None
    shape = [1] * (out_dim - value.dim()) + list(value.shape)
    for axis, size in enumerate(shape):
        if size != 1 and (axis != channel_axis or size != c_out):
            return None
    vec = value.to(**f64).reshape(shape).reshape(-1)
    return vec.expand(c_out).clone() if vec.numel() == 1 else vec


def _affine_step(user: fx.Node, pos: int, v: torch.Tensor, alpha) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(a, d)`` with ``user(chain) = a * chain + d`` per channel, or None (division by zero)."""
    name = _AFFINE_TARGETS[user.target]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        return None
    one, zero = torch.ones_like(v), torch.zeros_like(v)
    if name == "mul":
        return v, zero
    if name == "div":
        return (None if bool((v == 0).any()) else (1 / v, zero))
    if name == "add":  # chain + alpha * v, or v + alpha * chain
        return (one, alpha * v) if pos == 0 else (alpha * one, v)
    # sub: chain - alpha * v, or v - alpha * chain
    return (one, -alpha * v) if pos == 0 else (-alpha * one, v)


def _store_folded(gm: fx.GraphModule, conv: fx.Node, w_node: fx.Node, b_node: fx.Node | None,
                  new_weight: torch.Tensor, new_bias: torch.Tensor) -> None:
    """Make ``conv`` read ``new_weight`` / ``new_bias``: under the same attribute names (every alias of a tied
    tensor, so ties stay ties) when only this conv reads them, else under fresh ``*_bnfolded`` attributes (a
    weight read elsewhere keeps its values); a conv without bias gains one as a non-persistent buffer."""
    weight = get_attr_value(gm, w_node.target)
    bias = get_attr_value(gm, b_node.target) if b_node is not None else None
    # A weight read elsewhere must keep its values; fold into fresh attributes instead of in place.
    w_shared = _attr_users(gm, weight) > 1
    b_shared = bias is not None and _attr_users(gm, bias) > 1
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
