"""The max-autotune finalist (tctune.search.autotune) on the CPU: the runtime and its Inductor options, the option
on the command line, in the API and in TuneConfig, the rule that decides whether it runs, and the step inside a
search: its trial in the study and the report, its runtime in best_config.json and the tuned module, and a
failing or over-budget compile recorded while the run completes.

Max-autotune cannot run meaningfully on this CPU: the search tests replace the evaluator's runtime wrapper
(``tctune.search.evaluate.wrap``) with one that runs the candidate as it is and reports a chosen compile time, so
they test the step's logic, not Inductor."""
import dataclasses
import json
import time

import optuna
import pytest
import torch

from tctune.errors import UsageError
from tctune.search import TuneConfig
from tctune.search.autotune import AUTOTUNE_COMPILE_FACTOR, autotune_lines, autotune_source, decide

# ------------------------------------------------------------------------------------------------- runtime


def test_max_autotune_runtimes_and_their_inductor_options():
    from tctune.runtime import (ALL_RUNTIMES, CUDA_GRAPH_RUNTIMES, MAX_AUTOTUNE_VARIANT, RUNTIMES_GPU,
                                aot_inductor_configs, inductor_mode, without_cuda_graph)

    assert MAX_AUTOTUNE_VARIANT == {"inductor": "inductor-max-autotune",
                                    "inductor-cudagraphs": "inductor-max-autotune-cudagraphs"}
    assert "inductor-max-autotune-cudagraphs" in ALL_RUNTIMES and "inductor-max-autotune-cudagraphs" in CUDA_GRAPH_RUNTIMES
    assert not any("max-autotune" in r for r in RUNTIMES_GPU)  # never sampled by default: the finalist step tries it
    assert [inductor_mode(r) for r in ALL_RUNTIMES] == [None, None, "default", "max-autotune-no-cudagraphs", "default",
                                                        "max-autotune-no-cudagraphs"]
    assert [without_cuda_graph(r) for r in CUDA_GRAPH_RUNTIMES] == ["eager", "inductor", "inductor-max-autotune"]
    assert without_cuda_graph("inductor-max-autotune") == "inductor-max-autotune"
    opts = aot_inductor_configs("inductor-max-autotune-cudagraphs")
    assert opts == torch._inductor.list_mode_options("max-autotune-no-cudagraphs") and opts["max_autotune"] is True
    assert aot_inductor_configs("inductor-max-autotune") == opts
    assert aot_inductor_configs("inductor") == aot_inductor_configs("inductor-cudagraphs") == aot_inductor_configs("eager") == {}


def test_wrap_compiles_max_autotune_runtimes_in_that_mode(monkeypatch):
    import tctune.runtime as rt

    modes = []

    def fake_compile(fn, mode=None, dynamic=None):
        modes.append(mode)
        return fn

    monkeypatch.setattr(rt.torch, "compile", fake_compile)
    model = torch.nn.Linear(4, 3).eval()
    x = torch.randn(2, 4)
    for runtime in ("inductor", "inductor-max-autotune"):
        fn, setup_s = rt.wrap(model, runtime, (x,))
        assert setup_s >= 0 and torch.equal(fn(x), model(x))
    assert modes == ["default", "max-autotune-no-cudagraphs"]


def test_tuned_module_without_a_gpu_runs_the_max_autotune_compile_without_its_cuda_graph(monkeypatch):
    import tctune.tuned as tuned
    from tctune.trial import TrialParams

    modes = []
    monkeypatch.setattr(tuned.torch, "compile", lambda fn, mode=None, dynamic=None: modes.append(mode) or fn)
    model = torch.nn.Linear(4, 3).eval()
    m = tuned.TunedModule(model, TrialParams(batch_size=2, precision="fp32"), "inductor-max-autotune-cudagraphs")
    x = torch.randn(2, 4)
    with pytest.warns(RuntimeWarning, match="replays CUDA graphs"):
        out = m(x)
    assert modes == ["max-autotune-no-cudagraphs"]
    torch.testing.assert_close(out, model(x))


# --------------------------------------------------------------------------------------- option, CLI, API


def test_tune_config_autotune_field(tmp_path):
    assert TuneConfig(out_dir=str(tmp_path)).autotune == "off"  # default: never (the ResNet-50 measurement)
    cfg = TuneConfig(out_dir=str(tmp_path), autotune="off")
    assert TuneConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(UsageError, match="autotune must be one of auto, on, off") as err:
        TuneConfig(out_dir=str(tmp_path), autotune="yes")
    assert err.value.field == "autotune"


def test_cli_flag_api_option_and_help(tmp_path, capsys, monkeypatch):
    from tctune.api import tune_config
    from tctune.cli import main, parser
    from tctune.cli.optimize import config_from_args

    assert config_from_args(parser().parse_args(["optimize", "m.py", "--autotune", "off"])).autotune == "off"
    assert config_from_args(parser().parse_args(["optimize", "m.py"])).autotune == "off"
    with pytest.raises(SystemExit):
        parser().parse_args(["optimize", "m.py", "--autotune", "maybe"])
    assert tune_config({"autotune": "on"}, out_dir=tmp_path).autotune == "on"
    with pytest.raises(UsageError) as err:
        tune_config({"autotune": "sometimes"}, out_dir=tmp_path)
    assert err.value.field == "autotune"
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "2000")  # one line per option: argparse wraps at hyphens
    with pytest.raises(SystemExit):
        main(["optimize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--autotune {auto,on,off}" in text and "inductor-max-autotune-cudagraphs" in text
    # the help states the rule with the factor the code uses
    assert f"{AUTOTUNE_COMPILE_FACTOR:g} x that candidate's default compile" in text


# ------------------------------------------------------------------------------------------------- the rule


def _trial(number=0, throughput=100.0, runtime="inductor-cudagraphs", graph=True, setup_s=12.0, feasible=True,
           **attrs):
    params = {"batch_size": 8, "precision": "bf16", "graph_passes": graph, "runtime": runtime}
    dists = {"batch_size": optuna.distributions.CategoricalDistribution([8]),
             "precision": optuna.distributions.CategoricalDistribution(["bf16"]),
             "graph_passes": optuna.distributions.CategoricalDistribution([False, True]),
             "runtime": optuna.distributions.CategoricalDistribution(["eager", "inductor", "inductor-cudagraphs"])}
    t = optuna.trial.create_trial(params=params, distributions=dists, value=throughput,
                                  user_attrs={"throughput": throughput, "setup_s": setup_s, "latency_p99_ms": 1e3 / throughput,
                                              **attrs},
                                  constraints={"max_error": -1.0 if feasible else 1.0})
    t.number = number
    return t


@pytest.mark.parametrize("mode,device,training,kw,runs,why", [
    ("off", "cuda", False, {}, False, "--autotune off"),
    ("auto", "cuda", True, {}, False, "for inference"),
    ("on", "cuda", False, {"source": None}, False, "no feasible tctune candidate"),
    ("on", "cpu", False, {"source": _trial(setup_s=1000.0)}, True, "--autotune on"),
    ("auto", "cpu", False, {}, False, "this run measures on the CPU"),
    ("auto", "cpu", False, {"source": None}, False, "this run measures on the CPU"),  # the reason that applies first
    ("auto", "cuda", False, {"source": _trial(setup_s=3.0)}, True, "estimated max-autotune compile 300 s"),
    ("auto", "cuda", False, {"source": _trial(setup_s=3.01)}, False, "is over --compile-budget 300 s"),
    ("auto", "cuda", False, {"time_left_s": 50.0}, False, "over the 50 s left before --timeout"),
    ("auto", "cuda", False, {"over_budget": "trial compile took 400 s"}, False, "compiles are over --compile-budget"),
    ("auto", "cuda", False, {"source": _trial(setup_s=None)}, False, "recorded no compile time"),
    # no inductor / inductor-cudagraphs among the searched runtimes: the reason names the fix
    ("on", "cpu", False, {"source": None, "runtimes": ("eager",)}, False,
     "runtimes searched here (eager) include neither, so there is none to rebuild; fix: add one, e.g. --runtimes "
     "eager,inductor"),
    ("auto", "cuda", False, {"source": None, "runtimes": ("eager", "cudagraphs")}, False,
     "e.g. --runtimes eager,cudagraphs,inductor"),
    ("auto", "cpu", False, {"runtimes": ("eager",)}, False,
     "(--autotune on with --runtimes eager,inductor runs it anyway)"),
    ("on", "cpu", False, {"runtimes": ("eager", "inductor")}, True, "--autotune on"),
    ("auto", "cpu", False, {"runtimes": ("eager", "inductor")}, False, "(--autotune on runs it anyway)"),
])
def test_decide(mode, device, training, kw, runs, why):
    kw = {"source": _trial(setup_s=1.0), **kw}  # estimate: AUTOTUNE_COMPILE_FACTOR (100) x 1 s
    d = decide(mode, device, training, kw.pop("source"), 300.0, **kw)
    assert d.run is runs and why in d.reason


def test_runtimes_note_only_when_the_finalist_could_otherwise_run():
    from tctune.search.autotune import runtimes_note

    assert runtimes_note("on", "cpu", ("eager",)).endswith("fix: add one, e.g. --runtimes eager,inductor")
    assert "\n" not in runtimes_note("on", "cpu", ("eager",))  # one line: the report's "Not run:" line holds it
    assert runtimes_note("auto", "cuda", ("eager",)).startswith("--autotune auto: ")
    assert runtimes_note("auto", "cpu", ("eager",)) is None  # auto never runs it on the CPU: decide says that
    assert runtimes_note("off", "cuda", ("eager",)) is None
    assert runtimes_note("on", "cuda", ("eager", "inductor-cudagraphs")) is None
    assert runtimes_note("on", "cuda", None) is None


def test_source_is_the_best_feasible_graph_trial_through_a_default_inductor_runtime():
    study = optuna.create_study(direction="maximize")
    for t in [_trial(0, 500.0, runtime="inductor-cudagraphs", baseline="compile_ro_cast_bf16"),  # a plain baseline
              _trial(1, 400.0, runtime="eager"),  # no Inductor runtime to vary
              _trial(2, 300.0, runtime="inductor-cudagraphs", feasible=False),  # outside a constraint
              _trial(3, 200.0, runtime="inductor-cudagraphs"),
              _trial(4, 250.0, runtime="inductor"),
              _trial(5, 900.0, runtime="inductor-cudagraphs", autotune_of=4)]:  # a max-autotune rebuild itself
        study.add_trial(t)
    ran_max_autotune = _trial(6, 800.0, runtime="inductor")
    ran_max_autotune.user_attrs["runtime"] = "inductor-max-autotune"  # its runtime as run: no default-mode one
    study.add_trial(ran_max_autotune)
    assert autotune_source(study).number == 4
    study.add_trial(_trial(7, 240.0, runtime="inductor", latency_p99_ms=0.5))
    assert autotune_source(study, "latency").number == 7  # the lowest p99
    assert autotune_source(optuna.create_study()) is None


# ------------------------------------------------------------------------------------------ inside a search

#: Seconds every call of a candidate not built with max-autotune sleeps in the fake runtime wrapper: the
#: max-autotune rebuild is then clearly the fastest candidate (the tiny model's own call takes microseconds;
#: on a shared, loaded CPU a call can wait tens of ms for a core, so the margin is large).
SLOW_S = 0.05


def fake_wrap(seen: list, compile_s: float = 7.0, error: str | None = None):
    """A stand-in for ``tctune.search.evaluate.wrap``: records each runtime; a max-autotune runtime raises
    ``error`` when given, else runs the candidate as it is and reports ``compile_s`` as its compile; every other
    runtime runs it ``SLOW_S`` slower (an Inductor one reporting a 0.5 s compile)."""
    def wrap(fn, runtime, inputs):
        seen.append(runtime)
        if "max-autotune" in runtime:
            if error:
                raise RuntimeError(error)
            return fn, compile_s

        def slow(*args):
            time.sleep(SLOW_S)
            return fn(*args)

        return slow, 0.5 if runtime.startswith("inductor") else 0.0
    return wrap


def _search(tiny, out, **options):
    """``tctune.optimize`` of the tiny model file's module at batch 4, Inductor searched (fake), no export."""
    import tctune
    from tctune.modelfile import load_model_file

    mf = load_model_file(tiny)
    model = mf.model().eval()
    return tctune.optimize(model, lambda b: mf.inputs(b, "cpu"), out=out, batch_sizes=4, trials=3,
                           runtimes="eager,inductor", max_error=5e-2, no_export=True, no_prune=True, quiet=True,
                           **options)


def test_the_finalist_is_a_trial_of_the_study_and_wins_with_its_runtime(tiny, tmp_path, monkeypatch):
    """--autotune on, on the CPU: the best graph trial through inductor is rebuilt through inductor-max-autotune
    as a new trial (same parameters, the runtime in its user attribute), which wins here, so the report, the
    Trials table, best_config.json and the tuned module all carry inductor-max-autotune; a second call reuses the
    trial; auto on the CPU does not run, saying why."""
    import tctune.search.evaluate as ev

    seen = []
    monkeypatch.setattr(ev, "wrap", fake_wrap(seen))
    out = tmp_path / "out"
    tuned = _search(tiny, out, autotune="on")

    report = json.loads((out / "report.json").read_text())
    rec = report["autotune"]
    assert rec["ran"] is True and rec["mode"] == "on" and rec["reason"] == "--autotune on"
    assert rec["runtime"] == "inductor-max-autotune" and rec["source_runtime"] == "inductor"
    assert rec["compile_s"] == pytest.approx(7.0) and rec["source_compile_s"] == pytest.approx(0.5)
    assert rec["estimate_s"] == pytest.approx(AUTOTUNE_COMPILE_FACTOR * 0.5)
    rows = {t["number"]: t for t in report["trials"]}
    row, source = rows[rec["trial"]], rows[rec["source_trial"]]
    assert row["autotune_of"] == source["number"] and row["state"] == "COMPLETE"
    assert row["params"] == {**source["params"], "runtime": "inductor-max-autotune"}
    assert source["params"]["graph_passes"] is True and source["params"]["runtime"] == "inductor"
    assert seen.count("inductor-max-autotune") >= 1
    # the fastest by far: recommended, kept, and what every output names
    assert report["best"]["trial"] == rec["trial"], report["best"]["verdict"]
    assert rec["kept"] is True and rec["result"] == "kept"
    assert report["best"]["params"]["runtime"] == "inductor-max-autotune"
    assert rec["trial"] in [e["trial"] for e in report["side_by_side"]["entries"]]
    best_config = json.loads((out / "best_config.json").read_text())
    assert best_config["params"]["runtime"] == "inductor-max-autotune" and best_config["recommended"]["trial"] == rec["trial"]
    assert tuned.runtime == "inductor-max-autotune" and tuned.config.runtime == "inductor-max-autotune"
    md = (out / "report.md").read_text()
    assert "## Max-autotune finalist" in md and "Result: **kept: it is the recommended configuration**" in md
    assert f"| {rec['trial']} | complete |" in md and "inductor-max-autotune |" in md

    # the study as stored: the trial's Optuna parameters are its source's; its runtime is the user attribute
    from tctune.search import Tuner
    from tctune.hardware import resolve
    from tctune.modelfile import load_model_file

    cfg = TuneConfig(out_dir=str(out), batch_sizes=(4,), trials=1, runtimes=("eager", "inductor"), max_error=5e-2,
                     quiet=True, export=False, prune=False, autotune="on")
    t = Tuner(cfg, load_model_file(tiny), resolve(None), device=torch.device("cpu"))
    study = optuna.load_study(study_name=report["study"]["name"], storage=t.storage_url())
    stored = study.trials[rec["trial"]]
    assert stored.params["runtime"] == "inductor" and stored.user_attrs["runtime"] == "inductor-max-autotune"
    n = len(study.trials)
    again = t.autotune(study)  # a resumed run: the candidate is already measured, nothing is compiled
    assert again["reused"] is True and again["ran"] is False and again["trial"] == rec["trial"] and len(study.trials) == n
    t.cfg = dataclasses.replace(cfg, autotune="auto")
    auto = t.autotune(study)
    assert auto["ran"] is False and auto["result"] == "not run" and "measures on the CPU" in auto["reason"]
    assert autotune_lines(auto) == [f"- Not run: {auto['reason']}."]  # the reason names --autotune auto itself


@pytest.mark.parametrize("case", ["raises", "over budget"])
def test_a_failing_or_over_budget_max_autotune_compile_is_recorded_and_the_run_completes(tiny, tmp_path, monkeypatch,
                                                                                         case):
    import tctune.search.evaluate as ev

    seen = []
    error = "Triton template benchmarking exploded" if case == "raises" else None
    monkeypatch.setattr(ev, "wrap", fake_wrap(seen, compile_s=500.0, error=error))
    out = tmp_path / "out"
    tuned = _search(tiny, out, autotune="on", compile_budget=300.0)

    report = json.loads((out / "report.json").read_text())
    rec = report["autotune"]
    row = next(t for t in report["trials"] if t["number"] == rec["trial"])
    assert rec["ran"] is True and row["state"] == "FAIL" and row["autotune_of"] == rec["source_trial"]
    if case == "raises":
        assert rec["result"] == "failed" and error in rec["error"] and error in row["fail_reason"]
    else:
        assert rec["result"] == "over budget" and "compile took 500 s > --compile-budget 300 s" in rec["error"]
    assert rec["kept"] is False and report["best"]["trial"] != rec["trial"] and tuned is not None
    assert report["best"]["params"]["runtime"] != "inductor-max-autotune"
    assert not report.get("post_errors")  # recorded in its trial, not an error of the run
    md = (out / "report.md").read_text()
    assert "## Max-autotune finalist" in md and ("failed: not kept" if case == "raises" else "over --compile-budget") in md


def test_an_error_in_the_step_itself_is_a_recorded_stage_and_the_report_is_written(tiny, tmp_path, monkeypatch):
    import tctune.search.loop as loop
    from tctune.cli import main

    def broken(tuner, study, time_left_s=None):
        raise RuntimeError("finalist step exploded")

    monkeypatch.setattr(loop, "run_finalist", broken)
    out = tmp_path / "out"
    assert main(["optimize", str(tiny), "--out", str(out), "--batch-sizes", "4", "--trials", "1", "--quiet",
                 "--no-export"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [e["stage"] for e in report["post_errors"]] == ["max-autotune finalist"]
    assert "finalist step exploded" in report["post_errors"][0]["error"]
    assert report["best"] is not None and report["autotune"] is None and report["side_by_side"] is not None


def test_auto_on_the_cpu_is_not_run_and_the_report_says_why(tiny, tmp_path):
    from tctune.cli import main

    out = tmp_path / "out"
    assert main(["optimize", str(tiny), "--out", str(out), "--batch-sizes", "4", "--trials", "1", "--quiet",
                 "--no-export", "--autotune", "auto"]) == 0
    report = json.loads((out / "report.json").read_text())
    rec = report["autotune"]
    assert rec["mode"] == "auto" and rec["ran"] is False and rec["trial"] is None and rec["result"] == "not run"
    assert "--autotune auto runs it on a CUDA GPU only" in rec["reason"] and "this run measures on the CPU" in rec["reason"]
    assert report["config"]["autotune"] == "auto"
    assert f"- Not run: {rec['reason']}." in (out / "report.md").read_text()  # the reason names --autotune auto


def test_on_without_an_inductor_runtime_says_so_once_at_the_start_naming_the_fix(tiny, tmp_path, capsys):
    """--autotune on, on the CPU with its default runtimes (eager only): nothing can be rebuilt with max-autotune.
    The command says so once (a warning when the search is set up, not again when the step is skipped), naming
    --runtimes eager,inductor; the report says it too."""
    from tctune.cli import main

    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["optimize", str(tiny), "--out", str(out), "--batch-sizes", "4", "--trials", "1", "--no-export",
                 "--autotune", "on"]) == 0
    err = capsys.readouterr().err
    fix = "fix: add one, e.g. --runtimes eager,inductor"
    assert err.count(fix) == 1 and err.count("include neither") == 1, err
    said = next(line for line in err.splitlines() if fix in line)
    assert said.startswith("tctune: --autotune on: ") and "max-autotune finalist" in said
    rec = json.loads((out / "report.json").read_text())["autotune"]
    assert rec["ran"] is False and rec["result"] == "not run" and fix in rec["reason"]
    assert f"- Not run: {rec['reason']}." in (out / "report.md").read_text()  # the reason names --autotune on


# ------------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("runtime", ["inductor-max-autotune-cudagraphs", "inductor-cudagraphs"])
def test_tctune_export_compiles_aot_inductor_with_the_runtimes_options(tiny, tmp_path, monkeypatch, runtime):
    """A best_config.json whose runtime is a max-autotune one gets an AOTInductor package compiled with
    max-autotune's Inductor options (recorded in its manifest and its cache key); any other runtime with
    Inductor's defaults. The compile itself is replaced (it cannot run meaningfully on this CPU)."""
    import tctune.export.aoti as aoti
    from tctune.engines import export_artifacts

    calls = []

    def fake_export_aoti(graph, make_inputs, path, batch_sizes=(2, 3), *, inductor_configs=None):
        calls.append(inductor_configs)
        path.write_bytes(b"pt2")
        return {"aoti": str(path), "aoti_device": "cpu", "aoti_export_s": 0.0, "aoti_compile_s": 0.0,
                "aoti_validation": [], "aoti_max_abs_error": 0.0, "aoti_error": None}

    monkeypatch.setattr(aoti, "export_aoti", fake_export_aoti)
    cfg = {"model": "tiny", "hardware": {"name": "CPU (x86_64)", "arch": "cpu", "compute_capability": "",
                                         "source": "cpu", "is_gpu": False},
           "params": {"batch_size": 4, "precision": "fp32", "graph_passes": True, "runtime": runtime},
           "batch_sizes": [4], "passes": [], "tctune_version": "0.1.0"}
    path = tmp_path / "best_config.json"
    path.write_text(json.dumps(cfg))
    result = export_artifacts(tiny, path, formats=("aoti",), out_dir=tmp_path / "out")
    assert result["formats"]["aoti"]["status"] == "built", result["formats"]["aoti"]
    manifest = json.loads((tmp_path / "out" / "model.pt2.manifest.json").read_text())
    if "max-autotune" in runtime:
        wanted = torch._inductor.list_mode_options("max-autotune-no-cudagraphs")
        assert calls == [wanted] and wanted["max_autotune"] is True
        assert manifest["result"]["aoti_inductor_configs"] == wanted
        assert manifest["cache_key"]["extra"]["inductor_configs"] == wanted
    else:
        assert calls == [None] and manifest["result"].get("aoti_inductor_configs") is None
        assert "inductor_configs" not in json.dumps(manifest["cache_key"])


def test_a_finalist_slower_in_its_first_timing_is_reported_as_compared_not_as_slower():
    """The step's own first timing is one measurement; the re-measure and the side-by-side decide. Unless it is
    the recommended trial, the final result is "not kept" whichever way that first timing went."""
    from tctune.search.autotune import autotune_report

    study = optuna.create_study(direction="maximize")
    study.set_user_attr("run_id", "r1")
    for first in ("slower", "faster"):
        study.set_user_attr("autotune", {"run_id": "r1", "trial": 7, "source_trial": 3, "result": first,
                                         "speedup_vs_source": 0.994 if first == "slower" else 1.01})
        assert autotune_report(study, best_number=3)["result"] == "not kept"
        assert autotune_report(study, best_number=7)["result"] == "kept"
    lines = autotune_lines({**study.user_attrs["autotune"], "result": "not kept", "runtime": "inductor-max-autotune",
                            "source_runtime": "inductor", "reason": "--autotune on", "mode": "on", "budget_s": 300.0})
    assert "not the recommended configuration" in lines[-1] and "slower" not in lines[-1]


def test_not_run_because_off_says_the_mode_once():
    # report.md said "Not run: --autotune off (--autotune off)."
    assert autotune_lines({"mode": "off", "reason": "--autotune off", "trial": None}) == ["- Not run: --autotune off."]
    assert autotune_lines({"mode": "on", "reason": "no graph candidate through inductor", "trial": None}) == [
        "- Not run: no graph candidate through inductor (--autotune on)."]
