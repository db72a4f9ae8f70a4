"""Passes on graphs with symbolic sizes: a dynamic batch, a dynamic sequence, a data-dependent row count.

Every pass must rewrite such a graph correctly or skip the site with its reason, never raise: a T5 encoder
captured with a dynamic batch once failed every graph candidate in ``fuse_qkv`` ("Cannot call numel() on
tensor with symbolic sizes/strides", raised by a fake ``aten.linear`` on torch 2.11). Each test runs the whole
``PIPELINE`` with the ``PassSpec`` of an sm_90 target at bf16 and fp16 and checks parity with eager FP32 on
fresh random inputs at a batch (and sequence length) other than the captured one.
"""
from __future__ import annotations

import copy
import importlib

import pytest
import torch
from passes.policy import pass_spec
from torch import nn
import torch.nn.functional as F

import zoo
from passes import PIPELINE, run_pipeline
from tctune import hardware
from tctune.capture import capture

LOW = ("bf16", "fp16")
LINEAR = torch.ops.aten.linear.default
SPLIT = torch.ops.aten.split_with_sizes.default


def _spec(precision: str):
    return pass_spec(hardware.resolve("sm_90"), precision, policy="pure")


def _by_name(results):
    return {r.name: r for r in results}


def _reasons(result) -> list[str]:
    return [s.reason for s in result.skipped]


# ------------------------------------------------------------------------------------------------ models


class T5Encoder(nn.Module):
    """``transformers``' ``T5EncoderModel`` at tiny sizes (d_model 32, 4 heads of 8, FFN 64, 2 layers,
    vocabulary 100): ``(ids (batch, seq) int64, mask (batch, seq) int64)`` -> ``(batch, seq, 32)``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import T5Config, T5EncoderModel

        cfg = T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                       relative_attention_num_buckets=8, dropout_rate=0.0)
        self.t5 = T5EncoderModel(cfg)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=ids, attention_mask=mask).last_hidden_state


def _t5_inputs(batch: int, seq: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 100, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[0, seq - seq // 3:] = 0  # one padded sequence: the mask path is exercised
    return ids, mask


class SizedAttention(nn.Module):
    """Self-attention that reshapes with the input's own sizes (``x.size(0)``, ``x.size(1)``), an odd FFN
    (24 -> 37 -> 24) and a conv + per-channel affine head: ``(batch, seq, 24)`` -> ``(batch, seq, 24)``."""

    def __init__(self, d: int = 24, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.ff1, self.ff2 = nn.Linear(d, 37), nn.Linear(37, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.register_buffer("gamma", torch.rand(d, 1) + 0.5)
        self.register_buffer("beta", torch.randn(d, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.size(0), x.size(1), x.size(2)
        h = d // self.heads
        q, k, v = (t(x).view(b, s, self.heads, h).transpose(1, 2) for t in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-2, -1) / h**0.5, dim=-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, s, d))
        x = x + self.ff2(F.gelu(self.ff1(x)))
        c = self.conv(x.transpose(1, 2)) * self.gamma + self.beta  # a frozen affine after a conv
        return x + c.transpose(1, 2)


class MaskedRows(nn.Module):
    """Q/K/V projections of the rows a boolean mask keeps (a data-dependent row count, as in token routing):
    ``(x (batch, 30), keep (batch,) bool)`` -> ``(rows, 37)``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(30, 30), nn.Linear(30, 30), nn.Linear(30, 30)
        self.o = nn.Linear(30, 37)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        t = x[keep]
        q, k, v = self.q(t), self.k(t), self.v(t)
        return self.o(torch.softmax(q @ k.t() / 5.0, -1) @ v)


def _masked_inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    keep = torch.rand(batch) > 0.3
    keep[0] = True
    return torch.randn(batch, 30), keep


def _seeded(cls):
    torch.manual_seed(0)
    return cls().eval()


# ------------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def t5():
    model = _seeded(T5Encoder)
    return model, capture(model, _t5_inputs(2))


@pytest.mark.parametrize("precision", LOW)
def test_pipeline_on_t5_encoder_with_dynamic_batch(t5, precision):
    model, captured = t5
    gm = copy.deepcopy(captured)

    results = _by_name(run_pipeline(gm, _spec(precision)))

    assert [r for r in results] == list(PIPELINE)
    assert results["fuse_qkv"].count == 2  # q, k, v of each of the 2 layers
    assert sum(n.target == SPLIT for n in gm.graph.nodes) == 2
    zoo.assert_matches_eager(model, gm, _t5_inputs(5), precision)


@pytest.mark.parametrize("precision", LOW)
def test_pipeline_on_t5_encoder_with_dynamic_batch_and_sequence(t5, precision):
    model, _ = t5
    dyn = torch.export.Dim.DYNAMIC
    ep = torch.export.export(model, _t5_inputs(2), dynamic_shapes=({0: dyn, 1: dyn}, {0: dyn, 1: dyn}),
                             strict=False)
    gm = ep.module()

    results = _by_name(run_pipeline(gm, _spec(precision)))

    assert results["fuse_qkv"].count == 2
    zoo.assert_matches_eager(model, gm, _t5_inputs(5, seq=9), precision)


@pytest.mark.parametrize("precision", LOW)
def test_pipeline_on_hand_written_model_with_dynamic_batch_and_sequence(precision):
    model = _seeded(SizedAttention)
    dyn = torch.export.Dim.DYNAMIC
    gm = torch.export.export(model, (torch.randn(2, 6, 24),), dynamic_shapes=({0: dyn, 1: dyn},),
                             strict=False).module()

    results = _by_name(run_pipeline(gm, _spec(precision)))

    assert results["fuse_qkv"].count == 1
    assert results["fold_conv_batchnorm"].notes["folded_affine"] == {"conv1d": ["mul", "add_2"]}
    assert results["pad_linear_dims"].count >= 1  # the 37-wide FFN
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 11, 24),), precision)


@pytest.mark.parametrize("precision", LOW)
def test_pipeline_on_data_dependent_rows_skips_k_padding_with_reason(precision):
    model = _seeded(MaskedRows)
    dyn = torch.export.Dim.DYNAMIC
    gm = torch.export.export(model, _masked_inputs(4), dynamic_shapes=({0: dyn}, {0: dyn}), strict=False).module()

    results = _by_name(run_pipeline(gm, _spec(precision)))

    assert results["fuse_qkv"].count == 1
    pad = results["pad_linear_dims"]
    assert "input has a data-dependent size: its padded shape cannot be computed; K not padded" in _reasons(pad)
    assert pad.count >= 1  # N is still padded (the output slice needs no padded input)
    zoo.assert_matches_eager(model, gm, _masked_inputs(9), precision)


def test_fuse_qkv_skips_group_whose_fake_run_fails(monkeypatch):
    """The torch 2.11 failure, reproduced: fake propagation of the fused ops raises; the group is skipped with
    the error as its reason, the graph is untouched and the rest of the pipeline runs."""
    module = importlib.import_module("passes.fuse_qkv")
    real_split = module._SPLIT

    def failing_split(*args, **kwargs):
        if isinstance(args[0], torch._subclasses.fake_tensor.FakeTensor):
            raise RuntimeError("Cannot call numel() on tensor with symbolic sizes/strides")
        return real_split(*args, **kwargs)

    monkeypatch.setattr(module, "_SPLIT", failing_split)
    model = _seeded(SizedAttention)
    gm = capture(model, (torch.randn(2, 6, 24),))
    linears = sum(n.target == LINEAR for n in gm.graph.nodes)

    results = _by_name(run_pipeline(gm, _spec("bf16")))

    fuse = results["fuse_qkv"]
    assert fuse.count == 0
    reason = ("fake-tensor metadata for the fused linear failed: RuntimeError: Cannot call numel() on tensor "
              "with symbolic sizes/strides")
    assert _reasons(fuse).count(reason) == 3  # q, k and v
    assert sum(n.target == LINEAR for n in gm.graph.nodes) == linears
    assert results["cast_precision"].count > 0
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 6, 24),), "bf16")
