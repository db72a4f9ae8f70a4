"""Deployable engines from the tuned graph: ONNX (validated by onnxruntime) and TensorRT (when installed)."""
from __future__ import annotations

from tctune.export.onnx import export_onnx, validate_onnx
from tctune.export.tensorrt import build_engine, tensorrt_available

__all__ = ["export_onnx", "validate_onnx", "build_engine", "tensorrt_available"]
