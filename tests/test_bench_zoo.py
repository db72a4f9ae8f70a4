"""CPU tests of benchmarks/zoo.py: model lists, slicing, tiny model building, the per-model summary, merging,
the subprocess runner's timeout and budget paths, and a tiny end-to-end dry run (no GPU, no timm)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zoo import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
ZOO_PATH = ROOT / "benchmarks" / "zoo.py"


zoo = load_benchmark("zoo")


# ------------------------------------------------------------------------------------------------ lists


def test_lists_hold_both_suites_and_torchvision_with_positive_batches():
    every = zoo.all_entries()
    suites = {s: [e for e in every.values() if e.suite == s] for s in ("huggingface", "timm", "torchvision")}
    assert len(suites["huggingface"]) == len(zoo.HF_MODELS) >= 50
    assert len(suites["timm"]) == len(zoo.TIMM_MODELS) >= 15
    assert {e.name for e in suites["torchvision"]} == {"resnet50", "mobilenet_v3_large", "efficientnet_b0",
                                                       "convnext_tiny", "vit_b_16", "swin_t"}
    assert all(isinstance(e.batch_size, int) and e.batch_size >= 1 for e in every.values())
    assert not any(e.suite == "test" for e in every.values())  # self-test entries only by name
    assert "zoo_test_sleep" in zoo.all_entries(include_test=True)


def test_every_hf_entry_maps_to_a_config_and_model_class():
    transformers = pytest.importorskip("transformers")
    for name in zoo.HF_MODELS:
        cfg, model, _ = zoo.hf_spec(name)
        assert cfg.endswith("Config"), name
        # a missing class is reported as not_built at run time; here every mapping names a real class
        assert hasattr(transformers, cfg) and hasattr(transformers, model), (name, cfg, model)


def test_slices_partition_the_list_and_mix_suites():
    whole = zoo.select()
    parts = [zoo.select(slice_=f"{i}/4") for i in range(1, 5)]
    names = [e.name for p in parts for e in p]
    assert sorted(names) == sorted(e.name for e in whole) and len(names) == len(set(names))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert {e.suite for e in parts[0]} >= {"huggingface", "timm"}
    assert [e.name for e in zoo.select("resnet50,T5Small")] == ["resnet50", "T5Small"]
    assert {e.suite for e in zoo.select(suites="timm")} == {"timm"}


@pytest.mark.parametrize("bad", ["0/3", "4/3", "a/b", "3"])
def test_bad_slice_is_one_clear_error(bad):
    with pytest.raises(ValueError, match="slice"):
        zoo.select(slice_=bad)


def test_unknown_model_names_the_list_option():
    with pytest.raises(ValueError, match="--list"):
        zoo.select("BertForMaskedLM,NoSuchModel")


def test_scaled_batch():
    assert zoo.scaled_batch(32, 1.0) == 32
    assert zoo.scaled_batch(32, 0.5) == 16
    assert zoo.scaled_batch(1, 0.01) == 1


# ------------------------------------------------------------------------------------------------ building


@pytest.mark.parametrize("name", ["BertForMaskedLM", "GPT2ForSequenceClassification", "T5Small",
                                  "openai/whisper-tiny", "GPTNeoForCausalLM"])
def test_tiny_hf_models_build_and_run_forward(name):
    pytest.importorskip("transformers")
    entry = zoo.all_entries()[name]
    built = zoo.build(entry, tiny=True)
    assert built.params < 2_000_000  # the tiny sizes took effect
    inputs = built.make_inputs(3, "cpu", 7)
    assert all(x.shape[0] == 3 for x in inputs)
    ids = [x for x in inputs if not x.is_floating_point()]
    assert ids and all(x.max() > 0 for x in ids)  # random tokens, not zeros
    again = built.make_inputs(3, "cpu", 7)
    assert all(torch.equal(a, b) for a, b in zip(inputs, again))  # seeded
    with torch.no_grad():
        out = built.model(*inputs)
    assert isinstance(out, torch.Tensor) and out.shape[0] == 3 and torch.isfinite(out).all()


def test_every_tensor_of_a_built_model_and_its_inputs_is_on_the_requested_device():
    # XLNet creates its attention weights with torch.FloatTensor(...), a legacy constructor that allocates on the
    # CPU even inside `with torch.device(...)`: the H200 run's fp32 eager failed with "mat2 is on cpu".
    pytest.importorskip("transformers")
    built = zoo.build(zoo.all_entries()["XLNetLMHeadModel"], tiny=True, device="meta")
    where = zoo.tensor_devices(built.model)
    assert any(name.endswith(".q") for name in where)  # the legacy-constructed weights are counted
    assert set(where.values()) == {"meta"}, {n: d for n, d in where.items() if d != "meta"}
    assert all(x.device.type == "meta" for x in built.make_inputs(2, "meta", 0))


def test_place_moves_parameters_buffers_and_plain_tensor_attributes():
    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.register_buffer("buf", torch.ones(3))
            self.plain = torch.randn(3)  # neither parameter nor buffer: Module.to leaves it behind

    m = torch.nn.Sequential(Holder())
    assert zoo.tensor_devices(m.to("meta"))["0.plain"] == "cpu"
    assert set(zoo.tensor_devices(zoo.place(m, "meta")).values()) == {"meta"}
    assert isinstance(m[0].lin.weight, torch.nn.Parameter)


def test_sequence_length_follows_the_position_table():
    pytest.importorskip("transformers")
    every = zoo.all_entries()
    # meta device: the full-size configs, no memory
    assert "(B, 512)" in zoo.build(every["BertForMaskedLM"], device="meta").desc
    assert "(B, 510)" in zoo.build(every["RobertaForCausalLM"], device="meta").desc  # positions offset by pad + 1
    assert "(B, 128)" in zoo.build(every["BlenderbotForCausalLM"], device="meta").desc
    assert "(B, 256)" in zoo.build(every["BertForMaskedLM"], seq=256, device="meta").desc
    enc_dec = zoo.build(every["T5Small"], device="meta").desc
    assert "decoder_input_ids (B, 512)" in enc_dec


def test_tiny_kwargs_only_touch_present_attributes_and_fix_token_ids():
    kw = zoo.tiny_kwargs({"n_embd": 768, "n_layer": 12, "vocab_size": 50257, "eos_token_id": 50256,
                          "pad_token_id": 0})
    assert kw["n_embd"] == 64 and kw["n_layer"] == 2 and "hidden_size" not in kw
    assert kw["eos_token_id"] < kw["vocab_size"] and "pad_token_id" not in kw
    neo = zoo.tiny_kwargs({"num_layers": 24, "attention_types": [[["global", "local"], 12]]})
    assert neo["attention_types"] == [[["global", "local"], 1]]


def test_timm_models_build_when_timm_is_installed():
    pytest.importorskip("timm", reason="timm is not installed here (the GPU machine has it)")
    built = zoo.build(zoo.all_entries()["mobilenetv2_100"], device="meta")
    assert "(B, 3," in built.desc


def test_missing_package_is_not_buildable_with_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    with pytest.raises(zoo.NotBuildable, match="timm is not installed"):
        zoo.build(zoo.all_entries()["ghostnet_100"])


def test_missing_transformers_class_is_not_buildable(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setitem(zoo.HF_SPECS, "BertForMaskedLM", ("BertConfig", "NoSuchModelClass", {}))
    with pytest.raises(zoo.NotBuildable, match="has no NoSuchModelClass"):
        zoo.build_hf("BertForMaskedLM", tiny=True)


# ------------------------------------------------------------------------------------------------ summary


def _row(name, tct=None, ind=None, tct_cg=None, ind_cg=None, rel=1e-3, eager_rel=1e-3, fallbacks=(),
         tct_compile=12.0, ind_compile=10.0, status="ok", suite="huggingface", finished="2026-12-01T10:00:00"):
    def var(ips, **kw):
        return {"ok": True, "items_per_s": ips, **kw} if ips else {"ok": False, "error": "RuntimeError: boom"}

    return {"name": name, "suite": suite, "batch_size": 8, "dtype": "bf16", "status": status, "finished": finished,
            "env": {"device": "NVIDIA H200", "torch": "2.11.0"},
            "variants": {"fp32_eager": var(100.0), "eager": var(150.0, rel_err=eager_rel),
                         "inductor": var(ind, rel_err=eager_rel, compile_s=ind_compile),
                         "tctune": var(tct, rel_err=rel, compile_s=tct_compile),
                         "inductor_cg": var(ind_cg), "tctune_cg": var(tct_cg)},
            "tctune": {"fallbacks": list(fallbacks), "subgraphs": 1}}


def test_accuracy_rule_boundaries():
    assert zoo.accuracy_consistent(2 * 4e-3 + 1e-3, 4e-3) is True
    assert zoo.accuracy_consistent(2 * 4e-3 + 1.01e-3, 4e-3) is False
    assert zoo.accuracy_consistent(9e-4, 0.0) is True  # the absolute slack
    assert zoo.accuracy_consistent(None, 1e-3) is None


def test_summarize_computes_speedups_and_flags():
    s = zoo.summarize(_row("m", tct=300.0, ind=250.0, tct_cg=500.0, ind_cg=400.0, rel=2e-2, eager_rel=5e-3))
    assert s["speedup_vs_inductor"] == pytest.approx(1.2)
    assert s["speedup_vs_inductor_cg"] == pytest.approx(1.25)
    assert s["accuracy_consistent"] is False  # 2e-2 > 2 * 5e-3 + 1e-3
    assert s["tctune_ok"] is True and s["fallbacks"] == []
    assert s["compile_ratio"] == pytest.approx(1.2)
    fb = zoo.summarize(_row("m", tct=100.0, ind=250.0, fallbacks=["RuntimeError: overflow"]))
    assert fb["tctune_ok"] is False and fb["speedup_vs_inductor"] == pytest.approx(0.4)
    failed = zoo.summarize(_row("m", tct=None, ind=250.0))
    assert failed["tctune_ok"] is False and failed["speedup_vs_inductor"] is None
    assert failed["tctune_error"] == "RuntimeError: boom"


def test_timing_noisy_flags_a_disturbed_median_not_one_slow_repeat():
    row = _row("m", tct=300.0, ind=250.0, tct_cg=500.0, ind_cg=400.0)
    v = row["variants"]
    v["tctune"]["repeats_ms"] = [7.0, 7.4, 10.3, 13.4, 13.7]  # vit_b_16 on a shared GPU: the median moved
    v["inductor"]["repeats_ms"] = [6.9, 7.0, 7.0, 13.3, 13.3]  # two slow repeats of five: the median holds
    # a CUDA-graph variant is judged per capture: two steady captures at different speeds are not noise
    v["tctune_cg"].update(repeats_ms=[5.0, 5.0, 5.1, 5.0, 5.0, 4.0, 4.0, 4.1, 4.0, 4.0], captures_ms=[5.0, 4.0])
    v["inductor_cg"].update(repeats_ms=[5.0, 6.0, 6.0, 6.0, 5.0], captures_ms=[6.0])

    assert zoo.timing_noisy(row) == ["tctune", "inductor_cg"]
    assert zoo.summarize(row)["timing_noisy"] == ["tctune", "inductor_cg"]


def test_overall_reports_the_clean_rows_apart_and_markdown_marks_noisy_ones():
    clean = _row("a", tct=300.0, ind=250.0)
    noisy = _row("b", tct=100.0, ind=200.0)
    noisy["variants"]["tctune"]["repeats_ms"] = [5.0, 8.0, 9.0, 9.0, 9.0]
    models = {"a": zoo.summarize(clean), "b": zoo.summarize(noisy)}

    s = zoo.overall(models)

    assert s["timing_noisy"] == ["b"] and s["n_speedup_clean"] == 1
    assert s["geomean_speedup_vs_inductor_clean"] == pytest.approx(1.2)
    assert s["min_speedup_vs_inductor"] == pytest.approx(0.5) and s["min_speedup_vs_inductor_clean"] == 1.2
    md = zoo.markdown({"models": models, "summary": s, "dtype": "bf16"})
    assert "| b | huggingface | 8 | 0.50 † |" in md and "| a | huggingface | 8 | 1.20 |" in md
    assert "Over the 1 rows without it: geomean tctune / Inductor 1.20× (lowest 1.20×)" in md


def test_summary_records_the_tctune_variants_output_contract():
    row = _row("m", tct=300.0, ind=250.0)
    row["tctune"]["options"] = {"precision": "bf16", "policy": "pure"}
    assert zoo.summarize(row)["output_dtype"] == "fp32"  # a row from before the option: the backend's default
    row["tctune"]["options"]["output_dtype"] = zoo.TCTUNE_OUTPUT_DTYPE
    assert zoo.TCTUNE_OUTPUT_DTYPE == "compute"  # the contract of torch.compile(model.to(dt)), its baseline
    assert zoo.summarize(row)["output_dtype"] == "compute"


def test_geomean():
    assert zoo.geomean([2.0, 0.5]) == pytest.approx(1.0)
    assert zoo.geomean([1.21, 1.0, None, math.inf]) == pytest.approx(1.1)
    assert zoo.geomean([]) is None


def test_optimize_fields_against_best_plain_trial_and_fp32_fallback():
    trials = [
        {"number": 0, "state": "COMPLETE", "feasible": True, "throughput": 100.0,
         "params": {"batch_size": 8, "precision": "fp32", "graph_passes": False, "runtime": "eager"}},
        {"number": 1, "state": "COMPLETE", "feasible": True, "throughput": 400.0,
         "params": {"batch_size": 8, "precision": "bf16", "graph_passes": False, "runtime": "inductor"}},
        {"number": 2, "state": "COMPLETE", "feasible": False, "throughput": 900.0,  # too inaccurate: not a baseline
         "params": {"batch_size": 8, "precision": "fp16", "graph_passes": False, "runtime": "eager"}},
        {"number": 3, "state": "COMPLETE", "feasible": True, "throughput": 500.0,
         "params": {"batch_size": 8, "precision": "bf16", "graph_passes": True, "runtime": "inductor"}},
    ]
    best = dict(trials[3])
    report = {"best": best, "trials": trials, "baselines": [{"batch_size": 8, "throughput": 100.0, "trial": 0}]}
    f = zoo.optimize_fields(report)
    assert f["speedup_vs_best_baseline"] == pytest.approx(1.25)
    assert f["best_plain"]["trial"] == 1
    assert f["speedup_vs_fp32_eager"] == pytest.approx(5.0)
    assert f["optimize_speedup_source"].startswith("computed here")
    assert f["compiled_baseline"] is True  # trial 1 is torch.compile of the model as written
    report["best"] = dict(best, speedup_vs_best_baseline=4.9)
    assert zoo.optimize_fields(report)["speedup_vs_fp32_eager"] == 4.9
    assert zoo.optimize_fields({"best": None, "trials": []})["speedup_vs_best_baseline"] is None


def test_optimize_speedup_is_the_reports_side_by_side_number():
    """A report that names its best plain baseline gives the number report.md gives (the side-by-side timing
    after the search), not the ratio of the two trials' first timings; the first-timing ratio is kept beside it."""
    trials = [
        {"number": 0, "state": "COMPLETE", "feasible": True, "throughput": 400.0,
         "params": {"batch_size": 8, "precision": "bf16", "graph_passes": False, "runtime": "inductor"}},
        {"number": 1, "state": "COMPLETE", "feasible": True, "throughput": 576.0,
         "params": {"batch_size": 8, "precision": "bf16", "graph_passes": True, "runtime": "inductor"}},
    ]
    best = dict(trials[1], speedup_vs_best_baseline=1.56, speedup_vs_fp32_eager=6.0,
                best_baseline={"trial": 0, "name": "inductor_bf16", "batch_size": 8, "throughput": 390.0})
    f = zoo.optimize_fields({"best": best, "trials": trials})
    assert f["speedup_vs_best_baseline"] == pytest.approx(1.56)
    assert f["speedup_vs_best_baseline_first_timings"] == pytest.approx(1.44)
    assert "side by side" in f["speedup_vs_best_baseline_source"]
    assert f["best_plain"]["trial"] == 0 and f["best_plain"]["report_best_baseline"]["throughput"] == 390.0


def test_optimize_against_eager_baselines_only_is_marked():
    """A short search budget can end before any plain torch.compile baseline ran: the row says so
    (``compiled_baseline`` False) and the table marks the number with ‡ and a footnote."""
    trials = [
        {"number": 0, "state": "COMPLETE", "feasible": True, "throughput": 100.0,
         "params": {"batch_size": 8, "precision": "fp16", "graph_passes": False, "runtime": "eager"}},
        {"number": 1, "state": "COMPLETE", "feasible": True, "throughput": 150.0,
         "params": {"batch_size": 8, "precision": "fp8", "graph_passes": True, "runtime": "inductor-cudagraphs"}},
    ]
    f = zoo.optimize_fields({"best": dict(trials[1]), "trials": trials})
    assert f["compiled_baseline"] is False and f["speedup_vs_best_baseline"] == pytest.approx(1.5)
    row = _row("m", tct=300.0, ind=250.0)
    m = {"m": zoo.summarize(row, dict(f, status="ok"))}
    md = zoo.markdown({"models": m, "summary": zoo.overall(m), "dtype": "bf16"})
    assert "| 1.50 ‡ |" in md and "before a plain `torch.compile` baseline ran" in md
    timed_out = {"m": zoo.summarize(row, {"status": "timeout", "speedup_vs_best_baseline": None})}
    assert "| timeout |" in zoo.markdown({"models": timed_out, "summary": zoo.overall(timed_out), "dtype": "bf16"})


def _write_rows(folder: Path, rows: list[dict]) -> None:
    for r in rows:
        p = zoo.row_path(folder, r["name"])
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(r))


def test_merge_slices_prefers_ok_rows_and_writes_the_schema(tmp_path, capsys):
    a, b = tmp_path / "s1", tmp_path / "s2"
    _write_rows(a, [_row("BertForMaskedLM", tct=300.0, ind=250.0, tct_cg=420.0, ind_cg=400.0),
                    _row("resnet50", suite="torchvision", status="skipped")])
    _write_rows(b, [_row("resnet50", suite="torchvision", tct=110.0, ind=100.0, tct_cg=120.0, ind_cg=100.0,
                         rel=5e-3, eager_rel=1e-3, finished="2026-12-01T09:00:00"),
                    {"name": "openai/gpt-oss-20b", "suite": "huggingface", "batch_size": 8, "dtype": "bf16",
                     "status": "not_built", "reason": "too large", "variants": {}}])
    opt = zoo.row_path(b, "resnet50", "optimize")
    opt.write_text(json.dumps({"name": "resnet50", "status": "ok", "speedup_vs_best_baseline": 1.3}))
    out = tmp_path / "latest.json"
    assert zoo.main(["--merge", str(a), str(b), "--merge-out", str(out)]) == 0
    latest = json.loads(out.read_text())
    assert {"device", "date", "torch", "models"} <= set(latest)
    assert latest["device"] == "NVIDIA H200"
    m = latest["models"]
    assert set(m) == {"BertForMaskedLM", "resnet50", "openai/gpt-oss-20b"}
    keys = {"suite", "batch_size", "dtype", "tctune_ok", "fallbacks", "speedup_vs_inductor", "accuracy_consistent",
            "rel_err", "inductor_rel_err", "compile_s", "inductor_compile_s", "optimize_speedup_vs_best_baseline"}
    assert keys <= set(m["resnet50"])
    assert m["resnet50"]["status"] == "ok"  # the ok row beat the newer... skipped one
    assert m["resnet50"]["speedup_vs_inductor"] == pytest.approx(1.1)
    assert m["resnet50"]["accuracy_consistent"] is False  # 5e-3 > 2 * 1e-3 + 1e-3
    assert m["resnet50"]["optimize_speedup_vs_best_baseline"] == 1.3
    assert m["openai/gpt-oss-20b"]["status"] == "not_built"
    s = latest["summary"]
    assert s["geomean_speedup_vs_inductor"] == pytest.approx(math.sqrt(1.2 * 1.1))
    assert s["geomean_speedup_vs_inductor_cg"] == pytest.approx(math.sqrt(1.05 * 1.2))
    assert s["not_built"] == ["openai/gpt-oss-20b"] and s["accuracy_inconsistent"] == ["resnet50"]
    table = capsys.readouterr().out
    assert "| BertForMaskedLM | huggingface | 8 | 1.20 |" in table
    assert "Geomean tctune / Inductor: **1.15×** over 2 models" in table


def test_merge_without_rows_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit):
        zoo.main(["--merge", str(tmp_path), "--merge-out", str(tmp_path / "x.json")])


# ------------------------------------------------------------------------------------------------ runner


def test_help_explains_the_options():
    out = subprocess.run([sys.executable, str(ZOO_PATH), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for opt in ("--slice", "--models", "--scale", "--tiny", "--model-timeout", "--budget-s", "--merge",
                "--optimize", "--variants"):
        assert opt in out.stdout


def test_a_model_past_its_time_limit_is_killed_while_another_slot_runs(tmp_path, monkeypatch):
    """Two slots (--gpus): the MLP runs and finishes while the sleeping model is killed at its time limit.

    The limit (30 s) is what the MLP's process needs on a slow, loaded host (Python, torch's import, two tiny
    timings: a few seconds on an idle one); the sleep (600 s) is far beyond it, so "killed, not waited for" and
    "started together" have wide margins on either side."""
    monkeypatch.setenv("ZOO_TEST_SLEEP_S", "600")
    t0 = time.perf_counter()
    assert zoo.main(["--models", "zoo_test_sleep,zoo_test_mlp", "--gpus", "0,1", "--device", "cpu",
                     "--variants", "fp32_eager,eager", "--repeats", "1", "--repeat-s", "0.001",
                     "--out", str(tmp_path), "--model-timeout", "30"]) == 0
    sleep = json.loads(zoo.row_path(tmp_path, "zoo_test_sleep").read_text())
    mlp = json.loads(zoo.row_path(tmp_path, "zoo_test_mlp").read_text())
    assert time.perf_counter() - t0 < 300  # killed, not waited for (the sleep is 600 s)
    assert sleep["status"] == "timeout" and "killed after 30 s" in sleep["reason"]
    assert mlp["status"] == "ok", mlp.get("reason")
    import datetime as dt

    started = [dt.datetime.fromisoformat(r["started"]) for r in (sleep, mlp)]
    assert abs((started[1] - started[0]).total_seconds()) < 20  # started together (one after the other: >= 30 s)


def test_budget_stops_starting_models(tmp_path, capsys):
    assert zoo.main(["--models", "zoo_test_mlp,BertForMaskedLM", "--device", "cpu", "--out", str(tmp_path),
                     "--budget-s", "1", "--min-model-s", "60"]) == 0
    for name in ("zoo_test_mlp", "BertForMaskedLM"):
        row = json.loads(zoo.row_path(tmp_path, name).read_text())
        assert row["status"] == "skipped" and "--budget-s" in row["reason"]
    assert "--models zoo_test_mlp,BertForMaskedLM" in capsys.readouterr().out


def test_tiny_dry_run_end_to_end_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    # the worker path in this process (the runner's subprocess is exercised by the timeout test)
    assert zoo.main(["--worker", "BertForMaskedLM", "--tiny", "--scale", "0.0625", "--device", "cpu",
                     "--variants", "fp32_eager,eager", "--repeats", "2", "--repeat-s", "0.005",
                     "--out", str(tmp_path)]) == 0
    row = json.loads(zoo.row_path(tmp_path, "BertForMaskedLM").read_text())
    assert row["status"] == "ok", row.get("reason")
    assert row["batch_size"] == 2 and row["tiny"] is True and row["output_dtype"] == zoo.TCTUNE_OUTPUT_DTYPE
    v = row["variants"]
    assert v["fp32_eager"]["items_per_s"] > 0 and v["eager"]["items_per_s"] > 0
    assert 0 < v["eager"]["rel_err"] < 5e-2 and v["eager"]["nonfinite"] == 0  # bf16 against FP32
    assert v["tctune"]["skipped"].startswith("not requested")
    assert v["eager_cg"]["ok"] is False  # no CUDA here
    out = tmp_path / "latest.json"
    zoo.main(["--merge", str(tmp_path), "--merge-out", str(out)])
    m = json.loads(out.read_text())["models"]["BertForMaskedLM"]
    assert m["status"] == "ok" and m["speedup_vs_inductor"] is None and m["tctune_ok"] is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replays_new_inputs():
    lin = torch.nn.Linear(16, 16).cuda()
    x = torch.randn(4, 16, device="cuda")
    with torch.no_grad():
        run = zoo.cuda_graph(lin, (x,))
        y = torch.randn(4, 16, device="cuda")
        torch.testing.assert_close(run(y), lin(y))


def test_rel_err_chunked_matches_the_direct_formula():
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(5, 7, 11, generator=g)
    out = (ref + 1e-2 * torch.randn(5, 7, 11, generator=g)).bfloat16()
    direct = float((out.double() - ref.double()).norm() / ref.double().norm())
    got = zoo.rel_err(out, ref, chunk=13)  # chunks that do not divide the size
    assert got["rel_err"] == pytest.approx(direct, rel=1e-12) and got["nonfinite"] == 0
    bad = out.clone()
    bad[0, 0, :2] = float("nan")
    assert zoo.rel_err(bad, ref)["nonfinite"] == 2
    assert zoo.rel_err(out[:2], ref)["rel_err"] == math.inf


# ------------------------------------------------------------------------------------------------ sharing a GPU

_LOCK_CHILD = """
import importlib.util, json, os, pathlib, sys, time
spec = importlib.util.spec_from_file_location("tctune_bench_zoo", sys.argv[1])
zoo = sys.modules["tctune_bench_zoo"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(zoo)
# start together: each one's three sections (about 1 s) overlap the other's however late the host started it
barrier = pathlib.Path(sys.argv[3])
(barrier / f"ready-{os.getpid()}").touch()
deadline = time.time() + 120
while len(list(barrier.glob("ready-*"))) < 2 and time.time() < deadline:
    time.sleep(0.01)
spans, waits = [], []
for _ in range(3):
    time.sleep(0.05)  # "compiling": outside the lock
    with zoo.gpu_timing_lock(sys.argv[2], waits):
        t0 = time.time()
        time.sleep(0.3)  # the timed section
        spans.append((t0, time.time()))
print(json.dumps({"spans": spans, "waits": waits}))
"""


def test_timing_lock_serializes_two_processes_timed_sections(tmp_path):
    lock, barrier = tmp_path / ".gpu-0.lock", tmp_path / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _LOCK_CHILD, str(ZOO_PATH), str(lock), str(barrier)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    res = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    spans = sorted(s for r in res for s in r["spans"])
    assert len(spans) == 6
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end - 1e-3, spans  # no two timed sections overlap
    assert max(w for r in res for w in r["waits"]) > 0.1  # someone waited for the other's section
    waits = []
    with zoo.gpu_timing_lock(None, waits):
        pass
    assert waits == [0.0]


def test_gpu_slots_parsing():
    assert zoo.gpu_slots("0,0,0,0", 1, True) == ["0", "0", "0", "0"]
    assert zoo.gpu_slots("0,1", 2, True) == ["0", "0", "1", "1"]
    assert zoo.gpu_slots(None, 3, True) == ["0", "0", "0"]
    assert zoo.gpu_slots(None, 1, True) == [None]
    assert zoo.gpu_slots(None, 3, False) == [None]
    with pytest.raises(ValueError, match="--gpus"):
        zoo.gpu_slots("0,x", 1, True)
    with pytest.raises(ValueError, match="--jobs-per-gpu"):
        zoo.gpu_slots("0", 0, True)
    with pytest.raises(SystemExit):
        zoo.main(["--models", "zoo_test_mlp", "--gpus", "a", "--device", "cpu", "--out", "/tmp/x"])


def test_memory_guard_decisions():
    gib = 2**30
    assert zoo.fits(200 * gib, [], 140 * gib, 0.8)  # alone always starts (its own limit is checked at build)
    assert zoo.fits(40 * gib, [30 * gib, 40 * gib], 140 * gib, 0.8)  # 110 <= 112
    assert not zoo.fits(43 * gib, [30 * gib, 40 * gib], 140 * gib, 0.8)  # 113 > 112
    assert not zoo.fits(1 * gib, [1 * gib], None, 0.8)  # GPU size unknown: one at a time
    assert not zoo.fits(None, [1 * gib], 140 * gib, 0.8)  # own estimate unknown: runs alone
    assert not zoo.fits(1 * gib, [None], 140 * gib, 0.8)  # a running one unknown: nothing joins it
    need, how = zoo.memory_need(10**9, 3 * gib)
    assert need == gib + 8 * 10**9 + 6 * gib and how == "meta forward"
    need, how = zoo.memory_need(10**9, None)
    assert need == gib + 8 * 10**9 + 4 * gib and how.startswith("rough")  # max(4 B/param, 4 GiB)
    need, _ = zoo.memory_need(2 * 10**9, None, out_bytes=10 * gib)
    assert need == gib + 16 * 10**9 + 8 * 10**9 + 30 * gib  # + the reference and two CUDA-graph outputs


def test_meta_activation_peak_counts_live_bytes():
    class Net(torch.nn.Module):
        def forward(self, x):
            a = x * 2  # 4 KiB live
            b = a + 1  # 8 KiB live
            del a
            c = b.view(-1) * 3  # view: no new bytes; product: 8 KiB live again (b and c)
            return c

    built = zoo.Built(Net(), lambda b, dev, seed: (torch.randn(b, 256).to(dev),), "x")
    peak = zoo._meta_activation_peak(built, 4)
    assert peak == 2 * 4 * 256 * 4  # at most two (4, 256) float32 tensors live at once (a freed before c)
    assert zoo._meta_activation_peak(built, 8) == 2 * peak  # scales with the batch


def test_order_smallest_first_and_max_params_skip():
    E = zoo.Entry
    entries = [E("big", "huggingface", 1), E("small", "timm", 1), E("unknown", "timm", 1), E("mid", "timm", 1)]
    plans = {"big": zoo.Plan(7_000_000_000, 60), "small": zoo.Plan(5_000_000, 1), "unknown": zoo.Plan(),
             "mid": zoo.Plan(300_000_000, 3)}
    run, skip = zoo.order_and_limit(entries, plans, "size", None)
    assert [e.name for e in run] == ["unknown", "small", "mid", "big"] and skip == []
    run, skip = zoo.order_and_limit(entries, plans, "list", 2e9)
    assert [e.name for e in run] == ["small", "unknown", "mid"]
    assert [(e.name, r) for e, r in skip] == [("big", "--max-params 2e+09: 7.00 B parameters")]


def test_lock_compiles_puts_each_compile_under_the_gpu_lock(tmp_path):
    assert zoo.main(["--models", "zoo_test_mlp", "--gpus", "0", "--device", "cpu", "--lock-compiles",
                     "--variants", "fp32_eager,eager", "--repeats", "2", "--repeat-s", "0.001",
                     "--out", str(tmp_path), "--model-timeout", "60"]) == 0
    r = json.loads(zoo.row_path(tmp_path, "zoo_test_mlp").read_text())
    assert r["status"] == "ok" and r["lock_compiles"] is True
    assert r["gpu_lock"]["sections"] >= 3  # both timings and at least the compiles before the last timing


def test_max_params_writes_skipped_rows(tmp_path):
    pytest.importorskip("transformers")
    assert zoo.main(["--models", "BertForMaskedLM", "--tiny", "--max-params", "1000", "--device", "cpu",
                     "--out", str(tmp_path)]) == 0
    row = json.loads(zoo.row_path(tmp_path, "BertForMaskedLM").read_text())
    assert row["status"] == "skipped" and row["reason"].startswith("--max-params") and row["params"] > 1000


def test_two_processes_share_one_gpu_slot_pair_and_record_the_lock(tmp_path, monkeypatch):
    """--gpus 0,0 on the CPU: both start together, each row names GPU 0's lock file and two processes per GPU.
    The sleeping model sleeps 15 s, so one started after the other would start >= 15 s later; together, they
    start within the skew of two processes importing torch at once (well under 10 s even on a loaded host)."""
    monkeypatch.setenv("ZOO_TEST_SLEEP_S", "15")
    assert zoo.main(["--models", "zoo_test_sleep,zoo_test_mlp", "--gpus", "0,0", "--device", "cpu",
                     "--variants", "fp32_eager,eager", "--repeats", "2", "--repeat-s", "0.001",
                     "--out", str(tmp_path), "--model-timeout", "60"]) == 0
    import datetime as dt

    rows = [json.loads(zoo.row_path(tmp_path, n).read_text()) for n in ("zoo_test_sleep", "zoo_test_mlp")]
    for r in rows:
        assert r["status"] == "ok", r.get("reason")
        assert r["procs_per_gpu"] == 2 and "2 concurrent" in r["compile_note"]
        assert r["gpu_lock"]["file"] == str((tmp_path / ".gpu-0.lock").resolve())
        assert r["gpu_lock"]["sections"] == 2 and r["gpu_lock"]["wait_s"] >= 0  # fp32_eager and eager timings
    started = [dt.datetime.fromisoformat(r["started"]) for r in rows]
    assert abs((started[1] - started[0]).total_seconds()) < 10  # together (one after the other: >= 15 s)


# ------------------------------------------------------------------------------------------------ FP32 parity


def _parity_row(name, err, mismatch=None, fallbacks=(), ok=True):
    row = _row(name, tct=300.0, ind=250.0)
    row["variants"]["tctune_fp32"] = ({"ok": True, "rel_err": err, "fp32_parity_rel_err": err,
                                       "fp32_parity_mismatch": mismatch} if ok else
                                      {"ok": False, "error": "RuntimeError: boom"})
    row["tctune_fp32"] = {"tol": zoo.FP32_PARITY_TOL, "fired": {"fuse_qkv": 2}, "fallbacks": list(fallbacks)}
    return row


def test_fp32_parity_summary_flags_models_over_the_limit(tmp_path, capsys):
    fine = zoo.summarize(_parity_row("a", 3e-7))
    assert fine["fp32_parity_ok"] is True and fine["fp32_parity_rel_err"] == 3e-7
    assert fine["fp32_parity_fired"] == {"fuse_qkv": 2}
    assert zoo.summarize(_parity_row("b", 2.2e-2))["fp32_parity_ok"] is False
    assert zoo.summarize(_parity_row("c", 0.0, mismatch="output 1: 3 of 8 torch.int64 elements differ"))[
        "fp32_parity_ok"] is False
    assert zoo.summarize(_parity_row("d", 0.0, fallbacks=["RuntimeError: x"]))["fp32_parity_ok"] is False
    assert zoo.summarize(_parity_row("e", None, ok=False))["fp32_parity_ok"] is None
    assert zoo.summarize(_row("f", tct=300.0, ind=250.0))["fp32_parity_ok"] is None  # variant not requested
    _write_rows(tmp_path, [_parity_row("BertForMaskedLM", 3e-7), _parity_row("AllenaiLongformerBase", 2.2e-2),
                           _row("resnet50", suite="torchvision", tct=110.0, ind=100.0)])
    out = tmp_path / "latest.json"
    assert zoo.main(["--merge", str(tmp_path), "--merge-out", str(out)]) == 0
    s = json.loads(out.read_text())["summary"]
    assert s["fp32_parity_checked"] == 2 and s["fp32_parity_over_tol"] == ["AllenaiLongformerBase"]
    assert s["fp32_parity_max_rel_err"] == 2.2e-2
    table = capsys.readouterr().out
    assert "| **2.2e-02** |" in table and "| 3.0e-07 |" in table
    assert "1 of 2 checked models within, worst 2.2e-02; **over**: AllenaiLongformerBase." in table


def test_variants_option_adds_the_optional_parity_variant():
    with pytest.raises(SystemExit):
        zoo.main(["--models", "zoo_test_mlp", "--variants", "tctune_nope", "--device", "cpu", "--list"])
    assert "tctune_fp32" not in zoo.VARIANTS and "tctune_fp32" in zoo.ALL_VARIANTS  # optional: not a default
    opts = zoo.parity_options("bf16", target="sm_90")
    assert opts["precision"] == "bf16" and opts["target"] == "sm_90"
    assert not {"cast_precision", "cast_fp8_linears"} & set(opts["passes"])
    assert {"fuse_qkv", "pad_linear_dims", "fold_conv_batchnorm"} <= set(opts["passes"])


def test_tctune_fp32_variant_writes_parity_into_the_row(tmp_path, monkeypatch):
    """The worker path on the CPU at --tiny: the variant's row fields, then the merged summary. Inductor's code
    generation is replaced by running tctune's rewritten graph (its C++ compile is not what is tested)."""
    pytest.importorskip("transformers")
    import tctune.backend as tb

    monkeypatch.setattr(tb, "inductor_compile", lambda gm, example_inputs, config_patches: gm.forward)
    assert zoo.main(["--worker", "BertForMaskedLM", "--tiny", "--scale", "0.0625", "--device", "cpu",
                     "--variants", "fp32_eager,tctune_fp32", "--repeats", "1", "--repeat-s", "0.001",
                     "--out", str(tmp_path)]) == 0
    row = json.loads(zoo.row_path(tmp_path, "BertForMaskedLM").read_text())
    assert row["status"] == "ok", row.get("reason")
    v = row["variants"]["tctune_fp32"]
    assert v["ok"] is True, v.get("error")
    assert v["fp32_parity_rel_err"] <= zoo.FP32_PARITY_TOL and v["fp32_parity_mismatch"] is None
    info = row["tctune_fp32"]
    assert info["fallbacks"] == [] and info["fired"].get("fuse_qkv", 0) >= 1
    assert info["options"]["passes"] == list(zoo.structural_passes())
    assert row["variants"]["tctune"]["skipped"].startswith("not requested")
    out = tmp_path / "latest.json"
    zoo.main(["--merge", str(tmp_path), "--merge-out", str(out)])
    latest = json.loads(out.read_text())
    assert latest["models"]["BertForMaskedLM"]["fp32_parity_ok"] is True
    assert latest["summary"]["fp32_parity_checked"] == 1 and latest["summary"]["fp32_parity_over_tol"] == []


def test_parity_limit_follows_fp32_eagers_own_rounding():
    assert zoo.parity_limit(None) == zoo.FP32_PARITY_TOL
    assert zoo.parity_limit(1e-7) == zoo.FP32_PARITY_TOL  # the fixed limit is the floor
    assert zoo.parity_limit(7.5e-6) == pytest.approx(zoo.FP32_ROUNDING_FACTOR * 7.5e-6)
    torch.manual_seed(0)
    deep = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        ref = deep(x)
    d = zoo.float64_distance(deep, (x,), ref)
    assert 0 < d < 1e-5  # FP32 rounding of six 64-wide GEMMs, against the float64 run
    assert zoo.float64_distance(deep, (x,), ref + 1e-2 * ref.abs().max()) > 1e-3  # not rounding
    row = _parity_row("m", 2e-5)
    assert zoo.summarize(row)["fp32_parity_ok"] is False  # over 1e-5, no float64 check recorded
    row["variants"]["tctune_fp32"].update(fp32_rounding_err=7.5e-6, fp32_parity_limit=zoo.parity_limit(7.5e-6))
    s = zoo.summarize(row)
    assert s["fp32_parity_ok"] is True and s["fp32_rounding_err"] == 7.5e-6


def test_combine_captures_takes_the_median_of_per_capture_medians_and_keeps_errors():
    caps = [{"ok": True, "ms": 2.0, "repeats_ms": [2.0, 2.1]}, {"ok": False, "error": "capture failed: OOM"},
            {"ok": True, "ms": 1.0, "repeats_ms": [1.0]}, {"ok": True, "ms": 4.0, "repeats_ms": [4.0]}]
    out = zoo.combine_captures(caps, batch=8)
    assert out["ok"] is True and out["ms"] == 2.0 and out["captures"] == 4
    assert out["captures_ms"] == [2.0, 1.0, 4.0] and out["repeats_ms"] == [2.0, 2.1, 1.0, 4.0]
    assert out["items_per_s"] == pytest.approx(8 / 2e-3) and out["capture_errors"] == ["capture failed: OOM"]
    none = zoo.combine_captures([{"ok": False, "skipped": "CUDA graphs need a CUDA device"}] * 2, batch=8)
    assert "ms" not in none and "ok" not in none and none["capture_errors"] == ["CUDA graphs need a CUDA device"] * 2


def test_compile_cache_gives_each_compile_new_cache_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with zoo.compile_cache(False) as note:
        assert note == "shared" and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
    seen = []
    for _ in range(2):
        with zoo.compile_cache(True) as note:
            assert note == "fresh"
            seen.append((os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"]))
    assert seen[0] != seen[1] and all(d.startswith(str(tmp_path)) for d, _ in seen)
    assert all(t.startswith(d) for d, t in seen)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)  # restored after each compile


def test_warm_compile_pool_reports_readiness():
    out = zoo.warm_compile_pool(timeout_s=60)
    assert set(out) >= {"ready", "s"} and out["s"] >= 0
    assert out["ready"] is True or out.get("error")


def test_child_processes_get_the_capture_count_and_the_cache_choice():
    args = zoo._parser().parse_args(["--models", "zoo_test_mlp", "--cg-captures", "5", "--warm-cache",
                                     "--out", "/tmp/x", "--device", "cpu"])
    child = zoo._child_args(args)
    assert child[child.index("--cg-captures") + 1] == "5" and "--warm-cache" in child
    plain = zoo._child_args(zoo._parser().parse_args(["--out", "/tmp/x", "--device", "cpu"]))
    assert plain[plain.index("--cg-captures") + 1] == "3" and "--warm-cache" not in plain


def test_cast_inputs_inside_casts_floating_inputs_only():
    seen = []

    def low(x, ids):
        seen.append((x.dtype, ids.dtype))
        return x.float() * 2 + ids

    call = zoo.cast_inputs_inside(low, torch.bfloat16)
    x, ids = torch.randn(3, 4), torch.randint(0, 5, (3, 4))
    out = call(x, ids)
    assert seen == [(torch.bfloat16, torch.int64)]
    assert torch.equal(out, x.to(torch.bfloat16).float() * 2 + ids)


def test_inductor_with_the_cast_inside_gets_fp32_inputs_and_is_timed_with_both_sides(tmp_path, monkeypatch):
    """The optional ``inductor_fp32in`` variant on the CPU at --tiny: handed the FP32 inputs, it computes what
    ``inductor`` computes on inputs cast beforehand (the same error), is timed in the same interleaved block and
    summarized as ``speedup_vs_inductor_fp32in``. ``torch.compile`` is replaced by the callable it is given (what
    is tested is the variant's plumbing, not Inductor's code generation)."""
    pytest.importorskip("transformers")
    calls = []

    def fake_compile(fn, *a, **kw):
        calls.append(kw.get("backend"))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    assert zoo.main(["--worker", "BertForMaskedLM", "--tiny", "--scale", "0.0625", "--device", "cpu",
                     "--variants", "fp32_eager,eager,inductor,inductor_fp32in", "--repeats", "2",
                     "--repeat-s", "0.001", "--out", str(tmp_path)]) == 0
    row = json.loads(zoo.row_path(tmp_path, "BertForMaskedLM").read_text())
    assert row["status"] == "ok", row.get("reason")
    v = row["variants"]
    assert v["inductor_fp32in"]["ok"] is True, v["inductor_fp32in"].get("error")
    assert v["inductor_fp32in"]["rel_err"] == pytest.approx(v["inductor"]["rel_err"])
    assert len(v["inductor_fp32in"]["repeats_ms"]) == len(v["inductor"]["repeats_ms"]) == 2
    assert "inductor_fp32in" in row["compile_cache"]  # compiled in its own fresh cache, like the other two
    s = zoo.summarize({**row, "variants": {**v, "tctune": {"ok": True, "items_per_s": 50.0}}})
    assert s["speedup_vs_inductor_fp32in"] == pytest.approx(50.0 / v["inductor_fp32in"]["items_per_s"])
    assert zoo.summarize(_row("m", tct=300.0, ind=250.0))["speedup_vs_inductor_fp32in"] is None  # not run


def _optional_variants_row(tmp_path, monkeypatch, names: tuple[str, ...]) -> tuple[dict, list]:
    """The worker row of tiny BERT on the CPU with ``fp32_eager,eager,inductor`` and the optional variants
    ``names``, ``torch.compile`` replaced by the callable it is given (the plumbing is tested, not Inductor); each
    optional variant ran, was timed in the interleaved block with ``inductor`` (2 repeats) in a fresh cache.
    Returns the row and the ``(fn, backend, options)`` of every ``torch.compile`` call."""
    pytest.importorskip("transformers")
    calls = []

    def fake_compile(fn, *a, **kw):
        calls.append((fn, kw.get("backend"), kw.get("options")))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    assert zoo.main(["--worker", "BertForMaskedLM", "--tiny", "--scale", "0.0625", "--device", "cpu",
                     "--variants", ",".join(("fp32_eager", "eager", "inductor") + names), "--repeats", "2",
                     "--repeat-s", "0.001", "--out", str(tmp_path)]) == 0
    row = json.loads(zoo.row_path(tmp_path, "BertForMaskedLM").read_text())
    assert row["status"] == "ok", row.get("reason")
    v = row["variants"]
    for name in names:
        assert v[name]["ok"] is True, v[name].get("error")
        assert len(v[name]["repeats_ms"]) == len(v["inductor"]["repeats_ms"]) == 2
        assert name in row["compile_cache"]
    return row, calls


def test_freezing_variants_get_inductors_freezing_option_and_are_timed_with_both_sides(tmp_path, monkeypatch):
    """The optional ``tctune_freezing`` / ``inductor_freezing`` variants on the CPU at --tiny: the tctune backend
    with ``options["inductor"] = {"freezing": True}`` and ``torch.compile(model.to(dt), options={"freezing":
    True})``, each on its own copy of the model, timed in the interleaved block with ``inductor`` and summarized
    against both plain sides. ``torch.compile`` is replaced by the callable it is given (the plumbing is tested,
    not Inductor's freezing)."""
    row, compiles = _optional_variants_row(tmp_path, monkeypatch, ("tctune_freezing", "inductor_freezing"))
    calls = [(backend, opts) for _, backend, opts in compiles]
    v = row["variants"]
    assert v["inductor_freezing"]["rel_err"] == pytest.approx(v["inductor"]["rel_err"])
    assert v["tctune"].get("skipped") == "not requested (--variants)"
    frozen = [opts for backend, opts in calls if opts and (opts.get("freezing") or
                                                            (opts.get("inductor") or {}).get("freezing"))]
    assert len(frozen) == 2, calls  # one per side, each with Inductor's freezing on
    assert row["tctune_freezing"]["options"]["inductor"] == {"freezing": True}
    s = zoo.summarize(row)
    assert s["speedup_freezing_vs_inductor"] == pytest.approx(
        v["tctune_freezing"]["items_per_s"] / v["inductor"]["items_per_s"])
    assert s["speedup_freezing_vs_inductor_freezing"] == pytest.approx(
        v["tctune_freezing"]["items_per_s"] / v["inductor_freezing"]["items_per_s"])
    assert zoo.summarize(_row("m", tct=300.0, ind=250.0))["speedup_freezing_vs_inductor"] is None  # not run


def test_spread_and_lowtrace_variants_compile_the_dt_model_and_are_timed_with_both_sides(tmp_path, monkeypatch):
    """``inductor_again`` (a second plain compile of the dt model: the compile-to-compile spread) and
    ``tctune_lowtrace`` (the backend on ``model.to(dt)`` with dt inputs) on the CPU at --tiny: each compiles its own
    copy of the dt model, is timed in the interleaved block with ``inductor`` and summarized against it."""
    row, calls = _optional_variants_row(tmp_path, monkeypatch, ("inductor_again", "tctune_lowtrace"))
    v = row["variants"]
    for name in ("inductor_again", "tctune_lowtrace"):
        assert v[name]["rel_err"] == pytest.approx(v["inductor"]["rel_err"])  # the dt model, as inductor's
    compiled = [(fn, backend, opts) for fn, backend, opts in calls if isinstance(fn, torch.nn.Module)]
    models = [fn for fn, _, _ in compiled]
    assert len({id(m) for m in models}) == 3  # inductor, inductor_again, tctune_lowtrace: three copies
    assert all(next(m.parameters()).dtype == torch.bfloat16 for m in models)
    assert [backend for _, backend, _ in compiled][:2] == [None, zoo.inductor_anew]  # not inductor's cache entry
    lowtrace = [opts for _, backend, opts in compiled if backend not in (None, zoo.inductor_anew)]
    assert lowtrace == [{"precision": "bf16", "policy": "pure", "output_dtype": zoo.TCTUNE_OUTPUT_DTYPE}]
    s = zoo.summarize(row)
    assert s["inductor_again_vs_inductor"] == pytest.approx(v["inductor_again"]["items_per_s"] /
                                                            v["inductor"]["items_per_s"])
    assert s["speedup_lowtrace_vs_inductor"] == pytest.approx(v["tctune_lowtrace"]["items_per_s"] /
                                                              v["inductor"]["items_per_s"])
    assert zoo.summarize(_row("m", tct=300.0, ind=250.0))["inductor_again_vs_inductor"] is None  # not run


def test_inductor_again_compiles_anew_where_backend_inductor_reuses_the_first_compile(monkeypatch):
    """On the H200, ``torch.compile(copy.deepcopy(low))`` after ``torch.compile(low)`` took 0.05 s: Dynamo reused
    the first compile's cache entry (same code, equal Inductor backend), so ``inductor_again`` timed one compiled
    callable twice. :func:`zoo.inductor_anew` is a backend of its own: Dynamo compiles again."""
    import copy

    import torch._inductor.compile_fx as cfx

    calls = []
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, inputs, **kw: calls.append(gm) or gm.forward)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.compile(model)(x)
        torch.compile(copy.deepcopy(model))(x)
        assert len(calls) == 1  # the second backend="inductor" compile reused the first
        out = torch.compile(copy.deepcopy(model), backend=zoo.inductor_anew)(x)
    assert len(calls) == 2
    torch.testing.assert_close(out, model(x))
    torch._dynamo.reset()


def test_zero_initialised_weights_are_redrawn_so_errors_can_be_measured():
    """torchvision's ViT builds its head all zero: with random weights its logits were all zero and the zoo read
    relative errors of 0.0 on both sides on the H200 (an accuracy check that cannot fail). Such weights are
    re-drawn; biases and weights with a non-zero value stay as built."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    nn.init.zeros_(model[2].weight)
    nn.init.zeros_(model[2].bias)
    nn.init.zeros_(model[1].weight)
    kept = model[0].weight.clone()
    built = zoo._vision(model, (6,), "test")
    assert zoo.redraw_zero_weights(model) == []  # nothing left to re-draw
    assert "all-zero weights re-drawn: 1.weight, 2.weight" in built.note
    assert torch.equal(model[0].weight, kept) and not model[2].bias.count_nonzero()
    assert torch.equal(model[1].weight, torch.ones(8)) and model[2].weight.std() > 0
    x = built.make_inputs(4, "cpu", 1)[0]
    assert model(x).abs().max() > 0
