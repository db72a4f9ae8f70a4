"""FP8 numerics shared by the FP8 pass, the FP8 keep-list planner and the FP8 ONNX export.

One home for what "FP8" means in tctune, so that ``passes.cast_fp8`` (the graph rewrite),
``tctune.fp8_plan`` (which linears stay bf16) and ``tctune.export.onnx_fp8`` (Q/DQ export) agree by
construction:

- **E4M3 limits**: ``FP8_DTYPE`` (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, no infinity),
  ``FP8_MAX`` (448.0, its largest finite value, from ``torch.finfo``), ``AMAX_EPS`` (the smallest amax a
  scale uses), ``FP8_MULTIPLE`` (K and N of an FP8 GEMM must be multiples of 16: cuBLASLt's requirement,
  ``"Expected trailing dimension of mat1 to be divisible by 16"``) and ``OUT_DTYPE`` (bf16, the FP8 GEMM's
  output and bias dtype).
- **Quantization**: ``fp8_scale`` / ``quantize_fp8`` / ``dequantize_fp8`` (saturating: values are clamped
  to +-448 before the cast, so nothing becomes NaN), ``fp8_linear_reference`` (the FP8 linear's math in
  plain torch) and ``scaled_mm_works`` (whether ``torch._scaled_mm`` runs on a device).
- **GEMM recognisers**: ``weight_gemm`` (which ``aten.linear`` / ``addmm`` / ``mm`` nodes are GEMMs with a
  weight operand, as :class:`WeightGemm`), ``gemm_nk`` and ``weight_ineligible`` (why a weight cannot be
  an FP8 GEMM operand).

Imports torch only.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Iterable

import torch
from torch import fx

from passes._graph import get_attr_value, node_arg
from passes.calibrate import source_module

#: The FP8 storage dtype (4 exponent bits, 3 mantissa bits, no infinity) and its largest finite value.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
#: Smallest amax used for a scale, so that an all-zero row / tensor does not divide by zero.
AMAX_EPS = 1e-12
#: K and N of an FP8 GEMM must be multiples of this (cuBLASLt; 16 bytes of float8).
FP8_MULTIPLE = 16
#: The dtype of every FP8 GEMM's output (and of its bias).
OUT_DTYPE = torch.bfloat16

_LINEAR = torch.ops.aten.linear.default
_ADDMM = torch.ops.aten.addmm.default
_MM = torch.ops.aten.mm.default


# ------------------------------------------------------------------------------------------ quantization


def fp8_scale(t: torch.Tensor, scaling: str = "row") -> torch.Tensor:
    """The FP32 scale that maps ``t``'s amax to ``FP8_MAX``.

    Args:
        t: a floating tensor; ``"row"`` scales its last dimension's rows (one per leading index).
        scaling: ``"row"``: shape ``t.shape[:-1] + (1,)``; ``"tensor"``: a 0-dim scalar.
    """
    mag = t.detach().abs().float()
    amax = mag.amax(dim=-1, keepdim=True) if scaling == "row" else mag.amax()
    return amax.clamp_min(AMAX_EPS) / FP8_MAX


def quantize_fp8(
    t: torch.Tensor, scale: torch.Tensor | None = None, scaling: str = "row"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``t`` to float8_e4m3fn: ``clamp(t / scale, -448, 448)``, cast. Saturates, never NaN.

    Args:
        t: floating tensor.
        scale: FP32 scale broadcastable to ``t`` (default: ``fp8_scale(t, scaling)``).
        scaling: ``"row"`` or ``"tensor"`` when ``scale`` is computed here.

    Returns:
        ``(q, scale)`` with ``q.float() * scale ~= t``.
    """
    if scale is None:
        scale = fp8_scale(t, scaling)
    q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q.float() * scale`` (FP32)."""
    return q.float() * scale


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, scaling: str = "row"
) -> torch.Tensor:
    """The rewritten linear's math in plain torch (dequantize, FP32 matmul), output bf16.

    A reference for the graph this pass writes: it needs no ``_scaled_mm`` kernel, so it runs anywhere.
    """
    k, n = weight.shape[1], weight.shape[0]
    x2d = x.to(OUT_DTYPE).reshape(-1, k)
    xq, sx = quantize_fp8(x2d, scaling=scaling)
    wq, sw = quantize_fp8(weight, scaling=scaling)  # row: (N, 1), one scale per output channel
    y = dequantize_fp8(xq, sx) @ dequantize_fp8(wq, sw).t()
    if bias is not None:
        y = y + bias.to(OUT_DTYPE).float()
    return y.to(OUT_DTYPE).reshape(*x.shape[:-1], n)


def scaled_mm_works(device: str | torch.device = "cpu", scaling: str = "row") -> bool:
    """Whether ``torch._scaled_mm`` runs on ``device`` with float8_e4m3fn operands and ``scaling`` scales."""
    try:
        a = torch.ones(16, 16, device=device).to(FP8_DTYPE)
        b = torch.ones(16, 16, device=device).to(FP8_DTYPE)
        if scaling == "row":
            sa, sb = torch.ones(16, 1, device=device), torch.ones(1, 16, device=device)
        else:
            sa, sb = torch.ones((), device=device), torch.ones((), device=device)
        bias = torch.zeros(16, device=device, dtype=OUT_DTYPE)
        out = torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=OUT_DTYPE)
        return bool((out.float() == 16).all())
    except Exception:  # noqa: BLE001 - any failure means "not here"
        return False


# ------------------------------------------------------------------------------------- GEMM recognisers


@dataclasses.dataclass(frozen=True)
class WeightGemm:
    """The operands of a GEMM whose right operand is a weight, whichever op the capture wrote.

    ``aten.linear(x, W, b)`` keeps ``W`` as ``(N, K)`` (``nn.Linear``); ``aten.addmm(b, x, W)`` and
    ``aten.mm(x, W)`` with a ``get_attr`` ``W`` keep it as ``(K, N)`` (transformers' ``Conv1D`` in GPT-2:
    ``torch.addmm(bias, x.view(-1, K), weight)``), ``kn`` is True for those.
    """

    x: object
    weight: object
    bias: object
    kn: bool


def weight_gemm(node: fx.Node) -> WeightGemm | None:
    """The :class:`WeightGemm` of ``node``, or None when it is not one: every ``aten.linear``; an ``aten.addmm``
    / ``aten.mm`` only when its right operand is a ``get_attr`` (an activation @ activation product is no
    weight GEMM, and is not listed as skipped either)."""
    if node.op != "call_function":
        return None
    if node.target == _LINEAR:
        return WeightGemm(node.args[0], node.args[1], node_arg(node, 2, "bias"), False)
    if node.target in (_ADDMM, _MM):
        x, w = (node.args[1], node.args[2]) if node.target == _ADDMM else (node.args[0], node.args[1])
        if isinstance(w, fx.Node) and w.op == "get_attr":
            return WeightGemm(x, w, node.args[0] if node.target == _ADDMM else None, True)
    return None


def gemm_nk(gm: fx.GraphModule, gemm: WeightGemm) -> tuple[int, int]:
    """``(N, K)`` of a weight GEMM whose weight passed :func:`weight_ineligible`."""
    shape = tuple(get_attr_value(gm, gemm.weight.target).shape)
    return (shape[1], shape[0]) if gemm.kn else (shape[0], shape[1])


def weight_ineligible(gm: fx.GraphModule, gemm: WeightGemm) -> str | None:
    """Why the weight of a GEMM (:func:`weight_gemm`) cannot be an FP8 GEMM operand, or None: it must be a
    ``get_attr`` 2-D floating tensor with K and N multiples of ``FP8_MULTIPLE`` (also what ``tctune.fp8_plan``
    groups)."""
    w_node = gemm.weight
    if not isinstance(w_node, fx.Node) or w_node.op != "get_attr":
        return "weight is not a parameter"
    weight = get_attr_value(gm, w_node.target)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        return "weight is not a 2-D floating tensor"
    n, k = gemm_nk(gm, gemm)
    bad = [f"{role}={size}" for role, size in (("K", k), ("N", n)) if size % FP8_MULTIPLE]
    if bad:
        verb = "not a multiple" if len(bad) == 1 else "not multiples"
        return f"{', '.join(bad)} {verb} of {FP8_MULTIPLE} (FP8 GEMMs need {FP8_MULTIPLE})"
    return None


def fp8_keep_hit(node: fx.Node, patterns: Iterable[str]) -> tuple[str, str] | None:
    """``(module, pattern)`` when the FP8 keep-list ``patterns`` (``PassSpec.fp8_keep``: ``fnmatch`` patterns on
    module paths) keeps the GEMM ``node`` in bf16: its source module (``node.meta["nn_module_stack"]``; the node's
    name when it has none) matches a pattern, the first one that does. None otherwise."""
    module = source_module(node) or node.name
    hit = next((p for p in patterns if fnmatch.fnmatchcase(module, p)), None)
    return None if hit is None else (module, hit)


__all__ = [
    "AMAX_EPS",
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_MULTIPLE",
    "OUT_DTYPE",
    "WeightGemm",
    "dequantize_fp8",
    "fp8_keep_hit",
    "fp8_linear_reference",
    "fp8_scale",
    "gemm_nk",
    "quantize_fp8",
    "scaled_mm_works",
    "weight_gemm",
    "weight_ineligible",
]
