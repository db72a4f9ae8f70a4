"""Pad 2-D convolutions' input and output channels to what the Tensor Core kernels want.

Why: cuDNN's fast fp16/bf16 convolution kernels want channel counts that are multiples of the alignment;
measured on the H200 (benchmarks/NOTES.md, reference measurements): a 3x3 conv with C=61 takes 0.59 ms against
0.29 ms at C=64, and the 7x7 stem conv with Cin 3 / 4 / 8 takes 1.12 / 0.97 / 1.78 ms, so Cin 3 pads to 4, not
to 8. Which multiple, and whether at all, is ``passes.should_pad``'s answer (the measured table); this pass
does what is legal.

How, for ``y = conv2d(x, W, b)`` with ``x: (batch, Cin, H, W)``, ``W: (Cout, Cin, kh, kw)``, ``b: (Cout,)``:

* Cin -> Cin': zero weight columns ``W[:, Cin:]`` and ``x`` zero-padded on dim 1 with
  ``aten.constant_pad_nd`` (zero channels times zero weights add exactly nothing).
* Cout -> Cout': zero weight rows, zero bias entries, and the output sliced back to ``Cout`` channels with
  ``aten.slice.Tensor(y, 1, 0, Cout)``, so every reader sees the original shape.

Weights are stored under the same attribute names (``state_dict`` keys unchanged, shapes grow). Batch and
spatial dimensions are never touched.

Only at fp16 / bf16: at fp32 / tf32 no channel rule has been measured (the skip says so). Grouped,
depthwise and transposed convolutions are left alone with a reason, as are weights shared with other ops.

Memory format: channels-last (NHWC) is what the measurements used and what cuDNN's Tensor Core kernels run
on natively, but it is a *measurement-time* choice (``model.to(memory_format=torch.channels_last)`` and
channels-last inputs when a candidate is timed), not a graph change: the ATen graph is layout-agnostic and
this pass inserts no permutes.

Keeping channels padded between convolutions (``notes["kept_padded"]``): padding each conv on its own costs
a ``constant_pad_nd`` copy in front of it and a channel slice behind it, and on the H200 those copies eat the
win (a padded 61 -> 61 3x3 conv took 0.44 ms against 0.27 ms for a native 64-channel conv). After the
per-conv rewrite, a canonicalization lets the padded channels flow from one conv to the next:

1. *Sink* a channel slice ``slice(y, 1, 0, C)`` of a 4-D ``y`` with ``P > C`` channels below an op that never
   mixes channels, so the op runs on all ``P`` channels and the slice comes after it. The ops: unary
   elementwise ops that are finite on finite input (relu, gelu, silu, sigmoid, tanh, hardtanh, hardswish,
   leaky_relu, elu, clone/detach/alias, dropout in eval, ``_to_copy`` / ``to.dtype`` casts to a floating
   dtype, add/sub/mul by a finite Python scalar, div by a finite non-zero one, and their in-place forms),
   add / sub / mul of two such slices with the same ``P`` and ``C`` (one slice of the op on the padded
   tensors; never div: 0 / 0), and the spatial pools max_pool2d / avg_pool2d / adaptive_avg_pool2d.
2. *Cancel* ``constant_pad_nd(slice(y, 1, 0, C), [0, 0, 0, 0, 0, P - C], 0)`` -> ``y`` when ``y`` has exactly
   ``P`` channels and every reader of the pad is a conv whose weight columns ``C:P`` are all zero.

Why the values left in the padded channels are harmless: a padded conv's extra output channels are exactly 0
(zero weight rows, zero bias entries; checked on the tensors, not assumed), and a sunk op maps them to other
values without ever mixing them into the real channels. The next conv multiplies them by its zero
weight columns, and ``0 * v`` is exactly (+/-)0 for every *finite* ``v``, so its result is unchanged. Only
infinities or NaNs would leak (``0 * inf = NaN``), so the canonicalization tracks an upper bound on
``|v|`` through every sunk op (0 out of a conv, 1 after sigmoid, ``b + |s|`` after adding a scalar ``s``,
...) and sinks nothing whose bound exceeds ``2**14`` (a quarter of fp16's largest finite value, room for
rounding), nor through an op it cannot bound (tensor / tensor division, an unknown op).

Only a slice whose path ends in a cancelled pad is sunk (moving an op that feeds no padded conv would buy
nothing). Every other reader keeps seeing the original ``C``-channel tensor: when a sunk op has other
readers (a graph output, a reshape / flatten / linear / mean / cat / batch_norm, any op not listed above),
a slice is inserted right after the sunk op for them, so a padded tensor never reaches them. An in-place op
is sunk only when it is the sole reader of the tensor it mutates. Fake values (``meta["val"]``, with their
channels-last strides) are recomputed for every new node, and graph outputs are still made dense by
``keep_outputs_contiguous`` (an output channel slice is copied in the layout it has at run time, so a
channels-last run returns channels-last, as eager does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from passes._graph import (copy_meta, fake_eval, finish, get_attr_value, keep_outputs_contiguous, node_arg, op_name,
                           round_up)
from passes.base import PassResult, PassSpec, Skip
from passes.padding import PADDED_FLAG, replace_tensor, weight_users
from passes.should_pad import should_pad

NAME = "pad_conv_channels"

_CONV = torch.ops.aten.conv2d.default
_TRANSPOSED = (torch.ops.aten.conv_transpose2d.input, torch.ops.aten.conv_transpose1d.default,
               torch.ops.aten.conv_transpose3d.input)
_PAD = torch.ops.aten.constant_pad_nd.default
_SLICE = torch.ops.aten.slice.Tensor

#: Skip reason at fp32 / tf32 (no channel rule measured for FP32-storage convolutions).
TF32_REASON = "TF32 convs: no channel rule measured"


def pad_conv_channels(gm: fx.GraphModule, spec: PassSpec, *, keep_padded: bool = True) -> PassResult:
    """Pad every eligible ``aten.conv2d``'s Cin and Cout per ``passes.should_pad``, in place.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts: ``spec.precision`` (only fp16 / bf16 pad), ``spec.align()`` (elements),
            ``spec.arch`` (picks the measured rules, e.g. the Hopper fp16 stem rule Cin 3 -> 4).
        keep_padded: keep channels padded between consecutive convs (module docstring; the pipeline's
            default). False pads each conv on its own: a pad before it, a slice after it.

    Returns:
        A ``PassResult`` named ``"pad_conv_channels"``: ``count`` convolutions rewritten,
        ``notes["padded"]`` maps node name to ``{"Cin": [old, new], "Cout": [old, new]}``,
        ``notes["should_pad"]`` the decisions behind them, ``notes["kept_padded"]`` how many pad / slice
        pairs between consecutive convs were removed (the padded channels flow on; module docstring) and
        ``notes["kept_padded_ops"]`` the ops moved onto padded tensors for that.
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    result = PassResult(name=NAME, graph_module=gm)
    convs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == _CONV]
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _TRANSPOSED:
            result.skipped.append(Skip(node.name, "transposed convolution: channels not padded"))
    if spec.precision not in ("fp16", "bf16"):
        reason = TF32_REASON if spec.precision == "tf32" else f"precision {spec.precision}: only fp16/bf16 convs are padded"
        result.skipped.extend(Skip(n.name, reason) for n in convs)
        return result
    align = spec.align()
    if align <= 1:
        reason = f"alignment 1 (no Tensor Core requirement for {spec.precision} on {spec.arch})"
        result.skipped.extend(Skip(n.name, reason) for n in convs)
        return result

    padded: dict[str, dict] = {}
    decisions: dict[str, dict] = {}
    for node in convs:
        x_node, w_node = node.args[0], node.args[1]
        bias_node = node_arg(node, 2, "bias")
        groups = node_arg(node, 6, "groups", 1)
        # The weight must be a module attribute we can replace.
        if not isinstance(w_node, fx.Node) or w_node.op != "get_attr":
            result.skipped.append(Skip(node.name, "weight is not a parameter"))
            continue
        weight = get_attr_value(gm, w_node.target)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 4 or not weight.is_floating_point():
            result.skipped.append(Skip(node.name, "weight is not a 4-D floating tensor"))
            continue
        cout, cin_g = weight.shape[:2]
        # Grouped / depthwise: padding channels would change which channels meet in a group.
        if groups != 1:
            kind = "depthwise" if cin_g == 1 and groups == cout else "grouped"
            result.skipped.append(Skip(node.name, f"{kind} convolution (groups={groups}): channels not padded"))
            continue
        if len(weight_users(gm, weight)) > 1:
            result.skipped.append(Skip(node.name, "shared weight: channels not padded"))
            continue
        cin, x_val = cin_g, x_node.meta.get("val") if isinstance(x_node, fx.Node) else None
        in_dec = should_pad("conv2d", {"Cin": cin}, spec.precision, spec.arch, align)
        out_dec = should_pad("conv2d", {"Cout": cout}, spec.precision, spec.arch, align)
        decisions[node.name] = {"Cin": in_dec._asdict(), "Cout": out_dec._asdict()}
        cin_new = round_up(cin, in_dec.multiple) if in_dec.pad else cin
        cout_new = round_up(cout, out_dec.multiple) if out_dec.pad else cout
        reasons = [d.reason for d in (in_dec, out_dec) if d.reason.startswith("can pad but should not")]
        # Cin: the input must be a batched (batch, Cin, H, W) tensor with a static channel count.
        # Plain-int comparisons only (a SymInt comparison guards, or raises on a data-dependent size).
        if cin_new != cin and (x_val is None or x_val.dim() != 4 or not isinstance(x_val.shape[1], int)
                               or x_val.shape[1] != cin):
            reasons.append("input is not (batch, Cin, H, W) with a static Cin: Cin not padded")
            cin_new = cin
        elif cin_new != cin and free_unbacked_symbols(x_val):
            reasons.append("input has a data-dependent size: its padded shape cannot be computed; Cin not padded")
            cin_new = cin
        # Cout: the bias (if any) must be a parameter read by this conv alone.
        bias = None
        if cout_new != cout and bias_node is not None:
            if not isinstance(bias_node, fx.Node) or bias_node.op != "get_attr":
                reasons.append("bias is not a parameter: Cout not padded")
                cout_new = cout
            else:
                bias = get_attr_value(gm, bias_node.target)
                if len(weight_users(gm, bias)) > 1:
                    reasons.append("shared bias: Cout not padded")
                    cout_new, bias = cout, None
        if cin_new == cin and cout_new == cout:
            result.skipped.append(Skip(node.name, "; ".join(reasons) or "already aligned"))
            continue
        result.skipped.extend(Skip(node.name, r) for r in reasons)

        # Rewrite: weight rows (Cout) and columns (Cin), bias, then the graph around the conv.
        new_weight = F.pad(weight.detach(), (0, 0, 0, 0, 0, cin_new - cin, 0, cout_new - cout))
        replace_tensor(gm, weight, w_node.target, new_weight)
        if bias is not None:
            replace_tensor(gm, bias, bias_node.target, F.pad(bias.detach(), (0, cout_new - cout)))
        if cin_new != cin:
            with gm.graph.inserting_before(node):
                pad = gm.graph.call_function(_PAD, (x_node, [0, 0, 0, 0, 0, cin_new - cin], 0.0))
            copy_meta(x_node, pad, fake_eval(_PAD, pad.args))
            node.replace_input_with(x_node, pad)
        old_val = node.meta.get("val")
        new_val = fake_eval(node.target, node.args, node.kwargs)
        if cout_new != cout:
            with gm.graph.inserting_after(node):
                sliced = gm.graph.call_function(_SLICE, (node, 1, 0, cout))
            node.replace_all_uses_with(sliced, delete_user_cb=lambda user: user is not sliced)
        if new_val is not None:
            node.meta["val"] = new_val
        if cout_new != cout:
            sliced_val = fake_eval(_SLICE, sliced.args)  # the view's own strides (row stride Cout')
            copy_meta(node, sliced, old_val if sliced_val is None else sliced_val)
        node.meta[PADDED_FLAG] = True
        padded[node.name] = {"Cin": [cin, cin_new], "Cout": [cout, cout_new]}
        result.changed.append(node.name)
        result.count += 1

    if decisions:
        result.notes["should_pad"] = decisions
    if result.count:
        result.notes["padded"] = padded
        kept, moved = _keep_channels_padded(gm) if keep_padded else (0, [])
        result.notes["kept_padded"] = kept
        result.notes["kept_padded_ops"] = moved
        keep_outputs_contiguous(gm)
        finish(gm)
    return result


# ------------------------------------------------------------------------------ keeping channels padded

#: Largest |value| the padded channels may hold (a quarter of fp16's largest finite 65504, room for rounding).
BOUND_LIMIT = 2.0**14
_F32_MAX = torch.finfo(torch.float32).max
_F32_TINY = torch.finfo(torch.float32).tiny
_ASSERT_META = torch.ops.aten._assert_tensor_metadata.default

#: Unary ops (overload packet names, in-place forms without the trailing "_") and the keyword arguments
#: each may carry. Their padded-channel bound rules are in ``_unary_bound``.
_UNARY_KWARGS: dict[str, frozenset] = {
    "relu": frozenset(), "silu": frozenset(), "hardswish": frozenset(), "sigmoid": frozenset(),
    "tanh": frozenset(), "detach": frozenset(), "alias": frozenset(),
    "gelu": frozenset({"approximate"}),
    "hardtanh": frozenset({"min_val", "max_val"}),
    "leaky_relu": frozenset({"negative_slope"}),
    "elu": frozenset({"alpha", "scale", "input_scale"}),
    "clone": frozenset({"memory_format"}),
    "dropout": frozenset({"p", "train"}),
    "_to_copy": frozenset({"dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format"}),
    "to": frozenset({"dtype", "non_blocking", "copy", "memory_format"}),
}
_BINARY = ("add", "sub", "mul", "div")
_POOLS = ("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d")


@dataclass(frozen=True)
class _Padded:
    """A node whose value is ``v[:, :C]`` of a padded tensor ``v`` with ``P`` channels, ``|v[:, C:]| <= bound``."""

    P: int
    C: int
    bound: float


def _scalar(value: Any) -> float | None:
    """``value`` as a float when it is a Python number finite in fp32, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and abs(value) <= _F32_MAX else None


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _channels(node: Any) -> int | None:
    """The static channel count of a 4-D floating node (dim 1), else None."""
    val = _val(node)
    if not isinstance(val, torch.Tensor) or val.dim() != 4 or not val.is_floating_point():
        return None
    c = val.shape[1]
    return c if isinstance(c, int) else None


def _zero_from(gm: fx.GraphModule, node: Any, dim: int, start: int) -> bool:
    """Whether the parameter behind ``node`` (None: no tensor) is exactly zero from ``start`` on along ``dim``."""
    if node is None:
        return True
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return False
    t = get_attr_value(gm, node.target)
    return isinstance(t, torch.Tensor) and bool((t.detach().narrow(dim, start, t.shape[dim] - start) == 0).all())


def _source_slice(gm: fx.GraphModule, node: fx.Node) -> _Padded | None:
    """``slice(y, 1, 0, C)`` of a conv ``y`` whose output channels ``C:`` are exactly 0 (bound 0)."""
    if node.target != _SLICE or node.kwargs or len(node.args) not in (4, 5):
        return None
    y, dim, start, end = node.args[:4]
    step = node.args[4] if len(node.args) > 4 else 1
    if not isinstance(y, fx.Node) or y.op != "call_function" or y.target != _CONV:
        return None
    p, c = _channels(y), _channels(node)
    if p is None or dim not in (1, -3) or start not in (0, None) or step != 1 or end != c or not 0 < c < p:
        return None
    weight = y.args[1]
    bias = y.args[2] if len(y.args) > 2 else y.kwargs.get("bias")
    if not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None
    w = get_attr_value(gm, weight.target)
    if not isinstance(w, torch.Tensor) or w.dim() != 4 or w.shape[0] != p:
        return None
    if not (_zero_from(gm, weight, 0, c) and _zero_from(gm, bias, 0, c)):
        return None
    return _Padded(p, c, 0.0)


def _unary_bound(name: str, node: fx.Node, b: float) -> float | None:
    """Bound on ``|op(v)|`` for ``|v| <= b`` (None: the op or its arguments are not handled)."""
    if name in ("relu", "gelu", "silu", "hardswish", "detach", "alias", "clone"):
        return b  # |relu(v)|, |gelu(v)|, |silu(v)|, |hardswish(v)| <= |v|
    if name == "sigmoid":
        return 1.0
    if name == "tanh":
        return min(b, 1.0)
    if name == "hardtanh":
        lo, hi = _scalar(node_arg(node, 1, "min_val", -1.0)), _scalar(node_arg(node, 2, "max_val", 1.0))
        if lo is None or hi is None:
            return None
        return b if lo <= 0.0 <= hi else max(b, abs(lo), abs(hi))
    if name == "leaky_relu":
        slope = _scalar(node_arg(node, 1, "negative_slope", 0.01))
        return None if slope is None else max(1.0, abs(slope)) * b
    if name == "elu":
        alpha, scale = _scalar(node_arg(node, 1, "alpha", 1.0)), _scalar(node_arg(node, 2, "scale", 1.0))
        input_scale = _scalar(node_arg(node, 3, "input_scale", 1.0))
        if alpha is None or scale is None or input_scale is None or input_scale < 0:
            return None
        return abs(scale) * max(b, abs(alpha))  # v <= 0: alpha * (exp(input_scale * v) - 1) in (-alpha, 0]
    if name == "dropout":
        return b if node_arg(node, 2, "train", None) is False else None
    if name in ("_to_copy", "to"):
        val = _val(node)
        return b if isinstance(val, torch.Tensor) and val.is_floating_point() else None
    return None


def _padded_bound(node: fx.Node, padded: dict[fx.Node, _Padded]) -> _Padded | None:
    """The ``_Padded`` fact of ``node`` when the channel slice(s) it reads can sink below it, else None."""
    if node.op != "call_function" or not hasattr(node.target, "_schema"):
        return None
    name = op_name(node)
    in_place = name.endswith("_") and node.target._schema.is_mutable
    base = name[:-1] if in_place else name
    x = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    fact = padded.get(x) if x is not None else None
    if fact is None or _channels(node) != fact.C:
        return None
    # Tensors read: the sliced input, and (tensor op tensor) the second operand; nothing else.
    inputs = set(node.all_input_nodes) - {x}
    if inputs and not (base in _BINARY and len(node.args) == 2 and inputs == {node.args[1]}):
        return None
    bound: float | None = None
    if base in _UNARY_KWARGS:
        if set(node.kwargs) - _UNARY_KWARGS[base]:
            return None
        bound = _unary_bound(base, node, fact.bound)
    elif base in _BINARY and len(node.args) == 2 and set(node.kwargs) <= {"alpha"}:
        other = node.args[1]
        alpha = _scalar(node.kwargs.get("alpha", 1))
        if alpha is None or (base in ("mul", "div") and "alpha" in node.kwargs):
            return None
        s = _scalar(other)
        if s is not None:  # op by a Python scalar
            if base in ("add", "sub"):
                bound = fact.bound + abs(alpha * s)
            elif base == "mul":
                bound = fact.bound * abs(s)
            elif abs(s) >= _F32_TINY:  # div: a finite, non-zero scalar
                bound = fact.bound / abs(s)
        elif isinstance(other, fx.Node) and base != "div":  # tensor op tensor: both sliced alike
            second = padded.get(other)
            if second is None or (second.P, second.C) != (fact.P, fact.C) or _channels(other) != fact.C:
                return None
            bound = fact.bound + abs(alpha) * second.bound if base in ("add", "sub") else fact.bound * second.bound
    elif base in _POOLS and not in_place:
        if node.kwargs:
            return None
        bound = fact.bound
        if base == "avg_pool2d":
            divisor = node_arg(node, 6, "divisor_override", None)
            if divisor is not None:
                kernel = node.args[1]
                kernel = list(kernel) * (2 // len(kernel)) if isinstance(kernel, (list, tuple)) else [kernel] * 2
                if not divisor or not all(isinstance(k, int) for k in kernel):
                    return None
                bound = fact.bound * kernel[0] * kernel[1] / abs(divisor)
    if bound is None or not math.isfinite(bound) or bound > BOUND_LIMIT:
        return None
    if in_place and not _sole_reader(x):
        return None
    return _Padded(fact.P, fact.C, bound)


#: Handled ops whose result may share storage with their input (eval dropout and a same-dtype ``to``
#: return the input itself).
_ALIASING = frozenset({"alias", "detach", "dropout", "to", "slice"})


def _sole_reader(x: fx.Node) -> bool:
    """Whether an in-place op reading ``x`` is the only reader of ``x``'s storage: ``x`` and every tensor it
    aliases (back through slices, views and earlier in-place ops to a fresh result) have one reader each."""
    while True:
        if len(x.users) != 1:
            return False
        name = op_name(x) if x.op == "call_function" else ""
        mutates = name.endswith("_") and getattr(getattr(x.target, "_schema", None), "is_mutable", False)
        if not (mutates or name in _ALIASING) or not x.args or not isinstance(x.args[0], fx.Node):
            return True
        x = x.args[0]


def _pinned(node: fx.Node) -> bool:
    """A reader asserts this node's sizes or strides: leave it as it is."""
    return any(
        u.target == _ASSERT_META and (u.kwargs.get("size") is not None or u.kwargs.get("stride") is not None)
        for u in node.users
    )


def _cancellable_pad(gm: fx.GraphModule, node: fx.Node, padded: dict[fx.Node, _Padded]) -> bool:
    """``constant_pad_nd(x, [0, 0, 0, 0, 0, P - C], 0)`` of a sliced ``x`` read only by convs with zero columns."""
    if node.op != "call_function" or node.target != _PAD or node.kwargs or len(node.args) not in (2, 3):
        return False
    x, pad = node.args[0], node.args[1]
    value = node.args[2] if len(node.args) > 2 else 0.0
    fact = padded.get(x)
    if fact is None or value != 0 or not isinstance(pad, (list, tuple)) or len(pad) < 6:
        return False
    if list(pad) != [0, 0, 0, 0, 0, fact.P - fact.C] + [0] * (len(pad) - 6):
        return False
    if not node.users:
        return False
    for user in node.users:
        groups = user.args[6] if len(user.args) > 6 else user.kwargs.get("groups", 1)
        if user.op != "call_function" or user.target != _CONV or groups != 1 or user.args[0] is not node:
            return False
        if any(a is node for a in user.args[1:]) or any(v is node for v in user.kwargs.values()):
            return False
        weight = user.args[1]
        if not isinstance(weight, fx.Node) or weight.op != "get_attr":
            return False
        w = get_attr_value(gm, weight.target)
        if not isinstance(w, torch.Tensor) or w.dim() != 4 or w.shape[1] != fact.P:
            return False
        if not _zero_from(gm, weight, 1, fact.C):
            return False
    return True


def _keep_channels_padded(gm: fx.GraphModule) -> tuple[int, list[str]]:
    """Sink channel slices below per-channel ops and cancel them against the next conv's pad (module docstring).

    Returns:
        ``(pairs, moved)``: how many pads were cancelled (each with the slice it undid), and the names of
        the ops now computed on padded tensors.
    """
    nodes = list(gm.graph.nodes)
    # Forward: which nodes are a slice of a padded tensor, through ops a slice may sink below.
    padded: dict[fx.Node, _Padded] = {}
    sources: set[fx.Node] = set()
    for node in nodes:
        if node.op != "call_function" or _pinned(node):
            continue
        fact = _source_slice(gm, node)
        if fact is not None:
            sources.add(node)
        else:
            fact = _padded_bound(node, padded)
        if fact is not None:
            padded[node] = fact
    # Backward: keep only what leads to a cancellable pad (each sunk op must feed one, through sunk ops).
    wanted: set[fx.Node] = set()
    pads: list[fx.Node] = []
    for node in reversed(nodes):
        if _cancellable_pad(gm, node, padded):
            pads.append(node)
            wanted.add(node.args[0])
        elif node in wanted and node not in sources:
            wanted.update(a for a in node.all_input_nodes if a in padded)
    if not pads:
        return 0, []
    # Rewrite, in graph order: each wanted op runs on the padded inputs; its old readers get a slice of it.
    full: dict[fx.Node, fx.Node] = {}  # C-channel node (a slice) -> the P-channel node it views
    moved: list[str] = []
    graph = gm.graph
    for node in nodes:
        if node not in wanted:
            continue
        if node in sources:
            full[node] = node.args[0]
            continue
        # The op keeps its node (and name); it now reads the padded tensors, and a slice serves its readers.
        old_val = node.meta.get("val")
        node.args = tuple(full.get(a, a) if isinstance(a, fx.Node) else a for a in node.args)
        new_val = fake_eval(node.target, node.args, node.kwargs)
        if new_val is not None:
            node.meta["val"] = new_val
        with graph.inserting_after(node):
            view = graph.call_function(_SLICE, (node, 1, 0, padded[node].C))
        node.replace_all_uses_with(view, delete_user_cb=lambda user: user is not view)
        view_val = fake_eval(_SLICE, view.args)
        copy_meta(node, view, old_val if view_val is None else view_val)
        full[view] = node
        moved.append(node.name)
    for pad in pads:
        pad.replace_all_uses_with(full[pad.args[0]])
        graph.erase_node(pad)
    return len(pads), moved


__all__ = ["BOUND_LIMIT", "TF32_REASON", "pad_conv_channels"]
