"""cuDNN's fused convolution kernels as ``torch.library`` custom ops, so a graph pass can emit them.

PyTorch has ``aten.cudnn_convolution_relu`` (``relu(conv(x, W) + b)``) and ``aten.cudnn_convolution_add_relu``
(``relu(conv(x, W) + alpha * z + b)``): one cuDNN kernel whose epilogue adds the bias, the residual and applies
the ReLU while the output tile is in registers. They exist on CUDA only and have no meta kernel, so neither
``torch.export`` nor Inductor can trace them as they are. The two ops here wrap them with:

* a fake implementation, so Inductor compiles a graph that calls them (as extern kernels);
* the composite computation (``F.conv2d`` + add + ``relu``) on any other device, so a graph rewritten for a GPU
  target still runs (and is tested) on the CPU, with the same values, and on CUDA for a configuration cuDNN
  refuses (no engine for it: warned once, then the composite, :data:`REFUSED`);
* one fixed output layout: channels-last (NHWC) with its canonical strides on every device, so the fake
  implementation and the real one agree on strides by construction. ``x`` and ``z`` are made channels-last on
  entry (a no-op for a channels-last tensor: convolutions chained through these ops stay channels-last); the
  weight too (``passes.fuse_conv_relu`` stores it channels-last once).

Shapes: ``x (N, C_in, H, W)``, ``weight (C_out, C_in / groups, kH, kW)``, ``bias (C_out,)`` or None,
``z (N, C_out, H_out, W_out)`` (the output's shape); one floating dtype throughout (fp16 / bf16 / fp32, as the
convolution itself takes). No autograd formula: inference only (the pass refuses training graphs).
"""
from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

_CL = torch.channels_last


def _cl_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Canonical channels-last strides of a 4-D ``(N, C, H, W)`` shape."""
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with canonical channels-last strides (the tensor itself when it has them already)."""
    if tuple(t.stride()) == _cl_strides(t.shape):
        return t
    return torch.empty_strided(t.shape, _cl_strides(t.shape), dtype=t.dtype, device=t.device).copy_(t)


def _out_like(x: torch.Tensor, weight: torch.Tensor, bias, stride, padding, dilation, groups) -> torch.Tensor:
    """The fake output: the convolution's shape and dtype, channels-last strides."""
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return torch.empty_strided(y.shape, _cl_strides(y.shape), dtype=y.dtype, device=y.device)


#: The ops are defined with ``torch.library.Library`` and per-device kernels rather than ``torch.library.custom_op``:
#: the latter's Python dispatch layers cost about 4x the host time per call (53 against 14 microseconds, measured
#: on this project's 2-core CPU build host with an empty kernel), which Inductor pays per op per call when the
#: graph is not replayed as a CUDA graph. No autograd kernel: inference only (the pass refuses training graphs).
_LIB = torch.library.Library("tctune", "FRAGMENT")
_LIB.define("conv2d_relu(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, "
            "int groups) -> Tensor")
_LIB.define("conv2d_add_relu(Tensor x, Tensor weight, Tensor z, Tensor? bias, int[] stride, int[] padding, "
            "int[] dilation, int groups) -> Tensor")


#: Configurations cuDNN refused (shapes, dtype, geometry): computed as the composite since, with one warning.
REFUSED: set[tuple] = set()


def _cudnn_or_composite(kind: str, x, weight, z, bias, stride, padding, dilation, groups) -> torch.Tensor:
    """One fused cuDNN call on CUDA; the composite (``conv2d`` + add + ``relu``) elsewhere, or where cuDNN has no
    engine for the configuration (``RuntimeError`` from the call: warned once per configuration, then the
    composite without trying again)."""
    if x.is_cuda and torch.backends.cudnn.enabled:
        # the key is built only once some configuration was refused: nothing extra on the usual path
        key = _config(kind, x, weight, stride, padding, dilation, groups) if REFUSED else None
        if key not in REFUSED:
            try:
                return _cudnn_call(kind, x, weight, z, bias, stride, padding, dilation, groups)
            except RuntimeError as exc:
                key = key or _config(kind, x, weight, stride, padding, dilation, groups)
                REFUSED.add(key)
                warnings.warn(f"tctune::{kind}: cuDNN refused the fused convolution for {key} ({str(exc)[:200]}); "
                              f"computing convolution, add and ReLU separately for it from now on", RuntimeWarning,
                              stacklevel=2)
    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return torch.relu(y if z is None else y + z)


def _config(kind, x, weight, stride, padding, dilation, groups) -> tuple:
    return (kind, tuple(x.shape), tuple(weight.shape), x.dtype, tuple(stride), tuple(padding), tuple(dilation),
            groups)


def _cudnn_call(kind, x, weight, z, bias, stride, padding, dilation, groups) -> torch.Tensor:
    if kind == "conv2d_relu":
        return torch.ops.aten.cudnn_convolution_relu(x, weight, bias, stride, padding, dilation, groups)
    return torch.ops.aten.cudnn_convolution_add_relu(x, weight, z, 1.0, bias, stride, padding, dilation, groups)


def conv2d_relu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: Sequence[int],
                padding: Sequence[int], dilation: Sequence[int], groups: int) -> torch.Tensor:
    """``relu(conv2d(x, weight, bias, stride, padding, dilation, groups))``, channels-last output (module
    docstring); one cuDNN kernel on CUDA (``aten.cudnn_convolution_relu``)."""
    x, weight = x.contiguous(memory_format=_CL), weight.contiguous(memory_format=_CL)
    return _channels_last(_cudnn_or_composite("conv2d_relu", x, weight, None, bias, stride, padding, dilation,
                                              groups))


def conv2d_add_relu(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor, bias: Optional[torch.Tensor],
                    stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                    groups: int) -> torch.Tensor:
    """``relu(conv2d(x, weight, bias, ...) + z)``, channels-last output (module docstring); one cuDNN kernel on
    CUDA (``aten.cudnn_convolution_add_relu`` with ``alpha = 1``). ``z``: the output's shape, not written."""
    x, weight = x.contiguous(memory_format=_CL), weight.contiguous(memory_format=_CL)
    z = z.contiguous(memory_format=_CL)
    return _channels_last(_cudnn_or_composite("conv2d_add_relu", x, weight, z, bias, stride, padding, dilation,
                                              groups))


for _name, _fn in (("conv2d_relu", conv2d_relu), ("conv2d_add_relu", conv2d_add_relu)):
    for _key in ("CPU", "CUDA"):
        _LIB.impl(_name, _fn, _key)


@torch.library.register_fake("tctune::conv2d_relu")
def _conv2d_relu_fake(x, weight, bias, stride, padding, dilation, groups):
    return _out_like(x, weight, bias, stride, padding, dilation, groups)


@torch.library.register_fake("tctune::conv2d_add_relu")
def _conv2d_add_relu_fake(x, weight, z, bias, stride, padding, dilation, groups):
    return _out_like(x, weight, bias, stride, padding, dilation, groups)


CONV2D_RELU = torch.ops.tctune.conv2d_relu.default
CONV2D_ADD_RELU = torch.ops.tctune.conv2d_add_relu.default

__all__ = ["CONV2D_ADD_RELU", "CONV2D_RELU", "REFUSED", "conv2d_add_relu", "conv2d_relu"]
