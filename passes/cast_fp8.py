"""Run eligible linears as scaled FP8 GEMMs (``torch._scaled_mm``), everything else in bf16.

Why: on the H200 the FP8 GEMM ceiling is twice fp16's (1314 against 649 TFLOP/s at 8192^3,
benchmarks/NOTES.md, reference measurements), and in BERT-large the GEMMs are two thirds of the kernel time;
quantizing an activation costs a few hundredths of a millisecond. FP8 Tensor Cores exist on sm_89 (Ada) and
sm_90 (Hopper) and newer.

What, at ``spec.precision == "fp8"`` (any other precision: one ``"<graph>"`` skip, nothing touched):

1. The graph is first cast to bf16 by ``passes.cast_precision`` (called here with precision ``"bf16"``, same
   keep-list / residual / overflow rules), so every op that is not an FP8 GEMM runs in bf16. The pipeline's
   own ``cast_precision`` step skips at ``"fp8"``; this pass owns the cast because ``cast_precision`` would
   otherwise cast the float8 operands of ``_scaled_mm`` back to bf16.
2. Every weight GEMM -- ``aten.linear(x, W, b)`` with ``W`` ``(N, K)``, or ``aten.addmm(b, x, W)`` /
   ``aten.mm(x, W)`` with a ``get_attr`` ``W`` ``(K, N)`` (transformers' ``Conv1D``, all of GPT-2's block
   GEMMs) -- whose weight is a ``get_attr`` 2-D floating tensor with K and N multiples of 16 (cuBLASLt's FP8
   requirement: ``"Expected trailing dimension of mat1 to be divisible by 16"``) becomes::

       x2d  = x.reshape(-1, K)                                   # (M, K) bf16, row-major
       s_x  = clamp_min(amax(|x2d|, -1, keepdim) in fp32, eps) / 448     # (M, 1) fp32, per token
       x8   = clamp(x2d.float() / s_x, -448, 448).to(float8_e4m3fn)       # saturating, never NaN
       y2d  = aten._scaled_mm(x8, W8.t(), s_x, s_w, bias=b, out_dtype=bfloat16)
       y    = y2d.view(*x.shape[:-1], N)

   ``W8`` (``(N, K)`` float8_e4m3fn -- of ``W.t()`` for a ``(K, N)`` weight -- so ``W8.t()`` is the
   column-major second operand ``_scaled_mm`` needs) and
   ``s_w`` (``(1, N)`` fp32: amax of each output channel / 448) are computed ONCE here, from the FP32 weight,
   and stored as new *non-persistent* buffers ``<weight>_fp8`` / ``<weight>_fp8_scale``: ``state_dict`` keys
   are unchanged (the original parameter stays on the module, stored bf16, unused by the graph).
   With ``spec.fp8_scaling == "tensor"`` both scales are one fp32 scalar (0-dim) per tensor instead.
   ``use_fast_accum`` is ``spec.fp8_fast_accum`` (False by default: full-precision accumulation; True: Hopper's
   faster reduced-precision accumulation, chosen per model by ``tctune``'s search when the accuracy limit holds).
   The bias (bf16) goes into ``_scaled_mm``'s epilogue: checked on the H200 with torch 2.11 (sm_90) for both
   row-wise and tensor-wise scales; ``_scaled_mm`` requires a bf16 bias for a bf16 output.

Inputs outside the FP8 range never turn into NaN: values are clamped to +-448 before the cast (float8_e4m3fn
has no infinity, and whether an out-of-range cast saturates or gives NaN has differed between torch versions
and kernels; the clamp makes saturation explicit). All-zero rows get the scale ``eps / 448`` and quantize
to exact zeros. Inference only: with ``spec.training`` every linear is skipped (the dynamic quantization has
no straight-through gradient here). ``torch._scaled_mm`` also runs on the CPU (oneDNN): per-tensor scales in
torch 2.11, per-tensor and row-wise in torch 2.13, so the rewritten graph can be checked there
(``passes.fp8_numerics.scaled_mm_works``); it is only *fast* on sm_89+. Checked on the H200 (sm_90, torch
2.11, CUDA 13.0): both scalings, with bias, M not a multiple of 16.

Nodes made by this pass carry ``node.meta["tctune_fp8"] = True``.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import fx, nn

from passes._graph import copy_meta, fake_eval, fake_from_tensor, finish, get_attr_value, unique_attr_name
from passes.base import PassResult, PassSpec, Skip
from passes.cast_precision import cast_precision
from passes.fp8_numerics import (AMAX_EPS, FP8_DTYPE, FP8_MAX, OUT_DTYPE, WeightGemm, fp8_keep_hit, gemm_nk,
                                 quantize_fp8, weight_gemm, weight_ineligible)

NAME = "cast_fp8_linears"

#: ``node.meta`` flag on every node this pass created.
FP8_FLAG = "tctune_fp8"

_ADDMM = torch.ops.aten.addmm.default
_SCALED_MM = torch.ops.aten._scaled_mm.default
_CAST = torch.ops.aten._to_copy.default


# ------------------------------------------------------------------------------------------------ pass


def cast_fp8_linears(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """At precision fp8: cast the graph to bf16, then run eligible linears as scaled FP8 GEMMs, in place.

    For ``y = linear(x, W, b)`` with ``x: (..., K)``, ``W: (N, K)``: eligible when ``W`` is a ``get_attr``
    2-D floating tensor, K and N are multiples of 16, and the linear's source module matches no
    ``spec.fp8_keep`` pattern. Shapes are unchanged; the output is bf16 (as the bf16
    cast gave the linear). See the module docstring for the exact graph.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts; ``spec.precision`` must be ``"fp8"`` (else one ``"<graph>"`` skip),
            ``spec.fp8_scaling`` picks ``"row"`` or ``"tensor"`` scales, ``spec.training`` skips every linear,
            ``spec.fp8_fast_accum`` is every ``_scaled_mm``'s ``use_fast_accum``.

    Returns:
        A ``PassResult`` named ``"cast_fp8_linears"``: ``count`` is the number of linears rewritten, ``changed``
        their (former) node names; ``skipped`` the linears left in bf16 with the reason (``"K=61 not a
        multiple of 16 (FP8 GEMMs need 16)"``); ``notes``: ``scaling``, ``fast_accum`` (bool), ``fp8_weights``
        (weight -> its FP8 buffer names) and ``cast_precision`` (the bf16 cast's own result, or why it did not
        run again).
    """
    result = PassResult(name=NAME, graph_module=gm)
    if spec.precision != "fp8":
        result.skipped.append(Skip("<graph>", f"precision {spec.precision}: FP8 linears only at precision fp8"))
        return result
    scaling = spec.fp8_scaling

    # Every GEMM weight in FP32, as captured, before the bf16 cast replaces it: FP8 is quantized from FP32.
    originals: dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        gemm = weight_gemm(node)
        if gemm is not None and isinstance(gemm.weight, fx.Node) and gemm.weight.op == "get_attr":
            originals[gemm.weight.target] = get_attr_value(gm, gemm.weight.target)

    if any(n.meta.get(FP8_FLAG) for n in gm.graph.nodes):
        # Already rewritten: cast_precision must not run again (it would cast the float8 operands to bf16).
        result.notes["cast_precision"] = "not run: the graph already has FP8 GEMMs (cast to bf16 before)"
        cast_skips: dict[str, str] = {}
    else:
        cast = cast_precision(gm, dataclasses.replace(spec, precision="bf16"))
        result.notes["cast_precision"] = cast.to_dict()
        cast_skips = {s.node: s.reason for s in cast.skipped}

    quantized: dict[tuple[int, bool], tuple[str, str]] = {}  # (id(original weight), kn) -> (fp8, scale) buffers
    fp8_weights: dict[str, list[str]] = {}
    kn_weights: list[str] = []
    for node in list(gm.graph.nodes):
        gemm = weight_gemm(node)
        if gemm is None:
            continue
        reason = _ineligible(gm, node, gemm, spec, cast_skips)
        if reason is not None:
            result.skipped.append(Skip(node.name, reason))
            continue
        w_node = gemm.weight
        original = originals.get(w_node.target, get_attr_value(gm, w_node.target))
        key = (id(original), gemm.kn)
        if key not in quantized:
            # FP8 codes are always stored (N, K): a (K, N) weight is transposed once here
            quantized[key] = _store_fp8_weight(gm, w_node.target, original.t() if gemm.kn else original, scaling)
            fp8_weights[w_node.target] = list(quantized[key])
            if gemm.kn:
                kn_weights.append(w_node.target)
        _rewrite(gm, node, gemm, *quantized[key], scaling, spec.fp8_fast_accum)
        result.changed.append(node.name)
        result.count += 1

    result.notes["scaling"] = scaling
    result.notes["fast_accum"] = spec.fp8_fast_accum
    if fp8_weights:
        result.notes["fp8_weights"] = fp8_weights
    if kn_weights:
        result.notes["fp8_weights_kn"] = kn_weights
    cast_changed = isinstance(result.notes["cast_precision"], dict)
    if result.count or cast_changed:
        finish(gm)
    return result


def _ineligible(gm: fx.GraphModule, node: fx.Node, gemm: WeightGemm, spec: PassSpec,
                cast_skips: dict[str, str]) -> str | None:
    """Why the GEMM ``node`` stays a bf16 GEMM, or None when it becomes an FP8 GEMM."""
    if spec.training:
        return "training: FP8 linears are inference-only here"
    reason = weight_ineligible(gm, gemm)
    if reason is not None:
        return reason
    if node.target == _ADDMM and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
        return "addmm with beta or alpha other than 1"
    if node.name in cast_skips:
        return f"kept out of bf16 by cast_precision ({cast_skips[node.name]})"
    kept = fp8_keep_hit(node, spec.fp8_keep)
    if kept is not None:
        return f"FP8 keep-list: module {kept[0]} matches {kept[1]!r} (stays bf16)"
    x_val = gemm.x.meta.get("val") if isinstance(gemm.x, fx.Node) else None
    if not isinstance(x_val, torch.Tensor):
        return "input has no shape metadata (meta['val'])"
    if x_val.dtype != OUT_DTYPE:
        return f"input is {str(x_val.dtype).replace('torch.', '')}, not bf16, after cast_precision"
    if x_val.dim() < 1:
        return "input is a scalar"
    bias = gemm.bias
    if bias is not None and not isinstance(bias, fx.Node):
        return "bias is not a tensor"
    if gemm.kn and bias is not None:
        b_val = bias.meta.get("val")
        n = gemm_nk(gm, gemm)[0]
        if not isinstance(b_val, torch.Tensor) or tuple(b_val.shape) != (n,):
            shape = tuple(b_val.shape) if isinstance(b_val, torch.Tensor) else "unknown"
            return f"addmm bias of shape {shape} is not ({n},) (the FP8 GEMM's epilogue adds a per-column bias)"
    return None


def _store_fp8_weight(gm: fx.GraphModule, target: str, weight: torch.Tensor, scaling: str) -> tuple[str, str]:
    """Quantize ``weight`` once and store it, with its ``_scaled_mm`` scale, as non-persistent buffers.

    Returns the ``(fp8 weight, scale)`` attribute names. Row scaling stores the scale as ``(1, N)``.
    """
    wq, sw = quantize_fp8(weight.detach(), scaling=scaling)
    if scaling == "row":
        sw = sw.reshape(1, -1)
    names = []
    for suffix, value in (("_fp8", wq.contiguous()), ("_fp8_scale", sw.contiguous())):
        name = unique_attr_name(gm, f"{target}{suffix}")
        *path, attr = name.split(".")
        owner: nn.Module = gm.get_submodule(".".join(path)) if path else gm
        owner.register_buffer(attr, value, persistent=False)
        names.append(name)
    return names[0], names[1]


def _rewrite(gm: fx.GraphModule, node: fx.Node, gemm: WeightGemm, w8_name: str, sw_name: str, scaling: str,
             fast_accum: bool = False) -> None:
    """Replace the GEMM ``node`` by dynamic activation quantization + ``aten._scaled_mm`` (module docstring)."""
    graph = gm.graph
    x, w_node, bias = gemm.x, gemm.weight, gemm.bias
    weight = get_attr_value(gm, w8_name)
    n, k = weight.shape
    x_val = x.meta["val"]
    ndim = x_val.dim()
    made: list[fx.Node] = []

    def op(target, args, kwargs=None) -> fx.Node:
        new = graph.call_function(target, tuple(args), kwargs or {})
        copy_meta(node, new, fake_eval(target, new.args, new.kwargs))
        new.meta[FP8_FLAG] = True
        made.append(new)
        return new

    def attr(name: str) -> fx.Node:
        new = graph.get_attr(name)
        fake = fake_from_tensor(w_node.meta.get("val"), get_attr_value(gm, name))
        if fake is not None:
            new.meta["val"] = fake
        new.meta[FP8_FLAG] = True
        return new

    aten = torch.ops.aten
    with graph.inserting_before(node):
        lead: list = [-1]
        if ndim != 2:
            # Leading sizes for the view back: -1 for the first (the batch: on the H200, torch 2.11, GPT-2's
            # LM-head input carried a static batch of 2 in its metadata while the graph ran at 32, and a static
            # size there broke the view), then static ints, or sym_size nodes for dynamic dimensions.
            for i in range(1, ndim - 1):
                size = x_val.shape[i]
                lead.append(size if isinstance(size, int) else op(aten.sym_size.int, (x, i)))
        x2d = x if ndim == 2 else op(aten.reshape.default, (x, [-1, k]))
        mag = op(aten.abs.default, (x2d,))
        amax = op(aten.amax.default, (mag, [-1], True) if scaling == "row" else (mag, []))
        amax = op(_CAST, (amax,), {"dtype": torch.float32})
        amax = op(aten.clamp_min.default, (amax, AMAX_EPS))
        scale_x = op(aten.div.Tensor, (amax, FP8_MAX))
        x32 = op(_CAST, (x2d,), {"dtype": torch.float32})
        xs = op(aten.div.Tensor, (x32, scale_x))
        xs = op(aten.clamp.default, (xs, -FP8_MAX, FP8_MAX))
        x8 = op(_CAST, (xs,), {"dtype": FP8_DTYPE})
        w8 = attr(w8_name)
        scale_w = attr(sw_name)
        w8_t = op(aten.t.default, (w8,))
        if bias is not None:
            b_val = bias.meta.get("val")
            if b_val is None or b_val.dtype != OUT_DTYPE:
                bias = op(_CAST, (bias,), {"dtype": OUT_DTYPE})
        kwargs = {"bias": bias, "out_dtype": OUT_DTYPE, "use_fast_accum": fast_accum}
        y = op(_SCALED_MM, (x8, w8_t, scale_x, scale_w), kwargs)
        if ndim != 2:
            y = op(aten.view.default, (y, [*lead, n]))
    node.replace_all_uses_with(y)
    graph.erase_node(node)


__all__ = ["FP8_FLAG", "NAME", "cast_fp8_linears"]
