"""CPU test of benchmarks/recipe_defaults.py: `tctune optimize` with defaults on a model file in a fresh subprocess,
the summary read from its report, artifacts dropped, and the summary-only mode."""
from __future__ import annotations

import json
from pathlib import Path

from zoo import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _load():
    return load_benchmark("recipe_defaults")


def test_runs_a_model_file_and_summarizes_its_report(tiny, tmp_path):
    rd = _load()
    out = tmp_path / "bench"
    rc = rd.main(["--recipes", str(tiny), "--extra", "--trials 2 --batch-sizes 4", "--out", str(out),
                  "--drop-artifacts"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["extra"] == ["--trials", "2", "--batch-sizes", "4"]
    (row,) = summary["recipes"]
    assert row["recipe"] == "tiny" and row["exit"] == 0 and row["wall_s"] > 0
    assert row["command"].endswith(f"--out {out / 'tiny'} --trials 2 --batch-sizes 4")
    report = json.loads((out / "tiny" / "report.json").read_text())
    best = report["best"]
    assert row["kind"] == best["kind"] in ("tctune", "baseline") and row["name"] == best["name"]
    assert row["trial"] == best["trial"] and row["batch_size"] == 4 == best["params"]["batch_size"]
    assert row["throughput"] == best["chosen_throughput"] and row["precision"] == best["params"]["precision"]
    assert row["speedup_vs_best_baseline"] == best["speedup_vs_best_baseline"] >= 1.0
    assert row["best_baseline"] == best["best_baseline"]["name"] and row["best_baseline_throughput"] > 0
    assert row["speedup_vs_fp32_eager"] == best["speedup_vs_fp32_eager"] and row["verdict"]
    assert row["n_trials"] == report["study"]["n_trials"] and row["n_trials"] >= 2
    # only small text files are left: the report, console log, best_config.json; no study.db, ONNX, plots
    left = sorted(p.name for p in (out / "tiny").iterdir())
    assert "report.md" in left and "console.log" in left and "study.db" in row["dropped"]
    assert not any(n.endswith((".onnx", ".db", ".png", ".html")) for n in left)
    md = (out / "summary.md").read_text()
    assert md.startswith("| recipe | exit |") and "\n| tiny | 0 |" in md and f"{row['speedup_vs_best_baseline']:.2f}×" in md
    # summarize again without running: the same fields from the kept report
    assert rd.main(["--recipes", str(tiny), "--out", str(out), "--from-reports"]) == 0
    (again,) = json.loads((out / "summary.json").read_text())["recipes"]
    assert again["name"] == row["name"] and again["throughput"] == row["throughput"]
    assert again["exit"] == 0 and again["wall_s"] == row["wall_s"]  # kept from the earlier summary.json
    (out / "summary.json").unlink()  # with no earlier summary, nothing is known about the run itself
    assert rd.main(["--recipes", str(tiny), "--out", str(out), "--from-reports"]) == 0
    (third,) = json.loads((out / "summary.json").read_text())["recipes"]
    assert third["exit"] is None and third["wall_s"] is None and third["name"] == row["name"]


def test_markdown_row_of_a_baseline_answer_and_a_failed_run():
    rd = _load()
    rows = [{"recipe": "a", "exit": 0, "wall_s": 12.0, **rd.from_report({"best": {
                "kind": "baseline", "name": "cast_fp16", "trial": 3, "params": {"precision": "fp16", "batch_size": 64},
                "chosen_throughput": 1000.0, "speedup_vs_best_baseline": 1.0, "speedup_ci95": None,
                "best_baseline": {"name": "cast_fp16", "throughput": 1000.0}, "speedup_vs_fp32_eager": 3.1,
                "verdict": {"reason": "no tctune candidate beat model.half() eager at batch 64 (1.01×, 95 % CI "
                                      "0.98–1.04): use it"}}})},
            {"recipe": "b", "exit": "timeout", "wall_s": 600.0, **rd.from_report(None)}]
    md = rd.markdown(rows).splitlines()
    assert md[2].startswith("| a | 0 | 12 | plain baseline cast_fp16 | fp16 | eager | 64 | 1000 | 1.00× | cast_fp16 (1000) | 3.10 |")
    assert "use it |" in md[2]
    assert md[3].startswith("| b | timeout | 600 | – |")


def test_an_fp8_answers_keep_list_is_written_compactly_also_from_an_older_report():
    from tctune.fp8_plan import keep_label

    rd = _load()
    keep = ["h.*.attn.c_proj", *(f"h.{i}.mlp.c_fc" for i in (0, 1, 10, 11, 2, 3, 5)), "h.4.attn.c_attn"]
    old = f"tctune graph fp8 (bf16: {', '.join(keep)}), inductor-cudagraphs"  # as reports wrote it before keep_label
    new = f"tctune graph fp8 (bf16: {keep_label(keep)}), inductor-cudagraphs"
    assert new == "tctune graph fp8 (bf16: h.*.attn.c_proj, h.{0-3,5,10,11}.mlp.c_fc, h.4.attn.c_attn), inductor-cudagraphs"
    for name in (old, new):
        row = rd.from_report({"best": {"kind": "tctune", "name": name, "params": {"precision": "fp8"}}})
        assert row["name"] == new
        assert f"| tctune: {new} | fp8 |" in rd.markdown([{"recipe": "gpt2", **row}])
    assert rd.short_name("cast_fp16") == "cast_fp16" and rd.short_name(None) is None
