"""Fuse a convolution's bias, residual add and ReLU into one cuDNN kernel (``tctune::conv2d_relu`` /
``tctune::conv2d_add_relu``, :mod:`passes.cudnn_ops`).

Why: after BatchNorm folding, a ResNet block is ``relu(conv(x) + b)`` and ``relu(conv(x) + b + identity)``.
Inductor runs each convolution as an extern cuDNN call and the ReLU (and residual add) as a Triton kernel that
reads the convolution's output back and writes it again; cuDNN's fused kernels apply bias, add and ReLU in the
convolution's epilogue. Measured on an H100 (torch 2.11, cuDNN 9, ResNet-50 at batch 128, fp16, channels-last,
BatchNorm folded, each variant one CUDA graph, ``benchmarks/probe_cudnn_fused_conv.py``): Inductor with the
fused ops 4.10 ms per batch against 5.07 ms for Inductor on the same folded graph (1.24x), relative L2 error
against FP32 6.8e-4 against 7.2e-4.

Patterns (inference graphs from ``torch.export``, after ``fold_conv_batchnorm``):

* ``relu(conv2d(x, W, b))`` -> ``conv2d_relu(x, W, b, ...)``;
* ``relu(conv2d(x, W, b) + z)`` (either operand order; ``add_`` only when it writes into the convolution's
  output, as ``out += identity`` does) -> ``conv2d_add_relu(x, W, z, b, ...)``, ``z`` of the output's shape and
  dtype.

``relu`` / ``add`` may be the in-place forms (``nn.ReLU(inplace=True)``): they write into the convolution's own
output, which nothing else reads. The convolution is ``aten.conv2d`` (integer padding) or
``aten.convolution`` (not transposed), 4-D input, ``groups == 1``; its weight (and bias, when present) are
``get_attr`` tensors; its output and the add's feed only the next op of the pattern; no op between the
convolution and the ReLU writes in place into the convolution's input or the residual (the fused op runs at
the ReLU's place). When both operands of the add are such convolutions (``relu(conv_a(x) + conv_b(x))``), the
first is fused and the other is its residual. The weight is stored
channels-last (the layout cuDNN's NHWC kernels read; the ops' output is channels-last too).
The pass fuses only when at least :data:`MIN_SHARE` of the graph's 2-D convolutions are such sites.

When the pass refuses every site (the measured rule): training graphs (the ops have no autograd formula),
precisions other than fp16 / bf16 / fp8 (convolutions stay bf16 at fp8), targets other than Hopper (the only
architecture measured), grouped / depthwise convolutions (not measured). Each refusal is a ``Skip`` with its
reason. The engines (ONNX, TensorRT, AOTInductor) do not run this pass: the ops have no ONNX translation, and
TensorRT fuses convolution epilogues itself.
"""
from __future__ import annotations

import torch
from torch import fx
from torch._ops import HigherOrderOperator

from passes._graph import (copy_meta, fake_eval, fake_from_tensor, finish, get_attr_value, node_arg, op_name,
                           set_attr_tensor, view_base, writes_in_place)
from passes.base import PassResult, PassSpec, Skip
from passes.cudnn_ops import CONV2D_ADD_RELU, CONV2D_RELU

NAME = "fuse_conv_relu"

_aten = torch.ops.aten
_CONV2D = _aten.conv2d.default
_CONVOLUTION = _aten.convolution.default
_CONV2D_PADDING_STR = _aten.conv2d.padding  # padding="same" / "valid": refused with its reason
_CONV_TARGETS = (_CONV2D, _CONVOLUTION, _CONV2D_PADDING_STR)
_RELU = (_aten.relu.default, _aten.relu_.default)
_ADD = _aten.add.Tensor
_ADD_ = _aten.add_.Tensor
#: Precisions the rule admits: the fused kernel was measured at fp16; at fp8 convolutions run bf16.
PRECISIONS = ("fp16", "bf16", "fp8")
#: The least share of a graph's 2-D convolutions that must be fusable sites for the pass to fuse any. Measured on
#: the H200 (bf16, the backend against Inductor, ``results/zoo/2026-12-02-h200-fuse-conv/``): ResNet-50 (49 of 53
#: fused) and Inception-v3 (94 of 94) gained with CUDA graphs (1.03x -> 1.25x, 1.01x -> 1.41x); RepVGG-A2, where 5
#: of 44 convolutions are sites (only the blocks without an identity branch end in ``relu(conv + conv)``), lost
#: (1.10x -> 0.94x).
MIN_SHARE = 0.5
#: Architectures the rule admits (only Hopper measured; cuDNN's runtime-fusion engines differ by generation).
ARCHS = ("Hopper",)


def fuse_conv_relu(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """Replace ``relu(conv2d(x, W, b) [+ z])`` by one fused cuDNN convolution op, in place.

    ``x: (N, C_in, H, W)``, ``W: (C_out, C_in, kH, kW)``, ``b: (C_out,)`` or none, ``z: (N, C_out, H_out,
    W_out)``; the output keeps the ReLU's shape and dtype (channels-last strides).

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts: ``spec.training``, ``spec.precision`` and ``spec.arch`` decide whether any site
            fires (module docstring).

    Returns:
        A ``PassResult`` named ``"fuse_conv_relu"``: ``count`` fused convolutions, ``changed`` the new nodes,
        ``notes["kinds"]`` maps each to ``"relu"`` or ``"add_relu"``; ``skipped`` names every convolution
        followed by a ReLU that was left alone, with the reason.
    """
    result = PassResult(name=NAME, graph_module=gm)
    refusal = _spec_refusal(spec)
    ready = []
    claimed: dict[fx.Node, fx.Node] = {}  # a ready site's ReLU -> its convolution
    for node in list(gm.graph.nodes):
        site = _site(node)
        if site is None:
            between = _relu_behind(node)
            if between is not None:
                result.skipped.append(Skip(node.name, refusal or f"its output reaches the ReLU through "
                                                                 f"{op_name(between)} (e.g. pad_conv_channels' "
                                                                 f"channel slice): not fused"))
            continue
        add, z, act = site
        reason = refusal or _conv_reason(gm, node) or _add_reason(node, add, z) \
            or _write_reason(node, add, z, act)
        if reason is None and act in claimed:
            # relu(conv_a(x) + conv_b(x)) (RepVGG, a residual add of a downsample convolution written out of
            # place): both convolutions end in the one add and ReLU; the first is fused, the other is its z
            reason = f"the add's other operand {claimed[act].name} is fused with this ReLU (one convolution per add)"
        if reason is not None:
            result.skipped.append(Skip(node.name, reason))
        else:
            claimed[act] = node
            ready.append(node)
    convs = sum(1 for n in gm.graph.nodes if _is_conv2d(n))
    if ready and len(ready) < MIN_SHARE * convs:
        reason = (f"only {len(ready)} of the graph's {convs} 2-D convolutions can be fused: the rule fuses when at "
                  f"least {MIN_SHARE:.0%} can (a few channels-last fused ops among Inductor's own convolutions "
                  f"measured slower)")
        result.skipped.extend(Skip(node.name, reason) for node in ready)
        ready = []
    kinds: dict[str, str] = {}
    originals: dict[fx.Node, object] = {}  # fused node -> the replaced ReLU's fake value (eager's strides)
    for node in ready:
        # the site again, from the graph as it is now: an earlier rewrite may have replaced its residual (a
        # ResNet block's identity is the previous block's ReLU, now that block's fused op)
        site = _site(node)
        if site is None:
            continue
        add, z, act = site
        originals_val = act.meta.get("val")
        fused = _rewrite(gm, node, add, z, act)
        originals[fused] = originals_val
        kinds[fused.name] = "add_relu" if add is not None else "relu"
        result.changed.append(fused.name)
        result.count += 1
    if result.count:
        restored = _repropagate(gm, originals)
        result.notes["kinds"] = kinds
        if restored:
            result.notes["layout_restored"] = restored
        finish(gm)
    return result


#: Ops that read a tensor's memory layout itself (explicit strides), not its logical elements: their inputs must
#: keep the strides the model gave them.
_LAYOUT_READERS = frozenset(
    getattr(_aten, n).default for n in ("as_strided", "as_strided_", "as_strided_copy", "_reshape_alias")
    if hasattr(_aten, n))
_CLONE = _aten.clone.default


def _strides(val) -> list:
    """The strides of every tensor in a fake value (a tensor or a tuple / list of them), None for non-tensors."""
    return [tuple(v.stride()) if isinstance(v, torch.Tensor) else None
            for v in torch.utils._pytree.tree_leaves(val)]


def _repropagate(gm: fx.GraphModule, originals: dict[fx.Node, object]) -> list[str]:
    """Carry the fused ops' channels-last strides through the graph's fake values, and keep eager's layout
    where it matters.

    Every node downstream of a fused op whose input strides changed gets its ``meta["val"]`` recomputed. Where
    the new strides would change what the graph computes or returns, the value is copied back to its original
    memory format (``aten.clone(memory_format=...)``) for that reader: a graph output (the caller gets
    eager's strides), an op that reads explicit strides (``as_strided``), and an op that fails on the new strides
    (``view`` of a channels-last tensor that is not viewable). Returns the names of the nodes given such a copy.

    A value whose eager layout is a view (``y[:, :2]``, ``y.permute(...)``, an element of ``split``), and any
    value ``as_strided`` reads (it may reach outside the view, at the view's storage offset), is restored by
    copying the tensor it is a view of and replaying the views on the copy. The copy is made right after the
    value, shared by its readers, unless the graph writes the value (or a tensor it aliases) in place
    (``y.add_(1)`` after ``y = relu(conv(x))``): then it is made just before its reader, so it sees the writes.

    Raises:
        RuntimeError: an original layout is neither contiguous nor channels-last, nor a view of such a tensor,
            so it cannot be restored; or a view the new strides need a copy for aliases a tensor written in
            place (a view of a copy would not see the writes). ``passes.build_graph`` then builds the graph
            without this pass.
    """
    graph = gm.graph
    before = dict(originals)  # node -> its value before the pass (eager's strides)
    changed = {n for n, v in originals.items() if _strides(v) != _strides(n.meta.get("val"))}
    restored: list[str] = []
    copies: dict[fx.Node, fx.Node] = {}
    made: set[fx.Node] = set()
    # tensors written in place somewhere (by their alias root): a copy of one of them, or of a view of one, must
    # be made just before its reader, or it would miss the writes between the value and the reader
    written = {_alias_root(t) for n in graph.nodes for t in writes_in_place(n)}

    def restore(reader: fx.Node, value: fx.Node) -> None:
        # the copy is made of the tensor ``value`` is a view of (``chain``: the views between, replayed on the
        # copy) when ``value``'s own layout is not dense (a slice, a permute of the NCHW output), and always for
        # an op that reads the storage itself (as_strided may reach outside the view)
        src, chain = value, []
        while src in before and (reader.target in _LAYOUT_READERS or _memory_format(before[src]) is None):
            base = view_base(src)
            if base is None or base not in before:
                break
            chain.append(src)
            src = base
        orig = before[src]
        if not isinstance(orig, torch.Tensor):
            raise RuntimeError(f"cannot restore the layout of {value.name}: not a single tensor")
        fmt = _memory_format(orig)
        if fmt is None:
            raise RuntimeError(f"cannot restore the layout of {value.name}: strides {tuple(orig.stride())}")
        mutable = _alias_root(src) in written
        if mutable and reader.op != "output" and view_base(reader) is not None:
            # eager's view would alias the written tensor; a view of a copy would not see the writes
            raise RuntimeError(f"cannot restore the layout of {value.name} for {reader.name}: a view of a tensor "
                               f"written in place")
        shared = not mutable and not chain
        copy_ = copies.get(src) if shared else None
        if copy_ is None:
            with (graph.inserting_after(src) if shared else graph.inserting_before(reader)):
                copy_ = graph.call_function(_CLONE, (src,), {"memory_format": fmt})
                copy_meta(src, copy_, fake_eval(_CLONE, copy_.args, copy_.kwargs))
                made.add(copy_)
                for view in reversed(chain):
                    copy_ = graph.node_copy(view, lambda a, s=src, c=copy_: c if a is s else a)
                    copy_meta(view, copy_, fake_eval(copy_.target, copy_.args, copy_.kwargs))
                    made.add(copy_)
                    src = view
            if shared:
                copies[src] = copy_
        reader.replace_input_with(value, copy_)
        restored.append(reader.name)

    for node in list(graph.nodes):
        hit = [a for a in node.all_input_nodes if a in changed]
        if not hit or node in made:
            continue
        if node.op == "output" or node.target in _LAYOUT_READERS or isinstance(node.target, HigherOrderOperator):
            # a region (torch.autocast(enabled=False), cond, a checkpoint) was traced on the original strides
            for a in hit:
                restore(node, a)
            continue
        if node.op != "call_function":
            continue
        new = fake_eval(node.target, node.args, node.kwargs)
        if new is None:  # e.g. a view the new strides do not allow: compute it on the original layout
            for a in hit:
                restore(node, a)
            new = fake_eval(node.target, node.args, node.kwargs)
            if new is None:
                raise RuntimeError(f"{node.name} ({node.target}) fails on the fused convolutions' layout")
        old = node.meta.get("val")
        if _strides(new) != _strides(old):
            before[node] = old
            changed.add(node)
        node.meta["val"] = new
    return restored


def _memory_format(val) -> torch.memory_format | None:
    """The memory format ``aten.clone`` gives a copy with ``val``'s strides: contiguous, or channels-last for
    a 4-D tensor; None for other strides (a view, a permuted layout) or a value that is not a tensor."""
    if not isinstance(val, torch.Tensor):
        return None
    if val.is_contiguous():
        return torch.contiguous_format
    if val.dim() == 4 and val.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return None


def _spec_refusal(spec: PassSpec) -> str | None:
    if spec.training:
        return "training: the fused cuDNN convolution ops have no autograd formula"
    if spec.arch not in ARCHS:
        return f"arch {spec.arch}: the fused cuDNN kernel is used on {', '.join(ARCHS)} only (measured there)"
    if spec.precision not in PRECISIONS:
        return f"precision {spec.precision}: used at {', '.join(PRECISIONS)} only (measured at fp16 / bf16)"
    return None


def _site(conv: fx.Node) -> tuple[fx.Node | None, object, fx.Node] | None:
    """``(add, z, relu)`` when ``conv`` is a convolution whose only reader is a ReLU (``add`` None) or an add
    whose only reader is a ReLU (``z`` the add's other operand); else None (not a candidate)."""
    if conv.op != "call_function" or conv.target not in _CONV_TARGETS \
            or len(conv.users) != 1:
        return None
    user = next(iter(conv.users))
    if user.op == "call_function" and user.target in _RELU:
        return None, None, user
    if user.op != "call_function" or user.target not in (_ADD, _ADD_) or len(user.args) != 2 \
            or len(user.users) != 1:
        return None
    act = next(iter(user.users))
    if act.op != "call_function" or act.target not in _RELU:
        return None
    lhs, rhs = user.args
    return user, (rhs if lhs is conv else lhs), act


def _relu_behind(conv: fx.Node) -> fx.Node | None:
    """For a 2-D convolution that is not a site: the one op between it and a ReLU (its only reader, whose only
    reader is the ReLU), else None."""
    if not _is_conv2d(conv) or len(conv.users) != 1:
        return None
    user = next(iter(conv.users))
    if user.op != "call_function" or len(user.users) != 1:
        return None
    act = next(iter(user.users))
    return user if act.op == "call_function" and act.target in _RELU else None


def _is_conv2d(node: fx.Node) -> bool:
    """A 2-D, not transposed convolution node (the denominator of :data:`MIN_SHARE`)."""
    if node.op != "call_function" or node.target not in _CONV_TARGETS:
        return False
    args = _conv_args(node)
    xv = getattr(args[0], "meta", {}).get("val")
    return not args[6] and isinstance(xv, torch.Tensor) and xv.dim() == 4


def _conv_args(conv: fx.Node) -> tuple:
    """``(x, W, b, stride, padding, dilation, transposed, groups)`` of an ``aten.conv2d`` / ``aten.convolution``
    node, with defaults filled in."""
    def arg(i, name, default):
        return node_arg(conv, i, name, default)
    common = (arg(0, "input", None), arg(1, "weight", None), arg(2, "bias", None), arg(3, "stride", [1, 1]),
              arg(4, "padding", [0, 0]), arg(5, "dilation", [1, 1]))
    if conv.target == _CONVOLUTION:
        return (*common, arg(6, "transposed", False), arg(8, "groups", 1))
    return (*common, False, arg(6, "groups", 1))


def _pair(v) -> list[int] | None:
    """A 2-D convolution's stride / padding / dilation as two ints (a single int is repeated), else None."""
    if isinstance(v, str):
        return None
    v = [v] if isinstance(v, int) else list(v)
    if len(v) == 1:
        v = v * 2
    return v if len(v) == 2 and all(isinstance(i, int) and not isinstance(i, bool) for i in v) else None


def _is_attr(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "get_attr"


def _conv_reason(gm: fx.GraphModule, conv: fx.Node) -> str | None:
    """Why ``conv`` cannot be one of the fused ops (None: it can)."""
    x, w, b, stride, padding, dilation, transposed, groups = _conv_args(conv)
    if transposed:
        return "transposed convolution"
    xv, yv = getattr(x, "meta", {}).get("val"), conv.meta.get("val")
    if not isinstance(xv, torch.Tensor) or xv.dim() != 4 or not xv.is_floating_point() \
            or not isinstance(yv, torch.Tensor):
        return "not a 2-D convolution of a floating 4-D input"
    if groups != 1:
        return f"grouped or depthwise convolution (groups={groups}): the fused kernel is not measured there"
    if not _is_attr(w) or (b is not None and not _is_attr(b)):
        return "weight or bias is not a get_attr tensor"
    weight = get_attr_value(gm, w.target)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 4 or not weight.is_floating_point():
        return "weight is not a floating 4-D tensor"
    if any(_pair(v) is None for v in (stride, padding, dilation)):
        return "stride, padding or dilation is not two integers (e.g. padding='same')"
    return None


def _add_reason(conv: fx.Node, add: fx.Node | None, z) -> str | None:
    """Why the residual add after ``conv`` cannot be fused (None: it can, or there is no add)."""
    if add is None:
        return None
    if set(add.kwargs) - {"alpha"} or add.kwargs.get("alpha", 1) != 1:
        return "the add has an alpha other than 1"
    if add.target == _ADD_ and add.args[0] is not conv:
        return (f"the in-place add writes into {add.args[0].name}, not into this convolution's output: this one "
                f"is the residual (one convolution per add is fused)")
    zv, yv = getattr(z, "meta", {}).get("val"), conv.meta["val"]
    if not isinstance(z, fx.Node) or z is conv or not isinstance(zv, torch.Tensor):
        return "the add's other operand is not a tensor of the graph"
    if zv.dtype != yv.dtype or zv.dim() != 4 or list(zv.shape) != list(yv.shape):
        return "the residual's shape or dtype differs from the convolution's output (a broadcast add)"
    return None


def _alias_root(node):
    """The tensor ``node`` is a view (or the in-place result) of, followed to its end (``node`` itself when it is
    a new tensor); ``passes._graph.view_base`` decides each step."""
    seen = set()
    while isinstance(node, fx.Node) and node not in seen:
        seen.add(node)
        base = view_base(node)
        if base is None:
            return node
        node = base
    return node


def _write_reason(conv: fx.Node, add: fx.Node | None, z, act: fx.Node) -> str | None:
    """Why the fused op cannot run at the ReLU's place: an op between the convolution and the ReLU writes in
    place into the convolution's input, weight or bias, or into the residual ``z`` (or a view of one of them),
    so the fused op would read the written values where eager's convolution (and add) read the old ones."""
    x, w, b = _conv_args(conv)[:3]
    read = {_alias_root(t) for t in (x, w, b, z) if isinstance(t, fx.Node)}
    node = conv.next
    while node is not act and node.op != "root":
        if node is not add and any(_alias_root(t) in read for t in writes_in_place(node)):
            return (f"{node.name} writes in place into the convolution's input or the residual between the "
                    f"convolution and its ReLU (the fused op, at the ReLU's place, would read the new values)")
        node = node.next
    return None


def _rewrite(gm: fx.GraphModule, conv: fx.Node, add: fx.Node | None, z, act: fx.Node) -> fx.Node:
    """Replace ``act(add(conv, z))`` / ``act(conv)`` by one fused op; returns the new node."""
    x, w, b, stride, padding, dilation, _, groups = _conv_args(conv)
    weight = get_attr_value(gm, w.target)
    if len(w.users) == 1 and not weight.is_contiguous(memory_format=torch.channels_last):
        # cuDNN's NHWC kernels read a channels-last weight; stored once instead of copied at every call.
        weight = weight.contiguous(memory_format=torch.channels_last)
        set_attr_tensor(gm, w.target, weight)
        fake = fake_from_tensor(w.meta.get("val"), weight)
        if fake is not None:
            w.meta["val"] = fake
    geometry = (_pair(stride), _pair(padding), _pair(dilation), int(groups))
    graph = gm.graph
    with graph.inserting_before(act):
        if add is None:
            fused = graph.call_function(CONV2D_RELU, (x, w, b, *geometry))
        else:
            fused = graph.call_function(CONV2D_ADD_RELU, (x, w, z, b, *geometry))
        copy_meta(conv, fused, fake_eval(fused.target, fused.args))
    act.replace_all_uses_with(fused)
    graph.erase_node(act)
    if add is not None:
        graph.erase_node(add)
    graph.erase_node(conv)
    return fused


__all__ = ["ARCHS", "MIN_SHARE", "NAME", "PRECISIONS", "fuse_conv_relu"]
