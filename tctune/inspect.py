"""``tctune inspect``: which GEMMs and convolutions of a model run on Tensor Cores, and what the passes change.

For every matmul and convolution of the captured ATen graph (``aten.linear``, ``mm``, ``addmm``, ``bmm``,
``matmul``, ``baddbmm``, ``_addmm_activation``, ``_scaled_mm``, ``conv1d/2d/3d``, ``convolution``,
``conv_transpose1d/2d/3d`` and ``scaled_dot_product_attention``, counted as its two GEMMs) it reports the
source module, the operand shapes at one batch size, the compute precision, the FLOPs, and whether the op
runs efficiently on the target's Tensor Cores, with the reason when it does not. It then runs the pass
pipeline (:func:`tctune.trial.apply_passes`, whatever ``passes.run_pipeline`` contains) on a copy, inspects
the rewritten graph the same way and pairs the two node by node.

Eligibility rules (:func:`tensor_core_verdict`), in the order they are checked:

1. No GPU target (the CPU spec): "no Tensor Cores (CPU)".
2. FP32 without TF32: Tensor Cores take tf32/fp16/bf16/fp8 inputs only (NVIDIA architecture whitepapers,
   Volta through Hopper; NVIDIA Deep Learning Performance Guide, "Matrix Multiplication Background").
3. A precision the architecture's Tensor Cores do not take (``HardwareSpec.tensor_core_precisions``, from
   the same whitepapers), e.g. bf16 on Volta.
4. Depthwise convolution (one input channel per group): no GEMM to speak of, memory-bound (NVIDIA "Convolutional
   Layers User's Guide"). Other grouped convolutions are checked per group (Cin/groups, Cout/groups).
5. Alignment (NVIDIA Deep Learning Performance Guide, "Matrix Multiplication Background User's Guide",
   "Tensor Core Requirements", and "Convolutional Layers User's Guide", "Channels In and Out"): a GEMM's N and
   K, and a convolution's Cin and Cout, should be multiples of 16 bytes of the dtype (8 fp16/bf16, 4 tf32,
   16 fp8; ``HardwareSpec.alignment``). Since cuBLAS 11 / cuDNN 8 Tensor Cores *can* run unaligned shapes,
   but at much lower efficiency: measured on the H200, an fp16 GEMM with K=8191 runs at 140 against
   646 TFLOP/s at K=8192 (benchmarks/NOTES.md, reference measurements). So an unaligned op is reported as
   "not efficiently on Tensor Cores". M (rows: batch x tokens) is not checked: cuBLAS tiles any M. One
   exception, measured on the H200 (benchmarks/NOTES.md, reference measurements): a 2-byte convolution with
   Cin=4 takes cuDNN's small-channel first-layer kernels and beats Cin=8 (0.97 vs 1.78 ms for a 7x7 conv), so
   Cin=4 counts as aligned for fp16/bf16.
   For attention the head dims (E of Q/K, Ev of V) are checked: they are K of Q·Kᵀ and N of P·V; the
   sequence lengths are tiled by the fused kernels like M.
6. Tiny: M·N·K below :data:`TINY_MNK` (2^15 multiply-adds, a tctune heuristic: at 650 TFLOP/s that is
   about 0.1 ns of math against a few µs of kernel launch, so Tensor Cores cannot matter there).

FLOPs: 2·M·N·K per GEMM (times the batch of a batched GEMM); 2·N·Cout·prod(out spatial)·(Cin/groups)·
prod(kernel) per convolution; attention 2·B·H·L·S·(E + Ev) (its two GEMMs). Multiply-adds count as two.

The summary's Tensor Core share is FLOP-weighted over GEMMs and convolutions; a padded op counts with its
original (useful) FLOPs, not the padded ones.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError

log = logging.getLogger("tctune")

__all__ = [
    "OpInfo",
    "Inspection",
    "TINY_MNK",
    "GEMM_OPS",
    "CONV_OPS",
    "inspect_graph",
    "inspect_model_file",
    "supported_precisions",
    "default_precision",
    "tensor_core_verdict",
    "format_text",
    "register",
    "run",
]

#: Below this many multiply-adds (M·N·K) a GEMM/conv is reported "too small to matter" (tctune heuristic:
#: ~0.1 ns of Tensor Core math at 650 TFLOP/s against a kernel launch of a few µs).
TINY_MNK = 1 << 15

#: GEMM-like ATen ops (overload packet names) and how to read (a, b) from their args.
GEMM_OPS = ("linear", "mm", "addmm", "bmm", "matmul", "baddbmm", "_addmm_activation", "_scaled_mm")
#: Convolution ATen ops.
CONV_OPS = ("conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d",
            "conv_transpose3d", "_convolution",
            "conv2d_relu", "conv2d_add_relu")  # passes.fuse_conv_relu's cuDNN ops (tctune::), conv2d's operands
ATTENTION_OPS = ("scaled_dot_product_attention",)
_ALL_OPS = frozenset(GEMM_OPS + CONV_OPS + ATTENTION_OPS)

_PRECISION_OF_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
_FP32_REASON = "fp32: Tensor Cores need tf32/fp16/bf16; choose --precision tf32 or lower"
_CPU_REASON = "no Tensor Cores (CPU)"
#: ``passes.PRECISIONS``, written out so that building the CLI parser does not import torch (tests check they agree).
_PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8")


# ------------------------------------------------------------------------------------------------ data


@dataclass
class OpInfo:
    """One GEMM / convolution / attention node of a graph, at one batch size.

    Attributes:
        node: FX node name (``"linear_3"``).
        module: qualified path of the source module (``"bert.encoder.layer.0.attention.self.query"``);
            ``"(root)"`` for ops in the top module's own ``forward``.
        op: ATen op packet name (``"linear"``, ``"conv2d"``, ``"scaled_dot_product_attention"``).
        kind: ``"gemm"``, ``"conv"`` or ``"attention"``.
        shapes: operand shapes by role (``input``, ``weight`` / ``other``, ``query``/``key``/``value``) and
            ``output``; lists of ints.
        dtype: compute precision (``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"``, ``"fp8"``).
        flops: floating-point operations of one call (multiply-add = 2).
        mnk: M·N·K multiply-adds, for the "too small" rule.
        dims: the checked dimensions, e.g. ``{"N": 10, "K": 8192}`` or ``{"Cin": 3, "Cout": 32, "groups": 1}``.
        tensor_core: runs efficiently on Tensor Cores.
        reason: why not (empty when ``tensor_core``).
    """

    node: str
    module: str
    op: str
    kind: str
    shapes: dict
    dtype: str
    flops: int
    mnk: int
    dims: dict = field(default_factory=dict)
    tensor_core: bool = False
    reason: str = ""

    def to_dict(self) -> dict:
        return {"module": self.module, "op": self.op, "shapes": self.shapes, "dtype": self.dtype,
                "flops": self.flops, "tensor_core": self.tensor_core, "reason": self.reason}


@dataclass
class Pair:
    """A node before the passes and its counterpart after (None: removed / new, or passes not run)."""

    before: OpInfo | None
    after: OpInfo | None


@dataclass
class Inspection:
    """The result of ``tctune inspect``: per-node before/after, the pass results, and the FLOP shares."""

    model: str
    hardware: Any  # HardwareSpec
    precision: str
    batch_size: int
    pairs: list[Pair]
    passes: list  # PassResult
    passes_error: str | None = None

    @property
    def passes_ran(self) -> bool:
        return self.passes_error is None

    def share_before(self) -> float | None:
        ops = [p.before for p in self.pairs if p.before is not None]
        return _share([(o.flops, o.tensor_core) for o in ops])

    def share_after(self) -> float | None:
        if not self.passes_ran:
            return None
        items = []
        for p in self.pairs:
            if p.after is None:
                continue
            useful = p.before.flops if p.before is not None else p.after.flops  # padded FLOPs count as useful
            items.append((useful, p.after.tensor_core))
        return _share(items)

    def total_gflop(self) -> float:
        return sum(p.before.flops for p in self.pairs if p.before is not None) / 1e9

    def to_dict(self) -> dict:
        """The documented JSON: model, hardware, precision, batch_size, nodes, passes, summary."""
        nodes = []
        for p in self.pairs:
            if p.before is not None:
                d = p.before.to_dict()
            else:  # appears only after the passes (fusion)
                d = {"module": p.after.module, "op": p.after.op, "shapes": None, "dtype": None, "flops": None,
                     "tensor_core": None, "reason": "appears after the passes (fusion)"}
            d["after"] = p.after.to_dict() if p.after is not None else None
            nodes.append(d)
        return {
            "model": self.model,
            "hardware": self.hardware.to_dict(),
            "precision": self.precision,
            "batch_size": self.batch_size,
            "nodes": nodes,
            "passes": [r.to_dict() for r in self.passes],
            "summary": {
                "tensor_core_flop_share_before": self.share_before(),
                "tensor_core_flop_share_after": self.share_after(),
                "total_gflop": self.total_gflop(),
            },
        }


def _share(items: list[tuple[int, bool]]) -> float | None:
    total = sum(f for f, _ in items)
    if total <= 0:
        return None
    return sum(f for f, tc in items if tc) / total


# ------------------------------------------------------------------------------------------- precision


def supported_precisions(hw) -> tuple[str, ...]:
    """Precisions ``inspect`` accepts for ``hw``: fp32 always, plus the Tensor Core ones it has.

    On the CPU spec: ``("fp32", "bf16")`` (what the tuner searches there; nothing runs on Tensor Cores).
    """
    if not hw.is_gpu:
        return ("fp32", "bf16")
    return ("fp32",) + tuple(p for p in ("tf32", "fp16", "bf16", "fp8") if p in hw.tensor_core_precisions)


def default_precision(hw) -> str:
    """The best Tensor Core precision of ``hw``: bf16 where supported, else fp16; fp32 on the CPU."""
    if not hw.is_gpu:
        return "fp32"
    return "bf16" if "bf16" in hw.tensor_core_precisions else "fp16"


def _check_precision(hw, precision: str) -> None:
    ok = supported_precisions(hw)
    if precision not in ok:
        where = f"{hw.name} ({hw.arch}{', sm ' + hw.compute_capability if hw.compute_capability else ''})"
        raise UsageError(
            f"--precision {precision} is not supported on {where}; supported: {', '.join(ok)}\n"
            f"  fix: choose one of those, or --target a GPU that has {precision} Tensor Cores"
        )


# ------------------------------------------------------------------------------------- shape recording


def _op_packet(node) -> str | None:
    target = getattr(node, "target", None)
    packet = getattr(target, "_overloadpacket", None)
    name = getattr(packet, "__name__", None)
    return name if name in _ALL_OPS else None


def _describe(x: Any) -> Any:
    """Tensors -> ``(shape tuple, dtype)``; containers recursively; everything else as is."""
    import torch

    if isinstance(x, torch.Tensor):
        return (tuple(int(s) for s in x.shape), x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_describe(v) for v in x)
    return x


def record_shapes(gm, inputs: tuple) -> dict[str, tuple[tuple, dict, Any]]:
    """Run ``gm`` on ``inputs`` and record the concrete operands of every GEMM / conv / attention node.

    Runs under a ``FakeTensorMode`` (shapes and dtypes only, no math), and falls back to a real run under
    ``torch.no_grad()`` when an op has no fake implementation.

    Args:
        gm: a graph module from ``torch.export`` (or rewritten by the passes).
        inputs: concrete inputs at the batch size to report, each ``(batch, ...)``.

    Returns:
        node name -> (args, kwargs, output), tensors replaced by ``(shape, dtype)``.
    """
    import torch
    from torch.fx import Interpreter

    class _Recorder(Interpreter):
        def __init__(self, module):
            super().__init__(module)
            self.seen: dict = {}

        def run_node(self, n):
            result = super().run_node(n)
            if n.op == "call_function" and _op_packet(n):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                self.seen[n.name] = (_describe(args), _describe(kwargs), _describe(result))
            return result

    flat = list(inputs)
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        with mode, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in flat]
            rec = _Recorder(gm)
            rec.run(*fake)
        return rec.seen
    except Exception as exc:  # noqa: BLE001 - an op without a fake kernel: run it for real
        log.debug("fake shape propagation failed (%s: %s); running the graph for real", type(exc).__name__, exc)
    rec = _Recorder(gm)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec.run(*flat)
    return rec.seen


# ------------------------------------------------------------------------------------------- analysis


def _module_of(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "(root)"
    path = list(stack.values())[-1][0]
    return path or "(root)"


def _precision_of(dtype, precision: str, as_eager: bool) -> str:
    """The precision an op computes in.

    Args:
        dtype: the torch dtype of its first operand in the graph.
        precision: the ``--precision`` chosen.
        as_eager: True for the graph *before* the passes: the eager model run at ``precision`` (autocast for
            fp16/bf16, TF32 matmuls for tf32), so fp32 operands compute in ``precision``. False for the
            rewritten graph, whose dtypes are explicit: fp32 computes in tf32 only when that is the precision.
    """
    name = str(dtype).replace("torch.", "")
    if name.startswith("float8"):
        return "fp8"
    p = _PRECISION_OF_DTYPE.get(name, name)
    if p == "fp32":
        if as_eager:
            return precision
        return "tf32" if precision == "tf32" else "fp32"
    return p


def _shape(x) -> list[int] | None:
    return list(x[0]) if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple) else None


def _dtype(x):
    return x[1] if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple) else None


def _arg(args, kwargs, i, name, default=None):
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _gemm_dims(op: str, args, kwargs) -> tuple[dict, int, int, int, int, Any] | None:
    """``(shapes, batch, M, N, K, dtype)`` of a GEMM-like call, or None when the operands are not tensors."""
    if op == "linear":
        a, w = _shape(args[0]), _shape(args[1])
        if a is None or w is None:
            return None
        n, k = (w[0], w[1]) if len(w) == 2 else (1, w[0])
        m = math.prod(a[:-1]) if len(a) > 1 else 1
        return {"input": a, "weight": w}, 1, m, n, k, _dtype(args[0])
    if op in ("mm", "_scaled_mm"):
        a, b = _shape(args[0]), _shape(args[1])
        dt = _dtype(args[0])
        names = ("input", "weight") if op == "_scaled_mm" else ("input", "other")
    elif op in ("addmm", "_addmm_activation", "baddbmm"):
        a, b = _shape(args[1]), _shape(args[2])
        dt = _dtype(args[1])
        names = ("input", "other")
    elif op in ("bmm", "matmul"):
        a, b = _shape(args[0]), _shape(args[1])
        dt = _dtype(args[0])
        names = ("input", "other")
    else:
        return None
    if a is None or b is None:
        return None
    a2 = [1] + a if len(a) == 1 else a  # (K,) acts as (1, K)
    b2 = b + [1] if len(b) == 1 else b  # (K,) acts as (K, 1)
    m, k = a2[-2], a2[-1]
    n = b2[-1]
    lead_a, lead_b = a2[:-2], b2[:-2]
    width = max(len(lead_a), len(lead_b))
    lead_a = [1] * (width - len(lead_a)) + lead_a
    lead_b = [1] * (width - len(lead_b)) + lead_b
    batch = math.prod(max(x, y) for x, y in zip(lead_a, lead_b)) if width else 1
    return {names[0]: a, names[1]: b}, batch, m, n, k, dt


def _conv_dims(op: str, args, kwargs, out) -> dict | None:
    """Shapes and channel facts of a convolution call, or None when the operands are not tensors."""
    x, w, y = _shape(args[0]), _shape(args[1]), _shape(out)
    if x is None or w is None or y is None:
        return None
    transposed = op.startswith("conv_transpose") or (op in ("convolution", "_convolution")
                                                      and bool(_arg(args, kwargs, 6, "transposed", False)))
    if op in ("convolution", "_convolution"):
        groups = int(_arg(args, kwargs, 8, "groups", 1))
    elif op == "conv2d_add_relu":  # (x, weight, z, bias, stride, padding, dilation, groups)
        groups = int(_arg(args, kwargs, 7, "groups", 1))
    elif transposed:
        groups = int(_arg(args, kwargs, 6, "groups", 1))
    else:
        groups = int(_arg(args, kwargs, 6, "groups", 1))
    batched = len(x) == len(w)  # conv2d also takes unbatched (C, H, W) input
    n = x[0] if batched else 1
    kernel = math.prod(w[2:])
    if transposed:  # weight (Cin, Cout/groups, *k): every input pixel scatters into Cout/groups channels
        cin, cout = w[0], w[1] * groups
        spatial_in = math.prod(x[2:] if batched else x[1:])
        flops = 2 * n * cin * spatial_in * (cout // groups) * kernel
        m, nn, kk = n * spatial_in, cout // groups, cin  # GEMM view for the tiny rule
    else:  # weight (Cout, Cin/groups, *k)
        cout, cin = w[0], w[1] * groups
        spatial_out = math.prod(y[2:] if batched else y[1:])
        flops = 2 * n * cout * spatial_out * (cin // groups) * kernel
        m, nn, kk = n * spatial_out, cout, (cin // groups) * kernel
    return {"shapes": {"input": x, "weight": w, "output": y}, "flops": flops, "mnk": m * nn * kk,
            "cin": cin, "cout": cout, "groups": groups, "dtype": _dtype(args[0])}


def _needs(value: int, align: int, name: str) -> str | None:
    if value % align == 0:
        return None
    return f"{name}={value} not a multiple of {align} (needs +{-value % align})"


def tensor_core_verdict(hw, info: OpInfo) -> tuple[bool, str]:
    """Whether ``info`` runs efficiently on ``hw``'s Tensor Cores, and if not, why (the rules in the module
    docstring, checked in order)."""
    if not hw.is_gpu:
        return False, _CPU_REASON
    p = info.dtype
    if p in ("fp32", "fp64"):
        return False, _FP32_REASON if p == "fp32" else "fp64: no Tensor Core GEMMs at this precision in tctune's model"
    if p not in hw.tensor_core_precisions:
        ok = "/".join(hw.tensor_core_precisions) or "none"
        return False, f"{p}: not a Tensor Core precision on {hw.arch} (it takes {ok})"
    align = int(hw.alignment.get(p, 1))
    d = info.dims
    problems: list[str] = []
    if info.kind == "conv":
        groups, cin, cout = d["groups"], d["Cin"], d["Cout"]
        if groups > 1 and cin // groups == 1:
            return False, "depthwise conv: memory-bound, no Tensor Core GEMM"
        c_in, c_out = cin // groups, cout // groups
        pre = "grouped conv: " if groups > 1 else ""
        small_channel_ok = groups == 1 and c_in == 4 and p in ("fp16", "bf16")  # cuDNN C=4 kernels, NOTES.md
        if not small_channel_ok:
            problems.append(_needs(c_in, align, "Cin/groups" if groups > 1 else "Cin"))
        problems.append(_needs(c_out, align, "Cout/groups" if groups > 1 else "Cout"))
        problems = [pre + x for x in problems if x]
    elif info.kind == "attention":
        problems = [x for x in (_needs(d["E"], align, "head dim E"), _needs(d["Ev"], align, "value head dim Ev")
                                if d["Ev"] != d["E"] else None) if x]
    else:
        problems = [x for x in (_needs(d["N"], align, "N"), _needs(d["K"], align, "K")) if x]
    if problems:
        return False, "; ".join(problems) + ": not efficiently on Tensor Cores"
    if info.mnk < TINY_MNK:
        return False, f"too small to matter (M*N*K={info.mnk} < 2^15)"
    return True, ""


def inspect_graph(gm, inputs: tuple, hw, precision: str, *, as_eager: bool) -> list[OpInfo]:
    """Every GEMM / convolution / attention node of ``gm`` at the batch of ``inputs``, with its verdict.

    Args:
        gm: an ATen graph module (``torch.export``), possibly rewritten by the passes.
        inputs: concrete inputs, each ``(batch, ...)``.
        hw: the :class:`~tctune.hardware.HardwareSpec` judged against.
        precision: ``--precision``.
        as_eager: see :func:`_precision_of` (True for the graph before the passes).

    Returns:
        One :class:`OpInfo` per node, in graph order.
    """
    seen = record_shapes(gm, inputs)
    out: list[OpInfo] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        op = _op_packet(node)
        if op is None or node.name not in seen:
            continue
        args, kwargs, result = seen[node.name]
        module = _module_of(node)
        if op in ATTENTION_OPS:
            q, k, v = _shape(args[0]), _shape(args[1]), _shape(args[2])
            if q is None or k is None or v is None:
                continue
            batch = math.prod(q[:-2])
            l, e, s, ev = q[-2], q[-1], k[-2], v[-1]
            flops = 2 * batch * l * s * (e + ev)
            info = OpInfo(node.name, module, op, "attention",
                          {"query": q, "key": k, "value": v, "output": _shape(result)},
                          _precision_of(_dtype(args[0]), precision, as_eager), flops,
                          batch * l * s * min(e, ev), {"E": e, "Ev": ev, "L": l, "S": s})
        elif op in CONV_OPS:
            c = _conv_dims(op, args, kwargs, result)
            if c is None:
                continue
            info = OpInfo(node.name, module, op, "conv", c["shapes"],
                          _precision_of(c["dtype"], precision, as_eager), c["flops"], c["mnk"],
                          {"Cin": c["cin"], "Cout": c["cout"], "groups": c["groups"]})
        else:
            g = _gemm_dims(op, args, kwargs)
            if g is None:
                continue
            shapes, batch, m, n, k, dt = g
            res = result[0] if isinstance(result, tuple) and result and isinstance(result[0], tuple) \
                and isinstance(result[0][0], tuple) else result
            shapes["output"] = _shape(res)
            info = OpInfo(node.name, module, op, "gemm", shapes, _precision_of(dt, precision, as_eager),
                          2 * batch * m * n * k, batch * m * n * k, {"M": m, "N": n, "K": k, "batch": batch})
        info.tensor_core, info.reason = tensor_core_verdict(hw, info)
        out.append(info)
    return out


def pair_nodes(before: list[OpInfo], after: list[OpInfo] | None) -> list[Pair]:
    """Match nodes by (source module, op), in order of appearance within each key; a convolution the passes
    fused with its ReLU (``conv2d_relu`` / ``conv2d_add_relu`` of the same module) is matched with it.

    Unmatched ``before`` nodes were removed (fused, folded) by the passes; unmatched ``after`` nodes were
    created by them. With ``after`` None (passes not run) every pair has ``after=None``.
    """
    if after is None:
        return [Pair(b, None) for b in before]
    pool: dict[tuple[str, str], list[OpInfo]] = {}
    for a in after:
        pool.setdefault((a.module, a.op), []).append(a)
    pairs = []
    for b in before:
        cands = pool.get((b.module, b.op))
        if not cands and b.kind == "conv":
            cands = pool.get((b.module, "conv2d_relu")) or pool.get((b.module, "conv2d_add_relu"))
        pairs.append(Pair(b, cands.pop(0) if cands else None))
    matched = {id(p.after) for p in pairs if p.after is not None}
    pairs.extend(Pair(None, a) for a in after if id(a) not in matched)
    return pairs


# ---------------------------------------------------------------------------------------------- driver


def inspect_model_file(path: str, target: str | None = None, precision: str | None = None,
                       batch_size: int = 32) -> Inspection:
    """Capture a model file, inspect it at ``precision`` for ``target``, run the passes and inspect again.

    Args:
        path: a model file (``build_model()``, ``example_inputs(batch_size)``); it is executed.
        target: ``--target`` (``"h100"``, ``"sm_80"``...); None: the detected GPU, else the CPU.
        precision: one of :func:`supported_precisions`; None: :func:`default_precision`.
        batch_size: the batch the shapes and FLOPs are reported at (≥ 1).

    Raises:
        UsageError: a precision the target does not support, or a batch size below 1.
        ModelFileError: the model file breaks the contract.
        CaptureError: torch.export could not capture the model (the message gives the reason).
        HardwareError: an unknown or pre-Volta target.
        PassError: a pass failed on this model.
    """
    import torch

    from .capture import MAX_BATCH, batch_range, capture
    from .errors import CaptureError
    from .hardware import resolve
    from .modelfile import load_model_file
    from .trial import apply_passes

    if batch_size < 1 or batch_size > MAX_BATCH:
        raise UsageError(f"--batch-size must be between 1 and {MAX_BATCH}, got {batch_size}")
    hw = resolve(target)
    precision = precision or default_precision(hw)
    _check_precision(hw, precision)
    mf = load_model_file(path)
    model = mf.model().eval()
    capture_batch = max(2, min(batch_size, 8))  # batch ≥ 2 so export keeps it symbolic
    capture_inputs = mf.inputs(capture_batch)
    try:
        with torch.no_grad():
            gm = capture(model, capture_inputs, mf.dynamic_shapes, mf.batched_mask())
    except CaptureError:
        # A model that does not run at all is the cause to name (its line and the fix), as `tctune optimize`
        # names it, rather than torch.export's symptom ("could not capture ... with a dynamic batch").
        from .search.loop import check_fp32_runs

        check_fp32_runs(model, mf, capture_batch, torch.device("cpu"))
        raise
    lo, hi = batch_range(gm)
    if not lo <= batch_size <= hi:
        raise UsageError(f"--batch-size {batch_size} is outside the batch range the model allows ({lo}..{hi}: "
                         f"torch.export found a bound in its forward)\n  fix: --batch-size {min(max(lo, 8), hi)}")
    inputs = mf.inputs(batch_size)
    before = inspect_graph(gm, inputs, hw, precision, as_eager=True)
    after, results, error = None, [], None
    try:
        g2, results = apply_passes(gm, hw, precision)
    except ValueError as exc:  # PassSpec does not take this precision (e.g. fp8 before an fp8 pass exists)
        error = f"the pass pipeline does not run at {precision}: {exc}"
        log.warning("%s; showing the graph before the passes only", error)
    else:
        after = inspect_graph(g2, inputs, hw, precision, as_eager=False)
    return Inspection(model=mf.name, hardware=hw, precision=precision, batch_size=batch_size,
                      pairs=pair_nodes(before, after), passes=results, passes_error=error)


# ------------------------------------------------------------------------------------------------ text


def _shape_text(info: OpInfo) -> str:
    s = info.shapes
    keys = [k for k in s if k != "output" and s[k] is not None]
    return " @ ".join("x".join(map(str, s[k])) for k in keys[:2]) + (" (+v)" if "value" in s else "")


def _gflop(flops: int | None) -> str:
    return "-" if flops is None else f"{flops / 1e9:.4g}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def summary_line(ins: Inspection) -> str:
    """``Tensor Core FLOP share: 0.5% before -> 99.9% after passes (0.1342 GFLOP of GEMM/conv at batch 32)``."""
    after = _pct(ins.share_after()) if ins.passes_ran else "n/a (passes not run)"
    return (f"Tensor Core FLOP share: {_pct(ins.share_before())} before -> {after} after passes "
            f"({ins.total_gflop():.4g} GFLOP of GEMM/conv at batch {ins.batch_size})")


def format_text(ins: Inspection) -> str:
    """The human report: header, an aligned table (before row, then an ``after`` row per node), the passes,
    the summary line, and a hint to use ``--target`` when judging against the CPU."""
    hw = ins.hardware
    cc = f", sm {hw.compute_capability}" if hw.compute_capability else ""
    lines = [f"tctune inspect {ins.model}: {hw.name} ({hw.arch}{cc}), precision {ins.precision}, "
             f"batch {ins.batch_size}", ""]
    header = ("MODULE", "OP", "SHAPES (input @ weight)", "DTYPE", "GFLOP", "TC", "REASON")
    rows: list[tuple[str, ...]] = []

    def row(module: str, op: str, info: OpInfo | None, note: str = "") -> tuple[str, ...]:
        if info is None:
            return (module, op, note, "", "", "", "")
        return (module, op, _shape_text(info), info.dtype, _gflop(info.flops),
                "yes" if info.tensor_core else "no", info.reason)

    rewrote: dict[str, list[str]] = {}  # node -> the passes that changed it (same shapes: a folded weight)
    for r in ins.passes:
        for name in r.changed:
            rewrote.setdefault(name, []).append(r.name)
    for p in ins.pairs:
        if p.before is not None:
            rows.append(row(p.before.module, p.before.op, p.before))
            if not ins.passes_ran:
                continue
            if p.after is None:
                rows.append(("", "  after", "removed by the passes (fused or folded)", "", "", "", ""))
            elif p.after.to_dict() == p.before.to_dict():
                by = rewrote.get(p.before.node)
                rows.append(("", "  after", f"same shapes, rewritten by {', '.join(by)}" if by else "unchanged", "",
                             "", "yes" if p.after.tensor_core else "no", ""))
            else:
                rows.append(row("", "  after", p.after))
        else:
            rows.append(row(p.after.module, p.after.op, None, "(not in the original graph)"))
            rows.append(row("", "  after", p.after))
    if not rows:
        lines.append("no matmul or convolution found in the captured graph")
    else:
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        widths[-1] = 0
        fmt = lambda r: "  ".join(c.ljust(w) if i < 4 or i == 5 else (c.rjust(w) if i == 4 else c)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        lines.append(fmt(header))
        lines.extend(fmt(r) for r in rows)
    lines.append("")
    if ins.passes_ran:
        lines.append(f"passes at {ins.precision}:")
        for r in ins.passes:
            what = f"{r.count} change(s)" + (f": {', '.join(r.changed[:8])}" + (" ..." if len(r.changed) > 8 else "")
                                              if r.changed else "")
            if r.skipped:
                what += f"; {len(r.skipped)} skipped"
            lines.append(f"  {r.name}: {what}")
            padded = r.notes.get("padded") if isinstance(r.notes, dict) else None
            if padded:
                for node, dims in list(padded.items())[:8]:
                    lines.append(f"    {node}: " + ", ".join(f"{k} {a}->{b}" for k, (a, b) in dims.items()))
            reasons: dict[str, list[str]] = {}
            for sk in r.skipped:
                reasons.setdefault(sk.reason, []).append(sk.node)
            for reason, nodes in list(reasons.items())[:6]:  # grouped: one line per distinct reason
                more = f" (+{len(nodes) - 3} more)" if len(nodes) > 3 else ""
                lines.append(f"    skipped {', '.join(nodes[:3])}{more}: {reason}")
    else:
        lines.append(f"passes not run: {ins.passes_error}")
    lines.append("")
    lines.append(summary_line(ins))
    if not hw.is_gpu:
        lines.append("tip: judged against the CPU, which has no Tensor Cores; add --target h100 (or a100, l4, "
                     "v100, sm_90, ...) to see what a GPU would do with this model")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- CLI

_EPILOG = """\
The model file is executed as `python model.py` would execute it: only inspect files you trust.

Eligibility rules (NVIDIA Deep Learning Performance Guide: "Matrix Multiplication Background" and
"Convolutional Layers" user's guides): fp32 needs --precision tf32 or lower; the precision must be one
the GPU's Tensor Cores take; N and K of a GEMM, Cin and Cout of a convolution must be multiples of
16 bytes (8 fp16/bf16, 4 tf32, 16 fp8) or the op runs far slower (fp16 K=8191: 140 vs 646 TFLOP/s on
an H200); depthwise convolutions are memory-bound; ops under 2^15 multiply-adds are too small to matter.
M (batch x tokens) is never checked.

examples:
  tctune inspect recipes/seed_cnn.py --target h100
  tctune inspect recipes/bert_base.py --target a100 --precision fp16 --batch-size 64 --json
"""


def register(subparsers) -> str:
    """Add the ``inspect`` subcommand to ``subparsers``; returns its name."""
    p = subparsers.add_parser(
        "inspect", help="list every matmul/conv, whether it runs on Tensor Cores and why not, before and after the passes",
        description="Capture MODEL_FILE, list every matmul and convolution with its shapes, precision, FLOPs and "
                    "Tensor Core eligibility on the target, run tctune's graph passes and show what they change.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_file", metavar="MODEL_FILE",
                   help="Python file defining build_model() and example_inputs(batch_size) (it is executed)")
    p.add_argument("--target", metavar="NAME",
                   help="judge for this GPU (h100, a100, v100, l4, sm_90, ...); default: the detected GPU, else the CPU")
    p.add_argument("--precision", choices=_PRECISIONS,
                   help="compute precision (default: bf16 where the target has it, else fp16; fp32 on the CPU)")
    p.add_argument("--batch-size", type=int, default=32, metavar="N", help="batch size of the shapes (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return "inspect"


def run(args) -> int:
    """Run ``tctune inspect``; prints the table (or JSON) and returns 0. Errors are TctuneError subclasses."""
    ins = inspect_model_file(args.model_file, target=args.target, precision=args.precision,
                             batch_size=args.batch_size)
    if args.json:
        print(json.dumps(ins.to_dict(), indent=2))
    else:
        print(format_text(ins))
    return 0
