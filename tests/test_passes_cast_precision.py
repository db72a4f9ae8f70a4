"""Tests for passes.cast_precision: low-precision compute with an FP32 keep-list, typed in the graph."""
from __future__ import annotations

import pytest
import torch

import zoo
from passes import PassSpec, cast_precision

_CAST = torch.ops.aten._to_copy.default
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _val_dtype(node):
    return node.meta["val"].dtype


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["mlp", "simple_cnn", "conv_bn", "encoder_block", "bert"])
def test_cast_precision_parity(name, precision):
    model, gm, entry = zoo.build(name)
    keys = list(gm.state_dict())

    result = cast_precision(gm, PassSpec(precision=precision))

    assert result.count > 0
    assert list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), precision)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cast_precision_types_the_graph(precision):
    _, gm, _ = zoo.build("encoder_block")
    low = LOW[precision]

    result = cast_precision(gm, PassSpec(precision=precision))

    for node in gm.graph.nodes:
        if node.target in (torch.ops.aten.linear.default, torch.ops.aten.matmul.default):
            assert all(_val_dtype(a) == low for a in node.all_input_nodes), node.name
            assert node.name in result.changed
        if node.target in (torch.ops.aten.softmax.int, torch.ops.aten.layer_norm.default):
            assert all(_val_dtype(a) == torch.float32 for a in node.all_input_nodes), node.name
    assert gm.qkv.weight.dtype == low and gm.ff2.bias.dtype == low
    assert gm.ln1.weight.dtype == torch.float32
    reasons = {s.node: s.reason for s in result.skipped}
    assert reasons["softmax"] == "keep-list: softmax stays FP32"
    assert reasons["layer_norm"] == "keep-list: layer_norm stays FP32"


def test_cast_precision_casts_are_minimal():
    _, gm, _ = zoo.build("encoder_block")

    cast_precision(gm, PassSpec(precision="fp16"))

    casts = [n for n in gm.graph.nodes if n.target == _CAST]
    assert casts
    pairs = [(n.args[0], n.kwargs["dtype"]) for n in casts]
    assert len(pairs) == len(set(pairs)), "one cast per (node, dtype)"
    assert not any(n.args[0].target == _CAST for n in casts), "no cast of a cast"
    # x feeds layer_norm and the residual add before ln2, both FP32 (autocast's promotion): no cast of x.
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert [u for u in x.users if u.target == _CAST] == []


def test_cast_precision_output_dtypes_unchanged():
    model, gm, entry = zoo.build("bert")
    inputs = entry.example_inputs(2)

    cast_precision(gm, PassSpec(precision="bf16"))

    with torch.no_grad():
        ref, got = zoo.flat_outputs(model(*inputs)), zoo.flat_outputs(gm(*inputs))
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in ref]


def test_cast_precision_never_casts_integers():
    _, gm, _ = zoo.build("bert")

    cast_precision(gm, PassSpec(precision="fp16"))

    for node in gm.graph.nodes:
        if node.target == _CAST:
            assert node.args[0].meta["val"].dtype.is_floating_point, node.name
    assert gm.embeddings.position_ids.dtype == torch.int64


def test_cast_precision_idempotent():
    model, gm, entry = zoo.build("encoder_block")
    cast_precision(gm, PassSpec(precision="fp16"))
    code = gm.code

    again = cast_precision(gm, PassSpec(precision="fp16"))

    assert again.count == 0 and again.notes["casts_inserted"] == 0
    assert gm.code == code
    zoo.assert_matches_eager(model, gm, entry.example_inputs(3), "fp16")


def test_cast_precision_skips_fp32():
    _, gm, _ = zoo.build("mlp")
    code = gm.code

    result = cast_precision(gm, PassSpec(precision="tf32"))

    assert result.count == 0 and gm.code == code
    assert [s.to_dict() for s in result.skipped] == [
        {"node": "<graph>", "reason": "precision tf32: nothing to cast, compute stays FP32"}
    ]


def test_cast_precision_tied_weight_stored_once():
    model, gm, entry = zoo.build("tied_lm")

    cast_precision(gm, PassSpec(precision="bf16"))

    assert gm.head.weight.dtype == torch.bfloat16
    zoo.assert_matches_eager(model, gm, entry.example_inputs(2), "bf16")


# ------------------------------------------------------------------------------------- residual stream


def test_cast_precision_bert_bf16_as_accurate_as_autocast():
    model, gm, entry = zoo.build("bert")
    torch.manual_seed(7)
    inputs = entry.example_inputs(4)
    with torch.no_grad():
        ref = zoo.flat_outputs(model(*inputs))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = zoo.flat_outputs(model(*inputs))

    cast_precision(gm, PassSpec(precision="bf16"))

    with torch.no_grad():
        got = zoo.flat_outputs(gm(*inputs))
    for g, a, r in zip(got, auto, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert zoo.rel_l2(g, r) <= 1.5 * zoo.rel_l2(a.float(), r), (zoo.rel_l2(g, r), zoo.rel_l2(a.float(), r))


def test_cast_precision_residual_adds_before_layer_norm_fp32():
    _, gm, _ = zoo.build("bert")

    result = cast_precision(gm, PassSpec(precision="bf16"))

    norms = [n for n in gm.graph.nodes if n.target == torch.ops.aten.layer_norm.default]
    adds = [n.args[0] for n in norms]
    assert len(adds) == 5
    for add in adds:
        assert add.target == torch.ops.aten.add.Tensor, add.name  # no cast between the add and the norm
        assert _val_dtype(add) == torch.float32
        assert all(_val_dtype(a) == torch.float32 for a in add.all_input_nodes), add.name
    reasons = {s.node: s.reason for s in result.skipped}
    assert reasons[adds[1].name] == "residual: add stays FP32 (feeds layer_norm)"
    # The linears feeding them still compute low, with low weights.
    assert gm.get_parameter("encoder.layer.0.output.dense.weight").dtype == torch.bfloat16
    linears = [n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    assert all(_val_dtype(n) == torch.bfloat16 for n in linears)


def test_cast_precision_residual_stream_stays_fp32_between_norms():
    _, gm, _ = zoo.build("encoder_block")  # pre-norm: the second residual add feeds the output, not a norm

    result = cast_precision(gm, PassSpec(precision="fp16"))

    adds = [n for n in gm.graph.nodes if n.target == torch.ops.aten.add.Tensor]
    reasons = {s.node: s.reason for s in result.skipped}
    last = adds[-1]
    assert _val_dtype(last) == torch.float32
    assert reasons[last.name].startswith("residual: add stays FP32 (adds the FP32 output of ")


def test_cast_precision_skips_embedding_tables():
    _, gm, _ = zoo.build("bert")

    result = cast_precision(gm, PassSpec(precision="bf16"))

    assert gm.embeddings.word_embeddings.weight.dtype == torch.float32
    assert "embeddings.word_embeddings.weight" in result.notes["weights_fp32"]
    assert gm.pooler.dense.weight.dtype == torch.bfloat16


def test_cast_precision_residual_idempotent():
    model, gm, entry = zoo.build("bert")
    cast_precision(gm, PassSpec(precision="bf16"))
    code = gm.code

    again = cast_precision(gm, PassSpec(precision="bf16"))

    assert again.count == 0 and again.notes["casts_inserted"] == 0
    assert gm.code == code
    zoo.assert_matches_eager(model, gm, entry.example_inputs(3), "bf16")


def test_cast_precision_pure_policy_casts_residuals_and_embeddings_too():
    """residual_fp32=False (the "pure" policy, like model.half()): no residual/embedding FP32 rule."""
    from passes.base import PassSpec as Spec

    model, gm_autocast, entry = zoo.build("bert")
    _, gm_pure, _ = zoo.build("bert")
    auto = cast_precision(gm_autocast, Spec(precision="bf16"))
    pure = cast_precision(gm_pure, Spec(precision="bf16", keep_list=frozenset(), residual_fp32=False))

    assert pure.count > auto.count
    assert not any(s.reason.startswith("residual") for s in pure.skipped)
    assert gm_pure.get_parameter("embeddings.word_embeddings.weight").dtype == torch.bfloat16
    assert gm_autocast.get_parameter("embeddings.word_embeddings.weight").dtype == torch.float32
    zoo.assert_matches_eager(model, gm_pure, entry.example_inputs(5), "bf16")


class _WritesCache(torch.nn.Module):
    """A linear whose output is written into the caller's cache by slice assignment, then read back."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, cache):
        cache[:, :2] = self.fc(x)
        cache.mul_(0.5)
        return cache.sum(-1)[:, 2:] + self.fc(cache[:, 2:]).mean(-1)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cast_precision_keeps_written_tensors_and_their_views(precision):
    """A written tensor (and the slice the write goes through) is never replaced by a cast copy: the write must
    land in the caller's tensor. The linears still run low."""
    from passes._graph import view_base, writes_in_place, written_nodes

    model = _WritesCache().eval()
    g = torch.Generator().manual_seed(3)
    x, cache = torch.randn(3, 2, 8, generator=g), torch.randn(3, 4, 8, generator=g)
    gm = torch.export.export(model, (x, cache.clone()), strict=False).module()
    written = written_nodes(gm)
    assert {n.op for n in written} >= {"placeholder"}
    result = cast_precision(gm, PassSpec(precision=precision))
    assert result.count > 0
    assert any(s.reason.startswith("written in place: ") for s in result.skipped), result.skipped
    writes = [(n, a) for n in gm.graph.nodes for a in writes_in_place(n)]
    assert writes
    for node, arg in writes:  # each write goes through views to the caller's tensor, never through a cast
        while arg.op != "placeholder":
            assert arg.target is not _CAST, f"{node.name} writes a cast copy"
            arg = view_base(arg)
    mine, ref = cache.clone(), cache.clone()
    with torch.no_grad():
        got, want = gm(x, mine), model(x, ref)
    torch.testing.assert_close(mine, ref, rtol=2e-2, atol=2e-2)
    assert not torch.equal(mine, cache)  # the write reached the caller's tensor
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


class _FillsOwnBuffer(torch.nn.Module):
    """A recurrence writing each step into a tensor the graph made, through a view, then reading that tensor
    (Hugging Face's RWKV on the CPU: ``output = zeros_like(key); output[:, t] = ...``); an in-place ReLU on a
    linear's output beside it (a straight write into the graph's own tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.key = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):
        k = self.key(x)
        state = torch.zeros_like(k[:, 0], dtype=torch.float32)
        output = torch.zeros_like(k)
        for t in range(k.shape[1]):
            state = 0.5 * state + k[:, t].float()
            output[:, t] = state.to(output.dtype)
        return self.out(torch.relu_(self.out(output)))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cast_precision_keeps_writes_through_views_into_the_graphs_own_tensors(precision):
    """Before: the pass cast ``output`` to the low dtype at each ``output[:, t] = ...``, the write landed in that
    copy, and the final read saw the zeros (relative error 1.0). Now the write lands in ``output`` and the
    linears still run low; the in-place ReLU on a linear's output is cast like ``relu`` (not kept FP32)."""
    from passes._graph import written_nodes

    torch.manual_seed(0)
    model = _FillsOwnBuffer().eval()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 5, 8, generator=g)
    gm = torch.export.export(model, (x,), strict=False).module()
    written = written_nodes(gm)
    assert any(n.name.startswith("zeros_like") for n in written), written
    assert not any("relu" in n.name for n in written)  # a straight write into the graph's own tensor
    result = cast_precision(gm, PassSpec(precision=precision))
    assert result.count > 0
    lows = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert lows and all(n.meta["val"].dtype != torch.float32 for n in lows)
    x2 = torch.randn(3, 5, 8, generator=g)  # fresh inputs
    with torch.no_grad():
        got, want = gm(x2), model(x2)
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 3e-2, err


class _RandomMasking(torch.nn.Module):
    """ViTMAE's random masking, tiny: patches projected by a linear, ranked by an FP32 ``noise`` input with
    ``argsort``, the first half kept; returns the kept features and the restoring indices."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, x, noise):
        h = self.proj(x)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        keep = ids_shuffle[:, : x.shape[1] // 2]
        kept = torch.gather(h, 1, keep.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        top = torch.topk(noise, 4, dim=1).indices
        return kept, ids_restore, top


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cast_precision_ranks_fp32_inputs_as_they_are(precision):
    """Before: ``argsort`` / ``topk`` ranked a low copy of the FP32 noise, near-ties merged, and the indices
    differed from eager's. Now they match exactly and the linear still runs low."""
    torch.manual_seed(0)
    model = _RandomMasking().eval()
    g = torch.Generator().manual_seed(5)
    x, noise = torch.randn(2, 512, 8, generator=g), torch.rand(2, 512, generator=g)
    gm = torch.export.export(model, (x, noise), strict=False).module()
    result = cast_precision(gm, PassSpec(precision=precision))
    assert result.count > 0
    assert any(s.reason == "order op: argsort ranks FP32 values as they are" for s in result.skipped), result.skipped
    lows = [n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
    assert lows and all(n.meta["val"].dtype != torch.float32 for n in lows)
    x2, noise2 = torch.randn(2, 512, 8, generator=g), torch.rand(2, 512, generator=g)  # fresh inputs
    low = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[precision])
    assert not torch.equal(torch.argsort(noise2.to(low), dim=1), torch.argsort(noise2, dim=1))  # ties at low
    with torch.no_grad():
        (kept, restore, top), (kept_ref, restore_ref, top_ref) = gm(x2, noise2), model(x2, noise2)
    assert torch.equal(restore, restore_ref) and torch.equal(top, top_ref)
    torch.testing.assert_close(kept.float(), kept_ref, rtol=3e-2, atol=3e-2)
