"""report.md says which timing each throughput is (a trial's first timing, or the side-by-side median the verdict
compares), and why a pass made no rewrite (the skip reasons the passes record, as `tctune inspect` prints them)."""
from __future__ import annotations

import optuna
import torch

from tctune.hardware import resolve
from tctune.modelfile import load_model_file
from tctune.report import SKIP_REASON_SHOWN, TIMINGS_NOTE, build_report, render_markdown, skip_cell
from tctune.search import TuneConfig, Tuner
from tctune.search.evaluate import skip_reasons
from tctune.trial import apply_passes


def _study(passes, side_by_side=True, **extra_attrs):
    """Trial 0: FP32 eager (a plain baseline, first timing 200 items/s); trial 1: tctune's graph (first timing 150
    items/s) with ``passes``; a side-by-side timing of this run in which they ran at 260 and 190 items/s."""
    study = optuna.create_study(direction="maximize")
    for i, (graph, tput) in enumerate(((False, 200.0), (True, 150.0))):
        params = {"batch_size": 8, "precision": "fp32", "graph_passes": graph, "runtime": "eager"}
        dist = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
        attrs = {"run_id": "r", "max_rel_error": 1e-6 * i, "float_outputs": 1, "description": f"trial {i}",
                 "throughput": tput, "latency_ms": 8 / tput * 1e3, "passes": passes if graph else [], **extra_attrs}
        if not graph:
            attrs["baseline"] = "fp32_eager"
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dist, value=tput, user_attrs=attrs))
    study.set_user_attr("run_id", "r")
    if side_by_side:
        study.set_user_attr("side_by_side", {
            "run_id": "r", "after_trial": 1, "rounds": 3, "block_s": 0.05, "device": "cpu", "clocks": {},
            "entries": [{"trial": n, "baseline": b, "batch_size": 8, "throughput": thr, "median_ms": 8 / thr * 1e3,
                         "rounds_ms": [8 / thr * 1e3] * 3}
                        for n, b, thr in ((0, "fp32_eager", 260.0), (1, None, 190.0))]})
    return study


def _md(study):
    return render_markdown(build_report(
        study, hardware={"name": "cpu"}, measured_on="cpu", config={"max_error": 0.01, "mode": "infer"},
        model={"name": "m", "path": "m.py"}, passes=[], artifacts={}, capture={"ok": True}))


def test_each_throughput_says_whether_it_is_the_first_timing_or_the_side_by_side_median():
    md = _md(_study([{"name": "fuse_qkv", "changed": 1}]))
    result = md[md.index("## Result"):md.index("## Plain baselines")]
    # the searched candidate beside the answer: its side-by-side number, said to be that
    assert "trial 1 at batch 8 (trial 1), 190 items/s (side-by-side median, the same timing as the answer's)" in result
    base = md[md.index("## Plain baselines"):md.index("## Side-by-side timing")]
    assert TIMINGS_NOTE in base
    assert "| first timing items/s | side-by-side median items/s |" in base and "| 200 | 260 |" in base
    assert "| median ms | median items/s |" in md[md.index("## Side-by-side timing"):]
    passes = md[md.index("## Graph passes"):md.index("## Trials")]
    assert "trial 1 (fp32, eager, batch 8, 150 items/s first timing)" in passes  # not the 190 of the timing above
    trials = md[md.index("## Trials"):]
    assert "| first timing items/s | ms/batch |" in trials and "each trial's first timing" in trials
    # without a side-by-side timing the headline's numbers are first timings, and say so
    md = _md(_study([{"name": "fuse_qkv", "changed": 1}], side_by_side=False))
    result = md[md.index("## Result"):md.index("## Plain baselines")]
    assert "150 items/s (first timing, the same timing as the answer's)" in result


def test_a_pass_without_rewrites_shows_the_reasons_it_recorded_shortened():
    long = "gelu tanh on a CPU tensor: aten._addmm_activation computes erf GELU there " + "x" * 100
    passes = [{"name": "fuse_epilogue", "changed": 0, "skipped": [{"reason": long, "nodes": 2, "node": "linear"}]},
              {"name": "pad_linear_dims", "changed": 0,
               "skipped": [{"reason": "alignment 1 (no Tensor Core requirement for fp32 on cpu)", "nodes": 1,
                            "node": "linear_1"}]},
              {"name": "fold_conv_batchnorm", "changed": 0}]  # nothing recorded: an empty cell
    md = _md(_study(passes))
    section = md[md.index("## Graph passes"):md.index("## Trials")]
    shown = long[:SKIP_REASON_SHOWN - 1].rstrip() + "…"
    assert f"| fuse_epilogue | 0 |  | {shown} (linear, +1 more) |" in section
    assert "| pad_linear_dims | 0 |  | alignment 1 (no Tensor Core requirement for fp32 on cpu) (linear_1) |" in section
    assert "| fold_conv_batchnorm | 0 |  |  |" in section
    # the best's own passes (report.json's passes: every skipped node) are grouped by reason the same way
    full = [{"node": f"n{i}", "reason": "only one linear reads this input"} for i in range(4)] + [
        {"node": "m", "reason": "a | b"}]
    assert skip_cell(full) == "only one linear reads this input (n0, +3 more); a \\| b (m)"


def test_a_graph_trial_records_the_skip_reasons_its_passes_gave(tiny, tmp_path):
    cfg = TuneConfig(out_dir=str(tmp_path / "out"), batch_sizes=(4,), quiet=True, export=False, prune=False, trials=1)
    t = Tuner(cfg, load_model_file(tiny), resolve(None), device=torch.device("cpu"))
    params = t.candidate(batch_size=4, precision="fp32", graph_passes=True, runtime="eager")
    metrics = t.evaluator.evaluate(params)
    _, results = apply_passes(t.captured.graph_module, t.hw, "fp32")
    expected = {r.name: skip_reasons(r.skipped) for r in results if r.skipped}
    assert expected  # the premise: on the CPU at fp32 some passes leave nodes alone, with a reason
    recorded = {p["name"]: p["skipped"] for p in metrics["passes"] if p.get("skipped")}
    assert recorded == expected


def test_top1_and_kl_say_they_treat_the_last_dim_as_class_scores():
    # (a (batch, seq, hidden) output gets these figures too: tctune.measure.looks_like_logits goes by shape)
    study = _study([{"name": "fuse_qkv", "changed": 1}], top1_agreement=0.99, kl_divergence=1e-6)
    md = _md(study)
    outputs = next(x for x in md.splitlines() if x.startswith("- Outputs against FP32:"))
    assert "top-1 agreement 99.00%" in outputs
    assert "treating the last dim of every floating output of rank ≥ 2 as class scores" in outputs
    assert "hidden state" in outputs and "never a limit" in outputs
    trials = md[md.index("## Trials"):]
    assert "Top-1 / KL: treating the last dim" in trials and "99.00% / 1.0e-06" in trials
