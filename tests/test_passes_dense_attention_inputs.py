"""dense_attention_inputs: an SDPA input whose last dimension does not have stride 1 (T5's permuted
relative-position bias) is read through one contiguous copy, so CUDA's fused kernels can take the call."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tctune.backend as tb
import zoo
from passes import PIPELINE, PassSpec, run_pipeline
from passes.dense_attention_inputs import dense_attention_inputs

SDPA = torch.ops.aten.scaled_dot_product_attention.default
CLONE = torch.ops.aten.clone.default
GPU = PassSpec(arch="Hopper")


class _PermutedBias(nn.Module):
    """Self-attention with a learned bias stored ``(L, S, heads)`` and handed to SDPA as ``(1, heads, L, S)``
    (T5's relative-position bias layout: last-dim stride = heads). ``share`` runs a second attention reading the
    same bias."""

    def __init__(self, d: int = 32, heads: int = 4, seq: int = 12, share: bool = False) -> None:
        super().__init__()
        self.h, self.share = heads, share
        self.qkv = nn.Linear(d, 3 * d)
        self.bias = nn.Parameter(torch.randn(seq, seq, heads))

    def _attend(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.bias.permute(2, 0, 1).unsqueeze(0)
        y = self._attend(x, mask)
        return self._attend(y, mask) if self.share else y


class _TransposedQuery(nn.Module):
    """SDPA whose query is a transposed view (last-dim stride != 1), no mask."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.transpose(-1, -2), k, v)


def _sdpa_args(gm: torch.fx.GraphModule) -> list[tuple]:
    return [n.args for n in gm.graph.nodes if n.target is SDPA]


def test_a_permuted_bias_is_copied_once_and_the_graph_matches_eager():
    torch.manual_seed(0)
    model = _PermutedBias().eval()
    gm = zoo.capture(model, (torch.randn(2, 12, 32),))
    (args,) = _sdpa_args(gm)
    assert args[3].meta["val"].stride()[-1] == 4  # the bias as captured: last-dim stride = heads

    result = dense_attention_inputs(gm, GPU)

    assert result.count == 1 and result.notes["checked"] == 1
    (args,) = _sdpa_args(gm)
    mask = args[3]
    assert mask.target is CLONE and mask.meta["val"].is_contiguous()
    assert all(a.meta["val"].stride()[-1] == 1 for a in args[:3])  # q / k / v already dense: left alone
    (line,) = next(iter(result.notes["copied"].values()))
    assert line.startswith("attn_mask: input") and "(1, 4, 12, 12)" in line
    zoo.assert_matches_eager(model, gm, (torch.randn(3, 12, 32),), "fp32")


def test_two_attentions_reading_one_bias_share_one_copy():
    torch.manual_seed(0)
    model = _PermutedBias(share=True).eval()
    gm = zoo.capture(model, (torch.randn(2, 12, 32),))

    result = dense_attention_inputs(gm, GPU)

    assert result.count == 2 and len(result.changed) == 2
    assert zoo.count_calls(gm, CLONE) == 1
    masks = {a[3] for a in _sdpa_args(gm)}
    assert len(masks) == 1
    zoo.assert_matches_eager(model, gm, (torch.randn(2, 12, 32),), "fp32")


def test_a_transposed_query_is_copied():
    torch.manual_seed(0)
    model = _TransposedQuery().eval()
    inputs = (torch.randn(2, 4, 8, 10), torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8))
    gm = zoo.capture(model, inputs)

    result = dense_attention_inputs(gm, GPU)

    assert result.count == 1
    (args,) = _sdpa_args(gm)
    assert args[0].target is CLONE and args[1].target is not CLONE
    fresh = (torch.randn(2, 4, 8, 10), torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8))
    zoo.assert_matches_eager(model, gm, fresh, "fp32")


def test_a_cpu_target_is_left_alone():
    torch.manual_seed(0)
    plain = zoo.capture(_PermutedBias().eval(), (torch.randn(2, 12, 32),))
    before = len(plain.graph.nodes)

    on_cpu = dense_attention_inputs(plain, PassSpec(arch="cpu"))

    assert on_cpu.count == 0 and "CPU" in on_cpu.notes["not_run"] and len(plain.graph.nodes) == before


def test_nothing_to_copy_changes_nothing():
    class Dense(nn.Module):
        def forward(self, q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    inputs = (torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 8), torch.randn(2, 4, 10, 10))
    gm = zoo.capture(Dense().eval(), inputs)
    code = gm.code

    result = dense_attention_inputs(gm, GPU)

    assert result.count == 0 and result.notes["checked"] == 1 and "copied" not in result.notes
    assert gm.code == code


def test_the_pipeline_runs_it_after_the_mask_is_simplified():
    assert PIPELINE.index("simplify_attention_mask") < PIPELINE.index("dense_attention_inputs") < PIPELINE.index(
        "cast_precision")
    assert "dense_attention_inputs" in tb.BACKEND_PIPELINE


def test_t5_keeps_parity_and_every_sdpa_input_reaches_it_dense():
    """A real T5 (tiny config). Whether its relative-position bias arrives permuted depends on the transformers
    version (5.17 hands SDPA a ``(1, heads, L, S)`` bias of last-dim stride ``heads``; later versions a contiguous
    one): either way, after the pipeline every SDPA input has stride 1 last and the graph matches eager."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False)
    model = transformers.T5ForConditionalGeneration(cfg).eval()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids, dec):
            return self.m(input_ids=ids, decoder_input_ids=dec).logits

    wrapper = Logits().eval()
    gm = zoo.capture(wrapper, (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))))
    spec = PassSpec(arch="Hopper", precision="fp32")
    results = {r.name: r for r in run_pipeline(gm, spec, [n for n in PIPELINE if n != "cast_fp8_linears"])}

    assert results["dense_attention_inputs"].notes["checked"] == 6  # 2 encoder + 2x2 decoder attentions
    for args in _sdpa_args(gm):
        assert all(a is None or a.meta["val"].stride()[-1] == 1 for a in args[:4])
    zoo.assert_matches_eager(wrapper, gm, (torch.randint(0, 64, (3, 16)), torch.randint(0, 64, (3, 16))), "fp32")


from zoo import fresh_backend_on_request  # noqa: E402,F401 - the _fresh_backend fixture


def test_backend_for_a_gpu_target_copies_the_bias(_fresh_backend):
    torch.manual_seed(0)
    model = _PermutedBias().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "fp32", "target": "h100"})
    x = torch.randn(3, 12, 32)
    with torch.no_grad():
        got, ref = compiled(x), model(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    (rep,) = tb.reports
    assert not rep.fallback and rep.count("dense_attention_inputs") == 1
