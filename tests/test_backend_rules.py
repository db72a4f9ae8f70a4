"""The backend's measured rules for Inductor: ``fuse_attention`` left out of the default pipeline (noted in the
report, run when named), and ``pad_linear_dims`` leaving a returned linear's N alone (``pad_graph_outputs``
False). CPU only (Inductor's C++ backend); parity with eager on fresh random inputs."""
from __future__ import annotations

import pytest
import torch

import tctune.backend as tb
from passes import PIPELINE
from passes.pad_linear import GRAPH_OUTPUT_REASON
from zoo import TOLERANCES, ZOO, flat_outputs, rel_l2


from zoo import fresh_backend as _fresh  # noqa: E402,F401 - autouse: every test starts with no compiled graph


def _assert_close_bf16(got, ref) -> None:
    got, ref = flat_outputs(got), flat_outputs(ref)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert rel_l2(g, r) <= TOLERANCES["bf16"]["rel_l2"]


def _result(report: tb.SubgraphReport, name: str):
    return next(r for r in report.results if r.name == name)


def test_default_pipeline_leaves_out_fuse_attention():
    assert "fuse_attention" in PIPELINE and "fuse_attention" in tb.INDUCTOR_SKIPS
    assert tb.BACKEND_PIPELINE == tuple(n for n in PIPELINE if n != "fuse_attention")
    assert tb.BackendConfig().pass_names() == tb.BACKEND_PIPELINE
    assert tb.BackendConfig().left_out() == {"fuse_attention": tb.INDUCTOR_SKIPS["fuse_attention"]}
    named = tb.BackendConfig(passes=["fuse_attention", "cast_precision"])
    assert named.pass_names() == ("fuse_attention", "cast_precision") and named.left_out() == {}


@pytest.mark.parametrize("passes", [None, PIPELINE], ids=["default", "named"])
def test_bert_fuse_attention_only_when_named(passes):
    entry = ZOO["bert"]
    model = entry.build()
    opts = {"precision": "bf16", "target": "h100"}
    if passes is not None:
        opts["passes"] = list(passes)
    compiled = torch.compile(model, backend="tctune", options=opts)
    torch.manual_seed(11)
    x = entry.example_inputs(2)
    with torch.no_grad():
        _assert_close_bf16(compiled(*x), model(*x))
    assert tb.reports and all(not rep.fallback for rep in tb.reports), [rep.fallback for rep in tb.reports]
    fused = sum(rep.count("fuse_attention") for rep in tb.reports)
    ran = [any(r.name == "fuse_attention" for r in rep.results) for rep in tb.reports]
    note = "fuse_attention not run: Inductor matches attention itself; measured slower on"
    noted = [any(n.startswith(note) for n in rep.notes) for rep in tb.reports]
    if passes is None:
        assert fused == 0 and not any(ran) and all(noted)
        assert note in tb.reports[0].summary()
    else:
        assert fused >= 2 and all(ran) and not any(noted)


def test_backend_keeps_returned_head_n_and_pads_interior():
    """mlp (Linear 37 -> 61, GELU, Linear 61 -> 13): the interior linear gets N and K padded, the returned head
    only K; simple_cnn's returned head (K aligned) is skipped with the reason."""
    entry = ZOO["mlp"]
    model = entry.build()
    compiled = torch.compile(model, backend=tb.backend(precision="bf16", target="h100"))
    torch.manual_seed(12)
    x = entry.example_inputs(5)
    with torch.no_grad():
        _assert_close_bf16(compiled(*x), model(*x))
    rep = tb.reports[-1]
    assert not rep.fallback, rep.fallback
    pad = _result(rep, "pad_linear_dims")
    padded = sorted(pad.notes["padded"].values(), key=lambda d: d["K"][0])
    assert padded == [{"N": [61, 64], "K": [37, 40]}, {"N": [13, 13], "K": [61, 64]}]
    assert [s.reason for s in pad.skipped] == [GRAPH_OUTPUT_REASON]

    torch._dynamo.reset()
    tb.reset()
    entry = ZOO["simple_cnn"]
    model = entry.build()
    compiled = torch.compile(model, backend=tb.backend(precision="bf16", target="h100"))
    x = entry.example_inputs(4)
    with torch.no_grad():
        _assert_close_bf16(compiled(*x), model(*x))
    pad = _result(tb.reports[-1], "pad_linear_dims")
    assert pad.count == 0 and [s.reason for s in pad.skipped] == [GRAPH_OUTPUT_REASON]


class _TransposedQKV(torch.nn.Module):
    """Longformer's layout: q, k, v read ``x.transpose(0, 1)``, a (seq, batch, d) view of a (batch, seq, d)
    input."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(0, 1)
        return (self.q(h) * self.k(h) + self.v(h)).transpose(0, 1)


def test_backend_fused_qkv_copies_a_transposed_input_once():
    torch.manual_seed(0)
    model = _TransposedQKV().eval()
    compiled = torch.compile(model, backend=tb.backend(precision="bf16", target="h100"))
    x = torch.randn(4, 24, 32)
    with torch.no_grad():
        _assert_close_bf16(compiled(x), model(x))
    (rep,) = tb.reports
    assert not rep.fallback
    result = _result(rep, "fuse_qkv")
    assert result.count == 1 and list(result.notes["copied_inputs"]) == result.changed
    assert "(24, 4, 32) with strides (32, 768, 1)" in next(iter(result.notes["copied_inputs"].values()))


def test_a_graph_without_attention_gets_no_fuse_attention_note():
    """The left-out pass's note ("fuse_attention not run: ...") was on every subgraph's report, a conv net's
    too; it is kept where the graph has a softmax (hand-written attention it could have fused)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 4)).eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.compile(model, backend="tctune", options={"precision": "bf16"})(x)
    rep = tb.reports[-1]
    assert not rep.fallback and not any("fuse_attention" in n for n in rep.notes), rep.notes
