"""Tests for passes.cast_fp8: eligible linears as scaled FP8 GEMMs (torch._scaled_mm), the rest in bf16."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zoo
from passes import PASSES, PIPELINE, PassSpec, Skip, run_pipeline
from passes.cast_fp8 import FP8_FLAG, cast_fp8_linears
from passes.fp8_numerics import FP8_DTYPE, FP8_MAX, fp8_linear_reference, fp8_scale, quantize_fp8, scaled_mm_works

FP8 = PassSpec(precision="fp8", alignment={**zoo.ALIGNMENT, "fp8": 16}, arch="Hopper")
FP8_TENSOR = PassSpec(precision="fp8", fp8_scaling="tensor")
#: Signal-to-noise floor against FP32 eager: 25 dB, i.e. relative L2 error <= 10 ** (-25 / 20) = 5.6e-2.
SQNR_DB = 25.0
_LINEAR = torch.ops.aten.linear.default
_SCALED_MM = torch.ops.aten._scaled_mm.default


class FP8MLP(nn.Module):
    """Linear 64 -> 128 -> 64 -> 32 (ReLU, GELU): every K and N a multiple of 16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.relu(self.fc1(x)))))


class OddK(nn.Module):
    """Linear 61 -> 32 (K=61: not FP8) then 32 -> 16 (FP8), without bias on the second."""

    def __init__(self) -> None:
        super().__init__()
        self.odd, self.even = nn.Linear(61, 32), nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.even(torch.relu(self.odd(x)))


class Tied(nn.Module):
    """One Linear(32, 32) applied twice (one weight, two GEMMs)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


class KNProj(nn.Module):
    """GPT-2's ``Conv1D``: ``addmm(bias, x2d, W)`` with a (K, N) weight ``W``."""

    def __init__(self, k: int, n: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, n) * k ** -0.5)
        self.bias = nn.Parameter(torch.randn(n) * 0.1) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        y = torch.addmm(self.bias, x2d, self.weight) if self.bias is not None else torch.mm(x2d, self.weight)
        return y.view(*x.shape[:-1], -1)


class KNBlock(nn.Module):
    """Conv1D-style projections 64 -> 128 (addmm) -> 64 (square 64x64 via mm, no bias) -> 64 (addmm), and an
    activation @ activation mm that is not a weight GEMM."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.sq = KNProj(64, 128), KNProj(128, 64), KNProj(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(x)))
        g = torch.mm(h.reshape(-1, 64).t(), h.reshape(-1, 64))  # (64, 64): two activations, not a weight GEMM
        return self.sq(x) + h + g.mean() * 1e-2


def _build(cls, *shape, seed=0, device="cpu"):
    torch.manual_seed(seed)
    model = cls().eval().to(device)
    gm = zoo.capture(model, (torch.randn(*shape, device=device),))
    return model, gm


def _sqnr_db(got: torch.Tensor, ref: torch.Tensor) -> float:
    return -20 * math.log10(max(zoo.rel_l2(got, ref), 1e-30))


# --------------------------------------------------------------------------------------- quantization math


def test_quantize_saturates_never_nan():
    t = torch.tensor([1e6, -1e6, 3.0, 0.0, 500.0])

    q, _ = quantize_fp8(t, scale=torch.tensor(1.0))

    assert q.dtype == FP8_DTYPE
    assert q.float().tolist() == [FP8_MAX, -FP8_MAX, 3.0, 0.0, FP8_MAX]  # 1e6 -> 448 * scale
    q2, _ = quantize_fp8(t, scale=torch.tensor(2.0))
    assert q2.float()[0].item() * 2.0 == 2 * FP8_MAX and torch.isfinite(q2.float()).all()


def test_quantize_dynamic_scale_maps_amax_to_448_and_zero_rows_are_fine():
    t = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 3.0, 0.5], [-7.0, 1e-3, 0.0, 2.0]])

    q, scale = quantize_fp8(t)  # row-wise

    assert scale.shape == (3, 1) and scale.dtype == torch.float32
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert q.float()[0].tolist() == [0.0] * 4  # all-zero row: exact zeros, no 0/0
    assert q.float().abs().amax(dim=1)[1:].tolist() == [FP8_MAX, FP8_MAX]
    back = q.float() * scale
    assert torch.isfinite(back).all()
    assert zoo.rel_l2(back[1:], t[1:]) < 4e-2  # 3 mantissa bits: <= 2^-4 relative per element
    s = fp8_scale(t, "tensor")
    assert s.dim() == 0 and s.item() == pytest.approx(7.0 / FP8_MAX)
    assert fp8_scale(torch.zeros(4, 4), "tensor").item() > 0


@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_reference_math_parity_with_fp32(scaling):
    """The rewritten linear's math in plain torch (no _scaled_mm kernel needed) meets the SQNR floor."""
    torch.manual_seed(1)
    x, w, b = torch.randn(5, 7, 64), torch.randn(48, 64) / 8, torch.randn(48)

    got = fp8_linear_reference(x, w, b, scaling)

    assert got.dtype == torch.bfloat16 and got.shape == (5, 7, 48)
    assert _sqnr_db(got, F.linear(x, w, b)) >= SQNR_DB


# ---------------------------------------------------------------------------------------------- spec


def test_pass_spec_takes_fp8_stored_as_bf16():
    assert PassSpec(precision="fp8").dtype == torch.bfloat16
    assert PassSpec(precision="fp8").fp8_scaling == "row"
    assert PassSpec(precision="fp8", fp8_scaling="tensor").fp8_scaling == "tensor"
    with pytest.raises(ValueError, match="fp8_scaling"):
        PassSpec(precision="fp8", fp8_scaling="block")
    with pytest.raises(ValueError, match="precision"):
        PassSpec(precision="fp4")
    assert FP8.align() == 16


def test_registered_right_before_cast_precision():
    assert PASSES["cast_fp8_linears"] is cast_fp8_linears
    assert PIPELINE.index("cast_fp8_linears") == PIPELINE.index("cast_precision") - 1


# ---------------------------------------------------------------------------------------------- rewrite


def test_rewrite_fires_on_eligible_linears():
    _, gm = _build(FP8MLP, 3, 64)
    keys = list(gm.state_dict())

    result = cast_fp8_linears(gm, FP8)

    assert result.name == "cast_fp8_linears"
    assert result.count == 3 and result.changed == ["linear", "linear_1", "linear_2"]
    assert result.skipped == []
    assert _LINEAR not in zoo.call_targets(gm)
    mms = [n for n in gm.graph.nodes if n.target == _SCALED_MM]
    assert len(mms) == 3 and all(n.meta.get(FP8_FLAG) for n in mms)
    assert all(n.kwargs["out_dtype"] == torch.bfloat16 for n in mms)
    assert result.notes["scaling"] == "row"
    assert result.notes["fp8_weights"]["fc1.weight"] == ["fc1.weight_fp8", "fc1.weight_fp8_scale"]
    # the rest of the graph was cast to bf16 first (GELU runs on bf16)
    assert isinstance(result.notes["cast_precision"], dict) and result.notes["cast_precision"]["changed"] > 0
    # quantized once, stored as non-persistent buffers: state_dict keys unchanged
    assert list(gm.state_dict()) == keys
    assert gm.fc1.weight_fp8.dtype == FP8_DTYPE and gm.fc1.weight_fp8.shape == (128, 64)
    assert gm.fc1.weight_fp8_scale.dtype == torch.float32 and gm.fc1.weight_fp8_scale.shape == (1, 128)
    assert "fc1.weight_fp8" not in gm.state_dict()


def test_rewrite_fires_on_addmm_and_mm_with_a_kn_weight():
    """GPT-2's Conv1D GEMMs (aten.addmm / aten.mm reading a (K, N) get_attr weight) become FP8 GEMMs too; the
    codes are stored (N, K) like a linear's, and an activation @ activation mm is neither rewritten nor listed."""
    model, gm = _build(KNBlock, 2, 5, 64)
    addmm, mm = torch.ops.aten.addmm.default, torch.ops.aten.mm.default
    assert zoo.call_targets(gm).count(addmm) == 2 and zoo.call_targets(gm).count(mm) == 2

    result = cast_fp8_linears(gm, FP8)

    assert result.count == 3 and result.skipped == []
    assert addmm not in zoo.call_targets(gm) and zoo.call_targets(gm).count(mm) == 1  # the activation product stays
    assert sorted(result.notes["fp8_weights_kn"]) == ["down.weight", "sq.weight", "up.weight"]
    assert gm.up.weight_fp8.shape == (128, 64) and gm.up.weight_fp8_scale.shape == (1, 128)
    assert gm.sq.weight_fp8.shape == (64, 64)
    # the square weight's codes are of its transpose (output channel = row of the codes)
    codes, _ = quantize_fp8(model.sq.weight.detach().t())  # from the FP32 weight (the graph's is bf16 now)
    assert torch.equal(gm.sq.weight_fp8.float(), codes.float())
    mms = [n for n in gm.graph.nodes if n.target == _SCALED_MM]
    assert sum(n.kwargs["bias"] is not None for n in mms) == 2


def test_addmm_with_a_2d_bias_or_beta_stays_bf16_with_reason():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 16))
            self.b2 = nn.Parameter(torch.randn(4, 16))
            self.b1 = nn.Parameter(torch.randn(16))

        def forward(self, x):
            return torch.addmm(self.b2, x, self.w) + torch.addmm(self.b1, x, self.w, beta=0.5)

    torch.manual_seed(0)
    gm = torch.export.export(Odd().eval(), (torch.randn(4, 32),)).module()  # static batch: the (4, 16) bias

    result = cast_fp8_linears(gm, FP8)

    assert result.count == 0
    reasons = sorted(s.reason for s in result.skipped)
    assert reasons == ["addmm bias of shape (4, 16) is not (16,) (the FP8 GEMM's epilogue adds a per-column bias)",
                       "addmm with beta or alpha other than 1"]


@zoo.SCALED_MM_ROW
def test_kn_weight_parity_with_fp32_eager_and_reference_on_cpu():
    torch.manual_seed(0)
    model = KNBlock().eval()
    gm = zoo.capture(model, (torch.randn(2, 5, 64),))
    cast_fp8_linears(gm, FP8)

    for seed in (20, 21):
        torch.manual_seed(seed)
        x = torch.randn(3, 5, 64)  # a batch size not seen at capture
        with torch.no_grad():
            ref, got = model(x), gm(x)
        assert got.shape == ref.shape and torch.isfinite(got).all()
        assert _sqnr_db(got, ref) >= SQNR_DB, f"SQNR {_sqnr_db(got, ref):.1f} dB"

    # one projection against the plain-torch reference math (weight given (N, K), as a linear's)
    proj = KNProj(64, 48).eval()
    g1 = zoo.capture(proj, (torch.randn(4, 64),))
    cast_fp8_linears(g1, FP8)
    x = torch.randn(6, 64)
    with torch.no_grad():
        got = g1(x)
    ref = fp8_linear_reference(x, proj.weight.t(), proj.bias).float()
    torch.testing.assert_close(got, ref, rtol=1.6e-2, atol=1e-2)


def test_tensor_scaling_stores_scalar_scales():
    _, gm = _build(FP8MLP, 3, 64)

    result = cast_fp8_linears(gm, FP8_TENSOR)

    assert result.count == 3 and result.notes["scaling"] == "tensor"
    assert gm.fc2.weight_fp8_scale.shape == () and gm.fc2.weight_fp8_scale.dtype == torch.float32


def test_ineligible_linear_skipped_with_reason():
    _, gm = _build(OddK, 3, 61)

    result = cast_fp8_linears(gm, FP8)

    assert result.count == 1 and result.changed == ["linear_1"]
    assert result.skipped == [Skip("linear", "K=61 not a multiple of 16 (FP8 GEMMs need 16)")]
    assert zoo.call_targets(gm).count(_LINEAR) == 1 and zoo.call_targets(gm).count(_SCALED_MM) == 1
    (mm,) = [n for n in gm.graph.nodes if n.target == _SCALED_MM]
    assert mm.kwargs["bias"] is None


def test_3d_input_views_back_with_the_runtime_batch_even_if_metadata_says_static():
    model, gm = _build(FP8MLP, 3, 5, 64)
    first = next(n for n in gm.graph.nodes if n.target == _LINEAR)
    x = first.args[0]
    fake = x.meta["val"]
    # stale metadata as seen on the H200 (torch 2.11, GPT-2's LM head): a concrete batch in meta["val"]
    x.meta["val"] = fake.fake_mode.from_tensor(torch.empty(3, 5, 64, dtype=fake.dtype), static_shapes=True)

    result = cast_fp8_linears(gm, FP8)

    assert result.count == 3
    views = [n for n in gm.graph.nodes if n.target == torch.ops.aten.view.default and n.meta.get(FP8_FLAG)]
    assert len(views) == 3 and all(v.args[1][0] == -1 and v.args[1][1] == 5 for v in views)
    if scaled_mm_works("cpu", "row"):
        x7 = torch.randn(7, 5, 64)  # a batch the metadata never saw
        with torch.no_grad():
            assert gm(x7).shape == (7, 5, 32) and zoo.rel_l2(gm(x7), model(x7)) < 5e-2


def test_keep_list_leaves_matching_linears_in_bf16_with_reason():
    model, gm = _build(FP8MLP, 3, 64)
    spec = PassSpec(precision="fp8", fp8_keep=("fc2", "*.nothing"))

    result = cast_fp8_linears(gm, spec)

    assert result.count == 2 and result.changed == ["linear", "linear_2"]
    assert result.skipped == [Skip("linear_1", "FP8 keep-list: module fc2 matches 'fc2' (stays bf16)")]
    assert zoo.call_targets(gm).count(_SCALED_MM) == 2 and zoo.call_targets(gm).count(_LINEAR) == 1
    (kept,) = [n for n in gm.graph.nodes if n.target == _LINEAR]
    assert kept.meta["val"].dtype == torch.bfloat16  # kept in bf16, not FP32
    assert "fp8_weights" in result.notes and "fc2.weight" not in result.notes["fp8_weights"]
    if scaled_mm_works("cpu", "row"):
        x = torch.randn(5, 64)
        with torch.no_grad():
            assert zoo.rel_l2(gm(x), model(x)) < 5e-2


def test_keep_list_patterns_are_checked():
    with pytest.raises(ValueError, match="fp8_keep"):
        PassSpec(precision="fp8", fp8_keep="fc2")  # a bare string would match character by character
    with pytest.raises(ValueError, match="fp8_keep"):
        PassSpec(precision="fp8", fp8_keep=("",))
    assert PassSpec(precision="fp8", fp8_keep=["a.*"]).fp8_keep == ("a.*",)


def test_zoo_mlp_all_odd_reports_both_dims():
    _, gm, _ = zoo.build("mlp")  # 37 -> 61 -> 13

    result = cast_fp8_linears(gm, FP8)

    assert result.count == 0
    assert [s.reason for s in result.skipped] == [
        "K=37, N=61 not multiples of 16 (FP8 GEMMs need 16)",
        "K=61, N=13 not multiples of 16 (FP8 GEMMs need 16)",
    ]


def test_tied_weight_quantized_once():
    _, gm = _build(Tied, 4, 32)

    result = cast_fp8_linears(gm, FP8)

    assert result.count == 2
    assert result.notes["fp8_weights"] == {"fc.weight": ["fc.weight_fp8", "fc.weight_fp8_scale"]}
    assert not hasattr(gm.fc, "weight_fp8_1")


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_skips_other_precisions_with_one_reason(precision):
    _, gm = _build(FP8MLP, 3, 64)
    code = gm.code

    result = cast_fp8_linears(gm, PassSpec(precision=precision))

    assert result.count == 0 and not result.modified
    assert result.skipped == [Skip("<graph>", f"precision {precision}: FP8 linears only at precision fp8")]
    assert gm.code == code


def test_training_skips_every_linear():
    _, gm = _build(FP8MLP, 3, 64)

    result = cast_fp8_linears(gm, PassSpec(precision="fp8", training=True))

    assert result.count == 0 and _SCALED_MM not in zoo.call_targets(gm)
    assert {s.reason for s in result.skipped} == {"training: FP8 linears are inference-only here"}


def test_idempotent():
    _, gm = _build(FP8MLP, 3, 64)
    cast_fp8_linears(gm, FP8)
    code = gm.code

    again = cast_fp8_linears(gm, FP8)

    assert again.count == 0 and gm.code == code
    assert again.notes["cast_precision"].startswith("not run")


def test_eager_model_untouched():
    model, gm = _build(FP8MLP, 3, 64)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    cast_fp8_linears(gm, FP8)

    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, before[k]), k


# ---------------------------------------------------------------------------------------------- parity (CPU)


@pytest.mark.parametrize(
    "scaling", [pytest.param("row", marks=zoo.SCALED_MM_ROW), pytest.param("tensor", marks=zoo.SCALED_MM_TENSOR)]
)
def test_parity_with_fp32_eager_on_cpu(scaling):
    model, gm = _build(FP8MLP, 3, 8, 64)  # 3-D input, dynamic batch
    cast_fp8_linears(gm, PassSpec(precision="fp8", fp8_scaling=scaling))

    for seed in (10, 11):
        torch.manual_seed(seed)
        x = torch.randn(5, 8, 64)  # a batch size not seen at capture
        with torch.no_grad():
            ref, got = model(x), gm(x)
        assert got.shape == ref.shape and got.dtype == ref.dtype  # outputs cast back to FP32
        assert torch.isfinite(got).all()
        assert _sqnr_db(got, ref) >= SQNR_DB, f"{scaling}: SQNR {_sqnr_db(got, ref):.1f} dB"


@zoo.SCALED_MM_ROW
def test_graph_matches_reference_math_on_cpu():
    """One linear: the graph's _scaled_mm path equals the plain-torch reference up to bf16 rounding."""
    torch.manual_seed(3)
    model = nn.Linear(64, 48).eval()
    gm = zoo.capture(model, (torch.randn(4, 64),))
    cast_fp8_linears(gm, FP8)
    x = torch.randn(6, 64)
    x[2] = 0.0  # an all-zero token: scale eps/448, output = bias

    with torch.no_grad():
        got = gm(x)
    ref = fp8_linear_reference(x, model.weight, model.bias).float()

    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got[2], model.bias.detach().to(torch.bfloat16).float())


@zoo.SCALED_MM_ROW
def test_saturation_in_graph_on_cpu():
    """An activation outlier far outside the FP8 range saturates: finite output."""
    model, gm = _build(FP8MLP, 3, 64)
    cast_fp8_linears(gm, FP8)
    x = torch.randn(4, 64)
    x[0, 5] = 1e30

    with torch.no_grad():
        out = gm(x)

    assert torch.isfinite(out).all()


@zoo.SCALED_MM_ROW
def test_pipeline_at_fp8_pads_then_runs_fp8():
    """The whole pipeline at fp8: pad_linear_dims aligns N=61 to 16, so that linear is FP8 too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 61), nn.GELU(), nn.Linear(61, 32)).eval()
    gm = zoo.capture(model, (torch.randn(3, 64),))

    results = {r.name: r for r in run_pipeline(gm, FP8)}

    assert results["cast_fp8_linears"].count == 2 and _LINEAR not in zoo.call_targets(gm)
    assert results["cast_precision"].count == 0
    x = torch.randn(7, 64)
    with torch.no_grad():
        assert _sqnr_db(gm(x), model(x)) >= SQNR_DB


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (FP8 Tensor Cores: sm_89+)")
@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9), reason="FP8 needs sm_89+"
)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_parity_on_cuda(scaling):
    model, gm = _build(FP8MLP, 3, 8, 64, device="cuda")

    result = cast_fp8_linears(gm, PassSpec(precision="fp8", fp8_scaling=scaling))

    assert result.count == 3
    torch.manual_seed(5)
    x = torch.randn(5, 8, 64, device="cuda")
    with torch.no_grad():
        ref, got = model(x), gm(x)
    assert got.dtype == ref.dtype and torch.isfinite(got).all()
    assert _sqnr_db(got, ref) >= SQNR_DB
    with torch.no_grad():
        single = fp8_linear_reference(x, model.fc1.weight, model.fc1.bias, scaling)
    assert _sqnr_db(single, F.linear(x, model.fc1.weight, model.fc1.bias)) >= SQNR_DB
