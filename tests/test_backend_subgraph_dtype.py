"""Subgraphs whose inputs arrive in another dtype than the model's (CPU, Inductor's C++ backend).

Under ``output_dtype="compute"`` a subgraph returns bf16 activations; after a graph break the next subgraph gets
them beside the model's FP32 weights. Dynamo traces that frame, but the graph cannot run as it stands
(``linear(bf16, fp32)``), and its re-export used to fail, so plain Inductor compiled it (Longformer's encoder
after its ``.item()`` break). The backend now casts such inputs up on entry (exact) and the passes cast the graph
as any FP32 graph: every subgraph goes through tctune's passes, whatever dtype its inputs come in.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tctune.backend as tb
from zoo import rel_l2


from zoo import fresh_backend as _fresh  # noqa: E402,F401 - autouse: every test starts with no compiled graph


class _TwoBlocks(nn.Module):
    """Two linear blocks with a graph break between them (``graph_break()`` or a data-dependent ``.item()``).
    The second block starts with a linear on the activation transposed to sequence-first, as Longformer's
    self-attention reads its input (``first="linear"``: a non-contiguous 3-d input, which ``aten.linear`` runs
    as a batched matmul whose meta function checks dtypes), or with a LayerNorm (``first="norm"``, a keep-list
    op under the autocast policy, which reads its input in FP32)."""

    def __init__(self, brk: str = "graph_break", first: str = "linear") -> None:
        super().__init__()
        self.brk, self.first = brk, first
        self.a = nn.Linear(32, 64)
        self.pre = nn.Linear(64, 64) if first == "linear" else nn.LayerNorm(64)
        self.b = nn.Linear(64, 48)
        self.ln = nn.LayerNorm(48)
        self.c = nn.Linear(48, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.brk == "graph_break":
            torch._dynamo.graph_break()
        elif h.sum().item() < -1.0:  # never true after a relu; Dynamo breaks the graph on .item()
            h = -h
        h = self.pre(h.transpose(0, 1)).transpose(0, 1) if self.first == "linear" else self.pre(h)
        h = torch.relu(self.b(h))
        return self.c(self.ln(h)) + h[..., :40]


def _model(**kw) -> _TwoBlocks:
    torch.manual_seed(0)
    return _TwoBlocks(**kw).eval()


def _x(seed: int, batch: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 7, 32, generator=g) * 2 + 0.5


def _compile(model, output_dtype: str, policy: str, graphs: list | None = None, monkeypatch=None):
    if graphs is not None:
        real = tb.inductor_compile

        def spy(gm, example_inputs, config_patches):
            graphs.append(copy.deepcopy(gm))
            return real(gm, example_inputs, config_patches)

        monkeypatch.setattr(tb, "inductor_compile", spy)
    return torch.compile(model, backend="tctune",
                         options={"precision": "bf16", "policy": policy, "output_dtype": output_dtype})


def _fp32_readers(x_in: torch.fx.Node) -> list[str]:
    """The nodes reading ``x_in`` that make an FP32 tensor of it (an up-cast, ``aten.to`` or ``aten._to_copy``)."""
    return [u.format_node() for u in x_in.users if isinstance(u.meta.get("val"), torch.Tensor)
            and u.meta["val"].dtype == torch.float32 and u.meta["val"].shape == x_in.meta["val"].shape]


def _entry_notes() -> list[bool]:
    return [any("cast up on entry" in n for n in rep.notes) for rep in tb.reports]


@pytest.mark.parametrize("policy", ["pure", "autocast"])
@pytest.mark.parametrize("output_dtype", ["compute", "fp32"])
def test_graph_break_subgraphs_compile_through_the_passes(output_dtype, policy, monkeypatch):
    model = _model()
    graphs: list[torch.fx.GraphModule] = []
    compiled = _compile(model, output_dtype, policy, graphs, monkeypatch)
    x = _x(1)
    with torch.no_grad():
        out = compiled(x)
        ref32 = model(x)
        ref16 = copy.deepcopy(model).to(torch.bfloat16)(x.to(torch.bfloat16))
    assert len(tb.reports) == 2, [r.summary() for r in tb.reports]
    assert [r.fallback for r in tb.reports] == ["", ""]
    assert all(r.count("cast_precision") > 0 for r in tb.reports)
    # Only "compute" hands the second subgraph a bf16 activation; under "fp32" it arrives as FP32.
    assert _entry_notes() == [False, output_dtype == "compute"]
    # The last op adds two linear outputs: bf16 under either policy (autocast's add of two bf16 values is bf16).
    assert out.dtype == (torch.bfloat16 if output_dtype == "compute" else torch.float32)
    assert 0 < rel_l2(out.float(), ref32) < 2e-2
    assert rel_l2(out.float(), ref16.float()) < 2e-2
    # The second graph reads the bf16 activation as it came: no FP32 copy of it is made for the linear.
    second = graphs[-1]
    x_in = next(n for n in second.graph.nodes if n.op == "placeholder")
    assert x_in.meta["val"].dtype == (torch.bfloat16 if output_dtype == "compute" else torch.float32)
    if output_dtype == "compute":
        assert _fp32_readers(x_in) == [], [u.format_node() for u in x_in.users]
    # Fresh inputs at another batch size reuse or recompile through the passes, still without a fallback.
    with torch.no_grad():
        x2 = _x(2, batch=5)
        assert rel_l2(compiled(x2).float(), model(x2)) < 2e-2
    assert all(not r.fallback for r in tb.reports), [r.fallback for r in tb.reports]


def test_item_break_and_keep_list_reader_under_compute(monkeypatch):
    """A data-dependent ``.item()`` break, and a LayerNorm (keep-list under autocast) as the first reader of the
    bf16 activation: it is cast up for the norm, as autocast does, and the model still matches eager."""
    model = _model(brk="item", first="norm")
    graphs: list[torch.fx.GraphModule] = []
    compiled = _compile(model, "compute", "autocast", graphs, monkeypatch)
    x = _x(3)
    with torch.no_grad():
        out, ref32 = compiled(x), model(x)
    assert len(tb.reports) >= 2 and all(not r.fallback for r in tb.reports), [r.summary() for r in tb.reports]
    assert _entry_notes()[-1]
    assert out.dtype == torch.bfloat16  # the last op adds two linear outputs: bf16, as under autocast
    assert 0 < rel_l2(out.float(), ref32) < 2e-2
    second = graphs[-1]
    x_in = next(n for n in second.graph.nodes if n.op == "placeholder")
    assert x_in.meta["val"].dtype == torch.bfloat16
    assert len(_fp32_readers(x_in)) == 1, [u.format_node() for u in x_in.users]  # the norm's FP32 input


def test_entry_casts_only_widen():
    bf, hf, f32 = (torch.zeros(2, dtype=d) for d in (torch.bfloat16, torch.float16, torch.float32))
    ids = torch.zeros(2, dtype=torch.int64)
    # runtime inputs are indices 0 and 1; index 2 is a weight
    assert tb._entry_casts([bf, ids, f32], [0, 1]) == {0: torch.float32}
    assert tb._entry_casts([bf, hf, f32], [0, 1]) == {0: torch.float32, 1: torch.float32}
    assert tb._entry_casts([bf, hf], [0, 1]) == {}  # neither holds the other exactly
    assert tb._entry_casts([f32, ids, f32], [0, 1]) == {}
    assert tb._entry_casts([bf, 4, bf], [0, 1]) == {}  # a bf16 model: nothing narrower than its weights
    # float64 is never the target: a Python float argument arrives as a 0-dim float64 tensor, and a float64
    # submodule beside FP32 ones says nothing about the FP32 activations' dtype (tests/test_backend_robust.py)
    f64 = torch.zeros((), dtype=torch.float64)
    assert tb._entry_casts([f32, f64, f32], [0, 1]) == {}
    assert tb._entry_casts([bf, f64, f32], [0, 1]) == {0: torch.float32}
    assert tb._entry_casts([bf, f64], [0, 1]) == {}


@pytest.mark.slow  # about two minutes on two shared cores: a one-layer Longformer through Dynamo + Inductor
def test_longformer_encoder_subgraph_compiles_through_the_passes():
    transformers = pytest.importorskip("transformers")
    config = transformers.LongformerConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128, vocab_size=512,
        attention_window=16, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LongformerForMaskedLM(config).eval()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 512, (2, 32), generator=g)
    compiled = torch.compile(model, backend="tctune",
                             options={"precision": "bf16", "policy": "pure", "output_dtype": "compute"})
    with torch.no_grad():
        out, ref = compiled(input_ids=ids).logits, model(input_ids=ids).logits
    assert all(not r.fallback for r in tb.reports), [r.fallback for r in tb.reports]
    assert any(_entry_notes())  # the encoder's subgraph received the embeddings' bf16 output
    assert out.dtype == torch.bfloat16
    assert rel_l2(out.float(), ref) < 3e-2


def test_round_trip_dropped_only_where_the_input_itself_is_safe_to_read():
    """``x.to(float32).to(bfloat16)`` is read as ``x`` by a computing op; a cast back that is returned or written
    in place stays a copy (the caller's tensor must not come back or change)."""
    aten = torch.ops.aten

    def graph(reader: str) -> tuple[torch.fx.GraphModule, dict]:
        g = torch.fx.Graph()
        x = g.placeholder("x")
        x.meta["val"] = torch.zeros(2, 3, dtype=torch.bfloat16)
        up = g.call_function(aten.to.dtype, (x, torch.float32))
        back = g.call_function(aten._to_copy.default, (up,), {"dtype": torch.bfloat16})
        if reader == "relu":
            g.output(g.call_function(aten.relu.default, (back,)))
        elif reader == "add_":
            g.call_function(aten.add_.Tensor, (back, 1.0))
            g.output(back)
        else:
            g.output(back)
        return torch.fx.GraphModule(torch.nn.Module(), g), {up: x}

    gm, marked = graph("relu")
    assert tb._drop_round_trips(gm, marked) == 1
    x = torch.randn(2, 3).to(torch.bfloat16)
    assert torch.equal(gm(x), torch.relu(x))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [aten.relu.default]
    for reader in ("output", "add_"):
        gm, marked = graph(reader)
        assert tb._drop_round_trips(gm, marked) == 0, reader
        x = torch.randn(2, 3).to(torch.bfloat16)
        before = x.clone()
        out = gm(x)
        assert out is not x and torch.equal(x, before), reader
