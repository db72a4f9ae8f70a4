"""Tests for passes.fuse_qkv (sibling linears -> one GEMM + split) and passes.fuse_epilogue (linear + ReLU /
tanh-GELU -> aten._addmm_activation)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zoo
from passes import PassSpec, fuse_epilogue, fuse_qkv, pad_linear_dims, run_pipeline

LINEAR = torch.ops.aten.linear.default
SPLIT = torch.ops.aten.split_with_sizes.default
ADDMM_ACT = torch.ops.aten._addmm_activation.default
HOPPER = PassSpec(arch="Hopper")


# ---------------------------------------------------------------------------------------------- fuse_qkv


def test_fuse_qkv_fuses_three_projections():
    model, gm, entry = zoo.build("attn", batch=3)
    keys = list(gm.state_dict())
    assert zoo.count_calls(gm, LINEAR) == 3

    result = fuse_qkv(gm, PassSpec())

    assert result.count == 1 and zoo.count_calls(gm, LINEAR) == 1 and zoo.count_calls(gm, SPLIT) == 1
    (fused,) = [n for n in gm.graph.nodes if n.target == LINEAR]
    assert fused.args[1].target == "q_k_v_fused_weight" and fused.args[2].target == "q_k_v_fused_bias"
    assert gm.get_buffer("q_k_v_fused_weight").shape == (96, 32)
    assert list(gm.state_dict()) == keys  # fused tensors are non-persistent buffers
    zoo.assert_matches_eager(model, gm, entry.example_inputs(6), "fp32")


def test_fuse_qkv_idempotent():
    model, gm, entry = zoo.build("attn")
    fuse_qkv(gm, PassSpec())
    code = gm.code

    again = fuse_qkv(gm, PassSpec())

    assert again.count == 0 and gm.code == code
    assert [s.reason for s in again.skipped] == ["only one linear reads this input"]
    zoo.assert_matches_eager(model, gm, entry.example_inputs(2), "fp32")


def test_fuse_qkv_training_keeps_gradients_on_original_parameters():
    model, gm, entry = zoo.build("attn")

    result = fuse_qkv(gm, PassSpec(training=True))

    assert result.count == 1 and zoo.count_calls(gm, torch.ops.aten.cat.default) == 2
    gm(*entry.example_inputs(4)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gm.parameters())


def test_fuse_qkv_fuses_a_bias_less_sibling_with_a_zero_bias_slice():
    """Whisper's key projection has no bias, its query and value projections have one: at inference all three
    fuse, the key's slice of the fused bias zero (exact), parity with eager on fresh inputs."""
    model, gm, entry = zoo.build("attn_v_nobias")

    result = fuse_qkv(gm, PassSpec())

    assert result.count == 1 and zoo.count_calls(gm, LINEAR) == 1 and not result.skipped
    (group,) = result.notes["groups"].values()
    assert len(group) == 3
    (fused,) = [n for n in gm.graph.nodes if n.target == LINEAR]
    bias = gm.get_buffer(fused.args[2].target)
    v_bias = dict(model.named_parameters()).get("v.bias")
    assert v_bias is None and bias.shape == (96,)
    assert not bias[64:].any() and bias[:64].abs().sum() > 0  # q, k with their biases; v's slice zero
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp32")


def test_fuse_qkv_skips_bias_mismatch_in_training():
    model, gm, entry = zoo.build("attn_v_nobias")

    result = fuse_qkv(gm, PassSpec(training=True))

    assert result.count == 1 and result.notes["groups"]
    assert [(s.node, s.reason) for s in result.skipped] == [("linear_2", "bias mismatch with sibling linears")]


def test_fuse_qkv_skips_only_one_linear():
    _, gm, _ = zoo.build("mlp_relu")

    result = fuse_qkv(gm, PassSpec())

    assert result.count == 0
    assert {s.reason for s in result.skipped} == {"only one linear reads this input"}


class _ComputedWeight(nn.Module):
    """Two linears on one input; one weight is computed in the graph (``w * 2``), not a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + nn.functional.linear(x, self.b.weight * 2, self.b.bias)


def test_fuse_qkv_skips_weight_not_parameter():
    torch.manual_seed(0)
    gm = zoo.capture(_ComputedWeight().eval(), (torch.randn(3, 8),))

    result = fuse_qkv(gm, PassSpec())

    assert result.count == 0
    reasons = sorted(s.reason for s in result.skipped)
    assert reasons == ["dtype or device differs from sibling linears", "weight is not a parameter"]


class _TransposedQKV(nn.Module):
    """Longformer's layout: q, k, v linears read ``x.transpose(0, 1)``, a ``(seq, batch, d)`` view of a
    ``(batch, seq, d)`` input, which cannot be folded to ``(tokens, d)`` rows without a copy."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(0, 1)
        return (self.q(h) * self.k(h) + self.v(h)).transpose(0, 1)


_MATMULS = {"mm": torch.ops.aten.mm.default, "addmm": torch.ops.aten.addmm.default, "bmm": torch.ops.aten.bmm.default}


def _matmul_calls(gm: torch.fx.GraphModule, inputs: tuple) -> dict[str, int]:
    """The GEMM ops ATen's decomposition of ``gm`` runs (``make_fx`` traces through ``aten.linear``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad():
        traced = make_fx(gm)(*inputs)
    return {name: zoo.count_calls(traced, op) for name, op in _MATMULS.items()}


def test_fuse_qkv_copies_a_transposed_shared_input_once():
    torch.manual_seed(0)
    model = _TransposedQKV().eval()
    gm = zoo.capture(model, (torch.randn(3, 10, 16),))
    for p in gm.parameters():  # frozen, as the backend stores weights (a weight requiring grad folds with a copy)
        p.requires_grad_(False)
    before = _matmul_calls(gm, (torch.randn(3, 10, 16),))

    result = fuse_qkv(gm, PassSpec())

    assert result.count == 1 and zoo.count_calls(gm, LINEAR) == 1
    (fused,) = [n for n in gm.graph.nodes if n.target == LINEAR]
    copy = fused.args[0]
    assert copy.target == torch.ops.aten.clone.default
    assert copy.kwargs == {"memory_format": torch.contiguous_format}
    assert copy.args[0].target == torch.ops.aten.transpose.int and copy.meta["val"].is_contiguous()
    assert list(result.notes["copied_inputs"]) == [fused.name]
    assert "not a row-major (tokens, K) view" in result.notes["copied_inputs"][fused.name]
    # Frozen weights: each unfused projection was a GEMM batched over the sequence with the weight broadcast;
    # the fused one is a single (tokens, d) x (d, 3d) GEMM.
    after = _matmul_calls(gm, (torch.randn(3, 10, 16),))
    assert before["bmm"] == 3 and before["mm"] + before["addmm"] == 0
    assert after["bmm"] == 0 and after["mm"] + after["addmm"] == 1
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 10, 16),), "fp32")  # another (dynamic) batch


def test_fuse_qkv_reads_a_row_major_shared_input_in_place():
    model, gm, entry = zoo.build("attn")
    x = next(n for n in gm.graph.nodes if n.target == LINEAR).args[0]

    result = fuse_qkv(gm, PassSpec())

    (fused,) = [n for n in gm.graph.nodes if n.target == LINEAR]
    assert result.count == 1 and fused.args[0] is x and "copied_inputs" not in result.notes
    assert zoo.count_calls(gm, torch.ops.aten.clone.default) == 0
    zoo.assert_matches_eager(model, gm, entry.example_inputs(4), "fp32")


# ------------------------------------------------------------------------------------------ fuse_epilogue


def test_fuse_epilogue_fuses_relu():
    model, gm, entry = zoo.build("mlp_relu", batch=3)
    keys = list(gm.state_dict())

    result = fuse_epilogue(gm, PassSpec())

    assert result.count == 1 and result.notes["activations"] == {result.changed[0]: "relu"}
    assert zoo.count_calls(gm, ADDMM_ACT) == 1 and zoo.count_calls(gm, torch.ops.aten.relu.default) == 0
    assert list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(6), "fp32")


def test_fuse_epilogue_looks_through_pad_linear_slice():
    model, gm, entry = zoo.build("mlp_relu", batch=3)
    pad_linear_dims(gm, PassSpec(precision="fp16", alignment=zoo.ALIGNMENT))  # 61 -> 64: linear -> slice -> relu

    result = fuse_epilogue(gm, PassSpec(precision="fp16", alignment=zoo.ALIGNMENT))

    assert result.count == 1
    (act,) = [n for n in gm.graph.nodes if n.target == ADDMM_ACT]
    assert act.args[2].args[0].target == "fc1.weight" and gm.fc1.weight.shape == (64, 40)  # padding kept
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp32")


def test_fuse_epilogue_skips_gelu_tanh_planned_on_a_cpu_graph():
    """A GPU target (--target h100) on a graph that runs on the CPU: the CPU kernel is erf GELU, so no fusion."""
    _, gm, _ = zoo.build("mlp_gelu_tanh")

    result = fuse_epilogue(gm, HOPPER)

    assert result.count == 0
    assert any("CPU tensor" in s.reason for s in result.skipped)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (cuBLASLt GELU epilogue)")
def test_fuse_epilogue_fuses_gelu_tanh_on_cuda_with_parity():
    model, _, entry = zoo.build("mlp_gelu_tanh")
    model = model.cuda()
    gm = zoo.capture(model, tuple(t.cuda() for t in entry.example_inputs(3)))

    result = fuse_epilogue(gm, HOPPER)

    assert result.count == 1 and result.notes["activations"] == {result.changed[0]: "gelu_tanh"}
    (act,) = [n for n in gm.graph.nodes if n.target == ADDMM_ACT]
    assert act.kwargs == {"use_gelu": True}
    x = entry.example_inputs(6)[0].cuda()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-4, atol=1e-4)  # TF32 off by default for matmul


def test_fuse_epilogue_skips_gelu_tanh_on_cpu():
    _, gm, _ = zoo.build("mlp_gelu_tanh")

    result = fuse_epilogue(gm, PassSpec(arch="cpu"))

    assert result.count == 0
    assert [s.reason for s in result.skipped] == ["gelu tanh on CPU: aten._addmm_activation computes erf GELU there"]


def test_fuse_epilogue_skips_exact_gelu():
    _, gm, _ = zoo.build("mlp_gelu")

    result = fuse_epilogue(gm, HOPPER)

    assert result.count == 0
    assert "the cuBLASLt GELU epilogue is the tanh approximation" in result.skipped[0].reason


def test_fuse_epilogue_skips_training():
    _, gm, _ = zoo.build("mlp_relu")

    result = fuse_epilogue(gm, PassSpec(arch="Hopper", training=True))

    assert result.count == 0
    assert result.skipped[0].reason == "training: aten._addmm_activation has no autograd derivative"


def test_fuse_epilogue_skips_linear_without_bias():
    _, gm, _ = zoo.build("mlp_relu_nobias")

    result = fuse_epilogue(gm, HOPPER)

    assert result.count == 0
    assert result.skipped[0].reason == "linear has no bias (the epilogue op needs one)"


def test_fuse_epilogue_idempotent():
    model, gm, entry = zoo.build("mlp_relu")
    fuse_epilogue(gm, HOPPER)
    code = gm.code

    again = fuse_epilogue(gm, HOPPER)

    assert again.count == 0 and gm.code == code
    zoo.assert_matches_eager(model, gm, entry.example_inputs(2), "fp32")


# ----------------------------------------------------------------------------------------------- pipeline


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["mlp_relu", "attn_v_nobias"])
def test_run_pipeline_fusions_low_precision(name, precision):
    model, gm, entry = zoo.build(name, batch=3)
    keys = list(gm.state_dict())
    spec = PassSpec(precision=precision, alignment=zoo.ALIGNMENT, arch="Hopper")

    first = {r.name: r.count for r in run_pipeline(gm, spec)}

    assert first["fuse_epilogue"] + first["fuse_qkv"] + first["fuse_attention"] >= 1
    assert list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), precision)
    assert all(r.count == 0 for r in run_pipeline(gm, spec))


class _ChunkedQKV(nn.Module):
    """q, k, v of one input, each read in overlapping chunks through ``as_strided`` with strides computed from
    the projection's output (Longformer's ``_chunk``)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    @staticmethod
    def _chunk(h: torch.Tensor, w: int) -> torch.Tensor:
        h = h.view(h.size(0), h.size(1) // (2 * w), 2 * w, h.size(2))
        size, stride = list(h.size()), list(h.stride())
        size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
        return h.as_strided(size=size, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self._chunk(self.q(x) / 4.0, 2), self._chunk(self.k(x), 2)
        scores = torch.einsum("bcxd,bcyd->bcxy", q, k)
        return scores.sum(-1, keepdim=True) * self._chunk(self.v(x), 2)


def test_fuse_qkv_refuses_outputs_read_through_as_strided():
    torch.manual_seed(0)
    model = _ChunkedQKV().eval()
    gm = zoo.capture(model, (torch.randn(3, 8, 16),))

    result = fuse_qkv(gm, PassSpec())

    assert result.count == 0 and zoo.count_calls(gm, LINEAR) == 3
    assert len(result.skipped) == 3
    assert all("through aten.as_strided with strides fixed at capture" in s.reason for s in result.skipped)
    zoo.assert_matches_eager(model, gm, (torch.randn(5, 8, 16),), "fp32")


# ------------------------------------------------- fuse_epilogue: Conv1D addmm + written-out tanh GELU (GPT-2)


def _reference_interpret(gm: torch.fx.GraphModule, *args):
    """Run ``gm`` with ``_addmm_activation(use_gelu=True)`` computed as the CUDA epilogue does (tanh GELU), so
    the rewrite's structure can be checked for parity on the CPU, where the op computes erf GELU."""

    class Ref(torch.fx.Interpreter):
        def call_function(self, target, a, kw):
            if target == ADDMM_ACT:
                y = torch.addmm(*a[:3])
                return torch.nn.functional.gelu(y, approximate="tanh") if kw.get("use_gelu") else torch.relu(y)
            return super().call_function(target, a, kw)

    with torch.no_grad():
        return Ref(gm).run(*args)


def _as_if_on_cuda(monkeypatch):
    """The tanh-GELU epilogue is fused only for CUDA tensors; the CPU tests check the rewrite's structure."""
    import sys

    monkeypatch.setattr(sys.modules["passes.fuse_epilogue"], "_on_cuda", lambda node: True)


def _new_gelu(y: torch.Tensor) -> torch.Tensor:
    """transformers' ``NewGELUActivation`` (``"gelu_new"``), the tanh approximation written out op by op."""
    import math

    return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))


class Conv1DGelu(nn.Module):
    """transformers' GPT-2 MLP written out: ``Conv1D`` (``addmm(b, x2d, W (K, N))`` + view) and NewGELU."""

    def __init__(self, k: int = 24, n: int = 40, extra_use: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(k, n) / k ** 0.5)
        self.b = nn.Parameter(torch.randn(n))
        self.proj = nn.Linear(n, 8)
        self.extra_use = extra_use

    def forward(self, x):
        y = torch.addmm(self.b, x.view(-1, x.size(-1)), self.w).view(*x.shape[:-1], -1)
        out = self.proj(_new_gelu(y))
        return (out, y.sum()) if self.extra_use else out


class LinearNewGelu(nn.Module):
    """GPT-Neo / GPT-J's MLP: ``nn.Linear`` whose output feeds the written-out tanh GELU directly (three users)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(24, 40)
        self.proj = nn.Linear(40, 8)

    def forward(self, x):
        return self.proj(_new_gelu(self.fc(x)))


def test_fuse_epilogue_fuses_gpt2_conv1d_and_new_gelu(monkeypatch):
    pytest.importorskip("transformers")
    _as_if_on_cuda(monkeypatch)
    model, gm, entry = zoo.build("gpt2", batch=2)
    assert zoo.count_calls(gm, torch.ops.aten.tanh.default) == 2

    result = fuse_epilogue(gm, HOPPER)

    assert result.count == 2 and set(result.notes["activations"].values()) == {"gelu_tanh"}
    assert zoo.count_calls(gm, torch.ops.aten.tanh.default) == 0 and zoo.count_calls(gm, ADDMM_ACT) == 2
    for node in (n for n in gm.graph.nodes if n.target == ADDMM_ACT):
        assert node.args[2].target.endswith("mlp.c_fc.weight") and node.kwargs == {"use_gelu": True}
    ids = entry.example_inputs(3)[0]  # fresh inputs at another batch size
    with torch.no_grad():
        torch.testing.assert_close(_reference_interpret(gm, ids), model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [lambda: Conv1DGelu(), lambda: LinearNewGelu()], ids=["conv1d_view", "linear"])
def test_fuse_epilogue_written_out_gelu_on_a_plain_module(make, monkeypatch):
    """GPT-2's Conv1D (addmm + view, then the formula) and GPT-Neo's nn.Linear feeding the formula directly."""
    _as_if_on_cuda(monkeypatch)
    model = make().eval()
    gm = zoo.capture(model, (torch.randn(3, 5, 24),))

    result = fuse_epilogue(gm, HOPPER)

    assert result.count == 1 and zoo.count_calls(gm, torch.ops.aten.pow.Tensor_Scalar) == 0
    assert zoo.count_calls(gm, torch.ops.aten.tanh.default) == 0
    (node,) = [n for n in gm.graph.nodes if n.target == ADDMM_ACT]
    assert node.kwargs == {"use_gelu": True}
    x = torch.randn(4, 5, 24)  # fresh inputs at another batch size (the capture's dynamic dimension)
    with torch.no_grad():
        torch.testing.assert_close(_reference_interpret(gm, x), model(x), rtol=1e-5, atol=1e-5)


def test_fuse_epilogue_leaves_a_gemm_whose_output_is_also_read_elsewhere(monkeypatch):
    _as_if_on_cuda(monkeypatch)
    gm = zoo.capture(Conv1DGelu(extra_use=True).eval(), (torch.randn(3, 5, 24),))
    code = gm.code

    result = fuse_epilogue(gm, HOPPER)

    assert result.count == 0 and gm.code == code


def test_fuse_epilogue_new_gelu_on_cpu_is_skipped_with_the_reason():
    gm = zoo.capture(Conv1DGelu().eval(), (torch.randn(3, 5, 24),))

    result = fuse_epilogue(gm, HOPPER)

    assert result.count == 0
    assert [s.reason for s in result.skipped] == ["gelu tanh on a CPU tensor: aten._addmm_activation computes erf "
                                                  "GELU there"]


def test_fuse_epilogue_at_fp8_fuses_only_the_gemms_the_keep_list_keeps_bf16(monkeypatch):
    pytest.importorskip("transformers")
    _as_if_on_cuda(monkeypatch)
    fp8 = PassSpec(arch="Hopper", precision="fp8")
    _, gm, _ = zoo.build("gpt2", batch=2)
    left = fuse_epilogue(gm, fp8)
    assert left.count == 0 and {s.reason for s in left.skipped} == {
        "precision fp8: left for cast_fp8_linears (an FP8 GEMM beats the bf16 epilogue)"}

    _, gm, _ = zoo.build("gpt2", batch=2)
    kept = fuse_epilogue(gm, PassSpec(arch="Hopper", precision="fp8", fp8_keep=("gpt2.transformer.h.0.mlp.c_fc",)))
    assert kept.count == 1 and len(kept.skipped) == 1
    (node,) = [n for n in gm.graph.nodes if n.target == ADDMM_ACT]
    assert node.args[2].target == "gpt2.transformer.h.0.mlp.c_fc.weight"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (cuBLASLt GELU epilogue)")
def test_fuse_epilogue_gpt2_on_cuda_with_parity():
    pytest.importorskip("transformers")
    model, _, entry = zoo.build("gpt2")
    model = model.cuda()
    gm = zoo.capture(model, tuple(t.cuda() for t in entry.example_inputs(3)))

    result = fuse_epilogue(gm, HOPPER)

    assert result.count == 2
    ids = entry.example_inputs(4)[0].cuda()
    with torch.no_grad():
        torch.testing.assert_close(gm(ids), model(ids), rtol=1e-4, atol=1e-4)
