"""tctune's graph passes: pure rewrites of ``torch.export`` ATen graphs, run and tested on the CPU.

Each pass is a function ``(gm: torch.fx.GraphModule, spec: PassSpec) -> PassResult`` that mutates ``gm`` in
place and reports what it changed and what it skipped, and why. ``run_pipeline`` runs them in order on one
graph; ``build_graph`` builds a candidate's graph from an untouched capture (copy, fp16 overflow calibration,
a pass that raises left out with its reason). The cast policy and the ``PassSpec`` for a hardware target are
in ``passes.policy``. This package imports torch only, never ``tctune``.
"""
from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from typing import Callable, Sequence

import torch

from passes._graph import deferred_recompile
from passes.base import DEFAULT_KEEP_LIST, PRECISIONS, PassFailure, PassResult, PassSpec, Skip
from passes.calibrate import calibrate_ranges, overflow_nodes
from passes.copy_linear_inputs import copy_linear_inputs
from passes.dense_attention_inputs import dense_attention_inputs
from passes.cast_fp8 import cast_fp8_linears
from passes.cast_precision import cast_precision
from passes.fold_bn import fold_conv_batchnorm
from passes.fuse_attention import fuse_attention
from passes.fuse_conv_relu import fuse_conv_relu
from passes.fuse_epilogue import fuse_epilogue
from passes.fuse_qkv import fuse_qkv
from passes.pad_linear import pad_linear_dims
from passes.pad_conv import pad_conv_channels
from passes.pad_matmul import pad_matmul_dims
from passes.simplify_attention_mask import simplify_attention_mask

#: The default order: fold BN first (fewer ops to cast); fuse hand-written attention into SDPA *before*
#: simplifying masks (so an all-zero float mask that the fusion hands to SDPA is dropped too); give SDPA's
#: remaining inputs a stride-1 last dimension after that (a dropped mask needs no copy); fuse QKV
#: before padding (the fused N is padded once); pad before the epilogue fusion (which looks through
#: pad_linear_dims' slice, so padded linears keep their padding and still get the epilogue); copy strided
#: linear inputs after fuse_qkv and the padding (a fused group's input and a padded K are already row-major
#: copies, so nothing is copied twice) and before the epilogue and FP8 rewrites (which reshape the input to
#: 2-D); fuse convolution + ReLU after BN folding and channel padding (a padded convolution keeps its slice and
#: is left alone); cast precision last (it sees the final set of ops and weights).
PIPELINE: tuple[str, ...] = (
    "fold_conv_batchnorm",
    "fuse_attention",
    "simplify_attention_mask",
    "dense_attention_inputs",
    "fuse_qkv",
    "pad_linear_dims",
    "pad_matmul_dims",
    "pad_conv_channels",
    "copy_linear_inputs",
    "fuse_epilogue",
    "fuse_conv_relu",
    "cast_fp8_linears",  # precision fp8 only: bf16 cast + FP8 GEMMs (cast_precision then skips)
    "cast_precision",
)

PASSES: dict[str, Callable[[torch.fx.GraphModule, PassSpec], PassResult]] = {
    "fold_conv_batchnorm": fold_conv_batchnorm,
    "fuse_attention": fuse_attention,
    "simplify_attention_mask": simplify_attention_mask,
    "dense_attention_inputs": dense_attention_inputs,
    "fuse_qkv": fuse_qkv,
    "pad_linear_dims": pad_linear_dims,
    "pad_matmul_dims": pad_matmul_dims,
    "pad_conv_channels": pad_conv_channels,
    "copy_linear_inputs": copy_linear_inputs,
    "fuse_epilogue": fuse_epilogue,
    "fuse_conv_relu": fuse_conv_relu,
    "cast_fp8_linears": cast_fp8_linears,
    "cast_precision": cast_precision,
}


def run_pipeline(
    gm: torch.fx.GraphModule, spec: PassSpec, names: Sequence[str] = PIPELINE,
    seconds: dict[str, float] | None = None,
) -> list[PassResult]:
    """Run the passes ``names`` on ``gm`` in order, in place.

    Args:
        gm: an ATen-level graph module from ``torch.export`` (``ExportedProgram.module()``).
        spec: target facts shared by every pass.
        names: pass names, in order; each must be a key of ``PASSES``.
        seconds: when given, each pass's wall time in seconds (``time.perf_counter``) is added to
            ``seconds[name]`` (a pass that raises is not recorded).

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
    with deferred_recompile():  # one code generation for the passes that rewrote gm, not one per pass
        _run_passes(gm, spec, names, seconds, results)
    return results


def _run_passes(gm, spec, names, seconds, results) -> None:
    for name in names:
        t0 = time.perf_counter()
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
        if seconds is not None:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0


#: Passes that decide a candidate's precision: leaving one out would measure a graph that is not at the precision
#: it claims, so :func:`build_graph` re-raises their failure instead of skipping them.
CASTS: tuple[str, ...] = ("cast_fp8_linears", "cast_precision")


def build_graph(gm: torch.fx.GraphModule, spec: PassSpec, names: Sequence[str] = PIPELINE,
                calibration: Sequence[tuple] | None = None) -> tuple[torch.fx.GraphModule, list[PassResult]]:
    """A candidate's graph: a deep copy of ``gm`` with the passes ``names`` run for ``spec`` (``gm`` untouched).

    At precision fp16 with ``calibration`` inputs, the copy is run in FP32 on them just before the first cast
    pass; nodes whose max |activation| comes within ``spec.overflow_margin`` of fp16's 65504 go into
    ``spec.fp32_nodes`` and stay FP32 (``passes.calibrate``; the cast pass names their source modules).

    A pass that raises (other than a cast pass, see :data:`CASTS`) does not fail the graph: it is built again
    from ``gm`` without that pass, and the pass's result says it was skipped and why (one ``Skip`` on node
    ``"<graph>"``, the error in ``notes["failed"]``).

    Args:
        gm: an ATen-level graph module from ``torch.export`` (not modified).
        spec: target facts (``passes.policy.pass_spec`` builds one from hardware facts).
        names: pass names, in order; each a key of ``PASSES``.
        calibration: input tuples for the fp16 overflow analysis (ignored at other precisions).

    Returns:
        ``(graph, results)``: the rewritten copy, and one ``PassResult`` per name in ``names`` order.

    Raises:
        ValueError: an unknown pass name.
        PassFailure: a cast pass raised (the message names it and the passes that ran before it).
    """
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise ValueError(f"unknown pass(es) {unknown}; known passes: {sorted(PASSES)}")
    failed: dict[str, PassFailure] = {}
    while True:
        run = [n for n in names if n not in failed]
        try:
            g, results = _build_once(gm, spec, run, calibration)
            break
        except PassFailure as exc:
            if exc.pass_name in CASTS or exc.pass_name in failed:
                raise
            failed[exc.pass_name] = exc
    by_name = {r.name: r for r in results}
    out = []
    for name in names:
        if name in failed:
            reason = f"{failed[name]}; the graph was rebuilt without this pass"
            out.append(PassResult(name, g, skipped=[Skip("<graph>", reason)], notes={"failed": str(failed[name])}))
        else:
            out.append(by_name[name])
    return g, out


def _build_once(gm, spec, names, calibration):
    with warnings.catch_warnings():  # deepcopy of an exported module warns about pytree internals
        warnings.simplefilter("ignore", FutureWarning)
        g = copy.deepcopy(gm)
    if calibration and spec.precision == "fp16":
        split = next((i for i, n in enumerate(names) if n in CASTS), len(names))
        results = run_pipeline(g, spec, names[:split])
        with torch.inference_mode():
            ranges = calibrate_ranges(g, list(calibration))
        spec = dataclasses.replace(spec, fp32_nodes=overflow_nodes(ranges, spec.precision, spec.overflow_margin))
        return g, results + run_pipeline(g, spec, names[split:])
    return g, run_pipeline(g, spec, names)


__all__ = [
    "CASTS",
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
    "copy_linear_inputs",
    "dense_attention_inputs",
    "fold_conv_batchnorm",
    "fuse_attention",
    "fuse_conv_relu",
    "fuse_epilogue",
    "fuse_qkv",
    "pad_conv_channels",
    "pad_linear_dims",
    "pad_matmul_dims",
    "build_graph",
    "run_pipeline",
    "simplify_attention_mask",
]
