"""Tests for passes.fold_bn: eval-mode batch norm folded into the preceding convolution."""
from __future__ import annotations

import pytest
import torch
from passes.policy import pass_spec

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


# ------------------------------------------------------------------------------------ frozen affine maps


class FrozenBatchNorm2d(torch.nn.Module):
    """torchvision's ``FrozenBatchNorm2d``, written out: buffers ``weight``, ``bias``, ``running_mean``,
    ``running_var`` (``(C,)``, random here) and ``eps``; ``x * scale + bias`` computed from them in ``forward``."""

    def __init__(self, n: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.register_buffer("weight", torch.rand(n) + 0.5)
        self.register_buffer("bias", torch.randn(n) * 0.2)
        self.register_buffer("running_mean", torch.randn(n) * 0.5)
        self.register_buffer("running_var", torch.rand(n) + 0.5)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.reshape(1, -1, 1, 1)
        b = self.bias.reshape(1, -1, 1, 1)
        rv = self.running_var.reshape(1, -1, 1, 1)
        rm = self.running_mean.reshape(1, -1, 1, 1)
        scale = w * (rv + self.eps).rsqrt()
        bias = b - rm * scale
        return x * scale + bias


class FrozenBlock(torch.nn.Module):
    """A detection-backbone bottleneck: conv (no bias) -> FrozenBN -> ReLU, twice, plus the residual input:
    ``(batch, 8, H, W)`` -> ``(batch, 8, H, W)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(8, 12, 3, padding=1, bias=False)
        self.bn1 = FrozenBatchNorm2d(12)
        self.conv2 = torch.nn.Conv2d(12, 8, 1, bias=False)
        self.bn2 = FrozenBatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + x)


class Affine(torch.nn.Module):
    """``conv(x) <op> operand``: the operand is built by ``make(x)`` from the module's tensors (and ``x``)."""

    def __init__(self, make, c_in: int = 4, c_out: int = 6, dims: int = 2) -> None:
        super().__init__()
        self.conv = (torch.nn.Conv1d, torch.nn.Conv2d)[dims - 1](c_in, c_out, 3)
        self.gamma = torch.nn.Parameter(torch.rand(c_out, *([1] * dims)) + 0.5)
        self.register_buffer("beta", torch.randn(c_out, *([1] * dims)))
        self.register_buffer("beta64", torch.randn(c_out, 1, 1, dtype=torch.float64))
        self.register_buffer("grid", torch.randn(1, 1, 6, 6))
        self.make = make

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.make(self, self.conv(x), x)


def _capture(model, *shape):
    torch.manual_seed(0)
    return zoo.capture(model.eval(), (torch.randn(3, *shape),))


def _convs(gm):
    return [n for n in gm.graph.nodes if n.target in (torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default)]


def _arith(gm):
    names = {"mul", "add", "sub", "div", "rsqrt"}
    return [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "_overloadpacket", None)
            is not None and n.target._overloadpacket.__name__ in names]


def test_fold_conv_batchnorm_folds_frozen_batchnorm():
    torch.manual_seed(0)
    model = FrozenBlock().eval()
    gm = _capture(model, 8, 10, 10)
    keys = list(gm.state_dict())

    result = fold_conv_batchnorm(gm, SPEC)

    assert result.count == 2 and not result.skipped
    assert result.notes["folded_affine"] == {"conv2d": ["mul_2", "add_1"], "conv2d_1": ["mul_5", "add_3"]}
    # Only the residual add is left: the FrozenBN arithmetic on the buffers is dead and gone.
    assert [n.name for n in _arith(gm)] == ["add_4"]
    assert [c.args[2].target for c in _convs(gm)] == ["conv1.bias_bnfolded", "conv2.bias_bnfolded"]
    assert list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 8, 10, 10),), "fp32")
    assert fold_conv_batchnorm(gm, SPEC).count == 0


@pytest.mark.parametrize(
    "make, dims",
    [
        (lambda m, y, x: y * m.gamma + m.beta, 2),  # LayerScale-like parameter, then a buffer
        (lambda m, y, x: m.beta + m.gamma * y, 2),  # the conv as the right operand
        (lambda m, y, x: (y - m.beta) / m.gamma, 2),  # sub and div
        (lambda m, y, x: m.beta - y * 0.5, 2),  # constant minus the chain, a Python scalar
        (lambda m, y, x: torch.add(y, m.beta, alpha=-2.0) * 3.0, 2),  # add with alpha
        (lambda m, y, x: y * m.gamma + m.beta, 1),  # conv1d
    ],
)
def test_fold_conv_batchnorm_folds_any_per_channel_affine(make, dims):
    model = Affine(make, dims=dims)
    shape = (4, 9, 9) if dims == 2 else (4, 11)
    gm = _capture(model, *shape)

    result = fold_conv_batchnorm(gm, SPEC)

    assert result.count == 1 and not result.skipped
    assert _arith(gm) == []
    zoo.assert_matches_eager(model, gm, (torch.randn(5, *shape),), "fp32")


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda m, y, x: y * x.mean((0, 2, 3), keepdim=True)[:, :1].expand(1, 6, 1, 1),
         "per-channel operand is not a constant: it reads graph input x"),
        (lambda m, y, x: y * m.grid[..., :7, :7],
         "operand of shape (1, 1, 6, 6) is not per-channel for a conv output of 6 channels"),
        (lambda m, y, x: y * m.beta64, "the op changes the conv output's dtype (or has no fake-tensor metadata)"),
        (lambda m, y, x: y / (m.beta * 0), "division by zero or an unsupported keyword (rounding_mode)"),
    ],
)
def test_fold_conv_batchnorm_skips_affine_with_reason(make, reason):
    model = Affine(make)
    gm = _capture(model, 4, 8, 8)
    ops = len(_arith(gm))

    result = fold_conv_batchnorm(gm, SPEC)

    assert result.count == 0
    assert [s.reason for s in result.skipped] == [reason]
    assert len(_arith(gm)) == ops
    out = model(torch.randn(5, 4, 8, 8))
    if torch.isfinite(out).all():
        zoo.assert_matches_eager(model, gm, (torch.randn(5, 4, 8, 8),), "fp32")


def test_fold_conv_batchnorm_skips_affine_when_conv_output_has_other_users():
    model = Affine(lambda m, y, x: torch.cat([y * m.gamma + m.beta, y], 1))
    gm = _capture(model, 4, 8, 8)

    result = fold_conv_batchnorm(gm, SPEC)

    assert result.count == 0
    assert [s.reason for s in result.skipped] == ["conv output has other users"]
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 4, 8, 8),), "fp32")


def test_fold_conv_batchnorm_skips_affine_in_training():
    gm = _capture(FrozenBlock(), 8, 6, 6)

    result = fold_conv_batchnorm(gm, PassSpec(training=True))

    assert result.count == 0
    assert [s.reason for s in result.skipped] == ["spec.training is True: folding is eval-only"] * 2


def test_fold_conv_batchnorm_leaves_residual_adds_alone():
    model = Affine(lambda m, y, x: y + x[:, :1, 1:-1, 1:-1])  # a full activation, not a per-channel constant
    gm = _capture(model, 4, 8, 8)

    result = fold_conv_batchnorm(gm, SPEC)

    assert result.count == 0 and result.skipped == []


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pipeline_folds_frozen_batchnorm_on_sm90(precision):
    from passes import run_pipeline
    from tctune import hardware

    torch.manual_seed(0)
    model = FrozenBlock().eval()
    gm = _capture(model, 8, 10, 10)

    results = {r.name: r for r in run_pipeline(gm, pass_spec(hardware.resolve("sm_90"), precision))}

    assert results["fold_conv_batchnorm"].count == 2
    assert not any(n.target == torch.ops.aten.rsqrt.default for n in gm.graph.nodes)
    zoo.assert_matches_eager(model, gm, (torch.randn(4, 8, 10, 10),), precision)
