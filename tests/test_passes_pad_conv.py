"""Tests for passes.pad_conv: Cin / Cout padding of aten.conv2d per the measured should-pad rules."""
from __future__ import annotations

import pytest
import torch

import zoo
from passes import PassSpec, cast_precision
from passes.pad_conv import TF32_REASON, pad_conv_channels

ALIGNMENT = {"fp16": 8, "bf16": 8, "tf32": 4}
HOPPER_FP16 = PassSpec(precision="fp16", alignment=ALIGNMENT, arch="Hopper")
_CONV = torch.ops.aten.conv2d.default


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_pad_conv_channels_pads_stem_and_body():
    model, gm, entry = zoo.build("stem_cnn")
    keys = list(gm.state_dict())

    result = pad_conv_channels(gm, HOPPER_FP16)

    assert result.count == 2
    assert result.notes["padded"]["conv2d"] == {"Cin": [3, 4], "Cout": [61, 64]}  # stem: 3 -> 4, not 8
    assert result.notes["padded"]["conv2d_1"] == {"Cin": [61, 64], "Cout": [61, 64]}
    assert gm.stem.weight.shape == (64, 4, 7, 7) and gm.stem.bias.shape == (64,)
    assert gm.conv.weight.shape == (64, 64, 3, 3)
    assert "small-Cin rule" in result.notes["should_pad"]["conv2d"]["Cin"]["reason"]
    assert _ops(gm).count(torch.ops.aten.constant_pad_nd.default) == 2
    assert _ops(gm).count(torch.ops.aten.slice.Tensor) == 2
    assert list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp32")  # the pass alone keeps fp32 math


def test_pad_conv_channels_parity_with_cast():
    model, gm, entry = zoo.build("stem_cnn")
    spec = PassSpec(precision="bf16", alignment=ALIGNMENT, arch="Hopper")

    result = pad_conv_channels(gm, spec)
    cast_precision(gm, spec)

    # bf16 has no measured stem rule: Cin 3 -> 8 would be 2.67x the work, so Cin stays 3.
    assert result.notes["padded"]["conv2d"] == {"Cin": [3, 3], "Cout": [61, 64]}
    assert any(s.node == "conv2d" and s.reason.startswith("can pad but should not: Cin 3 -> 8") for s in result.skipped)
    zoo.assert_matches_eager(model, gm, entry.example_inputs(4), "bf16")


def test_pad_conv_channels_idempotent():
    model, gm, entry = zoo.build("stem_cnn")
    pad_conv_channels(gm, HOPPER_FP16)
    code = gm.code

    again = pad_conv_channels(gm, HOPPER_FP16)

    assert again.count == 0 and {s.reason for s in again.skipped} == {"already aligned"}
    assert gm.code == code
    zoo.assert_matches_eager(model, gm, entry.example_inputs(3), "fp32")


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_pad_conv_channels_skips_tf32(precision):
    _, gm, _ = zoo.build("stem_cnn")
    code = gm.code

    result = pad_conv_channels(gm, PassSpec(precision=precision, alignment=ALIGNMENT, arch="Hopper"))

    assert result.count == 0 and gm.code == code
    expected = TF32_REASON if precision == "tf32" else "precision fp32: only fp16/bf16 convs are padded"
    assert [s.reason for s in result.skipped] == [expected, expected]


@pytest.mark.parametrize(
    "name, node, reason",
    [
        ("conv_bn_grouped", "conv2d", "grouped convolution (groups=4): channels not padded"),
        ("conv_bn_depthwise", "conv2d_1", "depthwise convolution (groups=16): channels not padded"),
        ("conv_transpose_bn", "conv_transpose2d", "transposed convolution: channels not padded"),
    ],
    ids=["grouped", "depthwise", "transposed"],
)
def test_pad_conv_channels_skips_grouped_depthwise_transposed(name, node, reason):
    _, gm, _ = zoo.build(name)

    result = pad_conv_channels(gm, HOPPER_FP16)

    assert {s.node: s.reason for s in result.skipped}[node] == reason
