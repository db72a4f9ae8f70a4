"""Tests for passes.cast_precision: low-precision compute with an FP32 keep-list, typed in the graph."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import zoo
from passes import PassSpec, cast_precision
from passes.policy import PURE_KEEP_LIST

_CAST = torch.ops.aten._to_copy.default
LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _val_dtype(node):
    return node.meta["val"].dtype


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error of ``got`` (any floating dtype) against ``want``."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


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
    # output = zeros_like(k) of a low k is made low, as model.to(dt) makes it: the writes land in it
    (buf,) = [n for n in gm.graph.nodes if n.name.startswith("zeros_like") and n.meta["val"].dim() == 3]
    assert buf.meta["val"].dtype != torch.float32
    x2 = torch.randn(3, 5, 8, generator=g)  # fresh inputs
    with torch.no_grad():
        got, want = gm(x2), model(x2)
    err = _rel(got, want)
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


class _RotaryNoAutocast(torch.nn.Module):
    """A rotary embedding computed inside ``torch.autocast(enabled=False)`` (Hugging Face Llama's, before it moved
    to a helper): the region's body is traced in FP32 and reads an FP32 ``inv_freq`` buffer."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q = torch.nn.Linear(d, d)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False)

    def forward(self, x, pos):
        with torch.autocast("cpu", enabled=False):
            f = (self.inv_freq[None, :, None].float() @ pos[:, None, :].float()).transpose(1, 2)
            emb = torch.cat([f, f], -1)
            cos, sin = emb.cos(), emb.sin()
        h = self.q(x)
        return h * cos + h.roll(1, -1) * sin


@pytest.mark.parametrize("policy", ["pure", "autocast"])
def test_backend_runs_an_autocast_disabled_region_as_written(monkeypatch, policy):
    """Before: the region's buffer was stored bf16, the body (traced FP32) failed its dtype check on the first
    run, and the subgraph fell back to plain Inductor. Now the region reads its inputs as written, no fallback,
    and the linear still runs low."""
    import tctune.backend as tb

    handed = zoo.inductor_runs_the_graph(monkeypatch)
    torch._dynamo.reset()
    tb.reset()
    torch.manual_seed(0)
    model = _RotaryNoAutocast().eval()
    g = torch.Generator().manual_seed(3)
    x, pos = torch.randn(2, 64, 16, generator=g), torch.randint(0, 4096, (2, 64), generator=g)
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16", "policy": policy})
    with torch.no_grad():
        got, ref = compiled(x, pos), model(x, pos)
    assert handed and tb.reports and not any(r.fallback for r in tb.reports), [r.fallback for r in tb.reports]
    skips = [s.reason for r in tb.reports for res in r.results for s in res.skipped]
    assert any(s.startswith("region: wrap_with_autocast runs as written") for s in skips), skips
    assert any(res.name == "cast_precision" and res.count > 0 for r in tb.reports for res in r.results)
    err = _rel(got, ref)
    assert err < 2e-2, err  # the angles stay FP32 (positions up to 4096: bf16 angles would be off by ~1 rad)


class _Float64Angles(torch.nn.Module):
    """Rotary angles the model computes in float64 itself (diffusers' ``freqs_dtype=torch.float64``), then
    ``.float()``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q = torch.nn.Linear(d, d)
        self.d = d

    def forward(self, x, pos):
        freqs = 1.0 / (10000 ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d))
        ang = pos.to(torch.float64)[..., None] * freqs
        cos, sin = ang.cos().float(), ang.sin().float()
        q = self.q(x).unflatten(-1, (-1, 2))
        return torch.stack([q[..., 0] * cos - q[..., 1] * sin, q[..., 0] * sin + q[..., 1] * cos], -1).flatten(-2)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cast_precision_keeps_float64_values_float64(precision):
    """Before: the float64 angles were cast to the low dtype (positions up to 8192: relative error 1.7 at bf16).
    Now every op computing float64 runs as written, as ``model.to(dt)`` runs it."""
    torch.manual_seed(0)
    model = _Float64Angles().eval()
    g = torch.Generator().manual_seed(4)
    x, pos = torch.randn(2, 128, 16, generator=g), torch.randint(0, 8192, (2, 128), generator=g)
    gm = torch.export.export(model, (x, pos), strict=False).module()
    result = cast_precision(gm, PassSpec(precision=precision))
    assert result.count > 0
    assert any(s.reason.startswith("float64: ") for s in result.skipped), result.skipped
    def dtype(n):
        return getattr(n.meta.get("val"), "dtype", None)

    f64 = [n for n in gm.graph.nodes if n.op == "call_function" and dtype(n) == torch.float64]
    assert f64 and all(dtype(a) not in (torch.float16, torch.bfloat16) for n in f64 for a in n.all_input_nodes)
    x2, pos2 = torch.randn(2, 128, 16, generator=g), torch.randint(0, 8192, (2, 128), generator=g)
    with torch.no_grad():
        got, ref = gm(x2, pos2), model(x2, pos2)
        low = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[precision])
        eager = copy.deepcopy(model).to(low)(x2.to(low), pos2)
    err = _rel(got, ref)
    eager_err = _rel(eager, ref)
    assert err <= 2 * eager_err + 1e-3, (err, eager_err)


class _Debias(torch.nn.Module):
    """Bias correction of a 0-dim step count (Adam / EMA debiasing): ``h / (1 - 0.99 ** step.float())``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, step):
        return self.lin(x) / (1 - 0.99 ** step.float())


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cast_precision_keeps_explicit_fp32_scalars_fp32(precision):
    """Before: an op whose inputs were all 0-dim ignored them when looking for explicit FP32 values, so
    ``1 - 0.99 ** step.float()`` read a low copy of the FP32 power (0.98828 at bf16), 17 % off. Now the
    scalar arithmetic stays FP32 and the result is as accurate as ``model.to(dt)``."""
    torch.manual_seed(0)
    model = _Debias().eval()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, 16, generator=g)
    gm = torch.export.export(model, (x, torch.tensor(1)), strict=False).module()
    result = cast_precision(gm, PassSpec(precision=precision))
    assert result.count > 0
    assert any(s.reason.startswith("explicit FP32: rsub") for s in result.skipped), result.skipped
    x2 = torch.randn(8, 16, generator=g)
    with torch.no_grad():
        got, ref = gm(x2, torch.tensor(1)), model(x2, torch.tensor(1))
    err = _rel(got, ref)
    assert err < 1e-2, err  # 0.17 before: 1 - bf16(0.99) = 0.0117, not 0.01


class _ChunkedScores(torch.nn.Module):
    """Longformer's sliding-chunk attention scores, tiny: ``new_zeros`` of the scores, filled through slices
    (``copy_`` into views), then read by a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(12, 4)

    def forward(self, x):
        s = self.q(x) @ self.q(x).transpose(1, 2)  # (B, 6, 6)
        buf = s.new_zeros((s.shape[0], 6, 12))
        buf[:, :, :6] = s
        buf[:, :, 6:] = s.flip(-1)
        buf[:, 1:, :3] += s[:, :-1, :3]
        return self.out(buf)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cast_precision_makes_written_tensors_low_with_their_source(precision):
    """Before: a tensor the graph made with ``new_zeros`` of a low value and wrote through views was kept FP32
    with every view and write ("written in place: copy_ keeps its dtype"; Longformer's chunked attention: 90 ops
    of its tiny graph in FP32, 0.97x Inductor on the H200). Now it is made low as ``model.to(dt)`` makes it, the
    writes land in it and the result matches eager."""
    torch.manual_seed(0)
    model = _ChunkedScores().eval()
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, 6, 8, generator=g)
    gm = torch.export.export(model, (x,), strict=False).module()
    result = cast_precision(gm, PassSpec(precision=precision))
    assert result.count > 0
    assert not any(s.reason.startswith("written in place") for s in result.skipped), result.skipped
    (buf,) = [n for n in gm.graph.nodes if n.op == "call_function" and "new_zeros" in str(n.target)]
    low = getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[precision])
    assert buf.meta["val"].dtype == low
    writes = [n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("aten.copy_")]
    assert writes and all(w.meta["val"].dtype == low for w in writes)
    x2 = torch.randn(2, 6, 8, generator=g)
    with torch.no_grad():
        got, want = gm(x2), model(x2)
        eager = copy.deepcopy(model).to(low)(x2.to(low))
    err = _rel(got, want)
    eager_err = _rel(eager, want)
    assert err <= 2 * eager_err + 1e-3, (err, eager_err)


class _FillLike(torch.nn.Module):
    """Masks made like a low activation and filled with ``finfo(float32).min`` (``full_like`` / ``new_full``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        fill = torch.full_like(h, torch.finfo(torch.float32).min)
        bias = h.new_full((h.shape[0], 8), torch.finfo(torch.float32).min).clamp(min=-1.0)
        return torch.where(h > 0, h, fill).amax(-1) + bias.sum(-1)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cast_precision_fill_like_a_low_value_saturates(precision):
    """``full_like`` / ``new_full`` of a low activation make a low tensor at run time: their FP32 fill value
    saturates to the low range (noted), so they run where PyTorch raises "value cannot be converted to type ...
    without overflow", and the result matches eager."""
    torch.manual_seed(0)
    model = _FillLike().eval()
    g = torch.Generator().manual_seed(13)
    x = torch.randn(6, 8, generator=g)
    gm = torch.export.export(model, (x,), strict=False).module()
    result = cast_precision(gm, PassSpec(precision=precision))
    saturated = result.notes["constants_saturated"]
    assert any(n.startswith("full_like") for n in saturated) and any(n.startswith("new_full") for n in saturated)
    x2 = torch.randn(6, 8, generator=g)
    with torch.no_grad():
        got, want = gm(x2), model(x2)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


class _TimestepEmbedding(torch.nn.Module):
    """A diffusion model's timestep embedding: ``t[:, None].float()`` times ``exp`` of an FP32 ``arange``, then
    ``sin`` / ``cos`` and two linears."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.l1, self.l2, self.d = torch.nn.Linear(d, d), torch.nn.Linear(d, d), d

    def forward(self, x, t):
        half = self.d // 2
        expo = -math.log(10000) * torch.arange(half, dtype=torch.float32) / half
        emb = t[:, None].float() * torch.exp(expo)[None]
        emb = torch.cat([emb.sin(), emb.cos()], -1)
        return x + self.l2(torch.nn.functional.silu(self.l1(emb.to(self.l1.weight.dtype))))[:, None]


@pytest.mark.parametrize("policy", ["pure", "autocast"])
def test_backend_keeps_a_timestep_sinusoid_fp32(monkeypatch, policy):
    """Before: ``arange(dtype=torch.float32)`` was not an FP32 value the model asked for, so its ``exp`` ran low, the
    FP32 timestep met a low value, and the sinusoid of timesteps up to 1000 ran bf16 (twice ``model.to(bf16)``'s
    error). Now factories given ``dtype=torch.float32`` count as explicit FP32 values, and ``sin`` / ``cos`` run FP32
    as under ``model.to(dt)``; the linears still run low."""
    import tctune.backend as tb

    zoo.inductor_runs_the_graph(monkeypatch)
    torch._dynamo.reset()
    tb.reset()
    torch.manual_seed(0)
    model = _TimestepEmbedding().eval()
    g = torch.Generator().manual_seed(14)
    x, t = torch.randn(4, 8, 32, generator=g), torch.rand(4, generator=g) * 1000
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16", "policy": policy})
    with torch.no_grad():
        got, ref = compiled(x, t), model(x, t)
        eager = copy.deepcopy(model).to(torch.bfloat16)(x.to(torch.bfloat16), t.to(torch.bfloat16))
    assert tb.reports and not any(r.fallback for r in tb.reports)
    skips = [s.reason for r in tb.reports for res in r.results for s in res.skipped]
    assert any(s.startswith("explicit FP32: sin") for s in skips), skips
    assert any(res.name == "cast_precision" and res.count > 0 for r in tb.reports for res in r.results)
    err = _rel(got, ref)
    eager_err = _rel(eager, ref)
    assert err <= 1.2 * eager_err + 1e-3, (err, eager_err)


class _Float64Buffer(torch.nn.Module):
    """A float64 buffer read by float64 arithmetic (angles of a frequency table), beside a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("freqs", torch.tensor([1.0 / 3, 0.1, 1e-4, 12345.678], dtype=torch.float64))

    def forward(self, x):
        t = torch.arange(x.shape[0], dtype=torch.float64)
        return self.lin(x), torch.outer(t, self.freqs)


def test_cast_precision_keeps_a_float64_buffer_read_in_float64():
    """Before: the buffer was stored bf16 (its reader is no keep-list op) and cast back up to float64 for the
    ``outer``, which the report said ran "in float64 as the model wrote it": 12345.678 came back as 12352.0. Now
    a float64 weight a float64 op reads stays float64 and the result is exact."""
    model = _Float64Buffer().eval()
    x = torch.randn(64, 4)
    gm = torch.export.export(model, (x,), strict=False).module()
    result = cast_precision(gm, PassSpec(precision="bf16"))
    assert result.count > 0
    assert any(n.endswith("freqs") for n in result.notes["weights_fp32"]), result.notes
    with torch.no_grad():
        (_, got), (_, want) = gm(x), model(x)
    assert got.dtype == torch.float64 and torch.equal(got, want)


class _RotaryReadUp(torch.nn.Module):
    """A hand-written rotary embedding that reads its FP32 ``inv_freq`` buffer with ``.float()`` (directly, or
    through a view first) and computes the angles in FP32, no autocast region."""

    def __init__(self, through_view: bool, d: int = 16) -> None:
        super().__init__()
        self.through_view = through_view
        self.q = torch.nn.Linear(d, d)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False)

    def forward(self, x):
        t = torch.arange(x.shape[1]).float()
        if self.through_view:
            f = t[:, None] * self.inv_freq[None, :].float()
        else:
            f = torch.outer(t, self.inv_freq.float())
        q = self.q(x)
        q1, q2 = q[..., ::2], q[..., 1::2]
        return torch.cat([q1 * f.cos() - q2 * f.sin(), q1 * f.sin() + q2 * f.cos()], -1)


@pytest.mark.parametrize("through_view", [False, True])
@pytest.mark.parametrize("policy", ["autocast", "pure"])
def test_cast_precision_keeps_a_weight_read_up_to_fp32_under_the_autocast_policy(policy, through_view):
    """Before: ``inv_freq`` was stored bf16 under both policies, as ``model.to(bf16)`` stores it; at 2048
    positions the angles came out 0.14 off (relative) where autocast eager, which never rounds a stored weight,
    is 0.003 off. Under the autocast policy a weight read only by explicit FP32 conversions now stays FP32;
    under the pure policy it is still stored low (``model.to``'s numbers)."""
    torch.manual_seed(0)
    model = _RotaryReadUp(through_view).eval()
    x = torch.randn(2, 2048, 16, generator=torch.Generator().manual_seed(5))
    gm = torch.export.export(model, (x,), strict=False).module()
    spec = PassSpec(precision="bf16") if policy == "autocast" else PassSpec(
        precision="bf16", keep_list=PURE_KEEP_LIST, residual_fp32=False)
    result = cast_precision(gm, spec)
    assert result.count > 0  # the linear runs low either way
    kept = any(n.endswith("inv_freq") for n in result.notes["weights_fp32"])
    with torch.no_grad():
        got, ref = gm(x), model(x)
        with torch.autocast("cpu", torch.bfloat16):
            autocast_err = _rel(model(x), ref)
    if policy == "autocast":
        assert kept, result.notes
        assert _rel(got, ref) <= 2 * autocast_err + 1e-3, (_rel(got, ref), autocast_err)
    else:
        assert not kept and _rel(got, ref) > 0.05  # model.to(bf16)'s own error here


class _EmbeddingsAddedInPlace(torch.nn.Module):
    """BERT-style embeddings summed in place (``embeddings += position_embeddings``: Yoso, LiLT), then LayerNorm
    and a residual linear."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.word, self.pos = torch.nn.Embedding(99, 64), torch.nn.Embedding(32, 64)
        self.ln, self.fc = torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)

    def forward(self, ids):
        e = self.word(ids)
        p = self.pos(torch.arange(ids.shape[1]))[None]
        if self.inplace:
            e += p
        else:
            e = e + p
        h = self.ln(e)
        return h + self.fc(h)


def test_cast_precision_in_place_residual_add_stays_fp32_like_its_out_of_place_form():
    """Under the autocast policy ``e = e + p`` of two FP32 lookups stays FP32, but ``e += p`` (``aten.add_``) was
    typed low: both lookups cast down and the LayerNorm read a bf16 sum (relative error 2.8e-3 here against the
    out-of-place form's 1.4e-3). The in-place form now follows the residual rule too."""
    torch.manual_seed(0)
    ids = torch.randint(0, 99, (2, 12), generator=torch.Generator().manual_seed(6))
    errs = {}
    for inplace in (False, True):
        model = _EmbeddingsAddedInPlace(inplace).eval()
        gm = torch.export.export(model, (ids,), strict=False).module()
        result = cast_precision(gm, PassSpec(precision="bf16"))
        with torch.no_grad():
            errs[inplace] = _rel(gm(ids), model(ids))
        if inplace:
            assert any(s.reason.startswith("residual: add_ stays FP32") for s in result.skipped), result.skipped
    assert errs[True] <= 1.1 * errs[False], errs


class _ScaledInput(torch.nn.Module):
    """An input normalized by its own statistics (PatchTST's scaler), an FP32 lookup scaled by a Python float
    (Granite's ``embedding_multiplier``), an RMSNorm-style weight read by a ``mul`` and a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16)
        self.norm_weight = torch.nn.Parameter(1 + 0.1 * torch.randn(16))

    def forward(self, x, ids):
        z = (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)
        h = self.emb(ids) * 12.0 + z
        return self.fc(self.norm_weight * h)


def _ops(gm, name):
    return [n for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "_opname", None) == name]


@pytest.mark.parametrize("policy", ["autocast", "pure"])
def test_cast_precision_autocast_policy_computes_off_list_ops_in_their_inputs_dtype(policy):
    """Under autocast an op off its lower-precision list (GEMMs, convolutions, attention) computes in its inputs'
    promoted dtype and a weight is never rounded unless a GEMM reads it. The autocast policy used to cast every
    such op down: the input's normalization (``div``), the scaled lookup (``mul``) and the norm weight ran bf16.
    Now they compute in FP32 with the weight stored FP32, and the linear still runs bf16; the pure policy
    (``model.to(dt)``'s numbers) is unchanged."""
    torch.manual_seed(0)
    model = _ScaledInput().eval()
    x = 100 + torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, 50, (4,), generator=torch.Generator().manual_seed(3))
    gm = torch.export.export(model, (x, ids), strict=False).module()
    spec = PassSpec(precision="bf16") if policy == "autocast" else PassSpec(
        precision="bf16", keep_list=PURE_KEEP_LIST, residual_fp32=False)
    result = cast_precision(gm, spec)
    (linear,) = _ops(gm, "linear")
    assert all(_val_dtype(a) == torch.bfloat16 for a in linear.all_input_nodes)
    div, muls = _ops(gm, "div")[0], _ops(gm, "mul")
    kept = any(n.endswith("norm_weight") for n in result.notes["weights_fp32"])
    reasons = {s.node: s.reason for s in result.skipped}
    if policy == "autocast":
        assert _val_dtype(div) == torch.float32 and all(_val_dtype(m) == torch.float32 for m in muls)
        assert kept, result.notes
        assert reasons[div.name] == "autocast: div reads an FP32 value and computes in FP32"
    else:
        assert _val_dtype(div) == torch.bfloat16 and not kept
    with torch.no_grad():
        got, ref = gm(x, ids), model(x, ids)
        with torch.autocast("cpu", torch.bfloat16):
            autocast_err = _rel(model(x, ids), ref)
    if policy == "autocast":
        assert _rel(got, ref) <= 1.1 * autocast_err, (_rel(got, ref), autocast_err)


class _MadeConstant(torch.nn.Module):
    """Constants the model makes with ``torch.tensor`` (a cache's empty first layer, per-channel scales)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        cache = torch.cat([torch.tensor([]), self.fc(x).flatten()])
        return self.fc(x) * torch.tensor([0.5, 2.0]).repeat(4) + cache.view(x.shape)


@pytest.mark.parametrize("policy", ["autocast", "pure"])
def test_cast_precision_reads_a_made_constant_as_it_is(policy):
    """``torch.tensor(...)`` in a model exports as a lifted constant read by ``lift_fresh_copy``. The pass put a
    cast between them (under the pure policy, and under the autocast policy before it kept FP32 inputs FP32), and
    AOTAutograd then traced a real tensor ("Please convert all Tensors to FakeTensors first"): the subgraph fell
    back. The constant is now read as it is, an FP32 value like a factory given ``dtype=torch.float32``."""
    torch.manual_seed(0)
    model = _MadeConstant().eval()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(4))
    gm = torch.export.export(model, (x,), strict=False).module()
    spec = PassSpec(precision="bf16") if policy == "autocast" else PassSpec(
        precision="bf16", keep_list=PURE_KEEP_LIST, residual_fp32=False)
    result = cast_precision(gm, spec)
    assert result.count > 0
    lifts = _ops(gm, "lift_fresh_copy")
    assert lifts
    for node in lifts:
        (src,) = node.all_input_nodes
        assert src.op in ("get_attr", "placeholder") and _val_dtype(node) == torch.float32, src
    with torch.no_grad():
        assert _rel(gm(x), model(x)) < 2e-2
