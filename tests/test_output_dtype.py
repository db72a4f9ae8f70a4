"""The output-dtype contract, the same on both sides of every comparison (CPU).

``TuneConfig.output_dtype`` / ``--output-dtype`` / ``tctune.optimize(output_dtype=...)`` and the backend's
``output_dtype`` option: ``"compute"`` leaves floating outputs in the candidate's compute precision (tctune's graph
has no up-cast at its outputs; the whole-model cast and autocast baselines return what they compute), ``"fp32"``
returns the FP32 model's dtypes (the up-cast inside every call). Parity is checked against eager on fresh random
inputs after the up-cast, and the graphs are checked for the trailing convert node that separates the two.
"""
from __future__ import annotations

import functools
import sys

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import tctune
import tctune.backend as tb
import tctune.optimize  # noqa: F401 - the pipeline module, patched below through sys.modules
from tctune import measure
from tctune.errors import UsageError
from tctune.hardware import resolve
from tctune.measure import precision_mode
from tctune.modelfile import load_model_file
from tctune.search import TuneConfig, Tuner
from tctune.search.baselines import CastModel, OutputsTo, candidate_params
from tctune.trial import OUTPUT_DTYPES, apply_passes

from passes.base import PassSpec
from zoo import SCALED_MM_ROW, capture, rel_l2

_CAST = torch.ops.aten._to_copy.default


class Heads(nn.Module):
    """Four kinds of output: a linear's logits, a layer_norm (FP32 keep-list op under the autocast policy), a sum
    (keep-list) and an integer tensor. Every linear dimension is a multiple of 8, so no padding slice sits between
    the last op and the output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 64)
        self.head = nn.Linear(64, 48)
        self.ln = nn.LayerNorm(64)

    def forward(self, x, ids):
        h = torch.relu(self.body(x))
        return {"logits": self.head(h), "normed": self.ln(h), "total": (h * 2.0).sum(-1), "ids": ids + 1}


def _inputs(b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 5, 32, generator=g) * 2 + 0.5, torch.randint(0, 100, (b, 5), generator=g)


def _model() -> Heads:
    torch.manual_seed(0)
    return Heads().eval()


def _trailing_up_casts(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the output arguments that are a cast to float32 (the up-cast copy at the graph's end)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [a.name for a in pytree.tree_leaves(out.args) if isinstance(a, torch.fx.Node)
            and a.target == _CAST and a.kwargs.get("dtype") == torch.float32]


def _dtypes(out) -> dict:
    return {k: v.dtype for k, v in out.items()}


# -- the graph pass ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["autocast", "pure"])
def test_compute_outputs_leave_the_graph_without_an_up_cast_and_match_fp32_after_it(policy):
    model = _model()
    gm = capture(model, _inputs(2, 0))
    hw = resolve("h100")
    low, _ = apply_passes(gm, hw, "bf16", policy=policy, output_dtype="compute")
    full, _ = apply_passes(gm, hw, "bf16", policy=policy, output_dtype="fp32")
    assert _trailing_up_casts(low) == []  # no convert node at the outputs
    assert len(_trailing_up_casts(full)) >= 1  # the logits are cast back to FP32 there
    x = _inputs(3, 41)  # fresh random inputs, another batch
    with torch.no_grad():
        ref, lo, hi = model(*x), low(*x), full(*x)
    assert all(t.dtype == torch.float32 for k, t in hi.items() if k != "ids")
    assert lo["logits"].dtype == torch.bfloat16 and lo["ids"].dtype == hi["ids"].dtype == torch.int64
    if policy == "autocast":  # keep-list ops stay FP32, as autocast returns them
        assert lo["normed"].dtype == lo["total"].dtype == torch.float32
    else:  # everything low, as model.half() returns it
        assert lo["normed"].dtype == lo["total"].dtype == torch.bfloat16
    for k in ref:
        assert torch.equal(lo[k].to(hi[k].dtype), hi[k]), k  # the same values: only the last cast differs
        if k != "ids":
            assert 0 < rel_l2(lo[k].float(), ref[k]) < 2e-2, k  # computed in bf16, close to eager
    assert torch.equal(lo["ids"], ref["ids"])


def test_fp16_compute_outputs_are_fp16():
    model = _model()
    gm = capture(model, _inputs(2, 0))
    g, _ = apply_passes(gm, resolve("h100"), "fp16", policy="pure", calibration=[_inputs(4, 3)],
                        output_dtype="compute")
    x = _inputs(5, 7)
    with torch.no_grad():
        out, ref = g(*x), model(*x)
    assert out["logits"].dtype == torch.float16 and _trailing_up_casts(g) == []
    assert rel_l2(out["logits"].float(), ref["logits"]) < 2e-2


@SCALED_MM_ROW
def test_fp8_graph_leaves_its_bf16_outputs_under_compute():
    model = _model()
    gm = capture(model, _inputs(2, 0))
    hw = resolve("h100")
    low, results = apply_passes(gm, hw, "fp8", policy="pure", output_dtype="compute")
    full, _ = apply_passes(gm, hw, "fp8", policy="pure", output_dtype="fp32")
    assert next(r for r in results if r.name == "cast_fp8_linears").count == 2  # both linears run FP8
    x = _inputs(3, 23)
    with torch.no_grad():
        lo, hi, ref = low(*x), full(*x), model(*x)
    assert lo["logits"].dtype == torch.bfloat16 and hi["logits"].dtype == torch.float32
    assert _trailing_up_casts(low) == [] and _trailing_up_casts(full)
    assert torch.equal(lo["logits"].float(), hi["logits"]) and rel_l2(hi["logits"], ref["logits"]) < 8e-2


def test_bad_output_dtype_values_raise_one_clear_error():
    gm = capture(_model(), _inputs(2, 0))
    with pytest.raises(UsageError, match="output_dtype must be one of compute, fp32") as err:
        apply_passes(gm, resolve("h100"), "bf16", output_dtype="bf16")
    assert err.value.field == "output_dtype"
    with pytest.raises(ValueError, match="restore_output_dtypes must be True or False"):
        PassSpec(precision="bf16", restore_output_dtypes="no")
    assert OUTPUT_DTYPES == ("compute", "fp32")


# -- the plain baselines ---------------------------------------------------------------------------------------


def test_cast_model_without_out_dtype_returns_what_model_half_returns():
    model = _model()
    x = _inputs(4, 5)
    cast_low, cast_up = CastModel(model, torch.bfloat16, out_dtype=None), CastModel(model, torch.bfloat16)
    with torch.no_grad():
        import copy

        plain = copy.deepcopy(model).to(torch.bfloat16)(x[0].to(torch.bfloat16), x[1])  # model.to(bf16) by hand
        lo, hi, ref = cast_low(*x), cast_up(*x), model(*x)
    assert _dtypes(lo) == _dtypes(plain) == {"logits": torch.bfloat16, "normed": torch.bfloat16,
                                             "total": torch.bfloat16, "ids": torch.int64}
    assert _dtypes(hi) == {"logits": torch.float32, "normed": torch.float32, "total": torch.float32,
                           "ids": torch.int64}
    for k in ref:
        assert torch.equal(lo[k].to(hi[k].dtype), hi[k])
    assert 0 < rel_l2(lo["logits"].float(), ref["logits"]) < 2e-2


def test_outputs_to_casts_only_the_low_outputs():
    from tctune.runtime import Autocast

    model = _model()
    up = OutputsTo(Autocast(model, torch.bfloat16, "cpu"), torch.bfloat16)
    with torch.no_grad():
        raw, out = Autocast(model, torch.bfloat16, "cpu")(*_inputs(3, 8)), up(*_inputs(3, 8))
    assert raw["logits"].dtype == torch.bfloat16 and out["logits"].dtype == torch.float32
    assert out["ids"].dtype == torch.int64 and torch.equal(out["logits"], raw["logits"].float())


# -- the search: candidates and baselines under one contract ------------------------------------------------


@pytest.fixture
def fast_timing(monkeypatch):
    fast = functools.partial(measure.time_call, repeats=1, single_calls=2, max_iterations=3, warmup=1)
    monkeypatch.setattr("tctune.search.evaluate.time_call", fast)


@pytest.mark.parametrize("contract", OUTPUT_DTYPES)
def test_every_candidate_of_a_study_follows_the_contract(tiny, tmp_path, fast_timing, contract):
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4,), quiet=True, export=False,
                     output_dtype=contract)
    t = Tuner(cfg, load_model_file(tiny), resolve(None), device=torch.device("cpu"))
    want = torch.bfloat16 if contract == "compute" else torch.float32
    inputs, ref = t.reference(4)
    graph = t.candidate(batch_size=4, precision="bf16", graph_passes=True, runtime="eager")
    low = [candidate_params(b.params, b.user_attrs()) for b in t.plain_baselines() if b.params["precision"] == "bf16"]
    assert {p.get("model_cast", False) for p in low} == {True, False}  # autocast and the whole-model cast
    for params in (graph, *low):
        cand = t.build(params)
        with precision_mode(cand.precision), torch.no_grad():
            out = cand.module(*inputs)
        assert out.dtype == want, (params, out.dtype)
        assert 0 < rel_l2(out.float(), ref) < 2e-2
        metrics = t.evaluate(params)  # the accuracy check casts outside the timed call and accepts it
        assert 0 < metrics["max_rel_error"] < cfg.max_error
    fp32 = t.build(t.candidate(batch_size=4, precision="fp32", graph_passes=False, runtime="eager"))
    with torch.no_grad():
        assert fp32.module(*inputs).dtype == torch.float32  # FP32 candidates are FP32 under both contracts
    if contract == "compute":
        assert t.study_name().split("-")[-2] == "outcompute"  # a study of the other contract is not resumed
    else:
        assert "-out" not in t.study_name()


def test_config_flag_and_keyword_reach_the_same_field(tmp_path):
    from tctune.api import OPTIONS, tune_config
    from tctune.cli import parser
    from tctune.cli.optimize import config_from_args

    assert TuneConfig(out_dir="o").output_dtype == "compute"  # the plain baselines' own contract
    with pytest.raises(UsageError, match="output_dtype must be one of compute, fp32") as err:
        TuneConfig(out_dir="o", output_dtype="float32")
    assert err.value.field == "output_dtype"
    cfg = TuneConfig(out_dir="o", output_dtype="fp32")
    assert TuneConfig.from_json(cfg.to_json()).output_dtype == "fp32"  # worker processes get it
    assert OPTIONS["output_dtype"] == "output_dtype"
    assert tune_config({"output_dtype": "fp32"}, out_dir=tmp_path).output_dtype == "fp32"
    args = parser().parse_args(["optimize", "m.py", "--output-dtype", "fp32"])
    assert config_from_args(args).output_dtype == "fp32"
    assert config_from_args(parser().parse_args(["optimize", "m.py"])).output_dtype == "compute"


def test_report_states_the_contract_in_one_line():
    from tctune.report import output_contract_line

    assert output_contract_line("compute").startswith("Output dtypes: compute")
    assert output_contract_line("fp32").startswith("Output dtypes: fp32")


# -- the tuned module: follows the config, and save / load keeps it --------------------------------------------


def _pick_graph_bf16(mp):
    from tctune.search import results

    def best(study, *a, **k):
        ok = [t for t in study.trials if results.is_feasible(t) and t.params.get("graph_passes")
              and t.params.get("precision") == "bf16"]
        return ok[0] if ok else results.best_trial(study, *a, **k)

    mp.setattr(sys.modules["tctune.optimize"], "best_trial", best)
    mp.setattr(sys.modules["tctune.report"], "best_trial", best)


@pytest.fixture(scope="module")
def tuned_pair(tmp_path_factory):
    model = _model()
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tctune.search.evaluate.time_call",
                   functools.partial(measure.time_call, repeats=1, single_calls=2, max_iterations=3, warmup=1))
        _pick_graph_bf16(mp)
        for contract in OUTPUT_DTYPES:
            out[contract] = tctune.optimize(model, _inputs(4, 1), trials=2, runtimes="eager", no_export=True,
                                            quiet=True, output_dtype=contract,
                                            out=tmp_path_factory.mktemp(contract) / "out")
    return model, out


def test_tuned_module_follows_the_config_and_save_load_keeps_it(tuned_pair, tmp_path):
    model, tuned = tuned_pair
    low, full = tuned["compute"], tuned["fp32"]
    for t in (low, full):
        assert (t.config.precision, t.config.graph_passes) == ("bf16", True)
    assert low.report["config"]["output_dtype"] == "compute" and full.report["config"]["output_dtype"] == "fp32"
    assert _trailing_up_casts(low.graph) == [] and _trailing_up_casts(full.graph)
    x = _inputs(6, 77)
    with torch.no_grad():
        ref = model(*x)
    lo, hi = low(*x), full(*x)
    assert lo["logits"].dtype == torch.bfloat16 and lo["normed"].dtype == torch.float32  # autocast policy
    assert all(hi[k].dtype == torch.float32 for k in ("logits", "normed", "total"))
    for k in ref:
        assert torch.equal(lo[k].to(hi[k].dtype), hi[k])
        if k != "ids":
            assert rel_l2(hi[k], ref[k]) < 2e-2
    for contract, t in tuned.items():
        path = tctune.save(t, tmp_path / f"{contract}.pt2")
        assert tctune.tuned.read_manifest(path)["output_dtype"] == contract
        back = tctune.load(path)
        got = back(*x)
        assert _dtypes(got) == _dtypes(t(*x)), contract
        assert torch.equal(got["logits"], t(*x)["logits"])


def test_report_md_has_the_contract_line(tuned_pair):
    _, tuned = tuned_pair
    from pathlib import Path

    for contract, t in tuned.items():
        text = (Path(t.report["config"]["out_dir"]) / "report.md").read_text()
        assert sum(line.startswith("- Output dtypes:") for line in text.splitlines()) == 1
        assert f"- Output dtypes: {contract} — " in text


def test_keep_low_precision_outputs_is_the_older_spelling(tmp_path):
    with pytest.raises(UsageError, match="give output_dtype only"):
        tctune.optimize(_model(), _inputs(4, 1), output_dtype="fp32", keep_low_precision_outputs=True,
                        out=tmp_path / "o")


# -- the backend -------------------------------------------------------------------------------------------------


@pytest.fixture
def recorded(monkeypatch):
    graphs: list[torch.fx.GraphModule] = []

    def fake(gm, example_inputs, config_patches):
        graphs.append(gm)
        return gm  # runs the (rewritten) graph eagerly: no minutes of CPU code generation

    monkeypatch.setattr(tb, "inductor_compile", fake)
    tb.reset()
    torch._dynamo.reset()
    yield graphs
    torch._dynamo.reset()
    tb.reset()


@pytest.mark.parametrize("fallback", [False, True])
def test_backend_output_dtype_option(recorded, monkeypatch, fallback):
    if fallback:  # tctune's part fails: plain Inductor at bf16, cast like model.to(dt), same contract
        def broken(*a, **k):
            raise RuntimeError("forced for the test")

        monkeypatch.setattr(tb, "_compile_with_passes", broken)
    model = _model()
    x = _inputs(3, 19)
    with torch.no_grad():
        ref = model(*x)
        outs = {}
        for contract in ("fp32", "compute"):
            torch._dynamo.reset()
            outs[contract] = torch.compile(model, backend="tctune", dynamic=False,
                                           options={"precision": "bf16", "policy": "pure",
                                                    "output_dtype": contract})(*x)
        torch._dynamo.reset()
        default = torch.compile(model, backend="tctune", dynamic=False, options={"precision": "bf16"})
        assert default(*x)["logits"].dtype == torch.float32  # a backend keeps the module's contract by default
    assert tb.reports and all(bool(r.fallback) == fallback for r in tb.reports)
    hi, lo = outs["fp32"], outs["compute"]
    assert _dtypes(hi) == {"logits": torch.float32, "normed": torch.float32, "total": torch.float32,
                           "ids": torch.int64}
    assert _dtypes(lo) == {"logits": torch.bfloat16, "normed": torch.bfloat16, "total": torch.bfloat16,
                           "ids": torch.int64}  # pure policy: what torch.compile(model.to(bf16)) returns
    for k in ref:
        assert torch.equal(lo[k].to(hi[k].dtype), hi[k]), k
        if k != "ids":
            assert 0 < rel_l2(lo[k].float(), ref[k]) < 2e-2, k
    if not fallback:
        up = [len(_trailing_up_casts(g)) for g in recorded[:2]]
        assert up[0] >= 1 and up[1] == 0  # the compute graph hands Inductor no trailing convert


def test_backend_rejects_a_bad_output_dtype():
    with pytest.raises(ValueError, match="output_dtype must be 'fp32'"):
        tb.backend(output_dtype="bf16")
    cfg = tb.BackendConfig(precision="bf16", output_dtype="compute")
    assert cfg.output_dtype == "compute" and "output_dtype" in tb._OPTION_KEYS
