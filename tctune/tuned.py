"""The tuned model as a Python object: :class:`TunedModule`, and :func:`save` / :func:`load` of it in one file.

A :class:`TunedModule` runs the winning configuration of a search: the graph the winning trial measured (tctune's
rewritten graph, built by :func:`tctune.trial.build_trial_graph`, the model as written under
``torch.autocast``, or the model cast as a whole, ``model.half()`` / ``model.to(torch.bfloat16)``, when that
plain baseline won), at its precision (``tctune.measure.precision_mode``), memory format and runtime (eager,
Inductor, or a CUDA graph replayed per input shape, :func:`tctune.runtime.wrap`). Its outputs have the FP32
reference's structure; their dtypes follow the search's output contract (``TuneConfig.output_dtype``, recorded
as the manifest's ``output_dtype``): ``"compute"`` (the default), floating outputs in the dtype the winner
computed them in (bf16 logits from a bf16 winner, as the search timed them); ``"fp32"``, the FP32 reference's
dtypes.

:func:`save` writes one ``torch.export`` archive (``.pt2``): the rewritten graph re-exported with a dynamic batch
(the weights in their tuned dtypes), plus ``tctune_manifest.json`` (runtime, trial, output structure, inputs,
compute capability, torch version) and ``tctune_report.json`` in the archive's extra files. :func:`load` needs
neither the model's Python code nor AOTInductor: ``torch.export.load``, then the runtime is re-applied (Inductor
compiles on the first call; its cache makes a second load's compile fast).
"""
from __future__ import annotations

import copy
import json
import logging
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from .errors import ExportError, UsageError, clip
from .measure import precision_mode
from .runtime import CUDA_GRAPH_RUNTIMES, INDUCTOR_RUNTIMES, ChannelsLast, CudaGraphed, inductor_mode, without_cuda_graph

log = logging.getLogger("tctune")

#: Name of the manifest inside a saved archive (``torch.export.save``'s ``extra_files``).
MANIFEST = "tctune_manifest.json"
#: Name of the search's ``report.json`` inside a saved archive.
REPORT = "tctune_report.json"
#: Version of the manifest's layout (a loader refuses a newer one).
FORMAT_VERSION = 1

_AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


def state_layout(model: torch.nn.Module) -> dict:
    """How ``model`` holds its state, by fully qualified name: ``non_persistent`` (buffers left out of
    ``state_dict``) and ``tied`` (groups of names of one parameter or buffer object, e.g. tied embeddings)."""
    non_persistent = sorted(f"{prefix}.{b}" if prefix else b for prefix, mod in model.named_modules()
                            for b in getattr(mod, "_non_persistent_buffers_set", ()))
    groups: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    return {"non_persistent": non_persistent, "tied": [g for g in groups.values() if len(g) > 1]}


def restore_layout(module: torch.nn.Module, layout: dict) -> None:
    """Give ``module`` (a captured or re-loaded graph with the original names) ``layout``'s state layout
    (:func:`state_layout`): those buffers non-persistent again, and each tied group one object again where the
    graph still holds every name with equal values (a pass that padded one use leaves that group untied)."""
    for fqn in layout.get("non_persistent", ()):
        owner, _, leaf = _owner(module, fqn)
        if owner is not None and leaf in owner._buffers:
            owner._non_persistent_buffers_set.add(leaf)
    for group in layout.get("tied", ()):
        found = [(fqn, *_owner(module, fqn)) for fqn in group]
        found = [(fqn, o, kind, leaf) for fqn, o, kind, leaf in found if o is not None]
        if len(found) < 2:
            continue
        _, o0, kind0, leaf0 = found[0]
        first = getattr(o0, leaf0)
        for _, o, kind, leaf in found[1:]:
            t = getattr(o, leaf)
            if t is first or kind != kind0:
                continue
            if t.shape == first.shape and t.dtype == first.dtype and t.device == first.device and torch.equal(t, first):
                (o._parameters if kind == "parameter" else o._buffers)[leaf] = first


def _owner(module: torch.nn.Module, fqn: str) -> tuple[torch.nn.Module | None, str, str]:
    prefix, _, leaf = fqn.rpartition(".")
    try:
        owner = module.get_submodule(prefix) if prefix else module
    except AttributeError:
        return None, "", leaf
    if leaf in owner._parameters:
        return owner, "parameter", leaf
    if leaf in owner._buffers:
        return owner, "buffer", leaf
    return None, "", leaf


def _spec_dumps(spec: pytree.TreeSpec | None) -> str | None:
    if spec is None:
        return None
    try:
        return pytree.treespec_dumps(spec)
    except Exception:  # noqa: BLE001 - a container type without a serialized name (an unregistered class)
        return None


def _plain(obj: Any) -> Any:
    """``obj`` with mappings as dicts and sequences as tuples/lists (leaves as they are): a structure any process
    can rebuild, for outputs whose own container class cannot be serialized (``ModelOutput``-like objects)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    return obj


def _spec_loads(text: str | None) -> pytree.TreeSpec | None:
    if not text:
        return None
    try:
        return pytree.treespec_loads(text)
    except Exception:  # noqa: BLE001 - the container class is not importable here: try the plain spec
        return None


def _current_capability(device: torch.device) -> str | None:
    """The compute capability (``"9.0"``) of ``device``, None for the CPU. A seam: tests replace it."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


class TunedModule(torch.nn.Module):
    """A tuned model: the winning configuration of a search, callable like the original model.

    ``tuned(*inputs)`` takes the original model's positional inputs (batch on dim 0; any batch the captured
    graph accepts), and also by the names of ``forward``'s arguments (``tuned(input_ids=ids,
    attention_mask=mask)``, as the original model is called) where those names are known (``input_names``);
    exactly the tuned inputs: an input missing or named twice, or a keyword that is not one of them (an optional
    ``forward`` argument the search did not pass), is a ``TypeError`` naming the accepted inputs. A mapping of
    them (a tokenizer's ``BatchEncoding``) goes in as ``tuned(**inputs)``; a mapping passed as one positional
    input is a ``TypeError`` saying so. It returns its output structure (dict, tuple, ``ModelOutput``-like
    object). Output dtypes:
    with ``keep_low_precision_outputs`` (the ``"compute"`` output contract, what :func:`from_search` sets
    under ``TuneConfig.output_dtype="compute"``, the default) floating outputs come back in the dtype the
    winning graph computed them in (e.g. bf16, or FP32 where the cast policy kept the producing op FP32);
    without it (``"fp32"``) a floating output the FP32 reference returned in FP32 comes back FP32. Integer and
    bool outputs keep their dtype either way. Runs under ``torch.inference_mode()``.

    Attributes:
        graph: the module that holds the state (tctune's rewritten graph, or the model as written);
            ``state_dict()`` / ``load_state_dict()`` are its own, with the original model's key names
            (non-persistent buffers stay out of it; tied parameters stay one object).
        report: the search's ``report.json`` dictionary (``{}`` when unknown).
        out_dir: the folder the search wrote its files to (``tctune.optimize`` sets it), or None (e.g. loaded).
        config: the winning :class:`tctune.trial.TrialParams`.
        runtime: one of ``tctune.runtime.ALL_RUNTIMES`` (``eager``, ``cudagraphs``, ``inductor``,
            ``inductor-max-autotune``, ``inductor-cudagraphs``, ``inductor-max-autotune-cudagraphs``).
        manifest: what :func:`save` writes beside the graph (see the module docstring).
        input_names: the names of ``forward``'s arguments for the tuned inputs, in order (the manifest's
            ``input_names``), or None where unknown (then inputs are positional only).

    Built by :func:`from_search` (``tctune.optimize``) or :func:`load`; the constructor's other arguments:
    ``autocast`` (``"fp16"``/``"bf16"``: run the graph under ``torch.autocast``, a winning model as written),
    ``cast`` (``"fp16"``/``"bf16"``: the graph is the model cast as a whole, every floating parameter and buffer
    in that dtype, and floating inputs are cast to it on every call, as the winning ``cast_<p>`` baseline ran),
    ``out_spec`` / ``out_dtypes`` (the FP32 reference's output structure and leaf dtype names, ``"float32"``),
    ``save_graph`` (what :func:`save` exports), ``example_inputs`` (inputs at batch 2 for that export),
    ``dynamic_shapes`` (that export's ``torch.export`` dynamic shapes: the capture's batch and declared
    dimensions, e.g. a ``seq`` Dim; None: a batch on dim 0 only) and ``exported`` (the ``ExportedProgram`` a
    loaded module came from).
    """

    def __init__(self, graph: torch.nn.Module, config, runtime: str, *, autocast: str | None = None,
                 cast: str | None = None,
                 out_spec: pytree.TreeSpec | None = None, out_dtypes: Sequence[str | None] = (),
                 keep_low_precision_outputs: bool = False, report: dict | None = None, manifest: dict | None = None,
                 save_graph: torch.nn.Module | None = None, example_inputs: tuple | None = None,
                 exported: Any = None, input_names: Sequence[str] | None = None,
                 dynamic_shapes: tuple | None = None):
        super().__init__()
        self.graph = graph
        self.config = config
        self.runtime = runtime
        self.autocast = autocast
        self.cast = cast
        self.out_spec = out_spec
        self.out_dtypes = list(out_dtypes)
        self.keep_low_precision_outputs = keep_low_precision_outputs
        self.report = report or {}
        self.out_dir: str | None = None
        self.manifest = manifest or {}
        self.input_names = list(input_names) if input_names else None
        # Not submodules: neither in state_dict nor moved by .to() twice.
        self.__dict__["_save_graph"] = save_graph  # what save() exports (FP32 graph for a model-as-written win)
        self.__dict__["_example_inputs"] = example_inputs  # inputs at batch >= 2 for the re-export
        self.__dict__["_exported"] = exported  # the ExportedProgram a loaded module came from
        # torch.export dynamic_shapes of the capture (batch and the model file's declared Dims) for save()
        self.__dict__["_dynamic_shapes"] = dynamic_shapes
        self.__dict__["_compiled"] = None
        self.__dict__["_graphs"] = {}
        self.eval()  # inference: the graph (and a model as written) in eval mode

    def train(self, mode: bool = True) -> "TunedModule":
        """Set the mode flag; the graph follows where it can (an exported graph is fixed at inference)."""
        self.training = mode
        try:
            self.graph.train(mode)
        except NotImplementedError:  # torch.export's module(): its mode was fixed when it was exported
            pass
        return self

    # -- state: the graph's own -----------------------------------------------------------------------
    def state_dict(self, *args, **kwargs):
        """The graph's ``state_dict`` (the original model's key names; see the class docstring)."""
        return self.graph.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load into the graph (its tensors keep their addresses unless ``assign``, so a captured CUDA graph
        replays the new values)."""
        return self.graph.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- running ------------------------------------------------------------------------------------
    def _callable(self) -> Callable:
        fn: Callable = self.graph
        if self.config.memory_format == "channels_last":
            fn = ChannelsLast(self.graph)
        if self.cast:  # the model cast as a whole: floating inputs in its dtype, as CastModel ran it
            low, cast_inner = _AUTOCAST[self.cast], fn

            def fn(*args):  # noqa: F811
                return cast_inner(*_cast_floating(args, low))
        if self.autocast:
            dtype = _AUTOCAST[self.autocast]
            inner = fn

            def fn(*args):  # noqa: F811 - the model as written under autocast, as the search ran it
                device_type = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
                with torch.autocast(device_type, dtype=dtype):
                    return inner(*args)
        return fn

    def _runner(self, inputs: tuple) -> Callable:
        runtime = self.runtime
        on_gpu = any(isinstance(a, torch.Tensor) and a.is_cuda for a in inputs)
        if runtime in CUDA_GRAPH_RUNTIMES and not on_gpu:
            if not self.__dict__.get("_warned_cpu"):
                warnings.warn(f"runtime {runtime} replays CUDA graphs and these inputs are not on a CUDA GPU: "
                              "running without the CUDA graph", RuntimeWarning, stacklevel=3)
                self.__dict__["_warned_cpu"] = True
            runtime = without_cuda_graph(runtime)
        if runtime == "eager":
            return self._callable()
        if runtime in INDUCTOR_RUNTIMES:
            if self._compiled is None:
                self.__dict__["_compiled"] = torch.compile(self._callable(), mode=inductor_mode(runtime), dynamic=False)
            if runtime not in CUDA_GRAPH_RUNTIMES:
                return self._compiled
        base = self._compiled if runtime in INDUCTOR_RUNTIMES else self._callable()
        key = tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else repr(a) for a in inputs)
        if key not in self._graphs:  # one CUDA graph per input signature, captured on first use
            self._graphs[key] = CudaGraphed(base, inputs)
        return self._graphs[key]

    def _bind(self, inputs: tuple, kwargs: dict) -> tuple:
        """``inputs`` and ``kwargs`` as the positional tuple of the tuned inputs (see the class docstring)."""
        names = self.input_names
        if not names:
            raise TypeError(f"this tuned module takes its inputs by position only (the names of forward's "
                            f"arguments are unknown), got keyword(s) {sorted(kwargs)}\n  fix: tuned(*inputs), in "
                            "the order of the model's forward")
        accepted = ", ".join(names)
        if len(inputs) > len(names):
            raise TypeError(f"the tuned module takes {len(names)} inputs ({accepted}), got {len(inputs)} positional")
        twice = [n for n in names[:len(inputs)] if n in kwargs]
        unknown = [k for k in kwargs if k not in names]
        missing = [n for n in names[len(inputs):] if n not in kwargs]
        if twice or unknown or missing:
            why = "; ".join(w for w in (
                f"{twice} given by position and by name" if twice else "",
                f"{unknown} not among them (the search tuned only these inputs)" if unknown else "",
                f"missing {missing}" if missing else "") if w)
            raise TypeError(f"the tuned module takes the inputs it was tuned with: {accepted}; {why}")
        return tuple(inputs) + tuple(kwargs[n] for n in names[len(inputs):])

    def _refuse_mapping(self, inputs: tuple) -> None:
        """A TypeError for a mapping passed as a positional input (``tuned(enc)`` for ``tuned(**enc)``)."""
        i = next(i for i, a in enumerate(inputs) if isinstance(a, Mapping))
        kind = type(inputs[i]).__name__
        fix = (f"tuned(**inputs) passes a mapping's tensors by name ({', '.join(self.input_names)})"
               if self.input_names else "pass its tensors by position, in the order of the model's forward")
        raise TypeError(f"the tuned module takes tensors, got a {kind} as input {i}\n  fix: {fix}")

    def forward(self, *inputs, **kwargs):
        if kwargs:
            inputs = self._bind(inputs, kwargs)
        elif any(isinstance(a, Mapping) for a in inputs):
            self._refuse_mapping(inputs)
        with precision_mode(self.config.precision), torch.inference_mode():
            fn = self._runner(inputs)
            try:
                out = fn(*inputs)
            except (AssertionError, RuntimeError, TypeError, ValueError) as exc:
                problem = self._input_problem(inputs)
                if problem is None:
                    raise
                raise ValueError(problem) from exc
            if isinstance(fn, CudaGraphed):  # its static output is overwritten by the next replay
                out = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)
        return self._restructure(out)

    def _input_problem(self, inputs: tuple) -> str | None:
        """Why ``inputs`` cannot be what the tuned graph takes (count, rank, a fixed dimension, dtype), with the
        fix; None when they match (or no graph records the input shapes: a model cast as a whole). A model as
        written is judged by its FP32 capture (what ``save`` exports). Read only after a call failed: a graph's
        own guard (``AssertionError: Guard failed: x.size()[2] == 32``) or kernel (``expected scalar type Half``),
        or the model's own code (``mat1 and mat2 shapes cannot be multiplied``) names the symptom, not the input."""
        graph = self.graph if isinstance(self.graph, torch.fx.GraphModule) else self.__dict__.get("_save_graph")
        nodes = [n for n in graph.graph.nodes if n.op == "placeholder"] if isinstance(graph, torch.fx.GraphModule) \
            else []
        vals = [n.meta.get("val") for n in nodes]
        if not vals or not all(isinstance(v, torch.Tensor) for v in vals):
            return None
        names = self.input_names or [n.name for n in nodes]

        def shape(v) -> str:
            return "(" + ", ".join(str(d) if isinstance(d, int) else ("batch" if k == 0 else "*")
                                   for k, d in enumerate(v.shape)) + ")"

        def dtype(t) -> str:
            return str(t.dtype).removeprefix("torch.")

        taken = ", ".join(f"{name} {shape(v)} {dtype(v)}" for name, v in zip(names, vals))
        sizes = "* and batch: any size" if "*" in taken else "batch: any size"
        fix = f"\n  fix: call it with the inputs it was tuned with: {taken} ({sizes})"
        if len(inputs) != len(vals):
            return f"the tuned module takes {len(vals)} input(s), got {len(inputs)}" + fix
        for i, (a, v, name) in enumerate(zip(inputs, vals, names)):
            if not isinstance(a, torch.Tensor):
                return f"input {i} ({name}) is a {type(a).__name__}, not a tensor" + fix
            fixed = [d if isinstance(d, int) else None for d in v.shape]
            if a.dim() != len(fixed) or any(w is not None and w != got for w, got in zip(fixed, a.shape)):
                missing = " (a missing batch dimension?)" if a.dim() == len(fixed) - 1 else ""
                return (f"input {i} ({name}) has shape {tuple(a.shape)}, the tuned module takes {shape(v)}{missing}"
                        + fix)
            if a.dtype != v.dtype and not self.cast:
                return (f"input {i} ({name}) is {dtype(a)}, the tuned module takes {dtype(v)} (it casts to its own "
                        f"precision inside)" + fix)
        return None

    def _restructure(self, out):
        leaves, spec = pytree.tree_flatten(out)
        if not self.keep_low_precision_outputs and len(self.out_dtypes) == len(leaves):
            leaves = [t.to(getattr(torch, want)) if (isinstance(t, torch.Tensor) and want and t.is_floating_point()
                                                      and str(t.dtype) != f"torch.{want}") else t
                      for t, want in zip(leaves, self.out_dtypes)]
        if self.out_spec is not None and self.out_spec.num_leaves == len(leaves):
            return pytree.tree_unflatten(leaves, self.out_spec)
        return pytree.tree_unflatten(leaves, spec)

    def extra_repr(self) -> str:
        c = self.config
        what = ("tctune graph" if c.graph_passes else
                f"model cast as a whole ({_CAST_LABEL.get(self.cast, self.cast)})" if self.cast else "model as written")
        return f"{what}, {c.precision}, {self.runtime}, tuned batch {c.batch_size}"


_CAST_LABEL = {"fp16": "model.half()", "bf16": "model.to(torch.bfloat16)"}


def _cast_floating(args: tuple, dtype: torch.dtype) -> tuple:
    """``args`` with every floating tensor (at any depth) cast to ``dtype``; other leaves unchanged."""
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                           tuple(args))


def from_search(optimized, keep_low_precision_outputs: bool | None = None) -> TunedModule:
    """The :class:`TunedModule` of a finished search (``tctune.optimize.optimize_model``'s result).

    The graph is built as the search built the winning trial's (same builder, calibration inputs, FP8
    keep-list, output contract ``TuneConfig.output_dtype``); the output structure is that of the FP32 reference
    at the tuned batch, and so are the output dtypes under ``output_dtype="fp32"``; under ``"compute"`` the
    floating outputs stay in the winner's computed dtype. ``keep_low_precision_outputs``: None follows the
    search's ``output_dtype``; True / False force ``"compute"`` / ``"fp32"`` outputs (the graph keeps the
    search's contract; ``"fp32"`` is then an up-cast after the graph, ``"compute"`` returns what it returns).
    The manifest records the contract as ``output_dtype``. A winning plain baseline that cast the model as a
    whole (user attribute ``model_cast``, e.g. ``cast_fp16`` or ``compile_cast_bf16``) is that cast model: a copy
    of the FP32 model with every floating parameter and buffer in the low dtype, floating inputs cast on every
    call, through the trial's runtime (``torch.compile`` for a ``compile_*`` baseline); the manifest's ``cast``
    names its precision, and :func:`save` writes the cast model's program.

    Raises:
        UsageError: no configuration qualified (the report's failure summary says why).
    """
    from .trial import build_trial_graph, reference_inputs

    bt = optimized.best
    tuner = optimized.tuner  # a tctune.search.Tuner
    if bt is None:
        from .report import failure_summary

        why = failure_summary(optimized.report.get("trials", [])) if optimized.report.get("trials") else "no trial ran"
        raise UsageError(f"no configuration qualified, so there is no tuned module: {why}\n  fix: see the report in "
                         f"{tuner.cfg.out_dir}; raise max_error or widen the search")
    from .search.baselines import run_params
    from .search.loop import recorded_fp8

    params = run_params(bt.params, bt.user_attrs)  # its runtime as it ran (the max-autotune finalist's)

    trial = tuner.trial_params(params, **recorded_fp8(bt))
    inputs, ref = tuner.reference(trial.batch_size)
    output_dtype = getattr(tuner.cfg, "output_dtype", "fp32")
    if keep_low_precision_outputs is None:
        keep_low_precision_outputs = output_dtype == "compute"
    layout = state_layout(tuner.model)
    cast = None
    if bt.user_attrs.get("model_cast") and not trial.graph_passes and trial.precision in _AUTOCAST:
        cast = trial.precision  # what was measured: model.half() / model.to(torch.bfloat16), not autocast
        graph = copy.deepcopy(tuner.model).to(_AUTOCAST[cast]).eval()
        restore_layout(graph, layout)  # deepcopy keeps ties; non-persistent buffers stay so
        save_graph, autocast = graph, None
    elif trial.graph_passes:
        graph, _ = build_trial_graph(tuner.captured.graph_module, tuner.hw, trial, [inputs],
                                     output_dtype=output_dtype)
        graph = graph.to(tuner.device)
        restore_layout(graph, layout)
        save_graph, autocast = graph, None
    else:
        graph = tuner.model
        save_graph = tuner.captured.graph_module  # the FP32 capture; save() applies autocast on load
        autocast = trial.precision if trial.precision in _AUTOCAST else None
    if trial.memory_format == "channels_last":
        graph = (graph if trial.graph_passes or cast else copy.deepcopy(graph)).to(memory_format=torch.channels_last)
    leaves, spec = pytree.tree_flatten(ref)
    dtypes = [str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else None for t in leaves]
    hw = tuner.hw
    example = reference_inputs(tuner.mf, 2, tuner.device)  # batch 2: export does not specialize it
    manifest = {"format_version": FORMAT_VERSION, "model": tuner.mf.name, "trial": trial.to_dict(),
                "runtime": trial.runtime, "precision": trial.precision, "autocast": autocast, "cast": cast,
                "out_spec": _spec_dumps(spec), "out_spec_plain": _spec_dumps(pytree.tree_flatten(_plain(ref))[1]),
                "out_dtypes": dtypes, "keep_low_precision_outputs": keep_low_precision_outputs,
                "output_dtype": "compute" if keep_low_precision_outputs else "fp32",
                "layout": layout, "compute_capability": hw.compute_capability or None, "hardware": hw.name,
                "arch": hw.arch, "device": tuner.device.type, "torch_version": torch.__version__,
                "tctune_version": _version()}
    from .capture import export_dynamic_shapes

    captured = getattr(getattr(tuner, "captured", None), "graph_module", None)
    dynamic = export_dynamic_shapes(captured) if captured is not None else None
    names = tuner.mf.forward_names()
    names = names[:len(inputs)] if len(names) >= len(inputs) else None
    manifest["input_names"] = names
    return TunedModule(graph, trial, trial.runtime, autocast=autocast, cast=cast, out_spec=spec, out_dtypes=dtypes,
                       keep_low_precision_outputs=bool(keep_low_precision_outputs), report=optimized.report,
                       manifest=manifest, save_graph=save_graph, example_inputs=example, input_names=names,
                       dynamic_shapes=dynamic)


def _version() -> str:
    from . import __version__

    return __version__


def _dynamic_spec(example: tuple) -> tuple:
    """``torch.export`` dynamic shapes for ``example``: dim 0 a shared batch for every tensor whose dim 0 is
    the batch of the first batched tensor; other inputs static."""
    from .capture import MAX_BATCH
    from .modelfile import example_batch

    b = example_batch(example)
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    return tuple({0: batch} if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == b else None
                 for t in example)


def _describe_inputs(example: tuple, dynamic: tuple | None = None) -> list[dict]:
    """One entry per input: ``shape`` (sizes, the name of a dynamic dimension's symbol in its place:
    ``"batch"``, ``"seq"``) and ``dtype``; ``dynamic``: the export's dynamic shapes (None: batch on dim 0)."""
    from .modelfile import example_batch

    if dynamic is None:
        b = example_batch(example)
        dynamic = tuple({0: "batch"} if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == b else None
                        for t in example)

    def name(dim) -> str:
        return dim if isinstance(dim, str) else str(getattr(dim, "__name__", dim))

    return [{"shape": [name((spec or {})[i]) if i in (spec or {}) else d for i, d in enumerate(t.shape)],
             "dtype": str(t.dtype).removeprefix("torch.")} if isinstance(t, torch.Tensor) else {"value": repr(t)}
            for t, spec in zip(example, tuple(dynamic) + (None,) * (len(example) - len(dynamic)))]


def export_program(tuned: TunedModule):
    """The ``ExportedProgram`` :func:`save` writes: the tuned graph (its precision in its ops and weights),
    re-exported with a dynamic batch (and the model file's declared dynamic dimensions, ``DYNAMIC_SHAPES``, with
    their names and ranges) and the original model's state layout.

    Raises:
        ExportError: the graph cannot be exported (e.g. the model could not be captured: the reason is given).
    """
    if tuned._exported is not None:
        return tuned._exported
    graph, example = tuned._save_graph, tuned._example_inputs
    if graph is None or example is None:
        reason = (tuned.report.get("capture") or {}).get("reason") or "no captured graph"
        raise ExportError(f"cannot save: the model was not captured by torch.export ({reason})\n  fix: make the "
                          "model exportable (torch.export.export(model, inputs) must succeed)")
    restore_layout(graph, tuned.manifest.get("layout") or {})
    if tuned.cast:  # the cast model's program takes its dtype; the loaded TunedModule casts the inputs to it
        example = _cast_floating(example, _AUTOCAST[tuned.cast])
    from .capture import _quiet_torch_logs

    try:
        with warnings.catch_warnings(), _quiet_torch_logs():
            warnings.simplefilter("ignore")
            ep = torch.export.export(graph, tuple(example), dynamic_shapes=tuned._dynamic_shapes or _dynamic_spec(example),
                                     strict=False)
    except Exception as exc:  # noqa: BLE001 - one clear error for any export failure
        raise ExportError(f"cannot save: torch.export of the tuned graph failed: {type(exc).__name__}: "
                          f"{clip(str(exc).strip().splitlines()[0]) if str(exc).strip() else ''}") from exc
    _plain_outputs(ep)
    return ep


def _plain_outputs(ep) -> None:
    """Where the program's output structure holds a class ``torch.export.save`` cannot serialize (a namedtuple or
    dataclass without a registered serialized name), make the program return its flat tuple of outputs; the
    manifest's ``out_spec`` / ``out_spec_plain`` re-assemble them on load."""
    sig = ep.module_call_graph[0].signature
    if sig is None or sig.out_spec is None or _spec_dumps(sig.out_spec) is not None:
        return
    sig.out_spec = pytree.tree_structure(tuple(range(sig.out_spec.num_leaves)))


def save(tuned: TunedModule, path: str | Path) -> Path:
    """Write ``tuned`` to one file (a ``torch.export`` archive; ``.pt2`` by convention) that :func:`load` reads
    in any process with tctune and torch installed, without the model's code.

    Outputs whose container classes cannot be serialized (a namedtuple or dataclass without a registered
    serialized name) come back from the loaded module as plain tuples and dicts with the same leaves; a class
    registered with ``torch.utils._pytree`` under a serialized name (transformers' ``ModelOutput``) comes back
    as itself where it is importable.

    Holds: the tuned graph (:func:`export_program`: ops and weights at the tuned precision), the runtime,
    trial, output structure and dtypes, input shapes (``"batch"`` for the dynamic dim), compute capability and
    torch version (``tctune_manifest.json``), and the search's report (``tctune_report.json``).

    Returns:
        The path written.

    Raises:
        UsageError: ``tuned`` is not a :class:`TunedModule`.
        ExportError: the graph cannot be exported (see :func:`export_program`).
    """
    if not isinstance(tuned, TunedModule):
        raise UsageError(f"save needs the TunedModule that tctune.optimize returned, got {type(tuned).__name__}")
    ep = export_program(tuned)
    example = tuned._example_inputs
    manifest = dict(tuned.manifest)
    if example is not None:
        manifest["inputs"] = _describe_inputs(example, tuned._dynamic_shapes)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(ep, str(p), extra_files={MANIFEST: json.dumps(manifest, indent=1),
                                               REPORT: json.dumps(tuned.report, default=str)})
    return p


def read_manifest(path: str | Path) -> dict:
    """The manifest of a file :func:`save` wrote, without loading the graph.

    Raises:
        UsageError: not a tctune archive (no ``tctune_manifest.json``).
    """
    try:
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith(f"extra/{MANIFEST}")), None)
            if name is None:
                raise UsageError(f"{path} is not a file tctune.save wrote (no {MANIFEST} in it)")
            return json.loads(z.read(name))
    except (OSError, zipfile.BadZipFile) as exc:
        raise UsageError(f"cannot read {path}: {exc}\n  fix: pass a file written by tctune.save") from exc


def load(path: str | Path, device: str | torch.device | None = None) -> TunedModule:
    """Load a file written by :func:`save` as a :class:`TunedModule`; the model's Python code is not needed.

    The runtime is re-applied: Inductor compiles on the first call (Inductor's cache makes that fast when the
    same graph was compiled before on this machine); a CUDA graph is captured per input shape on first use.
    Loading on a GPU whose compute capability differs from the one tuned for (or on the CPU for a GPU-tuned
    file) warns, naming both: the padding, precision and runtime were chosen by measuring on that chip.

    Args:
        device: where to run; None: the GPU when the file was tuned on one and torch sees one, else the CPU.

    Raises:
        UsageError: not a tctune file, or written by a newer tctune.
    """
    manifest = read_manifest(path)
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise UsageError(f"{path} was written by a newer tctune (format {manifest['format_version']}); "
                         f"this one reads format {FORMAT_VERSION}\n  fix: upgrade tctune")
    import passes  # noqa: F401 - registers the custom ops a tuned graph may call

    extra = {MANIFEST: "", REPORT: ""}
    ep = torch.export.load(str(path), extra_files=extra)
    report = json.loads(extra[REPORT]) if extra.get(REPORT) else {}
    if device is None:
        device = "cuda" if manifest.get("device") == "cuda" and torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    _check_capability(manifest, device)
    try:
        from torch.export.passes import move_to_device_pass

        ep = move_to_device_pass(ep, device)
    except ImportError:  # older torch: module.to() below
        pass
    graph = ep.module().to(device)
    restore_layout(graph, manifest.get("layout") or {})
    from .trial import TrialParams

    trial = TrialParams.from_dict(manifest["trial"])
    if trial.memory_format == "channels_last":
        graph = graph.to(memory_format=torch.channels_last)
    spec = _spec_loads(manifest.get("out_spec")) or _spec_loads(manifest.get("out_spec_plain"))
    return TunedModule(graph, trial, manifest["runtime"], autocast=manifest.get("autocast"),
                       cast=manifest.get("cast"), out_spec=spec,
                       out_dtypes=manifest.get("out_dtypes") or (),
                       keep_low_precision_outputs=_keeps_low(manifest), report=report,
                       manifest=manifest, exported=ep, input_names=manifest.get("input_names"))


def _keeps_low(manifest: dict) -> bool:
    """Whether a saved module returns outputs in their computed dtype: its manifest's ``output_dtype``
    (``"compute"``), or for a file written before that key, its ``keep_low_precision_outputs`` flag."""
    if manifest.get("output_dtype") is not None:
        return manifest["output_dtype"] == "compute"
    return bool(manifest.get("keep_low_precision_outputs"))


def _check_capability(manifest: dict, device: torch.device) -> None:
    tuned_cc = manifest.get("compute_capability")
    if not tuned_cc:
        return
    here = _current_capability(device)
    if here == tuned_cc:
        return
    where = f"compute capability {here}" if here else f"the {device.type.upper()}"
    trial = manifest.get("trial") or {}
    warnings.warn(
        f"this file was tuned for compute capability {tuned_cc} ({manifest.get('hardware')}, {manifest.get('arch')}): "
        f"{trial.get('precision')}, {'tctune graph' if trial.get('graph_passes') else 'model as written'}, "
        f"runtime {manifest.get('runtime')}, batch {trial.get('batch_size')}; it runs here on {where}, where "
        f"that choice was not measured\n  fix: tune again on this machine for its best configuration",
        RuntimeWarning, stacklevel=3)


__all__ = ["FORMAT_VERSION", "MANIFEST", "REPORT", "TunedModule", "export_program", "from_search", "load",
           "read_manifest", "restore_layout", "save", "state_layout"]
