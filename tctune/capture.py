"""Capture a model as an ATen-level FX graph with ``torch.export``, a dynamic batch dimension and the model's
own dynamic dimensions.

``torch.export.export(..., strict=False)`` keeps ops such as ``aten.linear``, ``aten.conv2d``,
``aten.layer_norm`` and ``aten.scaled_dot_product_attention`` whole, with weights as ``get_attr`` nodes
in ``ExportedProgram.module()``: the graph the passes in ``passes/`` rewrite.

Shapes. Dim 0 of every *batched* input is one shared ``torch.export.Dim("batch")``; inputs that are not batched
(a broadcast mask ``(1, 1, S, S)``, a weight-like ``(7, 2)`` tensor, a 0-d tensor) keep dim 0 as it is. Other
dimensions are dynamic where the model file declares them in ``torch.export``'s own ``dynamic_shapes`` format
(``{1: torch.export.Dim("seq", min=8, max=512)}`` per input, or a dict by forward argument name); every other
dimension is specialized to the example's size. The captured graph records, in ``gm.meta``, which inputs are
batched (:func:`batched_inputs`) and every dynamic dimension with its range (:func:`dynamic_dims`).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import io
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .errors import CaptureError, clip

log = logging.getLogger("tctune")

#: Largest batch the captured graph accepts (torch.export needs a bound for the symbolic batch).
MAX_BATCH = 1 << 16


@dataclass
class Captured:
    """The outcome of capture: a graph module, or the reason there is none."""

    graph_module: torch.fx.GraphModule | None
    reason: str | None = None
    #: Set when the graph's FP32 outputs differ from the model's run eagerly on the same inputs (one sentence:
    #: which output, by how much; ``tctune.search.loop.capture_mismatch``); None when they agree or unchecked.
    eager_mismatch: str | None = None

    @property
    def ok(self) -> bool:
        return self.graph_module is not None

    def info(self) -> dict:
        """``report.json``'s ``capture`` entry: ``ok``, ``reason`` and ``dynamic`` (:func:`dynamic_dims`: which
        input dimensions the graph accepts at any size in a range, the batch included; ``[]`` without a graph),
        plus ``eager_mismatch`` when the graph's FP32 outputs differ from the model's (see that attribute)."""
        dynamic = dynamic_dims(self.graph_module) if self.graph_module is not None else []
        info = {"ok": self.ok, "reason": self.reason, "dynamic": dynamic}
        if self.eager_mismatch:
            info["eager_mismatch"] = self.eager_mismatch
        return info


def capture(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], dynamic_shapes: Any = None,
            batched: Sequence[bool] | None = None) -> torch.fx.GraphModule:
    """Export ``model`` on ``inputs`` with dim 0 of every batched input a shared dynamic batch, plus the
    dimensions ``dynamic_shapes`` declares.

    Args:
        model: the module in the mode it will be measured in (``eval()`` for inference).
        inputs: example inputs; each batched one of shape ``(batch, ...)`` with batch ≥ 2 so it is not
            specialized.
        dynamic_shapes: the model's own dynamic dimensions in ``torch.export.export``'s format (a tuple/list
            with one entry per input, or a dict keyed by ``forward``'s argument names; each entry None, a dict
            ``{dim: torch.export.Dim}`` or a list with one Dim/None per dimension). An entry on dim 0 of a
            batched input is replaced by tctune's batch. None: only the batch is dynamic.
        batched: one bool per input, True where dim 0 is the batch (``ModelFile.batched_mask()``); None: every
            input with at least one dimension is batched.

    Returns:
        ``ExportedProgram.module()``: an FX GraphModule that takes the same inputs and returns the same
        output structure as ``model``; its parameters are a deep copy (passes may rewrite them).

    Raises:
        CaptureError: torch.export failed; the message gives its first line and the fix (run eagerly).
        ValueError: ``dynamic_shapes`` is malformed (wrong length, unknown argument name, a dim out of range).
    """
    inputs = tuple(inputs)
    batched = _batched_or_default(inputs, batched)
    user = normalize_dynamic_shapes(dynamic_shapes, inputs, _forward_names(model), forward_varargs(model))
    model = copy.deepcopy(model)
    named = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    _export = functools.partial(_export_with, batched=batched, user=user)
    try:
        ep = _export(model, inputs, named)
    except Exception as exc:
        message = str(exc)
        if "Constraints violated" not in message:
            raise _capture_error(exc) from exc
        # The model (or an op's meta function, e.g. a 32-bit-indexing check on a large image batch) bounds the
        # batch below MAX_BATCH. Dim.DYNAMIC lets export narrow the range instead of failing; a batch it pins
        # to one value is still an error.
        try:
            ep = _export(model, inputs, torch.export.Dim.DYNAMIC)
        except Exception:
            raise _capture_error(exc) from exc  # the named-batch error reads better ("(batch)")
        lo, hi = _batch_range(ep, batched)
        if lo is None or not _only_bounds(ep):
            raise _capture_error(exc) from exc
        if lo > 1:  # Dim.DYNAMIC starts at 2; a named Dim with the narrowed max keeps batch 1 (best effort)
            try:
                ep = _export(model, inputs, torch.export.Dim("batch", min=1, max=hi))
                lo = 1
            except Exception:  # noqa: BLE001 - keep the Dim.DYNAMIC program
                pass
        log.info("torch.export bounded the dynamic batch: tctune's graph accepts batch %s..%s", lo, hi)
    else:
        lo, hi = _batch_range(ep, batched)
    gm = ep.module()
    gm.meta["tctune_batch_range"] = (lo if lo is not None else 1, hi if hi is not None else MAX_BATCH)
    gm.meta["tctune_batched"] = tuple(batched)
    gm.meta["tctune_dynamic"] = _describe_dynamic(ep, inputs, batched, _forward_names(model), user)
    return gm


def batched_inputs(gm: torch.fx.GraphModule) -> tuple[bool, ...] | None:
    """One bool per input of a graph from :func:`capture`: True where dim 0 is the batch (None: not recorded)."""
    b = gm.meta.get("tctune_batched")
    return None if b is None else tuple(b)


def dynamic_dims(gm: torch.fx.GraphModule) -> list[dict]:
    """Every dynamic dimension of a graph from :func:`capture`, batch included, as report entries.

    Returns:
        One dict per dynamic input dimension: ``input`` (index), ``name`` (the forward argument's name, or
        ``"input<i>"``), ``dim``, ``symbol`` (the Dim's name: ``"batch"``, ``"seq"``; dimensions sharing a
        symbol always have the same size), ``min`` and ``max`` (sizes, inclusive, from torch.export's range
        constraints; ``max`` is None when unbounded) and ``example`` (the size the capture example had).
    """
    return [dict(d) for d in gm.meta.get("tctune_dynamic", [])]


def export_dynamic_shapes(gm: torch.fx.GraphModule) -> tuple[dict[int, Any] | None, ...] | None:
    """``dynamic_shapes`` (one entry per input) for re-exporting a graph from :func:`capture` (ONNX, AOTI):
    fresh ``torch.export.Dim`` objects with the captured names and ranges, one per symbol; None when the graph
    does not record its shapes (then callers fall back to a batch on dim 0 of every input)."""
    if "tctune_dynamic" not in gm.meta or "tctune_batched" not in gm.meta:
        return None
    dims: dict[str, Any] = {}
    specs: list[dict[int, Any] | None] = [None] * len(gm.meta["tctune_batched"])
    for d in gm.meta["tctune_dynamic"]:
        sym = d["symbol"]
        if sym not in dims:
            kwargs = {"min": int(d["min"])}
            if d["max"] is not None:
                kwargs["max"] = int(d["max"])
            dims[sym] = torch.export.Dim(_identifier(sym), **kwargs)
        spec = specs[d["input"]] or {}
        spec[d["dim"]] = dims[sym]
        specs[d["input"]] = spec
    return tuple(specs)


def resize_inputs(inputs: Sequence[torch.Tensor], dynamic: Sequence[dict], sizes: dict[str, int]) -> tuple:
    """``inputs`` with the dynamic dimensions of symbol ``s`` set to ``sizes[s]``, for validating a graph at a
    size the model file's ``example_inputs`` does not produce.

    A dimension is cut to the first ``n`` entries when it shrinks (token ids stay token ids, a causal mask
    ``[:n, :n]`` stays causal) and tiled by repetition when it grows. The batch is not touched (``example_
    inputs(batch)`` makes it).

    Args:
        inputs: one example tuple (as ``example_inputs`` returns it).
        dynamic: :func:`dynamic_dims` of the graph.
        sizes: symbol -> new size (≥ 1).

    Raises:
        ValueError: a size below 1.
    """
    out = list(inputs)
    for d in dynamic:
        n = sizes.get(d["symbol"])
        if n is None or d["symbol"] == "batch":
            continue
        if n < 1:
            raise ValueError(f"size of {d['symbol']} must be >= 1, got {n}")
        t = out[d["input"]]
        have = t.shape[d["dim"]]
        if have < n:
            reps = [1] * t.dim()
            reps[d["dim"]] = -(-n // have)
            t = t.repeat(*reps)
        out[d["input"]] = t.narrow(d["dim"], 0, n).contiguous()
    return tuple(out)


def validation_sizes(dynamic: Sequence[dict]) -> dict[str, int]:
    """For each non-batch symbol, a second size to validate at besides the example's: half the example size
    (at least the Dim's min), or one more when the example is already at the min (bounded by the max).
    Symbols whose range holds a single size are left out."""
    out: dict[str, int] = {}
    for d in dynamic:
        sym = d["symbol"]
        if sym == "batch" or sym in out:
            continue
        ex, lo, hi = int(d["example"]), int(d["min"]), d["max"]
        other = max(lo, ex // 2)
        if other == ex:
            other = ex + 1
        if hi is not None and other > int(hi):
            continue
        out[sym] = other
    return out


def normalize_dynamic_shapes(spec: Any, inputs: Sequence[torch.Tensor],
                             arg_names: Sequence[str] | None = None,
                             varargs: str | None = None) -> list[dict[int, Any]]:
    """A model file's ``dynamic_shapes`` (``torch.export`` format) as one ``{dim: Dim}`` dict per input.

    Args:
        spec: None, a tuple/list with one entry per input, or a dict keyed by ``forward``'s argument names
            (the inputs a ``*args`` parameter takes: its name mapped to a tuple/list, one entry per such input,
            as ``torch.export`` reads it: ``{"args": ({}, {1: seq})}``).
            Each entry: None, ``{dim: Dim}`` (negative dims count from the end) or a list/tuple of Dim/None
            per dimension. ``Dim.AUTO`` / ``Dim.DYNAMIC`` are accepted; ``Dim.STATIC`` and None are dropped.
        inputs: the example inputs (for their ranks).
        arg_names: ``forward``'s positional argument names, needed for a dict ``spec``.
        varargs: the name of ``forward``'s ``*args`` parameter, or None.

    Raises:
        ValueError: wrong number of entries, an unknown name, a dim out of range, or an entry that is not a
            dict/list/None; the message names the input and the fix.
    """
    n = len(inputs)
    out: list[dict[int, Any]] = [{} for _ in range(n)]
    if spec is None:
        return out
    if isinstance(spec, dict):
        names = list(arg_names or [])
        through_varargs = max(0, n - len(names)) if varargs else 0  # inputs forward's *args takes
        unknown = [k for k in spec if k not in names[:n] and not (through_varargs and k == varargs)]
        if unknown:
            takes = (f"forward's first {len(names[:n])} argument(s) {names[:n]}" if names[:n] else
                     f"forward's named arguments (it has none before *{varargs})" if varargs else
                     "forward's named arguments (its signature names none)")
            fix = ("key dynamic_shapes by forward's argument names, or give a tuple with one entry per input"
                   if not through_varargs else
                   f"the {through_varargs} input(s) forward's *{varargs} takes go under {varargs!r}, one entry each: "
                   f"{{{varargs!r}: {_empty_specs(through_varargs)}}} (or give a tuple with one entry per "
                   "input)")
            raise ValueError(f"dynamic_shapes names {unknown}, which are not among {takes}\n  fix: {fix}")
        entries = [spec.get(name) for name in names[:n]]
        if through_varargs:
            rest = spec.get(varargs)
            if rest is None:
                rest = [None] * through_varargs
            if not isinstance(rest, (tuple, list)) or len(rest) != through_varargs:
                raise ValueError(f"dynamic_shapes[{varargs!r}] must be a tuple/list with one entry for each of the "
                                 f"{through_varargs} input(s) forward's *{varargs} takes, got {rest!r}\n  fix: "
                                 f"{{{varargs!r}: {_empty_specs(through_varargs)}}}, a dict {{dim: Dim}} "
                                 "(or None) per input")
            entries += list(rest)
    elif isinstance(spec, (tuple, list)):
        if len(spec) != n:
            raise ValueError(f"dynamic_shapes has {len(spec)} entries for {n} input(s)\n  fix: one entry per input "
                             "returned by example_inputs (None for an input with no dynamic dimension)")
        entries = list(spec)
    else:
        raise ValueError(f"dynamic_shapes must be a tuple/list (one entry per input) or a dict by argument name, "
                         f"got {type(spec).__name__}")
    static = getattr(torch.export.Dim, "STATIC", None)
    for i, (entry, t) in enumerate(zip(entries, inputs)):
        if entry is None:
            continue
        if isinstance(entry, dict):
            items = list(entry.items())
        elif isinstance(entry, (tuple, list)):
            items = list(enumerate(entry))
        else:
            raise ValueError(f"dynamic_shapes entry of input {i} must be None, a dict {{dim: Dim}} or a list, got "
                             f"{type(entry).__name__}")
        for dim, dimspec in items:
            if dimspec is None or (static is not None and dimspec is static):
                continue
            if not isinstance(dim, int) or not -t.dim() <= dim < t.dim():
                raise ValueError(f"dynamic_shapes marks dim {dim!r} of input {i}, which has shape {tuple(t.shape)}\n"
                                 f"  fix: use a dimension index below {t.dim()}")
            out[i][dim % t.dim()] = dimspec
    return out


def _batched_or_default(inputs: Sequence[torch.Tensor], batched: Sequence[bool] | None) -> tuple[bool, ...]:
    if batched is None:
        return tuple(isinstance(t, torch.Tensor) and t.dim() > 0 for t in inputs)
    batched = tuple(bool(b) for b in batched)
    if len(batched) != len(inputs):
        raise ValueError(f"batched has {len(batched)} entries for {len(inputs)} input(s)")
    return batched


def _forward_names(model: torch.nn.Module) -> list[str]:
    """``model.forward``'s positional parameter names, in order (``[]`` when it takes only ``*args``)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _empty_specs(n: int) -> str:
    """A tuple literal of ``n`` empty specs, as Python reads it: ``({},)`` for one, ``({}, {})`` for two."""
    return "(" + ", ".join(["{}"] * n) + ("," if n == 1 else "") + ")"


def forward_varargs(model: torch.nn.Module) -> str | None:
    """The name of ``model.forward``'s ``*args`` parameter, or None (none, or no readable signature)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    return next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)


def _identifier(name: str) -> str:
    """A Dim name must be a Python identifier."""
    out = re.sub(r"\W", "_", name)
    return out if out and not out[0].isdigit() else f"d_{out}"


def _dim_name(dimspec: Any, fallback: str) -> str:
    name = getattr(dimspec, "__name__", None)
    return name if isinstance(name, str) and name.isidentifier() and name not in ("AUTO", "DYNAMIC") else fallback


def _describe_dynamic(ep, inputs: Sequence[torch.Tensor], batched: Sequence[bool],
                      arg_names: Sequence[str], user: Sequence[dict[int, Any]]) -> list[dict]:
    """The dynamic dimensions of ``ep``'s user inputs with their symbols and ranges (:func:`dynamic_dims`)."""
    user_names = _user_input_names(ep)
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in user_names]
    out: list[dict] = []
    symbols: dict[Any, str] = {}
    for i, (node, example) in enumerate(zip(placeholders, inputs)):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            if expr not in symbols:
                if d == 0 and batched[i]:
                    symbols[expr] = "batch"
                else:
                    symbols[expr] = _dim_name(user[i].get(d), str(expr))
            vr = ep.range_constraints.get(expr)
            lo = _as_int(vr.lower, 1) if vr is not None else 1
            hi = _as_int(vr.upper, -1) if vr is not None else -1
            out.append({"input": i, "name": arg_names[i] if i < len(arg_names) else f"input{i}", "dim": d,
                        "symbol": symbols[expr], "min": lo, "max": None if hi < 0 else hi,
                        "example": int(example.shape[d])})
    return out


def batch_range(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """``(min, max)`` batch a graph from :func:`capture` accepts (export may narrow it below ``MAX_BATCH``)."""
    return tuple(gm.meta.get("tctune_batch_range", (1, MAX_BATCH)))  # type: ignore[return-value]


def _export_with(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], batch: Any, *, batched: Sequence[bool],
                 user: Sequence[dict[int, Any]]):
    dynamic = []
    for is_batched, dims in zip(batched, user):
        spec = {d: s for d, s in dims.items() if not (is_batched and d == 0)}
        if is_batched:
            spec[0] = batch
        dynamic.append(dict(sorted(spec.items())) or None)
    dynamic = _group_varargs(model, tuple(dynamic))
    printed = io.StringIO()
    try:
        # torch.export prints graph dumps and logs shape warnings when it fails: keep the user's terminal clean.
        with warnings.catch_warnings(), _quiet_torch_logs(), contextlib.redirect_stdout(printed), \
                contextlib.redirect_stderr(printed):
            warnings.simplefilter("ignore")
            return torch.export.export(model, tuple(inputs), dynamic_shapes=dynamic, strict=False)
    except Exception as exc:
        exc._tctune_printed = printed.getvalue()  # type: ignore[attr-defined]
        raise


def _group_varargs(model: torch.nn.Module, dynamic: tuple) -> tuple:
    """``dynamic`` (one entry per positional input) shaped like ``model.forward``'s signature, as
    ``torch.export`` reads it: the entries of the inputs a ``*args`` parameter takes become one tuple at that
    parameter's place (``forward(self, *args)``: ``((spec0, spec1, ...),)``; export refuses a flat tuple
    there, "inputs[0] is a tuple, but dynamic_shapes[0] is a dict")."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # no introspectable signature: leave export to judge
        return dynamic
    for k, param in enumerate(params):
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            # No input reaches *args (forward(x, *rest) called with x alone): export takes the flat tuple.
            return dynamic[:k] + (tuple(dynamic[k:]),) if k < len(dynamic) else dynamic
        if param.kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            break
    return dynamic


def _capture_error(exc: BaseException) -> CaptureError:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return CaptureError(
        f"torch.export could not capture the model with a dynamic batch{_and_dims(text)}: {type(exc).__name__}: "
        f"{clip(first)}"
        + _hint(text, getattr(exc, "_tctune_printed", ""))
    )


def _and_dims(message: str) -> str:
    violated = re.search(r"Constraints violated \(([^)]*)\)", message)
    others = [n.strip() for n in violated.group(1).split(",") if n.strip() != "batch"] if violated else []
    return f" and dynamic {', '.join(others)}" if others else ""


def _batch_range(ep, batched: Sequence[bool] | None = None) -> tuple[int | None, int | None]:
    """The range of the first batched input's dim 0 in an ExportedProgram; ``(None, None)`` when it is a
    constant (or no input is batched)."""
    user_inputs = _user_input_names(ep)
    index = -1
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in user_inputs:
            continue
        index += 1
        if batched is not None and (index >= len(batched) or not batched[index]):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue
        size = val.shape[0]
        if not isinstance(size, torch.SymInt):
            return None, None
        vr = ep.range_constraints.get(size.node.expr)
        if vr is None:
            return 1, MAX_BATCH
        return _as_int(vr.lower, 1), min(_as_int(vr.upper, MAX_BATCH), MAX_BATCH)
    return None, None


def _only_bounds(ep) -> bool:
    """Whether the exported program's input guards are bounds only (``size <= 1000``, ``size < 32``), which
    :func:`batch_range` describes. A guard like ``size != 32`` (a model branching on one batch size) is a hole
    in the range that the tuner could not see: such a model is not captured."""
    guards = getattr(ep, "_guards_code", None) or []  # torch >= 2.9; absent: the range is all there is
    return all(("!=" not in g and "==" not in g) for g in guards)


def _as_int(bound: Any, default: int) -> int:
    try:
        return int(bound)
    except Exception:  # noqa: BLE001 - sympy's oo / int_oo raise TypeError, OverflowError or AttributeError
        return default


def _user_input_names(ep) -> set[str]:
    from torch.export.graph_signature import InputKind

    return {spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT}


_WHERE = re.compile(r"# File: (\S+?:\d+) in \w+, code: (.*)")


def _hint(message: str, printed: str) -> str:
    """Plain words and a fix for the usual reasons torch.export fails, with the user's line where known."""
    where = _WHERE.search(printed) or _WHERE.search(message)
    at = f" at {where.group(1)} (`{where.group(2).strip()}`)" if where else ""
    violated = re.search(r"Constraints violated \(([^)]*)\)", message)
    names = [n.strip() for n in violated.group(1).split(",")] if violated else []
    if any(n != "batch" for n in names):
        fixes = message.split("Suggested fixes:", 1)[1].strip().splitlines() if "Suggested fixes:" in message else []
        fixes = [f.strip() for f in fixes if re.match(r"\s*\w+ = ", f)]
        return (f"\n  cause: the model fixes or bounds the dimension(s) {', '.join(n for n in names if n != 'batch')} "
                f"declared dynamic in dynamic_shapes{at}\n  fix: "
                + (f"torch.export suggests {'; '.join(fixes)} (a constant: leave the dimension out of "
                   "dynamic_shapes; a bound: set the Dim's min/max)" if fixes else
                   "narrow the Dim's min/max to the sizes the model accepts, or leave the dimension out of "
                   "dynamic_shapes"))
    unknown = re.search(r"Found <class '([\w.]+)'> in output, which is not a known type", message)
    if unknown:
        qualname = unknown.group(1)
        name = qualname.rsplit(".", 1)[-1]
        cache = qualname.startswith("transformers.") and "Cache" in name
        return (f"\n  cause: the model's output holds a `{qualname}`, a type torch.export cannot return (not a "
                "registered pytree type)"
                + (" -- a Hugging Face KV cache, returned because the model's config has use_cache=True" if cache
                   else "")
                + "\n  fix: " + ("build the model with use_cache=False (`model.config.use_cache = False` in "
                                 "build_model, or call `model(..., use_cache=False)` in a wrapper's forward that "
                                 "returns the tensors you need, e.g. `.logits`)" if cache else
                                 f"return tensors (or tuples / lists / dicts of them) from forward instead of a "
                                 f"{name}, or register {name} with torch.utils._pytree.register_pytree_node")
                + " (tctune runs the model eagerly meanwhile)")
    if "data-dependent" in message or "DataDependent" in message:
        return (f"\n  cause: Python control flow on tensor *values*{at}\n"
                "  fix: use torch.where / torch.cond instead of `if` on a tensor (tctune runs the model eagerly meanwhile)")
    if "Constraints violated" in message and "batch" in message:
        return (f"\n  cause: the model fixes the batch size{at} (a branch on x.shape[0], or a hard-coded batch in "
                "view/reshape/expand)\n  fix: use x.shape[0] or -1 (tctune runs the model eagerly meanwhile)")
    return ""


@contextlib.contextmanager
def _quiet_torch_logs():
    # torch logs a failing fake-tensor op at ERROR level with its traceback, through a handler bound to the
    # terminal's stderr (not redirectable): tctune reports the failure itself, in one message.
    names = ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._dynamo", "torch._export",
             "torch._subclasses.fake_tensor")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def try_capture(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], dynamic_shapes: Any = None,
                batched: Sequence[bool] | None = None) -> Captured:
    """Like :func:`capture` but returns the reason instead of raising (the tuner then runs eagerly).

    Raises:
        ValueError: ``dynamic_shapes`` is malformed (a user error, not a capture failure).
    """
    try:
        return Captured(capture(model, inputs, dynamic_shapes, batched))
    except CaptureError as exc:
        log.debug("%s; tctune will run the model eagerly without graph passes", exc)
        return Captured(None, str(exc))
