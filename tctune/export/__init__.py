"""Deployable engines from the tuned graph: ONNX (validated by onnxruntime; FP8 as float8 Q/DQ) and TensorRT."""
from __future__ import annotations

from tctune.export.onnx import (
    InvalidOnnxError,
    deployment,
    export_onnx,
    export_onnx_deployable,
    load_onnxruntime,
    validate_onnx,
)
from tctune.export.onnx_fp8 import build_fp8_graphs, export_onnx_fp8
from tctune.export.tensorrt import build_engine, tensorrt_available

__all__ = ["export_onnx", "export_onnx_deployable", "deployment", "InvalidOnnxError", "load_onnxruntime",
           "validate_onnx", "export_onnx_fp8", "build_fp8_graphs", "build_engine", "tensorrt_available"]
