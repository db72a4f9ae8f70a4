"""cast_precision keeps the model's own numerics: out-of-range constants saturate (no overflow error, no NaN),
explicit FP32 up-casts stay FP32 as under ``model.to(dt)``, and -inf / NaN calibration statistics are handled.

Accuracy bound for the transformers models: the relative L2 error against FP32 is within 2x that of
``model.to(dt)`` eager plus 1e-3 (the accuracy-consistency rule of the model-zoo benchmark)."""
from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zoo
from passes import PassSpec, cast_precision, run_pipeline
from passes.calibrate import NONFINITE_META, calibrate_ranges, overflow_nodes

LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: The two cast policies as PassSpecs: "pure" keeps only losses in FP32 (tctune.hardware.PURE_KEEP_LIST).
PURE_KEEP = frozenset({"cross_entropy_loss", "nll_loss", "mse_loss", "cumsum", "prod", "logsumexp"})


def _spec(precision: str, policy: str, **kw) -> PassSpec:
    extra = {"keep_list": PURE_KEEP, "residual_fp32": False} if policy == "pure" else {}
    return PassSpec(precision=precision, **extra, **kw)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def _first(out):
    return zoo.flat_outputs(out)[0]


# ------------------------------------------------------------------------------------- out-of-range constants


class MaskedAttention(nn.Module):
    """One attention head with three masks written in FP32 terms: ``masked_fill(pad, -1e9)``, an additive
    ``(1 - m) * finfo(float32).min`` key mask, and a causal ``torch.full(.., finfo(float32).min).triu(1)``."""

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.d = d

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        seq = x.shape[1]
        scores = scores.masked_fill(m[:, None, :] == 0, -1e9)
        scores = scores + (1.0 - m[:, None, :].float()) * torch.finfo(torch.float32).min
        causal = torch.full((seq, seq), torch.finfo(torch.float32).min, dtype=torch.float32).triu(1)
        scores = scores + causal
        return self.out(F.softmax(scores, dim=-1) @ v)


def _mask_inputs(batch: int, seq: int = 7, d: int = 24):
    x = torch.randn(batch, seq, d)
    m = torch.ones(batch, seq, dtype=torch.long)
    m[:, -2:] = 0  # padded keys; the first key is always visible, so no row is masked entirely
    return x, m


def test_fp16_eager_overflows_on_the_fill_value():
    """The problem the saturation fixes: PyTorch refuses -1e9 as an fp16 fill value."""
    torch.manual_seed(0)
    model = MaskedAttention().eval().half()
    x, m = _mask_inputs(2)
    with pytest.raises(RuntimeError, match="cannot be converted to type .*Half without overflow"):
        model(x.half(), m)


@pytest.mark.parametrize("policy", ["autocast", "pure"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_out_of_range_constants_saturate(precision, policy):
    torch.manual_seed(0)
    model = MaskedAttention().eval()
    gm = zoo.capture(model, _mask_inputs(3))

    result = cast_precision(gm, _spec(precision, policy))

    limit = torch.finfo(LOW[precision]).max
    notes = result.notes["constants_saturated"]
    assert notes, "an out-of-range mask constant must be saturated"
    if precision == "fp16":
        assert any("-1e+09 -> -6.55e+04" in n for n in notes), notes  # masked_fill's value
    assert any("clamped to +-" in n for n in notes), notes  # the FP32 full(...) mask, cast down
    for node in gm.graph.nodes:  # no low op is left with a scalar it cannot hold
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor) \
                and node.meta["val"].dtype == LOW[precision]:
            scalars = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, float)]
            assert all(not math.isfinite(a) or abs(a) <= limit for a in scalars), node.format_node()
    torch.manual_seed(5)
    x, m = _mask_inputs(4)
    with torch.no_grad():
        got, ref = gm(x, m), model(x, m)
    assert torch.isfinite(got).all()
    assert got.dtype == ref.dtype and _rel(got, ref) <= zoo.TOLERANCES[precision]["rel_l2"]


class InplaceMaskedScores(nn.Module):
    """One attention head whose scores are masked in place with FP32's extreme, as Hugging Face's XLM writes it:
    ``scores.masked_fill_(mask, -torch.finfo(torch.float32).max)``, a value neither bf16 nor fp16 holds; then an
    in-place ``add_`` of a second FP32-extreme bias on padded keys. Inputs ``x (batch, seq, 24)`` float and
    ``m (batch, seq)`` int64 (0: padded key)."""

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.d = d

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(self.d)
        seq = x.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        scores.masked_fill_(causal, -torch.finfo(torch.float32).max)
        scores.add_((m[:, None, :] == 0) * torch.finfo(torch.float32).min)
        return F.softmax(scores, dim=-1) @ self.v(x)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_in_place_fill_values_saturate(precision):
    """An in-place fill with an out-of-range scalar (``masked_fill_(mask, -finfo(float32).max)``) runs: before,
    ``masked_fill_`` kept -3.4e38 on bf16 scores and every call raised "value cannot be converted to type
    c10::BFloat16 without overflow" (XLM through the backend). The in-place forms of the value ops get their
    scalar saturated like the out-of-place ones, where the tensor they write is cast at all."""
    torch.manual_seed(0)
    model = InplaceMaskedScores().eval()
    gm = zoo.capture(model, _mask_inputs(3))
    assert any(op_name in str(n.target) for n in gm.graph.nodes for op_name in ("masked_fill_",)), gm.graph

    result = cast_precision(gm, _spec(precision, "pure"))

    limit = torch.finfo(LOW[precision]).max
    notes = result.notes.get("constants_saturated", [])
    # either the fill value is saturated to the low dtype, or the scores written in place stay in their dtype
    # (cast_precision never casts a tensor the graph writes): both run, and the values below match eager
    kept = [sk.reason for sk in result.skipped if "written in place" in sk.reason]
    assert any("masked_fill_" in n and f"-> {-limit:.4g}" in n for n in notes) or kept, (notes, result.skipped)
    for seed in (5, 6):
        torch.manual_seed(seed)
        x, m = _mask_inputs(4)
        with torch.no_grad():
            got, ref = gm(x, m), model(x, m)
        assert torch.isfinite(got).all()
        assert got.dtype == ref.dtype and _rel(got, ref) <= zoo.TOLERANCES[precision]["rel_l2"]


def _gpt_neo():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPTNeoConfig(
        use_cache=False, vocab_size=97, max_position_embeddings=64, hidden_size=32, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]], window_size=8, intermediate_size=64,
        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPTNeoModel(cfg).eval()
    return model, lambda b: (torch.randint(0, 97, (b, 16)),)


def _t5_encoder():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5EncoderModel(cfg).eval()

    def inputs(b):
        mask = torch.ones(b, 12, dtype=torch.long)
        mask[0, 8:] = 0  # one padded sequence: the mask is filled with the FP32 minimum
        return torch.randint(0, 97, (b, 12)), mask

    return model, inputs


@pytest.mark.parametrize("build", [_gpt_neo, _t5_encoder], ids=["gpt_neo", "t5_encoder"])
def test_transformers_masked_models_finite_and_as_accurate_as_model_to(build):
    from tctune.capture import capture

    model, inputs = build()
    captured = capture(model, inputs(2))
    torch.manual_seed(9)
    x = inputs(3)
    with torch.no_grad():
        ref = _first(model(*x))
    for precision in ("fp16", "bf16"):
        with torch.no_grad():
            eager = _first(copy.deepcopy(model).to(LOW[precision])(*x)).float()
        bound = 2 * _rel(eager, ref) + 1e-3
        for policy in ("autocast", "pure"):
            gm = copy.deepcopy(captured)
            run_pipeline(gm, _spec(precision, policy))
            with torch.no_grad():
                got = _first(gm(*x))
            assert torch.isfinite(got).all(), (precision, policy)
            assert _rel(got, ref) <= bound, (precision, policy, _rel(got, ref), bound)


# ------------------------------------------------------------------------------------- explicit FP32 up-casts


def test_llama_pure_keeps_the_models_fp32_upcasts():
    """LlamaForCausalLM computes RMSNorm statistics and rotary angles in FP32 itself (``.float()`` /
    ``.to(torch.float32)``). With positions past 256 (not exact in bf16) and weights large enough for
    attention to depend on position, casting those ops down gave 4x ``model.to(bf16)``'s error."""
    transformers = pytest.importorskip("transformers")
    from tctune.capture import capture

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   use_cache=False, initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    gm = capture(model, (torch.randint(0, 97, (2, 300)),))

    results = run_pipeline(gm, _spec("bf16", "pure"))

    cast = next(r for r in results if r.name == "cast_precision")
    explicit = [s for s in cast.skipped if s.reason.startswith("explicit FP32: ")]
    assert {s.reason.split(":")[1].split()[0] for s in explicit} >= {"pow", "mean", "rsqrt", "cos", "sin"}
    torch.manual_seed(4)
    ids = torch.randint(0, 97, (2, 300))
    with torch.no_grad():
        ref = model(ids).logits
        eager = copy.deepcopy(model).to(torch.bfloat16)(ids).logits.float()
        got = _first(gm(ids))
    assert _rel(got, ref) <= 2 * _rel(eager, ref) + 1e-3, (_rel(got, ref), _rel(eager, ref))


def test_explicit_fp32_region_then_low_again():
    """``w * x.float().pow(2)...to(x.dtype)``: the statistics run FP32, the weight product runs low."""

    class RMSNorm(nn.Module):
        def __init__(self, d: int = 16) -> None:
            super().__init__()
            self.lin = nn.Linear(d, d)
            self.weight = nn.Parameter(torch.randn(d))

        def forward(self, x):
            h = self.lin(x)
            h32 = h.to(torch.float32)
            h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight * h32.to(h.dtype)

    torch.manual_seed(0)
    model = RMSNorm().eval()
    gm = zoo.capture(model, (torch.randn(3, 16),))

    result = cast_precision(gm, _spec("bf16", "pure"))

    dtypes = {n.target: n.meta["val"].dtype for n in gm.graph.nodes
              if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)}
    assert dtypes[torch.ops.aten.rsqrt.default] == torch.float32
    assert dtypes[torch.ops.aten.pow.Tensor_Scalar] == torch.float32
    assert dtypes[torch.ops.aten.linear.default] == torch.bfloat16
    assert any(s.reason == "explicit FP32: rsqrt reads only values the model cast to FP32" for s in result.skipped)
    x = torch.randn(5, 16)
    with torch.no_grad():
        got, ref = gm(x), model(x)
    assert _rel(got, ref) <= zoo.TOLERANCES["bf16"]["rel_l2"]


# ------------------------------------------------------------------------------------- -inf / NaN calibration


class NegInfMask(nn.Module):
    """Scores masked with ``-inf`` (returned too), and an FFN whose activations exceed fp16's range. One query
    row may be masked entirely: its softmax is NaN in FP32 too, zeroed by ``nan_to_num``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.big = nn.Linear(d, 32)
        self.small = nn.Linear(32, d)
        with torch.no_grad():
            self.big.bias.fill_(1e5)  # activations ~1e5 > 65504
            self.small.weight.mul_(1e-4)

    def forward(self, x, mask):
        q = self.q(x)
        scores = (q @ x.transpose(-1, -2)).masked_fill(mask, float("-inf"))
        attn = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        return self.small(F.gelu(self.big(attn @ x))), scores


def _neg_inf_inputs(batch: int, seq: int = 6, full_row: bool = False):
    mask = torch.zeros(batch, seq, seq, dtype=torch.bool)
    mask[:, :, -2:] = True
    if full_row:
        mask[0, 1, :] = True  # a query that sees nothing: NaN in FP32
    return torch.randn(batch, seq, 16), mask


@pytest.mark.parametrize("full_row", [False, True], ids=["inf", "inf_and_nan"])
def test_calibrated_fp16_with_neg_inf_mask(full_row):
    torch.manual_seed(0)
    model = NegInfMask().eval()
    gm = zoo.capture(model, _neg_inf_inputs(2))
    ranges = calibrate_ranges(gm, [_neg_inf_inputs(4, full_row=full_row) for _ in range(2)])
    masked = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.masked_fill.Scalar)
    assert ranges.nonfinite[masked.name] == "inf" and math.isfinite(ranges[masked.name])
    fp32 = overflow_nodes(ranges, "fp16")
    assert masked.name not in fp32  # -inf is no overflow: the op still runs fp16
    big = next(n for n in gm.graph.nodes if "big" in str(n.meta.get("nn_module_stack")) and n.op == "call_function")
    assert big.name in fp32  # the finite values beside the infinities still decide

    result = cast_precision(gm, dataclasses.replace(PassSpec(precision="fp16"), fp32_nodes=fp32))

    assert masked.name in result.changed
    ignored = result.notes["calibration_ignored"]
    assert ignored[masked.name].startswith("calibration: FP32 run gave +-inf here")
    if full_row:
        softmax = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.softmax.int)
        assert softmax.meta[NONFINITE_META] == "nan"
        assert ignored[softmax.name] == "calibration: FP32 run gave NaN here; ignored for overflow"
    torch.manual_seed(3)
    x, mask = _neg_inf_inputs(3, full_row=full_row)
    with torch.no_grad():
        (out, scores), (ref_out, ref_scores) = gm(x, mask), model(x, mask)
    assert torch.isfinite(out).all()
    assert _rel(out, ref_out) <= zoo.TOLERANCES["fp16"]["rel_l2"]
    assert torch.equal(torch.isneginf(scores), torch.isneginf(ref_scores)) and torch.isneginf(scores).any()


def test_calibrated_fp16_transformer_encoder_layer_with_padding_mask():
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True, dropout=0.0).eval()

    def inputs(b):
        pad = torch.zeros(b, 7, dtype=torch.bool)
        pad[:, -2:] = True
        return torch.randn(b, 7, 16), pad

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = model

        def forward(self, x, pad):
            return self.layer(x, src_key_padding_mask=pad)

    wrapped = Wrapped().eval()
    gm = zoo.capture(wrapped, inputs(2))
    ranges = calibrate_ranges(gm, [inputs(4)])
    assert ranges.nonfinite, "the key-padding mask is -inf in the FP32 run"
    spec = PassSpec(precision="fp16", fp32_nodes=overflow_nodes(ranges, "fp16"))

    result = cast_precision(gm, spec)  # used to fail: "not enough values to unpack" formatting inf

    assert result.count > 0 and result.notes["calibration_ignored"]
    torch.manual_seed(2)
    x = inputs(3)
    with torch.no_grad():
        got, ref = gm(*x), wrapped(*x)
    assert torch.isfinite(got).all() and _rel(got, ref) <= zoo.TOLERANCES["fp16"]["rel_l2"]


def test_saturation_idempotent():
    torch.manual_seed(0)
    model = MaskedAttention().eval()
    gm = zoo.capture(model, _mask_inputs(3))
    cast_precision(gm, _spec("fp16", "pure"))
    code = gm.code

    again = cast_precision(gm, _spec("fp16", "pure"))

    assert again.notes["casts_inserted"] == 0 and again.notes["constants_saturated"] == []
    assert gm.code == code
