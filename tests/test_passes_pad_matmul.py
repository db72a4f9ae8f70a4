"""Tests for passes.pad_matmul: N/K padding of mm / addmm / bmm / matmul with a parameter operand."""
from __future__ import annotations

import torch
from torch import nn

import zoo
from passes import PassSpec
from passes.pad_matmul import pad_matmul_dims

FP16 = PassSpec(precision="fp16", alignment=zoo.ALIGNMENT)


class _Gemms(nn.Module):
    """Every GEMM spelling with a parameter right operand; ``w`` is shared by three of them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(37, 61) * 0.2)
        self.b = nn.Parameter(torch.randn(61))
        self.w3 = nn.Parameter(torch.randn(2, 37, 13) * 0.2)
        self.v = nn.Parameter(torch.randn(29, 19) * 0.2)

    def forward(self, x):
        xb = x.unsqueeze(0).expand(2, -1, -1)
        return torch.mm(x, self.w), torch.addmm(self.b, x, self.w), torch.bmm(xb, self.w3), x @ self.w, (
            x[:, :29] @ self.v
        )


class _TwoActivations(nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b)


class _LeftWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(13, 37))

    def forward(self, x):
        return torch.mm(self.w, x.t())


def _build():
    torch.manual_seed(0)
    model = _Gemms().eval()
    return model, zoo.capture(model, (torch.randn(3, 37),))


def test_pad_matmul_dims_pads_every_spelling():
    model, gm = _build()
    keys = list(gm.state_dict())

    result = pad_matmul_dims(gm, FP16)

    assert result.count == 5
    assert result.notes["padded"]["mm"] == {"N": [61, 64], "K": [37, 40]}
    assert result.notes["padded"]["bmm"] == {"N": [13, 16], "K": [37, 40]}
    assert result.notes["padded"]["matmul_1"] == {"N": [19, 24], "K": [29, 32]}
    assert gm.w.shape == (40, 64) and gm.b.shape == (64,) and gm.w3.shape == (2, 40, 16)
    assert list(gm.state_dict()) == keys
    ops = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.constant_pad_nd.default in ops and torch.ops.aten.slice.Tensor in ops
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 37),), "fp32")


def test_pad_matmul_dims_never_pads_m():
    model, gm = _build()

    pad_matmul_dims(gm, FP16)

    x = torch.randn(7, 37)
    with torch.no_grad():
        shapes = [t.shape for t in gm(x)]
    assert shapes == [(7, 61), (7, 61), (2, 7, 13), (7, 61), (7, 19)]


def test_pad_matmul_dims_idempotent():
    model, gm = _build()
    pad_matmul_dims(gm, FP16)
    code = gm.code

    again = pad_matmul_dims(gm, FP16)

    assert again.count == 0 and {s.reason for s in again.skipped} == {"already aligned"}
    assert gm.code == code
    zoo.assert_matches_eager(model, gm, (torch.randn(4, 37),), "fp32")


def test_pad_matmul_dims_skips_two_activation_operands():
    gm = zoo.capture(_TwoActivations().eval(), (torch.randn(2, 5, 7), torch.randn(2, 7, 9)))
    code = gm.code

    result = pad_matmul_dims(gm, FP16)

    assert result.count == 0 and gm.code == code
    assert [s.reason for s in result.skipped] == [
        "two activation operands: K padding would copy both at every call (not measured to pay)"
    ]


def test_pad_matmul_dims_skips_left_weight():
    gm = zoo.capture(_LeftWeight().eval(), (torch.randn(3, 37),))

    result = pad_matmul_dims(gm, FP16)

    assert result.count == 0
    assert [s.reason for s in result.skipped] == ["weight is the left operand: not padded"]


def test_pad_matmul_dims_skips_alignment_1():
    _, gm = _build()

    result = pad_matmul_dims(gm, PassSpec(precision="fp32", arch="Hopper"))

    assert result.count == 0
    assert {s.reason for s in result.skipped} == {"alignment 1 (no Tensor Core requirement for fp32 on Hopper)"}
