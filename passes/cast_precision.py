"""Rewrite a graph to compute in fp16 / bf16, with numerically fragile ops kept in FP32.

Why: precision lives in the graph, not in run-time autocast (weights stored in the low dtype once, casts as
explicit nodes).
One explicitly typed graph feeds every consumer: TensorRT 10/11 builds *strongly typed* networks (TRT 11
removed the FP16 builder flag, so the precision must already be in the ONNX), ONNX Runtime, AOTInductor and
the ``torch.compile`` backend. Tensor Cores run fp16/bf16 GEMMs at 13x the fp32 rate on the H200 (649-688
against 51 TFLOP/s at 8192^3, benchmarks/NOTES.md, reference measurements).

Rules, applied in one pass in graph (topological) order, tracking each value's dtype from the ``meta["val"]``
of placeholders and ``get_attr`` nodes (``meta`` is not updated by FX, so the pass propagates dtypes itself):

* Weights (floating ``get_attr`` tensors) read only by ops off the keep-list are stored in the low dtype,
  once, under the same attribute name. Those read by a keep-list op (layer-norm / batch-norm parameters and
  statistics) stay FP32. A weight read by both kinds stays FP32 and the other readers get one shared cast
  node: accuracy first, and such sharing is rare.
* Ops on the keep-list (``spec.keep_list``: softmax, norms, reductions, exp/log, losses) see their floating
  inputs in the dtype the original graph gave them (FP32): low inputs get a cast up.
* Every other op with floating tensor inputs gets them in the low dtype (fp32 inputs, including graph inputs
  and factory-op outputs such as ``aten.full``, get a cast down), so mixing never silently promotes back to
  FP32; its floating outputs are then low. Explicit conversions in the model (``aten._to_copy``,
  ``aten.to.dtype``, ops given a ``dtype=``) keep their inputs and output dtype.
* Residual stream in FP32, as ``torch.autocast`` does it. Under autocast ``add(linear_out_bf16,
  residual_fp32)`` promotes to FP32, so the residual stream of a transformer stays FP32 between norms;
  rounding it to bf16 at every layer doubled BERT-base's error on the H200 (relative L2 1.2e-2 against
  autocast's 5.5e-3, benchmarks/NOTES.md, "walking skeleton"). So an elementwise ``add`` / ``sub`` whose original
  output is FP32 runs in FP32 (inputs cast up) when (a) its output feeds a keep-list op (the add before a
  layer_norm / softmax), or (b) one of its floating inputs is an *FP32 anchor*: the FP32 output of a
  keep-list op, of such a residual add, or of a layout/identity op (view, reshape, transpose, dropout,
  ...) applied to an anchor (these ops follow their input's dtype under autocast, so they stay FP32 here
  too, and the cast down moves to the GEMM that reads them). The skip reason names the rule
  (``"residual: add stays FP32 (feeds layer_norm)"``). Weights are unaffected: a linear's weight is still
  stored low; only the activations entering these adds are cast up.
* Embedding tables read only by ``aten.embedding`` stay FP32 and the lookup runs in the table's dtype, as
  under autocast (a lookup is a gather: no Tensor Core work to gain). Rounding BERT's tables to bf16 put a
  2e-3 relative error into the whole residual stream (measured on tests/zoo.py's small BERT on the CPU);
  an FP32 lookup is an FP32 anchor. Under ``PassSpec.residual_fp32`` (the autocast policy) so does a weight
  read only by explicit conversions up to FP32 (``self.inv_freq[None, :].float()``: autocast never rounds a
  stored weight; ``model.to(dt)`` does, the pure policy's reference); it and its views are FP32 anchors.
* Autocast policy (``PassSpec.residual_fp32``): outside the ops on ``torch.autocast``'s lower-precision list
  (:data:`_LOW_COMPUTE_OPS`: GEMMs, convolutions, attention, tctune's fused convolutions) an op computes in its
  inputs' promoted dtype, as under autocast: one reading an FP32 value (a graph input, an FP32 anchor, an FP32
  weight) computes in FP32 and its output is an FP32 anchor (``"autocast: div reads an FP32 value and computes
  in FP32"``), and a weight no such op reads (an RMSNorm weight applied as a ``mul``, a layer scale, a position
  embedding) stays FP32. Pure moves (:data:`_MOVE_OPS`: padding, ``roll``, ``cat``, layout) whose readers all
  lead to such ops move low values instead (a cast down commutes with them exactly). Before, every other op
  computed low: PatchTST's input scaler and Granite's scaled lookup ran bf16 (graph error 3.1e-3 against
  autocast eager's 2.9e-4 for a tiny PatchTST, Inductor's code generation replaced); now the tiny PatchTST,
  Granite, Llama, T5 and GPT-2 graphs match autocast eager's error to two digits (benchmarks/NOTES.md).
  Inductor computes fused elementwise chains in FP32 anyway, so through the backend most of the gain is at kernel
  boundaries; an exported engine computes what the graph says.
* Tied weights stay one tensor. A table tied to an LM head (``lm_head.weight is wte.weight``: ``torch.export``
  reads it through one ``get_attr``, used by the lookup and the GEMM, while the module binds it under both
  names) is stored low *once*, under every name bound to it, as one object: ``model.to(dt)``'s storage. Its
  lookups gather low rows, exactly ``model.to(dt)``'s rows; under ``PassSpec.residual_fp32`` (the autocast
  policy) the gathered rows are cast up to FP32 at once (an FP32 anchor: the residual stream starts FP32, as
  under autocast; exact, and it touches ``(batch, seq, D)`` rows, not the ``V x D`` table). The alternatives
  cost more: an FP32 table beside a low head copy is 1.5x the FP32 bytes (GPT-2 small's 50257 x 768 table:
  154 MB FP32 + 77 MB bf16), and one FP32 table cast at every call re-reads 154 MB and writes 77 MB per
  forward pass. ``notes["weights_tied"]`` lists each group stored as one.
* Overflow (``spec.fp32_nodes``, from ``passes.calibrate``): a node whose calibrated max |x| exceeds the
  low dtype's range / margin runs in FP32 (inputs cast up, FP32 weights), and so does every op reading it
  (casting its value down would overflow there). The reason quotes the value and the source module from
  ``node.meta["nn_module_stack"]``: ``"overflow: max |x| 7.1e4 > 65504/2 at fp16 (module
  encoder.layer.3.output.dense)"``.
* Explicit up-casts in the model stay: a value the model converts to FP32 itself (``x.float()``,
  ``x.to(torch.float32)``, ``positions.float()``: RMSNorm statistics, rotary angles, GPT-Neo's attention
  scores), and a factory given ``dtype=torch.float32`` (``arange(n, dtype=torch.float32)`` of a diffusion
  timestep's sinusoid), is an *explicit FP32* value, and an op whose floating inputs are all explicit FP32 values (or FP32
  anchors; 0-dim constants do not count, unless every input is 0-dim: ``1 - 0.99 ** step.float()``) runs in
  FP32, GEMMs included, as ``model.to(dt)`` computes it. Where
  such a value meets a low one (``weight * x.to(input_dtype)``) the op runs low, as the model's cast back to its
  own dtype does under ``model.to(dt)``. Casting these ops down instead put a tiny Llama's bf16 error (rotary
  positions rounded to bf16, RMSNorm statistics in bf16) at 4x that of ``model.to(torch.bfloat16)``.
* Constants outside the low dtype's range (a mask filled with ``torch.finfo(torch.float32).min``,
  ``masked_fill(mask, -1e9)`` at fp16) saturate to the low dtype's finite range (``torch.finfo(dt).max``):
  a Python-scalar fill value of an op computing low (``masked_fill``, ``where``, ``full_like``, ``mul``,
  ``add``, ..., and their in-place forms such as ``masked_fill_``; PyTorch raises "value cannot be converted
  to type c10::Half without overflow" on the fill ones), a weight or lifted constant stored low, and an FP32 value computed from such a constant (a
  ``full(..., dtype=torch.float32)`` mask) when it is cast down (a ``clamp`` before the cast). Infinities are
  not touched: a deliberate ``-inf`` mask stays ``-inf`` (fp16 and bf16 hold it), except in a value that also
  carries such a constant, whose cast down saturates it too. ``notes["constants_saturated"]`` lists each.
* Ops with no fp16 / bf16 kernel (:func:`no_low_precision_kernel`: the FFT family, LAPACK-style linear-algebra
  solvers, pairwise distances, quantiles, complex constructors) run in FP32 whatever the policy or keep-list: their floating inputs are cast up, their FP32 (or
  complex) outputs are cast down by the low-precision ops that read them. Casting them down made the whole
  graph fail ("Unsupported dtype BFloat16" from ``fft_fftn`` in Hugging Face's FNet on the H200), so the
  backend fell back to plain Inductor. The reason is in ``skipped`` and ``notes["no_low_precision_kernel"]``.
* Writes in place (``passes._graph.written_nodes``: ``add_``, ``copy_``, ``index_copy_``, slice assignment,
  BatchNorm's running statistics in training mode) keep the original graph's dtypes: the written tensor, the
  views the write goes through and the writing op are never replaced by a cast (a copy, where the write would be
  lost: an input updated in place, a KV cache, an ``out=`` tensor), the other inputs of the writing op are cast
  to their original dtype, and no cast made before a write is reused after it. A written weight stays FP32.
  The reason is ``"written in place: index_copy_ keeps its dtype"``. Writes into tensors from outside the
  graph (inputs, buffers, views of them) count, and writes through a view into a tensor the graph made; an
  in-place op straight on a tensor the graph made (``relu_`` after a convolution) is cast like its out-of-place
  form. A tensor the graph makes from a low value and fills through views (``buf = scores.new_zeros(...)``;
  ``buf[:, :, :w] = scores``: Longformer's chunked attention; ``out = zeros_like(k)``: RWKV's recurrence) is
  made low, as ``model.to(dt)`` makes it, with its views and the writes into it (the values written are cast to
  its dtype, as the write itself casts them): keeping it FP32 put 90 ops of a tiny Longformer graph in FP32.
* Factories that take their source's dtype (``zeros_like(x)``, ``new_zeros(x, size)``, no ``dtype=``) take the
  source's dtype in the rewritten graph, as they do at run time.
* float64: an op whose result the model computes in float64 (``pos.to(torch.float64)``, float64 rotary angles
  as in diffusers' ``freqs_dtype=torch.float64``) runs as written, inputs in their original dtypes, as under
  ``model.to(dt)``: cast down, float64 angles of positions up to 8192 were off by 1.7 of their scale at bf16.
  A float64 weight or buffer such an op reads stays float64 (stored bf16, a float64 buffer read by an ``outer``
  in float64 came back rounded while the report said float64).
  The reason is ``"float64: mul computes in float64 as the model wrote it"``.
* Regions traced with their own dtypes (higher-order ops other than an activation checkpoint or flex
  attention: ``torch.autocast(enabled=False)`` as ``wrap_with_autocast``, ``cond``, ``while_loop``) run as
  written: their inputs keep the original graph's dtypes (a weight read only by such a region stays FP32) and
  their FP32 outputs are explicit FP32 values. Before, a rotary embedding under ``torch.autocast(enabled=False)``
  (Hugging Face Llama's before it moved to a helper) read a bf16 copy of its FP32 buffer, its FP32-traced body
  failed its dtype check, and the subgraph fell back to plain Inductor. The reason is ``"region:
  wrap_with_autocast runs as written (...)"``.
* An activation-checkpointed region (``torch.utils.checkpoint``: the ``tag_activation_checkpoint`` higher-order
  op) is cast inside its body at bf16, its boundary dtypes unchanged; at fp16 it stays as written (the overflow
  calibration sees the region as one node): ``"checkpointed region: not cast at fp16 (...)"``.
* A graph output that is a graph input or weight, or a view of one (view ops only), keeps its dtype: returned
  exact, as eager returns it, not rounded through the low dtype (such a weight is not stored low).
* Ops that rank values (:data:`_ORDER_OPS`: ``argsort``, ``sort``, ``topk``, ``argmax``, ...) read an FP32 input
  as it is, not a low copy: rounding would merge near-ties and reorder them, so the indices (an integer output,
  compared exactly) would differ from eager's. ViTMAE's random masking ranks an FP32 ``noise`` input with
  ``argsort``: cast, its ``ids_restore`` output differed from FP32 eager and ``model.to(dt)``. An input already
  computed low stays low. The reason is ``"order op: argsort ranks FP32 values as they are"``.
* Integer and bool tensors are never cast; symbolic-size queries, guards, asserts and ``item`` are left alone.
* Graph outputs are cast back to their original dtypes, so the caller sees eager's dtypes and shapes. With
  ``spec.restore_output_dtypes`` False, an output the original graph returned in FP32 is returned in the dtype
  the rewritten graph computed it in (low, or FP32 where a rule above kept its op FP32), as ``model.half()`` /
  ``torch.autocast`` return it: no cast node between the last op and the output. Outputs of any other original
  dtype (integer, bool, a low or float64 value the model returned itself) are still restored.

Casts are ``aten._to_copy.default(x, dtype=...)`` nodes; there is at most one per (value, dtype), inserted
before its first reader, and a cast back to a value's source dtype reuses the source instead of stacking a
second cast.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
from torch import fx

from passes._graph import (alias_targets, checkpoint_body, copy_meta, fake_from_tensor, finish, get_attr_value,
                           op_name, set_attr_tensor, view_base, writes_in_place, writes_outside,
                           written_nodes)
from passes.base import PassResult, PassSpec, Skip
from passes.calibrate import (FINITE_MAX, MAX_ABS_META, NONFINITE_META, CalibrationRanges, ignored_reasons,
                              source_module)
from passes.padding import replace_tensor

NAME = "cast_precision"

_CAST = torch.ops.aten._to_copy.default
_LOW = (torch.float16, torch.bfloat16)
#: Ops whose inputs are inspected, not computed on: never cast their inputs.
_PASSTHROUGH = frozenset(
    {
        "sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "_assert_scalar", "_assert_async",
        "_assert_tensor_metadata", "sym_constrain_range", "sym_constrain_range_for_size", "_local_scalar_dense",
        "item",  # reads the value as a Python number (a tensorified Python float): never rounded to low first
    }
)
#: Elementwise ops that run in FP32 on the residual stream (see the module docstring).
_RESIDUAL_OPS = frozenset({"add", "sub"})
#: Layout / identity ops whose output dtype follows their input under autocast: an FP32 anchor stays FP32.
_FOLLOW_OPS = frozenset(
    {
        "dropout", "view", "_unsafe_view", "reshape", "transpose", "permute", "contiguous", "clone", "select",
        "slice", "expand", "unsqueeze", "squeeze", "alias", "detach", "t", "flatten",
    }
)
#: Ops on ``torch.autocast``'s lower-precision list (GEMMs, convolutions, attention): under the autocast policy
#: they compute low whatever their inputs' dtype; every other op computes in its inputs' dtype.
_LOW_COMPUTE_OPS = frozenset(
    {
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "addr", "einsum",
        "chain_matmul", "linalg_multi_dot", "linalg_vecdot", "_addmm_activation", "prelu", "convolution",
        "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "cudnn_convolution", "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "lstm", "gru",
        "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "_scaled_mm",
        "cudnn_convolution_relu", "cudnn_convolution_add_relu",
        "conv2d_relu", "conv2d_add_relu",  # tctune's fused cuDNN convolutions (passes.cudnn_ops)
    }
)
#: Ops that only move or copy values (layout, padding with zeros, concatenation, gathers): a cast down commutes
#: with them exactly, so under the autocast policy one whose readers all lead to :data:`_LOW_COMPUTE_OPS` moves
#: low values (the cast before it): half the bytes, the same numbers.
_MOVE_OPS = frozenset(
    {
        "constant_pad_nd", "roll", "cat", "stack", "index_select", "index", "gather", "split", "split_with_sizes",
        "chunk", "unbind", "narrow", "repeat", "as_strided", "unfold", "flip", "pixel_shuffle", "pixel_unshuffle",
        "channel_shuffle", "movedim", "swapaxes", "view_as", "expand_as", "_reshape_alias",
    }
) | _FOLLOW_OPS
#: A tensor constant the model makes (``torch.tensor([...])``, ``torch.tensor([])`` of a KV cache's first layer):
#: export reads the constant through ``lift_fresh_copy``, which must read it as it is. A cast between them made
#: AOTAutograd trace a real tensor ("Please convert all Tensors to FakeTensors first") and the subgraph fell back.
_LIFT_OPS = frozenset({"lift_fresh_copy", "lift_fresh"})
#: Meta-only outputs: shape/type of the input matters, not its values.
_LIKE_OPS = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like"})
#: Factories whose result takes its source's dtype when no ``dtype=`` is given (``new_zeros(src, size)``).
_NEW_OPS = frozenset({"new_zeros", "new_ones", "new_full", "new_empty", "new_empty_strided"})
#: Ops whose result depends on the order of their input's values (indices, ranks, bins): an FP32 input is read
#: as it is (module docstring).
_ORDER_OPS = frozenset({"argsort", "sort", "msort", "topk", "argmax", "argmin", "kthvalue", "searchsorted",
                        "bucketize", "max", "min", "mode", "median", "nanmedian"})
#: Explicit conversions: their FP32 output is an explicit FP32 value (an up-cast the model wrote).
_CONVERSIONS = frozenset({"_to_copy", "to", "_to_dtype", "type_as"})
#: Ops whose Python-scalar arguments become element values (fill values, additive / multiplicative masks):
#: saturated to the low dtype's finite range when the op computes low.
_VALUE_OPS = frozenset(
    {
        "full", "full_like", "new_full", "fill", "masked_fill", "where", "scalar_tensor", "clamp", "clamp_min",
        "clamp_max", "index_fill", "constant_pad_nd", "hardtanh", "scatter", "mul", "add", "sub", "rsub",
    }
)


def _value_op(name: str) -> bool:
    """Whether op ``name`` is one of :data:`_VALUE_OPS` or its in-place form (``masked_fill_``, ``fill_``,
    ``clamp_``, ``add_``: ``torch.export`` keeps a model's in-place ops; XLM fills its attention scores with
    ``masked_fill_(mask, -finfo(float32).max)``, which bf16 cannot hold)."""
    return _out_of_place(name) in _VALUE_OPS


def _out_of_place(name: str) -> str:
    """The out-of-place form of an in-place op name (``add_`` -> ``add``); other names unchanged."""
    return name[:-1] if name.endswith("_") and not name.startswith("_") else name


#: ``node.meta`` flag on the casts this pass inserts (never taken for the model's own conversions).
_OWN_CAST = "tctune_cast"
#: The same flag for callers that insert a cast this pass must not take for one the model wrote (an up-cast
#: there would make an explicit FP32 value): its output is then typed like an FP32 graph input.
INSERTED_CAST = _OWN_CAST
#: ``node.meta`` flag on the casts this pass inserts that are FP32 anchors (a tied table's rows cast up).
_OWN_ANCHOR = "tctune_cast_anchor"

#: FFT ops: ``fft_*`` as ``torch.export`` keeps them, ``_fft_r2c`` / ``_fft_c2c`` / ``_fft_c2r`` after decomposition.
_FFT_PREFIXES = ("fft_", "_fft_")
_FFT_OPS = frozenset({"stft", "istft"})
_FFT_REASON = ("FFT has no bf16 kernel on any device, and fp16 only on CUDA for power-of-two sizes "
               "(torch._refs.fft._promote_type_fft accepts float32, float64 and, on CUDA, float16)")
#: Linear-algebra solvers and factorizations: the LAPACK (CPU), cuSOLVER / MAGMA (CUDA) kernels behind them are
#: float32 / float64 only. Evidence: on the CPU (torch 2.13) bf16 and fp16 inputs raise for inv ("Low precision
#: dtypes not supported", the check torch._meta_registrations.checkFloatingOrComplex also makes for inv_ex and
#: slogdet), svd, qr, eigh, det, solve and lstsq ("not implemented for 'BFloat16'"). The few that accept low
#: precision somewhere (Cholesky, triangular solve on the CPU) lose most of their digits in it, so every solver
#: stays FP32.
_SOLVER_OPS = frozenset(
    {
        "linalg_inv", "linalg_inv_ex", "inverse", "linalg_det", "_linalg_det", "det", "linalg_slogdet",
        "_linalg_slogdet", "slogdet", "logdet", "linalg_svd", "_linalg_svd", "linalg_svdvals", "svd",
        "linalg_eigh", "_linalg_eigh", "linalg_eigvalsh", "linalg_eig", "linalg_eigvals", "_linalg_eigvals",
        "linalg_qr", "qr", "geqrf", "orgqr", "ormqr", "linalg_householder_product", "linalg_solve",
        "linalg_solve_ex", "_linalg_solve_ex", "linalg_lstsq", "linalg_lu", "linalg_lu_factor",
        "linalg_lu_factor_ex", "linalg_lu_solve", "lu_solve", "linalg_cholesky", "linalg_cholesky_ex", "cholesky",
        "cholesky_solve", "cholesky_inverse", "linalg_pinv", "pinverse", "linalg_matrix_rank", "linalg_cond",
        "linalg_ldl_factor", "linalg_ldl_factor_ex", "linalg_ldl_solve", "linalg_solve_triangular",
        "triangular_solve", "linalg_tensorinv", "linalg_tensorsolve",
    }
)
_SOLVER_REASON = "linear-algebra solver: its LAPACK / cuSOLVER / MAGMA kernels take float32 and float64 only"
#: Other ops whose kernels take float32 / float64 only, each raising on a bf16 and an fp16 input on the CPU (torch
#: 2.13): pairwise distances ("cdist" / "pdist" not implemented for 'BFloat16'), quantiles ("input tensor must be
#: either float or double dtype", a dtype check shared by every device), and complex-number constructors (there
#: is no complex bf16 dtype, and PyTorch calls complex32 experimental).
_OTHER_OPS: dict[str, str] = {
    **dict.fromkeys(("cdist", "_cdist_forward", "pdist", "_pdist_forward"),
                    "pairwise distance: its kernels take float32 and float64 only"),
    **dict.fromkeys(("quantile", "nanquantile"), "quantile: its kernels take float32 and float64 only"),
    **dict.fromkeys(("view_as_complex", "complex", "polar"),
                    "complex result: there is no complex bf16 dtype (complex32 is experimental)"),
}


def no_low_precision_kernel(name: str) -> str | None:
    """Why the ATen op ``name`` (an overload packet, e.g. ``"fft_fftn"``) must compute in FP32, or None.

    The rule does not depend on the device the graph is rewritten on: an op listed here fails (or, for the
    solvers that accept low precision on one device, loses most digits) in fp16 / bf16 on a device tctune
    targets. Ops missing from the lists (``_FFT_PREFIXES``, ``_FFT_OPS``, ``_SOLVER_OPS``, ``_OTHER_OPS``) are
    assumed to have low-precision kernels.
    """
    if name.startswith(_FFT_PREFIXES) or name in _FFT_OPS:
        return _FFT_REASON
    if name in _SOLVER_OPS:
        return _SOLVER_REASON
    return _OTHER_OPS.get(name)


def cast_precision(gm: fx.GraphModule, spec: PassSpec) -> PassResult:
    """Make ``gm`` compute in ``spec.dtype`` (fp16 or bf16) with keep-list ops in FP32, in place.

    Shapes never change. Graph inputs keep their dtype at the call boundary (an FP32 input is cast to the low
    dtype *inside* the graph) and every output is cast back to its original dtype, so callers pass and get
    the same dtypes as eager (with ``spec.restore_output_dtypes`` False, FP32 outputs stay in their computed
    dtype: the module docstring). Floating weights read only by low-precision ops are replaced on the module by
    low-dtype copies (same ``state_dict`` keys, dtype changed).

    Args:
        gm: an ATen-level graph module from ``torch.export`` (mutated in place).
        spec: target facts; ``spec.precision`` selects the low dtype, ``spec.keep_list`` the ATen op names
            (overload packets, e.g. ``"softmax"``) that stay FP32.

    Returns:
        A ``PassResult`` named ``"cast_precision"``: ``count`` is the number of ops now computing in the low
        dtype (``changed`` their names); ``skipped`` lists the ops kept FP32 with the rule that kept them
        (``"keep-list: softmax stays FP32"``, ``"no low-precision kernel: fft_fftn stays FP32 (...)"``,
        ``"explicit FP32: pow reads only values the model cast to FP32"``, ``"residual: ..."``,
        ``"overflow: ..."``), or one ``"<graph>"`` entry when the precision is not fp16/bf16; ``notes`` has
        ``dtype``, ``casts_inserted``, ``weights_low`` / ``weights_fp32`` (attribute names, every alias of a tied
        weight included), ``weights_tied`` (``{first name: [every name]}`` for each tied weight stored low as
        one tensor), ``constants_saturated`` (one line per saturated constant or clamped cast, e.g.
        ``"masked_fill: -1e+09 -> -6.55e+04 (float16 range)"``), ``calibration_ignored`` (``{node: reason}`` for
        infinite or NaN calibration statistics, worded by ``passes.calibrate.ignored_reasons``) and
        ``no_low_precision_kernel`` (``{node: reason}`` for the ops :func:`no_low_precision_kernel` kept FP32).
    """
    result = PassResult(name=NAME, graph_module=gm)
    if spec.precision not in ("fp16", "bf16"):
        reason = (f"precision {spec.precision}: nothing to cast, compute stays FP32" if spec.precision != "fp8"
                  else "precision fp8: the bf16 cast is done by cast_fp8_linears, around its FP8 GEMMs")
        result.skipped.append(Skip("<graph>", reason))
        return result
    low = spec.dtype
    keep = spec.keep_list
    nodes = list(gm.graph.nodes)
    orig = {n: _dtypes(n.meta.get("val")) for n in nodes}
    new: dict[fx.Node, Any] = {}
    big: set[fx.Node] = set()  # FP32 values that may hold finite constants beyond the low range (docstring)
    saturated: list[str] = []
    rewriter = _Caster(gm, new, big, saturated)
    overflow = _overflow_reasons(nodes, spec)
    tied: dict[str, list[str]] = {}
    no_kernel = _no_kernel_reasons(nodes)
    written = written_nodes(gm)
    returned = _returned_input_views(gm)
    weights_low, weights_fp32 = _cast_weights(gm, nodes, keep, low, new, frozenset(overflow) | frozenset(no_kernel),
                                              spec.residual_fp32, big, saturated, tied,
                                              frozenset(written | returned))
    anchors: set[fx.Node] = set()  # FP32 values from keep-list ops / the residual stream (module docstring)
    explicit32: set[fx.Node] = set()  # FP32 values the model converted to FP32 itself, and ops on them only
    if spec.residual_fp32:  # weights only read up to FP32 stay FP32 (_cast_weights), through their views too
        anchors.update(n for n in nodes if n.op == "get_attr" and n.users and n not in new
                       and all(_reads_up(u) for u in n.users))

    for node in nodes:
        if node in written or node in returned or writes_outside(node, written):
            _keep_written(node, orig, new, rewriter, result, low)
            continue
        body = checkpoint_body(gm, node)
        if body is not None:
            _cast_checkpoint_body(body, node, spec, result)
            new[node] = orig[node]
            continue
        _visit(node, orig, new, rewriter, result, keep, low, spec, overflow, anchors, explicit32, big, saturated,
               no_kernel)
        if writes_in_place(node):  # a write into the graph's own tensor (relu_): casts made before hold old values
            rewriter.cache.clear()
        out = new.get(node)
        if node.op == "call_function" and _has_fp32(out):
            ins = node.all_input_nodes
            if node not in explicit32 and any(a in explicit32 for a in ins) and _is_tensor_val(node):
                explicit32.add(node)
            if node not in big and any(a in big for a in ins):
                big.add(node)

    result.notes = {
        "dtype": str(low).replace("torch.", ""),
        "casts_inserted": rewriter.inserted,
        "weights_low": weights_low,
        "weights_fp32": weights_fp32,
        "weights_tied": tied,
        "constants_saturated": saturated,
        "calibration_ignored": _calibration_ignored(nodes),
        "no_low_precision_kernel": no_kernel,
    }
    if result.count or rewriter.inserted or weights_low or saturated:
        finish(gm)
    return result


def _visit(node, orig, new, rewriter, result, keep, low, spec, overflow, anchors, explicit32, big, saturated,
           no_kernel) -> None:
    """Type one node (the rules of the module docstring, in order), recording into the shared maps and sets."""
    if node.op in ("placeholder", "get_attr"):
        new.setdefault(node, orig[node])
        return
    if node.op == "output":
        _cast_outputs(node, orig, new, rewriter, spec.restore_output_dtypes)
        return
    if node.op != "call_function":
        # call_module (_guards_fn) / call_method: left alone.
        new[node] = orig[node]
        return
    if node.target is operator.getitem:
        parent = new.get(node.args[0])
        idx = node.args[1]
        is_seq = isinstance(parent, (list, tuple)) and isinstance(idx, int) and -len(parent) <= idx < len(parent)
        new[node] = parent[idx] if is_seq else orig[node]
        _retype_meta(node, orig[node], new[node])
        if node.args[0] in anchors and new[node] == torch.float32:
            anchors.add(node)
        return
    if _runs_as_written(node):
        # A region traced with its own dtypes (torch.autocast(enabled=False), cond, ...): inputs as the original
        # graph had them, outputs as they were; its FP32 outputs are values the model made FP32 itself.
        rewriter.map_inputs(node, lambda arg: orig.get(arg))
        new[node] = orig[node]
        if _has_fp32(orig[node]):
            explicit32.add(node)
        result.skipped.append(Skip(node.name, f"region: {op_name(node)} runs as written (its body was traced in "
                                              "these dtypes)"))
        return
    if not isinstance(node.target, torch._ops.OpOverload):
        # Python-level ops (symbolic int arithmetic): no tensors to cast.
        new[node] = orig[node]
        return
    if node.meta.get(_OWN_CAST):
        # A saturating clamp or a cast this pass inserted (a second run): already typed.
        new[node] = orig[node]
        if node.meta.get(_OWN_ANCHOR):
            anchors.add(node)  # the up-cast of a tied table's gathered rows stays an FP32 anchor
        return
    name = op_name(node)
    if name in _PASSTHROUGH:
        if name == "_assert_tensor_metadata" and node.kwargs.get("dtype") is not None:
            src = new.get(node.args[0])
            if isinstance(src, torch.dtype) and src != node.kwargs["dtype"]:
                node.kwargs = {**node.kwargs, "dtype": src}
        new[node] = orig[node]
        return
    if _follows_source(node):
        # zeros_like(x) / new_zeros(x, size) without a dtype: the source's dtype in the rewritten graph, as at run
        # time (model.to(dt) makes them low where their source is low).
        _follow_source(node, orig, new, low, saturated)
        return
    if _explicit_dtype(node) or name in _LIKE_OPS or name in _LIFT_OPS:
        # A conversion / factory the model asked for: keep its inputs and its output dtype.
        new[node] = orig[node]
        if orig[node] == torch.float32:
            if name in _CONVERSIONS and not node.meta.get(_OWN_CAST) and node.all_input_nodes:
                explicit32.add(node)  # an up-cast the model wrote (x.float(), positions.float())
            elif (not node.all_input_nodes or name in _LIFT_OPS) and _is_tensor_val(node):
                explicit32.add(node)  # a factory given dtype=torch.float32 (arange(n, dtype=torch.float32)), or
                # a constant the model made (torch.tensor([0.5, 2.0]): FP32 under model.to(dt) too)
            if _big_scalars(node, low):
                big.add(node)  # e.g. full(..., finfo(float32).min, dtype=float32): saturated when cast down
        return
    if _has_dtype(orig[node], torch.float64):
        # The model computes this in float64 itself (float64 angles, positions): as written, as model.to(dt) does.
        rewriter.map_inputs(node, lambda arg: orig.get(arg))
        new[node] = orig[node]
        result.skipped.append(Skip(node.name, f"float64: {name} computes in float64 as the model wrote it"))
        return
    if node.name in no_kernel:
        # No fp16 / bf16 kernel (FFT, solvers): floating inputs back to their original dtype, output as it was.
        rewriter.map_inputs(node, lambda arg: orig.get(arg))
        new[node] = orig[node]
        if _has_fp32(orig[node]):
            anchors.add(node)
        result.skipped.append(Skip(node.name, f"no low-precision kernel: {name} stays FP32 ({no_kernel[node.name]})"))
        return
    if name in _ORDER_OPS and _ranks_fp32(node, name, new):
        # Ranks an FP32 value: read it as it is, as model.to(dt) reads an FP32 input (module docstring).
        new[node] = orig[node]
        result.skipped.append(Skip(node.name, f"order op: {name} ranks FP32 values as they are"))
        return
    if name in keep:
        # Keep-list op: floating inputs back to the dtype the original graph had (FP32).
        rewriter.map_inputs(node, lambda arg: orig.get(arg))
        new[node] = orig[node]
        if _has_float(orig[node]) or _has_float_input(node, orig):
            result.skipped.append(Skip(node.name, f"keep-list: {name} stays FP32"))
        if _has_fp32(orig[node]):
            anchors.add(node)
        return
    if name == "embedding":
        # A lookup runs in its table's dtype (FP32 table: FP32 anchor; low table, e.g. a tied LM head: low).
        table = new.get(node.args[0])
        new[node] = table if isinstance(table, torch.dtype) else orig[node]
        _retype_meta(node, orig[node], new[node])
        if new[node] == torch.float32:
            anchors.add(node)
        elif _lowered(orig[node], new[node]):
            result.changed.append(node.name)
            result.count += 1
            if spec.residual_fp32 and orig[node] == torch.float32:
                # A low table tied to an LM head: the gathered rows go up to FP32 at once (an FP32 anchor), so
                # the residual stream starts FP32 as under autocast; exact, and cheap (rows, not the table).
                up = rewriter.cast_after(node, torch.float32)
                up.meta[_OWN_ANCHOR] = True
                anchors.add(up)
        return
    if node.name in overflow:
        # Calibration saw values the low dtype cannot hold here (or this op reads such a value): FP32.
        rewriter.map_inputs(node, lambda arg: orig.get(arg))
        new[node] = orig[node]
        if _has_fp32(orig[node]):
            anchors.add(node)
        if _big_scalars(node, low):
            big.add(node)
        result.skipped.append(Skip(node.name, overflow[node.name]))
        return
    if orig[node] == torch.float32 and name in _FOLLOW_OPS and _all_float_inputs_in(node, anchors, new):
        # Layout / identity op on an FP32 anchor: follows its input's dtype, as under autocast.
        new[node] = orig[node]
        anchors.add(node)
        return
    if orig[node] == torch.float32 and _in_explicit_fp32(node, explicit32, anchors, new):
        # Every floating input is FP32 because the model made it so: compute as model.to(dt) does, in FP32.
        rewriter.map_inputs(node, lambda arg: orig.get(arg))  # 0-dim constants stored low come back up
        new[node] = orig[node]
        if _big_scalars(node, low):
            big.add(node)
        result.skipped.append(Skip(node.name, f"explicit FP32: {name} reads only values the model cast to FP32"))
        return
    reason = None
    if orig[node] == torch.float32 and _out_of_place(name) in _RESIDUAL_OPS and spec.residual_fp32:
        # ``add_`` / ``sub_`` too (``embeddings += position_embeddings``): a write straight into a tensor the graph
        # made is its out-of-place form here (``passes._graph.written_nodes``); typed low, it had both FP32
        # lookups cast down and the LayerNorm after it read a bf16 sum.
        reason = _residual_reason(node, name, keep, anchors, new)
    if (reason is None and spec.residual_fp32 and _has_fp32(orig[node]) and name not in _LOW_COMPUTE_OPS
            and _reads_fp32_value(node, new) and not (name in _MOVE_OPS and _only_feeds_low_compute(node))):
        # Autocast policy: an op off autocast's lower-precision list computes in its inputs' promoted dtype, so
        # one reading an FP32 value (an input's normalization, an FP32 lookup scaled, an FP32 weight) is FP32.
        reason = f"autocast: {name} reads an FP32 value and computes in FP32"
    if reason is not None:
        # Residual add / sub, or autocast's type promotion: inputs cast up, output FP32 (an FP32 anchor).
        rewriter.map_inputs(node, lambda arg: orig.get(arg))
        new[node] = orig[node]
        anchors.add(node)
        if _big_scalars(node, low):
            big.add(node)
        result.skipped.append(Skip(node.name, reason))
        return
    had_float = rewriter.map_inputs(node, lambda arg: low)
    new[node] = _lower(orig[node], low) if had_float else orig[node]
    _retype_meta(node, orig[node], new[node])
    if _lowered(orig[node], new[node]):
        result.changed.append(node.name)
        result.count += 1
        if _value_op(name):
            saturated.extend(_saturate_scalars(node, low))
    elif _has_fp32(new[node]) and _big_scalars(node, low):
        big.add(node)


def _cast_checkpoint_body(body: fx.GraphModule, node: fx.Node, spec: PassSpec, result: PassResult) -> None:
    """Cast ``body``, the body of the checkpointed region ``node`` (``passes._graph.checkpoint_body``), like a
    graph of its own, at bf16 only:
    its inputs and outputs keep their dtypes (the region's boundary is the original one), its ops compute
    low inside, and the backward recomputes them so. At fp16 the body stays as it is: the overflow calibration
    records the region as one node, so nothing says which of its ops stay FP32."""
    if spec.precision != "bf16":
        result.skipped.append(Skip(node.name, "checkpointed region: not cast at fp16 (no calibration inside it)"))
        return
    inner = cast_precision(body, dataclasses.replace(spec, restore_output_dtypes=True, fp32_nodes=frozenset()))
    result.count += inner.count
    result.changed.extend(f"{node.name}.{n}" for n in inner.changed)
    result.skipped.extend(Skip(f"{node.name}.{s.node}", s.reason) for s in inner.skipped)


def _returned_input_views(gm: fx.GraphModule) -> set[fx.Node]:
    """Graph outputs that are a graph input or a view of one (``x[:, :4]``, ``x.view(-1)``: view ops only, no
    arithmetic), with the views between them and the input. They keep the input's dtype: cast down and back
    up, the caller got the input rounded to fp16 / bf16 in a new tensor where eager returns its exact values
    (and a view of it)."""
    output = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if output is None:
        return set()
    out: set[fx.Node] = set()
    for ret in output.all_input_nodes:
        chain = [ret]
        while chain[-1].op not in ("placeholder", "get_attr"):
            base = view_base(chain[-1])
            if base is None:
                break
            chain.append(base)
        if chain[-1].op in ("placeholder", "get_attr") and len(chain) > 1:
            out.update(chain)
    return out


def _keep_written(node: fx.Node, orig: dict, new: dict, rewriter: "_Caster", result: PassResult,
                  low: torch.dtype) -> None:
    """An op that writes a tensor in place (``add_``, ``copy_``, ``index_copy_``, BN's running statistics), or
    a view of a written tensor on the way to its base (``passes._graph.written_nodes``): it keeps the dtypes of
    the original graph, except in a tensor the graph makes with its low source's dtype (``new_zeros`` /
    ``zeros_like`` of a low value), whose views and writes take that dtype (module docstring). Its floating inputs come back to their original dtype, so the write lands in the
    model's own tensor (a cast is a copy: an input, a buffer or a KV cache written through a bf16 copy lost
    the write). The cast cache is emptied after a write: a cast made before it holds the old values."""
    if node.op in ("placeholder", "get_attr"):
        new.setdefault(node, orig[node])
        return
    if _follows_source(node):
        # A tensor the graph makes from a low value and then writes into (new_zeros(scores) filled through
        # views: Longformer's chunked attention; zeros_like(k) in RWKV's recurrence): made low as model.to(dt)
        # makes it, so the writes land in it and its readers get it without a cast.
        _follow_source(node, orig, new, low, rewriter.saturated)
        return
    targets = writes_in_place(node)
    into = targets[0] if targets else view_base(node)
    have = new.get(into) if isinstance(into, fx.Node) else None
    if isinstance(have, torch.dtype) and have in _LOW and orig.get(into) == torch.float32:
        # A view of, or a write into, a tensor of that kind: the whole group in its dtype (the values written
        # are cast to it, as the write itself casts them at run time).
        rewriter.map_inputs(node, lambda arg: have)
        new[node] = _lower(orig[node], have)
        _retype_meta(node, orig[node], new[node])
        if targets:
            rewriter.cache.clear()
        return
    rewriter.map_inputs(node, lambda arg: orig.get(arg))
    new[node] = orig[node]
    if writes_in_place(node):
        rewriter.cache.clear()
        if _has_float(orig[node]) or _has_float_input(node, orig):
            result.skipped.append(Skip(node.name, f"written in place: {op_name(node)} keeps its dtype"))


def _follows_source(node: fx.Node) -> bool:
    """Whether ``node`` makes a new floating tensor whose dtype is its source's (``zeros_like(x)``,
    ``new_zeros(x, size)`` with no ``dtype=``)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if op_name(node) not in _LIKE_OPS | _NEW_OPS or _explicit_dtype(node) or not node.args:
        return False
    src = node.args[0]
    return isinstance(src, fx.Node) and _has_float(_dtypes(src.meta.get("val"))) and _has_float(
        _dtypes(node.meta.get("val")))


def _follow_source(node: fx.Node, orig: dict, new: dict, low: torch.dtype, saturated: list) -> None:
    """Type the :func:`_follows_source` ``node`` with its source's dtype in the rewritten graph; a fill value
    beyond the low range (``full_like(x, finfo(float32).min)`` of a low ``x``) saturates."""
    source = new.get(node.args[0])
    new[node] = source if isinstance(source, torch.dtype) and source.is_floating_point else orig[node]
    _retype_meta(node, orig[node], new[node])
    if _lowered(orig[node], new[node]) and _value_op(op_name(node)):
        saturated.extend(_saturate_scalars(node, low))


def _no_kernel_reasons(nodes: list[fx.Node]) -> dict[str, str]:
    """``{node: reason}`` for the ATen ops of ``nodes`` that :func:`no_low_precision_kernel` keeps in FP32."""
    out: dict[str, str] = {}
    for node in nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            reason = no_low_precision_kernel(op_name(node))
            if reason is not None:
                out[node.name] = reason
    return out


def _is_tensor_val(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _in_explicit_fp32(node: fx.Node, explicit32: set, anchors: set, new: dict) -> bool:
    """Whether ``node`` reads an explicit FP32 value and every other non-0-dim floating input is FP32 too (when
    every floating input is 0-dim, as in ``1 - 0.99 ** step.float()``, they all count)."""
    inputs = _value_inputs(node, new)
    if not any(a in explicit32 for a in inputs):
        return False
    return all(new[a] == torch.float32 and (a in explicit32 or a in anchors) for a in inputs)


def _is_scalar_tensor(node: fx.Node) -> bool:
    """A 0-dim tensor: PyTorch's type promotion lets it follow the other operands' dtype."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _scalar_args(node: fx.Node):
    """(container, key, value) for every Python float argument of ``node`` (top level and in lists)."""
    for container in (node.args, node.kwargs):
        keys = range(len(container)) if isinstance(container, tuple) else list(container)
        for k in keys:
            v = container[k]
            if isinstance(v, float):
                yield container, k, v, None
            elif isinstance(v, (list, tuple)):
                for j, item in enumerate(v):
                    if isinstance(item, float):
                        yield container, k, item, j


def _out_of_range(value: float, dtype: torch.dtype) -> bool:
    return math.isfinite(value) and abs(value) > torch.finfo(dtype).max


def _big_scalars(node: fx.Node, low: torch.dtype) -> bool:
    """Whether ``node`` (an FP32 op) takes a finite Python-float constant beyond ``low``'s range as a value."""
    if not isinstance(node.target, torch._ops.OpOverload) or not _value_op(op_name(node)):
        return False
    return any(_out_of_range(v, low) for _, _, v, _ in _scalar_args(node))


def saturate_value_scalars(node: fx.Node, name: str, low: torch.dtype) -> list[str]:
    """Clamp the finite Python-float arguments beyond ``low``'s range of a value op (:data:`_VALUE_OPS` or its
    in-place form; ``name`` is the op's name: an ATen packet, a torch function or a Tensor method name) to
    ``torch.finfo(low).max`` with their sign, in place on ``node``: a model that fills with
    ``torch.finfo(torch.float32).min`` as Dynamo traced it in FP32 raises "value cannot be converted to type
    c10::BFloat16 without overflow" once that op runs in ``low``. Returns one note per changed value."""
    return _saturate_scalars(node, low) if _value_op(name) else []


def _saturate_scalars(node: fx.Node, low: torch.dtype) -> list[str]:
    """Clamp ``node``'s finite out-of-range float arguments to ``low``'s finite range; one note per change."""
    limit = torch.finfo(low).max
    notes: list[str] = []
    args, kwargs = list(node.args), dict(node.kwargs)
    for container, key, value, j in list(_scalar_args(node)):
        if not _out_of_range(value, low):
            continue
        fixed = math.copysign(limit, value)
        target = args if container is node.args else kwargs
        if j is None:
            target[key] = fixed
        else:
            seq = list(target[key])
            seq[j] = fixed
            target[key] = type(node.args[key] if container is node.args else node.kwargs[key])(seq)
        notes.append(f"{node.name}: {value:.4g} -> {fixed:.4g} ({str(low).replace('torch.', '')} range)")
    node.args, node.kwargs = tuple(args), kwargs
    return notes


def _calibration_ignored(nodes: list[fx.Node]) -> dict[str, str]:
    """``{node: reason}`` for calibration statistics that were not finite (``passes.calibrate.ignored_reasons``)."""
    ranges = CalibrationRanges()
    for node in nodes:
        kind = node.meta.get(NONFINITE_META)
        if kind:
            ranges[node.name] = node.meta.get(MAX_ABS_META, 0.0)
            ranges.nonfinite[node.name] = kind
    return ignored_reasons(ranges)


class _Caster:
    """Inserts and reuses cast nodes; ``new`` maps each processed node to its dtype in the rewritten graph."""

    def __init__(self, gm: fx.GraphModule, new: dict, big: set, saturated: list) -> None:
        self.gm = gm
        self.new = new
        self.big = big  # values to saturate (clamp to the low range) before a cast down
        self.saturated = saturated
        self.cache: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.made: set[fx.Node] = set()
        self.inserted = 0

    def map_inputs(self, node: fx.Node, want) -> bool:
        """Cast every floating tensor input of ``node`` to ``want(arg)``; True if it had any floating input."""
        seen_float = False

        def visit(arg: fx.Node) -> fx.Node:
            nonlocal seen_float
            have = self.new.get(arg)
            if not (isinstance(have, torch.dtype) and have.is_floating_point):
                return arg
            seen_float = True
            target = want(arg)
            if not isinstance(target, torch.dtype) or not target.is_floating_point or target == have:
                return arg
            return self.cast(arg, target, before=node)

        node.args = fx.node.map_arg(node.args, visit)
        node.kwargs = fx.node.map_arg(node.kwargs, visit)
        return seen_float

    def cast(self, src: fx.Node, dtype: torch.dtype, before: fx.Node) -> fx.Node:
        """A node holding ``src`` in ``dtype``: the source of a cast we made, a cached cast, or a new one."""
        if src in self.made and self.new.get(_uncast(src)) == dtype:
            return _uncast(src)  # no cast of a cast: go back to the value it came from
        key = (src, dtype)
        if key not in self.cache:
            source = src
            with self.gm.graph.inserting_before(before):
                if dtype in _LOW and src in self.big:
                    limit = torch.finfo(dtype).max
                    source = self.gm.graph.call_function(torch.ops.aten.clamp.default, (src, -limit, limit))
                    copy_meta(src, source, src.meta.get("val"))
                    source.meta[_OWN_CAST] = True
                    self.saturated.append(f"{src.name}: clamped to +-{limit:.4g} before its cast to "
                                          f"{str(dtype).replace('torch.', '')}")
                cast = self.gm.graph.call_function(_CAST, (source,), {"dtype": dtype})
            copy_meta(src, cast, _retype(src.meta.get("val"), dtype))
            cast.meta[_OWN_CAST] = True
            self.cache[key] = cast
            self.made.add(cast)
            self.new[cast] = dtype
            self.inserted += 1
        return self.cache[key]

    def cast_after(self, src: fx.Node, dtype: torch.dtype) -> fx.Node:
        """Cast ``src`` to ``dtype`` right after it and route every reader of ``src`` through the cast (a
        reader that wants ``src``'s own dtype back gets ``src`` itself from :meth:`cast`)."""
        with self.gm.graph.inserting_after(src):
            cast = self.gm.graph.call_function(_CAST, (src,), {"dtype": dtype})
        src.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
        copy_meta(src, cast, _retype(src.meta.get("val"), dtype))
        cast.meta[_OWN_CAST] = True
        self.cache[(src, dtype)] = cast
        self.made.add(cast)
        self.new[cast] = dtype
        self.inserted += 1
        return cast


def _uncast(cast: fx.Node) -> fx.Node:
    """The value a cast this pass made reads (through its saturating ``clamp``, if any)."""
    src = cast.args[0]
    if src.target == torch.ops.aten.clamp.default and src.meta.get(_OWN_CAST):
        return src.args[0]
    return src


def _overflow_reasons(nodes: list[fx.Node], spec: PassSpec) -> dict[str, str]:
    """``{node name: skip reason}`` for the ops that run FP32 for overflow: ``spec.fp32_nodes`` and their readers."""
    if not spec.fp32_nodes:
        return {}
    limit = FINITE_MAX.get(spec.precision, float("inf"))
    reasons: dict[str, str] = {}
    for node in nodes:
        if node.op != "call_function":
            continue
        where = source_module(node)
        module = f" (module {where})" if where else ""
        if node.name in spec.fp32_nodes:
            peak = node.meta.get(MAX_ABS_META)
            seen = f"max |x| {_sci(peak)}" if isinstance(peak, float) else "calibrated out of range"
            reasons[node.name] = (
                f"overflow: {seen} > {limit:g}/{spec.overflow_margin:g} at {spec.precision}{module}"
            )
            continue
        big = [a for a in node.all_input_nodes if a.name in spec.fp32_nodes]
        if big:
            reasons[node.name] = f"overflow: reads {big[0].name}, out of {spec.precision} range{module}"
    return reasons


def _sci(x: float) -> str:
    """``71000.0`` -> ``"7.1e4"`` (scientific notation without the ``+0`` padding)."""
    if not math.isfinite(x):
        return str(x)  # "inf" / "nan": no mantissa to split
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _cast_weights(
    gm: fx.GraphModule,
    nodes: list[fx.Node],
    keep: frozenset,
    low: torch.dtype,
    new: dict,
    fp32_ops: frozenset = frozenset(),
    fp32_lookups: bool = True,
    big: set | None = None,
    saturated: list | None = None,
    tied: dict | None = None,
    exact: frozenset = frozenset(),
) -> tuple[list[str], list[str]]:
    """Store floating weights read only by non-keep-list ops in ``low``; returns (low names, FP32 names).

    A tensor bound to several names (tied weights) gets one low copy bound to all of them as one object,
    including names no ``get_attr`` node reads; ``tied`` (when given) maps the first name to them all.

    ``fp32_ops``: names of further ops that compute in FP32 (overflow), whose weights stay FP32 too.
    ``fp32_lookups``: weights no op of :data:`_LOW_COMPUTE_OPS` reads (:func:`_feeds_low_compute`) stay FP32
    (``PassSpec.residual_fp32``, the autocast policy): embedding tables read only by lookups, weights read only by
    explicit FP32 conversions (a hand-written rotary embedding's ``self.inv_freq.float()``), an RMSNorm weight
    applied as a ``mul``; autocast never rounds a stored weight, ``model.to(dt)`` does (the pure policy's
    reference): at T = 2048 a bf16 ``inv_freq`` took the angles' relative error to 0.14 against autocast eager's
    0.0028.
    ``exact``: nodes written in place (``passes._graph.written_nodes``) or returned as they are or as a view
    (:func:`_returned_input_views`); such a weight stays FP32 (a low copy would take the writes, or be returned
    rounded).
    Finite values beyond ``low``'s range saturate to ``torch.finfo(low).max`` in the low copy (noted in
    ``saturated``); an FP32 weight holding such values joins ``big`` (clamped wherever it is cast down).
    """
    by_tensor: dict[int, list[fx.Node]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for node in nodes:
        if node.op != "get_attr":
            continue
        value = get_attr_value(gm, node.target)
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype not in _LOW:
            by_tensor.setdefault(id(value), []).append(node)
            tensors[id(value)] = value
    weights_low: list[str] = []
    weights_fp32: list[str] = []
    for key, attr_nodes in by_tensor.items():
        users = [u for n in attr_nodes for u in n.users]
        # Read by a keep-list op (or handed out as an output), or an embedding table no GEMM reads: FP32.
        if (
            not users
            or any(n in exact for n in attr_nodes)
            or any(_reads_fp32(u, keep) or u.name in fp32_ops for u in users)
            or (tensors[key].dtype == torch.float64 and any(_computes_float64(u) for u in users))
            or (fp32_lookups and not any(_feeds_low_compute(u) for u in users))
        ):
            weights_fp32.extend(sorted({n.target for n in attr_nodes} | set(alias_targets(gm, tensors[key]))))
            if big is not None and _has_out_of_range(tensors[key], low):
                big.update(attr_nodes)
            continue
        value = tensors[key].detach()
        if _has_out_of_range(value, low):
            limit = torch.finfo(low).max
            value = torch.where(torch.isfinite(value), value.clamp(-limit, limit), value)
            if saturated is not None:
                saturated.append(f"{attr_nodes[0].target}: values beyond +-{limit:.4g} saturated "
                                 f"({str(low).replace('torch.', '')} range)")
        # Every name bound to this tensor gets the one low copy (tied weights stay one object, also under the
        # names no get_attr node reads: an LM head's table read through the head's name only).
        targets = sorted({n.target for n in attr_nodes} | set(alias_targets(gm, tensors[key])))
        stored = replace_tensor(gm, tensors[key], attr_nodes[0].target, value.to(low))
        for target in targets:
            if get_attr_value(gm, target) is not stored:  # a plain tensor attribute read under several names
                set_attr_tensor(gm, target, stored)
        weights_low.extend(targets)
        if len(targets) > 1 and tied is not None:
            tied[targets[0]] = targets
        for n in attr_nodes:
            fake = fake_from_tensor(n.meta.get("val"), stored)
            if fake is not None:
                n.meta["val"] = fake
            new[n] = low
    return weights_low, weights_fp32


def _has_out_of_range(t: torch.Tensor, low: torch.dtype) -> bool:
    """Whether ``t`` holds a finite value beyond ``low``'s finite range.

    One ``aminmax`` reduction answers for the usual weight (every value finite, or none beyond the range); only
    a tensor whose minimum or maximum is non-finite or beyond the range takes the exact element-wise check
    (an FP32 weight of BERT-base is read once instead of five times with three full-size temporaries).
    """
    if not t.numel():
        return False
    t = t.detach()
    limit = torch.finfo(low).max
    lo, hi = torch.aminmax(t)
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return bool((lo < -limit) | (hi > limit))
    if bool((lo >= -limit) & (hi <= limit)):  # NaN-free, no inf at either end: nothing beyond the range
        return False
    mag = t.abs()
    return bool(((mag > limit) & torch.isfinite(mag)).any())


def _computes_float64(user: fx.Node) -> bool:
    """Whether ``user`` computes a float64 result (the float64 rule of the module docstring: runs as written)."""
    return user.op == "call_function" and _has_dtype(_dtypes(user.meta.get("val")), torch.float64)


def _reads_fp32(user: fx.Node, keep: frozenset) -> bool:
    """Whether ``user`` needs its inputs in FP32 (keep-list op, graph output, a region that runs as written, or
    the ``lift_fresh_copy`` of a constant the model made)."""
    if user.op == "output":
        return True
    if _runs_as_written(user):
        return True
    if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
        return False
    return op_name(user) in keep or op_name(user) in _LIFT_OPS


def _reads_up(user: fx.Node) -> bool:
    """Whether ``user`` is given an explicit ``dtype`` and computes a float32 or float64 result
    (``w.float()``, ``w.to(torch.float32)``, ``w.sum(dtype=torch.float32)``), or is a layout op
    (:data:`_FOLLOW_OPS`: ``w[None, :]``) whose every reader is such an op. An op that only inspects its input
    (:data:`_PASSTHROUGH`: export's ``_assert_tensor_metadata``) does not count against it."""
    if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
        return False
    if op_name(user) in _PASSTHROUGH:
        return True
    if op_name(user) in _FOLLOW_OPS:
        return bool(user.users) and all(_reads_up(u) for u in user.users)
    return _explicit_dtype(user) and _dtypes(user.meta.get("val")) in (torch.float32, torch.float64)


def _only_feeds_low_compute(node: fx.Node) -> bool:
    """Whether every reader of ``node`` is an op of :data:`_LOW_COMPUTE_OPS`, or a move op (:data:`_MOVE_OPS`, or
    the ``getitem`` of a split) whose own readers all are, recursively."""
    if not node.users:
        return False
    for user in node.users:
        if user.op != "call_function":
            return False
        if user.target is operator.getitem or (isinstance(user.target, torch._ops.OpOverload)
                                               and op_name(user) in _MOVE_OPS):
            if not _only_feeds_low_compute(user):
                return False
        elif not (isinstance(user.target, torch._ops.OpOverload) and op_name(user) in _LOW_COMPUTE_OPS):
            return False
    return True


def _feeds_low_compute(user: fx.Node) -> bool:
    """Whether ``user`` is an op of :data:`_LOW_COMPUTE_OPS` (a GEMM, convolution, attention) or a layout op
    (:data:`_FOLLOW_OPS`: ``w.t()``) one of whose readers is."""
    if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
        return False
    if op_name(user) in _FOLLOW_OPS:
        return any(_feeds_low_compute(u) for u in user.users)
    return op_name(user) in _LOW_COMPUTE_OPS


def _cast_outputs(node: fx.Node, orig: dict, new: dict, rewriter: _Caster, restore: bool = True) -> None:
    """Cast each graph output back to its original dtype; with ``restore`` False, an output that was FP32 keeps
    the dtype it is computed in (``new``), so no cast is inserted for it."""
    def want(arg: fx.Node):
        before = orig.get(arg)
        if not restore and before == torch.float32 and isinstance(new.get(arg), torch.dtype):
            return new[arg]
        return before

    rewriter.map_inputs(node, want)


def _dtypes(val: Any) -> Any:
    """dtype (or nested list of dtypes / None) of a ``meta["val"]``."""
    if isinstance(val, torch.Tensor):
        return val.dtype
    if isinstance(val, (list, tuple)):
        return [_dtypes(v) for v in val]
    return None


def _lower(dtypes: Any, low: torch.dtype) -> Any:
    """``dtypes`` with every floating entry replaced by ``low``."""
    if isinstance(dtypes, torch.dtype):
        return low if dtypes.is_floating_point else dtypes
    if isinstance(dtypes, list):
        return [_lower(d, low) for d in dtypes]
    return dtypes


def _lowered(before: Any, after: Any) -> bool:
    if isinstance(before, list) and isinstance(after, list):
        return any(_lowered(b, a) for b, a in zip(before, after))
    return isinstance(before, torch.dtype) and before != after


def _has_float(dtypes: Any) -> bool:
    if isinstance(dtypes, torch.dtype):
        return dtypes.is_floating_point
    if isinstance(dtypes, list):
        return any(_has_float(d) for d in dtypes)
    return False


def _ranks_fp32(node: fx.Node, name: str, new: dict) -> bool:
    """Whether the order op ``node`` (:data:`_ORDER_OPS`) ranks an FP32 value: its floating inputs are all FP32
    in the rewritten graph so far. ``max`` / ``min`` count only in their ``dim`` form, which returns indices; the
    plain reductions are ordinary ops."""
    if name in ("max", "min") and not isinstance(node.meta.get("val"), (tuple, list)):
        return False
    inputs = _float_inputs(node, new)
    return bool(inputs) and all(new.get(a) == torch.float32 for a in inputs)


def _has_fp32(dtypes: Any) -> bool:
    return _has_dtype(dtypes, torch.float32)


def _has_dtype(dtypes: Any, dtype: torch.dtype) -> bool:
    if isinstance(dtypes, torch.dtype):
        return dtypes == dtype
    if isinstance(dtypes, list):
        return any(_has_dtype(d, dtype) for d in dtypes)
    return False


#: Higher-order ops whose bodies take any dtype (the score function of flex attention): cast like other ops.
_DTYPE_GENERIC_REGIONS = frozenset({"flex_attention", "flex_attention_backward"})


def _runs_as_written(node: fx.Node) -> bool:
    """Whether ``node`` is a higher-order op with a traced body (``wrap_with_autocast``, ``cond``,
    ``while_loop``, ...; not an activation-checkpointed region, cast by :func:`_cast_checkpoint_body`): its body
    holds the dtypes it was traced with (``torch.autocast(enabled=False)`` computes in FP32 by design), so the
    region's inputs keep the original graph's dtypes."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)
            and op_name(node) not in _DTYPE_GENERIC_REGIONS | {"tag_activation_checkpoint"})


def _float_inputs(node: fx.Node, new: dict) -> list[fx.Node]:
    """The inputs of ``node`` that hold a floating tensor in the rewritten graph."""
    found: list[fx.Node] = []

    def visit(arg: fx.Node) -> fx.Node:
        have = new.get(arg)
        if isinstance(have, torch.dtype) and have.is_floating_point:
            found.append(arg)
        return arg

    fx.node.map_arg((node.args, node.kwargs), visit)
    return found


def _value_inputs(node: fx.Node, new: dict) -> list[fx.Node]:
    """The floating inputs of ``node`` that decide its dtype under type promotion: the non-0-dim ones (a 0-dim
    tensor follows the other operands' dtype), or all of them when every one is 0-dim."""
    floats = _float_inputs(node, new)
    return [a for a in floats if not _is_scalar_tensor(a)] or floats


def _reads_fp32_value(node: fx.Node, new: dict) -> bool:
    """Whether an input of ``node`` that decides its dtype (:func:`_value_inputs`) is FP32 in the rewritten graph."""
    return any(new[a] == torch.float32 for a in _value_inputs(node, new))


def _all_float_inputs_in(node: fx.Node, anchors: set, new: dict) -> bool:
    inputs = _float_inputs(node, new)
    return bool(inputs) and all(a in anchors and new[a] == torch.float32 for a in inputs)


def _residual_reason(node: fx.Node, name: str, keep: frozenset, anchors: set, new: dict) -> str | None:
    """Why the add / sub ``node`` runs in FP32 (module docstring, rules a and b), or None when it need not."""
    for user in node.users:
        if user.op == "call_function" and isinstance(user.target, torch._ops.OpOverload) and op_name(user) in keep:
            return f"residual: {name} stays FP32 (feeds {op_name(user)})"
    for arg in _float_inputs(node, new):
        if arg in anchors and new[arg] == torch.float32:
            return f"residual: {name} stays FP32 (adds the FP32 output of {arg.name})"
    return None


def _has_float_input(node: fx.Node, orig: dict) -> bool:
    found = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(_has_float(orig.get(a))))
    return any(found)


def _explicit_dtype(node: fx.Node) -> bool:
    """Whether ``node`` is given an explicit ``dtype`` argument (a conversion or a typed factory)."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name != "dtype":
            continue
        value = node.kwargs.get("dtype", node.args[i] if i < len(node.args) and not arg.kwarg_only else None)
        return value is not None
    return False


def _retype(val: Any, dtype: torch.dtype) -> Any:
    """A fake tensor like ``val`` with ``dtype`` (None when ``val`` is not a fake tensor), with the strides
    ``val.to(dtype)`` gives (both follow ``torch.preserve_format``). ``empty_like`` is a plain factory call in the
    fake mode, where ``val.to`` runs ``_to_copy``'s decomposition on every shape the fake mode has not cached:
    ~1 ms against ~0.25 ms a cast node on a CPU host (swin_t, 773 cast nodes: 0.45 -> 0.26 s)."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return None
    with mode:
        return torch.empty_like(val, dtype=dtype)


def _retype_meta(node: fx.Node, before: Any, after: Any) -> None:
    """Update ``node.meta["val"]`` when its dtype(s) changed."""
    if before == after:
        return
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and isinstance(after, torch.dtype):
        node.meta["val"] = _retype(val, after)
    elif isinstance(val, (list, tuple)) and isinstance(after, list):
        node.meta["val"] = type(val)(
            _retype(v, d) if isinstance(v, torch.Tensor) and isinstance(d, torch.dtype) and v.dtype != d else v
            for v, d in zip(val, after)
        )


__all__ = ["cast_precision"]
