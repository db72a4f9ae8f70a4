"""``pad_linear_dims`` under ``PassSpec.pad_graph_outputs``: False (the backend's rule for Inductor) keeps the N of
a linear the graph returns, directly or through views / casts, and still pads K and interior N; True (the
default) pads it as before. Parity with eager on fresh random inputs."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zoo
from passes import PassSpec, pad_linear_dims
from passes.pad_linear import GRAPH_OUTPUT_REASON, returned_by_graph
from passes.policy import pass_spec

FP16 = PassSpec(precision="fp16", alignment=zoo.ALIGNMENT)
NO_OUT = dataclasses.replace(FP16, pad_graph_outputs=False)
_LINEAR = torch.ops.aten.linear.default


def _linears(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target == _LINEAR]


def _reasons(result) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s in result.skipped:
        out.setdefault(s.node, []).append(s.reason)
    return out


def test_pad_graph_outputs_defaults_true_and_is_checked():
    assert PassSpec().pad_graph_outputs is True
    assert pass_spec(type("HW", (), {"alignment": {"bf16": 8}, "arch": "Hopper"})(), "bf16").pad_graph_outputs
    with pytest.raises(ValueError, match="pad_graph_outputs must be True or False"):
        PassSpec(pad_graph_outputs="no")


def test_head_returned_keeps_n_interior_linear_still_padded():
    """mlp: Linear 37 -> 61 (interior) -> GELU -> Linear 61 -> 13 (returned)."""
    model, gm, entry = zoo.build("mlp")

    result = pad_linear_dims(gm, NO_OUT)

    first, head = _linears(gm)
    assert result.count == 2
    assert result.notes["padded"][first] == {"N": [61, 64], "K": [37, 40]}
    assert result.notes["padded"][head] == {"N": [13, 13], "K": [61, 64]}  # K padding of the head is kept
    assert GRAPH_OUTPUT_REASON in _reasons(result)[head]
    assert first not in _reasons(result)
    assert result.notes["should_pad"][head]["N"]["reason"] == GRAPH_OUTPUT_REASON
    assert gm.get_parameter("layers.1.weight").shape == (13, 64) and gm.get_parameter("layers.1.bias").shape == (13,)
    # No slice of the head's output: the graph returns the GEMM's own result.
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    assert not any(n.target == torch.ops.aten.slice.Tensor for n in out_node.all_input_nodes)
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp32")


def test_head_returned_is_padded_with_the_default_flag():
    model, gm, entry = zoo.build("mlp")

    result = pad_linear_dims(gm, FP16)

    assert result.notes["padded"][_linears(gm)[1]] == {"N": [13, 16], "K": [61, 64]}
    assert not any(GRAPH_OUTPUT_REASON in r for rs in _reasons(result).values() for r in rs)
    zoo.assert_matches_eager(model, gm, entry.example_inputs(4), "fp32")


@pytest.mark.parametrize("flag,padded", [(True, True), (False, False)])
def test_classifier_head_only_k_aligned(flag, padded):
    """simple_cnn's Linear(8192, 10) is the output and its K is aligned: nothing to pad under the rule."""
    model, gm, entry = zoo.build("simple_cnn")

    result = pad_linear_dims(gm, dataclasses.replace(FP16, pad_graph_outputs=flag))

    assert result.count == int(padded)
    assert gm.fc.weight.shape == ((16 if padded else 10), 8192)
    if not padded:
        assert _reasons(result) == {"linear": [GRAPH_OUTPUT_REASON]}
        assert "padded" not in result.notes
    zoo.assert_matches_eager(model, gm, entry.example_inputs(6), "fp32")


def test_tied_lm_head_returned_keeps_vocabulary():
    model, gm, entry = zoo.build("tied_lm")

    result = pad_linear_dims(gm, NO_OUT)

    assert result.count == 0
    reasons = _reasons(result)
    assert reasons["linear"] == [GRAPH_OUTPUT_REASON]
    assert reasons["embedding"][0].startswith("embedding: vocabulary rows are padded only when tied")
    assert gm.head.weight.shape == (50257, 64)
    zoo.assert_matches_eager(model, gm, entry.example_inputs(2), "fp32")


class _ViewedCastHead(nn.Module):
    """trunk Linear 19 -> 30, ReLU, head Linear 30 -> 21 returned through reshape + transpose + float cast."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(19, 30)
        self.head = nn.Linear(30, 21)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(F.relu(self.trunk(x)))
        return y.reshape(x.shape[0], 3, 7).transpose(1, 2).to(torch.float64)


class _ComputedHead(nn.Module):
    """The head's output is scaled before it is returned: the output is a new tensor either way."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(24, 21)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(x)) * 3.0


def test_returned_through_views_and_casts_counts_as_graph_output():
    torch.manual_seed(0)
    model = _ViewedCastHead().eval()
    gm = zoo.capture(model, (torch.randn(4, 19),))
    trunk, head = _linears(gm)
    node = {n.name: n for n in gm.graph.nodes}
    assert returned_by_graph(node[head]) and not returned_by_graph(node[trunk])

    result = pad_linear_dims(gm, NO_OUT)

    assert result.notes["padded"][trunk] == {"N": [30, 32], "K": [19, 24]}
    assert result.notes["padded"][head] == {"N": [21, 21], "K": [30, 32]}
    assert GRAPH_OUTPUT_REASON in _reasons(result)[head]
    x = torch.randn(6, 19)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1.3e-6, atol=1e-5)


def test_head_with_computation_after_it_is_padded_under_the_rule():
    torch.manual_seed(0)
    model = _ComputedHead().eval()
    gm = zoo.capture(model, (torch.randn(4, 24),))

    result = pad_linear_dims(gm, NO_OUT)

    (head,) = _linears(gm)
    assert not returned_by_graph(next(n for n in gm.graph.nodes if n.name == head))
    assert result.notes["padded"][head] == {"N": [21, 24], "K": [24, 24]}
    x = torch.randn(5, 24)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1.3e-6, atol=1e-5)


def test_dict_output_both_heads_returned():
    """dict_output returns the head's logits and ReLU(trunk): only the head is a returned linear."""
    model, gm, entry = zoo.build("dict_output")

    result = pad_linear_dims(gm, NO_OUT)

    trunk, head = _linears(gm)
    assert result.notes["padded"][trunk] == {"N": [33, 40], "K": [23, 24]}
    assert result.notes["padded"][head] == {"N": [11, 11], "K": [33, 40]}
    assert GRAPH_OUTPUT_REASON in _reasons(result)[head]
    zoo.assert_matches_eager(model, gm, entry.example_inputs(4), "fp32")
