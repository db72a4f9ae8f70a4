"""The backend on architectures outside the recipes: ops with no bf16 kernel (FNet's FFT) and frozen batch norms
(detection backbones) compile through tctune's passes with no fallback and match eager. CPU (Inductor's C++
backend), tiny models."""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tctune.backend as tb
from zoo import TOLERANCES


from zoo import fresh_backend as _fresh  # noqa: E402,F401 - autouse: every test starts with no compiled graph


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def _results(name: str):
    return [r for rep in tb.reports for r in rep.results if r.name == name]


class FNetLayer(nn.Module):
    """Hugging Face FNet's encoder layer, tiny: FFT mixing over (sequence, hidden), residual, norm, feed-forward."""

    def __init__(self, vocab: int = 50, hidden: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.norm1 = nn.LayerNorm(hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, 48), nn.GELU(), nn.Linear(48, hidden))
        self.norm2 = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        h = self.norm1(torch.fft.fftn(h, dim=(1, 2)).real + h)
        h = self.norm2(self.ff(h) + h)
        return self.head(h)


@pytest.mark.parametrize("policy", ["pure", "autocast"])
def test_fft_model_compiles_at_bf16_without_fallback(policy):
    torch.manual_seed(0)
    model = FNetLayer().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16", "policy": policy},
                             dynamic=False)
    torch.manual_seed(5)
    ids = torch.randint(0, 50, (3, 10))
    with torch.no_grad():
        got, ref = compiled(ids), model(ids)
    assert tb.reports and all(not rep.fallback for rep in tb.reports), [rep.fallback for rep in tb.reports]
    (cast,) = _results("cast_precision")
    assert cast.count > 0  # the linears run bf16
    (reason,) = cast.notes["no_low_precision_kernel"].values()
    assert "FFT has no bf16 kernel" in reason
    assert any(s.reason.startswith("no low-precision kernel: fft_fftn stays FP32") for s in cast.skipped)
    assert got.dtype == ref.dtype and torch.isfinite(got).all()
    assert _rel(got, ref) <= TOLERANCES["bf16"]["rel_l2"]


class FrozenBatchNorm2d(nn.Module):
    """torchvision.ops.misc.FrozenBatchNorm2d's forward: buffers ``weight``, ``bias``, ``running_mean``,
    ``running_var`` of shape ``(C,)``; ``x * scale + bias`` computed from them on every call."""

    def __init__(self, n: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.register_buffer("weight", torch.rand(n) + 0.5)
        self.register_buffer("bias", torch.randn(n) * 0.2)
        self.register_buffer("running_mean", torch.randn(n) * 0.5)
        self.register_buffer("running_var", torch.rand(n) + 0.5)
        self.eps = eps

    def forward(self, x):
        w = self.weight.reshape(1, -1, 1, 1)
        b = self.bias.reshape(1, -1, 1, 1)
        rv = self.running_var.reshape(1, -1, 1, 1)
        rm = self.running_mean.reshape(1, -1, 1, 1)
        scale = w * (rv + self.eps).rsqrt()
        bias = b - rm * scale
        return x * scale + bias


def _frozen_bn_class():
    """torchvision's own class when torchvision is installed, else the same forward written out above."""
    try:
        from torchvision.ops.misc import FrozenBatchNorm2d as TV
    except ImportError:
        return FrozenBatchNorm2d

    def make(n: int) -> nn.Module:
        bn = TV(n)
        with torch.no_grad():  # random statistics, not the identity it starts as
            bn.weight.copy_(torch.rand(n) + 0.5)
            bn.bias.copy_(torch.randn(n) * 0.2)
            bn.running_mean.copy_(torch.randn(n) * 0.5)
            bn.running_var.copy_(torch.rand(n) + 0.5)
        return bn

    return make


class Backbone(nn.Module):
    """A detection-backbone stem and bottleneck: conv -> FrozenBN -> ReLU, twice, with a residual add."""

    def __init__(self) -> None:
        super().__init__()
        bn = _frozen_bn_class()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = bn(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.bn2 = bn(16)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + h)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_frozen_batchnorm_is_folded_through_the_backend(precision):
    torch.manual_seed(0)
    model = Backbone().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": precision}, dynamic=False)
    torch.manual_seed(9)
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        got, ref = compiled(x), model(x)
    assert tb.reports and all(not rep.fallback for rep in tb.reports), [rep.fallback for rep in tb.reports]
    (fold,) = _results("fold_conv_batchnorm")
    assert fold.count == 2, (fold.skipped, fold.notes)
    assert len(fold.notes["folded_affine"]) == 2
    if precision == "fp32":
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    else:
        assert _rel(got, ref) <= TOLERANCES["bf16"]["rel_l2"]


# ------------------------------------------------------------------------------------------------ zoo sweep


def _bench_zoo():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "zoo.py"
    name = "tctune_bench_zoo"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return sys.modules[name]


#: Architectures of the Hugging Face suite that differ in what the passes meet: FFT mixing (FNet), einsum
#: relative attention (XLNet), disentangled attention (DeBERTa-v2), convolutions (ConvBERT, Whisper), logit
#: soft-capping (Gemma 2), a mixture of experts (gpt-oss), T5's relative buckets and RMSNorm.
SWEEP = ("GoogleFnet", "XLNetLMHeadModel", "DebertaV2ForMaskedLM", "YituTechConvBert", "openai/whisper-tiny",
         "google/gemma-2-2b", "openai/gpt-oss-20b", "T5Small")


@pytest.mark.slow  # about 10 s a model on two shared cores
@pytest.mark.parametrize("name", SWEEP)
def test_tiny_zoo_models_run_tctunes_graph_without_fallback(name, monkeypatch):
    """Capture and every pass of the backend's pipeline on the zoo's tiny configs at bf16 ("pure"), no fallback,
    error consistent with ``model.to(bf16)`` (the zoo's rule) or within the bf16 tolerance where that cannot
    run. Inductor's code generation is replaced by running the rewritten graph (its C++ compile of each model
    would take minutes here; test_backend.py covers Inductor compiling tctune's graphs)."""
    pytest.importorskip("transformers")
    zoo_bench = _bench_zoo()
    monkeypatch.setattr(tb, "inductor_compile", lambda gm, example_inputs, config_patches: gm.forward)
    built = zoo_bench.build(zoo_bench.all_entries()[name], tiny=True)
    inputs = built.make_inputs(2, "cpu", 3)
    with torch.no_grad():
        ref = built.model(*inputs)
        got = torch.compile(built.model, backend="tctune", options={"precision": "bf16", "policy": "pure"})(*inputs)
    assert tb.reports and all(not rep.fallback for rep in tb.reports), [rep.fallback for rep in tb.reports]
    assert sum(r.count for r in _results("cast_precision")) > 0
    assert got.dtype == ref.dtype and torch.isfinite(got).all()
    try:
        with torch.no_grad():
            low = built.model.to(torch.bfloat16)(*[x.to(torch.bfloat16) if x.is_floating_point() else x
                                                   for x in inputs])
        limit = zoo_bench.ACC_FACTOR * _rel(low, ref) + zoo_bench.ACC_ABS
    except RuntimeError:  # model.to(bf16) cannot run (FNet's FFT has no bf16 kernel)
        limit = TOLERANCES["bf16"]["rel_l2"]
    assert _rel(got, ref) <= limit


@pytest.mark.parametrize("output_dtype", ["fp32", "compute"])
def test_fallback_keeps_ops_without_a_low_precision_kernel_fp32(monkeypatch, output_dtype):
    """The plain fallback (a pass raised) casts Dynamo's graph like model.to(bf16), where torch.fft.fftn has no
    bf16 kernel: the FFT reads FP32 and its result is cast back to bf16 where a real value of it is read, so the
    linears still run bf16 and the fallback never drops to the FP32 graph."""
    def boom(gm, spec, names=(), seconds=None):  # run_pipeline's signature
        raise RuntimeError("injected pass failure")

    graphs: list[torch.fx.GraphModule] = []

    def eager(gm, example_inputs, config_patches):  # what reaches Inductor is under test, not Inductor
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(tb, "run_pipeline", boom)
    monkeypatch.setattr(tb, "inductor_compile", eager)
    torch.manual_seed(0)
    model = FNetLayer().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16", "output_dtype": output_dtype},
                             dynamic=False)
    torch.manual_seed(6)
    ids = torch.randint(0, 50, (3, 10))
    with torch.no_grad():
        got, ref = compiled(ids), model(ids)
    (rep,) = tb.reports
    assert "injected pass failure" in rep.fallback
    assert rep.notes[0] == "fallback compiled at bf16, cast like model.to(dt)", rep.notes
    assert len(rep.notes) == 2 and rep.notes[1].startswith("fallback kept FP32 (no low-precision kernel): ")
    assert "fft_fftn" in rep.notes[1] and "FFT has no bf16 kernel" in rep.notes[1]
    (g,) = graphs
    fft = next(n for n in g.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "") == "fft_fftn")
    (src,) = fft.all_input_nodes
    assert src.op == "call_method" and src.target == "to" and src.args[1] == torch.float32  # FP32 into the FFT
    linears = [n for n in g.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "") == "linear"]
    assert len(linears) == 3
    assert got.dtype == (torch.bfloat16 if output_dtype == "compute" else torch.float32)
    assert torch.isfinite(got).all() and _rel(got, ref) <= TOLERANCES["bf16"]["rel_l2"]
    assert not torch.allclose(got.float(), ref, rtol=1e-5, atol=1e-6)  # bf16 numbers, not the FP32 graph


# ------------------------------------------------------------------------------------------------ behaviors
# What bug reports about compiler backends are made of (benchmarks/NOTES.md, 2026-12-02, eleventh session):
# writes in place, int and float arguments, torch.autocast in forward, float64 submodules, restart signals.
# Inductor's code generation is replaced by AOT autograd without it (``aot_eager``): functionalization, the
# copy back of writes to inputs and buffers and the output aliasing are Inductor's own, the C++ compile is not.


@pytest.fixture
def aot_only(monkeypatch):
    from torch._dynamo.backends.debugging import aot_eager

    monkeypatch.setattr(tb, "inductor_compile", lambda gm, example_inputs, config_patches: aot_eager(
        gm, list(example_inputs)))


def _no_fallback():
    assert tb.reports and all(not rep.fallback for rep in tb.reports), [rep.fallback for rep in tb.reports]


def _close(got, ref, precision):
    if precision == "fp32":
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    else:
        assert got.dtype == ref.dtype and _rel(got, ref) <= TOLERANCES[precision]["rel_l2"], _rel(got, ref)


class KVCache(nn.Module):
    """One decoding step of attention with a KV cache in buffers, written with ``index_copy_`` and by slice
    assignment, and a call counter (an int64 buffer) updated with ``+=``."""

    def __init__(self, d: int = 16, slots: int = 6) -> None:
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)
        self.register_buffer("k", torch.zeros(2, slots, d), persistent=False)
        self.register_buffer("v", torch.zeros(2, slots, d), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x, pos):
        k, v = self.kv(x).chunk(2, dim=-1)
        self.k.index_copy_(1, pos, k)
        self.v[:, pos] = v
        self.steps += 1
        att = (self.q(x) @ self.k.transpose(1, 2)).softmax(-1)
        return self.o(att @ self.v)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_kv_cache_written_in_place_matches_eager(precision, aot_only):
    """The cache buffers are written at every step; frozen, tctune's passes cast a snapshot of them and the
    writes landed in the bf16 copy (relative error 1 at bf16, the fp16 calibration run wrote them a second
    time). Written buffers are now runtime inputs and cast_precision keeps written tensors in their dtype."""
    torch.manual_seed(0)
    model = KVCache().eval()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tctune", options={"precision": precision}, dynamic=False)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for step in range(3):
            x, pos = torch.randn(2, 1, 16, generator=g), torch.tensor([step])
            _close(compiled(x, pos), eager(x, pos), precision)
    _no_fallback()
    for name in ("k", "v"):
        _close(getattr(model, name), getattr(eager, name), precision)
        assert getattr(model, name)[:, 3:].eq(0).all()  # slots not reached yet stay empty
    assert model.steps.item() == eager.steps.item() == 3
    # named as the model names them (the note said "w1_l_self_buffers_k_")
    assert "written in place, passed at every call (not frozen): k, v, steps" in tb.reports[0].notes
    if precision != "fp32":
        cast = _results("cast_precision")[0]
        assert cast.count > 0  # the linears still run low
        assert any(s.reason == "written in place: index_copy_ keeps its dtype" for s in cast.skipped), cast.skipped


class AddToInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, out):
        x.mul_(2.0)
        out.copy_(self.fc(x))
        return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_inputs_written_in_place_keep_the_write(precision, aot_only):
    """``x.mul_(2)`` and ``out.copy_(...)`` on the caller's tensors: the write went to a cast copy, the caller's
    ``x`` stayed unchanged and ``out`` held garbage. Now both hold eager's values and ``out`` is returned."""
    torch.manual_seed(0)
    model = AddToInput().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": precision})
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 8, generator=g)
    x_ref, out, out_ref = x.clone(), torch.empty(3, 8), torch.empty(3, 8)
    with torch.no_grad():
        got = compiled(x, out)
        model(x_ref, out_ref)
    _no_fallback()
    torch.testing.assert_close(x, x_ref, rtol=0, atol=0)  # the write is exact: x * 2, in FP32
    assert got is out
    _close(out, out_ref, precision)


class BNTrain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_batchnorm_in_train_mode_without_grad_updates_the_statistics_once(aot_only):
    """A BatchNorm left in train mode, called under ``no_grad`` at fp16: the overflow calibration run updated the
    running statistics as well as the call (momentum applied twice)."""
    torch.manual_seed(0)
    model = BNTrain().train()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tctune", options={"precision": "fp16"})
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 3, 6, 6, generator=g)
            _close(compiled(x), eager(x), "fp16")
    _no_fallback()
    assert model.bn.num_batches_tracked.item() == 2
    _close(model.bn.running_var, eager.bn.running_var, "fp16")
    _close(model.bn.running_mean, eager.bn.running_mean, "fp16")


class Scalars(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, scale: float, n: int):
        return self.fc(x) * scale + n


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_python_float_and_int_arguments(precision, aot_only):
    """A Python float reaches the backend as a 0-dim float64 tensor: taken as the widest dtype, the activations
    were cast up to float64 in front of an FP32 linear (an error at fp32, a fallback at bf16). An int argument
    that changes between calls becomes a SymInt tied to no tensor's size ("size input s86 is not a dimension of
    any runtime tensor input", a fallback). Both now pass through tctune's graph, and the float is not rounded."""
    torch.manual_seed(0)
    model = Scalars().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": precision})
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for scale, n in ((0.5, 3), (0.7, 4), (1.0 / 3, 5)):
            x = torch.randn(3, 8, generator=g)
            _close(compiled(x, scale, n), model(x, scale, n), precision)
    _no_fallback()
    assert len(tb.reports) >= 2  # the int changed: Dynamo recompiled with it dynamic


class Float64Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4).double()

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)).double())


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_float64_submodule(precision, aot_only):
    torch.manual_seed(0)
    model = Float64Head().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": precision})
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got, ref = compiled(x), model(x)
    _no_fallback()
    assert got.dtype == torch.float64
    _close(got, ref, precision)


class AutocastInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.a(x))
        return self.b(h.float())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_autocast_region_in_forward(precision, aot_only):
    """export records the autocast region's output as FP32 and checks it before ``.float()``
    (``_assert_tensor_metadata``): "Tensor dtype mismatch! Expected: torch.float32, Got: torch.bfloat16" and a
    fallback at every precision, whose bf16 cast then failed at run time. The checks are dropped now."""
    torch.manual_seed(0)
    model = AutocastInside().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": precision})
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got, ref = compiled(x), model(x)
    _no_fallback()
    _close(got, ref, "bf16")  # the region runs bf16 in eager too


class ItemBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if h.sum().item() > 0:  # data-dependent: a graph break
            h = h * 2
        return self.b(h)


def test_dynamo_restart_is_not_a_fallback(aot_only):
    """AOT autograd asks Dynamo to retrace a graph whose Python float it cannot tensorify
    (``TensorifyScalarRestartAnalysis``); caught as a tctune failure, that subgraph fell back to plain Inductor."""
    torch.manual_seed(0)
    model = ItemBreak().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"})
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 16, generator=g)
            _close(compiled(x), model(x), "bf16")
    _no_fallback()


class ReturnsInputViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x[:, :4], x.view(-1), self.fc(x), self.fc.weight.t()


def test_returned_views_of_an_input_are_exact_views(aot_only):
    """At bf16 a returned ``x[:, :4]`` came back as a new tensor holding x rounded to bf16, and a returned
    ``weight.t()`` as the bf16 copy of the weight cast back up."""
    torch.manual_seed(0)
    model = ReturnsInputViews().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"})
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a, b, c, w = compiled(x)
    _no_fallback()
    assert torch.equal(a, x[:, :4]) and torch.equal(b, x.view(-1)) and torch.equal(w, model.fc.weight.t())
    assert a.data_ptr() == x.data_ptr() and b.data_ptr() == x.data_ptr()
    _close(c, model.fc(x), "bf16")
    assert _results("cast_precision")[0].count > 0


def test_fallback_of_a_graph_that_writes_in_place_compiles_it_uncast(monkeypatch, aot_only):
    """When tctune's part fails on a graph that writes an input, the fallback does not cast it like
    ``model.to(bf16)`` (the write would land in the cast copy): it compiles the graph as written, with a note."""
    def boom(gm, spec, names=(), seconds=None):  # run_pipeline's signature
        raise RuntimeError("injected pass failure")

    monkeypatch.setattr(tb, "run_pipeline", boom)
    torch.manual_seed(0)
    model = AddToInput().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"})
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    x_ref, out, out_ref = x.clone(), torch.empty(3, 8), torch.empty(3, 8)
    with torch.no_grad():
        compiled(x, out)
        model(x_ref, out_ref)
    (rep,) = tb.reports
    assert "injected pass failure" in rep.fallback
    assert rep.notes == ["fallback compiled in the model's own dtypes, not at bf16: the graph writes tensors in "
                         "place"]
    torch.testing.assert_close(x, x_ref, rtol=0, atol=0)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: F.gelu(self.a(t)), x, use_reentrant=False)
        return self.b(h)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_activation_checkpointing_in_training(precision, monkeypatch):
    """Vanilla ``torch.utils.checkpoint`` under the backend in training: the re-export raised
    ``KeyError: '_checkpoint_context_fn'`` (torch's pre-dispatch tracing of the checkpoint HOP reads a key Dynamo
    only sets for selective checkpointing), so every such graph fell back to plain Inductor. At bf16 the
    region's ops are cast inside it; at fp16 it stays FP32 (the calibration sees it as one node)."""
    from torch._dynamo.backends.debugging import aot_eager

    graphs: list[torch.fx.GraphModule] = []

    def spy(gm, example_inputs, config_patches):
        graphs.append(gm)
        return aot_eager(gm, list(example_inputs))

    monkeypatch.setattr(tb, "inductor_compile", spy)
    torch.manual_seed(0)
    model = Checkpointed().train()
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="tctune", options={"precision": precision})
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
    out, ref = compiled(x), eager(x)
    _close(out, ref, precision)
    out.square().sum().backward()
    ref.square().sum().backward()
    _no_fallback()
    assert tb.reports[-1].training
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None, name
        _close(p.grad, q.grad, precision)
    # The checkpointed region is still one (recomputed in the backward), and vanilla: no context_fn left behind.
    hop = torch.ops.higher_order.tag_activation_checkpoint
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is hop]
    assert len(calls) == 1
    assert "_checkpoint_context_fn" not in getattr(gm, str(calls[0].args[0].target)).meta
    inside = [n for r in _results("cast_precision") for n in r.changed if n.startswith(calls[0].name + ".")]
    if precision == "bf16":
        assert inside, _results("cast_precision")[0].changed  # the region's linear and GELU run bf16
    else:
        assert not inside
    if precision == "fp16":
        (cast,) = _results("cast_precision")
        assert any(s.reason.startswith("checkpointed region: not cast at fp16") for s in cast.skipped)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("dynamic", [False, True])
def test_evaluation_after_optimizer_steps_reads_the_new_weights(dynamic, aot_only):
    """Train through the compiled module, then evaluate it under ``no_grad``, every epoch: the inference graph
    froze the first evaluation's weights (stored bf16), and later evaluations kept using them (relative error
    0.39 at the second epoch). An optimizer step now makes the next inference call compile again."""
    torch.manual_seed(0)
    model = _MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"}, dynamic=dynamic)
    g = torch.Generator().manual_seed(1)
    for epoch in range(3):
        x = torch.randn(4, 16, generator=g)
        model.train()
        opt.zero_grad()
        compiled(x).square().mean().backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            for batch in (4, 6):
                x = torch.randn(batch, 16, generator=g)
                _close(compiled(x), model(x), "bf16")
    _no_fallback()
    again = [rep for rep in tb.reports if rep.notes and rep.notes[0].startswith("compiled again: ")]
    assert len(again) >= 2 and all(not rep.training for rep in again)
    # No optimizer step, no new compile: a further evaluation reuses the graph.
    before = len(tb.reports)
    with torch.no_grad():
        x = torch.randn(4, 16, generator=g)
        _close(compiled(x), model(x), "bf16")
    assert len(tb.reports) == before


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_replaced_parameter_is_read_after_the_replacement(precision, aot_only):
    """``model.a.weight = nn.Parameter(w)`` after an inference compile: the graph kept the old (frozen) weight at
    every precision (relative error 0.93). Assigning a parameter now makes the next call compile again."""
    torch.manual_seed(0)
    model = _MLP().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": precision})
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        x = torch.randn(4, 16, generator=g)
        _close(compiled(x), model(x), precision)
        replaced = weakref.ref(model.a.weight)
        model.a.weight = nn.Parameter(torch.randn(32, 16, generator=g) / 4)
        x = torch.randn(4, 16, generator=g)
        _close(compiled(x), model(x), precision)
    _no_fallback()
    assert tb.reports[-1].notes[0].startswith("compiled again: frozen weights changed")
    gc.collect()
    assert replaced() is None  # the graph of the replaced weight is not kept (its weight held weakly)


def _inject_pass_failure(monkeypatch):
    def boom(gm, spec, names=(), seconds=None):  # run_pipeline's signature
        raise RuntimeError("injected pass failure")

    monkeypatch.setattr(tb, "run_pipeline", boom)


def test_fallback_that_model_to_cannot_run_compiles_under_autocast(monkeypatch, aot_only):
    """The fallback casts Dynamo's graph like ``model.to(bf16)``; a model that converts a value to FP32 itself
    before a linear (``self.b(h.float())``) cannot run so ("mat1 and mat2 must have the same dtype"). The cast
    graph is run once on the first call's inputs; when it fails, the FP32 graph runs under
    ``torch.autocast(bf16)`` (which casts both operands), still at the requested precision, not in FP32."""
    _inject_pass_failure(monkeypatch)
    torch.manual_seed(0)
    model = AutocastInside().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"})
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 16, generator=g)
            _close(compiled(x), model(x), "bf16")
    (rep,) = tb.reports
    assert "injected pass failure" in rep.fallback
    assert rep.notes == ["fallback at bf16 failed (cast like model.to(dt): RuntimeError: mat1 and mat2 must have "
                         "the same dtype, but got Float and BFloat16)",
                         "fallback compiled at bf16, under torch.autocast(dt)"], rep.notes


class DtypeReadInForward(nn.Module):
    """GPT-Neo's attention, reduced: scores in FP32 (``q.float()``), a mask filled with
    ``torch.finfo(scores.dtype).min`` and the weights cast back with ``.to(v.dtype)``. Dynamo traces the FP32
    model, so both dtypes are baked into its graph as float32: cast like ``model.to(bf16)`` the graph multiplies
    FP32 weights with bf16 values; under autocast the bf16 scores meet the FP32 minimum."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q.float() @ k.float().transpose(-1, -2)
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        w = scores.softmax(-1).to(v.dtype)
        return self.out(w @ v)


@pytest.mark.parametrize("output_dtype", ["fp32", "compute"])
def test_fallback_of_dtypes_read_in_forward_stays_at_bf16(monkeypatch, aot_only, output_dtype):
    """The fallback's graph of a model that reads dtypes in forward, at bf16: the ``finfo(float32).min`` fill
    saturates to bf16's range and autocast runs the matmuls; the result matches the FP32 model at bf16's
    tolerance (not the model's own FP32 graph: that was 10x slower than plain Inductor at bf16 on the H200)."""
    _inject_pass_failure(monkeypatch)
    torch.manual_seed(0)
    model = DtypeReadInForward().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16", "output_dtype": output_dtype})
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, ref = compiled(x), model(x)
    (rep,) = tb.reports
    assert rep.notes[-1] == "fallback compiled at bf16, under torch.autocast(dt)", rep.notes
    assert got.dtype == (torch.float32 if output_dtype == "fp32" else torch.bfloat16)
    assert torch.isfinite(got).all() and 0 < _rel(got.float(), ref) <= TOLERANCES["bf16"]["rel_l2"]


class BitsOfFloat32(nn.Module):
    """``|h| + h`` with the absolute value taken on FP32's bits (``h.view(torch.int32) & 0x7FFFFFFF``): with
    ``h`` in bf16 (``model.to(bf16)`` or autocast) the int32 view has half the columns and the sum fails."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc(x)
        return (h.view(torch.int32) & 0x7FFFFFFF).view(torch.float32) + h


def test_fallback_compiles_the_model_dtypes_when_no_low_precision_way_runs(monkeypatch, aot_only):
    """Neither ``model.to(bf16)`` nor autocast can run the graph: the model's own dtypes are compiled (what
    eager runs), with both reasons in the notes, never a graph that raises at every call."""
    _inject_pass_failure(monkeypatch)
    torch.manual_seed(0)
    model = BitsOfFloat32().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"})
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    (rep,) = tb.reports
    (note,) = rep.notes
    assert note.startswith("fallback at bf16 failed (cast like model.to(dt): RuntimeError:"), note
    assert "; under torch.autocast(dt): RuntimeError:" in note and note.endswith("compiled in the model's own dtypes")


class TensorConstantAndMasks(nn.Module):
    """``torch.tensor(v)`` built in forward (export: ``lift_fresh_copy`` then ``detach_``) and masks combined
    with ``&`` (Dynamo: ``operator.and_``): neither writes a tensor in place. GPT-Neo and DeBERTa-v2 have both;
    taking them for writes made every bf16 graph of theirs fall back to the FP32 graph."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 32), nn.Linear(32, d)

    def forward(self, x, mask):
        scale = torch.sqrt(torch.tensor(x.shape[-1], dtype=torch.float32))
        keep = (mask > 0) & (x.abs() < 3)
        h = self.fc1(x / scale)
        return self.fc2(h.relu()).masked_fill(~keep, 0.0)


def test_tensor_constants_and_mask_and_are_not_writes(aot_only):
    torch.manual_seed(0)
    model = TensorConstantAndMasks().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"})
    g = torch.Generator().manual_seed(5)
    x, mask = torch.randn(3, 5, 16, generator=g), torch.randint(0, 2, (3, 5, 16), generator=g)
    with torch.no_grad():
        _close(compiled(x, mask), model(x, mask), "bf16")
    _no_fallback()
    assert _results("cast_precision")[0].count > 0
    assert not any("written in place" in n for rep in tb.reports for n in rep.notes)


def test_writes_in_place_ignores_metadata_only_and_operator_functions():
    """The two readings of "writes in place": ``passes._graph.writes_in_place`` on export's ATen graph
    (``detach_`` changes autograd metadata only) and the fallback's check on Dynamo's graph (``operator.and_``
    is ``&``; ``operator.iand`` is ``&=``, a write)."""
    from torch import fx

    from passes._graph import writes_in_place

    g = fx.Graph()
    a = g.placeholder("a")
    det = g.call_function(torch.ops.aten.detach_.default, (a,))
    add = g.call_function(torch.ops.aten.add_.Tensor, (a, a))
    g.output((det, add))
    assert writes_in_place(det) == [] and writes_in_place(add) == [a]

    import operator

    for fn, writes in ((operator.and_, False), (operator.iand, True)):
        d = fx.Graph()
        x, y = d.placeholder("x"), d.placeholder("y")
        d.output(d.call_function(fn, (x, y)))
        assert tb._writes_in_place(fx.GraphModule(nn.Module(), d)) is writes, fn


def _dynamo_graph(build) -> "torch.fx.GraphModule":
    from torch import fx

    g = fx.Graph()
    x = g.placeholder("x")
    g.output(build(g, x))
    return fx.GraphModule(nn.Module(), g)


@pytest.mark.parametrize("case, writes", [
    ("relu_ on the graph's own tensor", False),
    ("add_ through a view of an input", True),
    ("F.relu(input, inplace=True)", True),
    ("item assignment into the graph's own tensor", False),
    ("item assignment into an input", True),
])
def test_fallback_counts_only_writes_into_tensors_from_outside(case, writes):
    """The fallback compiles a graph that writes its inputs or buffers in place uncast (cast, the writes would
    land in copies); a write into a tensor the graph made (torchvision's ``ReLU(inplace=True)`` after every
    convolution) is invisible outside and must not cost the requested precision."""
    import operator

    builds = {
        "relu_ on the graph's own tensor": lambda g, x: g.call_method("relu_", (g.call_function(torch.sigmoid, (x,)),)),
        "add_ through a view of an input": lambda g, x: g.call_method("add_", (g.call_method("view", (x, -1)), 1.0)),
        "F.relu(input, inplace=True)": lambda g, x: g.call_function(F.relu, (x,), {"inplace": True}),
        "item assignment into the graph's own tensor": lambda g, x: g.call_function(
            operator.setitem, (g.call_function(torch.clone, (x,)), 0, 1.0)),
        "item assignment into an input": lambda g, x: g.call_function(operator.setitem, (x, 0, 1.0)),
    }
    assert tb._writes_in_place(_dynamo_graph(builds[case])) is writes


class InPlaceActivations(nn.Module):
    """torchvision's ResNet block habits: ``nn.ReLU(inplace=True)`` after each convolution and ``h += x`` on the
    residual; ``inplace=False`` is the same network written out of place. ``(n, 8, 12, 12)`` -> ``(n, 10)``."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.c1, self.c2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.Conv2d(8, 8, 1, bias=False)
        self.b1, self.b2 = nn.BatchNorm2d(8), nn.BatchNorm2d(8)
        self.act = nn.ReLU(inplace=inplace)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = self.b2(self.c2(self.act(self.b1(self.c1(x)))))
        if self.inplace:
            h += x
        else:
            h = h + x
        return self.head(self.act(h).mean((2, 3)))


def test_in_place_activations_are_cast_like_their_out_of_place_form(aot_only):
    """In-place ops on the graph's own tensors (``relu_``, ``add_`` on a convolution's output) were kept in FP32
    as writes: ResNet-50 ran 0.15x Inductor at bf16 on the H200, its convolutions in FP32. They are cast like the
    same network written out of place: same number of rewrites, no "written in place" skip, bf16 accuracy."""
    counts = {}
    x = torch.randn(3, 8, 12, 12, generator=torch.Generator().manual_seed(6))
    for inplace in (True, False):
        torch._dynamo.reset()
        tb.reset()
        torch.manual_seed(0)
        model = InPlaceActivations(inplace).eval()
        for bn in (model.b1, model.b2):
            bn.running_mean.normal_(0, 0.3)
            bn.running_var.uniform_(0.5, 1.5)
        compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"})
        with torch.no_grad():
            _close(compiled(x), model(x), "bf16")
        _no_fallback()
        (cast,) = _results("cast_precision")
        assert not any("written in place" in sk.reason for sk in cast.skipped), cast.skipped
        counts[inplace] = cast.count
    assert counts[True] == counts[False] > 0, counts


class VmapMix(nn.Module):
    """Linear 24 -> 36, a per-item function applied with ``torch.vmap`` (as Hugging Face's Mamba, Jamba and
    FalconMamba do in their forward), Linear 36 -> 20. ``(batch, 5, 24)`` -> ``(batch, 5, 20)``; 36 is 4 mod 8,
    so ``pad_linear_dims`` pads both linears at bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(24, 36)
        self.fc2 = nn.Linear(36, 20)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 36))

    def forward(self, x):
        h = self.fc1(x)
        h = torch.vmap(lambda r, s: r * r.sigmoid() * s + r.mean(), in_dims=(0, None))(h, self.scale)
        return self.fc2(h)


def _vmap_nesting_calls(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target.__name__ for n in gm.graph.nodes
            if n.op == "call_function" and "vmap_" in getattr(n.target, "__name__", "")]


@pytest.mark.parametrize("cast", [False, True], ids=["structural_fp32", "bf16"])
def test_vmap_in_forward_keeps_its_nesting_calls_through_the_passes(monkeypatch, cast):
    """Dynamo writes ``torch.vmap`` as ``_vmap_increment_nesting`` / ``_vmap_decrement_nesting`` calls nothing
    reads around ``_add_batch_dim`` ops. The passes' dead-code elimination removed those calls, so the graph's
    batched ops ran outside any vmap level: every call raised (Inductor's trace at compile time: a fallback).
    They stay now, the padding and cast passes still fire, and the graph matches eager. Inductor's code
    generation is replaced by running the graph handed to it (what reaches Inductor is under test). Without
    the cast passes (planned for bf16, computing FP32) the graph must match eager to FP32 rounding."""
    from passes import CASTS

    graphs: list[torch.fx.GraphModule] = []

    def eager(gm, example_inputs, config_patches):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(tb, "inductor_compile", eager)
    torch.manual_seed(0)
    model = VmapMix().eval()
    options = {"precision": "bf16", "policy": "pure", "target": "sm_90"}
    if not cast:
        options["passes"] = [n for n in tb.BACKEND_PIPELINE if n not in CASTS]
    compiled = torch.compile(model, backend="tctune", dynamic=False, options=options)
    g = torch.Generator().manual_seed(8)
    batches = [torch.randn(3, 5, 24, generator=g) for _ in range(2)]
    with torch.no_grad():
        outs = [(compiled(x), model(x)) for x in batches]
    assert tb.reports and all(not rep.fallback for rep in tb.reports), [rep.fallback for rep in tb.reports]
    assert sum(r.count for r in _results("pad_linear_dims")) == 2
    (gm,) = graphs
    calls = _vmap_nesting_calls(gm)
    assert calls.count("_vmap_increment_nesting") == calls.count("_vmap_decrement_nesting") >= 1, calls
    for got, ref in outs:
        assert got.dtype == ref.dtype
        if not cast:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        else:
            assert sum(r.count for r in _results("cast_precision")) > 0
            assert _rel(got, ref) <= TOLERANCES["bf16"]["rel_l2"]


def test_dead_code_elimination_keeps_model_calls_and_drops_orphaned_ops():
    """``passes._graph.kept_by_dce``: an unused call of a Python function the model made stays (FX cannot
    know it has no side effect), an unused ATen op or ``getitem`` a pass orphaned goes, as do unused symbolic
    size computations."""
    import operator

    from passes._graph import finish

    log: list[int] = []

    def side_effect(x):  # stands in for torch._C._functorch._vmap_increment_nesting
        log.append(1)

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(side_effect, (x,))
    graph.call_function(torch.ops.aten.relu.default, (x,))
    pair = graph.call_function(torch.ops.aten.split.Tensor, (x, 2))
    graph.call_function(operator.getitem, (pair, 0))
    graph.call_function(torch.sym_max, (2, 3))
    graph.output(graph.call_function(torch.ops.aten.neg.default, (x,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    finish(gm)
    left = [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]
    assert left == ["side_effect", "neg.default"], left
    x = torch.randn(4)
    torch.testing.assert_close(gm(x), -x)
    assert log == [1]


class BreakingLayer(nn.Module):
    """Linear 16 -> 16, ReLU, a graph break, Linear 16 -> 16 and a residual: ``(batch, 16)`` -> ``(batch, 16)``.
    Repeated, every layer's second half is the same resumed code, so Dynamo calls one compiled graph with each
    layer's parameters (Hugging Face's HiggsAudioV2 breaks inside its decoder layers this way)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(h) + x


class BreakingStack(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BreakingLayer() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_graph_reused_for_other_layers_uses_their_weights(monkeypatch):
    """Dynamo reuses a compiled graph for every layer that runs its code, handing it that layer's parameters;
    tctune froze the first layer's weights into the graph, so every layer computed layer 1 (FP32 outputs off by
    ~1.9 here). Each set of weights gets its own graph now (one report per layer and graph), and the model
    matches eager on fresh inputs, on later calls too (no further compile). Inductor's code generation is
    replaced by running the rewritten graph."""
    monkeypatch.setattr(tb, "inductor_compile", lambda gm, example_inputs, config_patches: gm.forward)
    torch.manual_seed(0)
    model = BreakingStack().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "fp32"}, dynamic=False)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 16, generator=g)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-6, atol=1e-6)
    assert len(tb.reports) == 2 * len(model.layers), [r.summary() for r in tb.reports]
    assert all(not r.fallback for r in tb.reports)
    assert sorted(len(r.frozen) for r in tb.reports) == [2] * 6  # each graph froze its own layer's weight and bias
    # and says why it compiled again: the buffers the backend's own compiles register are no weight change (the
    # note read "frozen weights changed since the last compile" for the later layers)
    again = [r.notes[0] for r in tb.reports if r.notes and r.notes[0].startswith("compiled again")]
    assert len(again) == 2 * (len(model.layers) - 1), [r.notes for r in tb.reports]
    assert all(n.startswith("compiled again: called with other weights") for n in again), again


def test_a_second_instance_of_a_compiled_class_uses_its_own_weights(monkeypatch):
    monkeypatch.setattr(tb, "inductor_compile", lambda gm, example_inputs, config_patches: gm.forward)
    torch.manual_seed(0)
    first, second = BreakingStack(layers=1).eval(), BreakingStack(layers=1).eval()
    x = torch.randn(3, 16)
    with torch.no_grad():
        for model in (first, second):
            compiled = torch.compile(model, backend="tctune", options={"precision": "fp32"}, dynamic=False)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-6, atol=1e-6)


class WritesThroughAliases(nn.Module):
    """Writes into the caller's ``x`` ``(2, 6, 8)`` through aliases that export's ATen graph shows without a
    plain view schema: an element of ``chunk`` / ``unbind`` (``operator.getitem`` of a list of views),
    ``type_as`` / ``atleast_3d`` (composites that return their input itself), and the result of an in-place op
    written again (``x.add_(1).mul_(h)``). ``h = Linear(y)``; returns ``h.sum(-1)`` ``(2, 6)``."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.fc(y)
        if self.form == "chunk":
            x.chunk(2, dim=1)[1].add_(h[:, 3:])
        elif self.form == "unbind":
            x.unbind(0)[1].add_(h[0])
        elif self.form == "type_as":
            x.type_as(h).mul_(h)
        elif self.form == "atleast_3d":
            torch.atleast_3d(x).add_(h)
        else:
            x.add_(1.0).mul_(h)
        return h.sum(-1)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("form", ["chunk", "unbind", "type_as", "atleast_3d", "in-place result written again"])
def test_writes_through_aliases_without_a_view_schema_reach_the_caller(form, precision, aot_only):
    """``passes._graph.written_nodes`` walked back only through ops whose schema says "view of the first
    argument": the write into ``x.chunk(2)[1]`` (a ``getitem``), ``x.type_as(h)``, ``torch.atleast_3d(x)`` or
    ``x.add_(1)``'s result was taken for a write into the graph's own tensor, cast_precision cast ``x`` to
    bf16 / fp16 on the way and the write landed in that copy: the caller's ``x`` was left unchanged (relative
    error 0.3 to 2)."""
    torch.manual_seed(0)
    model = WritesThroughAliases(form).eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": precision})
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for _ in range(2):
            x, y = torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g)
            x0, x_ref = x.clone(), x.clone()
            _close(compiled(x, y), model(x_ref, y), precision)
            assert _rel(x_ref, x0) > 0.1  # eager's write changes x: a lost write cannot pass below
            _close(x, x_ref, precision)
    _no_fallback()
    (cast,) = _results("cast_precision")
    assert cast.count > 0  # the linear still runs low
    assert any(s.reason.startswith("written in place: ") for s in cast.skipped), cast.skipped


def test_written_nodes_walks_lists_of_views_and_in_place_results():
    """``written_nodes`` on a hand-built ATen graph with no example values: ``getitem(chunk(x), 1).add_()`` and
    ``x.mul_(2).add_(1)`` write ``x`` (the chain back to it is written); ``relu_`` of the graph's own tensor,
    and a ``getitem`` of a non-view tuple (``max.dim``), are not writes from outside."""
    import operator

    from torch import fx

    from passes._graph import view_base, written_nodes

    aten = torch.ops.aten
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    chunk = g.call_function(aten.chunk.default, (x, 2, 1))
    part = g.call_function(operator.getitem, (chunk, 1))
    add = g.call_function(aten.add_.Tensor, (part, y))
    mul = g.call_function(aten.mul_.Tensor, (y, 2.0))
    again = g.call_function(aten.add_.Tensor, (mul, 1.0))
    own = g.call_function(aten.sigmoid.default, (x,))
    relu = g.call_function(aten.relu_.default, (own,))
    mx = g.call_function(aten.max.dim, (relu, 0))
    values = g.call_function(operator.getitem, (mx, 0))
    g.output((add, again, values))
    gm = fx.GraphModule(nn.Module(), g)
    assert view_base(part) is chunk and view_base(chunk) is x and view_base(again) is mul and view_base(mul) is y
    assert view_base(values) is None and view_base(own) is None
    assert written_nodes(gm) == {x, chunk, part, y, mul}


def _dynamo_graph_of(fn, *args) -> "torch.fx.GraphModule":
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=grab, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


@pytest.mark.parametrize("case, writes", [
    ("x.mT.add_", True),
    ("x[0].T.add_", True),
    ("x.data.mul_", True),
    ("x.moveaxis(0, 2).add_", True),
    ("x.float().mul_ (x is FP32: x itself)", True),
    ("torch.hsplit(x, 2)[0].add_", True),
    ("F.leaky_relu(x, 0.2, True)", True),
    ("F.hardtanh(x, -0.5, 0.5, True)", True),
    ("x.to(bfloat16).mul_ (a copy)", False),
    ("F.relu(2 * x, True) (the graph's own tensor)", False),
])
def test_fallback_sees_writes_through_attribute_views_and_positional_inplace(case, writes):
    """Dynamo records ``x.mT`` / ``x.T`` as ``getattr``, ``x.data`` as ``_get_data_attr``, and passes
    ``inplace`` positionally where the model does: the fallback's check missed these, cast the graph like
    ``model.to(bf16)`` and the writes landed in copies (the caller's ``x`` unchanged). Views are also read off
    Dynamo's example values (a result sharing an input's storage), so ``x.float()`` of an FP32 ``x`` is ``x``
    and ``x.to(torch.bfloat16)`` is not."""
    fns = {
        "x.mT.add_": lambda x: x.mT.add_(1.0),
        "x[0].T.add_": lambda x: x[0].T.add_(1.0),
        "x.data.mul_": lambda x: x.data.mul_(2.0),
        "x.moveaxis(0, 2).add_": lambda x: x.moveaxis(0, 2).add_(1.0),
        "x.float().mul_ (x is FP32: x itself)": lambda x: x.float().mul_(2.0),
        "torch.hsplit(x, 2)[0].add_": lambda x: torch.hsplit(x, 2)[0].add_(1.0),
        "F.leaky_relu(x, 0.2, True)": lambda x: F.leaky_relu(x, 0.2, True),
        "F.hardtanh(x, -0.5, 0.5, True)": lambda x: F.hardtanh(x, -0.5, 0.5, True),
        "x.to(bfloat16).mul_ (a copy)": lambda x: x.to(torch.bfloat16).mul_(2.0),
        "F.relu(2 * x, True) (the graph's own tensor)": lambda x: F.relu(2 * x, True),
    }
    gm = _dynamo_graph_of(fns[case], torch.randn(2, 6, 8))
    assert tb._writes_in_place(gm) is writes, gm.graph


class WritesAfterViews(nn.Module):
    """``x.mT.add_(h.mT)`` and ``F.leaky_relu(x[:, :2], 0.2, True)`` on the caller's ``x`` ``(2, 6, 8)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.fc(y)
        x.mT.add_(h.mT)
        F.leaky_relu(x[:, :2], 0.2, True)
        return h.sum(-1)


def test_fallback_of_writes_through_attribute_views_keeps_the_writes(monkeypatch, aot_only):
    """End to end: tctune's passes fail, the fallback compiles the graph uncast (it writes ``x``), and the
    caller's ``x`` holds eager's values."""
    _inject_pass_failure(monkeypatch)
    torch.manual_seed(0)
    model = WritesAfterViews().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"})
    g = torch.Generator().manual_seed(12)
    x, y = torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g)
    x_ref = x.clone()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, y), model(x_ref, y))
    torch.testing.assert_close(x, x_ref)
    (rep,) = tb.reports
    assert rep.notes == ["fallback compiled in the model's own dtypes, not at bf16: the graph writes tensors in "
                         "place"]


class ReturnsAViewThenWrites(nn.Module):
    """``x[:, :2]`` and ``Linear(x)`` returned by a graph that a graph break ends; the code after it writes
    into the returned view (``(3, 8)`` -> the caller's ``x`` changed, ``(3, 8)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        head, h = x[:, :2], self.fc(x)
        torch._dynamo.graph_break()
        head.mul_(-1.0)
        return h


def test_fallback_of_a_graph_returning_a_view_of_an_input_returns_the_view(monkeypatch, aot_only):
    """Cast like ``model.to(bf16)``, the fallback's graph returned ``x[:, :2]`` as a new tensor (the view of a
    cast copy, cast back): the write after the graph break missed the caller's ``x``. Such a graph is compiled
    under ``torch.autocast`` instead, which keeps the inputs: the returned tensor is a view of ``x`` again, and
    the linear still runs at bf16."""
    _inject_pass_failure(monkeypatch)
    torch.manual_seed(0)
    model = ReturnsAViewThenWrites().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"})
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 8, generator=g)
            x_ref = x.clone()
            got, ref = compiled(x), model(x_ref)
            assert 0 < _rel(got, ref) <= TOLERANCES["bf16"]["rel_l2"]
            torch.testing.assert_close(x, x_ref, rtol=0, atol=0)
    first = tb.reports[0]
    assert "fallback not cast like model.to(dt): the graph returns an input or a view of one" in first.notes
    assert first.notes[-1] == "fallback compiled at bf16, under torch.autocast(dt)", first.notes


class ReturnsListViews(nn.Module):
    """Returns elements of lists of views of the input and of a weight (``chunk``, ``unbind``) with a linear of
    the input: ``x`` ``(2, 6, 8)`` -> ``x[:, :3]``, ``x[1]``, ``weight[:4]``, ``(2, 6, 8)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x.chunk(2, dim=1)[0], x.unbind(0)[1], self.fc.weight.chunk(2)[0], self.fc(x)


def test_returned_elements_of_lists_of_views_are_exact_views(aot_only):
    """At bf16 a returned ``x.chunk(2)[0]`` came back as a new tensor holding ``x`` rounded to bf16 (the walk
    back to the input stopped at the ``getitem``); it is a view of ``x`` again, exact, like ``x[:, :3]``."""
    torch.manual_seed(0)
    model = ReturnsListViews().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"})
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        a, b, w, c = compiled(x)
    _no_fallback()
    assert torch.equal(a, x[:, :3]) and torch.equal(b, x[1]) and torch.equal(w, model.fc.weight[:4])
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    _close(c, model.fc(x), "bf16")
    assert _results("cast_precision")[0].count > 0


class DataAttr(nn.Module):
    """``.data`` in forward: the weight read through it, the caller's ``x`` ``(3, 8)`` doubled through it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        x.data.mul_(2.0)
        return F.linear(x, self.fc.weight.data, self.fc.bias)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_data_attribute_in_forward_goes_through_tctunes_graph(precision, aot_only):
    """``torch.export`` cannot trace Dynamo's ``_get_data_attr`` (``x.data``): every graph with one, read or
    written, fell back. Inference graphs are exported with ``x.data`` read as ``x.detach()`` (same storage):
    no fallback, the linear cast, the write into the caller's ``x`` exact."""
    torch.manual_seed(0)
    model = DataAttr().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": precision})
    g = torch.Generator().manual_seed(15)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 8, generator=g)
            x_ref = x.clone()
            _close(compiled(x), model(x_ref), precision)
            torch.testing.assert_close(x, x_ref, rtol=0, atol=0)
    _no_fallback()
    (cast,) = _results("cast_precision")
    assert cast.count > 0 and any(s.reason == "written in place: mul_ keeps its dtype" for s in cast.skipped)


class WritesAComputeOutputAfterABreak(nn.Module):
    """Linear 8 -> 8, a graph break, then ``h[:, :4] += fc2(x)[:, :4]`` and ``h`` returned: under
    ``output_dtype="compute"`` the second subgraph receives ``h`` in bf16 beside FP32 weights and writes it.
    ``(3, 8)`` -> ``(3, 8)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc1(x)
        torch._dynamo.graph_break()
        h[:, :4] += self.fc2(x)[:, :4]
        return h, h[:, 2:]


def test_an_input_cast_up_on_entry_and_written_keeps_the_write(aot_only):
    """A bf16 input of an FP32 graph is cast up to FP32 on entry for the re-export (``_entry_casts``); a write
    into it landed in that copy and the caller's ``h`` kept its old values (the second subgraph's addition
    lost). The copy's final values are written back, and a returned view of it is the same view of ``h``."""
    torch.manual_seed(0)
    model = WritesAComputeOutputAfterABreak().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16", "output_dtype": "compute"})
    g = torch.Generator().manual_seed(16)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 8, generator=g)
            (h, tail), (h_ref, tail_ref) = compiled(x), model(x)
            assert h.dtype == torch.bfloat16
            for got, ref in ((h, h_ref), (tail, tail_ref)):
                assert _rel(got.float(), ref) <= TOLERANCES["bf16"]["rel_l2"]
            assert tail.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
    _no_fallback()
    assert any(n.startswith("inputs narrower than the graph's float32 cast up on entry") and n.endswith(": h bfloat16")
               for n in tb.reports[1].notes), tb.reports[1].notes


def test_a_structural_pass_that_raises_is_left_out_and_the_others_run(monkeypatch, caplog):
    """A structural pass that raises on a graph (fuse_conv_relu did on a ReLU read by a
    ``torch.autocast(enabled=False)`` region) cost the whole subgraph every pass: the backend fell back to plain
    Inductor. Now the subgraph is exported again and compiled without that pass, with a warning and a note; the
    cast still runs and nothing falls back."""
    import passes
    from zoo import inductor_runs_the_graph

    inductor_runs_the_graph(monkeypatch)
    structural = [n for n in tb.BackendConfig(precision="bf16").pass_names() if n not in passes.CASTS]
    victim = structural[0]

    def broken(gm, spec):
        raise RuntimeError("a graph this pass cannot handle")

    monkeypatch.setitem(passes.PASSES, victim, broken)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"})
    x = torch.randn(4, 16)
    with caplog.at_level("WARNING", logger="tctune.backend"), torch.no_grad():
        got, ref = compiled(x), model(x)
    (rep,) = tb.reports
    assert not rep.fallback, rep.fallback
    assert any(n.startswith(f"{victim} left out: it failed on this graph") and "cannot handle" in n
               for n in rep.notes), rep.notes
    assert victim not in [r.name for r in rep.results]
    (cast,) = [r for r in rep.results if r.name == "cast_precision"]
    assert cast.count > 0
    assert any(f"compiling this subgraph without {victim}" in m for m in caplog.messages), caplog.messages
    assert _rel(got.float(), ref) < 3e-2


class ThreeNorms(nn.Module):
    """Three LayerNorms, each ``eps`` a Python float that ``dynamic=True`` hands to the backend as an input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norms = nn.ModuleList(nn.LayerNorm(16, eps=e) for e in (1e-5, 1e-6, 1e-3))

    def forward(self, x):
        for norm in self.norms:
            x = norm(torch.relu(self.fc(x)))
        return x


def test_floats_an_op_needs_as_numbers_are_specialized_before_export(monkeypatch, aot_only):
    """Under ``dynamic=True`` a LayerNorm's ``eps`` reached export as an unspecialized float: export failed on a
    guard on it, the subgraph went to the fallback, and only the fallback's compile had Dynamo trace again. Now
    the backend has Dynamo specialize every such float at once, before exporting: one export, no fallback."""
    exports, export = [], tb._export
    monkeypatch.setattr(tb, "_export", lambda *a, **k: exports.append(1) or export(*a, **k))
    monkeypatch.setattr(tb, "_fallback", lambda *a, **k: pytest.fail(f"fallback: {a[2].fallback}"))
    torch.manual_seed(0)
    model = ThreeNorms().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"}, dynamic=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for rows in (5, 9):
            x = torch.randn(rows, 16, generator=g)
            _close(compiled(x), model(x), "bf16")
    _no_fallback()
    assert len(tb.reports) == 1 and len(exports) == 1, (len(tb.reports), len(exports))


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x, scale: float):
        return self.fc(x) * scale + scale


def test_float_used_only_in_tensor_arithmetic_stays_an_input(aot_only):
    """A float the graph only multiplies and adds (a step size, a timestep) is not specialized: a new value
    does not compile again."""
    torch.manual_seed(0)
    model = Scaled().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"}, dynamic=True)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for scale in (0.5, 0.75, 1.25):
            _close(compiled(x, scale), model(x, scale), "bf16")
    _no_fallback()
    assert len(tb.reports) == 1


def test_a_fallback_under_passes_without_a_cast_pass_stays_in_the_models_dtypes(monkeypatch, aot_only):
    """``passes=`` naming only structural passes leaves tctune's graph FP32 at any ``precision`` (an FP32 parity
    run); its fallback compiled the subgraph cast to bf16 anyway."""
    def boom(gm, spec, names=(), seconds=None):  # run_pipeline's signature
        raise RuntimeError("injected pass failure")

    monkeypatch.setattr(tb, "run_pipeline", boom)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()
    compiled = torch.compile(model, backend="tctune",
                             options={"precision": "bf16", "passes": ["fuse_epilogue", "pad_linear_dims"]})
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, ref = compiled(x), model(x)
    (rep,) = tb.reports
    assert "injected pass failure" in rep.fallback
    assert rep.notes == ["fallback compiled in the model's own dtypes, not at bf16: the passes named include no "
                         "cast pass"]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)  # FP32, not bf16's 1e-2


class _Windows(nn.Module):
    """Swin-style windows of 4 over a (B, H, W, C) input, padded to a multiple of 4 and cropped back."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        b, h, w, c = x.shape
        x = F.pad(x, (0, 0, 0, (4 - w % 4) % 4, 0, (4 - h % 4) % 4))
        hp, wp = x.shape[1], x.shape[2]
        win = x.view(b, hp // 4, 4, wp // 4, 4, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 16, c)
        y = self.fc(win).view(b, hp // 4, wp // 4, 4, 4, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
        return y[:, :h, :w]


def test_dynamic_sizes_dynamo_tied_stay_one_symbol_in_the_export(monkeypatch):
    """Under ``dynamic=True`` Dynamo gives a square input's height and width one symbol; the re-export gave each
    its own (``Dim.DYNAMIC`` per dimension), so every window reshape carried two-variable guards: a tiny Swin's
    export took 305 s on the CPU, 129 s with them tied. The export now keeps them one symbol, and one compiled
    graph still serves a second square size."""
    exported = []
    real = torch.export.export

    def spy(*args, **kwargs):
        exported.append(real(*args, **kwargs))
        return exported[-1]

    monkeypatch.setattr(torch.export, "export", spy)
    monkeypatch.setattr(tb, "inductor_compile", lambda gm, example_inputs, config_patches: gm.forward)
    torch.manual_seed(0)
    model = _Windows().eval()
    compiled = torch.compile(model, backend="tctune", dynamic=True)
    with torch.no_grad():
        for shape in ((2, 12, 12, 8), (3, 20, 20, 8)):
            x = torch.randn(*shape)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(exported) == 1 and len(tb.reports) == 1 and not tb.reports[0].fallback
    (x_in,) = [n for n in exported[0].graph.nodes if n.op == "placeholder"
               and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() == 4]
    _, h, w, _ = x_in.meta["val"].shape
    assert str(h) == str(w) and not str(h).isdigit(), x_in.meta["val"].shape


class _MaskedAttention(nn.Module):
    """One self-attention over SDPA with a padding mask from a keyword argument (as Hugging Face encoders)."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)

    def forward(self, x, attention_mask=None):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, -1)).permute(2, 0, 3, 1, 4)
        mask = attention_mask[:, None, None, :].bool()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)


def test_pass_reasons_name_graph_inputs_as_the_model_does():
    """The re-export named Dynamo's inputs ``runtime``, ``runtime_1``, ...: a skip reason read "mask depends on
    graph input runtime_1". They carry the model's names (a keyword argument of ``module(**kwargs)`` included)."""
    torch.manual_seed(0)
    model = _MaskedAttention().eval()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf16"}, dynamic=False)
    torch.manual_seed(3)
    x, mask = torch.randn(2, 6, 16), torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    with torch.no_grad():
        got, ref = compiled(x, attention_mask=mask), model(x, attention_mask=mask)
    assert _rel(got, ref) < TOLERANCES["bf16"]["rel_l2"]
    assert tb.reports and not tb.reports[0].fallback, tb.reports[0].fallback
    (simplify,) = _results("simplify_attention_mask")
    reasons = [s.reason for s in simplify.skipped]
    assert reasons == ["mask depends on graph input attention_mask"], reasons
