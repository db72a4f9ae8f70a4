"""Tests for passes.run_pipeline: ordering, failure reporting, and a property test over random linear stacks."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import passes
from passes.should_pad import should_pad
import zoo
from passes import PIPELINE, PassFailure, PassSpec, run_pipeline


def test_run_pipeline_runs_in_order():
    model, gm, entry = zoo.build("conv_bn")

    results = run_pipeline(gm, PassSpec(precision="fp16", alignment=zoo.ALIGNMENT))

    assert [r.name for r in results] == list(PIPELINE)
    by_name = {r.name: r for r in results}
    assert by_name["fold_conv_batchnorm"].count == 2 and by_name["cast_precision"].count > 0
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp16")


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
@pytest.mark.parametrize("name", ["simple_cnn", "encoder_block", "tied_lm_odd"])
def test_run_pipeline_parity(name, precision):
    model, gm, entry = zoo.build(name)
    keys = list(gm.state_dict())

    run_pipeline(gm, PassSpec(precision=precision, alignment=zoo.ALIGNMENT))

    assert list(gm.state_dict()) == keys
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), precision)
    assert all(r.count == 0 for r in run_pipeline(gm, PassSpec(precision=precision, alignment=zoo.ALIGNMENT)))


def test_run_pipeline_records_each_pass_seconds_when_asked():
    model, gm, entry = zoo.build("conv_bn")
    spec = PassSpec(precision="fp16", alignment=zoo.ALIGNMENT)
    seconds = {"fold_conv_batchnorm": 1.0}  # adds to what is there

    results = run_pipeline(gm, spec, seconds=seconds)

    assert list(seconds) == list(PIPELINE) and all(v >= 0 for v in seconds.values())
    assert seconds["fold_conv_batchnorm"] >= 1.0
    assert [r.name for r in results] == list(PIPELINE) and results[0].count == 2  # same rewrites as without it
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp16")


def _count_recompiles(gm) -> list:
    calls: list = []
    original = gm.recompile

    def counted():
        calls.append(1)
        return original()

    gm.recompile = counted  # an instance attribute: finish() and deferred_recompile() call it
    return calls


def test_run_pipeline_recompiles_once_for_all_the_passes_that_fired():
    model, gm, entry = zoo.build("conv_bn")
    calls = _count_recompiles(gm)

    results = run_pipeline(gm, PassSpec(precision="fp16", alignment=zoo.ALIGNMENT))

    assert len([r for r in results if r.count]) >= 2  # fold_conv_batchnorm and cast_precision both rewrote it
    assert len(calls) == 1
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp16")  # gm.forward is the rewritten graph


def test_a_pass_called_alone_still_recompiles_and_a_failure_leaves_gm_recompiled(monkeypatch):
    model, gm, entry = zoo.build("conv_bn")
    calls = _count_recompiles(gm)
    assert passes.fold_conv_batchnorm(gm, PassSpec(precision="fp32")).count == 2
    assert len(calls) == 1
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp32")

    model, gm, entry = zoo.build("conv_bn")
    calls = _count_recompiles(gm)

    def broken(gm, spec):
        raise RuntimeError("boom")

    monkeypatch.setitem(passes.PASSES, "pad_conv_channels", broken)
    with pytest.raises(PassFailure):
        run_pipeline(gm, PassSpec(precision="fp32"), ["fold_conv_batchnorm", "pad_conv_channels"])
    assert len(calls) == 1  # the folded graph's code was generated once, on the way out
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp32")


def test_run_pipeline_names_failing_pass(monkeypatch):
    _, gm, _ = zoo.build("mlp")

    def broken(gm, spec):
        raise RuntimeError("boom")

    monkeypatch.setitem(passes.PASSES, "cast_precision", broken)
    with pytest.raises(PassFailure, match=r"'cast_precision' failed: RuntimeError: boom") as info:
        run_pipeline(gm, PassSpec(precision="fp16", alignment=zoo.ALIGNMENT))

    assert info.value.pass_name == "cast_precision"
    assert info.value.ran_before == list(PIPELINE[: PIPELINE.index("cast_precision")])
    assert isinstance(info.value.__cause__, RuntimeError)


def test_run_pipeline_rejects_unknown_pass():
    _, gm, _ = zoo.build("mlp")

    with pytest.raises(ValueError, match="unknown pass"):
        run_pipeline(gm, PassSpec(), names=("fold_conv_batchnorm", "fuse_everything"))


class _Stack(torch.nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=70), min_size=2, max_size=4),
    precision=st.sampled_from(["fp32", "tf32", "fp16", "bf16"]),
    batch=st.integers(min_value=1, max_value=9),
)
def test_run_pipeline_property_linear_stacks(sizes, precision, batch):
    torch.manual_seed(0)
    model = _Stack(sizes).eval()
    gm = zoo.capture(model, (torch.randn(3, sizes[0]),))
    spec = PassSpec(precision=precision, alignment=zoo.ALIGNMENT)
    align = spec.align()

    results = {r.name: r for r in run_pipeline(gm, spec)}

    def target(role, size):  # the should-pad decision (passes/should_pad.py) is part of the contract
        d = should_pad("linear", {role: size}, spec.precision, spec.arch, align)
        return -(-size // d.multiple) * d.multiple if d.pad else size

    for i, (k, n) in enumerate(zip(sizes[:-1], sizes[1:])):
        w = dict(gm.named_parameters())[f"layers.{i}.weight"]
        assert tuple(w.shape) == (target("N", n), target("K", k)), (i, tuple(w.shape))
        assert w.dtype == spec.dtype
    assert results["pad_linear_dims"].count == sum(
        1 for k, n in zip(sizes[:-1], sizes[1:]) if target("N", n) != n or target("K", k) != k
    )
    zoo.assert_matches_eager(model, gm, (torch.randn(batch, sizes[0]),), precision)
    assert all(r.count == 0 for r in run_pipeline(gm, spec))


def test_build_graph_leaves_out_a_pass_that_raises_and_says_why(monkeypatch):
    """A pass that corrupts the graph half-way and raises costs only itself: the graph is rebuilt from the
    untouched capture without it, every other pass still runs, and its result says it was skipped and why."""
    model, gm, entry = zoo.build("mlp")
    before = {k: v.clone() for k, v in gm.state_dict().items()}

    def broken(g, spec):
        with torch.no_grad():
            for p in g.parameters():
                p.mul_(3.0)  # a partial rewrite the rebuilt graph must not carry
        raise RuntimeError("boom")

    monkeypatch.setitem(passes.PASSES, "pad_linear_dims", broken)
    g, results = passes.build_graph(gm, PassSpec(precision="fp16", alignment=zoo.ALIGNMENT))

    assert [r.name for r in results] == list(PIPELINE)
    by_name = {r.name: r for r in results}
    failed = by_name["pad_linear_dims"]
    assert failed.count == 0 and "boom" in failed.notes["failed"]
    assert failed.skipped and "rebuilt without this pass" in failed.skipped[0].reason
    assert by_name["cast_precision"].count > 0  # the passes after it ran
    assert all(torch.equal(v, before[k]) for k, v in gm.state_dict().items())  # the capture is untouched
    zoo.assert_matches_eager(model, g, entry.example_inputs(5), "fp16")


def test_build_graph_does_not_hide_a_failing_cast(monkeypatch):
    """Leaving out a cast pass would measure a graph not at the precision it claims: its failure is raised."""
    _, gm, _ = zoo.build("mlp")

    def broken(g, spec):
        raise RuntimeError("boom")

    monkeypatch.setitem(passes.PASSES, "cast_precision", broken)
    with pytest.raises(PassFailure, match="'cast_precision' failed"):
        passes.build_graph(gm, PassSpec(precision="fp16", alignment=zoo.ALIGNMENT))


def test_run_pipeline_inside_a_deferred_block_joins_it():
    """Inside an outer ``deferred_recompile`` block, ``run_pipeline`` leaves the recompile to the outer block's end:
    one code generation for the passes and whatever the caller rewrites around them."""
    from passes._graph import deferred_recompile, recompile

    model, gm, entry = zoo.build("conv_bn")
    calls = _count_recompiles(gm)
    with deferred_recompile():
        results = run_pipeline(gm, PassSpec(precision="fp16", alignment=zoo.ALIGNMENT))
        assert calls == []
        recompile(gm)  # the caller's own rewrite, marked as well
        assert calls == []
    assert len([r for r in results if r.count]) >= 2 and len(calls) == 1
    zoo.assert_matches_eager(model, gm, entry.example_inputs(5), "fp16")


def test_a_deferred_block_that_raises_reports_its_own_error():
    """A block that raises still recompiles what it marked, and its own exception is the one raised even when
    that recompile fails (a half-rewritten graph)."""
    from passes._graph import deferred_recompile, recompile

    _, gm, _ = zoo.build("conv_bn")

    def broken():
        raise RuntimeError("recompile of a half-rewritten graph")

    gm.recompile = broken
    with pytest.raises(ValueError, match="the block's own error"):
        with deferred_recompile():
            recompile(gm)
            raise ValueError("the block's own error")
