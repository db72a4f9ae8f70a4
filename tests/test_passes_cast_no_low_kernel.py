"""passes.cast_precision keeps ops with no fp16 / bf16 kernel (FFT, linear-algebra solvers) in FP32, whatever the
policy, instead of handing them low-precision inputs that make the whole graph fail."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from passes import PassSpec, cast_precision
from passes.cast_precision import _FFT_OPS, _OTHER_OPS, _SOLVER_OPS, no_low_precision_kernel
from passes.policy import PURE_KEEP_LIST
from tctune.capture import capture
from zoo import TOLERANCES

LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


class FNetLike(nn.Module):
    """Hugging Face FNet's mixing layer between linears: the real part of a 2-D FFT over (sequence, hidden)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.out = nn.Linear(24, 8)

    def forward(self, x):
        h = self.inp(x)
        mixed = torch.fft.fftn(h, dim=(1, 2)).real
        return self.out(self.norm(mixed + h))


class SolveLike(nn.Module):
    """A linear system solved between linears (a learned metric, a whitening step)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)  # (B, 8, 8)
        gram = h @ h.transpose(-1, -2) + 8 * torch.eye(8)
        return self.b(torch.linalg.solve(gram, h))


def _spec(precision: str, policy: str) -> PassSpec:
    if policy == "pure":
        return PassSpec(precision=precision, keep_list=PURE_KEEP_LIST, residual_fp32=False)
    return PassSpec(precision=precision)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("policy", ["autocast", "pure"])
def test_fft_stays_fp32_with_reason_and_parity(precision, policy):
    torch.manual_seed(0)
    model = FNetLike().eval()
    gm = capture(model, (torch.randn(2, 12, 16),))

    result = cast_precision(gm, _spec(precision, policy))

    ffts = [n for n in gm.graph.nodes if n.op == "call_function" and "fft" in str(n.target)]
    assert ffts
    for node in ffts:
        assert all(a.meta["val"].dtype == torch.float32 for a in node.all_input_nodes), node.format_node()
        assert "FFT has no bf16 kernel" in result.notes["no_low_precision_kernel"][node.name]
    reasons = {s.node: s.reason for s in result.skipped}
    assert reasons[ffts[0].name].startswith(f"no low-precision kernel: {ffts[0].name} stays FP32 (FFT")
    linears = [n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert linears and all(n.name in result.changed for n in linears)  # the rest of the graph still casts
    assert gm.inp.weight.dtype == LOW[precision]
    torch.manual_seed(11)
    x = torch.randn(3, 12, 16)  # fresh inputs, another batch
    with torch.no_grad():
        got, ref = gm(x), model(x)
    assert got.dtype == ref.dtype and torch.isfinite(got).all()
    assert _rel(got, ref) <= TOLERANCES[precision]["rel_l2"]


def test_solver_stays_fp32_and_matches_eager():
    torch.manual_seed(0)
    model = SolveLike().eval()
    gm = capture(model, (torch.randn(2, 8, 8),))

    result = cast_precision(gm, _spec("bf16", "pure"))

    (solve,) = [n for n in gm.graph.nodes if n.name in result.notes["no_low_precision_kernel"]]
    assert "solver" in result.notes["no_low_precision_kernel"][solve.name]
    assert all(a.meta["val"].dtype == torch.float32 for a in solve.all_input_nodes
               if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].is_floating_point())
    assert result.count > 0
    torch.manual_seed(12)
    x = torch.randn(4, 8, 8)
    with torch.no_grad():
        got, ref = gm(x), model(x)
    assert _rel(got, ref) <= TOLERANCES["bf16"]["rel_l2"]


def test_graph_without_such_ops_has_no_entries():
    torch.manual_seed(0)
    gm = capture(nn.Sequential(nn.Linear(8, 8), nn.GELU()).eval(), (torch.randn(2, 8),))
    result = cast_precision(gm, _spec("bf16", "pure"))
    assert result.notes["no_low_precision_kernel"] == {}
    assert not any(s.reason.startswith("no low-precision kernel") for s in result.skipped)


def test_rule_names_real_aten_ops_and_leaves_others():
    for name in sorted(_SOLVER_OPS | _FFT_OPS | set(_OTHER_OPS)):
        assert hasattr(torch.ops.aten, name), f"{name} is not an ATen op: a typo in the list"
    for name in ("fft_fftn", "fft_rfft", "fft_irfft2", "_fft_r2c", "_fft_c2c", "_fft_c2r", "stft"):
        assert "FFT" in no_low_precision_kernel(name)
    assert "solver" in no_low_precision_kernel("linalg_inv_ex")
    assert "distance" in no_low_precision_kernel("_cdist_forward")
    for name in ("linear", "cumsum", "linalg_vector_norm", "matmul", "softmax", "roll"):
        assert no_low_precision_kernel(name) is None


class DistanceLike(nn.Module):
    """Pairwise distances between projected points (a prototype / retrieval head)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.out = nn.Linear(5, 3)

    def forward(self, x, protos):
        return self.out(torch.cdist(self.proj(x), protos))


def test_cdist_stays_fp32_and_matches_eager():
    torch.manual_seed(0)
    model = DistanceLike().eval()
    gm = capture(model, (torch.randn(2, 6, 8), torch.randn(2, 5, 8)))

    result = cast_precision(gm, _spec("bf16", "pure"))

    (reason,) = result.notes["no_low_precision_kernel"].values()
    assert reason.startswith("pairwise distance")
    torch.manual_seed(13)
    x, protos = torch.randn(3, 6, 8), torch.randn(3, 5, 8)
    with torch.no_grad():
        got, ref = gm(x, protos), model(x, protos)
    assert _rel(got, ref) <= TOLERANCES["bf16"]["rel_l2"]
