"""Tests for passes.fuse_conv_relu (convolution + bias [+ residual] + ReLU -> one cuDNN op) and the custom ops
of passes.cudnn_ops it emits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zoo
from passes import PIPELINE, PassSpec, fold_conv_batchnorm, fuse_conv_relu, run_pipeline
from passes.cudnn_ops import CONV2D_ADD_RELU, CONV2D_RELU
from tctune.deploy import EXPORT_PIPELINE

HOPPER16 = PassSpec(precision="fp16", arch="Hopper")


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck, small: 1x1 / 3x3 (stride) / 1x1 convolutions with BatchNorm, in-place
    ReLUs, ``out += identity`` and a downsample branch when the shape changes."""

    def __init__(self, cin: int = 16, mid: int = 8, cout: int = 32, stride: int = 2) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)
        self.relu = nn.ReLU(inplace=True)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.data.uniform_(0.5, 1.5)
                m.bias.data.uniform_(-0.5, 0.5)

    def forward(self, x):
        identity = self.down(x) if self.down is not None else x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


def _capture(model: nn.Module, *shape: int) -> tuple[nn.Module, torch.fx.GraphModule]:
    torch.manual_seed(0)
    model = model.eval()
    return model, zoo.capture(model, (torch.randn(2, *shape),))


def _fused(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target in (CONV2D_RELU, CONV2D_ADD_RELU)]


def _check_parity(model, gm, *shape: int) -> None:
    """FP32 parity with eager on fresh random inputs (a batch size the capture did not see), same strides."""
    x = torch.randn(5, *shape)
    with torch.no_grad():
        ref, got = model(x.clone()), gm(x.clone())
    ref_t, got_t = zoo.flat_outputs(ref), zoo.flat_outputs(got)
    for r, g in zip(ref_t, got_t):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        assert g.stride() == r.stride()


# -------------------------------------------------------------------------------------------- the pass


def test_fuses_a_folded_bottleneck_with_parity():
    model, gm = _capture(Bottleneck(), 16, 12, 12)
    assert fold_conv_batchnorm(gm, HOPPER16).count == 4

    result = fuse_conv_relu(gm, HOPPER16)

    assert result.count == 3
    assert sorted(result.notes["kinds"].values()) == ["add_relu", "relu", "relu"]
    assert zoo.count_calls(gm, torch.ops.aten.relu_.default) == 0
    assert zoo.count_calls(gm, torch.ops.aten.add_.Tensor) == 0
    # the downsample convolution (no ReLU after it) stays and feeds the fused add as its residual
    (add_relu,) = [n for n in gm.graph.nodes if n.target == CONV2D_ADD_RELU]
    assert add_relu.args[2].target == torch.ops.aten.conv2d.default
    assert gm.get_parameter("conv1.weight").is_contiguous(memory_format=torch.channels_last)
    assert result.notes["layout_restored"] == ["output"]  # the block's output keeps eager's NCHW strides
    _check_parity(model, gm, 16, 12, 12)


def test_chained_blocks_read_the_previous_fused_op_as_their_residual():
    """The second block's identity is the first block's ReLU, which the pass replaces first (a bug once: the
    second site kept the erased ReLU as its residual and the graph was out of order)."""
    model, gm = _capture(nn.Sequential(Bottleneck(), Bottleneck(32, 8, 32, stride=1)), 16, 12, 12)
    fold_conv_batchnorm(gm, HOPPER16)

    result = fuse_conv_relu(gm, HOPPER16)

    assert result.count == 6
    gm.graph.lint()
    add_relus = [n for n in gm.graph.nodes if n.target == CONV2D_ADD_RELU]
    assert add_relus[1].args[2] is add_relus[0]  # identity = the first block's fused output
    _check_parity(model, gm, 16, 12, 12)


def test_pipeline_casts_the_fused_ops_to_the_low_dtype():
    model, gm = _capture(Bottleneck(), 16, 12, 12)

    results = {r.name: r for r in run_pipeline(gm, PassSpec(precision="bf16", arch="Hopper",
                                                            alignment=zoo.ALIGNMENT))}

    assert results["fuse_conv_relu"].count == 3
    for node in _fused(gm):
        assert node.meta["val"].dtype == torch.bfloat16
        assert all(a.meta["val"].dtype == torch.bfloat16 for a in node.args if isinstance(a, torch.fx.Node))
    x = torch.randn(4, 16, 12, 12)
    with torch.no_grad():
        assert zoo.rel_l2(gm(x), model(x)) < 3e-2


@pytest.mark.parametrize("spec, reason", [
    (PassSpec(precision="fp16", arch="Hopper", training=True), "training"),
    (PassSpec(precision="fp32", arch="Hopper"), "precision fp32"),
    (PassSpec(precision="fp32", arch="cpu"), "arch cpu"),  # the architecture is named first
    (PassSpec(precision="fp16", arch="Ampere"), "arch Ampere"),
    (PassSpec(precision="fp16", arch="cpu"), "arch cpu"),
])
def test_refuses_by_the_measured_rule(spec, reason):
    _, gm = _capture(zoo.ConvResidual(), 8, 10, 10)
    code = gm.code

    result = fuse_conv_relu(gm, spec)

    assert result.count == 0 and gm.code == code
    assert len(result.skipped) == 2 and all(s.reason.startswith(reason) for s in result.skipped)


class _Sites(nn.Module):
    """One convolution followed by ReLU per refusal case."""

    def __init__(self) -> None:
        super().__init__()
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.same = nn.Conv2d(8, 8, 3, padding="same")
        self.bcast = nn.Conv2d(8, 8, 1)
        self.into_res = nn.Conv2d(8, 8, 1)
        self.twice = nn.Conv2d(8, 8, 1)
        self.scale = nn.Parameter(torch.randn(8, 1, 1))

    def forward(self, x):
        a = F.relu(self.grouped(x))
        b = F.relu(self.same(a))
        c = F.relu(self.bcast(b) + self.scale)  # a broadcast add: not a residual of the output's shape
        r = c * 2.0
        r += self.into_res(c)  # the in-place add writes into r, not into the convolution's output
        d = F.relu(r)
        t = self.twice(d)
        return F.relu(t) + t  # the convolution's output has a second reader


def test_skips_each_site_it_cannot_fuse_with_its_reason():
    model, gm = _capture(_Sites(), 8, 10, 10)

    result = fuse_conv_relu(gm, HOPPER16)

    assert result.count == 0
    reasons = {s.reason.split(" (")[0].split(":")[0] for s in result.skipped}
    assert reasons == {"grouped or depthwise convolution", "stride, padding or dilation is not two integers",
                       "the residual's shape or dtype differs from the convolution's output",
                       "the in-place add writes into mul, not into this convolution's output"}
    _check_parity(model, gm, 8, 10, 10)


class _FewSites(nn.Module):
    """One conv + ReLU site among three 2-D convolutions (the others end in no ReLU)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return torch.tanh(self.c(torch.sigmoid(self.b(F.relu(self.a(x))))))


def test_refuses_a_graph_where_few_convolutions_are_sites():
    model, gm = _capture(_FewSites(), 4, 6, 6)
    code = gm.code

    result = fuse_conv_relu(gm, HOPPER16)

    assert result.count == 0 and gm.code == code
    (skip,) = result.skipped
    assert skip.reason.startswith("only 1 of the graph's 3 2-D convolutions can be fused")


class _Strided(nn.Module):
    """A fused site whose output is read through ``as_strided`` and ``view``: both need the NCHW layout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.conv(x))
        n = y.shape[0]
        return y.as_strided((n, 6, 2), (6 * 25, 25, 1)) * 1.0, y.view(n, -1) + 1.0, torch.tanh(y)


def test_restores_the_layout_for_strided_readers_and_outputs():
    model, gm = _capture(_Strided(), 4, 5, 5)

    result = fuse_conv_relu(gm, HOPPER16)

    assert result.count == 1
    clones = [n for n in gm.graph.nodes if n.target == torch.ops.aten.clone.default]
    assert len(clones) == 2  # one copy back to NCHW of the fused output, one of tanh's output (a graph output)
    assert set(result.notes["layout_restored"]) == {"as_strided", "view", "output"}
    _check_parity(model, gm, 4, 5, 5)


def test_channels_last_model_needs_no_layout_copy():
    torch.manual_seed(0)
    model = Bottleneck().eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 16, 12, 12).contiguous(memory_format=torch.channels_last)
    gm = zoo.capture(model, (x,))
    fold_conv_batchnorm(gm, HOPPER16)

    result = fuse_conv_relu(gm, HOPPER16)

    assert result.count == 3 and "layout_restored" not in result.notes
    assert zoo.count_calls(gm, torch.ops.aten.clone.default) == 0
    y = torch.randn(3, 16, 12, 12).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref, got = model(y.clone()), gm(y.clone())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got.stride() == ref.stride()


class _PaddedVGG(nn.Module):
    """conv 8 -> 60 channels + ReLU: pad_conv_channels pads 60 to 64 and slices back, so the ReLU is reached through
    the slice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(8, 16, 3, padding=1), nn.Conv2d(16, 60, 3, padding=1)

    def forward(self, x):
        return F.relu(self.b(F.relu(self.a(x)))).flatten(1)


def test_a_relu_reached_through_another_op_is_a_skip_with_its_reason():
    from passes import pad_conv_channels

    model, gm = _capture(_PaddedVGG(), 8, 6, 6)
    spec = PassSpec(precision="fp16", arch="Hopper", alignment=zoo.ALIGNMENT)
    assert pad_conv_channels(gm, spec).count >= 1

    result = fuse_conv_relu(gm, spec)

    assert result.count == 1
    (skip,) = result.skipped
    assert skip.reason.startswith("its output reaches the ReLU through slice")
    _check_parity(model, gm, 8, 6, 6)


def test_the_downsample_residual_says_which_convolution_is_fused():
    _, gm = _capture(Bottleneck(), 16, 12, 12)
    fold_conv_batchnorm(gm, HOPPER16)

    result = fuse_conv_relu(gm, HOPPER16)

    (skip,) = result.skipped
    assert "this one is the residual (one convolution per add is fused)" in skip.reason


def test_idempotent():
    model, gm = _capture(zoo.ConvResidual(), 8, 10, 10)
    fuse_conv_relu(gm, HOPPER16)
    code = gm.code

    again = fuse_conv_relu(gm, HOPPER16)

    assert again.count == 0 and gm.code == code
    _check_parity(model, gm, 8, 10, 10)


def test_the_engines_do_not_run_it():
    assert "fuse_conv_relu" in PIPELINE and "fuse_conv_relu" not in EXPORT_PIPELINE
    assert PIPELINE.index("fold_conv_batchnorm") < PIPELINE.index("fuse_conv_relu") < PIPELINE.index(
        "cast_precision")


def test_inductor_compiles_the_fused_graph():
    """Inductor takes the custom ops as extern kernels (their fake implementation gives shapes and strides)."""
    model, gm = _capture(Bottleneck(), 16, 12, 12)
    fold_conv_batchnorm(gm, HOPPER16)
    assert fuse_conv_relu(gm, HOPPER16).count == 3
    compiled = torch.compile(gm, backend="inductor")
    x = torch.randn(3, 16, 12, 12)
    with torch.no_grad():
        got, ref = compiled(x), model(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert got.stride() == ref.stride()


class _TwoConvAdd(nn.Module):
    """RepVGG's block without identity, ``relu(conv_3x3(x) + conv_1x1(x))``: both convolutions end in one add."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 6, 3, padding=1), nn.Conv2d(4, 6, 1)

    def forward(self, x):
        return F.relu(self.a(x) + self.b(x))


def test_relu_of_two_convolutions_fuses_one_with_the_other_as_residual():
    """A bug once: both convolutions were taken as sites of the one add; rewriting the first consumed the add and
    the second raised a TypeError (``passes.build_graph`` then dropped the pass)."""
    model, gm = _capture(_TwoConvAdd(), 4, 7, 7)

    result = fuse_conv_relu(gm, HOPPER16)

    assert result.count == 1 and result.notes["kinds"] == {result.changed[0]: "add_relu"}
    (skip,) = result.skipped
    assert "is fused with this ReLU" in skip.reason
    (fused,) = _fused(gm)
    assert fused.args[2].target == torch.ops.aten.conv2d.default  # the other convolution is the residual
    _check_parity(model, gm, 4, 7, 7)


class _WrittenBetween(nn.Module):
    """An in-place op between the convolution and its ReLU writes the convolution's input (``"x"``) or the
    residual (``"z"``): eager's convolution / add read the values before the write."""

    def __init__(self, which: str) -> None:
        super().__init__()
        self.which = which
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        h = x * 1.0
        if self.which == "x":
            y = self.conv(h)
            h[:, :2] = 0.0  # a write through a view of the input
            return F.relu(y) + h
        y = self.conv(x) + h
        h.mul_(2.0)
        return F.relu(y) + h


@pytest.mark.parametrize("which", ["x", "z"])
def test_refuses_a_site_whose_input_is_written_before_its_relu(which):
    """A bug once: the fused op, placed at the ReLU, read the written values (wrong results, no error)."""
    model, gm = _capture(_WrittenBetween(which), 4, 6, 6)

    result = fuse_conv_relu(gm, HOPPER16)

    assert result.count == 0
    (skip,) = result.skipped
    assert "writes in place into the convolution's input or the residual" in skip.reason
    _check_parity(model, gm, 4, 6, 6)


class _WrittenAfter(nn.Module):
    """The fused output is written in place after the ReLU, then returned (and read by a later convolution)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 6, 3, padding=1), nn.Conv2d(6, 6, 1)

    def forward(self, x):
        y = F.relu(self.a(x))
        y.mul_(2.0)
        z = F.relu(self.b(y))
        y[:, :2] = 0.0  # the graph returns the mul_ node: this write comes after it
        return y, z


def test_layout_copy_sees_in_place_writes_after_the_fused_op():
    """A bug once: the copy back to NCHW for the graph output was made right after the value it copies (the
    ``mul_``), before the later write through ``y[:, :2]``, and the graph returned the values before it."""
    model, gm = _capture(_WrittenAfter(), 4, 6, 6)

    result = fuse_conv_relu(gm, HOPPER16)

    assert result.count == 2
    _check_parity(model, gm, 4, 6, 6)
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    clone = out.args[0][0]
    assert clone.target == torch.ops.aten.clone.default and clone.next is out  # after every write


class _ViewOutputs(nn.Module):
    """Graph outputs that are views of a fused output in eager's NCHW layout, and ``as_strided`` of a view at a
    storage offset: none is dense (contiguous or channels-last) by itself."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.conv(x))
        a, b = torch.split(y, [3, 5], dim=1)
        n = y.shape[0]
        return (y.permute(0, 2, 3, 1), y[:, 2:6], a, b, y[:, None].expand(-1, 2, -1, -1, -1),
                torch.as_strided(y[:, 1:], (n, 4), (200, 3)) * 1.0)


def test_restores_views_of_the_fused_output():
    """A bug once: every such output raised "cannot restore the layout" (``passes.build_graph`` then dropped the
    pass); now the NCHW copy is made of the fused output and the views are replayed on it."""
    model, gm = _capture(_ViewOutputs(), 3, 5, 5)

    result = fuse_conv_relu(gm, HOPPER16)

    assert result.count == 1
    gm.graph.lint()
    _check_parity(model, gm, 3, 5, 5)


# -------------------------------------------------------------------------------------------- the ops


@pytest.mark.parametrize("stride, padding, dilation", [([1, 1], [1, 1], [1, 1]), ([2, 2], [0, 0], [1, 1]),
                                                       ([1, 1], [2, 2], [2, 2])])
def test_ops_match_the_composite_and_their_fake_strides(stride, padding, dilation):
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 4, 9, 9), torch.randn(6, 4, 3, 3), torch.randn(6)
    y = F.conv2d(x, w, b, stride, padding, dilation)
    z = torch.randn_like(y)

    out = CONV2D_RELU(x, w, b, stride, padding, dilation, 1)
    out_add = CONV2D_ADD_RELU(x, w, z, None, stride, padding, dilation, 1)

    torch.testing.assert_close(out, torch.relu(y))
    torch.testing.assert_close(out_add, torch.relu(F.conv2d(x, w, None, stride, padding, dilation) + z))
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.library.opcheck(CONV2D_RELU, (x, w, b, stride, padding, dilation, 1))
    torch.library.opcheck(CONV2D_ADD_RELU, (x, w, z, b, stride, padding, dilation, 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (cuDNN's fused kernels)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cudnn_ops_match_the_composite_on_cuda(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 32, 14, 14, device="cuda", dtype=dtype)
    w = torch.randn(64, 32, 3, 3, device="cuda", dtype=dtype) / 17
    b = torch.randn(64, device="cuda", dtype=dtype)
    z = torch.randn(4, 64, 14, 14, device="cuda", dtype=dtype)
    ref = torch.relu(F.conv2d(x.float(), w.float(), b.float(), 1, 1) + z.float())

    got = CONV2D_ADD_RELU(x, w, z, b, [1, 1], [1, 1], [1, 1], 1)

    assert got.dtype == dtype and got.is_contiguous(memory_format=torch.channels_last)
    assert zoo.rel_l2(got.float(), ref) < (1e-2 if dtype == torch.float16 else 3e-2)
    torch.library.opcheck(CONV2D_RELU, (x, w, b, [1, 1], [1, 1], [1, 1], 1))


def test_a_configuration_cudnn_refuses_falls_back_to_the_composite_with_one_warning(monkeypatch):
    """On CUDA a configuration without a cuDNN engine raises RuntimeError: the op warns once, computes the
    composite, and does not try cuDNN again for that configuration (faked here on the CPU)."""
    import passes.cudnn_ops as ops

    calls = []

    class _FakeCuda(torch.Tensor):
        pass

    def refuse(*args):
        calls.append(args[0])
        raise RuntimeError("CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR: no valid engine configs")

    monkeypatch.setattr(ops, "_cudnn_call", refuse)
    monkeypatch.setattr(ops, "REFUSED", set())
    monkeypatch.setattr(_FakeCuda, "is_cuda", property(lambda self: True))
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 6).as_subclass(_FakeCuda)
    w, b = torch.randn(5, 4, 3, 3), torch.randn(5)

    with pytest.warns(RuntimeWarning, match="cuDNN refused the fused convolution"):
        first = ops._cudnn_or_composite("conv2d_relu", x, w, None, b, [1, 1], [1, 1], [1, 1], 1)
    second = ops._cudnn_or_composite("conv2d_relu", x, w, None, b, [1, 1], [1, 1], [1, 1], 1)

    assert calls == ["conv2d_relu"] and len(ops.REFUSED) == 1
    ref = torch.relu(F.conv2d(x.as_subclass(torch.Tensor), w, b, 1, 1))
    torch.testing.assert_close(first.as_subclass(torch.Tensor), ref)
    torch.testing.assert_close(second.as_subclass(torch.Tensor), ref)


class _ReluIntoRegion(nn.Module):
    """A convolution + ReLU read by a ``torch.autocast(enabled=False)`` region (timm's EfficientViT attention
    computes in FP32 that way): the region is a higher-order op with a traced body."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 1)

    def forward(self, x):
        q = torch.relu(self.conv(x)).flatten(2)
        with torch.autocast(device_type=x.device.type, enabled=False):
            q = q.float()
            out = q @ q.transpose(-1, -2)
        return out


def test_a_region_reading_the_fused_output_gets_the_original_layout():
    """Before: re-typing the readers of the fused convolution failed on the region ("to_1 (wrap_with_autocast)
    fails on the fused convolutions' layout"), the pass raised and the backend fell back to plain Inductor for the
    whole graph. Now the region reads a copy in the original layout and the site still fuses."""
    model, gm = _capture(_ReluIntoRegion(), 4, 5, 5)
    assert any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in gm.graph.nodes)

    result = fuse_conv_relu(gm, HOPPER16)

    assert result.count == 1
    _check_parity(model, gm, 4, 5, 5)
