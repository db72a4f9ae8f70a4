"""Tests for passes.should_pad (the measured should-pad table) and its use by pad_linear_dims."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import zoo
from passes import PassSpec, pad_linear_dims
from passes.should_pad import DEFAULT_TABLE_PATH, arch_entry, load_table, measurement, should_pad

SOURCE = "benchmarks/NOTES.md, reference measurements: H200, torch 2.11, 2026-11-30"


def test_should_pad_table_holds_reference_measurements():
    hopper, measured = arch_entry("Hopper")

    assert measured
    assert measurement(hopper, "gemm_k8191")["tflops_by_K"] == {"8191": 140, "8192": 646}
    assert measurement(hopper, "lm_head_vocab")["ms_by_N"] == {"50257": 13.2, "50264": 2.09, "50304": 2.06}
    assert measurement(hopper, "stem_conv_7x7_cin")["ms_by_Cin"] == {"3": 1.12, "4": 0.97, "8": 1.78}
    assert measurement(hopper, "conv_3x3_c61")["ms_by_C"] == {"61": 0.59, "64": 0.29}
    assert all(m["source"] == SOURCE for m in hopper["measurements"])
    assert json.loads(DEFAULT_TABLE_PATH.read_text()) == load_table()


@pytest.mark.parametrize(
    "op, dims, dtype, arch, expected",
    [
        ("linear", {"N": 50257}, "bf16", "Hopper", (True, 64)),  # measured: 50304 as fast as 50264
        ("linear", {"N": 50257}, "fp16", "Hopper", (True, 8)),  # no fp16 measurement: the alignment
        ("linear", {"N": 50257}, "bf16", "cpu", (True, 8)),  # unknown arch: default rules
        ("mm", {"K": 8191}, "fp16", "Hopper", (True, 8)),
        ("linear", {"N": 10}, "fp16", "Hopper", (True, 8)),  # N: widening the output only
        ("conv2d", {"Cin": 3}, "fp16", "Hopper", (False, 4)),  # stem: 3 -> 4 is faster, but not with the pad op
        ("conv2d", {"Cout": 61}, "bf16", "Hopper", (True, 8)),
        ("linear", {"K": 64}, "fp16", "Hopper", (False, 8)),
        ("linear", {"N": 50304}, "bf16", "Hopper", (False, 64)),
    ],
    ids=["vocab-bf16", "vocab-fp16", "vocab-cpu", "k8191", "n10", "stem-cin3", "cout61", "k64", "vocab-done"],
)
def test_should_pad_decisions(op, dims, dtype, arch, expected):
    pad, multiple, reason = should_pad(op, dims, dtype, arch, align=8)

    assert (pad, multiple) == expected, reason


def test_should_pad_small_cin_rule_matches_its_evidence():
    hopper, _ = arch_entry("Hopper")
    times = measurement(hopper, "stem_conv_7x7_cin")["ms_by_Cin"]

    fastest = int(min(times, key=times.get))

    assert fastest == hopper["rules"]["conv_small_cin"]["multiple"] == 4
    assert should_pad("conv2d", {"Cin": 3}, "fp16", "Hopper").multiple == fastest


def test_should_pad_small_cin_weighs_the_pad_op():
    """3 -> 4 is the fastest kernel, but the measured graph with its channel-pad op was slower than Cin 3:
    not padded, and the reason cites that measurement. Without that measurement the rule pads 3 -> 4."""
    hopper, _ = arch_entry("Hopper")
    pad, multiple, reason = should_pad("conv2d", {"Cin": 3}, "fp16", "Hopper")
    assert (pad, multiple) == (False, 4)
    assert "with the channel pad itself took 2.44 ms" in reason

    table = copy.deepcopy(load_table())
    measurement(table["arch"]["Hopper"], "stem_conv_7x7_cin").pop("ms_with_pad_op_by_Cin")
    pad, multiple, reason = should_pad("conv2d", {"Cin": 3}, "fp16", "Hopper", table=table)
    assert (pad, multiple) == (True, 4) and "small-Cin rule" in reason


def test_should_pad_skips_tiny_reduction_dims():
    pad, multiple, reason = should_pad("linear", {"K": 3}, "fp16", "Hopper", align=8)

    assert not pad and multiple == 8
    assert reason.startswith("can pad but should not: K 3 -> 8 is 2.67x the work (limit 1.5x")


def test_should_pad_rejects_bad_arguments():
    with pytest.raises(ValueError, match="exactly one"):
        should_pad("linear", {"N": 3, "K": 5}, "fp16", "Hopper")
    with pytest.raises(ValueError, match="not 'relu'"):
        should_pad("relu", {"N": 3}, "fp16", "Hopper")


# ---------------------------------------------------------------------------------------- pad_linear_dims


class _TinyK(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 61)

    def forward(self, x):
        return self.fc(x)


def test_pad_linear_dims_pads_vocabulary_to_64_on_hopper_bf16():
    model, gm, entry = zoo.build("tied_lm")
    keys = list(gm.state_dict())
    spec = PassSpec(precision="bf16", alignment=zoo.ALIGNMENT, arch="Hopper")

    result = pad_linear_dims(gm, spec)

    assert result.notes["padded"]["linear"] == {"N": [50257, 50304], "K": [64, 64]}
    assert result.notes["padded"]["embedding"] == {"V": [50257, 50304]}
    decision = result.notes["should_pad"]["linear"]["N"]
    assert decision["pad"] and decision["multiple"] == 64 and "2.06 ms vs N=50264 2.09 ms" in decision["reason"]
    assert gm.head.weight.shape == (50304, 64) and list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(2), "fp32")
    again = pad_linear_dims(gm, spec)
    assert again.count == 0 and {s.reason for s in again.skipped} == {"already aligned"}


def test_pad_linear_dims_skips_tiny_k():
    model = _TinyK().eval()
    gm = zoo.capture(model, (torch.randn(4, 3),))
    spec = PassSpec(precision="fp16", alignment=zoo.ALIGNMENT, arch="Hopper")

    result = pad_linear_dims(gm, spec)

    assert result.notes["padded"]["linear"] == {"N": [61, 64], "K": [3, 3]}
    reasons = [s.reason for s in result.skipped if s.node == "linear"]
    assert len(reasons) == 1 and reasons[0].startswith("can pad but should not: K 3 -> 8")
    assert gm.fc.weight.shape == (64, 3)
    zoo.assert_matches_eager(model, gm, (torch.randn(6, 3),), "fp32")
    again = pad_linear_dims(gm, spec)
    assert again.count == 0 and again.skipped[0].reason.startswith("can pad but should not")
