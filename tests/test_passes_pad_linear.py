"""Tests for passes.pad_linear: N/K padding of aten.linear to the Tensor Core alignment."""
from __future__ import annotations

import torch
from torch import nn

import zoo
from passes import PassSpec, pad_linear_dims
from passes.padding import PADDED_FLAG

FP16 = PassSpec(precision="fp16", alignment=zoo.ALIGNMENT)
ALIGN = 8


def test_pad_linear_dims_pads_mlp():
    model, gm, entry = zoo.build("mlp")
    keys = list(gm.state_dict())

    result = pad_linear_dims(gm, FP16)

    assert result.count == 2
    assert result.notes["padded"]["linear"] == {"N": [61, 64], "K": [37, 40]}
    assert result.notes["padded"]["linear_1"] == {"N": [13, 16], "K": [61, 64]}
    for name, p in gm.named_parameters():
        assert all(d % ALIGN == 0 for d in p.shape), name
    assert torch.ops.aten.constant_pad_nd.default in zoo.call_targets(gm)
    assert torch.ops.aten.slice.Tensor in zoo.call_targets(gm)
    assert list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp32")


def test_pad_linear_dims_leaves_eager_model_untouched():
    model, gm, _ = zoo.build("mlp")
    before = {k: v.clone() for k, v in model.state_dict().items()}

    pad_linear_dims(gm, FP16)

    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_pad_linear_dims_simple_cnn_pads_n_only():
    model, gm, entry = zoo.build("simple_cnn")

    result = pad_linear_dims(gm, FP16)

    assert result.notes["padded"] == {"linear": {"N": [10, 16], "K": [8192, 8192]}}
    assert gm.fc.weight.shape == (16, 8192) and gm.fc.bias.shape == (16,)
    assert torch.ops.aten.constant_pad_nd.default not in zoo.call_targets(gm)
    zoo.assert_matches_eager(model, gm, entry.example_inputs(7), "fp32")


def test_pad_linear_dims_idempotent():
    model, gm, entry = zoo.build("mlp")
    pad_linear_dims(gm, FP16)
    code = gm.code

    again = pad_linear_dims(gm, FP16)

    assert again.count == 0 and not again.modified
    assert {s.reason for s in again.skipped} == {"already aligned"}
    assert gm.code == code
    assert all(n.meta.get(PADDED_FLAG) for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    zoo.assert_matches_eager(model, gm, entry.example_inputs(4), "fp32")


def test_pad_linear_dims_skips_aligned():
    _, gm, _ = zoo.build("bert")

    result = pad_linear_dims(gm, FP16)

    assert result.count == 0
    linears = [n.name for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert {s.node for s in result.skipped if s.reason == "already aligned"} >= set(linears)


def test_pad_linear_dims_skips_alignment_1():
    _, gm, _ = zoo.build("mlp")
    spec = PassSpec(precision="fp32", alignment={"fp16": 8}, arch="Hopper")

    result = pad_linear_dims(gm, spec)

    assert result.count == 0
    assert {s.reason for s in result.skipped} == {"alignment 1 (no Tensor Core requirement for fp32 on Hopper)"}
    assert len(result.skipped) == 2


def test_pad_linear_dims_tf32_aligns_to_4():
    model, gm, entry = zoo.build("mlp")

    result = pad_linear_dims(gm, PassSpec(precision="tf32", alignment={"tf32": 4}))

    assert result.notes["padded"]["linear"] == {"N": [61, 64], "K": [37, 40]}
    assert result.notes["padded"]["linear_1"] == {"N": [13, 16], "K": [61, 64]}
    zoo.assert_matches_eager(model, gm, entry.example_inputs(6), "fp32")


def test_pad_linear_dims_pads_tied_vocabulary():
    model, gm, entry = zoo.build("tied_lm")
    keys = list(gm.state_dict())

    result = pad_linear_dims(gm, FP16)

    assert result.notes["padded"]["linear"] == {"N": [50257, 50264], "K": [64, 64]}
    assert result.notes["padded"]["embedding"] == {"V": [50257, 50264]}
    assert gm.head.weight.shape == (50264, 64)
    assert list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(2), "fp32")
    assert pad_linear_dims(gm, FP16).count == 0


def test_pad_linear_dims_skips_shared_weight_k():
    model, gm, entry = zoo.build("tied_lm_odd")

    result = pad_linear_dims(gm, FP16)

    assert result.notes["padded"]["linear"] == {"N": [1001, 1008], "K": [61, 61]}
    assert any(s.reason == "shared weight: K not padded" for s in result.skipped)
    assert gm.head.weight.shape == (1008, 61)
    zoo.assert_matches_eager(model, gm, entry.example_inputs(3), "fp32")
    again = pad_linear_dims(gm, FP16)
    assert again.count == 0
    assert {s.node: s.reason for s in again.skipped} == {
        "linear": "shared weight: K not padded", "embedding": "already aligned",
    }


class _ComputedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(13, 37))

    def forward(self, x):
        return nn.functional.linear(x, self.w * 2.0)


class _UntiedEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1001, 16)
        self.fc = nn.Linear(16, 24)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def test_pad_linear_dims_skips_weight_not_parameter():
    model = _ComputedWeight().eval()
    gm = zoo.capture(model, (torch.randn(3, 37),))

    result = pad_linear_dims(gm, FP16)

    assert result.count == 0
    assert [s.reason for s in result.skipped] == ["weight is not a parameter"]


def test_pad_linear_dims_skips_untied_embedding():
    model = _UntiedEmbedding().eval()
    gm = zoo.capture(model, (torch.randint(0, 1001, (3, 4)),))

    result = pad_linear_dims(gm, FP16)

    assert result.count == 0
    reasons = {s.node: s.reason for s in result.skipped}
    assert reasons["embedding"].startswith("embedding: vocabulary rows are padded only when tied")
    assert reasons["linear"] == "already aligned"
    assert gm.emb.weight.shape == (1001, 16)
