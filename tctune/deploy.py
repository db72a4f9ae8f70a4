"""The graphs an export writes for one trial, built the way the search built the graph it measured.

``tctune optimize`` (after the search) and ``tctune export`` (from ``best_config.json``) both call
:func:`export_graphs` with the trial's :class:`~tctune.trial.TrialParams` and the trial's calibration inputs
(the seeded reference inputs at its batch size, :func:`tctune.trial.reference_inputs`), so an engine is by
construction the measured graph: same precision, cast policy, FP8 keep-list and fp16 overflow keep-list.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Sequence

import torch

from passes import PIPELINE

from .trial import TrialParams, build_trial_graph

#: The passes for engines (ONNX → TensorRT / onnxruntime, AOTInductor): the cuBLASLt epilogue op and the fused
#: cuDNN convolution ops have no ONNX translation, and TensorRT fuses bias + activation itself.
#: ``fuse_epilogue`` and ``fuse_conv_relu`` fire for GPU targets only.
EXPORT_PIPELINE = tuple(n for n in PIPELINE if n not in ("fuse_epilogue", "fuse_conv_relu"))


@dataclass
class ExportGraphs:
    """What an export writes.

    Attributes:
        graph: the PyTorch graph of the trial with :data:`EXPORT_PIPELINE` (at fp8 the ``_scaled_mm`` graph).
        onnx_graph: what ``model.onnx`` is exported from (at fp8 the bf16 twin; Q/DQ are added from ``fp8``).
        fp8: at precision fp8, the ``tctune.export.onnx_fp8.FP8Graphs`` (fp32 / bf16 / fp8 twins); else None.
        results: the pass results of :data:`EXPORT_PIPELINE` on ``graph``.
    """

    graph: torch.fx.GraphModule
    onnx_graph: torch.fx.GraphModule
    fp8: Any = None
    results: list = field(default_factory=list)


def calibration_for(trial: TrialParams, inputs: tuple | None) -> list[tuple] | None:
    """The calibration list :func:`build_trial_graph` takes: ``[inputs]`` when the trial calibrates, else None."""
    return [inputs] if trial.calibration and inputs is not None else None


def export_graphs(gm: torch.fx.GraphModule, hw, trial: TrialParams, calibration: Sequence[tuple] | None,
                  names: Sequence[str] = EXPORT_PIPELINE) -> ExportGraphs:
    """The graphs an export of ``trial`` writes, from the captured FP32 graph ``gm`` (not modified).

    Args:
        hw: a ``tctune.hardware.HardwareSpec`` (alignment, generation).
        calibration: the trial's reference inputs (fp16 overflow analysis), e.g. ``[reference_inputs(...)]``.

    Raises:
        PassError: a cast pass failed.
    """
    if trial.precision == "fp8":
        # torch._scaled_mm has no ONNX translation: model.onnx is the bf16 twin with every FP8 linear as float8
        # QuantizeLinear/DequantizeLinear (tctune/export/onnx_fp8.py). The graph (AOTInductor's source) keeps the
        # trial's _scaled_mm fast accumulation; ONNX Q/DQ has no such switch (the engine chooses its accumulation).
        from passes.policy import pass_spec

        from .export.onnx_fp8 import build_fp8_graphs

        fp8 = build_fp8_graphs(gm, pass_spec(hw, "fp8", policy=trial.policy, fp8_keep=trial.fp8_keep,
                                               fp8_fast_accum=trial.fp8_fast_accum), names)
        return ExportGraphs(fp8.fp8, fp8.bf16, fp8, list(fp8.results))
    g, results = build_trial_graph(gm, hw, trial, calibration, names)
    return ExportGraphs(g, g, None, results)


#: What an export wrote for the best trial (``report.json``'s ``artifacts.exported_graph``): tctune's rewritten
#: graph, the model as written (FP32, no tctune pass) or the model cast as a whole (``model.half()``).
EXPORTED_GRAPHS = ("tctune_graph", "model_as_written", "model_cast")


def exports_as_written(trial: TrialParams) -> bool:
    """Whether an export of ``trial`` writes the model as written: the trial ran it without tctune's graph passes
    (``graph_passes`` False) at fp32 or tf32, so its ONNX file is the captured FP32 graph
    (:func:`as_written_export_graphs`; TF32 is FP32 in an engine file). The model as written at fp16/bf16 ran
    under ``torch.autocast``, which an engine file cannot hold: its export is tctune's graph at that precision
    (autocast cast policy), and the report says so."""
    return not trial.graph_passes and trial.precision in ("fp32", "tf32")


def as_written_export_graphs(captured: torch.fx.GraphModule) -> ExportGraphs:
    """:func:`export_graphs` for a trial that ran the model as written in FP32 (:func:`exports_as_written`, e.g.
    the plain baseline ``fp32_eager`` or its ``torch.compile``): the FP32 capture ``captured``
    (``tctune.capture.capture``) itself, no tctune pass (no QKV fusion, no padding), not copied."""
    return ExportGraphs(captured, captured, None, [])


#: Why a bf16 model cast as a whole is written with FP32 outputs under the ``"compute"`` contract: onnxruntime's
#: Python API (and so the validation and the generated runners) cannot return a bfloat16 output ("No
#: corresponding Numpy type for Tensor Type. bfloat16"); numpy has no bfloat16.
BF16_OUTPUTS_NOTE = ("bf16 outputs are written as FP32: onnxruntime's Python API and numpy have no bfloat16 "
                     "(the cast model's other tensors stay bf16)")


def cast_onnx_out_dtype(precision: str, output_dtype: str) -> torch.dtype | None:
    """The dtype the ONNX export of the model cast as a whole to ``precision`` (``"fp16"``/``"bf16"``) returns its
    floating outputs in under output contract ``output_dtype`` (``tctune.trial.OUTPUT_DTYPES``): None (left in the
    cast dtype) for ``"compute"`` at fp16; ``torch.float32`` for ``"fp32"``, and for ``"compute"`` at bf16
    (:data:`BF16_OUTPUTS_NOTE`)."""
    if output_dtype == "compute" and precision == "fp16":
        return None
    return torch.float32


def _named_like(cast: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """``cast`` (a :class:`~tctune.search.baselines.CastModel`, changed in place) with ``forward`` showing
    ``model.forward``'s positional parameter names, so that torch.export names the graph's inputs (and the ONNX
    file its inputs) as the model does (``x``, ``input_ids``), not ``args_0``."""
    import inspect

    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return cast
    base = type(cast)

    def forward(self, *args, **kwargs):
        return base.forward(self, *args, **kwargs)

    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params])
    cast.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})
    return cast


def cast_model_graph(model: torch.nn.Module, captured: torch.fx.GraphModule, precision: str, inputs: tuple,
                     out_dtype: torch.dtype | None = torch.float32) -> torch.fx.GraphModule:
    """The graph of the model cast as a whole (``model.half()`` / ``model.to(torch.bfloat16)``): what a plain
    ``cast_<p>`` baseline measured (:class:`~tctune.search.baselines.CastModel`), captured by ``torch.export``
    with the dynamic dimensions of ``captured`` (the FP32 capture of the same model, ``tctune.capture.capture``).

    Every floating parameter and buffer is in the low dtype (a copy: ``model`` is untouched); floating inputs are
    FP32 and cast inside the graph, as ``CastModel`` does; floating outputs of the low dtype are returned in it
    (``out_dtype`` None) or cast to ``out_dtype``. The graph carries ``captured``'s batch range and dynamic
    dimensions in its ``meta``, so the ONNX export gives it the same symbolic axes.

    Args:
        model: the FP32 eval-mode model; captured: its FP32 capture; precision: ``"fp16"`` or ``"bf16"``;
        inputs: example inputs with batch ≥ 2 (e.g. ``mf.inputs(2, device)``), on the model's device.

    Raises:
        ExportError: ``precision`` is not fp16/bf16, or torch.export of the cast model failed (its first line).
    """
    import copy
    import warnings

    from .capture import _quiet_torch_logs, export_dynamic_shapes
    from .errors import ExportError, clip
    from .search.baselines import LOW_DTYPES, CastModel

    if precision not in LOW_DTYPES:
        raise ExportError(f"the model cast as a whole needs precision fp16 or bf16, got {precision!r}")
    cast = _named_like(CastModel(model, LOW_DTYPES[precision], out_dtype=out_dtype).eval(), model)
    try:
        with warnings.catch_warnings(), _quiet_torch_logs(), torch.no_grad():
            warnings.simplefilter("ignore")
            ep = torch.export.export(cast, tuple(inputs), dynamic_shapes=export_dynamic_shapes(captured), strict=False)
    except Exception as exc:  # noqa: BLE001 - one clear error for any export failure
        text = str(exc).strip()
        raise ExportError(f"torch.export of the model cast to {precision} failed: {type(exc).__name__}: "
                          f"{clip(text.splitlines()[0]) if text else ''}") from exc
    g = ep.module()
    for key in ("tctune_batch_range", "tctune_batched", "tctune_dynamic"):
        if key in captured.meta:
            g.meta[key] = copy.deepcopy(captured.meta[key])
    return g


def cast_export_graphs(model: torch.nn.Module, captured: torch.fx.GraphModule, precision: str, inputs: tuple,
                       output_dtype: str = "fp32") -> ExportGraphs:
    """:func:`export_graphs` for a winning plain baseline that cast the model as a whole: the cast model's graph
    (:func:`cast_model_graph`; floating outputs per :func:`cast_onnx_out_dtype`), no tctune pass.

    Raises:
        ExportError: see :func:`cast_model_graph`.
    """
    g = cast_model_graph(model, captured, precision, inputs, cast_onnx_out_dtype(precision, output_dtype))
    return ExportGraphs(g, g, None, [])


def smallest_batch(run: Callable[[int], Any], searched: Sequence[int]) -> tuple[int, str | None]:
    """The smallest batch size an export claims: 1 when the model as written runs there, else the smallest of the
    ``searched`` batch sizes (the trials ran them) that runs. A graph from ``torch.export`` accepts batch 1 even
    where the model does not (an ``assert x.shape[0] > 1`` or BatchNorm's training-mode check on the batch are
    not in the graph), so it is the model that is run, not the graph.

    Args:
        run: ``run(b)`` runs the FP32 model as written on fresh inputs of batch ``b``, raising where it fails.
        searched: the searched batch sizes.

    Returns:
        ``(batch size, note)``: the note is None when batch 1 runs, else one line saying what batch 1 raised and
        where the range starts. When no size runs, the smallest searched one, with a note saying so.
    """
    failed: list[str] = []
    for b in sorted({1, *(int(x) for x in searched)}):
        try:
            run(b)
        except Exception as exc:  # noqa: BLE001 - the model's own failure at this batch size
            text = (str(exc).strip().splitlines() or [""])[0][:200]
            failed.append(f"batch {b}: {type(exc).__name__}: {text}".rstrip(": "))
            continue
        if b == 1:
            return 1, None
        return b, (f"the model as written raised at {'; '.join(failed)}; the exported batch range starts at {b}, "
                   "the smallest searched batch size that ran")
    lo = min(int(x) for x in searched)
    return lo, f"the model as written raised at every batch size tried ({'; '.join(failed)})"


def claim_batch_from(gm: torch.nn.Module, lo: int) -> torch.nn.Module:
    """``gm`` (a graph from ``tctune.capture.capture`` or built from one) with its smallest claimed batch raised to
    ``lo``: ``meta["tctune_batch_range"]`` and the ``min`` of its ``batch`` entries in ``meta["tctune_dynamic"]``,
    which the ONNX and AOTInductor exports turn into ``torch.export.Dim("batch", min=...)``. Changed in place (new
    meta values; shared ones are not mutated) and returned; a module without that meta is returned unchanged."""
    meta = getattr(gm, "meta", None)
    if not isinstance(meta, dict):
        return gm
    if "tctune_batch_range" in meta:
        old_lo, hi = meta["tctune_batch_range"]
        meta["tctune_batch_range"] = (max(int(old_lo), lo), hi)
    if "tctune_dynamic" in meta:
        meta["tctune_dynamic"] = [dict(d, min=max(int(d["min"]), lo)) if d.get("symbol") == "batch" else dict(d)
                                  for d in meta["tctune_dynamic"]]
    return gm


@dataclass
class Artifacts:
    """What ``tctune optimize`` exported for the best trial (``report.json``'s ``artifacts``: :meth:`to_dict`).

    Attributes:
        onnx: path of ``model.onnx``; onnx_max_abs_error: its max abs error in onnxruntime vs PyTorch (None when
            onnxruntime could not run it); onnx_error: why there is no (validated) ONNX; onnx_note: how an FP8
            ONNX was quantized and validated; onnx_inputs: its inputs (name, shape with ``"batch"``, dtype);
            onnx_fp8: FP8 export details (Q/DQ counts, calibration, validation).
        onnx_fp32, onnx_fp32_max_abs_error, onnx_fp32_error: the same graph in FP32 (written when onnxruntime
            cannot run the low-precision ``model.onnx``).
        onnx_load, onnx_provider: whether onnxruntime loaded ``model.onnx`` (``"ok"``, ``"no_kernel"``,
            ``"invalid"``, ``"failed"``, ``"skipped"``) and on which execution provider
            (``tctune.export.onnx.export_onnx``); onnx_invalid: why the typed graph is not valid ONNX at any opset
            (then ``onnx`` is None and the FP32 twin is the file).
        onnx_fp32_validation, onnx_fp32_load, onnx_fp32_provider: the same for the FP32 twin.
        deploy, deploy_reason: which file to deploy on which runtime (``{"tensorrt": "model.onnx",
            "onnxruntime-cpu": "model.fp32.onnx"}``) and why, in one line (``tctune.export.onnx.deployment``);
            TensorRT is built from ``deploy["tensorrt"]``.
        onnx_runner, onnx_fp32_runner: the generated ``runner.py`` beside each ONNX file.
        tensorrt: path of ``model.engine``; tensorrt_skipped_reason: why there is none.
        onnx_failed: when the ONNX export of the best trial raised, its entry as ``tctune export`` records a
            failed format (:func:`tctune.engines.failed_format`: ``status``, ``error`` (one line), ``log`` (the
            ``tctune_errors.log`` holding the full text), ``path``, ``files``); None otherwise (a skipped or
            disabled export is not a failure). ``tctune optimize`` then exits 1.
        exported_trial: the number of the trial whose configuration the files above are (the best trial), or
            None when nothing was exported.
        export_fallback: when the best trial could not be exported, ``{"best_trial", "best_error",
            "exported_trial", "params", "throughput", "dir", "artifacts", "tried"}``: the next-best feasible trial
            that exported (into ``dir``, with its own artifacts dict), or ``exported_trial`` None when none did.
        best_config, study_db: paths of ``best_config.json`` and the SQLite study.
        details: everything else the engine writers report (``onnx_opset``, ``onnx_validation``...), by key.
    """

    onnx: str | None = None
    onnx_max_abs_error: float | None = None
    onnx_error: str | None = None
    onnx_note: str | None = None
    onnx_inputs: list | None = None
    onnx_fp8: dict | None = None
    onnx_fp32: str | None = None
    onnx_fp32_max_abs_error: float | None = None
    onnx_fp32_error: str | None = None
    onnx_load: str | None = None
    onnx_provider: str | None = None
    onnx_invalid: str | None = None
    onnx_fp32_validation: list | None = None
    onnx_fp32_load: str | None = None
    onnx_fp32_provider: str | None = None
    deploy: dict | None = None
    deploy_reason: str | None = None
    onnx_runner: str | None = None
    onnx_fp32_runner: str | None = None
    tensorrt: str | None = None
    tensorrt_skipped_reason: str | None = None
    onnx_failed: dict | None = None
    exported_trial: int | None = None
    export_fallback: dict | None = None
    best_config: str | None = None
    study_db: str | None = None
    details: dict = field(default_factory=dict)
    _assigned: set = field(default_factory=set, init=False, repr=False, compare=False)

    #: Keys ``report.json`` always has (None when not written).
    ALWAYS = ("onnx", "onnx_max_abs_error", "tensorrt", "tensorrt_skipped_reason")

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        if name != "_assigned" and "_assigned" in self.__dict__:  # set after construction: reported even if None
            self._assigned.add(name)

    def update(self, info: dict) -> None:
        """Take an engine writer's result dict: its known keys set the fields, the others go to ``details``."""
        names = {f.name for f in fields(self)} - {"details", "_assigned"}
        for k, v in info.items():
            if k in names:
                setattr(self, k, v)
            else:
                self.details[k] = v

    def to_dict(self) -> dict:
        """The ``artifacts`` object of ``report.json``: :data:`ALWAYS`, every other field that is not None or was
        assigned, and ``details``' keys."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("details", "_assigned")
               and (f.name in self.ALWAYS or getattr(self, f.name) is not None or f.name in self._assigned)}
        out.update(self.details)
        return out


__all__ = ["Artifacts", "BF16_OUTPUTS_NOTE", "EXPORTED_GRAPHS", "EXPORT_PIPELINE", "ExportGraphs", "as_written_export_graphs",
           "calibration_for", "cast_export_graphs", "cast_model_graph", "cast_onnx_out_dtype", "claim_batch_from",
           "export_graphs", "exports_as_written", "smallest_batch"]
