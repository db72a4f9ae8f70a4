"""Fuse hand-written attention into one ``aten.scaled_dot_product_attention`` op.

Why: a hand-written ``softmax(q @ k^T * scale + mask) @ v`` runs as two batched GEMMs, an element-wise scale,
a mask add and a softmax over the full ``(batch, heads, L, S)`` score tensor, which is written to and read
back from memory several times. SDPA picks a fused kernel (flash / cuDNN / memory-efficient) that never
materializes the scores. On the H200, cuDNN flash attention took 2.8 ms of BERT-large's 32.7 ms per batch
where the decomposed form takes 35 ms under ``torch.compile`` (benchmarks/NOTES.md, reference measurements).
Models written without ``F.scaled_dot_product_attention`` (``attn_implementation="eager"`` in
``transformers``, many research codebases) only get there through this rewrite.

Pattern, as ``torch.export`` (non-strict, torch 2.13, no decompositions) records it::

    scores = aten.matmul(q, aten.transpose(k, -2, -1))     # or permute swapping the last two dims;
                                                           # aten.bmm for 3-D operands
    scores = aten.mul(scores, c) | aten.div(scores, c)     # optional, c a Python number
    scores = aten.add(scores, mask)                        # optional, floating mask of the scores' dtype
    probs  = aten.softmax(scores, -1) | aten._softmax(scores, -1, False)
    probs  = aten.dropout(probs, p, False)                 # optional, only with train=False (or p == 0)
    out    = aten.matmul(probs, v)                         # or aten.bmm

becomes ``aten.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=c | 1/c | 1.0)``, with a
contiguous copy (``aten.clone``) of each of q, k, v whose last dimension is not of stride 1 (CUDA's fused
kernels require it; without it PyTorch runs the math fallback, FP32 GEMMs for fp16/bf16 inputs). Every
intermediate (scores, scaled, masked, probs) must have exactly one user; q, k, v must be 3-D or 4-D with
equal leading dimensions, ``q.shape[-1] == k.shape[-1]`` and ``k.shape[-2] == v.shape[-2]`` (read from
``meta["val"]``), and the mask must broadcast to the scores without enlarging them.

Not handled (left as they are, no Skip entry unless the chain starts with a score matmul): a scale applied
to q or k before the matmul, ``baddbmm``, matmul decomposed to ``expand``/``view``/``bmm`` by
``run_decompositions`` (4-D), bool masks applied with ``masked_fill`` / ``where``, active dropout, softmax
in another dtype, grouped-query attention with fewer k/v heads, and a ``1/sqrt(d)`` computed from a symbolic
size (the scale must be a constant).
"""
from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from passes._graph import copy_meta, dense_last_dim, fake_eval, finish, op_name
from passes.base import PassResult, PassSpec, Skip

NAME = "fuse_attention"

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_MATMULS = (torch.ops.aten.matmul.default, torch.ops.aten.bmm.default)


class _NoMatch(Exception):
    """The chain is not fusable; ``args[0]`` is the reason."""


def fuse_attention(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """Replace each hand-written attention chain by ``aten.scaled_dot_product_attention``, in place.

    For ``q: (B, H, L, E)`` (or ``(B, L, E)``), ``k: (B, H, S, E)``, ``v: (B, H, S, Ev)`` the new node computes
    ``softmax(q @ k^T * scale + mask) @ v`` of shape ``(B, H, L, Ev)`` and dtype of q, exactly the old output.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts (unused: an active dropout is refused in every mode, the rewrite is exact otherwise).

    Returns:
        A ``PassResult`` named ``"fuse_attention"``: ``count`` is the number of chains fused, ``changed`` the
        new SDPA node names; ``skipped`` names each score matmul (``matmul(q, k^T)``) not fused, with the
        reason; ``notes["scales"]`` maps each new node to the scale it was given, ``notes["made_contiguous"]``
        lists the q / k / v values that got a contiguous copy (last dimension not of stride 1: CUDA's fused
        SDPA kernels need stride 1 there, see ``_dense_last_dim``).
    """
    del spec
    result = PassResult(name=NAME, graph_module=gm)
    scales: dict[str, float] = {}
    dense: list[str] = []  # q / k / v values given a contiguous copy (_dense_last_dim)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _MATMULS:
            continue
        k = _transposed_key(node)
        # Only matmuls of the form q @ k^T start an attention chain.
        if k is None:
            continue
        try:
            q, v, mask, scale, chain = _match(node)
            out = chain[-1]
            _check_shapes(q, k, v, mask, node)
        except _NoMatch as exc:
            result.skipped.append(Skip(node.name, str(exc)))
            continue
        with gm.graph.inserting_before(out):
            q, k, v = (_dense_last_dim(gm, x, dense) for x in (q, k, v))
            sdpa = gm.graph.call_function(_SDPA, (q, k, v, mask, 0.0, False), {"scale": scale})
        val = fake_eval(_SDPA, sdpa.args, sdpa.kwargs)
        copy_meta(out, sdpa, val if val is not None else out.meta.get("val"))
        out.replace_all_uses_with(sdpa)
        # Erase the chain explicitly: DCE keeps ``aten.dropout`` (tagged nondeterministic, so "impure").
        for dead in reversed(chain):
            gm.graph.erase_node(dead)
        scales[sdpa.name] = scale
        result.changed.append(sdpa.name)
        result.count += 1
    if result.count:
        result.notes["scales"] = scales
        result.notes["made_contiguous"] = dense
        finish(gm)
    return result


def _dense_last_dim(gm: fx.GraphModule, x: fx.Node, made: list[str]) -> fx.Node:
    """``x``, or a contiguous copy of it when its last dimension may not have stride 1
    (:func:`passes._graph.dense_last_dim`; ``x``'s name is appended to ``made``).

    A hand-written attention whose heads come from ``reshape(...).permute(...)`` of a fused QKV projection
    (timm's Visformer: q of shape ``(B, H, N, D)`` with strides ``(.., .., 1, N)``) would otherwise hand SDPA
    views that only its math fallback takes; the model's own fused path calls ``q.contiguous()`` for the same
    reason.
    """
    dense = dense_last_dim(gm.graph, x)
    if dense is None:
        return x
    made.append(x.name)
    return dense


def _transposed_key(mm: fx.Node) -> fx.Node | None:
    """``k`` when ``mm``'s second operand is ``k`` with its last two dimensions swapped, else None."""
    kt = mm.args[1]
    if not isinstance(kt, fx.Node) or kt.op != "call_function" or not isinstance(kt.args[0], fx.Node):
        return None
    val = kt.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    rank = val.dim()
    name = op_name(kt)
    if name == "transpose" and len(kt.args) == 3:
        dims = sorted(d % rank for d in kt.args[1:3] if isinstance(d, int))
        return kt.args[0] if dims == [rank - 2, rank - 1] else None
    if name == "permute":
        perm = [d % rank for d in kt.args[1]]
        return kt.args[0] if perm == [*range(rank - 2), rank - 1, rank - 2] else None
    return None


def _only_user(node: fx.Node, what: str) -> fx.Node:
    if len(node.users) != 1:
        raise _NoMatch(f"{what} {node.name} has {len(node.users)} users")
    return next(iter(node.users))


def _match(mm: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, float, list[fx.Node]]:
    """Walk ``mm``'s single-user chain; returns ``(q, v, mask, scale, chain)``, ``chain`` from ``mm`` to the
    final matmul, in order."""
    q = mm.args[0]
    chain = [mm]
    cur, user = mm, _only_user(mm, "scores")
    scale = 1.0
    if user.op == "call_function" and op_name(user) in ("mul", "div") and user.args[0] is cur:
        c = user.args[1]
        if not isinstance(c, numbers.Real) or isinstance(c, bool) or c == 0:
            raise _NoMatch(f"scale {user.name} is not a non-zero constant")
        scale = float(c) if op_name(user) == "mul" else 1.0 / float(c)
        chain.append(user)
        cur, user = user, _only_user(user, "scaled scores")
    mask = None
    if user.op == "call_function" and op_name(user) == "add":
        if user.kwargs.get("alpha", 1) != 1 or len(user.args) != 2:
            raise _NoMatch(f"mask add {user.name} has an alpha")
        mask = user.args[1] if user.args[0] is cur else user.args[0]
        if not isinstance(mask, fx.Node) or mask is cur:
            raise _NoMatch(f"mask add {user.name} does not add a tensor mask")
        chain.append(user)
        cur, user = user, _only_user(user, "masked scores")
    if user.op != "call_function" or op_name(user) not in ("softmax", "_softmax"):
        raise _NoMatch(f"scores feed {user.name}, not a softmax")
    rank = cur.meta["val"].dim() if isinstance(cur.meta.get("val"), torch.Tensor) else None
    dim = user.args[1]
    if rank is None or not isinstance(dim, int) or dim % rank != rank - 1:
        raise _NoMatch(f"softmax {user.name} is not over the last dimension")
    if op_name(user) == "softmax" and (len(user.args) > 2 and user.args[2] is not None or user.kwargs.get("dtype")):
        raise _NoMatch(f"softmax {user.name} changes dtype")
    if op_name(user) == "_softmax" and user.args[2]:
        raise _NoMatch(f"softmax {user.name} computes in another dtype (half_to_float)")
    chain.append(user)
    cur, user = user, _only_user(user, "probabilities")
    if user.op == "call_function" and op_name(user) == "dropout":
        p, train = user.args[1], user.args[2] if len(user.args) > 2 else user.kwargs.get("train", True)
        if train and p != 0:
            raise _NoMatch(f"dropout {user.name} is active (train=True, p={p})")
        chain.append(user)
        cur, user = user, _only_user(user, "probabilities")
    if user.op != "call_function" or user.target not in _MATMULS or user.args[0] is not cur:
        raise _NoMatch(f"probabilities feed {user.name}, not a matmul with v")
    return q, user.args[1], mask, scale, [*chain, user]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001
        return False


def _check_shapes(q: fx.Node, k: fx.Node, v: fx.Node, mask: fx.Node | None, mm: fx.Node) -> None:
    vals = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in (q, k, v)]
    if not all(isinstance(t, torch.Tensor) for t in vals):
        raise _NoMatch("no shape metadata on q, k or v")
    qv, kv, vv = vals
    if not qv.dim() == kv.dim() == vv.dim() or qv.dim() not in (3, 4):
        raise _NoMatch(f"q, k, v ranks {qv.dim()}, {kv.dim()}, {vv.dim()} are not all 3 or all 4")
    if not (qv.dtype == kv.dtype == vv.dtype) or not qv.is_floating_point():
        raise _NoMatch("q, k, v are not of one floating dtype")
    if not all(_same(a, b) and _same(a, c) for a, b, c in zip(qv.shape[:-2], kv.shape[:-2], vv.shape[:-2])):
        raise _NoMatch("q, k, v leading (batch, heads) dimensions differ")
    if not _same(qv.shape[-1], kv.shape[-1]) or not _same(kv.shape[-2], vv.shape[-2]):
        raise _NoMatch("q/k head dims or k/v sequence lengths differ")
    if mask is None:
        return
    mv = mask.meta.get("val")
    if not isinstance(mv, torch.Tensor):
        raise _NoMatch("no shape metadata on the mask")
    if mv.dtype != qv.dtype:
        raise _NoMatch(f"mask dtype {mv.dtype} differs from the scores' {qv.dtype}")
    scores = (*qv.shape[:-1], kv.shape[-2])
    if mv.dim() > len(scores) or not all(
        _same(m, 1) or _same(m, s) for m, s in zip(reversed(mv.shape), reversed(scores))
    ):
        raise _NoMatch("mask does not broadcast to the scores without enlarging them")


__all__ = ["fuse_attention"]
