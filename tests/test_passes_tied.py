"""Tied weights stay tied through padding and casting: an embedding table shared with the LM head is one tensor
before and after ``pad_linear_dims`` (and the padding passes of the pipeline), padded once for both of its users,
and after ``cast_precision`` (pure and autocast policies, bf16 and fp16) one low-dtype tensor bound to both names;
the ``torch.compile`` backend's frozen graph holds it once too.

State size is measured as the distinct storages (and their bytes) behind the graph's parameters and buffers:
padding may grow the tied table by its padded rows, casting may halve it, never add a second copy.
"""
from __future__ import annotations

import copy

import pytest
import torch
from passes.policy import pass_spec
from torch import nn
import torch.nn.functional as F

import zoo
from passes import PIPELINE, PassSpec, cast_precision, pad_linear_dims, run_pipeline
from passes._graph import alias_targets, get_attr_value
from tctune import hardware

BF16 = PassSpec(precision="bf16", alignment={"bf16": 8}, arch="Hopper")
LINEAR = torch.ops.aten.linear.default
EMBEDDING = torch.ops.aten.embedding.default


def _state(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """``(distinct storages, their bytes)`` behind every parameter and buffer name of ``gm``."""
    tensors = [t for _, t in gm.named_parameters(remove_duplicate=False)]
    tensors += [t for _, t in gm.named_buffers(remove_duplicate=False)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return len(storages), sum(storages.values())


def _weights_read(gm: torch.fx.GraphModule, target) -> list[torch.Tensor]:
    """The tensors the ``target`` nodes (embedding: arg 0, linear: arg 1) read, in graph order."""
    idx = 0 if target == EMBEDDING else 1
    return [get_attr_value(gm, n.args[idx].target) for n in gm.graph.nodes if n.target == target]


@pytest.mark.parametrize("name, table", [("tied_lm_odd", "wte.weight"), ("gpt2", "gpt2.transformer.wte.weight")])
def test_padding_keeps_tied_table_one_tensor(name, table):
    model, gm, entry = zoo.build(name)
    weight = get_attr_value(gm, table)
    names = alias_targets(gm, weight)
    assert len(names) == 2  # the embedding's and the head's names for one Parameter
    storages, nbytes = _state(gm)

    result = pad_linear_dims(gm, BF16)

    padded = get_attr_value(gm, table)
    v_old, v_new = result.notes["padded"]["embedding"]["V"]
    assert v_new > v_old and padded.shape[0] == v_new
    assert alias_targets(gm, padded) == names  # both names still bind one object
    (head,) = [w for w in _weights_read(gm, LINEAR) if w.shape[0] == v_new]
    assert head is padded
    tables = _weights_read(gm, EMBEDDING)  # GPT-2 also has its position table
    assert any(w is padded for w in tables) and not any(w.shape[0] in (v_old, v_new) and w is not padded
                                                        for w in tables)
    # One tensor, grown by its padded rows only: never a second copy of the table.
    grown = (v_new - v_old) * padded.shape[1] * padded.element_size()
    assert _state(gm) == (storages, nbytes + grown)
    zoo.assert_matches_eager(model, gm, entry.example_inputs(4), "fp32")


def test_padding_keeps_tie_read_through_two_get_attr_targets():
    """The head reads the table under its own name (a second ``get_attr``): both names are padded as one."""
    model, gm, entry = zoo.build("tied_lm_odd")
    (head,) = [n for n in gm.graph.nodes if n.target == LINEAR]
    with gm.graph.inserting_before(head):
        head_weight = gm.graph.get_attr("head.weight")
    head_weight.meta.update(head.args[1].meta)
    head.replace_input_with(head.args[1], head_weight)
    gm.recompile()
    assert gm.head.weight is gm.wte.weight
    storages, nbytes = _state(gm)

    result = pad_linear_dims(gm, BF16)

    assert result.notes["padded"]["linear"]["N"] == [1001, 1008]
    assert result.notes["padded"]["embedding"] == {"V": [1001, 1008]}
    assert gm.head.weight is gm.wte.weight and gm.wte.weight.shape == (1008, 61)
    assert _state(gm) == (storages, nbytes + 7 * 61 * 4)
    zoo.assert_matches_eager(model, gm, entry.example_inputs(4), "fp32")


class _TiedWithNorm(nn.Module):
    """Embedding 1001 x 64 tied to the head, and the table also read by a non-GEMM op (its mean, added to the
    logits): ``ids (batch, 5)`` -> ``(batch, 5, 1001)``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(1001, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.wte(ids), self.wte.weight) + self.wte.weight.mean()


def test_padding_skips_tie_with_a_use_that_cannot_take_padded_rows():
    torch.manual_seed(0)
    model = _TiedWithNorm().eval()
    gm = zoo.capture(model, (torch.randint(0, 1001, (3, 5)),))
    weight = gm.wte.weight
    state = _state(gm)

    result = pad_linear_dims(gm, BF16)

    assert result.count == 0
    (linear,) = [n.name for n in gm.graph.nodes if n.target == LINEAR]
    reasons = [s.reason for s in result.skipped if s.node == linear]
    assert reasons == ["weight tied to mean (aten.mean.default), which cannot take padded rows: N not padded"]
    assert gm.wte.weight is weight and _state(gm) == state
    zoo.assert_matches_eager(model, gm, (torch.randint(0, 1001, (4, 5)),), "fp32")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_pipeline_padding_passes_keep_gpt2_tie(precision):
    """Every pass before the casts (which own the dtype of the table) keeps the tied table one tensor."""
    model, gm, entry = zoo.build("gpt2")
    names = [n for n in PIPELINE if n not in ("cast_fp8_linears", "cast_precision")]
    storages, nbytes = _state(gm)
    table = gm.gpt2.transformer.wte.weight

    results = {r.name: r for r in run_pipeline(gm, pass_spec(hardware.resolve("sm_90"), precision), names)}

    assert results["pad_linear_dims"].count == 2  # the head and its tied embedding
    padded = gm.gpt2.transformer.wte.weight
    assert padded is gm.gpt2.lm_head.weight
    count, size = _state(gm)
    assert count == storages and size - nbytes < table.numel() * table.element_size() // 100
    zoo.assert_matches_eager(model, gm, entry.example_inputs(2), "fp32")


# ------------------------------------------------------------------------------------- casting: one copy

_PAD_PASSES = ("pad_linear_dims", "pad_matmul_dims", "pad_conv_channels")
_LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
_CAST = torch.ops.aten._to_copy.default


def _distinct_storages(model: nn.Module) -> int:
    """How many storages the eager model's parameters and buffers use (a tied weight counts once)."""
    return len({t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]})


def _model_to_error(model: nn.Module, inputs: tuple, precision: str) -> float:
    """Relative L2 error of ``model.to(dt)`` against the FP32 model on ``inputs``: the reference numerics."""
    low = copy.deepcopy(model).to(_LOW[precision])
    with torch.no_grad():
        return zoo.rel_l2(low(*inputs).float(), model(*inputs))


def _cast_pipeline(gm: torch.fx.GraphModule, precision: str, policy: str, pad: bool) -> dict:
    names = [n for n in PIPELINE if n != "cast_fp8_linears" and (pad or n not in _PAD_PASSES)]
    spec = pass_spec(hardware.resolve("sm_90"), precision, policy=policy)
    return {r.name: r for r in run_pipeline(gm, spec, names)}


@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("policy", ["pure", "autocast"])
def test_cast_stores_tied_table_once(policy, precision, pad):
    """V = 1001 (not a multiple of 8: the head's N and the table's rows are padded when ``pad``)."""
    model, gm, entry = zoo.build("tied_lm_odd")
    untied = _distinct_storages(model)
    assert _state(gm)[0] == untied == 3  # table, LayerNorm weight and bias

    results = _cast_pipeline(gm, precision, policy, pad)

    cast = results["cast_precision"]
    assert cast.notes["weights_tied"] == {"head.weight": ["head.weight", "wte.weight"]}  # the rule fired
    table = gm.wte.weight
    v = 1001
    if pad:
        v_old, v = results["pad_linear_dims"].notes["padded"]["embedding"]["V"]
        assert v_old == 1001 and v > v_old and v % 8 == 0
    assert gm.head.weight is table and table.dtype == _LOW[precision] and table.shape == (v, 61)
    assert all(w is table for w in _weights_read(gm, LINEAR) + _weights_read(gm, EMBEDDING))
    count, nbytes = _state(gm)
    # One copy of the table, in the low dtype with its padded rows, beside the LayerNorm's 2 x 61 (FP32 at most).
    assert count == untied and nbytes <= v * 61 * 2 + 2 * 61 * 4
    # The lookup gathers low rows; the autocast policy casts them up to FP32 at once, the pure policy does not.
    (lookup,) = [n for n in gm.graph.nodes if n.target == EMBEDDING]
    ups = [u for u in lookup.users if u.target == _CAST and u.kwargs.get("dtype") == torch.float32]
    assert len(ups) == (1 if policy == "autocast" else 0)
    torch.manual_seed(11)  # fresh ids, not the capture's
    inputs = entry.example_inputs(4)
    zoo.assert_matches_eager(model, gm, inputs, precision)
    with torch.no_grad():
        err = zoo.rel_l2(gm(*inputs), model(*inputs))
    assert 0 < err <= 1.05 * _model_to_error(model, inputs, precision)  # low for real, and model.to(dt)'s accuracy
    spec = pass_spec(hardware.resolve("sm_90"), precision, policy=policy)
    again = cast_precision(gm, spec)  # a second run changes nothing and keeps the one tensor
    assert again.count == 0 and gm.head.weight is table and gm.wte.weight is table and _state(gm) == (count, nbytes)


@pytest.mark.parametrize("policy", ["pure", "autocast"])
def test_gpt2_parameters_one_copy_after_cast_and_padding(policy):
    """transformers' GPT-2 (``lm_head.weight is transformer.wte.weight``, V = 50257 padded): bf16
    parameters are half the FP32 bytes plus the padded rows, never the FP32 table beside a bf16 head."""
    model, gm, entry = zoo.build("gpt2")
    untied = _distinct_storages(model)
    count0, fp32_bytes = _state(gm)
    assert count0 == untied

    results = _cast_pipeline(gm, "bf16", policy, pad=True)

    table = gm.gpt2.transformer.wte.weight
    v_old, v = results["pad_linear_dims"].notes["padded"]["embedding"]["V"]
    assert v_old == 50257 and v > v_old and v % 8 == 0
    assert results["cast_precision"].notes["weights_tied"] == {
        "gpt2.lm_head.weight": ["gpt2.lm_head.weight", "gpt2.transformer.wte.weight"]}
    assert gm.gpt2.lm_head.weight is table and table.dtype == torch.bfloat16 and table.shape == (v, 64)
    count, nbytes = _state(gm)
    kept = results["cast_precision"].notes["weights_fp32"]  # LayerNorms, position table (autocast policy)
    fp32_extra = sum(get_attr_value(gm, name).numel() * 2 for name in kept)  # their FP32 half beyond bf16
    assert count == untied and nbytes <= fp32_bytes // 2 + (v - v_old) * 64 * 2 + fp32_extra
    torch.manual_seed(12)
    inputs = entry.example_inputs(2)
    zoo.assert_matches_eager(model, gm, inputs, "bf16")
    with torch.no_grad():
        err = zoo.rel_l2(gm(*inputs), model(*inputs))
    assert err <= 1.05 * _model_to_error(model, inputs, "bf16")


@pytest.mark.parametrize("policy", ["pure", "autocast"])
def test_backend_compiles_tied_table_once(monkeypatch, policy):
    """``torch.compile(backend=tctune)``: Dynamo lifts the tied parameter as one input; the frozen graph Inductor
    gets holds one bf16 table read by the lookup and the head."""
    import tctune.backend as tb

    graphs = []

    def record(gm, example_inputs, patches):  # Inductor replaced by the graph it would compile
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(tb, "inductor_compile", record)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = zoo.TiedLM(vocab=1001, d=61).eval()
    compiled = torch.compile(model, backend=tb.backend(precision="bf16", policy=policy, target="sm_90"))
    ids = torch.randint(0, 1001, (3, 5))
    with torch.no_grad():
        out, ref = compiled(ids), model(ids)
    torch._dynamo.reset()

    (gm,) = graphs
    tensors = [*gm.parameters(), *gm.buffers()]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == _distinct_storages(model)
    (table,) = [t for t in tensors if t.dim() == 2]
    assert table.dtype == torch.bfloat16 and table.shape == (1001, 61)  # head output unpadded (graph output)
    assert _weights_read(gm, LINEAR)[0] is table and _weights_read(gm, EMBEDDING)[0] is table
    assert 0 < zoo.rel_l2(out, ref) <= zoo.TOLERANCES["bf16"]["rel_l2"]


class _TwoInputsTied(nn.Module):
    """What Dynamo would hand the backend if it passed a tied table twice: ``(table, ids, head_weight)`` ->
    ``linear(embedding(ids), head_weight)``, logits ``(batch, 5, V)``."""

    def forward(self, table: torch.Tensor, ids: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(F.embedding(ids, table), head_weight)


def test_backend_freezes_one_weight_passed_twice_as_one_tensor(monkeypatch):
    import tctune.backend as tb

    graphs = []
    monkeypatch.setattr(tb, "inductor_compile", lambda gm, ex, patches: graphs.append(gm) or gm.forward)
    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(1001, 64), requires_grad=False)
    ids = torch.randint(0, 1001, (3, 5))
    graph = torch.fx.symbolic_trace(_TwoInputsTied())

    run = tb.tctune_backend(graph, [table, ids, table], precision="bf16", policy="pure", target="sm_90")

    assert not run._tctune_report.fallback and len(run._tctune_report.frozen) == 2
    (gm,) = graphs
    tensors = [*gm.parameters(), *gm.buffers()]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1 and tensors[0].dtype == torch.bfloat16
    torch.manual_seed(13)
    fresh = torch.randint(0, 1001, (4, 5))
    with torch.no_grad():
        err = zoo.rel_l2(run(table, fresh, table), F.linear(F.embedding(fresh, table), table))
    assert 0 < err <= zoo.TOLERANCES["bf16"]["rel_l2"]
