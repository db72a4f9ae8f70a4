"""FP8 ONNX export: every FP8 linear as explicit QuantizeLinear / DequantizeLinear pairs (float8e4m3fn).

Why this exists: ``passes.cast_fp8`` runs eligible linears as ``torch._scaled_mm`` with per-token *dynamic*
activation scales; ``_scaled_mm`` has no ONNX translation, and TensorRT's explicit quantization reads
precision from Q/DQ nodes with *static* scales. This module writes the ONNX TensorRT expects::

    x (bf16) -> QuantizeLinear(s_x, zp) -> DequantizeLinear(s_x, zp) --+
                                                                        +-> MatMul / Gemm -> (+ bias, bf16)
    W8 (float8e4m3fn initializer) -> DequantizeLinear(s_w[, axis]) ----+

- ``zp`` is a float8e4m3fn scalar 0: its type is what makes QuantizeLinear emit float8 (``saturate=1``, so
  values beyond ``+-448 * s_x`` saturate to +-448, never NaN: float8e4m3fn has no infinity).
- ``s_x`` is one **static per-tensor** activation scale per FP8 weight: ``max |x| / 448`` over calibration
  inputs, measured on the bf16 graph (the graph this file is exported from) with an FX interpreter. The
  PyTorch FP8 graph uses **dynamic per-token** scales instead (``amax(|x|, -1) / 448`` per row, computed at
  run time); ONNX Q/DQ as TensorRT consumes it cannot express that, so the two differ by the activation
  quantization error (validated below). A weight used by several linears (tied) gets the max over its
  uses. Inputs far larger than the calibration inputs saturate instead of overflowing.
- ``W8`` is the float8_e4m3fn weight ``cast_fp8_linears`` computed from the FP32 weight
  (``clamp(W / s_w, -448, 448)``, the buffer ``<weight>_fp8``), so ONNX and PyTorch share the weight codes,
  in the layout the exporter gave the GEMM: ``(K, N)`` for ``MatMul`` (per output channel: ``axis=1``),
  ``(N, K)`` for ``Gemm(transB=1)`` (``axis=0``); ``s_w`` is 1-D ``(N,)`` when the pass scaled per output
  channel (``PassSpec.fp8_scaling == "row"``) or a scalar when it scaled per tensor (``"tensor"``).
- Scales are stored in the GEMM's dtype (bf16: QuantizeLinear-19 needs ``x`` and ``y_scale`` of one type,
  and DequantizeLinear's output type is its scale's type, so the MatMul sees bf16 operands as before). Every
  scale is rounded to bf16 (at most 2^-9 relative change of a weight channel's scale).
- Everything else is the bf16 graph exactly as the plain bf16 export writes it (same ops, casts, names,
  symbolic ``batch`` axis, output names).

Opset: **19**, the lowest with float8 types. QuantizeLinear/DequantizeLinear-19 already take per-axis (1-D)
scales for float8 (opset 21 only adds blocked quantization and int4): checked with ``onnx.checker``
(``full_check``) and onnxruntime 1.32 for per-tensor and per-axis float8 Q/DQ at opsets 19, 20 and 21.

Validation: onnxruntime's CPU provider has no bf16 QuantizeLinear/MatMul kernels (``NOT_IMPLEMENTED``), so
``model.onnx`` itself usually cannot run here. It is then checked with ``onnx.checker`` (full check: strict
shape and type inference), and an *FP32 twin* is validated numerically in its place: the same graph exported
in FP32 with the identical Q/DQ nodes, float8 weights and (bf16-rounded) scales, run by onnxruntime and
compared with the PyTorch FP8 graph (``_scaled_mm``) on fresh inputs at each batch size; it proves the Q/DQ
placement, the weight layout/axis and the scales. The twin is built in a temporary folder and, once it
validates, kept beside the model as ``<name>.fp32.onnx`` (a CPU-runnable copy with the same Q/DQ).
The limit on the relative L2 error is ``max(tolerance, 2 * e)`` with tolerance 5e-2 (tctune's FP8 limit)
and ``e`` the PyTorch FP8 graph's own relative L2 error against the FP32 graph on the same inputs: the two
models quantize activations independently (static per-tensor here, dynamic per-token there), and two
independent FP8 quantizations, each ``e`` away from FP32, differ by about ``sqrt(2) * e`` (seen: a 3-layer
MLP whose FP8 graph is 4.8% off FP32 differs from the ONNX FP8 model by 5.1%). Export bugs (wrong axis,
layout, scale, a dropped op) show up far above that (0.3 to 1).
Where onnxruntime can load ``model.onnx`` itself, that file is validated directly instead. Both run with
onnxruntime's *basic* graph optimizations, because its level-2 fusions (CPU provider) mishandle float8 Q/DQ:
in onnxruntime 1.32 ``ReluQuantFusion`` deletes a ``Relu`` feeding a float8 ``QuantizeLinear``, treating
zero point 0 as the bottom of the range as for uint8, which is wrong for signed float8 (relative L2 error
0.29 instead of 0.01 on a small MLP); in 1.30 the DQ + MatMul fusion into ``MatMulIntegerToFloat`` rejects
float8 and no session is created. Whoever runs these files with onnxruntime on the CPU must lower the
optimization level the same way (``GraphOptimizationLevel.ORT_ENABLE_BASIC``); TensorRT is not affected.
Checked on the H200 (torch 2.11 + CUDA ``_scaled_mm`` as the reference, onnxruntime 1.30): row and tensor
scaling, relative L2 about 0.02 at batch 1, 8 and 64.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import os
import shutil
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import fx
from torch.utils import _pytree as pytree

from passes import run_pipeline
from passes.base import PassFailure, PassResult, PassSpec
from passes.cast_fp8 import NAME as CAST_FP8, cast_fp8_linears
from passes.fp8_numerics import AMAX_EPS, FP8_DTYPE, FP8_MAX, OUT_DTYPE, quantize_fp8, weight_gemm
from passes.cast_precision import cast_precision
from tctune.errors import ExportError, PassError
from tctune.export.onnx import (
    EXTERNAL_DATA_BYTES,
    _as_tuple,
    _input_names,
    _module_device,
    _one_line,
    _ort_session,
    _to_device,
    ort_load,
    _validate_batch,
    export_onnx,
    publish,
)

#: The opset of FP8 exports: the lowest with float8 QuantizeLinear/DequantizeLinear (per-tensor and per-axis).
FP8_ONNX_OPSET = 19
#: Relative L2 error allowed between the ONNX FP8 model and the PyTorch FP8 graph (tctune's --max-error-fp8).
FP8_ONNX_TOLERANCE = 5e-2
#: What the manifest says about the activation scales.
ACTIVATION_SCALING = ("static per-tensor (max |x| / 448 over the calibration inputs); the PyTorch FP8 graph "
                      "uses dynamic per-token scales")

_CASTS = ("cast_fp8_linears", "cast_precision")


# ------------------------------------------------------------------------------------------------ graphs


@dataclasses.dataclass
class FP8Graphs:
    """The three views of one model at precision fp8 that the FP8 ONNX export needs.

    Attributes:
        fp32: the pipeline's graph at fp8 *before* any cast (FP32, padded to fp8's 16-element alignment).
        bf16: ``fp32`` cast to bf16 by ``cast_precision`` exactly as ``cast_fp8_linears`` casts it, with every
            linear left a bf16 ``aten.linear``: the graph ``model.onnx`` is exported from.
        fp8: ``fp32`` after ``cast_fp8_linears``: what PyTorch runs (``_scaled_mm``); the validation reference,
            identical to ``tctune.trial.apply_passes(gm, hw, "fp8", names)``.
        fp8_weights: weight attribute (e.g. ``"fc1.weight"``) -> ``(fp8 buffer, scale buffer)`` names on ``fp8``;
            empty when no linear is FP8-eligible.
        kn_weights: the weights of ``fp8_weights`` stored ``(K, N)`` (read by ``aten.addmm`` / ``aten.mm``, as
            GPT-2's ``Conv1D``); their FP8 codes are of the transpose, ``(N, K)`` like every other.
        scaling: the weight scale granularity, ``"row"`` (per output channel) or ``"tensor"``.
        results: the pass results of ``fp8`` (pipeline before the casts, then ``cast_fp8_linears``).
    """

    fp32: fx.GraphModule
    bf16: fx.GraphModule
    fp8: fx.GraphModule
    fp8_weights: dict[str, tuple[str, str]]
    scaling: str
    results: list[PassResult]
    kn_weights: frozenset[str] = frozenset()

    @property
    def fp8_result(self) -> PassResult:
        """The ``cast_fp8_linears`` result (``skipped`` lists the linears left in bf16, with the reason)."""
        return next(r for r in self.results if r.name == CAST_FP8)

    def to(self, device: torch.device | str) -> "FP8Graphs":
        """Move the three graphs' parameters and buffers to ``device`` (in place); returns self."""
        for g in (self.fp32, self.bf16, self.fp8):
            g.to(device)
        return self


def build_fp8_graphs(gm: fx.GraphModule, spec: PassSpec, names: Sequence[str]) -> FP8Graphs:
    """Run the pass pipeline ``names`` at fp8 on deep copies of ``gm``, stopping before and after the casts.

    Args:
        gm: the captured ATen graph module (``torch.export(...).module()``), FP32; not modified.
        spec: ``passes.policy.pass_spec(hw, "fp8", policy=...)``: ``precision == "fp8"``, ``fp8_scaling`` row/tensor.
        names: the pipeline (e.g. ``tctune.deploy.EXPORT_PIPELINE``); ``cast_fp8_linears`` and
            ``cast_precision`` must come last (as in ``passes.PIPELINE``).

    Returns:
        :class:`FP8Graphs`.

    Raises:
        ValueError: ``spec.precision`` is not ``"fp8"``, or a pass other than ``cast_precision`` follows
            ``cast_fp8_linears`` in ``names``.
        PassError: a pass failed (the message names it).
    """
    if spec.precision != "fp8":
        raise ValueError(f"build_fp8_graphs needs a precision fp8 PassSpec, got {spec.precision!r}")
    names = tuple(names)
    if CAST_FP8 in names:
        tail = names[names.index(CAST_FP8) + 1:]
        if any(n not in _CASTS for n in tail):
            raise ValueError(f"passes after {CAST_FP8} are not supported for the FP8 ONNX export: {tail}")
    before = tuple(n for n in names if n not in _CASTS)
    with warnings.catch_warnings():  # deepcopy of an exported module warns about pytree internals
        warnings.simplefilter("ignore", FutureWarning)
        g32 = copy.deepcopy(gm)
        try:
            results = run_pipeline(g32, spec, before)
        except PassFailure as exc:
            raise PassError(str(exc)) from exc
        g8, gb = copy.deepcopy(g32), copy.deepcopy(g32)
    try:
        r8 = cast_fp8_linears(g8, spec)
    except Exception as exc:  # noqa: BLE001 - name the pass, as run_pipeline does
        raise PassError(f"pass {CAST_FP8!r} failed: {type(exc).__name__}: {exc}") from exc
    try:
        cast_precision(gb, dataclasses.replace(spec, precision="bf16"))
    except Exception as exc:  # noqa: BLE001
        raise PassError(f"pass 'cast_precision' (bf16, for the FP8 ONNX export) failed: "
                        f"{type(exc).__name__}: {exc}") from exc
    fp8_weights = {k: (v[0], v[1]) for k, v in (r8.notes.get("fp8_weights") or {}).items()}
    return FP8Graphs(fp32=g32, bf16=gb, fp8=g8, fp8_weights=fp8_weights, scaling=spec.fp8_scaling,
                     results=[*results, r8], kn_weights=frozenset(r8.notes.get("fp8_weights_kn") or ()))


# ----------------------------------------------------------------------------------------- calibration


def calibrate_activation_amax(
    graph: fx.GraphModule, weights: Sequence[str], calibration: Sequence[Sequence[torch.Tensor]]
) -> dict[str, float]:
    """Max |input| of every weight GEMM (``aten.linear``, or ``aten.addmm`` / ``aten.mm`` with a ``get_attr``
    weight: ``passes.fp8_numerics.weight_gemm``) whose weight is one of ``weights``, over ``calibration``.

    Runs ``graph`` with an ``fx.Interpreter`` (no grad) and reads each linear's activation before the
    linear runs.

    Args:
        graph: an ATen graph module whose linears read their weight through ``get_attr`` (the bf16 graph).
        weights: weight attribute names (``"fc1.weight"``).
        calibration: input tuples, each as the graph takes them (batch on dim 0, on the graph's device).

    Returns:
        Weight name -> max |x| as a Python float (activation units; the max over every linear using that
        weight and every calibration input). A weight whose linear never ran is absent.

    Raises:
        ExportError: the graph fails on a calibration input, or an activation is not finite.
    """
    wanted = set(weights)
    amax: dict[str, float] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            gemm = weight_gemm(n)
            if gemm is not None:
                w = gemm.weight
                if isinstance(w, fx.Node) and w.op == "get_attr" and w.target in wanted:
                    x = self.env[gemm.x] if isinstance(gemm.x, fx.Node) else None
                    if isinstance(x, torch.Tensor):
                        value = float(x.detach().abs().amax().float()) if x.numel() else 0.0
                        amax[w.target] = max(amax.get(w.target, 0.0), value)
            return super().run_node(n)

    for i, inputs in enumerate(calibration):
        try:
            with torch.no_grad():
                _Recorder(graph).run(*_as_tuple(inputs))
        except Exception as exc:  # noqa: BLE001 - nothing to calibrate on
            raise ExportError(f"FP8 calibration: the bf16 graph fails on calibration input {i}: "
                              f"{_one_line(exc)}") from exc
    bad = sorted(k for k, v in amax.items() if not math.isfinite(v))
    if bad:
        raise ExportError(f"FP8 calibration: the input of the linear(s) using {bad} is not finite on the "
                          "calibration inputs; no static FP8 scale exists")
    return amax


# ------------------------------------------------------------------------------------------ ONNX rewrite


@dataclasses.dataclass
class FP8Linear:
    """One FP8 weight to rewrite in an ONNX graph.

    Attributes:
        name: the weight attribute (``"fc1.weight"``).
        exported: the weight exactly as the exported graph stores it, ``(N, K)`` (bf16 for ``model.onnx``,
            FP32 for the twin); used to find its initializer by value (``W`` or ``W.T``).
        weight: the FP32 weight ``(N, K)``, quantized here when ``codes`` is None.
        scaling: ``"row"`` (one scale per output channel) or ``"tensor"``.
        activation_amax: calibrated max |x| of the linear's input.
        codes: the float8_e4m3fn weight ``(N, K)`` that ``cast_fp8_linears`` stored (``<weight>_fp8``), or None.
        codes_scale: its FP32 scale (``(1, N)`` row, 0-dim tensor), required with ``codes``.
    """

    name: str
    exported: torch.Tensor
    weight: torch.Tensor
    scaling: str
    activation_amax: float
    codes: torch.Tensor | None = None
    codes_scale: torch.Tensor | None = None


def insert_fp8_qdq(model: Any, linears: Sequence[FP8Linear], *, round_scales_to: torch.dtype = OUT_DTYPE
                   ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Rewrite the MatMul/Gemm of each linear in ``linears`` into float8 Q/DQ form, in place.

    For each linear: find the initializer holding ``W`` ``(N, K)`` or ``W.T`` ``(K, N)`` (by value: the
    exporter renames and pre-transposes weights), then for every ``MatMul`` reading it as input B, every
    ``Gemm`` reading it as B with the matching ``transB``, and every ``Transpose(perm=[1, 0])`` feeding such a
    GEMM: the GEMM's input A gets ``QuantizeLinear -> DequantizeLinear`` (static per-tensor scale), and the
    weight becomes a float8e4m3fn initializer of the same layout read through one ``DequantizeLinear``
    (``axis`` 1 for ``(K, N)``, 0 for ``(N, K)``; no axis for per-tensor). The original initializer is
    removed unless another node still reads it. Scales get the GEMM weight's dtype after rounding to
    ``round_scales_to``. The float8 weight is ``linear.codes`` when given (the PyTorch FP8 graph's own codes,
    so both quantize the weight identically; the scale differs from the graph's by the bf16 rounding, at
    most 2^-9 relative per channel), else ``clamp(W / s_w, -448, 448)`` with the rounded ``s_w``.

    Args:
        model: an ``onnx.ModelProto`` at opset >= 19 with its weights loaded (not external references).
        linears: the FP8 weights.
        round_scales_to: every scale is rounded to this dtype first (bf16: the twin then matches
            ``model.onnx`` bit for bit in its FP8 parts).

    Returns:
        ``(quantized, missed)``: one dict per rewritten weight (``weight``, ``onnx_initializer``,
        ``layout`` ``"(K, N)"``/``"(N, K)"``, ``axis`` (int or None), ``weight_scaling``, ``gemms`` (count),
        ``activation_amax``, ``activation_scale``); ``missed`` maps weights left as they were to the reason.

    Raises:
        ValueError: the model's default-domain opset is below 19.
    """
    from onnx import TensorProto, helper

    opset = next((int(e.version) for e in model.opset_import if e.domain in ("", "ai.onnx")), 0)
    if opset < FP8_ONNX_OPSET:
        raise ValueError(f"float8 QuantizeLinear/DequantizeLinear need opset >= {FP8_ONNX_OPSET}, the model has {opset}")
    graph = model.graph
    nodes = list(graph.node)  # referenced by position: protobuf wrapper identity is not stable everywhere
    consumers: dict[str, list[tuple[int, int]]] = defaultdict(list)  # tensor -> [(node position, input index)]
    for pos, node in enumerate(nodes):
        for idx, name in enumerate(node.input):
            consumers[name].append((pos, idx))
    taken = ({i.name for i in graph.initializer} | {v.name for v in graph.input} | {v.name for v in graph.output}
             | {o for n in graph.node for o in n.output} | {v.name for v in graph.value_info})
    node_names = {n.name for n in graph.node if n.name}

    def fresh(base: str, pool: set[str]) -> str:
        name, k = base, 1
        while name in pool:
            name, k = f"{base}_{k}", k + 1
        pool.add(name)
        return name

    # Index: (dtype, dims, sha1 of bytes) -> [(linear, layout)].
    wanted: dict[tuple, list[tuple[FP8Linear, str]]] = defaultdict(list)
    for lin in linears:
        w = lin.exported.detach().cpu().contiguous()
        dtype = _ONNX_DTYPE.get(w.dtype)
        if dtype is None or w.dim() != 2:
            continue
        for layout, t in (("NK", w), ("KN", w.t().contiguous())):
            wanted[(dtype, tuple(t.shape), _digest(_tensor_bytes(t)))].append((lin, layout))
    shapes = {(k[0], k[1]) for k in wanted}
    found: dict[str, list[tuple[Any, str]]] = defaultdict(list)  # linear name -> [(initializer, layout)]
    for init in graph.initializer:
        if (init.data_type, tuple(init.dims)) not in shapes:
            continue
        for lin, layout in wanted.get((init.data_type, tuple(init.dims), _digest(_init_bytes(init))), []):
            found[lin.name].append((init, layout))

    zero_point = None
    head: list[Any] = []  # weight DequantizeLinear nodes (constant inputs): first in the node list
    before: dict[int, list[Any]] = defaultdict(list)  # GEMM node position -> its activation Q/DQ nodes
    quantized: list[dict[str, Any]] = []
    missed: dict[str, str] = {}
    removed: set[str] = set()
    done: set[str] = set()  # initializers already rewritten (two linears with identical weights share one)
    for lin in linears:
        if not found.get(lin.name):
            missed[lin.name] = "no ONNX initializer holds this weight (or its transpose)"
            continue
        rewired_any = False
        for init, layout in found[lin.name]:
            if init.name in done:
                rewired_any = True
                continue
            uses, gemms, other = _gemm_uses(init.name, layout, consumers, nodes)
            if not gemms:
                continue
            rewired_any = True
            done.add(init.name)
            if zero_point is None:
                zero_point = fresh("fp8_zero_point", taken)
                graph.initializer.append(helper.make_tensor(zero_point, TensorProto.FLOAT8E4M3FN, [], b"\x00", raw=True))
            n = lin.weight.shape[0]
            scale_dtype = _TORCH_DTYPE[init.data_type]
            if lin.codes is not None:
                q = lin.codes.detach().cpu().contiguous()
                sw = lin.codes_scale.detach().float().cpu().reshape(-1 if lin.scaling == "row" else ())
                sw = sw.to(round_scales_to).float()
            else:
                w32 = lin.weight.detach().float().cpu()
                if lin.scaling == "row":
                    sw = (w32.abs().amax(dim=1).clamp_min(AMAX_EPS) / FP8_MAX).to(round_scales_to).float()
                    q, _ = quantize_fp8(w32, sw.reshape(n, 1))
                else:
                    sw = (w32.abs().amax().clamp_min(AMAX_EPS) / FP8_MAX).to(round_scales_to).float()
                    q, _ = quantize_fp8(w32, sw)
            if layout == "KN":
                q = q.t().contiguous()
            axis = (0 if layout == "NK" else 1) if lin.scaling == "row" else None
            sx = torch.tensor(max(lin.activation_amax, AMAX_EPS) / FP8_MAX).to(round_scales_to).float()

            w8 = fresh(f"{init.name}_fp8", taken)
            w_scale = fresh(f"{init.name}_fp8_scale", taken)
            x_scale = fresh(f"{init.name}_input_scale", taken)
            w_dq = fresh(f"{init.name}_dequantized", taken)
            graph.initializer.extend([_make_init(w8, q), _make_init(w_scale, sw.to(scale_dtype)),
                                      _make_init(x_scale, sx.to(scale_dtype))])
            attrs = {"axis": axis} if axis is not None else {}
            head.append(helper.make_node("DequantizeLinear", [w8, w_scale], [w_dq],
                                         name=fresh(f"{init.name}_DequantizeLinear", node_names), **attrs))
            for pos, idx in uses:
                nodes[pos].input[idx] = w_dq
            for pos in gemms:
                gemm = nodes[pos]
                a = gemm.input[0]
                aq, adq = fresh(f"{a}_fp8", taken), fresh(f"{a}_fp8_dequantized", taken)
                label = gemm.name or a
                before[pos] += [
                    helper.make_node("QuantizeLinear", [a, x_scale, zero_point], [aq], saturate=1,
                                     name=fresh(f"{label}_input_QuantizeLinear", node_names)),
                    helper.make_node("DequantizeLinear", [aq, x_scale, zero_point], [adq],
                                     name=fresh(f"{label}_input_DequantizeLinear", node_names)),
                ]
                gemm.input[0] = adq
            if not other:
                removed.add(init.name)
            quantized.append({
                "weight": lin.name, "onnx_initializer": init.name,
                "layout": "(N, K)" if layout == "NK" else "(K, N)", "axis": axis,
                "weight_scaling": "per output channel" if lin.scaling == "row" else "per tensor",
                "gemms": len(gemms), "activation_amax": lin.activation_amax, "activation_scale": float(sx),
            })
        if not rewired_any:
            missed[lin.name] = "its ONNX initializer feeds no MatMul/Gemm as the weight operand"

    if removed:
        kept = [i for i in graph.initializer if i.name not in removed]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        kept_vi = [v for v in graph.value_info if v.name not in removed]
        del graph.value_info[:]
        graph.value_info.extend(kept_vi)
    if head or before:
        ordered = list(head)
        for pos, node in enumerate(nodes):
            ordered += before.get(pos, [])
            ordered.append(node)
        new_nodes = [copy.deepcopy(n) for n in ordered]
        del graph.node[:]
        graph.node.extend(new_nodes)
    return quantized, missed


def _gemm_uses(name: str, layout: str, consumers: dict, nodes: list) -> tuple[list, list, int]:
    """The (node position, input index) pairs to rewire, the GEMM positions reached, and other reads of ``name``."""
    uses, gemms, other = [], [], 0
    for pos, idx in consumers.get(name, []):
        node = nodes[pos]
        if _is_weight_gemm(node, idx, layout):
            uses.append((pos, idx))
            gemms.append(pos)
            continue
        if node.op_type == "Transpose" and idx == 0 and _attr(node, "perm", [1, 0]) in ([1, 0], (1, 0)):
            flipped = "KN" if layout == "NK" else "NK"
            after = consumers.get(node.output[0], [])
            if after and all(_is_weight_gemm(nodes[p], i, flipped) for p, i in after):
                uses.append((pos, idx))
                gemms += [p for p, _ in after]
                continue
        other += 1
    return uses, gemms, other


def _is_weight_gemm(node: Any, idx: int, layout: str) -> bool:
    """Whether ``node`` reads its input ``idx`` as a linear's weight stored in ``layout``."""
    if idx != 1:
        return False
    if node.op_type == "MatMul":
        return layout == "KN"
    if node.op_type == "Gemm" and not _attr(node, "transA", 0):
        return bool(_attr(node, "transB", 0)) == (layout == "NK")
    return False


def _attr(node: Any, name: str, default: Any) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return list(value) if isinstance(value, (list, tuple)) else value
    return default


def _digest(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """Little-endian raw bytes of ``t`` as ONNX stores them."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype == FP8_DTYPE:
        t = t.view(torch.uint8)
    return t.numpy().tobytes()


def _init_bytes(init: Any) -> bytes:
    from onnx import numpy_helper

    if init.raw_data:
        return bytes(init.raw_data)
    return numpy_helper.to_array(init).tobytes()


def _make_init(name: str, t: torch.Tensor) -> Any:
    from onnx import helper

    return helper.make_tensor(name, _ONNX_DTYPE[t.dtype], list(t.shape), _tensor_bytes(t), raw=True)


def _dtype_tables() -> tuple[dict, dict]:
    from onnx import TensorProto

    to_onnx = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
               torch.bfloat16: TensorProto.BFLOAT16, FP8_DTYPE: TensorProto.FLOAT8E4M3FN}
    return to_onnx, {v: k for k, v in to_onnx.items() if k != FP8_DTYPE}


_ONNX_DTYPE, _TORCH_DTYPE = _dtype_tables()


# -------------------------------------------------------------------------------------------- export


def export_onnx_fp8(
    graphs: FP8Graphs,
    make_inputs: Callable[[int], Sequence[torch.Tensor] | torch.Tensor],
    path: str | os.PathLike,
    *,
    batch_sizes: Sequence[int] = (2, 3),
    calibration: Sequence[Sequence[torch.Tensor]] | None = None,
    opset: int = FP8_ONNX_OPSET,
    tolerance: float = FP8_ONNX_TOLERANCE,
) -> dict[str, Any]:
    """Export the FP8 configuration of a model to ONNX with float8 Q/DQ around every FP8 linear.

    ``graphs.bf16`` is exported by :func:`tctune.export.onnx.export_onnx` (symbolic batch axis, atomic write,
    ``onnx.checker``), then every linear in ``graphs.fp8_weights`` is rewritten by :func:`insert_fp8_qdq`
    (module docstring: node pattern, scales, opset) and the file is replaced atomically after
    ``onnx.checker.check_model(full_check=True)`` (strict shape and type inference) accepts it. Without any
    FP8 linear the result is the plain bf16 export (exporter's default opset) with an ``onnx_note`` saying so.

    Validation (never raises; problems go to ``onnx_error``): onnxruntime (CPU) runs ``model.onnx`` if it can
    load it, else the FP32 twin (module docstring), on fresh ``make_inputs(b)`` for each ``b`` in
    ``batch_sizes``, compared with ``graphs.fp8`` run by PyTorch on the graphs' device (``graphs.bf16`` where
    this torch cannot run ``_scaled_mm``: ``onnx_fp8["reference"]`` says which). A batch whose relative L2
    error exceeds ``max(tolerance, 2 * the FP8 graph's own error vs FP32)`` (module docstring; just
    ``tolerance`` against the bf16 graph) is an error.

    Args:
        graphs: from :func:`build_fp8_graphs`, on the device to export and validate on.
        make_inputs: ``make_inputs(batch_size)`` returns fresh random inputs, batch on dim 0 (e.g.
            ``(batch, seq, 64)`` float32).
        path: the ``.onnx`` file to write (``<path>.data`` beside it when the weights exceed 1 GiB).
        batch_sizes: one or more positive batch sizes to validate at (e.g. ``(1, tuned, largest)``); the
            export example is the first that is >= 2, else 2. Sized to host memory by the caller
            (``tctune.export.onnx.plan_validation``).
        calibration: input tuples for the static activation scales (on the graphs' device); ``None``: one
            ``make_inputs(b)`` per distinct ``b`` in ``batch_sizes``.
        opset: >= 19 (default 19, see the module docstring).
        tolerance: the floor of the relative L2 limit vs the PyTorch FP8 graph (default 5e-2, tctune's FP8
            limit); see above.

    Returns:
        :func:`export_onnx`'s dict (``onnx``, ``onnx_opset``, ``onnx_inputs``, ``onnx_outputs``,
        ``onnx_dynamic``, ``onnx_export_s`` (seconds, everything), ``onnx_warnings``, ``onnx_validation`` (list
        of ``{batch_size, max_abs_error, rel_l2_error, allowed_rel_l2}``, ``reference_rel_l2_vs_fp32`` (the
        FP8 graph's own error) where measured, ``error`` where it failed), ``onnx_max_abs_error`` (output
        units), ``onnx_error``), plus ``onnx_max_rel_l2_error`` (float or None), ``onnx_note`` (str: what the file is
        and how it was validated) and ``onnx_fp8``: ``{quantized (list of insert_fp8_qdq dicts), skipped
        ({linear node: reason} from cast_fp8_linears), missed ({weight: reason}), qdq_nodes ({"QuantizeLinear":
        n, "DequantizeLinear": m}), activation_scaling (str), weight_scaling ("row"/"tensor"), opset,
        validated_on ("model", "fp32 twin" or None: onnxruntime is not installed, ``onnx_validation_skipped`` then
        says so, as :func:`export_onnx`'s does, and the validation list holds one ``skipped`` entry), reference ("pytorch fp8 graph" / "pytorch bf16 graph"),
        tolerance, calibration_batches (int)}``.

    Raises:
        ExportError: the export failed or ``onnx.checker`` rejected the file (nothing written to ``path``
            then), or the calibration failed.
        ValueError: ``opset < 19`` or ``batch_sizes`` empty / not positive ints.
    """
    import onnx

    path = Path(path)
    sizes = tuple(dict.fromkeys(int(b) for b in batch_sizes))
    if not sizes or any(b < 1 for b in sizes):
        raise ValueError(f"batch_sizes must be positive ints, got {batch_sizes!r}")
    if opset < FP8_ONNX_OPSET:
        raise ValueError(f"FP8 Q/DQ needs ONNX opset >= {FP8_ONNX_OPSET} (float8 types), got {opset}")
    export_pair = _export_pair(sizes)
    skipped = {s.node: s.reason for s in graphs.fp8_result.skipped}
    fp8_info: dict[str, Any] = {
        "quantized": [], "skipped": skipped, "missed": {}, "qdq_nodes": {"QuantizeLinear": 0, "DequantizeLinear": 0},
        "activation_scaling": ACTIVATION_SCALING, "weight_scaling": graphs.scaling, "opset": None,
        "validated_on": None, "reference": None, "tolerance": tolerance, "calibration_batches": 0,
    }
    started = time.perf_counter()

    if not graphs.fp8_weights:
        info = export_onnx(graphs.bf16, make_inputs, path, batch_sizes=export_pair)
        fp8_info["opset"] = info["onnx_opset"]
        why = "; ".join(f"{k}: {v}" for k, v in list(skipped.items())[:5]) or "the model has no linear layer"
        info["onnx_note"] = ("no linear is FP8-eligible (" + why + "), so model.onnx is the plain bf16 export "
                             "without Q/DQ nodes")
        info["onnx_fp8"] = fp8_info
        info["onnx_max_rel_l2_error"] = _max_of(info["onnx_validation"], "rel_l2_error")
        return info

    device = _module_device(graphs.bf16)
    if calibration is None:
        calibration = [_to_device(_as_tuple(make_inputs(b)), device) for b in sizes]
    calibration = [_to_device(_as_tuple(c), device) for c in calibration]
    fp8_info["calibration_batches"] = len(calibration)
    amax = calibrate_activation_amax(graphs.bf16, list(graphs.fp8_weights), calibration)

    uncalibrated = {name: "its linear never ran on the calibration inputs: no activation scale"
                    for name in graphs.fp8_weights if name not in amax}

    def linears(exported_graph: fx.GraphModule) -> list[FP8Linear]:
        out = []
        for name, (codes_name, scale_name) in graphs.fp8_weights.items():
            if name in uncalibrated:
                continue
            scale = _get(graphs.fp8, scale_name)
            exported, weight = _get(exported_graph, name), _get(graphs.fp32, name)
            if name in graphs.kn_weights:  # FP8Linear takes (N, K), as the codes are
                exported, weight = exported.t(), weight.t()
            out.append(FP8Linear(name=name, exported=exported, weight=weight,
                                 scaling="tensor" if scale.dim() == 0 else "row",
                                 activation_amax=amax[name], codes=_get(graphs.fp8, codes_name),
                                 codes_scale=scale))
        return out

    info = export_onnx(graphs.bf16, make_inputs, path, batch_sizes=export_pair, opset=opset, validate=False)
    model = onnx.load(str(path))  # external data (if any) loaded into the protos
    external = (path.parent / (path.name + ".data")).exists()
    try:
        quantized, missed = insert_fp8_qdq(model, linears(graphs.bf16))
    except ValueError as exc:
        raise ExportError(f"FP8 Q/DQ rewrite of {path.name} failed: {exc}") from exc
    _save_checked(model, path, external)
    del model
    fp8_info.update(quantized=quantized, missed={**uncalibrated, **missed}, opset=info["onnx_opset"],
                    qdq_nodes=count_qdq(path))

    problems = [info["onnx_error"]] if info.get("onnx_error") else []
    reference, ref_name, ref_problem = _reference(graphs, make_inputs, sizes[0])
    fp8_info["reference"] = ref_name
    names = _input_names(graphs.bf16, len(_as_tuple(make_inputs(export_pair[0]))))
    load = ort_load(path, basic_optimizations=True)
    session, main_reason = load["session"], load["reason"]
    check = (graphs.fp32, tolerance) if reference is graphs.fp8 else (None, tolerance)
    if session is not None:
        fp8_info["validated_on"] = "model"
        entries = [_validate_fp8_batch(reference, make_inputs, b, device, names, session, *check) for b in sizes]
    elif load["status"] == "skipped":  # onnxruntime is not installed: checked, not run, as export_onnx does
        del session
        entries = [{"batch_size": None, "max_abs_error": None, "rel_l2_error": None, "skipped": main_reason}]
        info["onnx_validation_skipped"] = main_reason
    else:
        del session
        entries, twin_problem = _validate_twin(graphs, make_inputs, path, export_pair, sizes, opset, reference,
                                               names, linears, check)
        if twin_problem:
            problems.append(f"model.onnx not run by onnxruntime ({main_reason}); FP32 twin: {twin_problem}")
        else:
            fp8_info["validated_on"] = "fp32 twin"
            kept = path.with_name(path.stem + ".fp32.onnx")
            if kept.exists():
                info["onnx_fp32"] = str(kept)
    problems += [e["error"] for e in entries if "error" in e]

    info["onnx_validation"] = entries
    info["onnx_max_abs_error"] = _max_of(entries, "max_abs_error")
    info["onnx_max_rel_l2_error"] = _max_of(entries, "rel_l2_error")
    info["onnx_error"] = "; ".join(dict.fromkeys(problems)) if problems else None
    info["onnx_export_s"] = round(time.perf_counter() - started, 3)
    info["onnx_fp8"] = fp8_info
    info["onnx_note"] = _note(fp8_info, main_reason, ref_problem)
    if info.get("onnx_validation_skipped"):
        info["onnx_note"] += f" ({info['onnx_validation_skipped']})"
    return info


def count_qdq(path: str | os.PathLike) -> dict[str, int]:
    """``{"QuantizeLinear": n, "DequantizeLinear": m}`` in the main graph of the ONNX file ``path``."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    ops = [n.op_type for n in proto.graph.node]
    return {op: ops.count(op) for op in ("QuantizeLinear", "DequantizeLinear")}


def _export_pair(sizes: tuple[int, ...]) -> tuple[int, int]:
    """Two batch sizes for export_onnx (it takes exactly two; the first >= 2 is the export example)."""
    first = next((b for b in sizes if b >= 2), 2)
    second = next((b for b in sizes if b != first), first + 1)
    return first, second


def _get(gm: fx.GraphModule, target: str) -> torch.Tensor:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _max_of(entries: list[dict], key: str) -> float | None:
    values = [e[key] for e in entries if e.get(key) is not None]
    return max(values) if values else None


def _reference(graphs: FP8Graphs, make_inputs: Callable, batch: int) -> tuple[torch.nn.Module, str, str | None]:
    """The PyTorch FP8 graph when it runs here, else the bf16 graph (with the reason)."""
    device = _module_device(graphs.fp8)
    try:
        with torch.no_grad():
            graphs.fp8(*_to_device(_as_tuple(make_inputs(batch)), device))
        return graphs.fp8, "pytorch fp8 graph", None
    except Exception as exc:  # noqa: BLE001 - e.g. no _scaled_mm kernel for this device
        return graphs.bf16, "pytorch bf16 graph", (f"the PyTorch FP8 graph cannot run on {device} "
                                                   f"({_one_line(exc, 160)}); compared with the bf16 graph")


def _validate_fp8_batch(reference: torch.nn.Module, make_inputs: Callable, batch: int, device: torch.device,
                       names: list[str], session: Any, fp32: torch.nn.Module | None, tolerance: float
                       ) -> dict[str, Any]:
    """``_validate_batch`` on one fresh input draw, plus the FP8 tolerance check (module docstring).

    With ``fp32`` (the reference is the PyTorch FP8 graph), the same inputs also run through the FP32
    graph: ``reference_rel_l2_vs_fp32`` is the FP8 graph's own quantization error, and the limit is
    ``max(tolerance, 2 * that)``: the ONNX model quantizes activations independently (static per-tensor
    scales, not dynamic per-token), and two independent FP8 quantizations with errors ``e`` differ by about
    ``sqrt(2) * e``. Without ``fp32`` the limit is ``tolerance``.
    """
    inputs = _as_tuple(make_inputs(batch))
    entry = _validate_batch(reference, lambda _b: inputs, batch, device, names, session)
    allowed = tolerance
    if fp32 is not None and "error" not in entry:
        try:
            with torch.no_grad():
                ref = [t.detach().float().cpu() for t in pytree.tree_leaves(
                    reference(*_to_device(inputs, device)))]
                f32 = [t.detach().float().cpu() for t in pytree.tree_leaves(
                    fp32(*_to_device(inputs, _module_device(fp32))))]
            num = math.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(ref, f32)))
            den = math.sqrt(sum(float((b ** 2).sum()) for b in f32))
            own = num / max(den, 1e-30)
            entry["reference_rel_l2_vs_fp32"] = own
            if math.isfinite(own):
                allowed = max(tolerance, 2.0 * own)
        except Exception:  # noqa: BLE001 - only widens the limit; the plain tolerance still applies
            pass
    entry["allowed_rel_l2"] = allowed
    rel = entry.get("rel_l2_error")
    if "error" not in entry and rel is not None and rel > allowed:
        entry["error"] = (f"batch {batch}: relative L2 error {rel:.3g} against the PyTorch graph exceeds the FP8 "
                          f"limit {allowed:.3g} (tolerance {tolerance:g}, or twice the FP8 graph's own error)")
    return entry


def _validate_twin(graphs: FP8Graphs, make_inputs: Callable, path: Path, export_pair: tuple[int, int],
                   sizes: tuple[int, ...], opset: int, reference: torch.nn.Module, names: list[str],
                   linears: Callable, check: tuple) -> tuple[list[dict], str | None]:
    """Export the FP32 graph with the same Q/DQ into a temporary folder and validate it with onnxruntime."""
    import onnx

    tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.twin.", dir=path.parent))
    try:
        twin = tmpdir / "twin.onnx"
        try:
            export_onnx(graphs.fp32, make_inputs, twin, batch_sizes=export_pair, opset=opset, validate=False)
            model = onnx.load(str(twin))
            _, missed = insert_fp8_qdq(model, linears(graphs.fp32))
            _save_checked(model, twin, (tmpdir / "twin.onnx.data").exists())
            del model
        except Exception as exc:  # noqa: BLE001 - the twin only validates; never lose model.onnx over it
            return [], f"could not be built ({_one_line(exc, 200)})"
        if missed:
            return [], f"weights {sorted(missed)} could not be located in it"
        session, reason = _ort_session(twin, basic_optimizations=True)
        if session is None:
            return [], reason
        device = _module_device(reference)
        entries = [_validate_fp8_batch(reference, make_inputs, b, device, names, session, *check) for b in sizes]
        del session
        if not any("error" in e for e in entries) and not (tmpdir / "twin.onnx.data").exists():
            # Keep it beside model.onnx: the same Q/DQ graph in FP32, which onnxruntime's CPU provider runs.
            os.replace(twin, path.with_name(path.stem + ".fp32.onnx"))
        return entries, None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _save_checked(model: Any, path: Path, external: bool) -> None:
    """Write ``model`` to ``path`` atomically after ``onnx.checker`` (full check) accepts it."""
    import onnx

    # Weight bytes, not model.ByteSize(): protobuf cannot serialize (or size) a message above 2 GiB.
    external = external or sum(len(i.raw_data) for i in model.graph.initializer) > EXTERNAL_DATA_BYTES
    tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        tmp = tmpdir / path.name
        onnx.save_model(model, str(tmp), save_as_external_data=external, all_tensors_to_one_file=True,
                        location=path.name + ".data", size_threshold=1024)
        try:
            onnx.checker.check_model(str(tmp), full_check=True)
        except Exception as exc:  # noqa: BLE001 - onnx raises ValidationError / InferenceError
            raise ExportError(f"onnx.checker rejected the FP8 Q/DQ model {path.name}: {_one_line(exc)}") from exc
        publish(tmpdir, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _note(fp8: dict, main_reason: str, ref_problem: str | None) -> str:
    count = len(fp8["quantized"])
    q, dq = fp8["qdq_nodes"]["QuantizeLinear"], fp8["qdq_nodes"]["DequantizeLinear"]
    text = (f"FP8 Q/DQ ONNX (opset {fp8['opset']}): {count} linear weight(s) as float8e4m3fn initializers "
            f"({q} QuantizeLinear, {dq} DequantizeLinear), everything else bf16; activation scales are static "
            "per-tensor from calibration (max |x| / 448), while the PyTorch FP8 graph uses dynamic per-token "
            f"scales; weight scales {'per output channel' if fp8['weight_scaling'] == 'row' else 'per tensor'}")
    if fp8["skipped"]:
        text += f"; {len(fp8['skipped'])} linear(s) not FP8-eligible stay bf16"
    if fp8["missed"]:
        text += f"; {len(fp8['missed'])} FP8 weight(s) stay bf16 in the ONNX (onnx_fp8.missed says why)"
    if fp8["validated_on"] == "model":
        text += f"; validated with onnxruntime against the {fp8['reference']}"
    elif fp8["validated_on"] == "fp32 twin":
        why = main_reason.split(": ", 1)[-1].strip()
        why = why if len(why) <= 160 else why[:157].rstrip() + "..."
        text += ("; onnxruntime cannot run model.onnx on the CPU (" + why
                 + "), so it was checked with onnx.checker (full shape/type inference) and an FP32 twin with "
                 f"identical Q/DQ, float8 weights and scales was validated against the {fp8['reference']}"
                 " (kept as model.fp32.onnx, which runs on the CPU)")
    else:
        text += "; checked with onnx.checker (full shape/type inference) only, not run by onnxruntime"
    if ref_problem:
        text += f" ({ref_problem})"
    return text


__all__ = [
    "ACTIVATION_SCALING",
    "FP8Graphs",
    "FP8Linear",
    "FP8_ONNX_OPSET",
    "FP8_ONNX_TOLERANCE",
    "build_fp8_graphs",
    "calibrate_activation_amax",
    "count_qdq",
    "export_onnx_fp8",
    "insert_fp8_qdq",
]
