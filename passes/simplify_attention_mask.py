"""Drop attention masks that provably mask nothing, and turn provably causal ones into ``is_causal=True``, so
SDPA can pick its flash / cuDNN kernels.

Why: under ``torch.export`` ``transformers`` materializes the "no padding" attention mask instead of passing
``attn_mask=None`` as it does eagerly: BERT's graph builds ``ge(unsqueeze(arange(S) + 0), 0)`` and expands it
to ``(batch, 1, S, S)``, an all-True bool mask handed to ``aten.scaled_dot_product_attention``. Any mask rules
out the flash kernel; on the H200 this made the captured BERT-base 2x slower than eager at every precision
(benchmarks/NOTES.md, the "walking skeleton" entry). Eager-attention models add an all-zero float mask
(``where(mask, 0.0, finfo.min)``) the same way; once ``fuse_attention`` has made it an SDPA mask, this pass
drops it too.

How (a proof, not a test run): the mask's producers are interpreted abstractly. Every value on the mask's
path is represented by a concrete tensor ``R`` of the same rank and dtype such that, *for every batch size*,
the real value is ``R.expand(real_shape)``:

* a sub-graph that reads no graph input (constants, ``arange`` of fixed sizes, ``get_attr`` buffers) is
  evaluated concretely: ``R`` is its value (random ops and sub-graphs over 2**24 elements are refused);
* ``expand`` (its sizes may be symbolic, e.g. the batch) keeps ``R``; ``unsqueeze`` / ``transpose`` /
  ``permute`` apply to ``R``; ``slice`` keeps ``R`` along a broadcast dimension and applies fixed bounds
  otherwise; ``view`` / ``reshape`` / ``squeeze`` / ``flatten`` are allowed when ``R`` is uniform (all
  elements equal), whose reshapes are uniform too;
* element-wise ops (ATen's ``pointwise`` tag, ``where``, ``_to_copy``, ``clone``, eval dropout) apply to the
  ``R`` of their inputs: broadcasting commutes with element-wise functions.

* factories of a symbolic size (``new_ones``, ``zeros``, ``full``) are uniform; ``cumsum`` / ``diff`` apply to
  ``R`` along a dimension that has its real, static size in ``R``;
* ``arange`` of a symbolic size (``arange(batch)``) has unknown values: it may only be an ``index.Tensor`` index
  into a dimension along which the indexed ``R`` is a broadcast (every in-range index reads the same values).

A graph input (placeholder) anywhere on the path, other than through the *sizes* of shape ops, makes the mask
data-dependent and it is kept. The mask is dropped when ``R`` is all True (bool) or all 0 (float; SDPA adds a
float mask) and the mask's shape broadcasts to the attention scores' ``(..., L, S)`` without enlarging them;
then ``attn_mask=None`` computes exactly the same attention.

Causal masks: ``transformers`` decoders (GPT-2, Llama) under ``torch.export`` build the causal mask from
``arange`` and position ids instead of passing ``is_causal=True``, which keeps SDPA off its flash kernel. When
``R`` is, in every batch and head, exactly SDPA's own causal triangle (``torch.ones(L, S).tril()``, top-left
aligned; bool, or float 0 / ``-inf`` or ``<= finfo.min``) with static ``L <= S`` and no dropout, the mask is
replaced by ``is_causal=True`` (``notes["causal"]`` lists those nodes). Other masks (padding from an input,
shifted or bottom-right triangles, ALiBi biases, ``-1e4`` fills) are never touched.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from passes._graph import finish, get_attr_value, node_arg, op_name, set_node_arg, storage_of, writes_in_place
from passes.base import PassResult, PassSpec, Skip

NAME = "simplify_attention_mask"

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
#: Largest sub-graph value (elements) the pass evaluates concretely.
_MAX_ELEMENTS = 1 << 24

_RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "squeeze", "flatten", "unflatten", "alias"})
_ELEMENTWISE = frozenset(
    {"where", "_to_copy", "to", "clone", "contiguous", "detach", "lift_fresh_copy", "type_as", "masked_fill",
     "__and__", "__or__", "__xor__", "__invert__", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
     "logical_and", "logical_or", "logical_xor", "logical_not"}
)
#: Factories whose sizes may be symbolic (read from a graph input's shape): a uniform tensor of that rank.
_FILLS = {"new_ones": 1, "new_zeros": 0, "ones": 1, "zeros": 0, "new_full": None, "full": None}


class _Unprovable(Exception):
    """The mask could not be proven trivial; ``args[0]`` is the one-line reason."""


class _Sym:
    """Marker for a symbolic integer (a size read from a graph input)."""


_SYM = _Sym()


class _Idx:
    """An integer tensor whose values are not known (``arange`` of a symbolic size, e.g. the batch), good only
    as an ``index.Tensor`` index into a dimension along which the indexed value is a broadcast (all slices
    equal), where any in-range index selects the same values. ``rank`` is its number of dimensions."""

    def __init__(self, rank: int, source: str) -> None:
        self.rank = rank
        self.source = source

    def unprovable(self) -> "_Unprovable":
        return _Unprovable(f"mask depends on graph input {self.source} (values of an arange over its size)")


def simplify_attention_mask(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """Set ``attn_mask=None`` on every ``aten.scaled_dot_product_attention`` whose mask provably masks nothing.

    A mask of shape broadcastable to the scores ``(batch, heads, L, S)`` qualifies when it is all True (bool)
    or all 0 (float) for every batch size (see the module docstring for the proof). Shapes and dtypes of
    every output are unchanged; the mask's producers become dead and are removed.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts (unused: the rewrite is exact at every precision and in training).

    Returns:
        A ``PassResult`` named ``"simplify_attention_mask"``: ``count`` is the number of SDPA nodes whose mask
        was dropped (``changed`` their names); ``skipped`` has each SDPA whose mask was kept, with the reason
        (``"mask depends on graph input attention_mask"``, ``"mask has False entries (a real mask)"``, ...).
    """
    del spec
    result = PassResult(name=NAME, graph_module=gm)
    memo: dict[fx.Node, Any] = {}
    # Storages some op writes in place (``mask[1] = True`` on a clone): a mask built from one is not what its
    # producers compute, so the proof below does not hold for it.
    written: dict[Any, str] = {}
    for n in gm.graph.nodes:
        for arg in writes_in_place(n):
            ref = storage_of(arg)
            if ref is not None:
                written.setdefault(ref, n.name)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != _SDPA:
            continue
        mask = node_arg(node, 3, "attn_mask")
        # No mask: nothing to simplify (also covers an earlier run of this pass).
        if mask is None:
            continue
        if not isinstance(mask, fx.Node):
            result.skipped.append(Skip(node.name, "mask is not a graph value"))
            continue
        causal = False
        try:
            _check_broadcast(node, mask)
            _check_not_written(mask, written)
            rep = _rep(gm, mask, memo)
            try:
                _check_trivial(rep)
            except _Unprovable as not_trivial:
                if not _is_causal(node, rep):
                    raise not_trivial
                causal = True
        except _Unprovable as exc:
            result.skipped.append(Skip(node.name, str(exc)))
            continue
        set_node_arg(node, 3, "attn_mask", None)
        if causal:
            set_node_arg(node, 5, "is_causal", True)
            result.notes.setdefault("causal", []).append(node.name)
        result.changed.append(node.name)
        result.count += 1
    if result.count:
        finish(gm)
    return result


def _is_causal(sdpa: fx.Node, rep: Any) -> bool:
    """Whether the mask is exactly SDPA's ``is_causal=True`` mask: for every batch and head, position ``i`` of
    the ``L`` queries sees keys ``j <= i`` (top-left aligned, ``torch.ones(L, S).tril()``, as SDPA defines it).

    Bool masks must equal that triangle. Float masks must be 0 on it and ``-inf`` or at most
    ``torch.finfo(dtype).min`` off it (what ``transformers`` writes): every row keeps its diagonal, so
    ``exp`` of such a score is exactly 0 as with ``-inf``. Needs static ``L`` and ``S``, no dropout and no
    ``is_causal`` already set; every leading (batch, head) slice of the representative must be that triangle.
    """
    if not isinstance(rep, torch.Tensor) or rep.dim() < 2:
        return False
    if node_arg(sdpa, 4, "dropout_p", 0.0) != 0.0 or node_arg(sdpa, 5, "is_causal", False):
        return False
    q, k = (a.meta.get("val") for a in sdpa.args[:2])
    L, S = q.shape[-2], k.shape[-2]
    if not (isinstance(L, int) and isinstance(S, int)) or L > S or tuple(rep.shape[-2:]) != (L, S):
        return False
    tri = torch.ones(L, S, dtype=torch.bool, device=rep.device).tril()
    planes = rep.reshape(-1, L, S)  # every batch / head slice (static batch: evaluated whole) must be the triangle
    if planes.dtype == torch.bool:
        return bool((planes == tri).all())
    if not planes.is_floating_point():
        return False
    allowed_zero = bool((planes[:, tri] == 0).all())
    off = planes[:, ~tri]
    masked = bool((off <= torch.finfo(planes.dtype).min).all())  # -inf included
    return allowed_zero and masked


def _same(a: Any, b: Any) -> bool:
    """Whether two (possibly symbolic) sizes are provably equal."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - unknown symbolic relation: not provable
        return False


def _check_broadcast(sdpa: fx.Node, mask: fx.Node) -> None:
    """The mask must broadcast to the scores ``q.shape[:-1] + (S,)`` without enlarging them."""
    q, k = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in sdpa.args[:2])
    m = mask.meta.get("val")
    if not all(isinstance(t, torch.Tensor) for t in (q, k, m)):
        raise _Unprovable("no shape metadata on the query, key or mask")
    scores = (*q.shape[:-1], k.shape[-2])
    if m.dim() > len(scores):
        raise _Unprovable("mask has more dimensions than the attention scores")
    for ms, ss in zip(reversed(m.shape), reversed(scores)):
        if not (_same(ms, 1) or _same(ms, ss)):
            raise _Unprovable("mask shape does not provably broadcast to the attention scores")


def _check_not_written(mask: fx.Node, written: dict) -> None:
    """Refuse a mask any of whose producers (itself included) shares a storage an op writes in place."""
    if not written:
        return
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        ref = storage_of(node)
        if ref is not None and ref in written:
            raise _Unprovable(f"mask path {node.name} is written in place (by {written[ref]})")
        stack.extend(node.all_input_nodes)


def _check_trivial(rep: Any) -> None:
    if not isinstance(rep, torch.Tensor):
        raise _Unprovable("mask is not a tensor")
    if rep.numel() == 0:
        raise _Unprovable("mask is empty")
    if rep.dtype == torch.bool:
        if not bool(rep.all()):
            raise _Unprovable("mask has False entries (a real mask)")
    elif rep.is_floating_point():
        if not bool((rep == 0).all()):
            raise _Unprovable("float mask has non-zero entries (a real mask or bias)")
    else:
        raise _Unprovable(f"mask dtype {rep.dtype} is neither bool nor floating")


# ------------------------------------------------------------------------------------- abstract evaluation


def _inputs(node: fx.Node, memo: dict) -> frozenset:
    """Names of the graph inputs (placeholders) ``node`` reads, directly or through its producers."""
    key = ("inputs", node)
    if key in memo:
        return memo[key]
    if node.op == "placeholder":
        found = frozenset({node.name})
    else:
        found = frozenset()
        for arg in node.all_input_nodes:
            found |= _inputs(arg, memo)
    memo[key] = found
    return found


def _rep(gm: fx.GraphModule, node: fx.Node, memo: dict) -> Any:
    """The concrete representative of ``node`` (see module docstring), ``_SYM`` for a symbolic integer.

    Raises:
        _Unprovable: ``node``'s value may depend on graph data, or an op is not understood.
    """
    if node in memo:
        if isinstance(memo[node], _Unprovable):
            raise memo[node]
        return memo[node]
    try:
        memo[node] = _rep_uncached(gm, node, memo)
    except _Unprovable as exc:
        memo[node] = exc
        raise
    return memo[node]


def _rep_uncached(gm: fx.GraphModule, node: fx.Node, memo: dict) -> Any:
    val = node.meta.get("val")
    if node.op == "placeholder":
        raise _Unprovable(f"mask depends on graph input {node.name}")
    if node.op == "get_attr":
        value = get_attr_value(gm, node.target)
        if not isinstance(value, torch.Tensor):
            raise _Unprovable(f"mask reads non-tensor attribute {node.target}")
        return value
    if node.op != "call_function":
        raise _Unprovable(f"mask comes from a {node.op} node ({node.name})")
    inputs = _inputs(node, memo)
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool) and inputs:
        return _SYM  # a size read from a graph input: only allowed as a shape argument below
    name = op_name(node)
    if not inputs:
        too_large = isinstance(val, torch.Tensor) and isinstance(val.numel(), int) and val.numel() > _MAX_ELEMENTS
        if not too_large and not any(_broadcast_rep(gm, a, memo) for a in node.all_input_nodes):
            return _evaluate(gm, node, memo)
        # Too large to evaluate (a (batch, 1, L, S) mask at a large static batch, as torch.compile's graphs have
        # it), or an op reading such a value: represented by its un-broadcast value, with the rules below (the
        # same as for a broadcast to a symbolic batch), never evaluated at full size.
    source = sorted(inputs)[0] if inputs else None
    if not isinstance(val, torch.Tensor):
        raise _Unprovable(f"mask depends on graph input {source} (through {name})" if source else
                          f"mask path reads a non-tensor {name} of a broadcast too large to evaluate")
    rank = val.dim()
    if name == "arange":
        return _Idx(1, source)  # arange(batch): values unknown, usable only as an index (_index)
    if name == "unsqueeze" and isinstance(src := _rep(gm, node.args[0], memo), _Idx):
        return _Idx(rank, src.source)
    if name == "index":
        return _index(gm, node, memo, rank)
    if name in _ALONG_DIM:
        return _along_dim(gm, node, memo, name)
    if name == "expand":
        r = _tensor_arg(gm, node.args[0], memo)
        return r.reshape((1,) * (rank - r.dim()) + tuple(r.shape))
    if name == "unsqueeze":
        return _tensor_arg(gm, node.args[0], memo).unsqueeze(_int_arg(node.args[1]))
    if name == "transpose":
        return _tensor_arg(gm, node.args[0], memo).transpose(_int_arg(node.args[1]), _int_arg(node.args[2]))
    if name == "permute":
        return _tensor_arg(gm, node.args[0], memo).permute([_int_arg(d) for d in node.args[1]])
    if name == "slice":
        return _slice(gm, node, memo, rank)
    if name in _RESHAPES:
        return _uniform(_tensor_arg(gm, node.args[0], memo), rank, name)
    if name in _FILLS:
        # new_ones(x, size) / ones(size) / full(size, v): the same value everywhere, whatever the sizes.
        fill = _FILLS[name]
        if fill is None:
            fill = node.args[2] if name == "new_full" else node.args[1]
            if isinstance(fill, fx.Node):
                raise _Unprovable(f"mask path fills with a graph value ({name})")
        return torch.full((1,) * rank, fill, dtype=val.dtype, device=val.device)
    if name == "dropout" and (len(node.args) < 3 or node.args[2] is False):
        return _tensor_arg(gm, node.args[0], memo)  # eval dropout is the identity
    if name in _ELEMENTWISE or torch.Tag.pointwise in getattr(node.target, "tags", ()):
        if torch.Tag.nondeterministic_seeded in node.target.tags:
            raise _Unprovable(f"mask is random ({name})")
        args = _map_args(gm, node.args, memo)
        kwargs = _map_args(gm, node.kwargs, memo)
        if source is None:  # the operands' equal slices as broadcasts, so the result stays small
            args, kwargs = (fx.node.map_aggregate(a, _unbroadcast) for a in (args, kwargs))
        out = node.target(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.numel() > _MAX_ELEMENTS:
            raise _Unprovable(f"mask sub-graph {node.name} is too large to evaluate ({out.numel()} elements)")
        return out
    if source is None:
        raise _Unprovable(f"mask sub-graph {node.name} is too large to evaluate ({name} of a broadcast, which is "
                          f"not shape-only or element-wise)")
    raise _Unprovable(
        f"mask depends on graph input {source} through {name}, which is not shape-only or element-wise"
    )


def _unbroadcast(value: Any) -> Any:
    """``value`` with every dimension along which all its slices are equal cut to size 1: the same values once
    broadcast back, so an element-wise op on it gives a representative of the op's full result. Non-tensors
    are returned as they are."""
    if not isinstance(value, torch.Tensor):
        return value
    for dim in range(value.dim()):
        if value.shape[dim] > 1:
            first = value.narrow(dim, 0, 1)
            if bool((value == first).all()):
                value = first
    return value


def _broadcast_rep(gm: fx.GraphModule, node: fx.Node, memo: dict) -> bool:
    """Whether ``node``'s representative is smaller than its value (broadcast dimensions of size 1 that
    the value expands): such a representative must not be handed to an op evaluated concretely."""
    rep = _rep(gm, node, memo)
    val = node.meta.get("val")
    return (isinstance(rep, torch.Tensor) and isinstance(val, torch.Tensor)
            and tuple(rep.shape) != tuple(val.shape))


#: Ops that mix values only along one dimension (``dim`` argument at position 1): valid on a representative
#: when that dimension has its real size there (not a broadcast), since every other slice is a copy.
_ALONG_DIM = frozenset({"cumsum", "cumprod", "diff"})


def _along_dim(gm: fx.GraphModule, node: fx.Node, memo: dict, name: str) -> torch.Tensor:
    r = _tensor_arg(gm, node.args[0], memo)
    val = node.meta["val"]
    dim_pos = 2 if name == "diff" else 1
    dim = node.args[dim_pos] if len(node.args) > dim_pos else node.kwargs.get("dim", -1)
    dim = _int_arg(dim) % val.dim()
    if not (isinstance(val.shape[dim], int) and r.shape[dim] == val.shape[dim]):
        raise _Unprovable(f"mask path applies {name} along a broadcast or symbolic dimension")
    args = _map_args(gm, node.args, memo)
    kwargs = _map_args(gm, node.kwargs, memo)
    return node.target(*args, **kwargs)


def _index(gm: fx.GraphModule, node: fx.Node, memo: dict, rank: int) -> torch.Tensor:
    """``index.Tensor(x, [i0, i1, ...])`` (leading indices, none skipped) on representatives: an index whose
    values are unknown (``_Idx``) is allowed only into a dimension where ``x`` is a broadcast, where every
    in-range index gives the same value (index 0 of the representative)."""
    r = _tensor_arg(gm, node.args[0], memo)
    indices = node.args[1]
    if not isinstance(indices, (list, tuple)) or any(i is None for i in indices) or len(indices) > r.dim():
        raise _Unprovable("mask path uses an index.Tensor form that is not understood")
    reps = []
    for d, idx in enumerate(indices):
        rep = _rep(gm, idx, memo) if isinstance(idx, fx.Node) else idx
        if isinstance(rep, _Idx):
            if r.shape[d] != 1:
                raise _Unprovable("mask path indexes a varying dimension with data-dependent indices")
            rep = torch.zeros((1,) * rep.rank, dtype=torch.long, device=r.device)
        elif not isinstance(rep, torch.Tensor) or rep.dtype not in (torch.long, torch.int):
            raise _Unprovable("mask path has a non-integer index")
        elif r.shape[d] == 1:
            rep = torch.zeros_like(rep)  # a broadcast dimension: every in-range index reads the same value
        reps.append(rep)
    out = torch.ops.aten.index.Tensor(r, reps)
    if out.dim() != rank:
        raise _Unprovable("mask path index.Tensor changed rank unexpectedly")
    return out


def _tensor_arg(gm: fx.GraphModule, arg: Any, memo: dict) -> torch.Tensor:
    r = _rep(gm, arg, memo) if isinstance(arg, fx.Node) else arg
    if isinstance(r, _Idx):
        raise r.unprovable()
    if not isinstance(r, torch.Tensor):
        raise _Unprovable("mask path has a non-tensor operand")
    return r


def _int_arg(arg: Any) -> int:
    if not isinstance(arg, int):
        raise _Unprovable("mask path has a symbolic dimension argument")
    return arg


def _map_args(gm: fx.GraphModule, args: Any, memo: dict) -> Any:
    """Replace nodes by their representatives; a symbolic size among them makes the op unprovable."""

    def one(arg: fx.Node) -> Any:
        r = _rep(gm, arg, memo)
        if r is _SYM:
            raise _Unprovable("mask path uses a symbolic size as a value")
        if isinstance(r, _Idx):
            raise r.unprovable()
        return r

    return fx.node.map_arg(args, one)


def _uniform(r: torch.Tensor, rank: int, name: str) -> torch.Tensor:
    """A rank-``rank`` all-ones-shape tensor holding the one value of ``r``; refuses a non-uniform ``r``."""
    flat = r.reshape(-1)
    if flat.numel() == 0 or not bool((flat == flat[0]).all()):
        raise _Unprovable(f"mask has distinct values before a {name} with a symbolic shape (a real mask)")
    return flat[:1].reshape((1,) * rank)


def _slice(gm: fx.GraphModule, node: fx.Node, memo: dict, rank: int) -> torch.Tensor:
    """``slice.Tensor(x, dim, start, end, step)`` on a representative."""
    r = _tensor_arg(gm, node.args[0], memo)
    dim = _int_arg(node.args[1]) if len(node.args) > 1 else 0
    if r.shape[dim] == 1:
        return r  # a slice of a broadcast dimension is still a broadcast of r (empty slices fail at SDPA)
    bounds = list(node.args[2:5])
    if any(isinstance(b, fx.Node) for b in bounds):
        return _uniform(r, rank, "slice")
    return torch.ops.aten.slice.Tensor(r, dim, *bounds)


def _evaluate(gm: fx.GraphModule, node: fx.Node, memo: dict) -> Any:
    """Run ``node`` on the concrete values of its (graph-input-free) producers."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
        if not (op_name(node) == "dropout" and len(node.args) > 2 and node.args[2] is False):
            raise _Unprovable(f"mask is random ({op_name(node)})")
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and isinstance(val.numel(), int) and val.numel() > _MAX_ELEMENTS:
        raise _Unprovable(f"mask sub-graph {node.name} is too large to evaluate ({val.numel()} elements)")
    if not (isinstance(target, torch._ops.OpOverload) or target is operator.getitem or callable(target)):
        raise _Unprovable(f"cannot evaluate {node.name}")
    args = fx.node.map_arg(node.args, lambda a: _rep(gm, a, memo))
    kwargs = fx.node.map_arg(node.kwargs, lambda a: _rep(gm, a, memo))
    try:
        with torch.no_grad():
            return target(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - anything that does not run concretely is not provable
        raise _Unprovable(f"could not evaluate {node.name}: {type(exc).__name__}") from exc


__all__ = ["simplify_attention_mask"]
