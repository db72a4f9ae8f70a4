"""What a call of a ``torch.compile(backend="tctune")`` model runs besides the compiled kernels: the graph handed
to Inductor has a plain FX codegen (no pytree flatten / unflatten wrapper around each call), takes no weight it
does not read, and the callable returned to Dynamo picks the runtime tensors without building a list. CPU only;
a tiny BERT for the real Inductor compile."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import fx, nn

import tctune.backend as tb
from zoo import ZOO, flat_outputs


@pytest.fixture(autouse=True)
def _fresh():
    patch = torch._inductor.config.patch(compile_threads=1)  # no worker pool on a two-core machine
    patch.__enter__()
    torch._dynamo.reset()
    tb.reset()
    yield
    torch._dynamo.reset()
    tb.reset()
    patch.__exit__(None, None, None)


def _graph_inputs(gm: fx.GraphModule) -> int:
    """Tensors a compiled ``gm`` takes per call: its placeholders plus every parameter and buffer, each name
    counted (what ``aot_module_simplified`` lifts to graph inputs)."""
    return (sum(1 for n in gm.graph.nodes if n.op == "placeholder")
            + len(list(gm.named_parameters(remove_duplicate=False)))
            + len(list(gm.named_buffers(remove_duplicate=False))))


def test_inductor_gets_a_plain_graph_of_read_weights_only(monkeypatch):
    """BERT with ``fuse_qkv`` (its separate Q/K/V weights replaced by one fused weight per layer): the graph
    Inductor compiles takes fewer tensors per call than Dynamo's graph of the same model (no frozen weight left
    unread), has no pytree codegen, and Inductor wraps no pytree flatten / unflatten around it; outputs match
    eager and plain ``torch.compile`` on fresh random inputs. Per call, no Python function outside the generated
    code runs more often than under plain ``torch.compile`` except the backend's own picker of runtime inputs
    (a second ``torch._dynamo.disable`` layer, a pytree wrapper or AOTAutograd's handling of more inputs would
    show here)."""
    import torch._inductor.compile_fx as cfx

    seen: list[fx.GraphModule] = []
    real = cfx.compile_fx

    def spy(gm, *args, **kwargs):
        seen.append(gm)
        return real(gm, *args, **kwargs)

    wrapped: list[str] = []
    real_wrap = cfx.handle_dynamo_export_graph

    def wrap_spy(gm, *args, **kwargs):
        wrapped.append(type(gm.graph._codegen).__name__)
        return real_wrap(gm, *args, **kwargs)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    monkeypatch.setattr(cfx, "handle_dynamo_export_graph", wrap_spy)
    entry = ZOO["bert"]
    model = entry.build()
    plain_model = copy.deepcopy(model)
    x = entry.example_inputs(3)
    with torch.no_grad():
        ft = torch.compile(model, backend=tb.backend(precision="fp32"))
        got = ft(*x)
        (tct,) = seen
        pt = torch.compile(plain_model)
        plain = pt(*x)
        dyn = seen[-1]
        ref = model(*x)
        extra = _extra_python_calls(ft, pt, x)
    rep = tb.reports[-1]
    assert not rep.fallback and rep.count("fuse_qkv") >= 1
    assert wrapped == [], f"Inductor wrapped a pytree flatten / unflatten around the graph: {wrapped}"
    assert type(tct.graph._codegen) is fx.graph.CodeGen
    read = {str(n.target) for n in tct.graph.nodes if n.op == "get_attr"}
    unread = [n for n, _ in [*tct.named_parameters(remove_duplicate=False),
                             *tct.named_buffers(remove_duplicate=False)] if n not in read]
    assert unread == []
    assert _graph_inputs(tct) < _graph_inputs(dyn), (_graph_inputs(tct), _graph_inputs(dyn))
    assert set(extra) <= {"tctune/backend.py"}, f"per call, more than plain torch.compile runs: {extra}"
    for g, p, r in zip(flat_outputs(got), flat_outputs(plain), flat_outputs(ref)):
        assert g.shape == r.shape and g.dtype == r.dtype
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(g, p, rtol=1e-4, atol=1e-5)


def _extra_python_calls(ft, pt, x) -> dict[str, int]:
    """Python functions (by file, generated Inductor code and C builtins left out: the two graphs' kernels
    differ) one warm call of ``ft`` runs more often than one of ``pt``: ``{file: extra calls}``."""
    import cProfile
    import collections
    import pstats

    counts = []
    for fn in (ft, pt):
        fn(*x)
        prof = cProfile.Profile()
        prof.enable()
        fn(*x)
        prof.disable()
        by_file: collections.Counter = collections.Counter()
        for (path, _, _), stat in pstats.Stats(prof).stats.items():
            if path != "~" and "torchinductor" not in path and not path.startswith("<"):
                by_file[path.split("site-packages/")[-1].replace("\\", "/")] += stat[1]
        counts.append(by_file)
    extra = counts[0] - counts[1]
    return {("tctune/backend.py" if path.endswith("tctune/backend.py") else path): n for path, n in extra.items()}


class _Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, a, b):
        return self.fc(a) + b, a.sum(-1)


class _Nested(_Flat):
    def forward(self, a, b):
        return {"y": self.fc(a) + b, "s": a.sum(-1)}


def _inputs():
    torch.manual_seed(7)
    return torch.randn(3, 6), torch.randn(3, 4)


def test_plain_codegen_replaces_flat_pytree_code_only():
    """A flat tuple in and out: the pytree codegen is replaced and the module returns the same tuple; a dict
    output (a nested spec) keeps its pytree code and still returns the dict."""
    x = _inputs()
    flat = torch.export.export(_Flat().eval(), x, strict=False).module()
    tb._strip_export_checks(flat)
    want = flat(*x)
    assert tb._plain_codegen(flat) is True
    assert type(flat.graph._codegen) is fx.graph.CodeGen
    got = flat(*x)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)

    nested = torch.export.export(_Nested().eval(), x, strict=False).module()
    tb._strip_export_checks(nested)
    assert tb._plain_codegen(nested) is False
    assert type(nested.graph._codegen) is not fx.graph.CodeGen
    out = nested(*x)
    assert set(out) == {"y", "s"}


class _UsesA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.randn(4))

    def forward(self, x):
        return x * self.a


def test_drop_unused_weights_keeps_read_names_of_a_shared_tensor():
    """Unread buffers and parameters are deleted (at the root and in submodules), including a second name of a
    tensor read under its first; the graph still computes the same."""
    gm = fx.symbolic_trace(_UsesA())
    gm.register_buffer("alias", gm.a)  # the same tensor, never read under this name
    gm.register_buffer("old", torch.randn(4))
    gm.add_submodule("sub", nn.Linear(4, 4))
    x = torch.randn(2, 4)
    want = gm(x)
    dropped = tb._drop_unused_weights(gm)
    assert sorted(dropped) == ["alias", "old", "sub.bias", "sub.weight"]
    assert [n for n, _ in gm.named_buffers(remove_duplicate=False)] == ["a"]
    assert list(gm.named_parameters()) == []
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)


class _CallsSub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = nn.Linear(4, 4)

    def forward(self, x):
        return self.sub(x)


def test_drop_unused_weights_keeps_the_weights_of_a_called_module():
    """A ``call_module`` node reads its module's weights without a ``get_attr``: they stay."""
    gm = fx.symbolic_trace(_CallsSub())
    x = torch.randn(2, 4)
    want = gm(x)
    assert tb._drop_unused_weights(gm) == []
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("runtime", [[], [2], [0, 3], [3, 1, 4]])
def test_runtime_caller_passes_the_runtime_inputs_in_order(runtime):
    """The callable Dynamo calls with all its graph inputs hands the compiled graph the runtime ones, in order."""
    got: list[tuple] = []
    run = tb._runtime_caller(lambda *a: got.append(a) or "out", runtime)
    args = tuple(torch.randn(2) + i for i in range(5))
    assert run(*args) == "out"
    assert len(got[0]) == len(runtime) and all(g is args[i] for g, i in zip(got[0], runtime))


def test_runtime_caller_unwraps_inductors_disable_and_is_disabled_once():
    """Inductor's compiled function comes wrapped in ``torch._dynamo.disable``: the caller runs the function
    inside it and is itself the one disabled callable (Dynamo wraps it again without nesting)."""
    from torch._dynamo.eval_frame import innermost_fn

    got: list[tuple] = []
    raw = lambda *a: got.append(a) or "out"  # noqa: E731
    run = tb._runtime_caller(torch._dynamo.disable(raw), [1])
    assert getattr(run, "_torchdynamo_disable", False)
    inner = innermost_fn(run)
    assert inner is not run and raw in [c.cell_contents for c in inner.__closure__]
    args = (torch.randn(2), torch.randn(3))
    assert run(*args) == "out" and got[0][0] is args[1]


def test_the_rewritten_graph_is_generated_once_and_records_no_stack_traces(monkeypatch):
    """The module ``ExportedProgram.module()`` returns is rewritten by the backend (export's checks removed, the
    passes, the plain codegen) and regenerates its Python code once for all of it; the re-export records no
    ``stack_trace`` (where this torch can turn it off). The same passes fire, and the graph handed to Inductor
    (run here as it is) gives eager's outputs on fresh random inputs at FP32."""
    real_module = torch.export.ExportedProgram.module
    recompiles: list[int] = []
    modules: list[fx.GraphModule] = []

    def module(self, *args, **kwargs):
        gm = real_module(self, *args, **kwargs)
        original = gm.recompile

        def counted():
            recompiles.append(1)
            return original()

        gm.recompile = counted
        modules.append(gm)
        return gm

    monkeypatch.setattr(torch.export.ExportedProgram, "module", module)
    monkeypatch.setattr(tb, "inductor_compile", lambda gm, example_inputs, config_patches: gm.forward)
    entry = ZOO["bert"]
    model = entry.build()
    x = entry.example_inputs(3)
    with torch.no_grad():
        got = torch.compile(model, backend=tb.backend(precision="fp32"))(*x)
        ref = model(*x)
    rep = tb.reports[-1]
    (gm,) = modules
    assert not rep.fallback and rep.count("fuse_qkv") >= 1
    assert len(recompiles) == 1
    assert type(gm.graph._codegen) is fx.graph.CodeGen and "_guards_fn" not in gm.code
    if hasattr(getattr(torch.fx, "config", None), "do_not_emit_stack_traces"):
        # No trace of the re-export's own frames (the backend's wrapper, Dynamo's generated code); the traces
        # the nodes carry are the ones Dynamo recorded in the model's source, copied node by node.
        traces = [n.meta["stack_trace"] for n in gm.graph.nodes if n.meta.get("stack_trace")]
        assert traces and not any("tctune/backend.py" in t or "eval_with_key" in t for t in traces)
        assert any("modeling_bert.py" in t for t in traces)  # the model's source (transformers BERT)
        assert torch.fx.config.do_not_emit_stack_traces is False  # restored after the re-export
    for g, r in zip(flat_outputs(got), flat_outputs(ref)):
        torch.testing.assert_close(g, r, rtol=1.3e-6, atol=1e-5)


def test_inductor_is_told_the_frozen_weights_are_static_inputs_as_dynamos_parameters_are(monkeypatch):
    """Inductor takes the static input indices from AOT autograd, which marks lifted parameters and buffers
    static only for a module from Dynamo (``meta["dynamo_compile_id"]``). ``ep.module()`` dropped that meta, so
    tctune's frozen weights reached Inductor as ordinary inputs (0 static where plain ``torch.compile`` has one per
    weight; seen on the H200 for swin_t, 0 against 185): under ``mode="reduce-overhead"`` each replay copied every
    weight into the CUDA graph's input buffers. Now as many as Dynamo's graph, on a real Inductor compile (CPU)."""
    import torch._inductor.compile_fx as cfx

    import tctune.backend as tb

    told: list[int] = []
    real = cfx.get_static_input_idxs

    def spy(num_fixed):
        idxs = real(num_fixed)
        told.append(len(idxs))
        return idxs

    monkeypatch.setattr(cfx, "get_static_input_idxs", spy)
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    torch._dynamo.reset()
    # a cache hit skips the compile spied on; config.patch restores the option (monkeypatch deleted it)
    with torch.no_grad(), inductor_config.patch(force_disable_caches=True):
        ref = model(x)
        plain = torch.compile(model)(x)
        torch._dynamo.reset()
        tb.reset()
        out = torch.compile(model, backend=tb.backend(precision="fp32"))(x)
    torch._dynamo.reset()
    assert len(told) == 2 and told[0] == 4, told  # plain Inductor: the four weights static
    assert told[1] == 4, told  # tctune's frozen weights: static too (0 before)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain, ref, rtol=1e-5, atol=1e-5)
