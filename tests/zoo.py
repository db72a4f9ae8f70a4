"""Test support shared by the graph-pass tests: small models, capture, graph counting and parity helpers.

Every zoo entry builds an eval-mode model on the CPU with fixed seeds, so the tests are deterministic. Sizes
are chosen to exercise the passes (odd widths for padding, conv + BN for folding, softmax / layer_norm for
the keep-list) while staying fast on two CPU cores. Beside the models: ``capture`` (as tctune captures),
``ALIGNMENT`` (the Tensor Core alignment the pass tests use), ``call_targets`` / ``count_calls`` (what a
graph calls), ``rel_l2`` and ``assert_matches_eager`` (parity), and the ``SCALED_MM_ROW`` /
``SCALED_MM_TENSOR`` skip marks for tests that run ``torch._scaled_mm`` on this CPU, ``onnxruntime_or_skip`` (for
tests that run ONNX files: onnxruntime is an extra), and ``load_benchmark`` (a script of ``benchmarks/`` as a
module, once per process).
"""
from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from passes.fp8_numerics import scaled_mm_works

#: Tensor Core alignment in elements per precision (16 bytes of the dtype: ``HardwareSpec.alignment`` for
#: Volta to Hopper), the ``PassSpec.alignment`` of the pass tests.
ALIGNMENT: dict[str, int] = {"fp16": 8, "bf16": 8, "tf32": 4}

#: Skip marks for tests that run ``torch._scaled_mm`` on the CPU (oneDNN: row-wise scales need torch 2.13).
SCALED_MM_ROW = pytest.mark.skipif(not scaled_mm_works("cpu", "row"),
                                   reason="torch._scaled_mm with row-wise scales does not run on this CPU torch")
SCALED_MM_TENSOR = pytest.mark.skipif(not scaled_mm_works("cpu", "tensor"),
                                      reason="torch._scaled_mm with tensor-wise scales does not run on this CPU torch")


#: Why a test that runs ONNX files skips without onnxruntime: it is an extra, not part of ``[test]`` (its CPU and
#: GPU wheels both install the module ``onnxruntime`` and cannot be installed side by side).
ORT_MISSING_REASON = ("onnxruntime is not installed: it is an extra, not part of [test]; pip install -e '.[test,onnx]' "
                      "(CPU) or '.[test,onnx-gpu]' (GPU)")


def onnxruntime_or_skip():
    """``import onnxruntime`` (the ``onnxruntime`` or ``onnxruntime-gpu`` wheel), or skip the calling test with
    :data:`ORT_MISSING_REASON`."""
    return pytest.importorskip("onnxruntime", reason=ORT_MISSING_REASON)


def _benchload():
    """``benchmarks/benchload.py`` (the scripts' shared by-path loader), registered once as ``benchload``: the name
    the scripts import it by, so a script a test loads finds it although ``benchmarks/`` is not on ``sys.path``."""
    if "benchload" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "benchload", Path(__file__).resolve().parents[1] / "benchmarks" / "benchload.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["benchload"] = mod
    return sys.modules["benchload"]


def load_benchmark(stem: str):
    """``benchmarks/<stem>.py`` (a script, not a package module) as module ``tctune_bench_<stem>``, loaded once per
    process (``benchload.load_benchmark``): the benchmarks load each other under the same names
    (``zoo_profile.py`` loads ``zoo.py`` as ``tctune_bench_zoo``), so a test and the script it tests share one
    module object."""
    return _benchload().load_benchmark(stem)


_benchload()  # at import (conftest imports this file): a script loaded by path in any test imports it


def capture(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.fx.GraphModule:
    """Capture ``model`` as tctune does: ``torch.export`` (non-strict) with a dynamic batch dimension.

    Args:
        model: an eval-mode module.
        inputs: example inputs; dim 0 of each is the batch (made dynamic, 1..4096).

    Returns:
        The ATen-level ``GraphModule`` (``ExportedProgram.module()``).
    """
    batch = torch.export.Dim("batch", min=1, max=4096)
    dynamic_shapes = tuple({0: batch} for _ in inputs)
    ep = torch.export.export(model, tuple(inputs), dynamic_shapes=dynamic_shapes, strict=False)
    return ep.module()


def call_targets(gm: torch.fx.GraphModule) -> list:
    """The targets (ATen overloads) of ``gm``'s ``call_function`` nodes, in graph order."""
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def count_calls(gm: torch.fx.GraphModule, target: Any) -> int:
    """How many ``call_function`` nodes of ``gm`` call ``target`` (an ATen overload)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def rel_l2(got: Any, ref: Any) -> float:
    """Relative L2 error ``||got - ref|| / ||ref||`` in float64 (tensors or numpy arrays of one shape)."""
    got, ref = torch.as_tensor(got).double(), torch.as_tensor(ref).double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()


# ---------------------------------------------------------------------------------------------- models


class MLP(nn.Module):
    """Linear 37 -> 61 -> 13 with GELU: every K and N is odd."""

    def __init__(self, sizes: tuple[int, ...] = (37, 61, 13)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class SimpleCNN(nn.Module):
    """The seeds' SimpleCNN: conv 3->32 (3x3, pad 1), ReLU, max-pool 2, flatten, Linear(8192, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(32 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv(x)))
        return self.fc(torch.flatten(x, 1))


class ConvBN(nn.Module):
    """conv -> BN -> ReLU, twice; options for a bias-free conv, grouped and depthwise convolutions."""

    def __init__(self, bias: bool = True, groups: int = 1, depthwise: bool = False, dims: int = 2) -> None:
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims]
        bn = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims]
        self.conv1 = conv(8, 16, 3, padding=1, bias=bias, groups=groups)
        self.bn1 = bn(16)
        g2 = 16 if depthwise else groups
        self.conv2 = conv(16, 16, 3, padding=1, bias=bias, groups=g2, stride=2)
        self.bn2 = bn(16)
        _randomize_bn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(x)))


class ConvResidual(nn.Module):
    """A ResNet basic block without BN, written as torchvision writes it: ``ReLU(inplace=True)`` after a biased
    conv, then ``out += identity`` and the in-place ReLU again; the block's output is also viewed flat."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.relu(self.conv1(x))
        out = self.conv2(out)
        out += x
        out = self.relu(out)
        return out, out.view(out.shape[0], -1)


class ConvBNBranch(nn.Module):
    """A conv whose output feeds a BN *and* a residual add: the BN must not be folded."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        _randomize_bn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.bn(y) + y


class ConvTransposeBN(nn.Module):
    """A transposed convolution followed by BN (not folded by the skeleton)."""

    def __init__(self) -> None:
        super().__init__()
        self.deconv = nn.ConvTranspose2d(8, 16, 2, stride=2)
        self.bn = nn.BatchNorm2d(16)
        _randomize_bn(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.deconv(x))


class EncoderBlock(nn.Module):
    """A pre-norm transformer encoder block with hand-written attention (softmax, layer_norm, GELU)."""

    def __init__(self, d: int = 60, heads: int = 4, ff: int = 100) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, ff)
        self.ff2 = nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.ln1(x)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class TiedLM(nn.Module):
    """Embedding V x D tied to an LM head (the GPT-2 vocabulary, V = 50257)."""

    def __init__(self, vocab: int = 50257, d: int = 64) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.wte(ids)))


class StemCNN(nn.Module):
    """A ResNet-like stem with odd channels: 7x7 conv 3 -> 61 (stride 2), ReLU, 3x3 conv 61 -> 61, ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 61, 7, stride=2, padding=3)
        self.conv = nn.Conv2d(61, 61, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(F.relu(self.stem(x))))


class OverflowMLP(nn.Module):
    """Linear 16 -> 32 with weights ~1e4 (activations ~1e5, past fp16's 65504), GELU, Linear 32 -> 8 with
    weights ~1e-4 (outputs back to ~10): fp16 without overflow analysis gives inf / NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(16, 32)
        self.small = nn.Linear(32, 8)
        with torch.no_grad():
            self.big.weight.mul_(1e5)
            self.small.weight.mul_(3e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(F.gelu(self.big(x)))


def _randomize_bn(model: nn.Module) -> None:
    """Give every BN non-trivial running statistics and affine parameters (fresh BN is the identity)."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            c = m.num_features
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.5)
                m.running_var.copy_(torch.rand(c, generator=g) + 0.5)
                m.weight.copy_(torch.rand(c, generator=g) + 0.5)
                m.bias.copy_(torch.randn(c, generator=g) * 0.2)


def small_bert() -> nn.Module:
    """A 2-layer BERT (hidden 64, 4 heads, FFN 96, vocabulary 1000) from ``transformers``, eager attention."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=1000,
        max_position_embeddings=64, attn_implementation="eager",
    )
    return BertModel(cfg, add_pooling_layer=True)


# ---------------------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ZooEntry:
    """A zoo model: ``build()`` returns an eval-mode module, ``example_inputs(batch)`` fresh random inputs."""

    name: str
    build: Callable[[], nn.Module]
    example_inputs: Callable[[int], tuple[torch.Tensor, ...]]


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return factory().eval()

    return build


def _randn(*shape: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
    return lambda batch: (torch.randn(batch, *shape),)


def _ids(vocab: int, seq: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
    return lambda batch: (torch.randint(0, vocab, (batch, seq), dtype=torch.int64),)


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry("mlp", _seeded(MLP), _randn(37)),
        ZooEntry("simple_cnn", _seeded(SimpleCNN), _randn(3, 32, 32)),
        ZooEntry("conv_bn", _seeded(ConvBN), _randn(8, 12, 12)),
        ZooEntry("conv_bn_nobias", _seeded(lambda: ConvBN(bias=False)), _randn(8, 12, 12)),
        ZooEntry("conv_bn_grouped", _seeded(lambda: ConvBN(groups=4)), _randn(8, 12, 12)),
        ZooEntry("conv_bn_depthwise", _seeded(lambda: ConvBN(depthwise=True)), _randn(8, 12, 12)),
        ZooEntry("conv1d_bn", _seeded(lambda: ConvBN(dims=1)), _randn(8, 20)),
        ZooEntry("conv3d_bn", _seeded(lambda: ConvBN(dims=3)), _randn(8, 6, 6, 6)),
        ZooEntry("conv_bn_branch", _seeded(ConvBNBranch), _randn(8, 10, 10)),
        ZooEntry("conv_residual", _seeded(ConvResidual), _randn(8, 10, 10)),
        ZooEntry("conv_transpose_bn", _seeded(ConvTransposeBN), _randn(8, 6, 6)),
        ZooEntry("encoder_block", _seeded(EncoderBlock), _randn(10, 60)),
        ZooEntry("bert", _seeded(small_bert), _ids(1000, 16)),
        ZooEntry("tied_lm", _seeded(TiedLM), _ids(50257, 5)),
        ZooEntry("tied_lm_odd", _seeded(lambda: TiedLM(vocab=1001, d=61)), _ids(1001, 5)),
        ZooEntry("stem_cnn", _seeded(StemCNN), _randn(3, 16, 16)),
        ZooEntry("overflow_mlp", _seeded(OverflowMLP), _randn(16)),
    )
}


def build(name: str, batch: int = 3) -> tuple[nn.Module, torch.fx.GraphModule, ZooEntry]:
    """Build zoo model ``name`` and capture it at ``batch``.

    Returns:
        ``(eager_model, graph_module, entry)``.
    """
    entry = ZOO[name]
    model = entry.build()
    torch.manual_seed(123)
    gm = capture(model, entry.example_inputs(batch))
    return model, gm, entry


# ---------------------------------------------------------------------------------------------- parity

#: Parity tolerances per compute dtype, in one place. fp32: torch.testing's rtol with an atol for sums of
#: hundreds of products; fp16 / bf16: relative L2 error against the FP32 eager reference.
TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": {"rtol": 1.3e-6, "atol": 1e-5},
    "tf32": {"rtol": 1.3e-6, "atol": 1e-5},  # CPU has no TF32: same as fp32
    "fp16": {"rel_l2": 1e-2},
    "bf16": {"rel_l2": 3e-2},
}


def flat_outputs(out: object) -> list[torch.Tensor]:
    """The tensors of a model output (tensor, tuple/list, dict or ``transformers`` ModelOutput), in order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):  # ModelOutput is an OrderedDict
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in flat_outputs(o)]
    return []


def assert_matches_eager(model: nn.Module, gm: torch.fx.GraphModule, inputs: tuple, precision: str) -> None:
    """Run eager (FP32) and ``gm`` on ``inputs``; outputs must agree in shape, dtype and value (``TOLERANCES``)."""
    with torch.no_grad():
        ref = flat_outputs(model(*inputs))
        got = flat_outputs(gm(*inputs))
    assert len(ref) == len(got)
    tol = TOLERANCES[precision]
    for r, g in zip(ref, got):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert torch.isfinite(g).all()
        if "rel_l2" in tol:
            err = rel_l2(g, r)
            assert err <= tol["rel_l2"], f"{precision}: relative L2 error {err:.2e} > {tol['rel_l2']:.0e}"
        else:
            torch.testing.assert_close(g, r, rtol=tol["rtol"], atol=tol["atol"])


# ---------------------------------------------------------------------------------------------- fusion zoo
# Models for the attention / fusion passes (tests/test_passes_attention.py, tests/test_passes_fusion.py).


def small_bert_sdpa() -> nn.Module:
    """The 2-layer BERT of ``small_bert`` with ``transformers``' default SDPA attention (mask built in-graph)."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, vocab_size=1000,
        max_position_embeddings=64, attn_implementation="sdpa",
    )
    return BertModel(cfg, add_pooling_layer=False)


class BertWithPadding(nn.Module):
    """``small_bert_sdpa`` called with a padding ``attention_mask`` input (a real, data-dependent mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.bert = small_bert_sdpa()

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids, attention_mask=attention_mask).last_hidden_state


def _ids_and_padding(vocab: int, seq: int) -> Callable[[int], tuple[torch.Tensor, ...]]:
    def make(batch: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(0, vocab, (batch, seq), dtype=torch.int64)
        lengths = torch.randint(seq // 2, seq + 1, (batch,))
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).to(torch.int64)
        return ids, mask

    return make


class HandAttention(nn.Module):
    """Multi-head attention written by hand: separate q/k/v linears, ``softmax(q k^T * scale + mask) v``.

    Options: ``scale`` (None: divide by sqrt(head dim); a number: multiply by it), ``mask`` ("none",
    "causal": a float buffer with -1e4 above the diagonal, "zeros": an all-zero float buffer), ``rank`` 4
    (batch, heads, seq, dim) or 3 (batch * heads folded: (batch, seq, dim) with one head), ``leak_scores``
    (the scores also feed the output: two users, not fusable), ``v_bias`` (False: v has no bias).
    """

    def __init__(
        self, d: int = 32, heads: int = 4, seq: int = 12, scale: float | None = None, mask: str = "none",
        rank: int = 4, leak_scores: bool = False, v_bias: bool = True,
    ) -> None:
        super().__init__()
        self.heads = heads if rank == 4 else 1
        self.scale, self.rank, self.leak = scale, rank, leak_scores
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
        self.v = nn.Linear(d, d, bias=v_bias)
        self.mask_kind = mask
        if mask == "causal":
            self.register_buffer("mask", torch.triu(torch.full((seq, seq), -1e4), diagonal=1))
        elif mask == "zeros":
            self.register_buffer("mask", torch.zeros(seq, seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.rank == 4:
            q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1)
        if self.scale is None:
            scores = scores / math.sqrt(q.shape[-1])
        else:
            scores = scores * self.scale
        if self.mask_kind != "none":
            scores = scores + self.mask
        out = torch.softmax(scores, dim=-1) @ v
        if self.rank == 4:
            out = out.transpose(1, 2).reshape(b, s, d)
        if self.leak:
            out = out + scores.mean()
        return out


class EpilogueMLP(nn.Module):
    """Linear(37 -> 61) -> activation -> Linear(61 -> 16); ``act`` is "relu", "gelu_tanh" or "gelu"."""

    def __init__(self, act: str = "relu", bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(37, 61, bias=bias)
        self.fc2 = nn.Linear(61, 16)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.act == "relu":
            h = F.relu(h)
        else:
            h = F.gelu(h, approximate="tanh" if self.act == "gelu_tanh" else "none")
        return self.fc2(h)


ZOO.update(
    {
        e.name: e
        for e in (
            ZooEntry("bert_sdpa", _seeded(small_bert_sdpa), _ids(1000, 16)),
            ZooEntry("bert_padded", _seeded(BertWithPadding), _ids_and_padding(1000, 16)),
            ZooEntry("attn", _seeded(HandAttention), _randn(12, 32)),
            ZooEntry("attn_scaled", _seeded(lambda: HandAttention(scale=0.37)), _randn(12, 32)),
            ZooEntry("attn_causal", _seeded(lambda: HandAttention(mask="causal")), _randn(12, 32)),
            ZooEntry("attn_zero_mask", _seeded(lambda: HandAttention(mask="zeros")), _randn(12, 32)),
            ZooEntry("attn_3d", _seeded(lambda: HandAttention(rank=3, scale=0.2)), _randn(12, 32)),
            ZooEntry("attn_leak", _seeded(lambda: HandAttention(leak_scores=True)), _randn(12, 32)),
            ZooEntry("attn_v_nobias", _seeded(lambda: HandAttention(v_bias=False)), _randn(12, 32)),
            ZooEntry("mlp_relu", _seeded(EpilogueMLP), _randn(10, 37)),
            ZooEntry("mlp_gelu_tanh", _seeded(lambda: EpilogueMLP("gelu_tanh")), _randn(10, 37)),
            ZooEntry("mlp_gelu", _seeded(lambda: EpilogueMLP("gelu")), _randn(10, 37)),
            ZooEntry("mlp_relu_nobias", _seeded(lambda: EpilogueMLP(bias=False)), _randn(10, 37)),
        )
    }
)


# ---------------------------------------------------------------------------------------------- coverage zoo
# Models for the zoo-wide pass tests (tests/test_passes_zoo.py): the remaining kinds of model the issue lists.


class MHABlock(nn.Module):
    """A pre-norm transformer block with ``nn.MultiheadAttention(batch_first=True)``, LayerNorm and a GELU MLP.

    ``(batch, seq, 48)`` -> ``(batch, seq, 48)``; 4 heads, FFN 72 -> 50 -> 48 (an odd hidden width).
    """

    def __init__(self, d: int = 48, heads: int = 4, ff: int = 50) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, ff)
        self.ff2 = nn.Linear(ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff2(F.gelu(self.ff1(self.ln2(x))))


class GPT2Logits(nn.Module):
    """A 2-layer GPT-2 (``n_embd`` 64, 4 heads, V = 50257, 64 positions) from ``transformers``, returning the
    logits ``(batch, seq, 50257)`` of ``GPT2LMHeadModel`` (LM head tied to the token embedding)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=50257, n_positions=64)
        self.gpt2 = GPT2LMHeadModel(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt2(input_ids=ids, use_cache=False).logits


class ScaledByBuffer(nn.Module):
    """Linear 29 -> 45 plus a positional table and a per-feature scale kept as *non-persistent* buffers.

    ``(batch, 7, 29)`` -> ``(batch, 7, 45)``. The buffers are used in ``forward`` but are absent from
    ``state_dict``; in the exported graph they are constants.
    """

    def __init__(self, seq: int = 7, d_in: int = 29, d_out: int = 45) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.register_buffer("pos", torch.randn(seq, d_in) * 0.1, persistent=False)
        self.register_buffer("scale", torch.rand(d_out) + 0.5, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.pos) * self.scale


class DictOutput(nn.Module):
    """A shared trunk (Linear 23 -> 33, ReLU) with two heads, returned as ``{"logits": (batch, 11),
    "embedding": (batch, 33)}`` (a dict output, as the export boundary must preserve)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(23, 33)
        self.head = nn.Linear(33, 11)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = F.relu(self.trunk(x))
        return {"logits": self.head(h), "embedding": h}


ZOO.update(
    {
        e.name: e
        for e in (
            ZooEntry("mha_block", _seeded(MHABlock), _randn(9, 48)),
            ZooEntry("gpt2", _seeded(GPT2Logits), _ids(50257, 8)),
            ZooEntry("nonpersistent_buffer", _seeded(ScaledByBuffer), _randn(7, 29)),
            ZooEntry("dict_output", _seeded(DictOutput), _randn(23)),
        )
    }
)


#: A two-linear model file (input (batch, 24) float32, output (batch, 12)): the ``tiny`` fixture of
#: ``conftest.py`` writes it, and tests that need the text itself (e.g. to extend it) import it.
TINY_MODEL_FILE = '''
import torch
def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 12))
def example_inputs(batch_size):
    return (torch.randn(batch_size, 24),)
'''


def _fresh_backend_state():
    """Each test starts and ends with no compiled graph and no backend report, and Inductor compiles in this
    process (no compile worker pool on a two-core CI machine)."""
    import tctune.backend as tb

    patch = torch._inductor.config.patch(compile_threads=1)
    patch.__enter__()
    torch._dynamo.reset()
    tb.reset()
    yield
    torch._dynamo.reset()
    patch.__exit__(None, None, None)


#: Import into a test module as ``from zoo import fresh_backend as _fresh`` to run every test of it fresh.
fresh_backend = pytest.fixture(autouse=True, name="_fresh")(_fresh_backend_state)
#: The same, on request only: import it, then ``def test_x(_fresh_backend): ...``.
fresh_backend_on_request = pytest.fixture(name="_fresh_backend")(_fresh_backend_state)


class TwoHeads(torch.nn.Module):
    """Dict and nested-tuple outputs, a non-persistent buffer, an embedding tied to the output projection."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.body = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 50, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(0.75), persistent=False)
        self.register_buffer("shift", torch.linspace(-1, 1, 32))

    def forward(self, ids, feats):
        h = torch.relu(self.body(self.emb(ids) + feats)) * self.scale + self.shift
        return {"logits": self.head(h), "extra": (h.sum(-1), h.mean(dim=(1, 2)))}


def two_heads_inputs(b: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded inputs of :class:`TwoHeads`: token ids (b, 6) int64 in [0, 50) and features (b, 6, 32) float32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (b, 6), generator=g), torch.randn(b, 6, 32, generator=g)


def inductor_runs_the_graph(monkeypatch) -> list:
    """Replace Inductor's ``compile_fx`` by running the graph it is handed (no C++ compile on the CPU); returns the
    list every handed ``GraphModule`` is appended to."""
    import torch._inductor.compile_fx as cfx

    handed: list = []

    def fake_compile_fx(gm, inputs, **kw):
        handed.append(gm)
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    return handed
