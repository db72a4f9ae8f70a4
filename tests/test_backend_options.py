"""``torch.compile(backend="tctune")`` options: mode as Inductor config patches, extra Inductor options, pad over
the three padding passes, precision fp8 off FP8 hardware, and one clear error for a bad option.

Inductor itself is replaced by a recorder through the backend's seam (``tctune.backend.inductor_compile``): it
records the config patches and runs the graph it was given, so these tests check what the backend hands
Inductor (and that the rewritten graph matches eager) without minutes of CPU code generation.
"""
from __future__ import annotations

import logging

import pytest
import torch

import tctune.backend as tb
from torch._inductor import list_mode_options


class _Mixed(torch.nn.Module):
    """A conv with 3 -> 5 channels, a linear 20 -> 30 and a matmul by an (11, 20) weight: each padding pass has
    something to pad when planning bf16 for an H100."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 5, 3, padding=1)
        self.fc = torch.nn.Linear(20, 30)
        self.fc2 = torch.nn.Linear(30, 13)
        self.w = torch.nn.Parameter(torch.randn(11, 20) / 4)

    def forward(self, img, x, y):
        c = self.conv(img).mean(dim=(2, 3))
        m = x @ self.w + y  # (b, 7, 11) @ (11, 20)
        return self.fc2(torch.relu(self.fc(m))).sum(1) + c.sum(1, keepdim=True)


def _inputs(b=2):
    torch.manual_seed(b)
    return torch.randn(b, 3, 8, 8), torch.randn(b, 7, 11), torch.randn(b, 7, 20)


@pytest.fixture
def recorded(monkeypatch):
    calls: list[dict] = []

    def fake(gm, example_inputs, config_patches):
        calls.append(dict(config_patches))
        return gm  # runs the (rewritten) graph eagerly

    monkeypatch.setattr(tb, "inductor_compile", fake)
    tb.reset()
    torch._dynamo.reset()
    yield calls
    torch._dynamo.reset()
    tb.reset()


def _run(model, backend=None, **compile_kwargs):
    x = _inputs()
    with torch.no_grad():
        out = torch.compile(model, backend=backend or "tctune", dynamic=False, **compile_kwargs)(*x)
        ref = model(*x)
    return out, ref


@pytest.mark.parametrize("mode", ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
@pytest.mark.parametrize("how", ["compile_mode", "options", "callable"])
def test_mode_becomes_inductors_config_patches(recorded, mode, how):
    model = torch.nn.Linear(20, 30).eval()
    x = torch.randn(4, 20)
    if how == "compile_mode":
        compiled = torch.compile(model, backend="tctune", mode=mode)
    elif how == "options":
        compiled = torch.compile(model, backend="tctune", options={"mode": mode})
    else:
        compiled = torch.compile(model, backend=tb.backend(mode=mode))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert recorded == [list_mode_options(mode)]
    assert not tb.reports[-1].fallback


def test_inductor_options_go_over_the_mode(recorded):
    model = torch.nn.Linear(20, 30).eval()
    with torch.no_grad():
        torch.compile(model, backend="tctune", options={"mode": "max-autotune",
                                                        "inductor": {"coordinate_descent_tuning": False,
                                                                     "epilogue_fusion": False}})(torch.randn(3, 20))
    assert recorded == [{**list_mode_options("max-autotune"), "coordinate_descent_tuning": False,
                         "epilogue_fusion": False}]


def test_compile_mode_overrides_the_callables_mode(recorded):
    model = torch.nn.Linear(20, 30).eval()
    with torch.no_grad():
        torch.compile(model, backend=tb.backend(mode="max-autotune"), mode="reduce-overhead")(torch.randn(3, 20))
    assert recorded == [list_mode_options("reduce-overhead")]


@pytest.mark.parametrize("pad", [True, False])
def test_pad_governs_all_three_padding_passes(recorded, pad):
    model = _Mixed().eval()
    out, ref = _run(model, tb.backend(precision="bf16", target="h100", pad=pad))
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)
    results = {r.name: r.count for r in tb.reports[-1].results}
    assert not tb.reports[-1].fallback
    if pad:
        assert all(results.get(name, 0) > 0 for name in tb.PAD_PASSES), results
    else:
        assert not set(tb.PAD_PASSES) & set(results), results
        assert "fold_bn" in results or "cast_precision" in results  # the other passes still ran


def test_fp8_on_the_cpu_warns_and_falls_back_to_bf16(recorded, caplog):
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).eval()
    x = torch.randn(4, 20)
    with caplog.at_level(logging.WARNING, logger="tctune.backend"), torch.no_grad():
        out = torch.compile(model, backend="tctune", options={"precision": "fp8", "fp8_keep": ["2"]})(x)
        ref = model(x)
    report = tb.reports[-1]
    assert report.precision == "bf16" and not report.fallback
    assert any("fp8 needs FP8 Tensor Cores" in n and "bf16 instead" in n for n in report.notes)
    assert any("fp8 needs FP8 Tensor Cores" in r.getMessage() for r in caplog.records)
    assert report.count("cast_precision") > 0 and report.count("cast_fp8_linears") == 0
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("options,match", [
    ({"precison": "bf16"}, r"unknown tctune backend option\(s\) \['precison'\]; known: \['precision'"),
    ({"max_autotune": True}, r"Inductor settings go inside inductor="),
    ({"mode": "fastest"}, r"mode must be one of \[.*'max-autotune'"),
    ({"inductor": {"max_autotunes": True}}, r"unknown Inductor option\(s\) \['max_autotunes'\]"),
    ({"fp8_keep": "classifier"}, r"fp8_keep must be a list of patterns"),
    ({"precision": "int4"}, r"precision must be fp32, tf32, fp16, bf16, fp8 or None"),
])
def test_bad_option_is_one_clear_error(options, match):
    with pytest.raises(ValueError, match=match):
        tb.tctune_backend(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)), [torch.randn(1, 2)], options=options)
    if set(options) <= {"mode", "inductor", "fp8_keep", "precision"}:  # the callable form checks the same
        with pytest.raises(ValueError, match=match):
            tb.backend(**options)


def test_torch_compile_refuses_mode_with_options():
    """Why ``options={"mode": ...}`` exists: torch.compile takes one of the two."""
    with pytest.raises(RuntimeError, match="Either mode or options"):
        torch.compile(torch.nn.Linear(2, 2), backend="tctune", mode="max-autotune", options={"precision": "bf16"})


def test_a_bad_option_says_what_the_readme_says_in_each_form():
    """README: the callable form raises the ValueError where the option is written; the string form's options reach
    the backend at the first call, which raises BackendCompilerFailed holding the same ValueError line. Either way
    the message names the option, its valid values and the closest one."""
    from torch._dynamo.exc import BackendCompilerFailed

    with pytest.raises(ValueError, match=r"precision must be fp32, tf32, fp16, bf16, fp8 or None, got 'bf17' "
                                         r"\(did you mean 'bf16'\?\)"):
        tb.backend(precision="bf17")
    model, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="tctune", options={"precision": "bf17"})  # nothing checked yet
    with pytest.raises(BackendCompilerFailed) as info:
        compiled(x)
    assert "backend='tctune' raised:\nValueError: precision must be fp32, tf32, fp16, bf16, fp8 or None, got " \
           "'bf17' (did you mean 'bf16'?)" in str(info.value)
    assert isinstance(info.value.inner_exception, ValueError)
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed, match=r"unknown tctune backend option\(s\) \['precison'\]; known: "
                                                    r"\[.*\(did you mean 'precision'\?\)"):
        torch.compile(model, backend="tctune", options={"precison": "bf16"})(x)
    torch._dynamo.reset()
    # the factory form names an unknown keyword the same way (it was Python's bare TypeError)
    with pytest.raises(ValueError, match=r"unknown tctune backend option\(s\) \['precison'\]; known: "
                                         r"\[.*\(did you mean 'precision'\?\)"):
        tb.backend(precison="bf16")


class _Blocks(torch.nn.Module):
    """Linears at three depths: a ModuleList of blocks, a Sequential inside each, a head."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32)) for _ in range(2))
        self.head = torch.nn.Linear(32, 16)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_graph_the_passes_see_names_the_models_modules(recorded, monkeypatch):
    """The backend re-exports Dynamo's graph; its GEMMs must still carry the model's module paths
    (``named_modules()`` form), which ``fp8_keep`` patterns and the calibration's reasons name. Before, every
    node's module was the backend's wrapper, so ``fp8_keep=["blocks.1.*"]`` matched nothing."""
    from passes.calibrate import source_module
    from passes.fp8_numerics import fp8_keep_hit

    seen: dict[str, str | None] = {}
    kept: dict[str, bool] = {}
    run = tb.run_pipeline

    def spy(gm, spec, names, **kwargs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in (torch.ops.aten.linear.default,
                                                               torch.ops.aten.addmm.default):
                seen[node.name] = source_module(node)
                kept[node.name] = fp8_keep_hit(node, ("blocks.1.*",)) is not None
        return run(gm, spec, names, **kwargs)

    monkeypatch.setattr(tb, "run_pipeline", spy)
    model = _Blocks().eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        out = torch.compile(model, backend="tctune", options={"precision": "bf16"})(x)
        ref = model(x)
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)
    assert sorted(seen.values()) == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2", "head"], seen
    assert sorted(seen[n] for n, hit in kept.items() if hit) == ["blocks.1.0", "blocks.1.2"]


@pytest.mark.parametrize("path, want", [
    ("L['self'].lm.transformer.h.0.attn.c_attn", "lm.transformer.h.0.attn.c_attn"),
    ("L['self']._modules['lm']._modules['h'][0]", "lm.h.0"),
    ("L['model'].blocks['a']", "blocks.a"),
    ("G['m'].layers[0]._modules['fc']", "layers.0.fc"),  # a model reached through a global
    ("L['self']", ""),
    ("encoder.layer.0.attention", "encoder.layer.0.attention"),
    ("my_modules.x", "my_modules.x"),
])
def test_module_path_reads_dynamos_spelling(path, want):
    from passes.calibrate import module_path

    assert module_path(path) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 GEMMs need an NVIDIA GPU with sm_89+")
def test_fp8_keep_keeps_the_named_modules_bf16_on_cuda(recorded):
    model = _Blocks().cuda().eval()
    x = torch.randn(64, 32, device="cuda")
    with torch.no_grad():
        out = torch.compile(model, backend=tb.backend(precision="fp8", fp8_keep=["blocks.1.*"]))(x)
        ref = model(x)
    report = tb.reports[-1]
    assert report.precision == "fp8" and not report.fallback
    assert report.count("cast_fp8_linears") == 3  # blocks.0.0, blocks.0.2, head; blocks.1.* stay bf16
    torch.testing.assert_close(out.float(), ref, atol=0.25, rtol=0.1)


@pytest.mark.parametrize("given,name", [("BF16", "bf16"), (torch.bfloat16, "bf16"), ("half", "fp16"),
                                        (torch.float16, "fp16"), (torch.float32, "fp32"), ("Float8_E4M3FN", "fp8")])
def test_other_spellings_of_a_precision_are_that_precision(given, name):
    """``torch.bfloat16`` or ``"BF16"`` raised "precision must be fp32, tf32, ..." with no hint."""
    assert tb.BackendConfig(precision=given).precision == name
    assert callable(tb.backend(precision=given))


def test_a_dtype_that_is_no_precision_is_named_as_given():
    with pytest.raises(ValueError, match=r"got torch\.int8"):
        tb.BackendConfig(precision=torch.int8)
