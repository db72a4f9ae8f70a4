"""Fuse sibling linears that read the same input (attention's q, k, v projections) into one GEMM.

Why: BERT-style attention runs three ``(tokens, d) x (d, d)`` GEMMs on the same activation. One
``(tokens, d) x (d, 3d)`` GEMM reads the activation once, launches one kernel instead of three and gives
cuBLAS a wider N to fill the GPU's SMs with (the H200 has 132): at BERT-base sizes (d = 768) each of the
three GEMMs is small enough that tile quantization and launch overhead are a visible share of its time.

How: for each value ``x`` read by two or more ``aten.linear`` nodes whose weights are ``get_attr`` tensors of
equal in-features K, one dtype and device, and ``get_attr`` biases or none, the linears become
``y = aten.linear(x, cat(W_i), cat(b_i))`` followed by ``aten.split_with_sizes(y, [N_i], -1)`` whose pieces feed
the old users. Concatenating rows of W is exact: each output column is the same dot product as before. At
inference a linear without a bias joins siblings with one, its slice of the fused bias zero (adding 0 is
exact: Whisper's and Funnel's bias-less key projection beside biased query and value projections); in training
all or none must have a bias (``"bias mismatch with sibling linears"``).

Weights: at inference the concatenated weight is computed once and stored as a *non-persistent buffer*
``<common module>.<leaf names>_fused_weight`` (and ``..._fused_bias``) beside the originals, which stay
registered (unused by the graph), so ``state_dict`` keys are unchanged and the fused tensors never appear in
a checkpoint; the cost is a second copy of those weights in memory. With ``spec.training`` the
concatenation is done in the graph (``aten.cat`` of the original parameters, a small copy per step) so
gradients reach the original parameters.

The pieces of ``split_with_sizes`` are strided views; a user that must ``view`` its input in a way a strided
piece does not allow (checked on the fake tensors) makes the group a refusal rather than a silent copy. So does
an ``aten.as_strided`` that reads a linear's output through views, pointwise ops or layout-preserving copies: its
strides were computed from the linear's own contiguous output at capture and would address other elements of a
piece (Longformer's ``_chunk`` reads its query and key this way; fused, its FP32 logits were off by up to 0.022).

Shared input that is not a row-major ``(tokens, K)`` view. ``aten.linear`` on an input of 3 or more dimensions
runs ATen's ``matmul``, which folds the leading dimensions into one GEMM of ``(tokens, K) x (K, N)`` only when
that is a view of the input (``passes._graph.rows_foldable``) or when the weight
requires grad (then it copies the input). Otherwise, as for a frozen weight (a ``get_attr`` buffer, which is how
the backend and export see weights), it runs a *batched* GEMM over the first dimension with the weight broadcast
(batch stride 0). Longformer's self-attention hands its projections ``hidden_states.transpose(0, 1)``, a
``(seq, batch, K)`` view of a ``(batch, seq, K)`` tensor: the fused GEMM became 512 batched GEMMs of
``(8 x 768) x (768 x 2304)`` (batch 8), each reading the whole fused weight; cuBLAS ran it with a 192x8 tile at
178 us per layer on the H200, where ``torch.compile(model.to(bf16))`` (trainable weights, so matmul folds with
a copy) ran ``(4096 x 768) x (768 x 768)`` GEMMs of about 10 us (the kernel profile in
benchmarks/results/zoo/2026-12-01-h200-profile2/AllenaiLongformerBase/profile.md; the Inductor calls are in
benchmarks/NOTES.md). So when the shared input is not foldable this way, the fused linear reads
``aten.clone(x, memory_format=torch.contiguous_format)``: the one copy plain Inductor makes for the same linears,
after which the fused GEMM is one ``(tokens, K) x (K, sum N_i)`` GEMM. ``notes["copied_inputs"]`` names each
such group with the input's shape and strides.
"""
from __future__ import annotations

import operator

import torch
from torch import fx, nn

from passes._graph import (copy_meta, fake_eval, fake_from_tensor, finish, get_attr_value, layout_note, node_arg,
                           op_name, rows_foldable, unique_attr_name)
from passes.base import PassResult, PassSpec, Skip

NAME = "fuse_qkv"

_LINEAR = torch.ops.aten.linear.default
_SPLIT = torch.ops.aten.split_with_sizes.default
_CAT = torch.ops.aten.cat.default
_CLONE = torch.ops.aten.clone.default


def fuse_qkv(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """Merge linears that share their input into one linear plus ``split_with_sizes``, in place.

    For ``y_i = linear(x, W_i, b_i)``, ``x: (..., K)``, ``W_i: (N_i, K)``: one ``linear(x, W, b)`` with
    ``W: (sum N_i, K)``; each ``y_i`` (``(..., N_i)``, same dtype) is a piece of its output.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts; ``spec.training`` concatenates the weights in the graph instead of once.

    Returns:
        A ``PassResult`` named ``"fuse_qkv"``: ``count`` is the number of groups fused, ``changed`` the new
        linear nodes; ``notes["groups"]`` maps each to the names of the linears it replaced;
        ``notes["copied_inputs"]`` maps each fused linear whose shared input is not a row-major ``(tokens, K)``
        view (see the module docstring) to one line with that input's shape and strides; ``skipped`` has
        every linear left alone with the reason (``"only one linear reads this input"``, ``"bias mismatch
        with sibling linears"``, ``"weight is not a parameter"``, ``"fake-tensor metadata for the fused linear
        failed: ..."``, ``"<node> reads <linear>'s output through aten.as_strided ..."``, ...). Symbolic
        sizes (a dynamic batch or sequence) are handled; a group whose fake run fails is skipped with the
        error, never raised.
    """
    result = PassResult(name=NAME, graph_module=gm)
    groups: dict[str, list[str]] = {}
    copied: dict[str, str] = {}
    by_input: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target == _LINEAR and isinstance(node.args[0], fx.Node):
            by_input.setdefault(node.args[0], []).append(node)

    for x, linears in by_input.items():
        if len(linears) < 2:
            result.skipped.extend(Skip(n.name, "only one linear reads this input") for n in linears)
            continue
        # Partition the siblings by what must match for one GEMM; refuse the odd ones out.
        parts: dict[tuple, list[fx.Node]] = {}
        for node in linears:
            key, reason = _key(gm, node, spec.training)
            if reason:
                result.skipped.append(Skip(node.name, reason))
                continue
            parts.setdefault(key, []).append(node)
        for key, part in parts.items():
            if len(part) < 2:
                reason = _why_alone(key, parts)
                result.skipped.extend(Skip(n.name, reason) for n in part)
                continue
            fused = _fuse(gm, x, part, spec.training)
            if isinstance(fused, str):
                result.skipped.extend(Skip(n.name, fused) for n in part)
                continue
            if fused.args[0] is not x:
                copied[fused.name] = _copy_note(x)
            groups[fused.name] = [n.name for n in part]
            result.changed.append(fused.name)
            result.count += 1
    if result.count:
        result.notes["groups"] = groups
        if copied:
            result.notes["copied_inputs"] = copied
        finish(gm)
    return result


def _key(gm: fx.GraphModule, node: fx.Node, training: bool = False) -> tuple[tuple, str | None]:
    """``(compatibility key, None)`` for a fusable linear, or ``((), reason)``. Having a bias is part of the key
    only in training (the fused bias is concatenated in the graph there); in inference a linear without one
    joins siblings with one, its slice of the fused bias zero."""
    w = node.args[1]
    b = node_arg(node, 2, "bias")
    if not isinstance(w, fx.Node) or w.op != "get_attr":
        return (), "weight is not a parameter"
    weight = get_attr_value(gm, w.target)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        return (), "weight is not a 2-D floating tensor"
    if b is not None:
        if not isinstance(b, fx.Node) or b.op != "get_attr":
            return (), "bias is not a parameter"
        bias = get_attr_value(gm, b.target)
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.dtype != weight.dtype:
            return (), "bias is not a 1-D tensor of the weight's dtype"
    return (weight.shape[1], weight.dtype, weight.device, b is not None if training else None), None


def _why_alone(key: tuple, parts: dict[tuple, list[fx.Node]]) -> str:
    others = [k for k in parts if k != key]
    if any(k[:3] == key[:3] for k in others):
        return "bias mismatch with sibling linears"
    if any(k[0] != key[0] for k in others):
        return "in-features differ from sibling linears"
    return "dtype or device differs from sibling linears"


def _fuse(gm: fx.GraphModule, x: fx.Node, part: list[fx.Node], training: bool) -> fx.Node | str:
    """Rewrite one group; returns the new linear node, or a refusal reason (graph untouched)."""
    for node in part:
        reader = _as_strided_reader(node)
        if reader is not None:
            return (f"{reader.name} reads {node.name}'s output through aten.{op_name(reader)} with strides fixed "
                    f"at capture; a split piece of the fused output has other strides")
    graph = gm.graph
    first = part[0]
    w_nodes = [n.args[1] for n in part]
    b_nodes = [n.args[2] if len(n.args) > 2 else n.kwargs.get("bias") for n in part]
    weights = [get_attr_value(gm, w.target) for w in w_nodes]
    sizes = [int(w.shape[0]) for w in weights]
    has_bias = any(b is not None for b in b_nodes)  # mixed only in inference (_key): zero slices for the rest

    # Fake-run the new ops first: a user that cannot take a strided piece refuses the whole group. The fused
    # output's metadata is the concatenation of the linears' own outputs (``aten.cat`` has a symbolic-size-safe
    # meta function), never a fake ``aten.linear``: on a symbolic batch some torch releases run linear's C++
    # decomposition, which raises "Cannot call numel() on tensor with symbolic sizes/strides". Any failure
    # here refuses the group with its reason; the graph is untouched until the fake run succeeded.
    x_val = x.meta.get("val")
    mode = getattr(x_val, "fake_mode", None)
    if mode is None:
        return "no fake-tensor metadata on the input"
    out_vals = [n.meta.get("val") for n in part]
    have_outs = all(isinstance(v, torch.Tensor) and getattr(v, "fake_mode", None) is mode for v in out_vals)
    fused_weight = torch.cat(weights).detach()
    fused_bias = torch.cat([get_attr_value(gm, b.target) if b is not None
                            else weights[i].new_zeros(sizes[i]) for i, b in enumerate(b_nodes)]).detach() if has_bias else None
    copy = isinstance(x_val, torch.Tensor) and not rows_foldable(x_val)
    try:
        with mode:
            x_in_val = _CLONE(x_val, memory_format=torch.contiguous_format) if copy else x_val
            fused_w_val = mode.from_tensor(fused_weight, static_shapes=True)
            fused_b_val = mode.from_tensor(fused_bias, static_shapes=True) if has_bias else None
            if have_outs:
                y_val = _CAT(out_vals, -1)
            else:  # no metadata on an output (a hand-built graph): the fused linear's own fake run
                y_val = _LINEAR(x_in_val, fused_w_val, fused_b_val) if has_bias else _LINEAR(x_in_val, fused_w_val)
            piece_vals = list(_SPLIT(y_val, sizes, -1))
    except Exception as exc:  # noqa: BLE001 - a site the fake run cannot describe is skipped, never fatal
        return f"fake-tensor metadata for the fused linear failed: {_one_line(exc)}"
    for node, piece in zip(part, piece_vals):
        for user in node.users:
            if user.op == "call_function" and op_name(user) == "view":
                args = tuple(piece if a is node else _fake(a) for a in user.args)
                if fake_eval(user.target, args) is None:
                    return f"user {user.name} views the output in a way a split piece does not allow"

    insert_at = min(part, key=_position(graph))
    with graph.inserting_before(insert_at):
        if training:
            w_new = graph.call_function(_CAT, (list(w_nodes),))
            b_new = graph.call_function(_CAT, (list(b_nodes),)) if has_bias else None
        else:
            w_new = _fused_attr(gm, w_nodes, "weight", fused_weight)
            b_new = (_fused_attr(gm, b_nodes if all(b is not None for b in b_nodes) else w_nodes, "bias", fused_bias)
                     if has_bias else None)
        x_in = x
        if copy:  # not a row-major (tokens, K) view: one copy, as matmul's fold makes (module docstring)
            x_in = graph.call_function(_CLONE, (x,), {"memory_format": torch.contiguous_format})
            copy_meta(first, x_in, x_in_val)
        fused = graph.call_function(_LINEAR, (x_in, w_new, b_new) if has_bias else (x_in, w_new))
        split = graph.call_function(_SPLIT, (fused, sizes, -1))
    copy_meta(w_nodes[0], w_new, fused_w_val if training else None)
    if b_new is not None:
        copy_meta(next(b for b in b_nodes if b is not None), b_new, fused_b_val if training else None)
    copy_meta(first, fused, y_val)
    copy_meta(first, split, piece_vals)
    for i, (node, val) in enumerate(zip(part, piece_vals)):
        with graph.inserting_after(split):
            piece = graph.call_function(operator.getitem, (split, i))
        copy_meta(node, piece, val)
        node.replace_all_uses_with(piece)
    for node in part:
        graph.erase_node(node)
    return fused


#: Ops that read memory with strides given as arguments (fixed when the graph was captured).
_AS_STRIDED = frozenset({"as_strided", "as_strided_", "as_strided_copy", "as_strided_scatter"})
#: Ops whose output takes its input's layout (besides views and pointwise ops), for ``_as_strided_reader``.
_SAME_LAYOUT = frozenset({"clone", "_to_copy", "to", "contiguous", "alias", "detach", "type_as"})


def _as_strided_reader(node: fx.Node) -> fx.Node | None:
    """The first ``as_strided`` node that reads ``node``'s value through ops whose output follows their input's
    layout (views, pointwise ops, copies that preserve the layout), or None.

    Such a reader addresses memory with strides computed from the linear's own contiguous output when the graph
    was captured (Longformer's ``_chunk`` views its query and key as overlapping chunks this way). A piece of the
    fused output has the fused row stride, so the same strides would read other elements: the group is refused.
    """
    seen: set[fx.Node] = set()
    todo = list(node.users)
    while todo:
        user = todo.pop()
        if user in seen or user.op != "call_function":
            continue
        seen.add(user)
        name = op_name(user)
        if name in _AS_STRIDED:
            return user
        target = user.target
        if (target is operator.getitem or name in _SAME_LAYOUT or getattr(target, "is_view", False)
                or torch.Tag.pointwise in getattr(target, "tags", ())):
            todo.extend(user.users)
    return None


def _copy_note(x: fx.Node) -> str:
    """One line for ``notes["copied_inputs"]``: the shared input's shape and strides."""
    return (f"{layout_note(x)} is not a row-major (tokens, K) view: copied once "
            f"(aten.clone, contiguous) so the fused linear is one GEMM, not a batched GEMM per leading index")


def _one_line(exc: BaseException) -> str:
    """``"<type>: <first line of the message>"``, at most 200 characters (a skip reason is one line)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}".rstrip(": ")


def _fake(arg):
    """Fake value of a view argument (nodes, also inside size lists, become their ``meta["val"]``)."""
    if isinstance(arg, fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, (list, tuple)):
        return type(arg)(_fake(a) for a in arg)
    return arg


def _position(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]


def _fused_attr(gm: fx.GraphModule, attr_nodes: list[fx.Node], kind: str, value: torch.Tensor) -> fx.Node:
    """Register ``value`` as a non-persistent buffer next to the originals; returns its ``get_attr`` node."""
    paths = [n.target.split(".")[:-1] for n in attr_nodes]
    common: list[str] = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    leaves = [p[len(common)] if len(p) > len(common) else "self" for p in paths]
    target = unique_attr_name(gm, ".".join([*common, f"{'_'.join(leaves)}_fused_{kind}"]))
    *owner_path, name = target.split(".")
    owner: nn.Module = gm.get_submodule(".".join(owner_path)) if owner_path else gm
    owner.register_buffer(name, value, persistent=False)
    node = gm.graph.get_attr(target)
    fake = fake_from_tensor(attr_nodes[0].meta.get("val"), value)
    copy_meta(attr_nodes[0], node, fake)
    return node


__all__ = ["fuse_qkv"]
