"""Tests for passes.pad_conv: Cin / Cout padding of aten.conv2d per the measured should-pad rules."""
from __future__ import annotations

import pytest
import torch

import zoo
from passes import PassSpec, cast_precision
from passes.pad_conv import TF32_REASON, pad_conv_channels

HOPPER_FP16 = PassSpec(precision="fp16", alignment=zoo.ALIGNMENT, arch="Hopper")
_CONV = torch.ops.aten.conv2d.default


@pytest.fixture
def stem_rule_without_pad_cost(monkeypatch):
    """The Hopper table without the stem's with-pad-op timing: the small-Cin rule then pads Cin 3 -> 4 (the
    rewrite the tests below exercise; the shipped table says the pad op makes it slower, so it is skipped)."""
    import passes.should_pad as sp

    table = copy.deepcopy(sp.load_table())
    sp.measurement(table["arch"]["Hopper"], "stem_conv_7x7_cin").pop("ms_with_pad_op_by_Cin")
    monkeypatch.setattr(sp, "load_table", lambda path=None: table)


def test_pad_conv_channels_skips_stem_with_the_shipped_table():
    model, gm, entry = zoo.build("stem_cnn")

    result = pad_conv_channels(gm, HOPPER_FP16)

    assert result.notes["padded"]["conv2d"] == {"Cin": [3, 3], "Cout": [61, 64]}
    assert any(s.node == "conv2d" and "with the channel pad itself" in s.reason for s in result.skipped)
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp32")


def test_pad_conv_channels_pads_stem_and_body(stem_rule_without_pad_cost):
    model, gm, entry = zoo.build("stem_cnn")
    keys = list(gm.state_dict())

    result = pad_conv_channels(gm, HOPPER_FP16)

    assert result.count == 2
    assert result.notes["padded"]["conv2d"] == {"Cin": [3, 4], "Cout": [61, 64]}  # stem: 3 -> 4, not 8
    assert result.notes["padded"]["conv2d_1"] == {"Cin": [61, 64], "Cout": [61, 64]}
    assert gm.stem.weight.shape == (64, 4, 7, 7) and gm.stem.bias.shape == (64,)
    assert gm.conv.weight.shape == (64, 64, 3, 3)
    assert "small-Cin rule" in result.notes["should_pad"]["conv2d"]["Cin"]["reason"]
    # The stem's padded output flows through the ReLU into the body conv: one pad (the input's Cin 3 -> 4)
    # and one slice (before the output) instead of one of each per conv.
    assert result.notes["kept_padded"] == 1 and result.notes["kept_padded_ops"] == ["relu"]
    assert zoo.call_targets(gm).count(torch.ops.aten.constant_pad_nd.default) == 1
    assert zoo.call_targets(gm).count(torch.ops.aten.slice.Tensor) == 1
    assert list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp32")  # the pass alone keeps fp32 math


def test_pad_conv_channels_parity_with_cast():
    model, gm, entry = zoo.build("stem_cnn")
    spec = PassSpec(precision="bf16", alignment=zoo.ALIGNMENT, arch="Hopper")

    result = pad_conv_channels(gm, spec)
    cast_precision(gm, spec)

    # bf16 has no measured stem rule: Cin 3 -> 8 would be 2.67x the work, so Cin stays 3.
    assert result.notes["padded"]["conv2d"] == {"Cin": [3, 3], "Cout": [61, 64]}
    assert any(s.node == "conv2d" and s.reason.startswith("can pad but should not: Cin 3 -> 8") for s in result.skipped)
    zoo.assert_matches_eager(model, gm, entry.example_inputs(4), "bf16")


def test_pad_conv_channels_idempotent(stem_rule_without_pad_cost):
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

    result = pad_conv_channels(gm, PassSpec(precision=precision, alignment=zoo.ALIGNMENT, arch="Hopper"))

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


# ------------------------------------------------------------------ padded channels kept between convs
# pad_conv_channels' canonicalization (passes/pad_conv.py docstring): channel slices sink below per-channel
# ops and cancel against the next padded conv's pad, so a chain of padded convs has one pad (the input's)
# and one slice (before the output). The pass pads at spec.precision fp16 / bf16 but leaves the dtype alone:
# the graph runs in fp32 here and must match eager within the fp32 tolerance (zero weights add exactly 0);
# the bf16 tests add cast_precision and compare at the bf16 tolerance.

import copy  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import fx, nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from passes._graph import op_name  # noqa: E402

_PAD = torch.ops.aten.constant_pad_nd.default
_SLICE = torch.ops.aten.slice.Tensor
#: Ops allowed to read a tensor with padded channels: convs, slices, and the ops a slice may sink below.
_PADDED_READERS = {
    "conv2d", "slice", "relu", "relu_", "sigmoid", "gelu", "silu", "tanh", "hardtanh", "hardswish", "leaky_relu",
    "elu", "clone", "dropout", "_to_copy", "to", "add", "add_", "sub", "mul", "div", "max_pool2d", "avg_pool2d",
    "adaptive_avg_pool2d",
}
_ACTS = {
    "relu": F.relu,
    "relu_inplace": nn.ReLU(inplace=True),
    "sigmoid": torch.sigmoid,
    "gelu": F.gelu,
    "scaled": lambda x: torch.tanh(x) * 0.5 + 1.0,
}


class ConvChain(nn.Module):
    """``n`` 3x3 convs of ``c`` channels with an activation between them (and a max-pool after the second)."""

    def __init__(self, n: int = 4, c: int = 61, act: str = "relu", pool: bool = False) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in range(n))
        self.act, self.pool = _ACTS[act], pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(x)
            if i < len(self.convs) - 1:
                x = self.act(x)
                if self.pool and i == 1:
                    x = F.max_pool2d(x, 2)
        return x


class BasicBlockNet(nn.Module):
    """Stem conv + ReLU, a ResNet basic block (conv, ReLU, conv, residual add, ReLU), a head conv; 61 channels.

    ``inplace``: written as torchvision writes it (``ReLU(inplace=True)``, ``out += identity``: relu_ / add_).
    """

    def __init__(self, inplace: bool = False, c: int = 61) -> None:
        super().__init__()
        self.stem, self.conv1, self.conv2, self.head = (nn.Conv2d(c, c, 3, padding=1) for _ in range(4))
        self.inplace = inplace
        self.relu = nn.ReLU(inplace=inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.stem(x))
        out = self.conv2(self.relu(self.conv1(x)))
        if self.inplace:
            out += x
        else:
            out = out + x
        return self.head(self.relu(out))


class LeakyChain(nn.Module):
    """conv, ReLU, conv, ReLU, conv (61 channels); the first ReLU's output is read by something else too."""

    def __init__(self, reader: str, c: int = 61, hw: int = 8) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in range(3))
        self.reader = reader
        if reader == "linear":
            self.fc = nn.Linear(c * hw * hw, 10)
        if reader == "batch_norm":
            self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor):
        h = F.relu(self.convs[0](x))
        y = self.convs[2](F.relu(self.convs[1](h)))
        if self.reader == "output":
            return y, h
        if self.reader == "linear":
            return y, self.fc(torch.flatten(h, 1))
        if self.reader == "mean":
            return y, h.mean(dim=1)
        if self.reader == "cat":
            return torch.cat([y, h], dim=1)
        return y, self.bn(h)


class Unbounded(nn.Module):
    """Two convs joined by an op whose padded-channel values are not bounded (or not finite): slices stay."""

    def __init__(self, kind: str, c: int = 61) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Conv2d(c, c, 3, padding=1) for _ in range(3))
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "big_scalar":  # sigmoid(0) = 0.5 in the padded channels, times 1e5: past the bound
            h = torch.sigmoid(self.a(x)) * 1e5
        elif self.kind == "tensor_div":  # 0 / 0 in the padded channels
            h = self.a(x) / (self.b(x) + 3.0)
        else:  # "inf_scalar": the real channels become tanh(+-inf) = +-1, the padded ones tanh(0 * inf) = NaN
            h = torch.tanh(self.a(x) * float("inf"))
        return self.c(h)


class InPlaceShared(nn.Module):
    """A conv output read by a sigmoid *and* mutated in place by relu_: the mutated slice must stay."""

    def __init__(self, c: int = 61) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x)
        t = torch.sigmoid(a)
        a.relu_()
        return self.b(a) + t


def _capture(model: nn.Module, *shape: int, channels_last: bool = False):
    model = model.eval()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    torch.manual_seed(123)
    x = torch.randn(3, *shape)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    return model, zoo.capture(model, (x,))


def _seeded(factory):
    torch.manual_seed(0)
    return factory()


def _run_nodes(gm, inputs) -> dict:
    """Every node's runtime value (fx.Interpreter) on ``inputs``."""
    seen = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            seen[n] = out
            return out

    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return seen


def _assert_meta_matches_run(gm, inputs) -> None:
    """Each call_function node's ``meta["val"]`` has the dtype, sizes (batch aside) and strides it runs with."""
    for node, out in _run_nodes(gm, inputs).items():
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(out, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        assert val.dtype == out.dtype, node.name
        assert tuple(val.shape[1:]) == tuple(out.shape[1:]), node.name
        assert tuple(val.stride()[1:]) == tuple(out.stride()[1:]), (node.name, val.stride(), out.stride())


def _assert_padded_stays_inside(gm) -> None:
    """No tensor with padded channels reaches a graph output or a reader outside the handled set."""
    padded_width = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor) and val.dim() == 4:
            padded_width[node] = val.shape[1]
    for node in gm.graph.nodes:
        if node.op == "output":
            for leaf in node.all_input_nodes:
                assert leaf.meta["val"].shape[1] not in (64,), f"padded tensor {leaf.name} reaches the output"
            continue
        for arg in node.all_input_nodes:
            if padded_width.get(arg) == 64 and node.op == "call_function":
                assert op_name(node) in _PADDED_READERS | {"_assert_tensor_metadata"}, (node.name, arg.name)


def _check_kept_padded(model, gm, inputs, pads: int, slices: int, kept: int) -> None:
    """Pad once, check the counts and the caller-visible contract, then pad again (idempotent)."""
    keys = list(gm.state_dict())
    with torch.no_grad():
        before = zoo.flat_outputs(copy.deepcopy(gm)(*inputs))

    result = pad_conv_channels(gm, HOPPER_FP16)

    assert result.notes["kept_padded"] == kept, result.notes
    assert (zoo.count_calls(gm, _PAD), zoo.count_calls(gm, _SLICE)) == (pads, slices), gm.code
    assert list(gm.state_dict()) == keys
    _assert_padded_stays_inside(gm)
    _assert_meta_matches_run(gm, inputs)
    zoo.assert_matches_eager(model, gm, inputs, "fp32")
    with torch.no_grad():
        ref, got = zoo.flat_outputs(model(*inputs)), zoo.flat_outputs(gm(*inputs))
    assert [(t.shape, t.dtype, t.stride()) for t in got] == [(t.shape, t.dtype, t.stride()) for t in ref]
    assert [(t.shape, t.dtype, t.stride()) for t in got] == [(t.shape, t.dtype, t.stride()) for t in before]
    code = gm.code
    again = pad_conv_channels(gm, HOPPER_FP16)
    assert again.count == 0 and gm.code == code, "not idempotent"


@pytest.mark.parametrize("act", ["relu", "relu_inplace", "sigmoid", "gelu", "scaled"])
@pytest.mark.parametrize("n", [3, 4])
def test_pad_conv_keeps_channels_padded_through_chain(n, act):
    model, gm = _capture(_seeded(lambda: ConvChain(n=n, act=act)), 61, 8, 8)
    torch.manual_seed(5)

    # One pad (the graph input, Cin 61 -> 64) and one slice (before the output), not one per conv.
    _check_kept_padded(model, gm, (torch.randn(5, 61, 8, 8),), pads=1, slices=1, kept=n - 1)

    pad = next(n for n in gm.graph.nodes if n.target == _PAD)
    assert pad.args[0].op == "placeholder"
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    (leaf,) = out.all_input_nodes
    assert leaf.target == torch.ops.aten.clone.default and leaf.args[0].target == _SLICE  # the output copy


def test_pad_conv_keeps_channels_padded_through_max_pool():
    model, gm = _capture(_seeded(lambda: ConvChain(n=4, act="relu", pool=True)), 61, 8, 8)
    torch.manual_seed(6)

    _check_kept_padded(model, gm, (torch.randn(5, 61, 8, 8),), pads=1, slices=1, kept=3)

    (pool,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.max_pool2d.default]
    assert pool.meta["val"].shape[1] == 64  # the pool runs on the padded tensor


@pytest.mark.parametrize("inplace", [False, True], ids=["functional", "inplace"])
def test_pad_conv_keeps_channels_padded_through_residual_block(inplace):
    model, gm = _capture(_seeded(lambda: BasicBlockNet(inplace=inplace)), 61, 8, 8)
    torch.manual_seed(7)

    _check_kept_padded(model, gm, (torch.randn(5, 61, 8, 8),), pads=1, slices=1, kept=3)

    adds = [n for n in gm.graph.nodes if op_name(n) in ("add", "add_")]
    assert len(adds) == 1 and adds[0].meta["val"].shape[1] == 64  # one add, of the two padded tensors


@pytest.mark.parametrize("reader", ["output", "linear", "mean", "cat", "batch_norm"])
def test_pad_conv_keeps_slice_for_other_readers(reader):
    model, gm = _capture(_seeded(lambda: LeakyChain(reader)), 61, 8, 8)
    torch.manual_seed(8)

    # conv 2 and conv 3 read padded tensors directly; the ReLU output's other reader gets a slice of it.
    _check_kept_padded(model, gm, (torch.randn(5, 61, 8, 8),), pads=1, slices=2, kept=2)

    relu = next(n for n in gm.graph.nodes if op_name(n) == "relu")  # the first ReLU (nodes keep their names)
    assert relu.args[0].target == _CONV and relu.args[0].args[0].args[0].op == "placeholder"
    others = [u for u in relu.users if u.target not in (_CONV, _SLICE)]
    assert others == []  # the ReLU feeds conv 2 and the slice only
    (view,) = [u for u in relu.users if u.target == _SLICE]
    assert view.args[1:] == (1, 0, 61) and view.meta["val"].shape[1] == 61


@pytest.mark.parametrize("kind, pads, slices", [("big_scalar", 2, 2), ("tensor_div", 3, 3), ("inf_scalar", 2, 2)])
def test_pad_conv_keeps_slice_when_padded_values_unbounded(kind, pads, slices):
    model, gm = _capture(_seeded(lambda: Unbounded(kind)), 61, 8, 8)
    torch.manual_seed(9)

    _check_kept_padded(model, gm, (torch.randn(5, 61, 8, 8),), pads=pads, slices=slices, kept=0)


def test_pad_conv_keeps_mutated_slice_with_other_readers():
    model, gm = _capture(_seeded(InPlaceShared), 61, 8, 8)
    torch.manual_seed(10)

    _check_kept_padded(model, gm, (torch.randn(5, 61, 8, 8),), pads=2, slices=2, kept=0)

    (relu_,) = [n for n in gm.graph.nodes if op_name(n) == "relu_"]
    assert relu_.args[0].target == _SLICE  # still mutates the 61-channel view the sigmoid also read


def test_pad_conv_keeps_padded_channels_last():
    """A channels-last capture: the padded intermediates stay channels-last, in the fake values and at run
    time, and the output is channels-last as eager's is (and as per-conv padding's is)."""
    model, gm = _capture(_seeded(lambda: ConvChain(n=4, act="relu")), 61, 8, 8, channels_last=True)
    baseline = copy.deepcopy(gm)
    torch.manual_seed(11)
    x = torch.randn(5, 61, 8, 8).to(memory_format=torch.channels_last)

    result = pad_conv_channels(gm, HOPPER_FP16)
    per_conv = pad_conv_channels(baseline, HOPPER_FP16, keep_padded=False)

    assert result.notes["kept_padded"] == 3 and (zoo.count_calls(gm, _PAD), zoo.count_calls(gm, _SLICE)) == (1, 1)
    assert per_conv.count == result.count and per_conv.notes["kept_padded"] == 0
    assert (zoo.count_calls(baseline, _PAD), zoo.count_calls(baseline, _SLICE)) == (4, 4)
    inner = [n for n in gm.graph.nodes if op_name(n) in ("conv2d", "relu")]
    assert len(inner) == 7
    for node in inner:
        val = node.meta["val"]
        assert val.shape[1] == 64 and val.is_contiguous(memory_format=torch.channels_last), node.name
    _assert_meta_matches_run(gm, (x,))
    gm, baseline = gm.to(memory_format=torch.channels_last), baseline.to(memory_format=torch.channels_last)
    zoo.assert_matches_eager(model, gm, (x,), "fp32")
    with torch.no_grad():
        got, ref = gm(x), model(x)
        assert got.stride() == baseline(x).stride() == ref.stride()
        assert got.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("factory", [lambda: ConvChain(n=4, act="relu", pool=True), BasicBlockNet],
                         ids=["chain", "basic_block"])
def test_pad_conv_keeps_padded_parity_with_cast(factory):
    model, gm = _capture(_seeded(factory), 61, 8, 8)
    spec = PassSpec(precision="bf16", alignment=zoo.ALIGNMENT, arch="Hopper")

    result = pad_conv_channels(gm, spec)
    cast_precision(gm, spec)

    assert result.notes["kept_padded"] == 3
    assert (zoo.count_calls(gm, _PAD), zoo.count_calls(gm, _SLICE)) == (1, 1)
    torch.manual_seed(12)
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 61, 8, 8),), "bf16")


class _RandomNet(nn.Module):
    """Convs of odd widths joined by random per-channel ops (and residual adds where the widths agree)."""

    def __init__(self, widths: list[int], ops: list[str], side: str) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3, padding=1) for a, b in zip(widths[:-1], widths[1:]))
        self.ops, self.side = ops, side

    def forward(self, x):
        prev = None
        extra = None
        for i, conv in enumerate(self.convs):
            y = conv(x)
            if i == len(self.convs) - 1:
                break
            op = self.ops[i]
            if op == "residual":  # a residual add where the widths agree, else a plain ReLU
                y = F.relu(y + prev) if prev is not None and prev.shape == y.shape else F.relu(y)
            elif op == "sigmoid_mul":
                y = torch.sigmoid(y) * y
            elif op == "max_pool":
                y = F.max_pool2d(y, 3, stride=1, padding=1)
            elif op == "avg_pool":
                y = F.avg_pool2d(y, 3, stride=1, padding=1, count_include_pad=False)
            elif op == "hardtanh":
                y = F.hardtanh(y, 0.5, 2.0)
            elif op == "scalar":
                y = (F.leaky_relu(y, 0.2) - 1.5) / 4.0
            elif op != "none":
                y = _ACTS[op](y)
            if i == 0 and self.side == "output":
                extra = y
            elif i == 0 and self.side == "sum":
                extra = y.sum(dim=(2, 3))
            prev, x = y, y
        return y if extra is None else (y, extra)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    widths=st.lists(st.sampled_from([11, 13, 16, 21, 29]), min_size=3, max_size=5),
    ops=st.lists(st.sampled_from(["relu", "relu_inplace", "sigmoid", "gelu", "scaled", "none", "residual",
                                  "sigmoid_mul", "max_pool", "avg_pool", "hardtanh", "scalar"]),
                 min_size=4, max_size=4),
    side=st.sampled_from(["none", "output", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_pad_conv_keeps_padded(widths, ops, side, seed):
    torch.manual_seed(seed)
    model = _RandomNet(widths, ops, side).eval()
    torch.manual_seed(seed + 1)
    gm = zoo.capture(model, (torch.randn(3, widths[0], 6, 6),))
    keys = list(gm.state_dict())
    inputs = (torch.randn(5, widths[0], 6, 6),)

    result = pad_conv_channels(gm, HOPPER_FP16)

    assert list(gm.state_dict()) == keys
    _assert_padded_stays_inside_any(gm)
    _assert_meta_matches_run(gm, inputs)
    zoo.assert_matches_eager(model, gm, inputs, "fp32")
    if result.count:
        # Every pad left is either on the graph input or in front of a conv whose producer is not padded.
        assert zoo.count_calls(gm, _PAD) <= 1 + sum(1 for n in gm.graph.nodes if n.target == _SLICE)
    code = gm.code
    assert pad_conv_channels(gm, HOPPER_FP16).count == 0 and gm.code == code


def _assert_padded_stays_inside_any(gm) -> None:
    """``_assert_padded_stays_inside`` for any widths: a tensor is padded when it is wider than its slice."""
    widths = {}
    for node in gm.graph.nodes:
        if node.target == _SLICE and node.args[1] == 1:
            widths[node.args[0]] = node.args[3]
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            if arg in widths and node.op == "output":
                raise AssertionError(f"padded tensor {arg.name} reaches the output")
            if arg in widths and node.op == "call_function":
                assert op_name(node) in _PADDED_READERS | {"_assert_tensor_metadata"}, (node.name, arg.name)
