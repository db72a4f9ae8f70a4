"""tctune's Python API: ``tctune.optimize(model, example_inputs, **options)`` returns a ``TunedModule``;
``tctune.save`` / ``tctune.load`` move it to another process that does not have the model's code.

CPU, eager runtime, tiny budgets; the timing protocol is shortened (fewer repeats) to keep each test fast.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

import tctune
import tctune.optimize  # noqa: F401 - the pipeline module, patched below through sys.modules
from tctune import measure
from tctune.trial import TrialParams
from tctune.tuned import MANIFEST, TunedModule

ROOT = Path(__file__).resolve().parents[1]


from zoo import TwoHeads  # noqa: E402 - dict / nested-tuple outputs, buffers, a tied embedding
from zoo import two_heads_inputs as _inputs  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def short_timing(monkeypatch):
    # Fewer timed repeats: these tests check what runs, not which configuration is fastest.
    fast = functools.partial(measure.time_call, repeats=1, single_calls=2, max_iterations=3, warmup=1)
    monkeypatch.setattr("tctune.search.evaluate.time_call", fast)


def _pick_graph_bf16(monkeypatch):
    """Make the search's winner tctune's bf16 graph (a seam: which trial wins is timing, not under test)."""
    from tctune.search import results

    def best(study, *a, **k):
        ok = [t for t in study.trials if results.is_feasible(t) and t.params.get("graph_passes")
              and t.params.get("precision") == "bf16"]
        return ok[0] if ok else results.best_trial(study, *a, **k)

    # the pipeline module (``tctune.optimize`` the attribute is the function) and the report, which agree on it
    monkeypatch.setattr(sys.modules["tctune.optimize"], "best_trial", best)
    monkeypatch.setattr(sys.modules["tctune.report"], "best_trial", best)


@pytest.fixture(scope="module")
def tuned_bf16(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tctune.search.evaluate.time_call",
                   functools.partial(measure.time_call, repeats=1, single_calls=2, max_iterations=3, warmup=1))
        _pick_graph_bf16(mp)
        torch.manual_seed(0)
        model = TwoHeads()
        # output_dtype "fp32": the FP32 model's output dtypes (tests/test_output_dtype.py covers "compute")
        tuned = tctune.optimize(model, _inputs(4), trials=2, runtimes="eager", no_export=True, quiet=True,
                                output_dtype="fp32", out=tmp_path_factory.mktemp("api") / "out")
    return model, tuned


def test_tuned_module_matches_eager_and_keeps_structure_and_fp32(tuned_bf16):
    model, tuned = tuned_bf16
    assert isinstance(tuned, TunedModule) and isinstance(tuned, torch.nn.Module)
    assert tuned.config == TrialParams.from_dict({**tuned.report["best"]["params"], "fp8_keep": []})
    assert (tuned.config.precision, tuned.config.graph_passes, tuned.runtime) == ("bf16", True, "eager")
    assert tuned.report["model"]["name"] == "TwoHeads"
    for b, seed in ((4, 11), (7, 12)):  # the tuned batch and another one, fresh random inputs
        x = _inputs(b, seed)
        with torch.no_grad():
            ref = model(*x)
        out = tuned(*x)
        assert type(out) is dict and list(out) == ["logits", "extra"]
        assert type(out["extra"]) is tuple and len(out["extra"]) == 2
        for o, r in ((out["logits"], ref["logits"]), *zip(out["extra"], ref["extra"])):
            assert o.dtype == torch.float32 and o.shape == r.shape
            assert _rel(o, r) <= 1e-2
        assert _rel(out["logits"], ref["logits"]) > 0  # it really ran in bf16


def test_keep_low_precision_outputs_returns_the_graph_dtypes(tuned_bf16):
    _, tuned = tuned_bf16
    low = TunedModule(tuned.graph, tuned.config, tuned.runtime, out_spec=tuned.out_spec, out_dtypes=tuned.out_dtypes,
                      keep_low_precision_outputs=True)
    raw = tuned.graph(*_inputs(3, 5))
    out = low(*_inputs(3, 5))
    assert [t.dtype for t in torch.utils._pytree.tree_leaves(out)] == [t.dtype for t in torch.utils._pytree.tree_leaves(raw)]


def test_state_dict_keeps_keys_non_persistent_buffers_and_tied_weights(tuned_bf16):
    model, tuned = tuned_bf16
    keys = set(tuned.state_dict())
    assert keys == set(model.state_dict())  # same names; the non-persistent 'scale' is not among them
    assert "scale" not in keys and "scale" in dict(tuned.graph.named_buffers())
    emb, head = tuned.graph.emb.weight, tuned.graph.head.weight
    # bf16 graph, autocast policy: the table the projection reads is stored bf16 once, for both names
    assert head is emb and head.dtype == torch.bfloat16
    assert torch.equal(head, model.emb.weight.detach().to(torch.bfloat16))
    tensors = [*tuned.graph.parameters(), *tuned.graph.buffers()]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len([*model.parameters(), *model.buffers()])
    tuned.load_state_dict(model.state_dict(), strict=True)  # the original keys load strictly


def test_restore_layout_reties_split_weights_and_marks_buffers_non_persistent():
    from tctune.capture import capture
    from tctune.tuned import restore_layout, state_layout

    model = TwoHeads().eval()
    gm = capture(model, _inputs(2))
    gm.head.weight = torch.nn.Parameter(gm.emb.weight.detach().clone())  # what a copying pass leaves
    gm.register_buffer("scale", gm.scale.clone())  # persistent again
    assert gm.head.weight is not gm.emb.weight and "scale" in gm.state_dict()
    layout = state_layout(model)
    assert layout == {"non_persistent": ["scale"], "tied": [["emb.weight", "head.weight"]]}
    restore_layout(gm, layout)
    assert gm.head.weight is gm.emb.weight and "scale" not in gm.state_dict()
    with torch.no_grad():
        gm.head.weight.mul_(2)  # a different value is never tied
    gm.head.weight = torch.nn.Parameter(gm.emb.weight.detach() * 3)
    restore_layout(gm, layout)
    assert gm.head.weight is not gm.emb.weight


def test_callable_example_inputs_and_default_batch_sizes(tmp_path):
    torch.manual_seed(0)  # the weights: not whatever the earlier tests left the global RNG at
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 3))
    tuned = tctune.optimize(model, lambda b: (torch.randn(b, 12),), batch_sizes=[3], trials=2, runtimes="eager",
                            no_export=True, quiet=True, out=tmp_path / "o")
    assert tuned.report["config"]["batch_sizes"] == [3]
    assert tuned.out_dir == str(tmp_path / "o") and (tmp_path / "o" / "report.json").is_file()
    x = torch.randn(5, 12, generator=torch.Generator().manual_seed(1))  # fresh rows, the same in every run
    assert _rel(tuned(x), model(x).detach()) <= 1e-2


def test_without_out_the_temporary_folder_is_named_and_returned(tmp_path, monkeypatch, capsys):
    """A folder the caller did not choose is said once (a warning) and kept on the returned module; what the API
    prints speaks in its keywords (no_export=True), never in the command's flags, and names no ONNX files when
    nothing is exported."""
    import logging
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp creates it
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("tctune")
    logger.addHandler(handler)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(12, 3))
        tuned = tctune.optimize(model, (torch.randn(3, 12),), trials=1, runtimes="eager", no_export=True)
    finally:
        logger.removeHandler(handler)
    out = Path(tuned.out_dir)
    assert out.parent == tmp_path and out.name.startswith("tctune_Sequential_") and (out / "report.json").is_file()
    said = [r for r in records if str(out) in r.getMessage()]
    assert len(said) == 1 and "out=" in said[0].getMessage() and said[0].levelno >= logging.WARNING
    assert "ONNX" not in said[0].getMessage()  # no_export=True: no ONNX file is written
    printed = capsys.readouterr().out
    assert "export disabled (no_export=True)" in printed
    assert not [line for line in [printed, *(r.getMessage() for r in records)] if "--" in line]


def test_tuple_inputs_are_resized_along_the_batch():
    from tctune.modelfile import ModelFile

    ids, feats = _inputs(3)
    mf = ModelFile.from_module(TwoHeads(), (ids, feats))
    big = mf.inputs(7)
    assert [t.shape[0] for t in big] == [7, 7] and torch.equal(big[0][3:6], ids) and torch.equal(big[1][:2], feats[:2])
    assert torch.equal(mf.inputs(2)[0], ids[:2])


def test_unknown_option_is_a_type_error_naming_the_valid_ones():
    with pytest.raises(TypeError, match=r"batch_size\b.*valid: .*batch_sizes.*max_error"):
        tctune.optimize(torch.nn.Linear(2, 2), (torch.randn(2, 2),), batch_size=4)


def test_a_misspelt_option_names_the_closest_one_before_anything_runs(monkeypatch):
    def never(*a, **k):
        raise AssertionError("the model was used before the options were checked")

    monkeypatch.setattr("tctune.modelfile.ModelFile.from_module", never)
    with pytest.raises(TypeError, match=r"unknown option\(s\) trails \(did you mean 'trials'\?\); valid: out, "):
        tctune.optimize(torch.nn.Linear(2, 2), (torch.randn(2, 2),), trails=4)
    with pytest.raises(TypeError, match=r"no_exprot \(did you mean 'no_export'\?\)"):
        tctune.optimize("model.py", no_exprot=True)


def test_example_inputs_given_by_keyword_is_the_same_argument(tmp_path):
    """The README writes ``tctune.optimize(model, example_inputs, **options)``: ``example_inputs=`` as a keyword
    was an "unknown option" TypeError listing every valid option but it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 3))
    x = torch.randn(3, 12)
    tuned = tctune.optimize(model, example_inputs=(x,), runtimes="eager", trials=1, no_export=True, quiet=True,
                            out=tmp_path / "o")
    with torch.no_grad():
        torch.testing.assert_close(tuned(x).float(), model(x), rtol=5e-2, atol=5e-2)
    with pytest.raises(TypeError, match="example_inputs twice"):
        tctune.optimize(model, (x,), example_inputs=(x,))


def test_bad_option_value_names_the_field():
    with pytest.raises(tctune.UsageError) as info:
        tctune.optimize(torch.nn.Linear(2, 2), (torch.randn(2, 2),), trials=0)
    assert info.value.field == "trials"


@pytest.mark.parametrize("value,sizes", [("8,32", (8, 32)), ("16-64", (16, 32, 64)), ([32, 8], (32, 8)), (4, (4,))])
def test_batch_sizes_take_the_flag_strings_and_lists(value, sizes):
    from tctune.api import tune_config

    assert tune_config({"batch_sizes": value}, out_dir="unused").batch_sizes == sizes


@pytest.mark.parametrize("value,why", [("8,abc", "'abc' is not a positive integer"),
                                       ("256-16", "the range must go up, e.g. 16-256")])
def test_bad_batch_sizes_string_gives_the_commands_message_in_keywords(value, why):
    """The command's message (its parser), naming the keyword argument as the caller wrote it, not the flag."""
    from tctune.api import api_words
    from tctune.cli.common import parse_batch_sizes

    with pytest.raises(tctune.UsageError) as info:
        tctune.optimize(torch.nn.Linear(2, 2), (torch.randn(2, 2),), batch_sizes=value)
    with pytest.raises(tctune.UsageError) as cli:
        parse_batch_sizes(value)
    assert str(cli.value).startswith(f"invalid --batch-sizes {value!r}: ")  # the command's wording
    assert str(info.value) == api_words(str(cli.value)) and why in str(info.value)
    assert str(info.value).startswith(f"invalid batch_sizes={value!r}: ") and "--" not in str(info.value)
    assert info.value.field == "batch_sizes"


@pytest.mark.parametrize("option,said,field", [({"timeout": -1}, "timeout must be a positive number of seconds",
                                                "timeout_s"),
                                               ({"compile_budget": 0}, "compile_budget must be a positive", "compile_budget_s"),
                                               ({"runtimes": ""}, "runtimes has unknown (empty)", "runtimes")])
def test_option_errors_name_the_keyword_not_the_config_field(option, said, field):
    """A value the configuration rejects is named by the keyword that set it (timeout, not TuneConfig's timeout_s);
    ``err.field`` stays the field."""
    with pytest.raises(tctune.UsageError) as info:
        tctune.optimize(torch.nn.Linear(2, 2), (torch.randn(2, 2),), **option)
    text = str(info.value)
    assert text.startswith(said) and "--" not in text and info.value.field == field
    assert field == next(iter(option)) or field not in text


@pytest.fixture()
def plain_logging(monkeypatch):
    """Call it first in the test: logging as in a plain Python session, no handler on the root logger (pytest adds
    its capture handlers there as the test's call starts, after fixtures) nor on tctune's, which propagates and has
    no level of its own. Returns tctune's logger; everything is restored afterwards."""
    import logging

    ours = logging.getLogger("tctune")
    level = ours.level

    def plain() -> logging.Logger:
        monkeypatch.setattr(logging.getLogger(), "handlers", [])
        monkeypatch.setattr(ours, "handlers", [])
        monkeypatch.setattr(ours, "propagate", True)
        ours.setLevel(logging.NOTSET)  # setLevel (not setattr): clears the loggers' cached levels
        return ours

    yield plain
    ours.setLevel(level)


def test_console_log_shows_tctune_lines_only_where_nothing_else_would(plain_logging, capsys):
    import logging

    from tctune.console import console_log

    log = plain_logging()
    with console_log(quiet=False):
        log.info("shown %d", 1)
    with console_log(quiet=True):
        log.info("hidden")
        log.warning("warned")
    assert capsys.readouterr().err == "tctune: shown 1\ntctune: warned\n"
    assert log.handlers == [] and log.level == logging.NOTSET  # as it was
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)  # the caller configured logging: its set-up decides
    with console_log(quiet=False):
        log.warning("to the caller's handler")
    assert capsys.readouterr().err == "" and [r.getMessage() for r in records] == ["to the caller's handler"]


@pytest.mark.parametrize("case", ["every candidate tried", "timeout"])
def test_the_search_says_why_it_ended_before_the_bars_total_as_the_command_does(tmp_path, capsys, plain_logging,
                                                                                   case):
    """The progress bar counts --trials plus the baselines; a search that ends below that total says why, in the
    command's log line (the loop's), which the API shows too, in its keywords."""
    import re

    plain_logging()
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 3))
    options = {"trials": 40} if case == "every candidate tried" else {"trials": 3, "timeout": 1e-9}
    tuned = tctune.optimize(model, (torch.randn(3, 12),), runtimes="eager", no_export=True, out=tmp_path / "o",
                            **options)
    err = capsys.readouterr().err
    if case == "every candidate tried":  # eager on the CPU: a few candidates, all measured long before 40 trials
        assert re.search(r"tctune: every one of the \d+ candidates of this search space was tried: \d+ measured", err), err
        # the bar's total is what can run (the space's candidates), not --trials plus the baselines: it ends full
        ends = re.findall(r"trials: *\d+%\|[^|]*\| *(\d+)/(\d+)", err)
        assert ends and ends[-1][0] == ends[-1][1] and int(ends[-1][1]) < 40, ends[-3:]
    else:  # the deadline passed while the plain baselines (never cut short) ran: no searched trial started
        said = re.findall(r"tctune: timeout 1e-09 s reached: 0 of (\d+) searched trial\(s\) ran \(.+\); a longer "
                          r"timeout, or another run with the same out, adds the rest\n", err)
        assert len(said) == 1 and int(said[0]) >= 1, err
        assert not [t for t in tuned.report["trials"] if not t.get("baseline")]
    assert "--" not in err


def test_a_rerun_into_an_exhausted_search_space_draws_no_empty_progress_bar(tmp_path, capsys, plain_logging):
    """Run twice into one folder on a small enumerated space: the second run has no baseline and no candidate
    left. It said so, then drew a bar reading ``trials: 0trial [00:00, ?trial/s]``; now the line alone."""
    plain_logging()
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 3))
    args = dict(runtimes="eager", no_export=True, out=tmp_path / "o", trials=40)
    tctune.optimize(model, (torch.randn(3, 12),), **args)
    capsys.readouterr()
    tctune.optimize(model, (torch.randn(3, 12),), **args)
    err = capsys.readouterr().err
    assert "candidates of this search space were already tried" in err, err
    assert "0trial" not in err and "trials:" not in err, err


@pytest.mark.parametrize("handler", ["api", "command"])
def test_log_lines_print_above_the_progress_bar_not_on_its_line(tmp_path, capsys, plain_logging, monkeypatch,
                                                                  handler):
    """A line logged while the trials bar is drawn (here: the timeout reached during the plain baselines) starts
    its own line: tqdm clears the bar (``\\r``), writes the line, then redraws the bar below it. Both console
    set-ups: the API's (``console_log``) and the command's (``console_handler`` on a non-propagating logger)."""
    import re

    from tctune.console import console_handler

    log = plain_logging()
    if handler == "command":
        log.addHandler(console_handler())
        monkeypatch.setattr(log, "propagate", False)
        log.setLevel("INFO")
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 3))
    try:
        tctune.optimize(model, (torch.randn(3, 12),), runtimes="eager", no_export=True, out=tmp_path / "o",
                        trials=3, timeout=1e-9)
    finally:
        log.handlers.clear()
    err = capsys.readouterr().err
    assert "trials:" in err and "timeout 1e-09 s reached" in err, err  # the bar was drawn; the line was said
    starts = [m.start() for m in re.finditer("tctune: ", err)]
    assert starts and [err[i - 1:i + 40] for i in starts if i and err[i - 1] not in "\r\n"] == [], err


def test_submodules_are_attributes_after_a_bare_import():
    code = ("import sys, tctune\n"
            "assert 'tctune.backend' not in sys.modules\n"  # lazy: `import tctune` stays fast
            "assert callable(tctune.backend.backend) and isinstance(tctune.backend.reports, list)\n"
            "assert 'tctune.backend' in sys.modules and tctune.optimize is tctune.api.optimize\n"
            "try:\n    tctune.no_such_name\nexcept AttributeError as e:\n    print('ok', e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok module 'tctune' has no attribute 'no_such_name'", r.stderr


def test_tctune_optimize_is_the_function_after_the_submodule_is_imported():
    code = ("import tctune.optimize, tctune.cli.optimize, inspect\n"
            "from tctune import optimize\n"
            "import tctune.api, tctune\n"
            "from tctune.optimize import optimize_model, check_out_dir\n"
            "assert optimize is tctune.api.optimize and tctune.optimize is tctune.api.optimize, optimize\n"
            "assert inspect.isfunction(optimize)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def _rewrite_manifest(path: Path, **changes) -> None:
    with zipfile.ZipFile(path) as z:
        items = [(i, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for info, data in items:
            if info.filename.endswith("extra/" + MANIFEST):
                data = json.dumps({**json.loads(data), **changes}).encode()
            z.writestr(info, data)


def test_save_load_in_process_and_capability_warning(tuned_bf16, tmp_path, monkeypatch):
    _, tuned = tuned_bf16
    path = tctune.save(tuned, tmp_path / "m.pt2")
    x = _inputs(5, 21)
    loaded = tctune.load(path)
    for a, b in zip(torch.utils._pytree.tree_leaves(loaded(*x)), torch.utils._pytree.tree_leaves(tuned(*x))):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # the tied bf16 table is saved and loaded once, shared by both names
    assert loaded.graph.emb.weight is loaded.graph.head.weight and loaded.graph.emb.weight.dtype == torch.bfloat16
    assert loaded.config == tuned.config and loaded.report["best"] == tuned.report["best"]
    _rewrite_manifest(path, compute_capability="9.0", hardware="NVIDIA H200", arch="hopper")
    monkeypatch.setattr("tctune.tuned._current_capability", lambda device: "8.6")
    with pytest.warns(RuntimeWarning, match=r"tuned for compute capability 9\.0 \(NVIDIA H200.*bf16.*compute capability 8\.6"):
        tctune.load(path)



def test_inputs_by_forward_argument_name_before_and_after_save_load(tuned_bf16, tmp_path):
    # tuned(ids=..., feats=...) as the model is called; the names survive save/load; a wrong keyword is one
    # TypeError naming the tuned inputs.
    _, tuned = tuned_bf16
    ids, feats = _inputs(5, 31)
    assert tuned.input_names == ["ids", "feats"]
    loaded = tctune.load(tctune.save(tuned, tmp_path / "k.pt2"))
    assert loaded.input_names == ["ids", "feats"]
    for m in (tuned, loaded):
        want = torch.utils._pytree.tree_leaves(m(ids, feats))
        for call in (lambda: m(ids=ids, feats=feats), lambda: m(feats=feats, ids=ids), lambda: m(ids, feats=feats)):
            for a, b in zip(torch.utils._pytree.tree_leaves(call()), want):
                assert torch.equal(a, b)
        for bad, said in ((lambda: m(ids, ids=ids, feats=feats), "['ids'] given by position and by name"),
                          (lambda: m(ids=ids), "missing ['feats']"),
                          (lambda: m(ids, feats, mask=feats), "['mask'] not among them")):
            with pytest.raises(TypeError, match=r"tuned with: ids, feats; ") as e:
                bad()
            assert said in str(e.value)
    anonymous = TunedModule(tuned.graph, tuned.config, tuned.runtime)
    with pytest.raises(TypeError, match="by position only"):
        anonymous(ids=ids, feats=feats)


def test_load_refuses_a_file_that_is_not_a_tctune_archive(tmp_path):
    p = tmp_path / "x.pt2"
    p.write_bytes(b"not a zip")
    with pytest.raises(tctune.UsageError, match="tctune.save"):
        tctune.load(p)


MODEL_SOURCE = textwrap.dedent('''
    import torch

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(40, 16)
            self.mix = torch.nn.Linear(16, 16)
            self.out = torch.nn.Linear(16, 40, bias=False)
            self.out.weight = self.emb.weight
            self.register_buffer("temperature", torch.tensor(1.5), persistent=False)

        def forward(self, ids):
            h = torch.tanh(self.mix(self.emb(ids)))
            return {"logits": self.out(h) / self.temperature, "hidden": h}
''')

SAVE = textwrap.dedent('''
    import functools, sys, torch, tctune
    import tctune.optimize
    from tctune import measure
    import tctune.search.evaluate as ev
    ev.time_call = functools.partial(measure.time_call, repeats=1, single_calls=2, max_iterations=3, warmup=1)
    sys.path.insert(0, sys.argv[1])
    from usermodel import Tied
    from tctune.search import results
    def fp32_graph(study, *a, **k):  # the winner: tctune's FP32 graph (one dtype: the tie must survive)
        return next(t for t in study.trials if results.is_feasible(t) and t.params["graph_passes"]
                    and t.params["precision"] == "fp32")
    sys.modules["tctune.optimize"].best_trial = fp32_graph
    torch.manual_seed(0)
    m = Tied()
    ids = torch.randint(0, 40, (4, 7))
    tuned = tctune.optimize(m, (ids,), trials=4, runtimes="eager", no_export=True, quiet=True, out=sys.argv[2] + "/o")
    tctune.save(tuned, sys.argv[2] + "/tuned.pt2")
    x = torch.randint(0, 40, (3, 7))
    torch.save({"x": x, "y": tuned(x), "keys": sorted(m.state_dict())}, sys.argv[2] + "/expected.pt")
''')

LOAD = textwrap.dedent('''
    import sys, torch, tctune
    try:
        import usermodel
    except ImportError:
        pass
    else:
        raise SystemExit("the model's module must not be importable here")
    loaded = tctune.load(sys.argv[1] + "/tuned.pt2")
    exp = torch.load(sys.argv[1] + "/expected.pt")
    y = loaded(exp["x"])
    assert list(y) == ["logits", "hidden"] and all(torch.equal(y[k], exp["y"][k]) for k in y), "outputs differ"
    assert sorted(loaded.state_dict()) == exp["keys"], sorted(loaded.state_dict())
    assert "temperature" in dict(loaded.graph.named_buffers()) and "temperature" not in loaded.state_dict()
    assert loaded.graph.emb.weight is loaded.graph.out.weight, "tied weights were split"
    print("ok")
''')


@pytest.mark.slow
def test_save_then_load_in_a_process_without_the_model_code(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "usermodel.py").write_text(MODEL_SOURCE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", SAVE, str(src), str(tmp_path)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (src / "usermodel.py").unlink()  # and it is not on the path below either
    r = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


Pair = __import__("collections").namedtuple("Pair", "y extra")


class NamedOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        y = self.b(torch.relu(self.a(x)))
        return Pair(y, {"norm": y.norm(dim=-1)})


def test_model_as_written_autocast_winner_and_a_namedtuple_output_survive_save_and_load(tmp_path, monkeypatch):
    from tctune.search import results

    def as_written_bf16(study, *a, **k):
        return next(t for t in study.trials if results.is_feasible(t) and not t.params["graph_passes"]
                    and t.params["precision"] == "bf16")

    monkeypatch.setattr(sys.modules["tctune.optimize"], "best_trial", as_written_bf16)
    torch.manual_seed(1)
    model = NamedOut()
    tuned = tctune.optimize(model, (torch.randn(4, 16),), trials=4, runtimes=["eager"], no_export=True, quiet=True,
                            out=tmp_path / "o")
    assert (tuned.config.graph_passes, tuned.config.precision, tuned.autocast) == (False, "bf16", "bf16")
    x = torch.randn(6, 16)
    out = tuned(x)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            amp = model(x)
    # output_dtype "compute" (the default): the outputs autocast returns, as the search timed them
    assert type(out) is Pair and out.y.dtype == amp.y.dtype == torch.bfloat16
    assert out.extra["norm"].dtype == amp.extra["norm"].dtype
    assert torch.equal(out.y, amp.y) and _rel(out.y, ref.y) <= 1e-2  # autocast, as the search measured
    loaded = tctune.load(tctune.save(tuned, tmp_path / "m.pt2"))
    assert loaded.manifest["autocast"] == "bf16"
    back = loaded(x)
    # the namedtuple class has no serialized name: the loaded module returns the plain containers
    assert type(back) is tuple and list(back[1]) == ["norm"] and back[0].dtype == torch.bfloat16
    assert loaded.manifest["output_dtype"] == "compute" and back[1]["norm"].dtype == out.extra["norm"].dtype
    assert _rel(back[0], out.y) <= 1e-2 and _rel(back[1]["norm"], out.extra["norm"]) <= 1e-2
    # a wrong input to the live module as written: judged by its FP32 capture, as the loaded module is
    for m in (tuned, loaded):
        with pytest.raises(ValueError, match=r"input 0 \(x\) has shape \(4, 15\), the tuned module takes "
                                             r"\(batch, 16\)"):
            m(torch.randn(4, 15))



class SeqPool(torch.nn.Module):
    """(batch, seq, 12) -> (batch, 3): a linear per token, then a mean over the sequence."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = torch.nn.Linear(12, 20), torch.nn.Linear(20, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x)).mean(1))


@pytest.mark.parametrize("winner", ["graph_bf16", "as_written"])
def test_save_keeps_the_declared_dynamic_dims(winner, tmp_path, monkeypatch):
    # dynamic_shapes declares seq: the tuned module, and the file tctune.save writes, accept any length in the
    # Dim's range, not only the example's; the manifest names the symbol in each input's shape.
    from torch.export import Dim

    if winner == "graph_bf16":
        _pick_graph_bf16(monkeypatch)
    torch.manual_seed(0)
    model = SeqPool().eval()
    seq = Dim("seq", min=2, max=64)
    tuned = tctune.optimize(model, (torch.randn(4, 10, 12),), trials=2, runtimes=["eager"], no_export=True,
                            quiet=True, dynamic_shapes=({1: seq},), out=tmp_path / "o")
    assert tuned.config.graph_passes == (winner == "graph_bf16")
    loaded = tctune.load(tctune.save(tuned, tmp_path / "d.pt2"))
    assert loaded.manifest["inputs"] == [{"shape": ["batch", "seq", 12], "dtype": "float32"}]
    for b, length in ((3, 10), (5, 7), (2, 33)):
        x = torch.randn(b, length, 12)
        with torch.no_grad():
            ref = model(x)
        got, back = tuned(x), loaded(x)
        assert back.shape == got.shape == (b, 3)
        assert _rel(got.float(), ref) <= 1e-2 and _rel(back.float(), got.float()) <= 1e-2


def test_a_model_file_path_returns_a_tuned_module_too(tmp_path):
    f = tmp_path / "mlp.py"
    f.write_text(textwrap.dedent('''
        import torch
        def build_model():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Tanh(), torch.nn.Linear(20, 2))
        def example_inputs(batch_size):
            return (torch.randn(batch_size, 10),)
    '''))
    tuned = tctune.optimize(str(f), batch_sizes=[4], trials=2, runtimes="eager", no_export=True, quiet=True,
                            out=tmp_path / "o")
    assert isinstance(tuned, TunedModule) and tuned.report["model"]["path"] == str(f.resolve())
    assert tuned(torch.randn(3, 10)).shape == (3, 2)
    with pytest.raises(TypeError, match="score"):
        tctune.optimize(str(f), score=lambda m: 1.0)


def test_a_cuda_graph_runtime_runs_without_it_on_cpu_inputs_and_warns(tuned_bf16):
    _, tuned = tuned_bf16
    graphed = TunedModule(tuned.graph, tuned.config.but(runtime="cudagraphs"), "cudagraphs", out_spec=tuned.out_spec,
                          out_dtypes=tuned.out_dtypes)
    x = _inputs(3, 9)
    with pytest.warns(RuntimeWarning, match="not on a CUDA GPU"):
        out = graphed(*x)
    assert torch.equal(out["logits"], tuned(*x)["logits"])


def test_every_optimize_flag_has_an_api_keyword():
    """The API's keywords are the CLI's long flags with ``_`` (the issue's contract): a flag added to
    ``tctune optimize`` without its keyword fails here."""
    from tctune.api import API_OPTIONS, OPTIONS
    from tctune.cli import parser

    sub = next(a for a in parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    flags = {o[2:].replace("-", "_") for a in sub.choices["optimize"]._actions for o in a.option_strings
             if o.startswith("--")}
    not_for_a_module = {"help", "debug", "worker_config"}  # console and worker-process plumbing
    assert flags - not_for_a_module <= set(OPTIONS) | set(API_OPTIONS)


def test_api_accuracy_options_reach_the_config():
    from tctune.api import tune_config

    cfg = tune_config({"min_score_ratio": 0.98, "max_mismatch_rate": 0.01}, out_dir="unused")
    assert (cfg.min_score_ratio, cfg.max_mismatch_rate, cfg.min_score) == (0.98, 0.01, None)
    assert tune_config({"min_score": 0.5}, out_dir="unused").min_score == 0.5
    with pytest.raises(tctune.UsageError, match="both given"):  # an absolute min_score would silently replace the ratio
        tune_config({"min_score_ratio": 0.98, "min_score": 0.5}, out_dir="unused")


@pytest.mark.parametrize("quiet", [False, True])
def test_the_winner_summary_is_printed_as_the_command_prints_it_unless_quiet(tmp_path, capsys, quiet):
    from tctune.cli.optimize import _summary

    model = torch.nn.Sequential(torch.nn.Linear(12, 3))
    tuned = tctune.optimize(model, (torch.randn(3, 12),), trials=1, runtimes="eager", no_export=True, quiet=quiet,
                            out=tmp_path / "o")
    printed = capsys.readouterr().out
    summary = _summary(tuned.report, tmp_path / "o")  # the command's summary of the same report
    assert summary.startswith("best: ") and f"report: {tmp_path / 'o' / 'report.md'}" in summary
    # no export at all is said as such, not on a line labelled TensorRT
    assert "export disabled (--no-export)" in summary.splitlines() and "TensorRT" not in summary
    if quiet:
        assert "best: " not in printed and "report: " not in printed
    else:  # the command's summary, in the API's terms (no_export=True where the command says --no-export)
        from tctune.api import api_words

        assert printed.count(api_words(summary)) == 1, printed
        assert "--no-export" in summary and "--no-export" not in printed


@pytest.mark.parametrize("bad", [{"batch_sizes": "8,,32"}, {"autotune": "maybe"}, {"mode": "train"}])
def test_a_rejected_call_without_out_leaves_no_temporary_folder(bad, tmp_path, monkeypatch):
    import tempfile

    import tctune
    from tctune.errors import UsageError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp would put tctune_<name>_*
    with pytest.raises(UsageError):
        tctune.optimize(torch.nn.Linear(4, 2), (torch.randn(2, 4),), **bad)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option,kind", [({"trials": "3"}, "an integer, got '3' (str)"),
                                         ({"seed": 1.5}, "an integer, got 1.5 (float)"),
                                         ({"timeout": "60"}, "a number, got '60' (str)"),
                                         ({"max_error": True}, "a number, got True (bool)"),
                                         ({"min_score": "0.9"}, "a number, got '0.9' (str)")])
def test_a_number_option_of_another_type_is_one_error_naming_the_keyword(option, kind, tmp_path, monkeypatch):
    """Not Python's "'<' not supported between instances of 'str' and 'int'" from a range check."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(tctune.UsageError) as info:
        tctune.optimize(torch.nn.Linear(4, 2), (torch.randn(2, 4),), **option)
    keyword = next(iter(option))
    assert str(info.value) == f"{keyword} must be {kind}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option,meant", [({"max_error": 2}, "did you mean 0.02 (2 %)?"),
                                          ({"max_error_fp8": 5.0}, "did you mean 0.05 (5 %)?"),
                                          ({"max_error": 1}, "did you mean 0.01 (1 %)?"),
                                          ({"max_error": 250}, "e.g. 0.01 for 1 %")])
def test_an_error_limit_of_1_or_more_is_one_error_suggesting_the_fraction(option, meant, tmp_path, monkeypatch):
    """max_error=2 (200 %: a percentage typed as the fraction) let any output through, silently."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(tctune.UsageError) as info:
        tctune.optimize(torch.nn.Linear(4, 2), (torch.randn(2, 4),), **option)
    (keyword, value), = option.items()
    assert str(info.value) == (f"{keyword} must be below 1, got {value:g}: it is the largest relative L2 error "
                               f"against the FP32 reference, as a fraction (0.01 = 1 %); {meant}")
    assert info.value.field == keyword and list(tmp_path.iterdir()) == []


def test_an_error_limit_below_1_is_taken_as_given():
    from tctune.api import tune_config

    cfg = tune_config({"max_error": 0.999, "max_error_fp8": 1e-6}, out_dir="unused")
    assert (cfg.max_error, cfg.max_error_fp8) == (0.999, 1e-6)


def test_numpy_numbers_are_numbers():
    import numpy as np

    from tctune.api import tune_config

    cfg = tune_config({"trials": np.int64(3), "max_error": np.float32(0.5)}, out_dir="unused")
    assert (cfg.trials, cfg.max_error) == (3, 0.5)


@pytest.mark.parametrize("option", [{"min_score": 0.5}, {"min_score_ratio": 0.9}])
def test_a_score_limit_without_a_score_is_refused_before_anything_runs(option, tmp_path, monkeypatch):
    """Without score= the relative L2 limit decides: a score limit would be silently ignored."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    keyword = next(iter(option))
    with pytest.raises(tctune.UsageError) as info:
        tctune.optimize(torch.nn.Linear(4, 2), (torch.randn(2, 4),), quiet=True, **option)
    text = str(info.value)
    assert text.startswith(f"{keyword} needs a score(model) metric, and <Linear> gives none: ")
    assert "(max_error) decides" in text and "fix: pass score=" in text and "--" not in text
    assert info.value.field == keyword and list(tmp_path.iterdir()) == []


def test_a_score_that_is_not_a_function_is_refused_before_the_model_runs(tmp_path, monkeypatch):
    """score=5 was called only after the FP32 model ran ("'int' object is not callable"): one error up front,
    naming the keyword and the contract; a ModelFile built in Python with such a score gets a ModelFileError."""
    import dataclasses
    import tempfile

    from tctune.errors import ModelFileError
    from tctune.modelfile import ModelFile
    from tctune.optimize import optimize_model
    from tctune.search import TuneConfig

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model, calls = torch.nn.Linear(4, 2), []
    model.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(tctune.UsageError) as info:
        tctune.optimize(model, (torch.randn(2, 4),), quiet=True, score=5)
    text = str(info.value)
    assert text.startswith("score=5 is an int, not a function") and "score(model) -> float (higher is better)" in text
    assert "fix: pass score=your_metric" in text and "--" not in text
    assert calls == [] and list(tmp_path.iterdir()) == []  # nothing ran, no folder made
    mf = dataclasses.replace(ModelFile.from_module(model, (torch.randn(2, 4),)), path=Path("m.py"), score="top1")
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(2,), trials=1, quiet=True, export=False)
    with pytest.raises(ModelFileError, match=r"m.py: score is a str, not a function\n  expected: def score\(model"):
        optimize_model(mf, cfg)
    assert calls == [] and list(tmp_path.iterdir()) == []


# --- inputs by forward's argument names: a dict, or a Mapping like a tokenizer's BatchEncoding ----------------

class _TextEncoder(torch.nn.Module):
    """forward(input_ids, attention_mask, token_type_ids=None), as a text encoder takes its tokenizer's output."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.types = torch.nn.Embedding(2, 16)
        self.proj = torch.nn.Linear(16, 8)

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        h = self.emb(input_ids)
        if token_type_ids is not None:
            h = h + self.types(token_type_ids)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.proj((h * m).sum(1) / m.sum(1).clamp_min(1))


class _Encoding(Mapping):
    """Read-only, not a dict, keys in the tokenizer's order (not forward's): what a ``BatchEncoding`` is."""

    def __init__(self, data: dict):
        self._data = data

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


def _encoded(b: int, seed: int, types: bool) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, 6, generator=g) > 0.3).long()
    mask[:, 0] = 1  # every row has a token
    out = {"input_ids": torch.randint(0, 32, (b, 6), generator=g)}
    if types:
        out["token_type_ids"] = torch.randint(0, 2, (b, 6), generator=g)  # before the mask, as tokenizers order it
    out["attention_mask"] = mask
    return out


@pytest.mark.parametrize("make,types", [(dict, True), (_Encoding, False)])
def test_a_mapping_of_inputs_is_taken_by_forwards_argument_names(make, types, tmp_path):
    """tctune.optimize(model, tokenizer(...)) refused the mapping with no hint; its keys are forward's names, in
    the tokenizer's order (token_type_ids before attention_mask) where forward takes attention_mask first."""
    torch.manual_seed(0)
    model = _TextEncoder().eval()
    tuned = tctune.optimize(model, make(_encoded(3, 1, types)), trials=1, runtimes="eager", no_export=True,
                            quiet=True, out=tmp_path / "o")
    names = ["input_ids", "attention_mask", "token_type_ids"][:3 if types else 2]
    assert tuned.input_names == names and tuned.report["config"]["batch_sizes"] == [3]  # the mapping's batch
    for b, seed in ((3, 7), (5, 8)):  # fresh rows, the tuned batch and another
        enc = make(_encoded(b, seed, types))
        with torch.no_grad():
            ref = model(**enc)
        assert _rel(tuned(**enc), ref) <= 1e-2
        assert torch.equal(tuned(**enc), tuned(*(enc[n] for n in names)))  # by name = in forward's order
    with pytest.raises(TypeError, match=r"got a (dict|_Encoding) as input 0\n  fix: tuned\(\*\*inputs\)"):
        tuned(enc)


class _Decoder(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, attention_mask=None):
        return input_ids.float() * attention_mask


@pytest.mark.parametrize("model,inputs,said", [
    (_Decoder(), {"input_ids": torch.ones(2, 3), "attention_mask": torch.ones(2, 3)},
     "_Decoder: example_inputs gives input_ids, attention_mask but not past_key_values, which forward takes before "
     "'attention_mask'"),
    (_TextEncoder(), {"input_ids": [[1, 2]], "attention_mask": [[1, 1]]},
     "_TextEncoder: example_inputs: 'input_ids' is a list, 'attention_mask' is a list, not a tensor\n  fix: tensors "
     "only (a Hugging Face tokenizer returns them with return_tensors='pt')"),
    (_TextEncoder(), {"input_ids": torch.ones(2, 3, dtype=torch.long), "labels": torch.ones(2)},
     "_TextEncoder: example_inputs: 'labels' not among forward's positional arguments (input_ids, attention_mask, "
     "token_type_ids)"),
])
def test_a_mapping_that_cannot_be_put_in_forwards_order_is_one_error_before_anything_runs(model, inputs, said,
                                                                                           tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(tctune.ModelFileError) as info:
        tctune.optimize(model, inputs)
    assert str(info.value).startswith(said) and "\n  fix: " in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_wrong_inputs_to_a_tuned_or_loaded_module_name_the_input_and_the_fix(tuned_bf16, tmp_path):
    """A missing batch dimension, a wrong fixed dimension or a half-precision input reached the graph's own
    guard (``AssertionError: Guard failed: ...``) or kernel (``expected scalar type Half``) before; now one
    ValueError names the input, what the module takes and the fix, before and after save / load."""
    _, tuned = tuned_bf16
    ids, feats = _inputs(5, 41)
    loaded = tctune.load(tctune.save(tuned, tmp_path / "w.pt2"))
    for m in (tuned, loaded):
        with pytest.raises(ValueError, match=r"input 1 \(feats\) has shape \(6, 32\), the tuned module takes "
                                             r"\(batch, 6, 32\) \(a missing batch dimension\?\)") as e:
            m(ids, feats[0])
        assert "fix: call it with the inputs it was tuned with: ids (batch, 6) int64, feats (batch, 6, 32)" \
            in str(e.value)
        assert str(e.value).endswith("(batch: any size)")  # no '*' dimension to explain
        with pytest.raises(ValueError, match=r"input 1 \(feats\) has shape \(5, 6, 16\)"):
            m(ids, feats[..., :16])
        got = m(ids, feats)  # the right inputs still run
        assert got["logits"].shape[0] == 5
