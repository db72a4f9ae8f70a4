"""The cast policy: which ops a low-precision graph keeps in FP32, and the :class:`PassSpec` for one candidate.

Built from the hardware facts the passes need (duck-typed: any object with ``alignment``, a dict of elements
per dtype, and ``arch``, a Tensor Core generation name or ``"cpu"``), so this package stays free of tctune.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from passes.base import PassSpec

#: Precision policies of the cast pass: ``autocast`` keeps the FP32 keep-list, residual adds and embeddings in
#: FP32 (autocast's accuracy); ``pure`` casts everything but losses and unsafe reductions (as ``model.half()``).
POLICIES = ("autocast", "pure")
#: What the "pure" policy still keeps in FP32: losses and the ops whose low-precision results are unsafe.
PURE_KEEP_LIST = frozenset({"cross_entropy_loss", "nll_loss", "nll_loss_nd", "mse_loss", "kl_div",
                            "binary_cross_entropy_with_logits", "smooth_l1_loss", "l1_loss", "cumsum", "prod",
                            "logsumexp"})


def pass_spec(hw, precision: str, *, training: bool = False, policy: str = "autocast",
              fp8_keep: Iterable[str] = (), pad_graph_outputs: bool = True,
              restore_output_dtypes: bool = True, fp8_fast_accum: bool = False) -> PassSpec:
    """The plain facts the graph passes need for one candidate.

    Args:
        hw: hardware facts with ``alignment`` (dtype -> elements, e.g. ``{"fp16": 8}``; ``{}`` on the CPU) and
            ``arch`` (``"Hopper"``, ``"Blackwell"``, ``"cpu"``...), e.g. a ``tctune.hardware.HardwareSpec``.
        precision: ``"fp32"``, ``"tf32"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        training: True when the rewritten graph will be trained.
        policy: one of :data:`POLICIES`.
        fp8_keep: at precision fp8, ``fnmatch`` patterns of module paths whose linears stay bf16.
        pad_graph_outputs: ``PassSpec.pad_graph_outputs``: False when Inductor compiles the graph without a
            measurement to choose (``tctune.backend``), so ``pad_linear_dims`` leaves the N of a linear the graph
            returns unpadded.
        restore_output_dtypes: ``PassSpec.restore_output_dtypes``: False leaves the graph's floating outputs in
            the dtype they were computed in (the ``"compute"`` output contract) instead of casting them back to
            the FP32 model's dtypes.
        fp8_fast_accum: at precision fp8, ``PassSpec.fp8_fast_accum`` (``torch._scaled_mm``'s ``use_fast_accum``);
            ignored (False) at other precisions.

    Raises:
        ValueError: ``policy`` is not in :data:`POLICIES`, or ``precision`` is not one PassSpec accepts.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    # Row-wise FP8 scaling is what cuBLAS offers on sm_89/sm_90; Blackwell's cuBLAS lacks it (passes/cast_fp8.py).
    scaling = "tensor" if hw.arch == "Blackwell" else "row"
    extra = {"keep_list": PURE_KEEP_LIST, "residual_fp32": False} if policy == "pure" else {}
    spec = PassSpec(precision=precision, alignment=dict(hw.alignment), arch=hw.arch, training=training,
                    fp8_scaling=scaling, pad_graph_outputs=pad_graph_outputs,
                    restore_output_dtypes=restore_output_dtypes,
                    fp8_fast_accum=bool(fp8_fast_accum) and precision == "fp8", **extra)
    keep = tuple(fp8_keep)
    return dataclasses.replace(spec, fp8_keep=keep) if keep else spec


__all__ = ["POLICIES", "PURE_KEEP_LIST", "pass_spec"]
