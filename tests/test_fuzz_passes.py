"""Fuzzing the whole pass pipeline: random small linear / attention / norm / conv stacks with odd sizes.

Each random model goes through torch.export and ``run_pipeline`` at a random precision and Tensor Core
alignment. The pipeline must not crash, the result must match eager within the dtype tolerance
(tests/zoo.py TOLERANCES), and every candidate it leaves alone is a recorded skip with a reason.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zoo
from passes import PassSpec, run_pipeline


class Attention(nn.Module):
    """Hand-written multi-head attention (with an optional additive mask and a non-default scale)."""

    def __init__(self, dim: int, heads: int, masked: bool, scale: float):
        super().__init__()
        self.heads, self.scale, self.masked = heads, scale, masked
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        h = self.heads
        q, k, v = (f(x).view(b, s, h, d // h).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        if self.masked:
            att = att + torch.triu(torch.full((s, s), -1e4), diagonal=1)
        out = torch.matmul(att.softmax(-1), v).transpose(1, 2).reshape(b, s, d)
        return self.o(out)


class SeqStack(nn.Module):
    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) if not isinstance(layer, Attention) else x + layer(x)
        return x


@st.composite
def seq_models(draw):
    """(model, input width, sequence length): random widths, heads, masks, norms and activations."""
    heads = draw(st.sampled_from([1, 2, 3]))
    width = in_width = heads * draw(st.integers(min_value=3, max_value=13))
    layers: list[nn.Module] = []
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        kind = draw(st.sampled_from(["linear", "attention", "norm", "act"]))
        if kind == "linear":
            out = draw(st.integers(min_value=1, max_value=45))
            layers.append(nn.Linear(width, out, bias=draw(st.booleans())))
            width = out
        elif kind == "attention" and width % heads == 0:
            scale = draw(st.sampled_from([1 / math.sqrt(width // heads), 0.3, 1.0]))
            layers.append(Attention(width, heads, draw(st.booleans()), scale))
        elif kind == "norm":
            layers.append(nn.LayerNorm(width))
        else:
            layers.append(draw(st.sampled_from([nn.ReLU(), nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU()])))
    seq = draw(st.integers(min_value=1, max_value=9))
    return SeqStack(layers), in_width, seq


@st.composite
def conv_models(draw):
    cin = draw(st.integers(min_value=1, max_value=13))
    layers: list[nn.Module] = []
    c = cin
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        out = draw(st.integers(min_value=1, max_value=21))
        groups = draw(st.sampled_from([1] + ([c] if c > 1 and out % c == 0 else [])))  # grouped / depthwise
        layers.append(nn.Conv2d(c, out, draw(st.sampled_from([1, 3])), padding=1, groups=groups,
                                bias=draw(st.booleans())))
        if draw(st.booleans()):
            layers.append(nn.BatchNorm2d(out))
        layers.append(nn.ReLU())
        c = out
    return nn.Sequential(*layers), cin


def _randomize(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)


def _check(model, make_inputs, precision, align):
    model.eval()
    _randomize(model)
    gm = zoo.capture(model, make_inputs(3))
    spec = PassSpec(precision=precision, alignment=zoo.ALIGNMENT if align else {}, arch="Hopper" if align else "cpu")
    results = run_pipeline(gm, spec)
    for r in results:
        assert all(s.reason for s in r.skipped), r.name
    zoo.assert_matches_eager(model, gm, make_inputs(5), precision)


FUZZ = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(data=st.data(), precision=st.sampled_from(["fp32", "tf32", "fp16", "bf16"]), align=st.booleans())
def test_fuzz_sequence_models(data, precision, align):
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    model, in_width, seq = data.draw(seq_models())
    _check(model, lambda b: (torch.randn(b, seq, in_width),), precision, align)


@FUZZ
@given(data=st.data(), precision=st.sampled_from(["fp32", "fp16", "bf16"]), align=st.booleans())
def test_fuzz_conv_models(data, precision, align):
    torch.manual_seed(data.draw(st.integers(0, 2**16)))
    model, cin = data.draw(conv_models())
    hw = data.draw(st.integers(min_value=3, max_value=9))
    _check(model, lambda b: (torch.randn(b, cin, hw, hw),), precision, align)
