"""Merge per-model rows of several ``suite.py`` runs into one ``results/latest.json``.

Usage::

    python benchmarks/merge_latest.py --out benchmarks/results/latest.json --note "why these calls" \
        bert_base=benchmarks/results/<call>/latest.json gpt2=... ...

Each model's row is taken whole from the named run (its baselines and tctune's variants were measured in that
one device call; ratios never mix calls) and its summary is recomputed with ``suite.finish`` (so every row
follows the current rules: ``tctune`` is what ``tctune optimize`` chose, the fastest fixed variant beside it),
with ``source`` (the file) and ``ceilings_tflops_that_call``. Top-level fields (device, torch, protocol, limits)
come from the first run named; a run whose device or torch differs is refused.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchload import load_benchmark

HERE = Path(__file__).resolve().parent


def _suite():
    return load_benchmark("suite")


SUMMARY_KEYS = ("best_baseline_name", "best_baseline", "tctune_name", "tctune", "ratio", "max_rel_error",
                "achieved_tflops", "ceiling_tflops", "ceiling_precision", "fraction_of_ceiling", "fastest_variant_name",
                "fastest_variant", "fastest_variant_ratio", "fastest_variant_error", "optimize", "optimize_ratio",
                "optimize_within_limit")


def merge(pairs: list[tuple[str, Path]], note: str) -> dict:
    """The merged report (see the module docstring).

    Raises:
        SystemExit: a file or model is missing, or the runs' device / torch differ.
    """
    suite = _suite()
    out: dict | None = None
    for model, path in pairs:
        try:
            run = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"merge_latest: cannot read {path}: {exc}") from exc
        if not isinstance(run, dict) or not isinstance(run.get("models"), dict):
            raise SystemExit(f"merge_latest: {path} is not a benchmarks/suite.py latest.json (no 'models' table)")
        if run.get("dry_run"):
            raise SystemExit(f"merge_latest: {path} is a --dry-run (tiny models on the CPU: its numbers mean nothing)")
        if model not in run["models"]:
            raise SystemExit(f"merge_latest: {path} has no model {model!r} (it has {', '.join(run.get('models', {}))})")
        if out is None:
            out = {k: v for k, v in run.items() if k not in ("models", "wall_s", "budget_s", "dry_run", "quick")}
            out["models"] = {}
        elif (run.get("device"), run.get("torch")) != (out.get("device"), out.get("torch")):
            raise SystemExit(f"merge_latest: {path} ran on {run.get('device')} / torch {run.get('torch')}, the first "
                             f"run on {out.get('device')} / torch {out.get('torch')}: not one table")
        entry = {k: v for k, v in run["models"][model].items() if k not in SUMMARY_KEYS}
        row = suite.finish(entry, run.get("ceilings_tflops", {}))
        row["source"] = str(path.relative_to(HERE / "results")) if path.is_relative_to(HERE / "results") else str(path)
        row["ceilings_tflops_that_call"] = run.get("ceilings_tflops")
        out["models"][model] = row
    out["note"] = note
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the merged JSON to write")
    p.add_argument("--note", default="", help="why these runs (kept in the JSON)")
    p.add_argument("pairs", nargs="+", metavar="MODEL=FILE", help="a suite model and the suite latest.json to take it from")
    args = p.parse_args(argv)
    pairs = []
    for item in args.pairs:
        model, sep, file = item.partition("=")
        if not sep or not model or not file:
            p.error(f"expected MODEL=FILE, got {item!r}")
        pairs.append((model, Path(file).resolve()))
    report = merge(pairs, args.note)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    for name, m in report["models"].items():
        print(f"{name:<11} {m['best_baseline_name'] or '-':<22} {m['tctune_name'] or '-':<24} "
              f"ratio {m['ratio'] or 0:.3f}  fastest {m.get('fastest_variant_name') or '-'} "
              f"{m.get('fastest_variant_ratio') or 0:.3f}  ({m['source']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
