"""copy_linear_inputs: a linear (or matmul with a 2-D weight) whose input ATen cannot fold to (tokens, K) rows
without a copy reads one contiguous copy, so a frozen weight gives one GEMM instead of a broadcast-weight bmm."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import tctune.backend as tb
import zoo
from passes import PIPELINE, PassSpec, run_pipeline
from passes._graph import rows_foldable
from passes.copy_linear_inputs import copy_linear_inputs

LINEAR = torch.ops.aten.linear.default
CLONE = torch.ops.aten.clone.default
_MATMULS = {"mm": torch.ops.aten.mm.default, "addmm": torch.ops.aten.addmm.default, "bmm": torch.ops.aten.bmm.default}


class _TransposedLinear(nn.Module):
    """One linear on ``x.transpose(0, 1)``: a (seq, batch, d) view of a (batch, seq, d) input (Longformer's
    layout), output transposed back."""

    def __init__(self, d: int = 16, n: int = 24) -> None:
        super().__init__()
        self.proj = nn.Linear(d, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.transpose(0, 1)).transpose(0, 1)


class _TwoLinears(nn.Module):
    """Two linears on the same transposed input (q and k when ``fuse_qkv`` does not run)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(0, 1)
        return (self.q(h) * self.k(h)).transpose(0, 1)


class _TransposedMatmul(nn.Module):
    """``x.transpose(0, 1) @ W`` with a 2-D parameter ``W``."""

    def __init__(self, d: int = 16, n: int = 20) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.transpose(0, 1) @ self.w).transpose(0, 1)


class _RowMajor(nn.Module):
    """Linears on row-major inputs: a (batch, seq, d) tensor and a slice of its last dimension."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d - 4, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x[..., 4:])


class _LoneAndFused(nn.Module):
    """q, k, v (fused by fuse_qkv) and one more linear, all reading transposed views of the input."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d) for _ in range(3))
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(0, 1)
        y = (self.q(h) * self.k(h) + self.v(h)).transpose(0, 1)
        return self.out((x + y).transpose(0, 1))


def _frozen_capture(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    gm = zoo.capture(model, (x,))
    for p in gm.parameters():  # frozen, as the backend stores weights (a weight requiring grad folds with a copy)
        p.requires_grad_(False)
    return gm


def _matmul_calls(gm: torch.fx.GraphModule, inputs: tuple) -> dict[str, int]:
    """The GEMM ops ATen's decomposition of ``gm`` runs (``make_fx`` traces through linear / matmul)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        traced = make_fx(gm)(*inputs)
    return {name: zoo.count_calls(traced, op) for name, op in _MATMULS.items()}


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 5, 8).transpose(0, 1),  # Longformer's (seq, batch, K) view
    lambda: torch.randn(2, 8, 5).transpose(1, 2),  # K not the fastest dimension
    lambda: torch.randn(1, 5, 8).transpose(0, 1),  # batch 1: should_fold does not skip size-1 dimensions
    lambda: torch.randn(2, 5, 10)[..., :8],  # padded rows: a view with a row stride of 10
    lambda: torch.randn(3, 4, 5, 8).permute(1, 0, 2, 3),  # 4-D, the first two dimensions swapped
    lambda: torch.randn(2, 5, 8),
])
def test_rows_foldable_agrees_with_atens_matmul(make):
    x = make()
    w = torch.randn(6, 8)  # frozen: requires no grad
    calls = _matmul_calls(torch.fx.symbolic_trace(_Apply(w)), (x,))
    assert rows_foldable(x) == (calls["bmm"] == 0), (tuple(x.shape), x.stride(), calls)


class _Apply(nn.Module):
    """A bias-free linear on a frozen weight (with a bias, a contiguous input takes addmm before matmul)."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("w", w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w)


def test_lone_transposed_linear_reads_one_contiguous_copy():
    torch.manual_seed(0)
    model = _TransposedLinear().eval()
    gm = _frozen_capture(model, torch.randn(3, 10, 16))
    before = _matmul_calls(gm, (torch.randn(3, 10, 16),))

    result = copy_linear_inputs(gm, PassSpec())

    (linear,) = [n for n in gm.graph.nodes if n.target == LINEAR]
    copy = linear.args[0]
    assert result.count == 1 and result.changed == [linear.name] and result.notes["checked"] == 1
    assert copy.target == CLONE and copy.kwargs == {"memory_format": torch.contiguous_format}
    assert copy.args[0].target == torch.ops.aten.transpose.int and copy.meta["val"].is_contiguous()
    note = result.notes["copied_inputs"][linear.name]
    assert "not a row-major (tokens, K) view" in note and copy.name in note and "(10, s" in note
    after = _matmul_calls(gm, (torch.randn(3, 10, 16),))
    assert before["bmm"] == 1 and before["mm"] + before["addmm"] == 0
    assert after["bmm"] == 0 and after["mm"] + after["addmm"] == 1
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 10, 16),), "fp32")  # another (dynamic) batch


def test_linears_reading_one_input_share_one_copy():
    torch.manual_seed(0)
    model = _TwoLinears().eval()
    gm = _frozen_capture(model, torch.randn(3, 10, 16))

    result = copy_linear_inputs(gm, PassSpec())

    linears = [n for n in gm.graph.nodes if n.target == LINEAR]
    assert result.count == 2 and sorted(result.changed) == sorted(n.name for n in linears)
    assert zoo.count_calls(gm, CLONE) == 1 and linears[0].args[0] is linears[1].args[0]
    after = _matmul_calls(gm, (torch.randn(2, 10, 16),))
    assert after["bmm"] == 0 and after["mm"] + after["addmm"] == 2
    zoo.assert_matches_eager(model, gm, (torch.randn(6, 10, 16),), "fp32")


def test_matmul_with_a_2d_weight_reads_a_copy():
    torch.manual_seed(0)
    model = _TransposedMatmul().eval()
    gm = _frozen_capture(model, torch.randn(3, 10, 16))
    matmul = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.matmul.default)
    before = _matmul_calls(gm, (torch.randn(3, 10, 16),))

    result = copy_linear_inputs(gm, PassSpec())

    assert result.count == 1 and result.changed == [matmul.name] and matmul.args[0].target == CLONE
    after = _matmul_calls(gm, (torch.randn(3, 10, 16),))
    assert before["bmm"] == 1 and after["bmm"] == 0 and after["mm"] == 1
    zoo.assert_matches_eager(model, gm, (torch.randn(4, 10, 16),), "fp32")


def test_row_major_inputs_are_left_alone():
    torch.manual_seed(0)
    model = _RowMajor().eval()
    gm = _frozen_capture(model, torch.randn(3, 10, 16))
    code = gm.code

    result = copy_linear_inputs(gm, PassSpec())

    assert result.count == 0 and result.notes == {"checked": 2} and not result.skipped
    assert zoo.count_calls(gm, CLONE) == 0 and gm.code == code
    assert _matmul_calls(gm, (torch.randn(3, 10, 16),))["bmm"] == 0
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 10, 16),), "fp32")


def test_pipeline_copies_a_fused_group_once_and_the_lone_linear_once():
    torch.manual_seed(0)
    model = _LoneAndFused().eval()
    gm = _frozen_capture(model, torch.randn(3, 10, 16))

    results = {r.name: r for r in run_pipeline(gm, PassSpec(), [n for n in PIPELINE if n != "cast_fp8_linears"])}

    assert PIPELINE.index("fuse_qkv") < PIPELINE.index("copy_linear_inputs") < PIPELINE.index("fuse_epilogue")
    assert results["fuse_qkv"].count == 1 and len(results["fuse_qkv"].notes["copied_inputs"]) == 1
    out = next(n for n in gm.graph.nodes if n.target == LINEAR and "out" in str(n.meta.get("nn_module_stack", "")))
    assert results["copy_linear_inputs"].changed == [out.name]  # the fused linear already reads fuse_qkv's copy
    assert zoo.count_calls(gm, CLONE) == 2
    assert _matmul_calls(gm, (torch.randn(3, 10, 16),))["bmm"] == 0
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 10, 16),), "fp32")


from zoo import fresh_backend_on_request  # noqa: E402,F401 - the _fresh_backend fixture


def test_backend_copies_a_lone_transposed_input(_fresh_backend):
    torch.manual_seed(0)
    model = _TransposedLinear(32, 48).eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "fp32"})
    x = torch.randn(4, 24, 32)
    with torch.no_grad():
        got, ref = compiled(x), model(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    (rep,) = tb.reports
    assert not rep.fallback and rep.count("copy_linear_inputs") == 1
    result = next(r for r in rep.results if r.name == "copy_linear_inputs")
    assert "(24, 4, 32) with strides (32, 768, 1)" in next(iter(result.notes["copied_inputs"].values()))
