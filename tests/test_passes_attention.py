"""Tests for passes.simplify_attention_mask and passes.fuse_attention: SDPA without trivial masks, and
hand-written attention fused into SDPA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zoo
from passes import PassSpec, fuse_attention, run_pipeline, simplify_attention_mask

SDPA = torch.ops.aten.scaled_dot_product_attention.default
SPEC = PassSpec()


def _sdpa(gm):
    return [n for n in gm.graph.nodes if n.target == SDPA]


def _mask(node):
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def _has_softmax(gm):
    return any(n.op == "call_function" and "softmax" in str(n.target) for n in gm.graph.nodes)


# ------------------------------------------------------------------------------------ simplify_attention_mask


def test_simplify_attention_mask_drops_bert_all_true_mask():
    model, gm, entry = zoo.build("bert_sdpa", batch=3)
    keys = list(gm.state_dict())
    assert all(_mask(n) is not None for n in _sdpa(gm))  # transformers materialized the mask under export

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == 2 and not result.skipped
    assert len(_sdpa(gm)) == 2 and all(_mask(n) is None for n in _sdpa(gm))
    assert not any(n.target == torch.ops.aten.ge.Scalar for n in gm.graph.nodes)  # mask producers are gone
    assert list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(7), "fp32")


def test_simplify_attention_mask_skips_mask_from_graph_input():
    model, gm, entry = zoo.build("bert_padded", batch=3)

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == 0
    assert len(result.skipped) == 2
    assert all(s.reason.startswith("mask depends on graph input attention_mask") for s in result.skipped)
    assert all(_mask(n) is not None for n in _sdpa(gm))
    zoo.assert_matches_eager(model, gm, entry.example_inputs(6), "fp32")


class _ConstMaskAttention(nn.Module):
    """SDPA with a mask built from constants and broadcast to the batch: ``kind`` "causal" (a real mask),
    "all_true" (trivial), "from_batch" (all True, but built from ``arange(batch)``), "shifted" (a triangle
    that also hides the diagonal below row 0: not SDPA's causal mask), "causal_float" (0 / finfo.min),
    "causal_1e4" (0 / -1e4: not exactly causal for large scores)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.register_buffer("causal", torch.ones(8, 8, dtype=torch.bool).tril())
        shifted = torch.ones(8, 8, dtype=torch.bool).tril(-1)
        shifted[0, 0] = True
        self.register_buffer("shifted", shifted)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, heads 2, seq 8, dim 4)
        b = x.shape[0]
        if self.kind == "causal":
            mask = self.causal[None, None].expand(b, 1, 8, 8)
        elif self.kind == "shifted":
            mask = self.shifted[None, None].expand(b, 1, 8, 8)
        elif self.kind in ("causal_float", "causal_1e4"):
            fill = torch.finfo(torch.float32).min if self.kind == "causal_float" else -1e4
            mask = torch.zeros(8, 8).masked_fill(~self.causal, fill)[None, None].expand(b, 1, 8, 8)
        elif self.kind == "all_true":
            mask = (torch.arange(8) >= 0)[None, None, :, None].expand(b, 1, 8, 8)
        else:
            mask = (torch.arange(b) >= 0)[:, None, None, None].expand(b, 1, 8, 8)
        return F.scaled_dot_product_attention(x, x * 0.5, x, attn_mask=mask)


def _capture_const(kind):
    torch.manual_seed(0)
    model = _ConstMaskAttention(kind).eval()
    return model, zoo.capture(model, (torch.randn(3, 2, 8, 4),))


def test_simplify_attention_mask_drops_expanded_all_true_constant():
    model, gm = _capture_const("all_true")

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == 1 and _mask(_sdpa(gm)[0]) is None
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 2, 8, 4),), "fp32")


def test_simplify_attention_mask_idempotent():
    model, gm = _capture_const("all_true")
    simplify_attention_mask(gm, SPEC)
    code = gm.code

    again = simplify_attention_mask(gm, SPEC)

    assert again.count == 0 and not again.skipped
    assert gm.code == code
    zoo.assert_matches_eager(model, gm, (torch.randn(2, 2, 8, 4),), "fp32")


def test_simplify_attention_mask_skips_false_entries():
    model, gm = _capture_const("shifted")

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == 0
    assert [s.reason for s in result.skipped] == ["mask has False entries (a real mask)"]
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 2, 8, 4),), "fp32")


def _is_causal(node):
    return (node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)) is True


@pytest.mark.parametrize("kind", ["causal", "causal_float"])
def test_simplify_attention_mask_makes_causal_triangle_is_causal(kind):
    model, gm = _capture_const(kind)

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == 1 and result.notes["causal"] == [_sdpa(gm)[0].name]
    assert _mask(_sdpa(gm)[0]) is None and _is_causal(_sdpa(gm)[0])
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 2, 8, 4),), "fp32")
    again = simplify_attention_mask(gm, SPEC)
    assert again.count == 0 and not again.skipped


def test_simplify_attention_mask_keeps_minus_1e4_causal_float_mask():
    # -1e4 is not -inf: a score above 1e4 would still see the masked key, so the mask is not provably causal.
    _, gm = _capture_const("causal_1e4")

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == 0 and _mask(_sdpa(gm)[0]) is not None and not _is_causal(_sdpa(gm)[0])


def test_simplify_attention_mask_makes_gpt2_causal_mask_is_causal():
    pytest.importorskip("transformers")
    model, gm, entry = zoo.build("gpt2", batch=3)
    assert all(_mask(n) is not None for n in _sdpa(gm))  # transformers materialized the causal mask

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == len(_sdpa(gm)) == 2 and not result.skipped
    assert all(_mask(n) is None and _is_causal(n) for n in _sdpa(gm))
    for batch in (1, 4):  # fresh inputs at other batch sizes: the proof holds for every batch
        zoo.assert_matches_eager(model, gm, entry.example_inputs(batch), "fp32")


def test_simplify_attention_mask_causal_with_static_batch():
    # torch.compile(dynamic=False) hands the backend a static batch: the mask is evaluated whole, (3, 1, L, S).
    pytest.importorskip("transformers")
    model = zoo.ZOO["gpt2"].build()
    x = zoo.ZOO["gpt2"].example_inputs(3)
    gm = torch.export.export(model, x, strict=False).module()

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == 2 and all(_is_causal(n) for n in _sdpa(gm))
    zoo.assert_matches_eager(model, gm, zoo.ZOO["gpt2"].example_inputs(3), "fp32")


class _StaticBatchCausal(nn.Module):
    """Causal attention whose mask is built the way ``transformers`` builds it, per batch row from position
    ids: ``positions[b, None, j] <= positions[b, i, None]``, ``(batch, 1, L, S)`` bool."""

    def forward(self, q, k, v):
        batch, seq = q.shape[0], q.shape[-2]
        pos = torch.arange(seq).unsqueeze(0).expand(batch, -1)
        rows = torch.arange(batch)[:, None, None, None]
        idx = torch.arange(seq)
        mask = pos[rows, idx[None, None, None, :]] <= pos[rows, idx[None, None, :, None]]  # keys <= queries
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(batch, -1, seq, seq))


def test_simplify_attention_mask_causal_at_a_static_batch_too_large_to_evaluate():
    """torch.compile hands the backend a static batch, so the mask's sub-graph reads no input and was
    evaluated whole: at batch 65 x 512 x 512 (over the pass's 2**24-element limit; GPT-2 at batch 128 x 512
    through the backend) the causal mask stayed. Broadcast operands are now kept un-broadcast."""
    batch, seq = 65, 512
    assert batch * seq * seq > 1 << 24
    model = _StaticBatchCausal().eval()
    q, k, v = (torch.randn(batch, 1, seq, 8) for _ in range(3))
    gm = torch.export.export(model, (q, k, v), strict=False).module()
    assert _mask(_sdpa(gm)[0]) is not None

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == 1 and not result.skipped, result.skipped
    assert _mask(_sdpa(gm)[0]) is None and _is_causal(_sdpa(gm)[0])
    zoo.assert_matches_eager(model, gm, tuple(torch.randn(batch, 1, seq, 8) for _ in range(3)), "fp32")


def test_simplify_attention_mask_keeps_a_real_mask_at_a_static_batch_too_large_to_evaluate():
    """The same large static-batch path must still refuse a mask that is not causal (the row below its
    diagonal masked too)."""

    class Banded(_StaticBatchCausal):
        def forward(self, q, k, v):
            batch, seq = q.shape[0], q.shape[-2]
            pos = torch.arange(seq).unsqueeze(0).expand(batch, -1)
            keys, queries = pos[:, None, None, :], pos[:, None, :, None]
            mask = (keys <= queries) & (keys >= queries - 4)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(batch, -1, seq, seq))

    batch, seq = 65, 512
    q, k, v = (torch.randn(batch, 1, seq, 8) for _ in range(3))
    gm = torch.export.export(Banded().eval(), (q, k, v), strict=False).module()

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == 0 and _mask(_sdpa(gm)[0]) is not None and not _is_causal(_sdpa(gm)[0])
    assert result.skipped and "False entries" in result.skipped[0].reason


@pytest.mark.parametrize("batch", [4, 65])
def test_simplify_attention_mask_keeps_a_causal_mask_edited_in_place(batch):
    """A causal triangle cloned and then written in place (``m[1] = True``: batch row 1 sees every key) is not
    causal; the proof reads the producers, so a write through a view of the clone must make it refuse. It
    dropped the mask before (wrong attention for that row)."""

    class Edited(nn.Module):
        def forward(self, q, k, v):
            b, seq = q.shape[0], q.shape[-2]
            m = torch.ones(seq, seq, dtype=torch.bool).tril().expand(b, 1, seq, seq).clone()
            m[1] = True
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    seq = 512 if batch > 8 else 16
    q, k, v = (torch.randn(batch, 1, seq, 8) for _ in range(3))
    model = Edited().eval()
    gm = torch.export.export(model, (q, k, v), strict=False).module()

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == 0 and _mask(_sdpa(gm)[0]) is not None and not _is_causal(_sdpa(gm)[0])
    assert "written in place" in result.skipped[0].reason
    zoo.assert_matches_eager(model, gm, tuple(torch.randn(batch, 1, seq, 8) for _ in range(3)), "fp32")


def test_simplify_attention_mask_skips_mask_built_from_batch_size():
    # All True in fact, but arange(batch) reads the batch size: not provable by the pass, so kept.
    _, gm = _capture_const("from_batch")

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == 0
    assert result.skipped[0].reason.startswith("mask depends on graph input x")


def test_simplify_attention_mask_skips_nonzero_float_mask():
    _, gm, _ = zoo.build("attn_causal")
    fuse_attention(gm, SPEC)

    result = simplify_attention_mask(gm, SPEC)

    assert result.count == 0
    assert [s.reason for s in result.skipped] == ["float mask has non-zero entries (a real mask or bias)"]


# ------------------------------------------------------------------------------------------- fuse_attention


@pytest.mark.parametrize(
    "name, scale, masked",
    [
        ("attn", 8 ** -0.5, False),
        ("attn_scaled", 0.37, False),
        ("attn_causal", 8 ** -0.5, True),
        ("attn_3d", 0.2, False),
    ],
    ids=["plain", "scale-0.37", "float-mask", "3d"],
)
def test_fuse_attention_fuses_hand_written_attention(name, scale, masked):
    model, gm, entry = zoo.build(name, batch=3)
    keys = list(gm.state_dict())

    result = fuse_attention(gm, SPEC)

    assert result.count == 1 and not result.skipped
    (sdpa,) = _sdpa(gm)
    assert not _has_softmax(gm)
    assert sdpa.kwargs["scale"] == pytest.approx(scale, rel=1e-12)
    assert (_mask(sdpa) is not None) == masked
    assert list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(6), "fp32")


def test_fuse_attention_then_simplify_drops_eager_bert_mask():
    model, gm, entry = zoo.build("bert", batch=3)  # attn_implementation="eager": matmul/softmax/matmul

    fused = fuse_attention(gm, SPEC)
    simplified = simplify_attention_mask(gm, SPEC)

    assert fused.count == 2 and simplified.count == 2
    assert not _has_softmax(gm)
    assert all(_mask(n) is None for n in _sdpa(gm))
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp32")


def test_fuse_attention_idempotent():
    model, gm, entry = zoo.build("attn_causal")
    fuse_attention(gm, SPEC)
    code = gm.code

    again = fuse_attention(gm, SPEC)

    assert again.count == 0 and gm.code == code
    zoo.assert_matches_eager(model, gm, entry.example_inputs(4), "fp32")


def test_fuse_attention_skips_intermediate_with_two_users():
    model, gm, entry = zoo.build("attn_leak")

    result = fuse_attention(gm, SPEC)

    assert result.count == 0 and _has_softmax(gm) and not _sdpa(gm)
    assert [s.reason for s in result.skipped] == ["scaled scores div has 2 users"]
    zoo.assert_matches_eager(model, gm, entry.example_inputs(4), "fp32")


class _BoolMaskAdd(nn.Module):
    """Adds a bool tensor to the scores (0/1 bias): SDPA would read it as a keep-mask, so no fusion."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keep = (q[..., :1] > 0).expand(-1, -1, -1, k.shape[-2])
        return torch.softmax(q @ k.transpose(-2, -1) + keep, dim=-1) @ v


def test_fuse_attention_skips_bool_mask_add():
    inputs = tuple(torch.randn(3, 2, 5, 4) for _ in range(3))
    gm = zoo.capture(_BoolMaskAdd(), inputs)

    result = fuse_attention(gm, SPEC)

    assert result.count == 0
    assert "mask dtype torch.bool differs" in result.skipped[0].reason


# ----------------------------------------------------------------------------------------------- pipeline


@pytest.mark.parametrize(
    "name, precision",
    [("bert_sdpa", "bf16"), ("bert_sdpa", "fp16"), ("bert", "bf16")],
    ids=["sdpa-bf16", "sdpa-fp16", "eager-attention-bf16"],
)
def test_run_pipeline_small_bert_low_precision(name, precision):
    model, gm, entry = zoo.build(name, batch=3)
    keys = list(gm.state_dict())
    spec = PassSpec(precision=precision, alignment=zoo.ALIGNMENT, arch="Hopper")

    results = {r.name: r for r in run_pipeline(gm, spec)}

    assert results["simplify_attention_mask"].count == 2 and results["fuse_qkv"].count == 2
    assert all(_mask(n) is None for n in _sdpa(gm)) and len(_sdpa(gm)) == 2
    assert list(gm.state_dict()) == keys
    with torch.no_grad():
        inputs = entry.example_inputs(5)
        ref, got = zoo.flat_outputs(model(*inputs))[0], zoo.flat_outputs(gm(*inputs))[0]
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = zoo.rel_l2(got, ref)
    assert err <= 3e-2, f"{precision}: relative L2 error {err:.2e}"
