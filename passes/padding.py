"""Helpers shared by the padding passes (``pad_linear_dims``, ``pad_matmul_dims``, ``pad_conv_channels``).

A padding pass grows a weight with zeros under its *same* attribute names (``replace_tensor``: tied weights
stay one tensor, ``state_dict`` keys unchanged), pads the activation's last dimension with zeros
(``pad_input_k``: ``aten.constant_pad_nd``) and slices the GEMM's output back to its original width
(``slice_back``: ``aten.slice.Tensor``), so every reader sees the original shape. ``weight_users`` finds
every reader of a weight through any of its names (a shared weight must be padded for all of them or not
at all), and ``PADDED_FLAG`` marks the nodes a padding pass rewrote.

Imports torch only.
"""
from __future__ import annotations

import torch
from torch import fx

from passes._graph import alias_targets, copy_meta, fake_eval, fake_from_tensor, get_attr_value, set_attr_tensor

_PAD = torch.ops.aten.constant_pad_nd.default
_SLICE = torch.ops.aten.slice.Tensor

#: ``node.meta`` flag set on every linear, GEMM or convolution a padding pass has padded.
PADDED_FLAG = "tctune_padded"


def weight_users(gm: fx.GraphModule, tensor: torch.Tensor) -> list[tuple[fx.Node, fx.Node]]:
    """``(user, get_attr node)`` for every use of ``tensor`` through any of its attribute names."""
    names = set(alias_targets(gm, tensor))
    uses = []
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        if node.target not in names and get_attr_value(gm, node.target) is not tensor:
            continue
        uses.extend((user, node) for user in node.users)
    return uses


def pad_input_k(gm: fx.GraphModule, node: fx.Node, x_node: fx.Node, k_old: int, k_new: int, pad_cache: dict) -> None:
    """Feed ``node`` its activation ``x_node`` zero-padded on the last dim from ``k_old`` to ``k_new``.

    One pad node per ``(x_node, k_new)`` (``pad_cache``), shared by every GEMM reading the same input.
    """
    key = (x_node, k_new)
    if key not in pad_cache:
        # Before the GEMM, not after x: x may be a placeholder followed by other placeholders.
        with gm.graph.inserting_before(node):
            pad = gm.graph.call_function(_PAD, (x_node, [0, k_new - k_old], 0.0))
        copy_meta(x_node, pad, fake_eval(_PAD, pad.args))
        pad_cache[key] = pad
    node.replace_input_with(x_node, pad_cache[key])


def slice_back(gm: fx.GraphModule, node: fx.Node, n_old: int) -> None:
    """Insert ``aten.slice.Tensor(node, -1, 0, n_old)`` after ``node`` and route all its users through it."""
    if any(u.target == _SLICE and u.args[1:4] == (-1, 0, n_old) for u in node.users):
        return
    old_val = node.meta.get("val")
    with gm.graph.inserting_after(node):
        sliced = gm.graph.call_function(_SLICE, (node, -1, 0, n_old))
    node.replace_all_uses_with(sliced, delete_user_cb=lambda user: user is not sliced)
    copy_meta(node, sliced, old_val)
    new_val = fake_eval(node.target, node.args, node.kwargs)
    if new_val is not None:
        node.meta["val"] = new_val


def replace_tensor(gm: fx.GraphModule, old: torch.Tensor, target: str, new: torch.Tensor) -> torch.Tensor:
    """Store ``new`` under every attribute name bound to ``old`` (tied weights stay tied) and refresh the
    ``meta["val"]`` of the ``get_attr`` nodes that read them. Returns the tensor now stored."""
    targets = alias_targets(gm, old) or [target]
    for name in targets:
        set_attr_tensor(gm, name, new)
    stored = get_attr_value(gm, targets[0])
    for name in targets[1:]:  # keep aliases as one object, as they were
        set_attr_tensor(gm, name, stored)
        _rebind(gm, name, stored)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in targets:
            fake = fake_from_tensor(node.meta.get("val"), stored)
            if fake is not None:
                node.meta["val"] = fake
    return stored


def _rebind(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    """Bind the exact object ``value`` (a parameter) under ``target``."""
    *path, name = target.split(".")
    owner = gm.get_submodule(".".join(path)) if path else gm
    if name in owner._parameters:
        owner._parameters[name] = value
    elif name in owner._buffers:
        owner._buffers[name] = value


__all__ = ["PADDED_FLAG", "pad_input_k", "replace_tensor", "slice_back", "weight_users"]
