"""The graphs an export writes for one trial, built the way the search built the graph it measured.

``tctune optimize`` (after the search) and ``tctune export`` (from ``best_config.json``) both call
:func:`export_graphs` with the trial's :class:`~tctune.trial.TrialParams` and the trial's calibration inputs
(the seeded reference inputs at its batch size, :func:`tctune.trial.reference_inputs`), so an engine is by
construction the measured graph: same precision, cast policy, FP8 keep-list and fp16 overflow keep-list.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import torch

from passes import PIPELINE

from .trial import TrialParams, build_trial_graph

#: The passes for engines (ONNX → TensorRT / onnxruntime, AOTInductor): the cuBLASLt epilogue op has no ONNX
#: translation, and TensorRT fuses bias + activation itself. ``fuse_epilogue`` fires on CUDA graphs only.
EXPORT_PIPELINE = tuple(n for n in PIPELINE if n != "fuse_epilogue")


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
        # QuantizeLinear/DequantizeLinear (tctune/export/onnx_fp8.py).
        from passes.policy import pass_spec

        from .export.onnx_fp8 import build_fp8_graphs

        fp8 = build_fp8_graphs(gm, pass_spec(hw, "fp8", policy=trial.policy, fp8_keep=trial.fp8_keep), names)
        return ExportGraphs(fp8.fp8, fp8.bf16, fp8, list(fp8.results))
    g, results = build_trial_graph(gm, hw, trial, calibration, names)
    return ExportGraphs(g, g, None, results)


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


__all__ = ["Artifacts", "EXPORT_PIPELINE", "ExportGraphs", "calibration_for", "export_graphs"]
