"""Fuse a linear's bias + activation into the GEMM epilogue (``aten._addmm_activation``, cuBLASLt).

Why: after a linear, an activation such as GELU is a separate kernel that reads and writes the whole
``(tokens, N)`` output again. On the H200, BERT-large's GELUs took 3.3 ms of 32.7 ms of kernels per batch
(benchmarks/NOTES.md, reference measurements): epilogue fusion is one of the fp16 levers. On CUDA,
``aten._addmm_activation(bias, x2d, W.t(), use_gelu=...)`` runs cuBLASLt with a ``BIAS + RELU`` or
``BIAS + GELU`` epilogue, applied to the tile while it is still in registers.

Semantics, checked against PyTorch's kernels (``aten/src/ATen/native/cuda/Blas.cpp``, torch 2.11-2.13):

* ``use_gelu=False`` is ``relu(x @ W.t() + b)`` on every device: ``relu`` is always fused.
* ``use_gelu=True`` is the **tanh approximation** of GELU on CUDA (the cuBLASLt GELU epilogue, and the
  non-Lt fallback calls ``gelu_(..., "tanh")``), but **erf** GELU on the CPU (measured: the CPU result equals
  ``F.gelu(approximate="none")`` exactly). So ``gelu(approximate="tanh")`` is fused only when the target is a
  GPU (``spec.arch != "cpu"``) *and* the graph's tensors live on a CUDA device, and exact GELU (``approximate="none"``, BERT's) is never fused: the epilogue
  would change the model's numbers.
* ``aten._addmm_activation`` has no autograd derivative (``RuntimeError: derivative for
  aten::_addmm_activation is not implemented``): the pass refuses every candidate when ``spec.training``.

Pattern: ``linear(x, W, b)`` whose only user is ``relu`` / ``gelu``, optionally through the
``slice(-1, 0, N)`` that ``pad_linear_dims`` puts after a padded linear (an element-wise activation
commutes with that slice, and the slice's single user must be the activation). ``x: (..., K)`` is reshaped
to ``(M, K)``, the result back to ``(..., N)``. Weights and bias must be ``get_attr`` tensors, the bias 1-D.
"""
from __future__ import annotations

import torch
from torch import fx

from passes._graph import copy_meta, fake_eval, finish, op_name
from passes.base import PassResult, PassSpec, Skip
from passes.fp8_numerics import FP8_MULTIPLE

NAME = "fuse_epilogue"

_LINEAR = torch.ops.aten.linear.default
_ADDMM_ACT = torch.ops.aten._addmm_activation.default
_RESHAPE = torch.ops.aten.reshape.default
_T = torch.ops.aten.t.default
_SYM_SIZE = torch.ops.aten.sym_size.int
_SLICE = torch.ops.aten.slice.Tensor


def fuse_epilogue(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """Replace ``act(linear(x, W, b))`` by ``aten._addmm_activation`` where the semantics match exactly.

    ``x: (..., K)``, ``W: (N, K)``, ``b: (N,)``; the output keeps shape ``(..., N)`` and dtype.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts; ``spec.arch == "cpu"`` refuses tanh-GELU (the CPU kernel computes erf GELU),
            ``spec.training`` refuses everything (no autograd derivative).

    Returns:
        A ``PassResult`` named ``"fuse_epilogue"``: ``count`` is the number of fused linears, ``changed`` the
        new ``_addmm_activation`` nodes, ``notes["activations"]`` maps each to ``"relu"`` or ``"gelu_tanh"``;
        ``skipped`` names every linear followed by an activation that was left alone, with the reason.
    """
    result = PassResult(name=NAME, graph_module=gm)
    acts: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != _LINEAR:
            continue
        # The linear's output must reach exactly one activation, directly or through pad_linear's slice.
        if len(node.users) != 1:
            continue
        user = next(iter(node.users))
        sliced = None
        if user.target == _SLICE and _is_last_dim_prefix(user) and len(user.users) == 1:
            sliced, user = user, next(iter(user.users))
        if user.op != "call_function" or op_name(user) not in ("relu", "gelu"):
            continue
        kind, reason = _activation(user, spec)
        if reason is None:
            reason = _operands_reason(node)
        if reason is None and spec.precision == "fp8" and _fp8_eligible(node):
            reason = "precision fp8: left for cast_fp8_linears (an FP8 GEMM beats the bf16 epilogue)"
        if reason is not None:
            result.skipped.append(Skip(node.name, reason))
            continue
        fused = _rewrite(gm, node, sliced, user, kind)
        acts[fused.name] = kind
        result.changed.append(fused.name)
        result.count += 1
    if result.count:
        result.notes["activations"] = acts
        finish(gm)
    return result


def _is_last_dim_prefix(node: fx.Node) -> bool:
    """Whether ``node`` is ``slice(x, -1 | rank-1, 0, n)`` with step 1 (pad_linear_dims' slice back)."""
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(val, torch.Tensor) or len(node.args) < 4:
        return False
    dim, start = node.args[1], node.args[2]
    step = node.args[4] if len(node.args) > 4 else 1
    return isinstance(dim, int) and dim % val.dim() == val.dim() - 1 and start == 0 and step == 1


def _fp8_eligible(linear: fx.Node) -> bool:
    """K and N of ``linear``'s weight are multiples of ``FP8_MULTIPLE`` (16: what cast_fp8_linears needs)."""
    w = linear.args[1].meta.get("val") if isinstance(linear.args[1], fx.Node) else None
    return isinstance(w, torch.Tensor) and w.dim() == 2 and all(int(d) % FP8_MULTIPLE == 0 for d in w.shape)


def _activation(act: fx.Node, spec: PassSpec) -> tuple[str, str | None]:
    """``(kind, None)`` when the epilogue computes ``act`` exactly on ``spec``'s target, else ``("", reason)``."""
    if spec.training:
        return "", "training: aten._addmm_activation has no autograd derivative"
    if op_name(act) == "relu":
        return "relu", None
    approximate = act.args[1] if len(act.args) > 1 else act.kwargs.get("approximate", "none")
    if approximate != "tanh":
        return "", f"gelu approximate={approximate!r}: the cuBLASLt GELU epilogue is the tanh approximation"
    if spec.arch.lower() == "cpu":
        return "", "gelu tanh on CPU: aten._addmm_activation computes erf GELU there"
    val = act.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.device.type != "cuda":
        # A GPU target planned on a CPU graph (--target h100 on a CPU machine) still runs on the CPU.
        return "", "gelu tanh on a CPU tensor: aten._addmm_activation computes erf GELU there"
    return "gelu_tanh", None


def _operands_reason(linear: fx.Node) -> str | None:
    x, w = linear.args[0], linear.args[1]
    b = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    if b is None:
        return "linear has no bias (the epilogue op needs one)"
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in (x, w, b)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return "no shape metadata on the linear's operands"
    xv, wv, bv = vals
    if wv.dim() != 2 or bv.dim() != 1 or xv.dim() < 2:
        return "linear operands are not x (..., K), W (N, K), b (N,)"
    if not (xv.dtype == wv.dtype == bv.dtype):
        return "linear operands have different dtypes"
    return None


def _rewrite(gm: fx.GraphModule, linear: fx.Node, sliced: fx.Node | None, act: fx.Node, kind: str) -> fx.Node:
    graph = gm.graph
    x, w, b = linear.args[0], linear.args[1], linear.args[2] if len(linear.args) > 2 else linear.kwargs["bias"]
    xv = x.meta["val"]
    n_out = w.meta["val"].shape[0]
    with graph.inserting_before(linear):
        x2d = x
        if xv.dim() != 2:
            x2d = graph.call_function(_RESHAPE, (x, [-1, int(w.meta["val"].shape[1])]))
            copy_meta(x, x2d, fake_eval(_RESHAPE, x2d.args))
        wt = graph.call_function(_T, (w,))
        copy_meta(w, wt, fake_eval(_T, wt.args))
        fused = graph.call_function(_ADDMM_ACT, (b, x2d, wt), {"use_gelu": kind == "gelu_tanh"})
        copy_meta(linear, fused, fake_eval(_ADDMM_ACT, fused.args, fused.kwargs))
        out = fused
        if xv.dim() != 2:
            out = graph.call_function(_RESHAPE, (fused, [*_leading_sizes(graph, x, xv), n_out]))
            copy_meta(act, out, linear.meta.get("val"))
    if sliced is not None:
        # act(slice(linear)) == slice(act(linear)): keep the slice, now after the fused op.
        sliced.replace_input_with(linear, out)
        act.replace_all_uses_with(sliced)
    else:
        act.replace_all_uses_with(out)
    graph.erase_node(act)
    graph.erase_node(linear)
    return fused


def _leading_sizes(graph: fx.Graph, x: fx.Node, xv: torch.Tensor) -> list:
    """``x``'s leading sizes for the reshape back, read at run time with ``aten.sym_size.int``.

    Never baked from ``meta["val"]``: a fake ``aten.constant_pad_nd`` (``pad_linear_dims``) specializes the
    symbolic batch in the shared shape environment, so a size that reads as a constant may be the batch.
    """
    sizes = []
    for i, size in enumerate(xv.shape[:-1]):
        node = graph.call_function(_SYM_SIZE, (x, i))
        node.meta["val"] = size
        sizes.append(node)
    return sizes


__all__ = ["fuse_epilogue"]
