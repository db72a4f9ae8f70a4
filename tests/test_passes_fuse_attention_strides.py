"""fuse_attention hands SDPA q / k / v whose last dimension has stride 1.

CUDA's fused SDPA kernels (flash, memory-efficient, cuDNN) need stride 1 there; otherwise PyTorch runs the math
fallback, which computes bf16 inputs as two FP32 GEMMs. Heads split by ``reshape(...).permute(...)`` of a
fused QKV 1x1 convolution (timm's Visformer, non-fused path) give q with strides ``(.., .., 1, N)``.
"""
from __future__ import annotations

import torch
from torch import nn

import zoo
from passes import PassSpec, fuse_attention

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


class ConvQKVAttention(nn.Module):
    """Visformer-style attention: q, k, v are ``(B, H, N, D)`` permuted views with last-dim stride ``N``."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Conv2d(dim, 3 * dim, 1, bias=False)
        self.proj = nn.Conv2d(dim, dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        q, k, v = self.qkv(x).reshape(b, 3, self.heads, self.head_dim, -1).permute(1, 0, 2, 4, 3).unbind(0)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).permute(0, 1, 3, 2).reshape(b, -1, h, w))


class LinearHeadsAttention(nn.Module):
    """BERT-style heads: ``view(B, N, H, D).transpose(1, 2)`` keeps the last dimension dense."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def split(t):
            return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        attn = (q @ k.transpose(-1, -2) / self.head_dim ** 0.5).softmax(-1)
        return (attn @ v).transpose(1, 2).reshape(b, n, -1)


def _sdpa_inputs(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    node = next(n for n in gm.graph.nodes if n.target == _SDPA)
    return [a.meta["val"] for a in node.args[:3]]


def test_permuted_heads_get_a_contiguous_copy_and_match_eager():
    torch.manual_seed(0)
    model = ConvQKVAttention().eval()
    gm = zoo.capture(model, (torch.randn(2, 32, 5, 7),))
    before = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.matmul.default).args[0].meta["val"]
    assert before.stride(-1) != 1  # the problem: a permuted view

    result = fuse_attention(gm, PassSpec(precision="bf16"))

    assert result.count == 1
    assert len(result.notes["made_contiguous"]) == 3
    assert all(t.stride(-1) == 1 for t in _sdpa_inputs(gm))
    torch.manual_seed(3)
    x = torch.randn(3, 32, 5, 7)
    with torch.no_grad():
        assert torch.allclose(gm(x), model(x), rtol=1e-5, atol=1e-5)


def test_dense_heads_are_not_copied():
    torch.manual_seed(0)
    model = LinearHeadsAttention().eval()
    gm = zoo.capture(model, (torch.randn(2, 9, 32),))

    result = fuse_attention(gm, PassSpec(precision="bf16"))

    assert result.count == 1 and result.notes["made_contiguous"] == []
    assert zoo.count_calls(gm, torch.ops.aten.clone.default) == 0
    assert all(t.stride(-1) == 1 for t in _sdpa_inputs(gm))
    torch.manual_seed(3)
    x = torch.randn(3, 9, 32)
    with torch.no_grad():
        assert torch.allclose(gm(x), model(x), rtol=1e-5, atol=1e-5)
