"""``tctune optimize`` with every default on each recipe: the speedup over the fastest plain baseline (issue 16).

    python benchmarks/recipe_defaults.py --out DIR                          # seed_cnn bert_base bert_large gpt2 resnet50
    python benchmarks/recipe_defaults.py --recipes bert_base,gpt2 --out DIR --drop-artifacts
    python benchmarks/recipe_defaults.py --recipes seed_cnn --extra "--trials 2" --out DIR
    python benchmarks/recipe_defaults.py --from-reports --out DIR           # summarize runs already in DIR

Each recipe (a name in ``recipes/``, or a path to a model file) runs as ``python -m tctune optimize MODEL --out
DIR/<name>`` plus only what ``--extra`` passes through, one after the other, each in a fresh subprocess (its own
CUDA context and compile caches), from the repository root. Recorded per recipe: wall seconds, exit status
(``"timeout"`` after ``--timeout-per-recipe``), the console's last lines, and from its ``report.json``: the
recommended configuration (``best.kind`` "tctune" or "baseline", ``best.name``, precision, runtime, batch size,
the throughput it was chosen on), ``best.speedup_vs_best_baseline`` with its 95 % CI and sign-test p-value, the
fastest plain baseline at that batch (name, throughput), the fastest at any batch, the speedup over FP32 eager,
and the verdict's one-line reason. The report's speedup is 1.0 when a plain baseline is the answer
(``tctune.search.results.verdict``).

Writes ``DIR/summary.json`` (``{"recipes": [row, ...], "extra": [...], "python": ..., "written": ISO time}``)
and ``DIR/summary.md`` (the table for ``benchmarks/RESULTS.md``), and keeps each run's ``report.json`` /
``report.md`` in ``DIR/<name>/``. ``--drop-artifacts`` deletes everything else a run wrote (ONNX, engines,
archives, ``study.db``, plots) after its report is read, except small text files (``.json``, ``.md``, ``.log``,
``.txt`` up to ``KEEP_MAX_BYTES``), so little comes back from a GPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_KEEP = re.compile(r" \(bf16: (.+)\), ")  # an FP8 candidate's keep-list in its name (tctune.search.evaluate)

#: The recipes run by default (``recipes/<name>.py``).
DEFAULT_RECIPES = ("seed_cnn", "bert_base", "bert_large", "gpt2", "resnet50")
#: With ``--drop-artifacts``: files kept in a run's folder (suffix, and at most this size); the rest is deleted.
KEEP_SUFFIXES = (".json", ".md", ".log", ".txt")
KEEP_MAX_BYTES = 2 * 1024 * 1024
#: Console lines kept per run in ``summary.json`` (``console_tail``).
CONSOLE_TAIL = 12


def recipe_path(name: str) -> Path:
    """``recipes/<name>.py``, or ``name`` itself when it is a path to a ``.py`` file.

    Raises:
        SystemExit: no such file (names the recipes available).
    """
    p = Path(name)
    if p.suffix == ".py":
        path = p if p.is_absolute() else Path.cwd() / p
    else:
        path = ROOT / "recipes" / f"{name}.py"
    if not path.is_file():
        have = ", ".join(sorted(q.stem for q in (ROOT / "recipes").glob("*.py")))
        raise SystemExit(f"recipe_defaults: no model file {path}\n  fix: a recipe name ({have}) or a path to a .py file")
    return path.resolve()


def run_one(model: Path, out: Path, extra: list[str], timeout_s: float | None) -> dict:
    """Run ``tctune optimize`` on ``model`` into ``out`` in a fresh subprocess (from the repository root, the
    repository's ``tctune`` on ``PYTHONPATH``); returns ``{"command", "wall_s", "exit", "console_tail"}``
    (``exit``: the status, or ``"timeout"``). The console goes to ``out/console.log``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tctune", "optimize", str(model), "--out", str(out), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    with open(out / "console.log", "w", encoding="utf-8") as log:
        try:
            code: int | str = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                             timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.perf_counter() - t0
    lines = (out / "console.log").read_text(encoding="utf-8", errors="replace").splitlines()
    # the progress bar rewrites one line with carriage returns: keep each line's last state
    tail = [ln.split("\r")[-1] for ln in lines if ln.strip()][-CONSOLE_TAIL:]
    return {"command": shlex.join(cmd), "wall_s": round(wall, 1), "exit": code, "console_tail": tail}


def from_report(report: dict | None) -> dict:
    """The summary fields of one run's ``report.json`` (all None when there is no report or no best)."""
    keys = ("kind", "name", "trial", "precision", "runtime", "batch_size", "throughput", "chosen_on",
            "speedup_vs_best_baseline", "speedup_ci95", "speedup_p_value", "best_baseline", "best_baseline_throughput",
            "best_baseline_any_batch", "best_baseline_any_batch_throughput", "speedup_vs_fp32_eager", "verdict",
            "measured_on", "n_trials")
    row = dict.fromkeys(keys)
    if not report:
        return row
    row["measured_on"] = report.get("measured_on")
    row["n_trials"] = (report.get("study") or {}).get("n_trials")
    b = report.get("best")
    if not b:
        return row
    p = b.get("params") or {}
    bb, anyb = b.get("best_baseline") or {}, b.get("best_baseline_any_batch") or {}
    row.update(kind=b.get("kind") or ("baseline" if b.get("baseline") else "tctune"),
               name=short_name(b.get("name") or b.get("baseline") or b.get("description")), trial=b.get("trial"),
               precision=p.get("precision"), runtime=p.get("runtime", "eager"), batch_size=p.get("batch_size"),
               throughput=b.get("chosen_throughput") or b.get("throughput"), chosen_on=b.get("chosen_on"),
               speedup_vs_best_baseline=b.get("speedup_vs_best_baseline"), speedup_ci95=b.get("speedup_ci95"),
               speedup_p_value=b.get("speedup_p_value"), best_baseline=bb.get("name"),
               best_baseline_throughput=bb.get("throughput"), best_baseline_any_batch=anyb.get("name"),
               best_baseline_any_batch_throughput=anyb.get("throughput"),
               speedup_vs_fp32_eager=b.get("speedup_vs_fp32_eager"), verdict=(b.get("verdict") or {}).get("reason"))
    return row


def short_name(name: str | None) -> str | None:
    """A tctune candidate's name with its FP8 keep-list (``"... fp8 (bf16: a.0.x, a.1.x, a.2.x), runtime"``)
    written by ``tctune.fp8_plan.keep_label`` (``a.{0-2}.x``), so a report written before that rendering reads
    the same as a new one (a name already written so is unchanged); any other name as it is."""
    m = _KEEP.search(name or "")
    if m is None:
        return name
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tctune.fp8_plan import keep_label

    return name[:m.start(1)] + keep_label(m.group(1).split(", ")) + name[m.end(1):]


def drop_artifacts(folder: Path) -> list[str]:
    """Delete what a run wrote in ``folder`` except small text files (:data:`KEEP_SUFFIXES`, at most
    :data:`KEEP_MAX_BYTES`); returns the deleted paths relative to ``folder``."""
    gone = []
    for p in sorted(folder.iterdir()):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p.name + "/")
        elif p.suffix not in KEEP_SUFFIXES or p.stat().st_size > KEEP_MAX_BYTES:
            p.unlink()
            gone.append(p.name)
    return gone


def _fmt(v, spec=".4g") -> str:
    return "–" if v is None else format(v, spec)


def markdown(rows: list[dict]) -> str:
    """The summary table (one row per recipe)."""
    lines = ["| recipe | exit | wall s | answer | precision | runtime | batch | items/s | × fastest plain baseline "
             "(95 % CI) | fastest plain baseline, same batch (items/s) | × FP32 eager | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = r.get("speedup_ci95")
        sp = _fmt(r.get("speedup_vs_best_baseline"), ".2f") + ("×" if r.get("speedup_vs_best_baseline") else "")
        if ci:
            sp += f" ({ci[0]:.2f}–{ci[1]:.2f})"
        answer = "–" if not r.get("kind") else (f"plain baseline {r['name']}" if r["kind"] == "baseline"
                                                 else f"tctune: {r['name']}")
        base = "–" if not r.get("best_baseline") else f"{r['best_baseline']} ({_fmt(r.get('best_baseline_throughput'))})"
        lines.append(f"| {r['recipe']} | {r.get('exit')} | {_fmt(r.get('wall_s'), '.0f')} | {answer} | "
                     f"{r.get('precision') or '–'} | {r.get('runtime') or '–'} | {r.get('batch_size') or '–'} | "
                     f"{_fmt(r.get('throughput'))} | {sp} | {base} | {_fmt(r.get('speedup_vs_fp32_eager'), '.2f')} | "
                     f"{(r.get('verdict') or '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", default=",".join(DEFAULT_RECIPES),
                    help="comma-separated recipe names (recipes/<name>.py) or model file paths (default %(default)s)")
    ap.add_argument("--out", default="recipe_defaults_out", help="output folder (one subfolder per recipe)")
    ap.add_argument("--extra", default="", help='options passed through to every `tctune optimize`, e.g. "--trials 2" '
                                                "(default: none, every default)")
    ap.add_argument("--timeout-per-recipe", type=float, metavar="S", help="kill a run after S seconds (exit 'timeout')")
    ap.add_argument("--drop-artifacts", action="store_true",
                    help="after reading each report, delete the run's engines, ONNX, archives, study.db and plots")
    ap.add_argument("--from-reports", action="store_true",
                    help="run nothing: summarize the report.json already in OUT/<name>/ (exit status and wall seconds "
                         "kept from OUT/summary.json when an earlier run wrote it)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.extra)
    if "--out" in extra:
        raise SystemExit("recipe_defaults: --extra must not set --out (each recipe writes to OUT/<name>)")
    rows = []
    prior = {}  # --from-reports keeps what an earlier run of this script recorded (exit status, wall seconds)
    if args.from_reports and (out / "summary.json").is_file():
        prior = {r["recipe"]: r for r in json.loads((out / "summary.json").read_text()).get("recipes", [])}
    for name in [n.strip() for n in args.recipes.split(",") if n.strip()]:
        model = recipe_path(name)
        folder = out / model.stem
        if args.from_reports:
            old = prior.get(model.stem, {})
            run = {"command": old.get("command"), "wall_s": old.get("wall_s"), "exit": old.get("exit"),
                   "console_tail": old.get("console_tail", [])}
        else:
            print(f"recipe_defaults: {model.stem}: tctune optimize {model.name} {shlex.join(extra)}".rstrip(), flush=True)
            run = run_one(model, folder, extra, args.timeout_per_recipe)
        report_path = folder / "report.json"
        report = json.loads(report_path.read_text()) if report_path.is_file() else None
        row = {"recipe": model.stem, "model_file": str(model), **run, **from_report(report),
               "report": str(report_path) if report else None}
        if args.drop_artifacts and folder.is_dir():
            row["dropped"] = drop_artifacts(folder)
        rows.append(row)
        print(f"recipe_defaults: {model.stem}: exit {row['exit']}, {_fmt(row['wall_s'], '.0f')} s, "
              f"{row.get('kind') or 'no answer'} {row.get('name') or ''}: "
              f"{_fmt(row.get('speedup_vs_best_baseline'), '.2f')}x the fastest plain baseline", flush=True)
    summary = {"recipes": rows, "extra": extra, "python": sys.version.split()[0],
               "written": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    table = markdown(rows)
    (out / "summary.md").write_text(table)
    print(table)
    failed = [r["recipe"] for r in rows if r["exit"] not in (0, None)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
