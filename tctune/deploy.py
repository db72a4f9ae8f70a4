"""The graphs an export writes for one trial, built the way the search built the graph it measured.

``tctune optimize`` (after the search) and ``tctune export`` (from ``best_config.json``) both call
:func:`export_graphs` with the trial's :class:`~tctune.trial.TrialParams` and the trial's calibration inputs
(the seeded reference inputs at its batch size, :func:`tctune.trial.reference_inputs`), so an engine is by
construction the measured graph: same precision, cast policy, FP8 keep-list and fp16 overflow keep-list.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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


__all__ = ["EXPORT_PIPELINE", "ExportGraphs", "calibration_for", "export_graphs"]
