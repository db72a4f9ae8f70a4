"""Pad 2-D convolutions' input and output channels to what the Tensor Core kernels want.

Why: cuDNN's fast fp16/bf16 convolution kernels want channel counts that are multiples of the alignment;
measured on the H200 (DESIGN.md): a 3x3 conv with C=61 takes 0.59 ms against 0.29 ms at C=64, and the 7x7
stem conv with Cin 3 / 4 / 8 takes 1.12 / 0.97 / 1.78 ms, so Cin 3 pads to 4, not to 8. Which multiple,
and whether at all, is ``passes.should_pad``'s answer (the measured table); this pass does what is legal.

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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from passes._graph import copy_meta, fake_eval, finish, get_attr_value, keep_outputs_contiguous, round_up
from passes.base import PassResult, PassSpec, Skip
from passes.pad_linear import PADDED_FLAG, _replace_tensor, _weight_users
from passes.should_pad import should_pad

NAME = "pad_conv_channels"

_CONV = torch.ops.aten.conv2d.default
_TRANSPOSED = (torch.ops.aten.conv_transpose2d.input, torch.ops.aten.conv_transpose1d.default,
               torch.ops.aten.conv_transpose3d.input)
_PAD = torch.ops.aten.constant_pad_nd.default
_SLICE = torch.ops.aten.slice.Tensor

#: Skip reason at fp32 / tf32 (no channel rule measured for FP32-storage convolutions).
TF32_REASON = "TF32 convs: no channel rule measured"


def pad_conv_channels(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """Pad every eligible ``aten.conv2d``'s Cin and Cout per ``passes.should_pad``, in place.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts: ``spec.precision`` (only fp16 / bf16 pad), ``spec.align()`` (elements),
            ``spec.arch`` (picks the measured rules, e.g. the Hopper fp16 stem rule Cin 3 -> 4).

    Returns:
        A ``PassResult`` named ``"pad_conv_channels"``: ``count`` convolutions rewritten,
        ``notes["padded"]`` maps node name to ``{"Cin": [old, new], "Cout": [old, new]}``,
        ``notes["should_pad"]`` the decisions behind them.
    """
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
        bias_node = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
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
        if len(_weight_users(gm, weight)) > 1:
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
        if cin_new != cin and (x_val is None or x_val.dim() != 4 or x_val.shape[1] != cin):
            reasons.append("input is not (batch, Cin, H, W) with a static Cin: Cin not padded")
            cin_new = cin
        # Cout: the bias (if any) must be a parameter read by this conv alone.
        bias = None
        if cout_new != cout and bias_node is not None:
            if not isinstance(bias_node, fx.Node) or bias_node.op != "get_attr":
                reasons.append("bias is not a parameter: Cout not padded")
                cout_new = cout
            else:
                bias = get_attr_value(gm, bias_node.target)
                if len(_weight_users(gm, bias)) > 1:
                    reasons.append("shared bias: Cout not padded")
                    cout_new, bias = cout, None
        if cin_new == cin and cout_new == cout:
            result.skipped.append(Skip(node.name, "; ".join(reasons) or "already aligned"))
            continue
        result.skipped.extend(Skip(node.name, r) for r in reasons)

        # Rewrite: weight rows (Cout) and columns (Cin), bias, then the graph around the conv.
        new_weight = F.pad(weight.detach(), (0, 0, 0, 0, 0, cin_new - cin, 0, cout_new - cout))
        _replace_tensor(gm, weight, w_node.target, new_weight)
        if bias is not None:
            _replace_tensor(gm, bias, bias_node.target, F.pad(bias.detach(), (0, cout_new - cout)))
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
            copy_meta(node, sliced, old_val)
        if new_val is not None:
            node.meta["val"] = new_val
        node.meta[PADDED_FLAG] = True
        padded[node.name] = {"Cin": [cin, cin_new], "Cout": [cout, cout_new]}
        result.changed.append(node.name)
        result.count += 1

    if decisions:
        result.notes["should_pad"] = decisions
    if result.count:
        result.notes["padded"] = padded
        keep_outputs_contiguous(gm)
        finish(gm)
    return result


__all__ = ["TF32_REASON", "pad_conv_channels"]
