"""Tied weights stay tied through padding: an embedding table shared with the LM head is one tensor before and
after ``pad_linear_dims`` (and the padding passes of the pipeline), padded once for both of its users.

State size is measured as the distinct storages (and their bytes) behind the graph's parameters and buffers:
padding may grow the tied table by its padded rows, never by a second copy.
"""
from __future__ import annotations

import pytest
import torch
from passes.policy import pass_spec
from torch import nn
import torch.nn.functional as F

import zoo
from passes import PIPELINE, PassSpec, pad_linear_dims, run_pipeline
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
