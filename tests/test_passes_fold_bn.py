"""Tests for passes.fold_bn: eval-mode batch norm folded into the preceding convolution."""
from __future__ import annotations

import pytest
import torch

import zoo
from passes import PassSpec, fold_conv_batchnorm

SPEC = PassSpec()
_BN_OPS = {torch.ops.aten.batch_norm.default, torch.ops.aten._native_batch_norm_legit_no_training.default}


def _bn_nodes(gm):
    return [n for n in gm.graph.nodes if n.target in _BN_OPS]


@pytest.mark.parametrize(
    "name", ["conv_bn", "conv_bn_nobias", "conv_bn_grouped", "conv_bn_depthwise", "conv1d_bn", "conv3d_bn"]
)
def test_fold_conv_batchnorm_folds(name):
    model, gm, entry = zoo.build(name)
    keys = set(gm.state_dict())

    result = fold_conv_batchnorm(gm, SPEC)

    assert result.count == 2 and not result.skipped
    assert _bn_nodes(gm) == []
    assert set(gm.state_dict()) >= keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp32")


def test_fold_conv_batchnorm_bias_free_conv_gains_bias():
    model, gm, entry = zoo.build("conv_bn_nobias")

    fold_conv_batchnorm(gm, SPEC)

    convs = [n for n in gm.graph.nodes if n.target == torch.ops.aten.conv2d.default]
    assert [c.args[2].target for c in convs] == ["conv1.bias_bnfolded", "conv2.bias_bnfolded"]
    assert set(gm.state_dict()) == set(model.state_dict())  # the new biases are non-persistent buffers
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp32")


def test_fold_conv_batchnorm_leaves_eager_model_untouched():
    model, gm, _ = zoo.build("conv_bn")
    before = {k: v.clone() for k, v in model.state_dict().items()}

    fold_conv_batchnorm(gm, SPEC)

    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_fold_conv_batchnorm_idempotent():
    model, gm, entry = zoo.build("conv_bn")
    fold_conv_batchnorm(gm, SPEC)
    code = gm.code

    again = fold_conv_batchnorm(gm, SPEC)

    assert again.count == 0 and gm.code == code
    zoo.assert_matches_eager(model, gm, entry.example_inputs(2), "fp32")


def test_fold_conv_batchnorm_native_no_training_variant():
    entry = zoo.ZOO["conv_bn"]
    model = entry.build()
    batch = torch.export.Dim("batch", min=1, max=4096)
    ep = torch.export.export(model, entry.example_inputs(3), dynamic_shapes=({0: batch},), strict=False)
    gm = ep.run_decompositions({}).module()
    assert any(n.target == torch.ops.aten._native_batch_norm_legit_no_training.default for n in gm.graph.nodes)

    result = fold_conv_batchnorm(gm, SPEC)

    assert result.count == 2 and _bn_nodes(gm) == []
    zoo.assert_matches_eager(model, gm, entry.example_inputs(4), "fp32")


def test_fold_conv_batchnorm_skips_training():
    _, gm, _ = zoo.build("conv_bn")

    result = fold_conv_batchnorm(gm, PassSpec(training=True))

    assert result.count == 0 and len(_bn_nodes(gm)) == 2
    assert {s.reason for s in result.skipped} == {"spec.training is True: BN folding is eval-only"}


def test_fold_conv_batchnorm_skips_bn_training_flag():
    _, gm, _ = zoo.build("conv_bn")
    bn = _bn_nodes(gm)[0]
    bn.update_arg(5, True)

    result = fold_conv_batchnorm(gm, SPEC)

    assert result.count == 1
    assert result.skipped[0].node == bn.name and result.skipped[0].reason == "BN training flag is True"


def test_fold_conv_batchnorm_skips_missing_running_stats():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3), torch.nn.BatchNorm2d(8, track_running_stats=False)
    ).eval()
    gm = zoo.capture(model, (torch.randn(3, 4, 8, 8),))

    result = fold_conv_batchnorm(gm, SPEC)

    assert result.count == 0
    assert [s.reason for s in result.skipped] == ["running stats are None"]


def test_fold_conv_batchnorm_skips_other_users():
    model, gm, entry = zoo.build("conv_bn_branch")

    result = fold_conv_batchnorm(gm, SPEC)

    assert result.count == 0 and len(_bn_nodes(gm)) == 1
    assert [s.reason for s in result.skipped] == ["conv output has other users"]
    zoo.assert_matches_eager(model, gm, entry.example_inputs(2), "fp32")


def test_fold_conv_batchnorm_skips_transposed():
    _, gm, _ = zoo.build("conv_transpose_bn")

    result = fold_conv_batchnorm(gm, SPEC)

    assert result.count == 0
    assert [s.reason for s in result.skipped] == ["transposed convolution"]
