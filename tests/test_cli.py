"""`tctune` end to end on the CPU: optimize the seed CNN, resume, detect, and one clear error per bad input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tctune.cli import main, parse_batch_sizes
from tctune.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
SEED_CNN = ROOT / "recipes" / "seed_cnn.py"


def run_cli(*args, cwd=None):
    """Run the real console entry point in a subprocess (as a user would)."""
    return subprocess.run([sys.executable, "-m", "tctune", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=600)


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed_cnn")
    # --trials counts searched trials besides the plain baselines (6 here): 2 leave the 8-candidate CPU space
    # unfinished, so the rerun below has trials to add
    r = run_cli("optimize", SEED_CNN, "--out", out, "--batch-sizes", "8,32", "--trials", "2", "--quiet")
    assert r.returncode == 0, r.stderr
    return out, r


def test_optimize_writes_every_output(seed_run):
    out, _ = seed_run
    for name in ("report.json", "report.md", "study.db", "model.onnx", "best_config.json"):
        assert (out / name).is_file(), name


def test_bench_times_the_onnx_optimize_wrote(seed_run, ort):
    out, _ = seed_run
    onnx = out / "model.fp32.onnx" if (out / "model.fp32.onnx").exists() else out / "model.onnx"
    assert (out / "runner.py").is_file() and Path(str(onnx) + ".manifest.json").is_file()
    r = run_cli("bench", onnx, "--batch", "4", "--iters", "3", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["batch_size"] == 4 and row["throughput"] > 0 and row["artifact"] == onnx.name


def test_the_first_export_after_optimize_reuses_its_onnx_and_runner(seed_run):
    """optimize's model.onnx manifest carries the cache key `tctune export` checks: exporting the same
    configuration reuses the file (no rebuild) and leaves runner.py as it was."""
    out, _ = seed_run
    manifest = json.loads((out / "model.onnx.manifest.json").read_text())
    assert manifest["cache_key"]["format"] == "onnx" and manifest["cache_key"]["digest"]
    before = {name: (out / name).read_bytes() for name in ("model.onnx", "runner.py")}
    stamps = {name: (out / name).stat().st_mtime_ns for name in before}
    r = run_cli("export", SEED_CNN, "--config", out / "best_config.json", "--format", "onnx", "--json")
    assert r.returncode == 0, r.stderr
    onnx = json.loads(r.stdout)["formats"]["onnx"]
    assert onnx["status"] == "reused" and onnx["files"] == []
    assert {name: (out / name).read_bytes() for name in before} == before
    assert {name: (out / name).stat().st_mtime_ns for name in before} == stamps


def test_report_json_has_the_documented_fields(seed_run):
    out, _ = seed_run
    r = json.loads((out / "report.json").read_text())
    assert r["hardware"]["source"] in ("cpu", "torch", "cuda-python", "target")
    assert {"name", "arch", "compute_capability", "source"} <= set(r["hardware"])
    assert r["baseline"]["precision"] == "fp32" and r["baseline"]["throughput"] > 0
    complete = [t for t in r["trials"] if t["state"] == "COMPLETE"]
    assert len(complete) >= 4
    for t in r["trials"]:
        assert {"number", "state", "params", "throughput", "latency_ms", "peak_memory_mib", "max_rel_error", "fail_reason"} <= set(t)
        assert {"batch_size", "precision"} <= set(t["params"])
    assert r["trials"][0]["params"] == {"batch_size": 8, "precision": "fp32", "graph_passes": False, "runtime": "eager"}
    best = r["best"]
    assert best["throughput"] > 0 and best["speedup_vs_baseline"] > 0
    assert best["max_rel_error"] <= 1e-2
    as_written = not best["params"]["graph_passes"] and best["params"]["precision"] == "fp32"
    if best.get("model_cast") or as_written:  # the model cast as a whole or FP32 as written won (timing decides on
        assert r["passes"] == []  # this CPU): its exported graph is that model, no tctune pass
        assert r["artifacts"]["exported_graph"] == ("model_cast" if best.get("model_cast") else "model_as_written")
    else:
        assert {p["name"] for p in r["passes"]} >= {"fold_conv_batchnorm", "pad_linear_dims", "cast_precision"}
    for p in r["passes"]:
        assert all({"node", "reason"} <= set(s) for s in p["skipped"])
    a = r["artifacts"]
    assert a["onnx"].endswith("model.onnx")
    assert a["tensorrt"] is None and a["tensorrt_skipped_reason"]
    assert "onnx_max_abs_error" in a


def test_report_md_has_result_and_trials(seed_run):
    out, _ = seed_run
    md = (out / "report.md").read_text()
    assert "## Result" in md and "## Trials" in md and "FP32 eager" in md


def test_rerun_resumes_the_study(seed_run):
    out, _ = seed_run
    before = json.loads((out / "report.json").read_text())
    r = run_cli("optimize", SEED_CNN, "--out", out, "--batch-sizes", "8,32", "--trials", "2", "--quiet", "--no-export")
    assert r.returncode == 0, r.stderr
    after = json.loads((out / "report.json").read_text())
    assert after["study"]["n_trials"] == before["study"]["n_trials"] + 2
    assert [t["number"] for t in after["trials"][: len(before["trials"])]] == [t["number"] for t in before["trials"]]
    first_before = before["trials"][0]
    first_after = after["trials"][0]
    assert first_after["throughput"] == first_before["throughput"]  # kept, not re-measured


def test_detect_target_h100_json():
    r = run_cli("detect", "--target", "h100", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["arch"] == "Hopper" and d["compute_capability"] == "9.0" and "fp8" in d["tensor_core_precisions"]


def test_detect_without_gpu_exits_zero():
    r = run_cli("detect")
    assert r.returncode == 0
    assert r.stdout.strip()


BAD_FILES = {
    "no_build_model": ("import torch\ndef example_inputs(b):\n    return (torch.randn(b, 4),)\n", "does not define build_model()"),
    "syntax_error": ("import torch\ndef build_model(:\n", "syntax error"),
    "inputs_not_tensors": ("import torch\ndef build_model():\n    return torch.nn.Linear(4, 2)\n"
                           "def example_inputs(b):\n    return [[1.0] * 4] * b\n", "must return a tuple of tensors"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_model_file_gets_one_clear_error(tmp_path, name):
    text, expected = BAD_FILES[name]
    f = tmp_path / f"{name}.py"
    f.write_text(text)
    r = run_cli("optimize", f, "--out", tmp_path / "out", "--trials", "1", "--quiet")
    assert r.returncode == 2  # bad input, like a usage error: a script can tell it from "nothing qualified" (1)
    assert expected in r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert r.stderr.strip().startswith("tctune: error:")


def test_unknown_target_lists_names(tmp_path):
    r = run_cli("optimize", SEED_CNN, "--target", "gtx480", "--out", tmp_path, "--quiet")
    assert r.returncode == 2 and "h100" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,match", [(["--trials", "0"], "--trials"), (["--batch-sizes", "8,x"], "--batch-sizes"),
                                        (["--runtimes", ""], "--runtimes is empty"),
                                        (["--seed", "-1"], "--seed must be an integer from 0 to 4294967295, got -1"),
                                        (["--max-error", "0"], "  fix: give the error you accept as a fraction"),
                                        (["--effective-batch", "3"], "  fix: add --mode train")])
def test_bad_options(tmp_path, args, match):
    r = run_cli("optimize", SEED_CNN, "--out", tmp_path, "--quiet", *args)
    assert r.returncode == 2 and match in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flag,value,meant", [("--max-error", "2", "did you mean 0.02 (2 %)?"),
                                              ("--max-error-fp8", "5", "did you mean 0.05 (5 %)?")])
def test_an_error_limit_of_1_or_more_is_one_usage_error_suggesting_the_fraction(tmp_path, flag, value, meant):
    """``--max-error 2`` (200 % relative error: almost surely 2 % meant) was accepted and let any output through."""
    r = run_cli("optimize", SEED_CNN, "--out", tmp_path / "out", "--quiet", flag, value)
    assert r.returncode == 2 and "Traceback" not in r.stderr and not (tmp_path / "out").exists()
    errors = [line for line in r.stderr.splitlines() if line.startswith("tctune: error:")]
    assert errors == [f"tctune: error: {flag} must be below 1, got {value}: it is the largest relative L2 error "
                      f"against the FP32 reference, as a fraction (0.01 = 1 %); {meant}"]


def test_an_error_limit_below_1_is_taken_as_given():
    from tctune.cli import parser
    from tctune.cli.optimize import config_from_args

    args = parser().parse_args(["optimize", "m.py", "--max-error", "0.5", "--max-error-fp8", "0.99"])
    cfg = config_from_args(args)
    assert (cfg.max_error, cfg.max_error_fp8) == (0.5, 0.99)


@pytest.mark.parametrize("args,said", [
    (["optimize", "m.py", "--trails", "4"], "tctune optimize: error: unrecognized arguments: --trails 4; --trails "
                                            "(did you mean --trials?)"),
    (["optimize", "m.py", "--no-exprot"], "unrecognized arguments: --no-exprot; --no-exprot (did you mean --no-export?)"),
    (["export", "m.py", "--config", "c.json", "--formats=onnx"], "unrecognized arguments: --formats=onnx; --formats "
                                                                 "(did you mean --format?)"),
    (["optimize", "m.py", "--zzzz"], "unrecognized arguments: --zzzz\n"),
])
def test_a_misspelt_flag_names_the_closest_flag_of_its_command(args, said, capsys):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2 and said in capsys.readouterr().err


def test_parse_batch_sizes():
    assert parse_batch_sizes("8,32,128") == (8, 32, 128)
    assert parse_batch_sizes("16-256") == (16, 32, 64, 128, 256)
    assert parse_batch_sizes("3-10") == (3, 6, 10)
    for bad in ("", "0", "a", "10-3", "-4"):
        with pytest.raises(UsageError):
            parse_batch_sizes(bad)


@pytest.mark.parametrize("text,why", [("8,abc", "'abc' is not a positive integer"),
                                      ("8,0", "'0' is not a positive integer"),
                                      ("16-abc", "'abc' is not a positive integer"),
                                      ("-4", "'-4' is not a positive integer"),
                                      ("256-16", "the range must go up, e.g. 16-256"),
                                      (" , ", "no batch size given"),
                                      ("8,,32", "entry 2 is empty (two commas in a row, or a comma at an end)"),
                                      ("8,32,", "entry 3 is empty (two commas in a row, or a comma at an end)"),
                                      ("8,32,8", "8 given more than once")])
def test_parse_batch_sizes_names_the_bad_item(text, why):
    with pytest.raises(UsageError) as err:
        parse_batch_sizes(text)
    first, fix = str(err.value).split("\n")
    assert first == f"invalid --batch-sizes {text.strip()!r}: {why}" and fix.startswith("  fix: a comma list")


def test_help_says_the_file_is_executed(capsys):
    with pytest.raises(SystemExit):
        main(["optimize", "--help"])
    assert "executed" in capsys.readouterr().out


FIXED_BATCH = ("import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n"
               "        super().__init__(); self.fc = torch.nn.Linear(8, 4)\n"
               "    def forward(self, x):\n        return self.fc(x.view(4, -1))\n"
               "def build_model():\n    return M()\n"
               "def example_inputs(b):\n    return (torch.randn(b, 8),)\n")


def test_a_model_that_only_runs_at_another_batch_is_one_error_exit_2(tmp_path):
    """The model only runs at batch 4, 8 is searched: the up-front FP32 run names the cause; no trial runs."""
    f = tmp_path / "fixed.py"
    f.write_text(FIXED_BATCH)
    r = run_cli("optimize", f, "--out", tmp_path / "out", "--batch-sizes", "8", "--trials", "4", "--quiet",
                "--no-export")
    assert r.returncode == 2 and "the model raised in FP32 at batch 8: RuntimeError" in r.stderr, r.stderr
    assert "no configuration qualified" not in r.stdout and "Traceback" not in r.stdout + r.stderr


OOM_AT_8 = FIXED_BATCH.replace(
    "return self.fc(x.view(4, -1))",
    "if x.shape[0] >= 8 and not torch.compiler.is_compiling():\n"
    "            raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB (simulated)')\n"
    "        return self.fc(x)")


def test_nothing_qualifies_names_the_cause_and_exits_1(tmp_path):
    """Every trial fails (the model runs out of memory at batch 8, simulated; running out of memory is the search's
    to find, a lower precision may fit): the summary says why, not "--max-error"."""
    f = tmp_path / "oom8.py"
    assert OOM_AT_8 != FIXED_BATCH
    f.write_text(OOM_AT_8)
    r = run_cli("optimize", f, "--out", tmp_path / "out", "--batch-sizes", "8", "--trials", "4", "--quiet",
                "--no-export")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no configuration qualified" in r.stdout and "did not qualify" in r.stdout
    assert "batch size 8" in r.stdout and "--max-error" not in r.stdout
    assert "Traceback" not in r.stdout + r.stderr


def test_inspect_batch_outside_the_models_range(tmp_path):
    f = tmp_path / "bounded.py"
    f.write_text(FIXED_BATCH.replace("return self.fc(x.view(4, -1))",
                                     "torch._check(x.shape[0] <= 16)\n        return self.fc(x)"))
    r = run_cli("inspect", f, "--batch-size", "32")
    assert r.returncode == 2 and "outside the batch range the model allows (1..16" in r.stderr
    assert "fix: --batch-size 8" in r.stderr and "Traceback" not in r.stderr


def test_a_tctune_folder_in_the_current_folder_that_shadows_the_installed_one_is_named(tmp_path):
    """`python -m tctune` imports ./tctune first: when another tctune is importable, one line names both."""
    from pathlib import Path

    import tctune
    from tctune.cli import shadowing_note

    copy = tmp_path / "tctune"
    copy.mkdir()
    (copy / "__init__.py").write_text("")
    note = shadowing_note(str(copy / "__init__.py"), cwd=str(tmp_path), env={})
    installed = Path(tctune.__file__).resolve().parent  # (or the editable install's copy: another folder)
    assert note and note.startswith(f"note: running the tctune in {copy.resolve()}") and "shadows" in note
    assert str(copy.resolve()) not in note.split("installed one in ")[1] and installed.name == "tctune"
    assert shadowing_note(str(copy / "__init__.py"), cwd=str(tmp_path), env={"PYTHONPATH": str(tmp_path)}) is None
    assert shadowing_note(str(copy / "__init__.py"), cwd=str(tmp_path / "elsewhere"), env={}) is None


#: A setuptools-style editable install (a meta-path finder after Python's path finder, mapping the package names
#: to this checkout), then `python -m tctune --version`: what `pip install -e` sets up.
EDITABLE_RUN = """
import runpy, sys
from importlib.machinery import PathFinder
from pathlib import Path
ROOT = Path(sys.argv[1])
MAPPING = {"tctune": ROOT / "tctune", "passes": ROOT / "passes"}
# an editable install of this checkout as a plain path entry (pyproject's package-dir) would win over the clone below:
# drop every path entry that holds a regular tctune package, so that only the import hook under test can find it
sys.path[:] = [p for p in sys.path if not (Path(p or ".") / "tctune" / "__init__.py").is_file()]
class Editable:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name in MAPPING:
            return PathFinder.find_spec(name, [str(ROOT)])
        parent = name.rpartition(".")[0]
        return PathFinder.find_spec(name, [str(MAPPING[parent])]) if parent in MAPPING else None
sys.meta_path.insert(sys.meta_path.index(PathFinder) + 1, Editable)  # before any installed tctune's finder
sys.argv = ["tctune", "--version"]
runpy.run_module("tctune", run_name="__main__", alter_sys=True)
"""


def test_a_clone_named_tctune_in_the_current_folder_gets_one_clear_error(tmp_path):
    """From the folder that holds a clone named tctune/ (no __init__.py at its root), `import tctune` is a namespace
    package under an editable install; `python -m tctune` says so in one error with a fix, not an ImportError."""
    import types

    from tctune._namespace import namespace_error

    clone = tmp_path / "tctune"
    clone.mkdir()
    (clone / "README.md").write_text("a clone's root\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", EDITABLE_RUN, str(ROOT)], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"tctune: error: `import tctune` found {clone}") and "no __init__.py" in r.stderr
    assert "\n  fix: run from another folder" in r.stderr and "Traceback" not in r.stderr
    # the same finder from a folder without a tctune/ folder runs the real package (the premise of the test)
    (tmp_path / "elsewhere").mkdir()
    ok = subprocess.run([sys.executable, "-c", EDITABLE_RUN, str(ROOT)], capture_output=True, text=True,
                        cwd=tmp_path / "elsewhere", timeout=120, env=env)
    assert ok.returncode == 0 and ok.stdout.startswith("tctune "), ok.stderr
    ns = types.ModuleType("tctune")
    ns.__path__ = [str(clone)]
    assert str(clone) in namespace_error(ns)
    import tctune

    assert namespace_error(tctune) is None  # the package itself (e.g. from this repository's root)


def test_an_editable_install_is_a_path_entry_that_wins_over_a_clone_folder_named_tctune(tmp_path):
    """pyproject.toml maps the packages to the project root (``package-dir``), so setuptools' editable wheel is a
    plain path entry (the project root), not an import hook consulted only after Python's path finder: from the
    folder that holds a clone named tctune/, `import tctune` is the package, not that folder as a namespace."""
    import os
    import shutil
    import zipfile

    pytest.importorskip("setuptools.command.editable_wheel", reason="needs setuptools >= 64 (PEP 660 editable wheels)")
    clone = tmp_path / "tctune"  # a clone named like the package, beside the folder Python runs from
    clone.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, clone / name)
    for package in ("tctune", "passes"):
        shutil.copytree(ROOT / package, clone / package, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    build = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta\n"
                            "print(build_meta.build_editable(sys.argv[1]))", str(tmp_path / "wheel")],
                           cwd=clone, capture_output=True, text=True, timeout=300, env=env)
    assert build.returncode == 0, build.stderr[-3000:]
    with zipfile.ZipFile(tmp_path / "wheel" / build.stdout.split()[-1]) as wheel:
        pth = [n for n in wheel.namelist() if n.endswith(".pth")]
        entries = wheel.read(pth[0]).decode().split("\n") if len(pth) == 1 else pth
    entries = [e for e in entries if e.strip()]
    assert len(entries) == 1 and Path(entries[0]).resolve() == clone.resolve(), entries  # no `import ...` hook
    # what site.py does with that line: append it to sys.path, after the current folder ('' for `python -c`)
    # (first dropping any path entry that already holds a regular tctune package: the installed checkout running these
    # tests, when it is itself an editable install of the same kind)
    code = ("import sys; from pathlib import Path\n"
            "sys.path[:] = [p for p in sys.path if not (Path(p or '.') / 'tctune' / '__init__.py').is_file()]\n"
            "sys.path.append(sys.argv[1]); import tctune; print(tctune.__file__, callable(tctune.optimize))")
    r = subprocess.run([sys.executable, "-c", code, entries[0]], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    file, is_callable = r.stdout.split()
    assert Path(file).resolve() == (clone / "tctune" / "__init__.py").resolve() and is_callable == "True"


RAISES_IN_FP32 = ("import torch\n"
                  "def build_model():\n    return torch.nn.Sequential(torch.nn.Linear(7, 7), torch.nn.LayerNorm(64))\n"
                  "def example_inputs(b):\n    return (torch.randn(b, 7),)\n")


def test_model_that_cannot_run_in_fp32_is_one_error_before_capture_and_trials(tmp_path):
    """The FP32 model runs once at the smallest searched batch first: an error there is bad input (exit 2, the
    error and the fix), not a capture warning, trials, and "no configuration qualified"; --out is left as it was."""
    f = tmp_path / "badln.py"
    f.write_text(RAISES_IN_FP32)
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.json").write_text('{"kept": true}')
    r = run_cli("optimize", f, "--out", out, "--batch-sizes", "16,8", "--trials", "3")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    err = [line for line in r.stderr.splitlines() if not line.startswith("tctune: no NVIDIA GPU")]
    assert err[0].startswith("tctune: error: badln.py: the model raised in FP32 at batch 8: RuntimeError: "
                             "Given normalized_shape=[64]"), r.stderr
    assert err[1] == ("  fix: make forward run on example_inputs(8) in FP32: the error is in forward (or code it calls), "
                      "or in example_inputs when it builds inputs forward cannot take")
    assert len(err) == 2 and "graph passes disabled" not in r.stderr and "qualified" not in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["report.json"] and (out / "report.json").read_text() == '{"kept": true}'


def test_fp32_check_runs_the_smallest_batch_only(tmp_path):
    """check_fp32_runs passes a model that raises only above the smallest batch (the search handles that), and
    names the error of one that raises there."""
    import torch

    from tctune.errors import ModelFileError
    from tctune.modelfile import load_model_file
    from tctune.search.loop import check_fp32_runs

    f = tmp_path / "big_only.py"
    f.write_text("import torch\nclass M(torch.nn.Module):\n    def forward(self, x):\n"
                 "        if x.shape[0] > 8:\n            raise ValueError('too big')\n        return x * 2\n"
                 "def build_model():\n    return M()\ndef example_inputs(b):\n    return (torch.randn(b, 4),)\n")
    mf = load_model_file(f)
    check_fp32_runs(mf.model(), mf, 8, torch.device("cpu"))
    with pytest.raises(ModelFileError, match=r"big_only\.py: the model raised in FP32 at batch 16: ValueError: too big"):
        check_fp32_runs(mf.model(), mf, 16, torch.device("cpu"))


def test_a_forward_that_writes_its_buffers_is_named_and_its_state_restored(tmp_path, caplog):
    """A forward that updates a buffer in eval mode (a running mean) makes runs of the same inputs differ, so the
    accuracy check fails every candidate: the check names the buffers and the fix, and leaves them as they were."""
    import torch

    from tctune.modelfile import load_model_file
    from tctune.search.loop import check_fp32_runs

    f = tmp_path / "stateful.py"
    f.write_text("import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                 "        self.register_buffer('running', torch.zeros(4))\n"
                 "        self.register_buffer('scale', torch.ones(4))\n"
                 "    def forward(self, x):\n        self.running.mul_(0.9).add_(0.1 * x.mean(0))\n"
                 "        return x - self.running\n"
                 "def build_model():\n    return M()\ndef example_inputs(b):\n    return (torch.randn(b, 4),)\n")
    mf = load_model_file(f)
    model = mf.model()
    with caplog.at_level("WARNING", logger="tctune"):
        written = check_fp32_runs(model, mf, 4, torch.device("cpu"))
    assert written == ["running"]
    assert torch.equal(model.running, torch.zeros(4))  # restored
    assert "writes its buffer(s) running at every call" in caplog.text and "if self.training:" in caplog.text
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\ndef build_model():\n    return torch.nn.BatchNorm1d(4).eval()\n"
                     "def example_inputs(b):\n    return (torch.randn(b, 4),)\n")
    mf = load_model_file(plain)
    assert check_fp32_runs(mf.model(), mf, 4, torch.device("cpu")) == []  # eval BatchNorm reads its stats only


def test_a_forward_that_raises_names_the_users_file_and_line(tmp_path):
    """The error of the model's own forward gives its frame (file:line, function, source line) and a fix naming
    forward and example_inputs (build_model ran fine: it is not the cause)."""
    import torch

    from tctune.errors import ModelFileError
    from tctune.modelfile import load_model_file
    from tctune.search.loop import check_fp32_runs

    f = tmp_path / "mm.py"
    f.write_text("import torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                 "        self.fc = torch.nn.Linear(8, 4)\n    def forward(self, x):\n        y = self.fc(x)\n"
                 "        return y @ torch.randn(5, 3)\n"
                 "def build_model():\n    return M()\ndef example_inputs(b):\n    return (torch.randn(b, 8),)\n")
    mf = load_model_file(f)
    with pytest.raises(ModelFileError) as info:
        check_fp32_runs(mf.model(), mf, 4, torch.device("cpu"))
    lines = str(info.value).splitlines()
    assert lines[0].startswith("mm.py: the model raised in FP32 at batch 4: RuntimeError: mat1 and mat2 shapes")
    assert lines[1] == f"  at {f}:8 in forward: return y @ torch.randn(5, 3)"
    assert "forward" in lines[2] and "example_inputs(4)" in lines[2] and "build_model" not in str(info.value)



@pytest.mark.parametrize("flag,value", [("--min-score", "0.5"), ("--min-score-ratio", "0.9")])
def test_a_score_limit_for_a_model_file_without_score_is_a_usage_error(tmp_path, flag, value):
    f = tmp_path / "no_score.py"
    f.write_text("import torch\ndef build_model():\n    return torch.nn.Linear(4, 2)\n"
                 "def example_inputs(b):\n    return (torch.randn(b, 4),)\n")
    r = run_cli("optimize", f, "--out", tmp_path / "out", "--trials", "1", "--quiet", flag, value)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"tctune: error: {flag} needs a score(model) metric, and no_score.py gives none: ")
    assert "(--max-error) decides accuracy" in r.stderr
    assert f"fix: define def score(model) -> float (higher is better) in the model file, or leave {flag} out" in r.stderr
    assert not (tmp_path / "out").exists()  # refused before the model was built or the folder made
