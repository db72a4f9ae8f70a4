"""Private helpers shared by the graph passes: module attributes behind ``get_attr`` nodes, fake-tensor
metadata for new nodes, and the common clean-up after a rewrite.

Passes never mutate a tensor in place: ``ExportedProgram.module()`` shares its parameters with the eager
model it was captured from, so every rewrite stores a *new* tensor under the attribute name.
"""
from __future__ import annotations

import contextlib
import contextvars
import operator
from typing import Any

import torch
from torch import fx, nn


def op_name(node: fx.Node) -> str:
    """ATen overload-packet name of a ``call_function`` node (``"linear"`` for ``aten.linear.default``)."""
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def node_arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call node, given positionally at index ``i`` or by keyword; ``default`` if absent."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def set_node_arg(node: fx.Node, i: int, name: str, value: Any) -> None:
    """Set argument ``name`` where the node gives it: positionally at index ``i``, else by keyword."""
    if len(node.args) > i:
        node.args = (*node.args[:i], value, *node.args[i + 1:])
    else:
        node.kwargs = {**node.kwargs, name: value}


def round_up(n: int, align: int) -> int:
    """Smallest multiple of ``align`` that is >= ``n``."""
    return -(-n // align) * align


def get_attr_value(gm: fx.GraphModule, target: str) -> Any:
    """The object a ``get_attr`` target (dotted path) names on ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def has_attr(gm: fx.GraphModule, target: str) -> bool:
    """Whether the dotted path ``target`` names an existing, non-None attribute of ``gm``."""
    try:
        return get_attr_value(gm, target) is not None
    except AttributeError:
        return False


def set_attr_tensor(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    """Store ``value`` under the dotted path ``target``, keeping its kind (parameter, buffer or constant).

    A parameter stays an ``nn.Parameter`` (same ``requires_grad``), a buffer stays a buffer, so
    ``state_dict`` keys are unchanged. Missing intermediate modules are created.
    """
    *path, name = target.split(".")
    owner: nn.Module = gm
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    old = getattr(owner, name, None)
    if name in owner._parameters or (old is None and name not in owner._buffers):
        requires_grad = bool(old.requires_grad) if isinstance(old, nn.Parameter) else False
        requires_grad = requires_grad and value.is_floating_point()
        owner.register_parameter(name, nn.Parameter(value.detach(), requires_grad=requires_grad))
    elif name in owner._buffers:
        owner._buffers[name] = value.detach()
    else:
        setattr(owner, name, value.detach())


def keep_outputs_contiguous(gm: fx.GraphModule) -> int:
    """Route every floating graph output through ``aten.contiguous`` (a no-op on a contiguous tensor).

    Padding passes slice results back to the original size; a slice (or an op on one) is a strided view,
    and the caller must see eager's layout (it may ``.view()`` the output). Returns how many were added.

    A channel slice of a 4-D tensor (``slice(y, 1, ...)``, what ``pad_conv_channels`` leaves) is copied by
    ``aten.clone(memory_format=torch.preserve_format)`` instead: dense in the layout its strides suggest,
    which is eager's layout for NCHW and channels-last runs alike (``contiguous`` would turn a channels-last
    output into NCHW, a transposing copy eager does not make: 0.33 ms of a 1.7 ms 4-conv chain on the H200).
    """
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    added = 0
    for leaf in list(out.all_input_nodes):
        val = leaf.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or _is_dense_copy(leaf):
            continue
        target, kwargs = _CONTIGUOUS, {}
        if leaf.target == _SLICE and val.dim() == 4 and len(leaf.args) > 1 and leaf.args[1] in (1, -3):
            target, kwargs = _CLONE, {"memory_format": torch.preserve_format}
        with gm.graph.inserting_before(out):
            dense = gm.graph.call_function(target, (leaf,), kwargs)
        dense.meta.update(leaf.meta)
        dense_val = fake_eval(target, (leaf,), kwargs)  # the dense result's own strides, not the view's
        if dense_val is not None:
            dense.meta["val"] = dense_val
        out.replace_input_with(leaf, dense)
        added += 1
    return added


def _is_dense_copy(node: fx.Node) -> bool:
    """An output copy ``keep_outputs_contiguous`` made (or would make)."""
    return node.target == _CONTIGUOUS or (
        node.target == _CLONE and node.kwargs.get("memory_format") == torch.preserve_format
    )


_SLICE = torch.ops.aten.slice.Tensor
_CLONE = torch.ops.aten.clone.default
_CONTIGUOUS = torch.ops.aten.contiguous.default


def add_constant(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    """Store a tensor a pass *creates* under the free dotted path ``target`` as a non-persistent buffer, so
    ``state_dict`` keys stay those of the user's model (it still moves with ``.to()``)."""
    *path, name = target.split(".")
    owner: nn.Module = gm
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    owner.register_buffer(name, value.detach(), persistent=False)


def alias_targets(gm: fx.GraphModule, tensor: torch.Tensor) -> list[str]:
    """Every parameter/buffer name of ``gm`` bound to exactly ``tensor`` (tied weights have several)."""
    names = [n for n, p in gm.named_parameters(remove_duplicate=False) if p is tensor]
    names += [n for n, b in gm.named_buffers(remove_duplicate=False) if b is tensor]
    return names


def unique_attr_name(gm: fx.GraphModule, target: str) -> str:
    """``target`` if it is free on ``gm``, else ``target`` with the first free ``_<i>`` suffix."""
    if not has_attr(gm, target):
        return target
    i = 1
    while has_attr(gm, f"{target}_{i}"):
        i += 1
    return f"{target}_{i}"


def rows_foldable(val: torch.Tensor) -> bool:
    """Whether ATen's ``matmul`` folds ``val``'s leading dimensions into GEMM rows without a copy.

    ``val``: the left operand of ``aten.linear`` / ``aten.matmul`` with a 2-D right operand, ``(*lead, K)``
    (a fake or real tensor). True for 1-D and 2-D inputs, and when every leading stride equals the next stride
    times the next size (the check of ``should_fold`` in ``aten/src/ATen/native/LinearAlgebra.cpp``; K's stride
    does not matter). Otherwise, when the right operand does not require grad (a frozen weight), ``matmul``
    runs a GEMM batched over the first dimension with the right operand broadcast (batch stride 0) instead of
    one ``(tokens, K)`` GEMM.

    A leading dimension of size 1 is not skipped, as ``should_fold`` does not skip it: a bias-free linear on a
    ``(seq, 1, K)`` transposed view is a batched GEMM of ``seq`` single-row GEMMs there. (``aten.linear`` with
    a bias on an input that ``is_contiguous()`` ignoring size-1 dimensions takes ``addmm`` directly; for it a
    False here costs one copy that was not needed, never a wrong result.)

    Symbolic sizes: a stride relation that the sizes cannot prove counts as not foldable (a copy, never a wrong
    view); ``matmul``'s decomposition (``torch._decomp``) decides the same way (``guard_or_false``), so a False
    here is a batched GEMM there too.
    """
    if val.dim() < 3:
        return True
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    sizes, strides = val.shape, val.stride()
    for i in range(val.dim() - 2):
        same = strides[i] == strides[i + 1] * sizes[i + 1]
        if isinstance(same, torch.SymBool):
            same = statically_known_true(same)
        if not same:
            return False
    return True


def known_equal(a: Any, b: Any) -> bool:
    """Whether sizes / strides ``a`` and ``b`` (ints or SymInts) are provably equal; False when unknown."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - an undecidable relation counts as not equal
        return False


def dense_last_dim(graph: fx.Graph, x: fx.Node) -> fx.Node | None:
    """A contiguous copy of ``x`` (``aten.clone(x, memory_format=contiguous_format)``, inserted at ``graph``'s
    insertion point, with ``meta["val"]``) when ``x``'s last dimension may not have stride 1; None when it
    provably has (or is of size 1, or ``x`` has no tensor metadata, or is 0-d).

    Why: CUDA's fused SDPA kernels (flash, memory-efficient, cuDNN) require stride 1 in the last dimension of
    q, k, v and the attention mask ("All fused kernels require the last dimension of the input to have stride
    1", ``sdp_utils``); otherwise PyTorch runs the math fallback, which computes fp16 / bf16 attention as two
    FP32 GEMMs plus a materialized softmax. The copy costs one pass over the tensor.
    """
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    if known_equal(val.stride(-1), 1) or known_equal(val.shape[-1], 1):
        return None
    clone = torch.ops.aten.clone.default
    dense = graph.call_function(clone, (x,), {"memory_format": torch.contiguous_format})
    new_val = fake_eval(clone, dense.args, dense.kwargs)
    copy_meta(x, dense, new_val if new_val is not None else val)
    return dense


def layout_note(x: fx.Node) -> str:
    """``"input <name> <shape> with strides <strides>"`` from ``x.meta["val"]`` (``?`` when it has none)."""
    val = x.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else "?"
    strides = tuple(val.stride()) if isinstance(val, torch.Tensor) else "?"
    return f"input {x.name} {shape} with strides {strides}"


def fake_value(value: Any) -> Any:
    """``meta["val"]`` of a node argument (the argument itself when it is not a node)."""
    if isinstance(value, fx.Node):
        return value.meta.get("val")
    if isinstance(value, (list, tuple)):
        return type(value)(fake_value(v) for v in value)
    return value


def fake_eval(target: Any, args: tuple, kwargs: dict | None = None) -> Any:
    """Run ``target`` on the fake values of ``args`` to get a new node's ``meta["val"]`` (None if it fails).

    The fake mode is taken from the arguments, so symbolic batch sizes stay symbolic.
    """
    fargs = fake_value(tuple(args))
    fkwargs = {k: fake_value(v) for k, v in (kwargs or {}).items()}
    flat = [v for v in torch.utils._pytree.tree_leaves((fargs, fkwargs)) if isinstance(v, torch.Tensor)]
    # The arguments' own fake mode first: inside a torch.compile backend, detect_fake_mode would return Dynamo's
    # (the active tracing context's), which cannot mix with the exported graph's fake tensors.
    mode = next((t.fake_mode for t in flat if getattr(t, "fake_mode", None) is not None), None)
    mode = mode or torch._guards.detect_fake_mode(flat)
    if mode is None:
        return None
    try:
        with mode:
            return target(*fargs, **fkwargs)
    except Exception:  # noqa: BLE001 - metadata is best-effort; the graph itself is still correct
        return None


def fake_from_tensor(like: Any, tensor: torch.Tensor) -> Any:
    """A fake tensor for ``tensor`` in the fake mode of ``like`` (a node's old ``meta["val"]``), or None."""
    mode = getattr(like, "fake_mode", None)
    if mode is None:
        return None
    try:
        return mode.from_tensor(tensor, static_shapes=True)
    except Exception:  # noqa: BLE001
        return None


def copy_meta(src: fx.Node, dst: fx.Node, val: Any = None) -> None:
    """Copy ``src.meta`` (source module stack, stack trace, ...) onto ``dst``, with ``val`` as its value."""
    for key, value in src.meta.items():
        if key in ("val", "tensor_meta") or key.startswith("tctune_"):
            continue
        dst.meta[key] = value
    if val is not None:
        dst.meta["val"] = val


#: Graph modules whose ``recompile`` :func:`finish` left to :func:`deferred_recompile`'s block (None: no block).
_DEFERRED: contextvars.ContextVar[list | None] = contextvars.ContextVar("tctune_deferred_recompile", default=None)


#: Python callables a graph may call whose unused results are still dead code: ``operator`` and ``math``
#: (``getitem``, symbolic size arithmetic) and the builtins (:func:`kept_by_dce`).
_PURE_MODULES = frozenset({"_operator", "operator", "math", "builtins"})


def kept_by_dce(node: fx.Node) -> bool:
    """Whether dead-code elimination must keep ``node`` although nothing reads it: ``Node.is_impure`` (in-place
    ATen ops, asserts, grad and autocast switches), and also every ``call_function`` of a Python callable that
    is neither a torch op (``OpOverload``, ``OpOverloadPacket``, higher-order op), nor symbolic size arithmetic
    (``torch.sym_max``, ...), nor in :data:`_PURE_MODULES`.

    The passes orphan only ATen ops, ``getitem`` and ``get_attr`` nodes. Any other call in the graph came from
    the model, and FX cannot tell a side effect there: ``torch.vmap`` in a model's forward (Hugging Face's
    Mamba and Jamba) leaves ``torch._C._functorch._vmap_increment_nesting`` / ``_vmap_decrement_nesting`` calls
    nothing reads, which ``Node.is_impure`` does not list (torch 2.13: it lists the JVP ones); removing them left
    the graph's ``_add_batch_dim`` calls without a vmap level, and every call raised "Either your tensor may
    have escaped from inside a function being vmapped"."""
    if node.is_impure():
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return False
    if getattr(target, "__name__", "").startswith(("sym_", "_sym_")):  # torch.sym_max, torch.sym_float, ...
        return False
    return getattr(target, "__module__", None) not in _PURE_MODULES


def finish(gm: fx.GraphModule) -> None:
    """Clean up after a rewrite: dead-code elimination (keeping :func:`kept_by_dce`'s calls), lint, recompile
    (callers do this only on change).

    Inside :func:`deferred_recompile` the recompile (regenerating ``gm.forward``'s Python code, the costly part on
    a large graph) waits until the block ends; passes read ``gm.graph``, never ``gm.code``.
    """
    gm.graph.eliminate_dead_code(is_impure_node=kept_by_dce)
    gm.graph.lint()
    recompile(gm)


def recompile(gm: fx.GraphModule) -> None:
    """``gm.recompile()`` now, or once when the enclosing :func:`deferred_recompile` block ends."""
    pending = _DEFERRED.get()
    if pending is None:
        gm.recompile()
    elif not any(g is gm for g in pending):
        pending.append(gm)


@contextlib.contextmanager
def deferred_recompile():
    """Within the block, :func:`finish` and :func:`recompile` mark graph modules for recompiling instead of
    recompiling each time; each one marked is recompiled once when the block exits, so several passes that
    rewrite one graph pay one code generation. A block inside another joins it: its graph modules are
    recompiled when the outermost block exits (code that runs ``gm`` itself between the two, rather than an
    ``fx.Interpreter`` over ``gm.graph``, must call ``gm.recompile()`` first).

    When the block raises, the marked modules are still recompiled, and an error from that recompile (a graph
    left half-rewritten) is dropped so that the block's own exception is the one raised."""
    if _DEFERRED.get() is not None:
        yield
        return
    pending: list = []
    token = _DEFERRED.set(pending)
    try:
        yield
    except BaseException:
        _DEFERRED.reset(token)
        for gm in pending:
            try:
                gm.recompile()
            except Exception:  # noqa: BLE001 - the block's own error is the one to report
                pass
        raise
    _DEFERRED.reset(token)
    for gm in pending:
        gm.recompile()


#: ATen ops that write some inputs without saying so in their schema: ``{op name: (arg position, ...)}``, taken
#: only when ``training`` (position 5) is True: ``batch_norm`` updates ``running_mean`` / ``running_var``.
_UNANNOTATED_WRITES = {"batch_norm": (3, 4)}
#: In-place ops whose ``Tensor(a!)`` changes autograd metadata only, never the data: ``torch.tensor(v)`` in a
#: model exports as ``lift_fresh_copy`` then ``detach_``; taking that for a write kept the constant out of the
#: casts and left an FP32 read of a cast constant that Inductor could not trace (GPT-Neo, DeBERTa-v2).
METADATA_ONLY_WRITES = frozenset({"detach_", "requires_grad_"})


def written_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of ``gm`` whose tensors some op writes in place, with every view they are a view of.

    An op writes an argument when its schema marks it ``Tensor(a!)`` (``add_``, ``copy_``, ``index_copy_``,
    ``index_put_``; the ``out=`` of an out variant); ``aten.batch_norm`` in training mode writes its running
    statistics without the mark. A written view (``buffer[:, pos] = v`` is ``slice`` then ``copy_``) writes its
    base, so the walk goes back through aliases (:func:`view_base`: view ops, elements of ``split`` / ``chunk``,
    the result of an in-place op, composites returning their input) to the placeholder or ``get_attr``. A pass
    must not replace such a node by a copy (a cast, a padded or folded weight): the write would land in the
    copy and be lost.

    Writes that reach a tensor from outside the graph count: the base is a placeholder (an input, a KV cache)
    or a ``get_attr`` (a buffer). So do writes *through a view* into a tensor the graph made itself
    (``out = zeros_like(k); out[:, t] = v`` in a loop, as Hugging Face's RWKV does on the CPU): the graph reads
    ``out`` itself afterwards, not the write's result, so a copy of ``out`` (or of the view) would take the write
    and every later read would see zeros (RWKV's bf16 logits were off by 1.3 of their scale). A write straight
    into a tensor the graph made (``nn.ReLU(inplace=True)`` on a convolution's output, ``masked_fill_`` on
    scores) is not counted: later reads go through the in-place op's result, and casting it is as safe as
    casting its out-of-place form (taking those for writes kept every torchvision / timm network with in-place
    activations in FP32: ResNet-50 at 0.15x Inductor on the H200).

    Returns:
        The written nodes and the views between them and their base, the base included.
    """
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        for arg in writes_in_place(node):
            chain: list[fx.Node] = []
            while isinstance(arg, fx.Node) and arg not in out and arg not in chain:
                chain.append(arg)
                arg = view_base(arg)
            base = arg if isinstance(arg, fx.Node) and arg in out else (chain[-1] if chain else None)
            # a view on the way (not only results of in-place ops, which are the tensor they wrote)
            views = chain[:-1] if chain and base is chain[-1] else chain
            through_view = any(not writes_in_place(n) for n in views)
            if base is not None and (base in out or base.op in ("placeholder", "get_attr") or through_view):
                out.update(chain)
    return out


def writes_outside(node: fx.Node, written: set[fx.Node]) -> bool:
    """Whether ``node`` writes in place a tensor of ``written`` (:func:`written_nodes` of its graph): a tensor
    from outside the graph, or a view of one."""
    return any(arg in written for arg in writes_in_place(node))


def writes_in_place(node: fx.Node) -> list[fx.Node]:
    """The arguments the ATen op ``node`` writes in place (:func:`written_nodes`); ``[]`` for other nodes."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return []
    if op_name(node) in METADATA_ONLY_WRITES:
        return []
    out: list[fx.Node] = []
    schema = node.target._schema
    if schema.is_mutable:
        for i, formal in enumerate(schema.arguments):
            info = formal.alias_info
            if info is not None and info.is_write:
                arg = node.args[i] if i < len(node.args) else node.kwargs.get(formal.name)
                if isinstance(arg, fx.Node):
                    out.append(arg)
    positions = _UNANNOTATED_WRITES.get(op_name(node))
    if positions and node_arg(node, 5, "training", False) is True:
        out.extend(node.args[i] for i in positions if i < len(node.args) and isinstance(node.args[i], fx.Node))
    return out


def view_base(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` is an alias of (a view of it, or that tensor itself), or None when it is a new tensor.

    By the op's schema: the argument whose alias set the result shares (``slice``, ``t``, ``view``: the first
    argument; ``add_``: ``self``, the result of an in-place op being the tensor it wrote; ``add.out``: ``out``).
    An element of a returned list of views (``operator.getitem`` of ``split``, ``chunk``, ``unbind``) is an
    alias of that list, itself an alias of the op's input; an element of a returned tuple, of the argument its
    return aliases (``max.dim_max``'s ``values``). An op whose schema says nothing (``atleast_3d``,
    ``type_as``: composites that return their input itself where nothing changes) is an alias of an input whose
    example value (``meta["val"]``) shares its storage. Writing through any of these writes the base
    (:func:`written_nodes`)."""
    if node.op != "call_function" or not node.args:
        return None
    index = 0
    op = node
    if node.target is operator.getitem:
        op, index = node.args[0], node.args[1]
        if not isinstance(op, fx.Node) or not isinstance(index, int) or op.op != "call_function":
            return None
    if not isinstance(op.target, torch._ops.OpOverload):
        return None
    schema = op.target._schema
    ret = None
    if len(schema.returns) == 1:
        ret = schema.returns[0].alias_info  # a tensor, or a list of views (split: ``Tensor(a)[]``)
    elif op is node or index < len(schema.returns):
        ret = schema.returns[0 if op is node else index].alias_info
    if ret is not None:
        # A list of views (``Tensor(a)[]``) shows no alias set here (its elements' is not exposed): it aliases
        # the argument that turns into the wildcard set (``split(Tensor(a -> *) self)``).
        want = set(ret.before_set)
        for i, formal in enumerate(schema.arguments):
            info = formal.alias_info
            if info is not None and (want & set(info.before_set) or (not want and "*" in info.after_set)):
                base = op.args[i] if i < len(op.args) else op.kwargs.get(formal.name)
                if not isinstance(base, fx.Node):
                    return None
                return op if op is not node and len(schema.returns) == 1 else base  # the list, then its input
        return None
    if op is not node:
        return None
    storage = storage_of(node)
    if storage is None:
        return None
    return next((a for a in node.all_input_nodes if (s := storage_of(a)) is not None and s == storage), None)


def storage_of(node: fx.Node, key: str = "val") -> Any:
    """A weak reference to the storage of ``node``'s example value (``meta[key]``: export's ``"val"``, Dynamo's
    ``"example_value"``; a fake tensor sharing the storage of what it is a view of), or None when it has no
    tensor value. Two nodes whose values share a storage alias each other."""
    from torch.multiprocessing.reductions import StorageWeakRef

    val = node.meta.get(key)
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except Exception:  # noqa: BLE001 - a tensor subclass without a storage: no aliasing known
        return None


def checkpoint_body(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The body of ``node`` when it is an activation-checkpointed region (``torch.utils.checkpoint`` as the
    ``tag_activation_checkpoint`` higher-order op, its body a ``get_attr`` graph module), in an ATen graph or in
    Dynamo's; else None."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    if hop is None or node.op != "call_function" or node.target is not hop or not node.args:
        return None
    body = node.args[0]
    if not isinstance(body, fx.Node) or body.op != "get_attr":
        return None
    module = get_attr_value(gm, str(body.target))
    return module if isinstance(module, fx.GraphModule) else None
