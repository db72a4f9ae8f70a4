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

Patterns. The GEMM is ``linear(x, W, b)`` (``nn.Linear``, ``W: (N, K)``) or ``addmm(b, x2d, W)`` with a
``get_attr`` ``W: (K, N)`` (transformers' ``Conv1D``, GPT-2's block GEMMs), with a 1-D bias. Its output reaches
the activation directly, or through the ``slice(-1, 0, N)`` that ``pad_linear_dims`` puts after a padded linear
(an element-wise activation commutes with that slice), or through the ``view``/``reshape`` back to
``(..., N)`` that ``Conv1D`` writes after its ``addmm``; that intermediate node must have the activation as its
only user. The activation is ``relu``, ``gelu(approximate="tanh")``, or the tanh approximation written out as
transformers' ``NewGELUActivation`` (``"gelu_new"``: GPT-2, GPT-Neo, GPT-J) computes it,
``0.5 * y * (1 + tanh(sqrt(2 / pi) * (y + 0.044715 * y ** 3)))`` (matched op by op, constants within 1e-6
relative; its nodes must read nothing but ``y`` and each other, and ``y`` must feed only them). ``x: (..., K)``
of a linear is reshaped to ``(M, K)``, the result back to ``(..., N)``. Weights and bias must be ``get_attr``
tensors, the bias 1-D.

At precision fp8 a GEMM ``cast_fp8_linears`` will run in FP8 (K and N multiples of 16 and its module on no
``spec.fp8_keep`` pattern) is left to that pass; a GEMM the FP8 keep-list keeps bf16 is fused.
"""
from __future__ import annotations

import torch
from torch import fx

import math

from passes._graph import copy_meta, fake_eval, finish, op_name
from passes.base import PassResult, PassSpec, Skip
from passes.fp8_numerics import fp8_keep_hit, weight_gemm, weight_ineligible

NAME = "fuse_epilogue"

_LINEAR = torch.ops.aten.linear.default
_ADDMM_ACT = torch.ops.aten._addmm_activation.default
_RESHAPE = torch.ops.aten.reshape.default
_T = torch.ops.aten.t.default
_SYM_SIZE = torch.ops.aten.sym_size.int
_SLICE = torch.ops.aten.slice.Tensor
_ADDMM = torch.ops.aten.addmm.default
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)
_MUL = torch.ops.aten.mul.Tensor
_ADD = torch.ops.aten.add.Tensor
_TANH = torch.ops.aten.tanh.default
_POW = torch.ops.aten.pow.Tensor_Scalar
#: The constants of the tanh approximation of GELU: sqrt(2 / pi) and the cubic coefficient (Hendrycks & Gimpel,
#: "Gaussian Error Linear Units", 2016; transformers' NewGELUActivation uses the same).
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


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
        gemm = _gemm(node)
        if gemm is None or not node.users:
            continue
        # The GEMM's output must reach exactly one activation, directly or through one slice / view.
        between, y = None, node
        user = next(iter(node.users))
        if len(node.users) == 1 and ((user.target == _SLICE and gemm == "linear" and _is_last_dim_prefix(user))
                                     or (user.target in _VIEWS and gemm == "addmm")):
            between, y = user, user
        act, formula = _activation_site(y)
        if act is None:
            continue
        kind, reason = _activation(act, spec, formula)
        if reason is None:
            reason = _operands_reason(node, gemm)
        if reason is None and spec.precision == "fp8" and _fp8_bound(gm, node, spec):
            reason = "precision fp8: left for cast_fp8_linears (an FP8 GEMM beats the bf16 epilogue)"
        if reason is not None:
            result.skipped.append(Skip(node.name, reason))
            continue
        fused = _rewrite(gm, node, gemm, between, act, formula, kind)
        acts[fused.name] = kind
        result.changed.append(fused.name)
        result.count += 1
    if result.count:
        result.notes["activations"] = acts
        finish(gm)
    return result


def _gemm(node: fx.Node) -> str | None:
    """``"linear"`` for ``aten.linear``, ``"addmm"`` for ``aten.addmm(b, x, W)`` with a ``get_attr`` ``W``
    (``Conv1D``), else None (an activation @ activation product has no weight to fuse against)."""
    if node.op != "call_function":
        return None
    if node.target == _LINEAR:
        return "linear"
    if node.target == _ADDMM and len(node.args) >= 3 and isinstance(node.args[2], fx.Node) \
            and node.args[2].op == "get_attr":
        return "addmm"
    return None


def _activation_site(y: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    """The activation applied to ``y`` and nothing else: ``(relu/gelu node, [])``, ``(root, nodes)`` for the
    written-out tanh GELU (``root`` its last ``mul``, ``nodes`` every node of the formula), or ``(None, [])``."""
    users = list(y.users)
    if len(users) == 1 and users[0].op == "call_function" and op_name(users[0]) in ("relu", "gelu"):
        return users[0], []
    formula = _tanh_gelu_formula(y)
    return (formula[-1], formula) if formula else (None, [])


def _const(v, want: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isclose(float(v), want, rel_tol=1e-6)


def _split(node: fx.Node, target, want: float | None = None) -> tuple | None:
    """The operands of a binary ``node`` with ``target``; with ``want``, ``(tensor operand, constant)`` in
    either order, else None."""
    if node.op != "call_function" or node.target != target or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if want is None:
        return a, b
    if _const(b, want) and isinstance(a, fx.Node):
        return a, b
    if _const(a, want) and isinstance(b, fx.Node):
        return b, a
    return None


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _tanh_gelu_formula(y: fx.Node) -> list[fx.Node]:
    """The nodes of ``0.5 * y * (1 + tanh(sqrt(2/pi) * (y + 0.044715 * y**3)))`` computed on ``y``, the result
    last, when ``y`` feeds only them and they read nothing else; else ``[]``."""
    users = list(y.users)
    if len(users) != 3:
        return []
    half = next((u for u in users if (m := _split(u, _MUL, 0.5)) and m[0] is y), None)
    cube = next((u for u in users if u.op == "call_function" and u.target == _POW and len(u.args) == 2
                 and u.args[0] is y and _const(u.args[1], 3.0)), None)
    inner = next((u for u in users if (a := _split(u, _ADD)) and any(o is y for o in a)), None)
    if half is None or cube is None or inner is None:
        return []
    scaled = _only_user(cube)
    if scaled is None or (m := _split(scaled, _MUL, _CUBIC)) is None or m[0] is not cube:
        return []
    a = _split(inner, _ADD)
    if not ((a[0] is y and a[1] is scaled) or (a[0] is scaled and a[1] is y)) or _only_user(scaled) is not inner:
        return []
    arg = _only_user(inner)
    if arg is None or (m := _split(arg, _MUL, _SQRT_2_OVER_PI)) is None or m[0] is not inner:
        return []
    tanh = _only_user(arg)
    if tanh is None or tanh.op != "call_function" or tanh.target != _TANH:
        return []
    one_plus = _only_user(tanh)
    if one_plus is None or (m := _split(one_plus, _ADD, 1.0)) is None or m[0] is not tanh:
        return []
    root = _only_user(one_plus)
    r = _split(root, _MUL) if root is not None else None
    if r is None or not ((r[0] is half and r[1] is one_plus) or (r[0] is one_plus and r[1] is half)) \
            or _only_user(half) is not root:
        return []
    return [half, cube, scaled, inner, arg, tanh, one_plus, root]


def _is_last_dim_prefix(node: fx.Node) -> bool:
    """Whether ``node`` is ``slice(x, -1 | rank-1, 0, n)`` with step 1 (pad_linear_dims' slice back)."""
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(val, torch.Tensor) or len(node.args) < 4:
        return False
    dim, start = node.args[1], node.args[2]
    step = node.args[4] if len(node.args) > 4 else 1
    return isinstance(dim, int) and dim % val.dim() == val.dim() - 1 and start == 0 and step == 1


def _fp8_bound(gm: fx.GraphModule, gemm_node: fx.Node, spec: PassSpec) -> bool:
    """Whether ``cast_fp8_linears`` will make ``gemm_node`` an FP8 GEMM: its weight is eligible
    (``fp8_numerics.weight_ineligible``: a 2-D floating parameter, K and N multiples of 16) and the FP8 keep-list
    does not keep it bf16 (``fp8_numerics.fp8_keep_hit``), the same two tests that pass makes."""
    gemm = weight_gemm(gemm_node)
    return (gemm is not None and weight_ineligible(gm, gemm) is None
            and fp8_keep_hit(gemm_node, spec.fp8_keep) is None)


def _activation(act: fx.Node, spec: PassSpec, formula: list[fx.Node] = ()) -> tuple[str, str | None]:
    """``(kind, None)`` when the epilogue computes ``act`` exactly on ``spec``'s target, else ``("", reason)``.
    ``formula``: the nodes of a written-out tanh GELU whose result is ``act`` (empty for a relu / gelu node)."""
    if spec.training:
        return "", "training: aten._addmm_activation has no autograd derivative"
    if not formula:
        if op_name(act) == "relu":
            return "relu", None
        approximate = act.args[1] if len(act.args) > 1 else act.kwargs.get("approximate", "none")
        if approximate != "tanh":
            return "", f"gelu approximate={approximate!r}: the cuBLASLt GELU epilogue is the tanh approximation"
    if spec.arch.lower() == "cpu":
        return "", "gelu tanh on CPU: aten._addmm_activation computes erf GELU there"
    if not _on_cuda(act):
        # A GPU target planned on a CPU graph (--target h100 on a CPU machine) still runs on the CPU.
        return "", "gelu tanh on a CPU tensor: aten._addmm_activation computes erf GELU there"
    return "gelu_tanh", None


def _on_cuda(node: fx.Node) -> bool:
    """Whether ``node``'s value lives on a CUDA device (its ``meta["val"]``)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cuda"


def _operands_reason(node: fx.Node, gemm: str) -> str | None:
    if gemm == "linear":
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    else:
        b, x, w = node.args[:3]
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return "addmm with beta or alpha other than 1"
    if b is None:
        return "linear has no bias (the epilogue op needs one)"
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in (x, w, b)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return "no shape metadata on the linear's operands"
    xv, wv, bv = vals
    if gemm == "linear" and (wv.dim() != 2 or bv.dim() != 1 or xv.dim() < 2):
        return "linear operands are not x (..., K), W (N, K), b (N,)"
    if gemm == "addmm" and (wv.dim() != 2 or xv.dim() != 2 or tuple(bv.shape) != (wv.shape[1],)):
        return "addmm operands are not b (N,), x (M, K), W (K, N)"
    if not (xv.dtype == wv.dtype == bv.dtype):
        return "linear operands have different dtypes"
    return None


def _rewrite(gm: fx.GraphModule, node: fx.Node, gemm: str, between: fx.Node | None, act: fx.Node,
             formula: list[fx.Node], kind: str) -> fx.Node:
    """Replace ``act(between(node))`` by ``between(_addmm_activation(...))``; returns the fused node."""
    graph = gm.graph
    use_gelu = {"use_gelu": kind == "gelu_tanh"}
    if gemm == "addmm":
        b, x2d, w = node.args[:3]
        with graph.inserting_before(node):
            fused = graph.call_function(_ADDMM_ACT, (b, x2d, w), use_gelu)
            copy_meta(node, fused, fake_eval(_ADDMM_ACT, fused.args, fused.kwargs))
        out = fused
    else:
        x, w, b = node.args[0], node.args[1], node.args[2] if len(node.args) > 2 else node.kwargs["bias"]
        xv = x.meta["val"]
        n_out = w.meta["val"].shape[0]
        with graph.inserting_before(node):
            x2d = x
            if xv.dim() != 2:
                x2d = graph.call_function(_RESHAPE, (x, [-1, int(w.meta["val"].shape[1])]))
                copy_meta(x, x2d, fake_eval(_RESHAPE, x2d.args))
            wt = graph.call_function(_T, (w,))
            copy_meta(w, wt, fake_eval(_T, wt.args))
            fused = graph.call_function(_ADDMM_ACT, (b, x2d, wt), use_gelu)
            copy_meta(node, fused, fake_eval(_ADDMM_ACT, fused.args, fused.kwargs))
            out = fused
            if xv.dim() != 2:
                out = graph.call_function(_RESHAPE, (fused, [*_leading_sizes(graph, x, xv), n_out]))
                copy_meta(act, out, node.meta.get("val"))
    if between is not None:
        # act(slice(linear)) == slice(act(linear)) and act(view(addmm)) == view(act(addmm)): the slice / view
        # stays, now after the fused op.
        between.replace_input_with(node, out)
        act.replace_all_uses_with(between)
    else:
        act.replace_all_uses_with(out)
    for dead in reversed(formula or [act]):
        graph.erase_node(dead)
    graph.erase_node(node)
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
