"""tctune's graph passes: pure rewrites of ``torch.export`` ATen graphs, run and tested on the CPU.

Each pass is a function ``(gm: torch.fx.GraphModule, spec: PassSpec) -> PassResult`` that mutates ``gm`` in
place and reports what it changed and what it skipped, and why. ``run_pipeline`` runs them in order.
This package imports torch only, never ``tctune``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from passes.base import DEFAULT_KEEP_LIST, PRECISIONS, PassFailure, PassResult, PassSpec, Skip
from passes.cast_fp8 import cast_fp8_linears
from passes.cast_precision import cast_precision
from passes.fold_bn import fold_conv_batchnorm
from passes.fuse_attention import fuse_attention
from passes.fuse_epilogue import fuse_epilogue
from passes.fuse_qkv import fuse_qkv
from passes.pad_linear import pad_linear_dims
from passes.pad_conv import pad_conv_channels
from passes.pad_matmul import pad_matmul_dims
from passes.simplify_attention_mask import simplify_attention_mask

#: The default order: fold BN first (fewer ops to cast); fuse hand-written attention into SDPA *before*
#: simplifying masks (so an all-zero float mask that the fusion hands to SDPA is dropped too); fuse QKV
#: before padding (the fused N is padded once); pad before the epilogue fusion (which looks through
#: pad_linear_dims' slice, so padded linears keep their padding and still get the epilogue); cast
#: precision last (it sees the final set of ops and weights).
PIPELINE: tuple[str, ...] = (
    "fold_conv_batchnorm",
    "fuse_attention",
    "simplify_attention_mask",
    "fuse_qkv",
    "pad_linear_dims",
    "pad_matmul_dims",
    "pad_conv_channels",
    "fuse_epilogue",
    "cast_fp8_linears",  # precision fp8 only: bf16 cast + FP8 GEMMs (cast_precision then skips)
    "cast_precision",
)

PASSES: dict[str, Callable[[torch.fx.GraphModule, PassSpec], PassResult]] = {
    "fold_conv_batchnorm": fold_conv_batchnorm,
    "fuse_attention": fuse_attention,
    "simplify_attention_mask": simplify_attention_mask,
    "fuse_qkv": fuse_qkv,
    "pad_linear_dims": pad_linear_dims,
    "pad_matmul_dims": pad_matmul_dims,
    "pad_conv_channels": pad_conv_channels,
    "fuse_epilogue": fuse_epilogue,
    "cast_fp8_linears": cast_fp8_linears,
    "cast_precision": cast_precision,
}


def run_pipeline(
    gm: torch.fx.GraphModule, spec: PassSpec, names: Sequence[str] = PIPELINE
) -> list[PassResult]:
    """Run the passes ``names`` on ``gm`` in order, in place.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (``ExportedProgram.module()``).
        spec: target facts shared by every pass.
        names: pass names, in order; each must be a key of ``PASSES``.

    Returns:
        One ``PassResult`` per pass, in the order run.

    Raises:
        ValueError: a name is not a known pass (raised before any pass runs).
        PassFailure: a pass raised; the message names it and the passes that ran before it, the original
            exception is chained as ``__cause__``, and ``pass_name`` / ``ran_before`` are set on the error.
            ``gm`` may be partly rewritten by then; re-capture the model before retrying.
    """
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass(es) {unknown}; known passes: {sorted(PASSES)}")
    results: list[PassResult] = []
    for name in names:
        try:
            results.append(PASSES[name](gm, spec))
        except Exception as exc:
            ran = [r.name for r in results]
            err = PassFailure(
                f"pass {name!r} failed: {type(exc).__name__}: {exc} (passes run before it: {ran or 'none'})"
            )
            err.pass_name = name
            err.ran_before = ran
            raise err from exc
    return results


__all__ = [
    "DEFAULT_KEEP_LIST",
    "PASSES",
    "PIPELINE",
    "PRECISIONS",
    "PassFailure",
    "PassResult",
    "PassSpec",
    "Skip",
    "cast_fp8_linears",
    "cast_precision",
    "fold_conv_batchnorm",
    "fuse_attention",
    "fuse_epilogue",
    "fuse_qkv",
    "pad_conv_channels",
    "pad_linear_dims",
    "pad_matmul_dims",
    "run_pipeline",
    "simplify_attention_mask",
]
