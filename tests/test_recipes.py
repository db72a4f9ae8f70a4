"""The bundled recipes load as model files and keep the contract, without building the big models.

Full-size builds are left to the GPU suite (benchmarks/suite.py); here only cheap builds run: the seed CNN,
tiny configurations of the BERT-large and GPT-2 recipes (through their ``make_model``), and the error a
missing package gives.
"""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tctune.errors import ModelFileError
from tctune.modelfile import load_model_file
from zoo import load_benchmark

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

#: recipe -> (example_inputs(batch) shapes for batch 3, dtype, has training functions)
CONTRACT = {
    "seed_cnn": ([(3, 3, 32, 32)], torch.float32, True),
    "bert_base": ([(3, 128)], torch.int64, True),  # also a fine-tuning step (regression targets)
    "bert_large": ([(3, 384)], torch.int64, False),
    "gpt2": ([(3, 512)], torch.int64, False),
    "resnet50": ([(3, 3, 224, 224)], torch.float32, True),
}
VOCAB = {"bert_base": 30522, "bert_large": 30522, "gpt2": 50257}


def module_of(mf):
    return sys.modules[f"tctune_model_{mf.name}"]


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_recipe_loads_and_inputs_keep_the_contract(name):
    mf = load_model_file(RECIPES / f"{name}.py")
    shapes, dtype, trainable = CONTRACT[name]
    inputs = mf.inputs(3)
    assert [tuple(x.shape) for x in inputs] == shapes
    assert all(x.dtype == dtype for x in inputs)
    if name in VOCAB:  # token ids inside the vocabulary, and fresh (not constant)
        (ids,) = inputs
        assert 0 <= int(ids.min()) and int(ids.max()) < VOCAB[name]
        assert ids.unique().numel() > 1
    else:
        assert inputs[0].std() > 0
    assert (mf.loss_fn is not None and mf.example_targets is not None) == trainable


def test_resnet50_training_functions():
    mf = load_model_file(RECIPES / "resnet50.py")
    targets = mf.example_targets(4)
    assert targets.shape == (4,) and targets.dtype == torch.int64 and int(targets.max()) < 1000
    loss = mf.loss_fn(torch.randn(4, 1000, requires_grad=True), targets)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_resnet50_builds_when_torchvision_is_there():
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed here (it is on the H200 machine, where benchmarks/suite.py builds "
                    "ResNet-50); the missing-package error is tested instead")
    mf = load_model_file(RECIPES / "resnet50.py")
    model = mf.model().eval()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's ResNet-50
    with torch.inference_mode():
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 1000)


def test_resnet50_without_torchvision_gives_the_model_file_error():
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the missing-package path cannot happen here")
    mf = load_model_file(RECIPES / "resnet50.py")  # importing the file must not need torchvision
    with pytest.raises(ModelFileError, match="build_model.*torchvision"):
        mf.model()


def test_seed_cnn_builds_and_runs():
    mf = load_model_file(RECIPES / "seed_cnn.py")
    out = mf.model()(*mf.inputs(2))
    assert out.shape == (2, 10)


def test_bert_large_config_sizes_and_tiny_smoke():
    transformers = pytest.importorskip("transformers")
    mf = load_model_file(RECIPES / "bert_large.py")
    mod = module_of(mf)
    cfg = transformers.BertConfig(**mod.CONFIG)  # the sizes, without building 335 M parameters
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (1024, 24, 16, 4096)
    assert cfg.vocab_size == mod.VOCAB_SIZE == 30522 and cfg.max_position_embeddings >= mod.SEQ_LEN == 384
    tiny = mod.make_model(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                          vocab_size=100).eval()
    with torch.inference_mode():
        out = tiny(torch.randint(0, 100, (2, 384)))
    assert out.shape == (2, 384, 32) and out.dtype == torch.float32  # a plain tensor: the last hidden state


def test_gpt2_config_sizes_and_tiny_smoke():
    transformers = pytest.importorskip("transformers")
    mf = load_model_file(RECIPES / "gpt2.py")
    mod = module_of(mf)
    cfg = transformers.GPT2Config()
    assert cfg.vocab_size == mod.VOCAB_SIZE == 50257 and cfg.n_positions >= mod.SEQ_LEN == 512
    tiny = mod.make_model(n_embd=32, n_layer=1, n_head=2, vocab_size=101, n_positions=512,
                          bos_token_id=0, eos_token_id=0).eval()
    with torch.inference_mode():
        out = tiny(torch.randint(0, 101, (2, 512)))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 512, 101)  # logits, no KV cache


# -- benchmarks/suite.py, which measures these recipes on a GPU: its cheap, GPU-free parts ------------------------


def load_suite():
    return load_benchmark("suite")


def test_suite_models_are_the_recipes():
    suite = load_suite()
    assert set(suite.MODELS) == set(CONTRACT)
    for name, spec in suite.MODELS.items():
        assert (RECIPES / f"{spec.recipe}.py").exists()
    assert sum(s.limit_s for s in suite.MODELS.values()) <= 400  # the run_h200.sh step is killed at 420 s


def test_suite_summary_takes_the_fastest_variant_within_the_error_limit():
    suite = load_suite()
    v = {
        "fp32_eager": {"kind": "baseline", "precision": "fp32", "status": "ok", "throughput": 100.0,
                       "rel_l2_error": 0.0, "nonfinite": 0},
        "fp16_eager": {"kind": "baseline", "precision": "fp16", "status": "ok", "throughput": 400.0,
                       "rel_l2_error": 2e-2, "nonfinite": 0},  # over 1e-2: not a valid baseline
        "tf32_eager": {"kind": "baseline", "precision": "tf32", "status": "ok", "throughput": 300.0,
                       "rel_l2_error": 1e-3, "nonfinite": 0},
        "tctune_bf16_eager": {"kind": "tctune", "precision": "bf16", "status": "ok", "throughput": 600.0,
                              "rel_l2_error": 5e-3, "nonfinite": 0, "achieved_tflops": 60.0},
        "tctune_fp16_cudagraphs": {"kind": "tctune", "precision": "fp16", "status": "ok", "throughput": 900.0,
                                   "rel_l2_error": 1e-3, "nonfinite": 3},  # NaN/inf: never chosen
        "tctune_compile_fp16_pure": {"kind": "tctune", "precision": "fp16", "status": "timeout", "reason": "x"},
    }
    m = suite.finish({"variants": v}, {"bf16": 600.0, "fp16": 650.0})
    assert (m["best_baseline_name"], m["best_baseline"]) == ("tf32_eager", 300.0)
    assert (m["tctune_name"], m["tctune"], m["ratio"]) == ("tctune_bf16_eager", 600.0, 2.0)
    assert m["max_rel_error"] == 5e-3 and m["ceiling_tflops"] == 600.0 and m["fraction_of_ceiling"] == 0.1
    assert (m["fastest_variant_name"], m["fastest_variant_ratio"]) == ("tctune_bf16_eager", 2.0)

    # what `tctune optimize` chose is the headline when it ran within the limit, even if a fixed variant is faster
    v["tctune_optimize"] = {"kind": "tctune", "precision": "fp16", "status": "ok", "throughput": 450.0,
                            "rel_l2_error": 1e-3, "nonfinite": 0, "achieved_tflops": 45.0}
    m = suite.finish({"variants": v}, {"bf16": 600.0, "fp16": 650.0})
    assert (m["tctune_name"], m["tctune"], m["ratio"], m["max_rel_error"]) == ("tctune_optimize", 450.0, 1.5, 1e-3)
    assert (m["fastest_variant_name"], m["fastest_variant"]) == ("tctune_bf16_eager", 600.0)
    v["tctune_optimize"]["rel_l2_error"] = 2e-2  # over the limit: not the headline
    assert suite.finish({"variants": v}, {})["tctune_name"] == "tctune_bf16_eager"


def test_suite_fp8_variants_are_judged_by_the_fp8_error_limit():
    suite = load_suite()
    row = {"status": "ok", "nonfinite": 0, "rel_l2_error": 3e-2}
    v = {
        "fp16_eager": {"kind": "baseline", "precision": "fp16", "throughput": 100.0, **row, "rel_l2_error": 1e-3},
        "fp8_torchao_compile": {"kind": "baseline", "precision": "fp8", "throughput": 150.0, **row},
        "tctune_fp8_inductor_cudagraphs": {"kind": "tctune", "precision": "fp8", "throughput": 300.0, **row,
                                           "rel_l2_error": 7e-2},  # over 5e-2: rejected
        "tctune_fp8keep_inductor_cudagraphs": {"kind": "tctune", "precision": "fp8", "throughput": 200.0, **row},
        "tctune_bf16_pure_cudagraphs": {"kind": "tctune", "precision": "bf16", "throughput": 250.0, **row},  # > 1e-2
    }
    m = suite.finish({"variants": v}, {})
    assert m["best_baseline_name"] == "fp8_torchao_compile"  # 3e-2 is within the FP8 limit
    assert (m["tctune_name"], m["ratio"]) == ("tctune_fp8keep_inductor_cudagraphs", 200.0 / 150.0)


def test_suite_variants_option_names_real_variants(capsys):
    suite = load_suite()
    with pytest.raises(SystemExit):
        suite.main(["--out", "x", "--variants", "fp16_eagr"])
    assert "match no variant" in capsys.readouterr().err


def test_suite_without_a_gpu_says_so_and_exits_0(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    assert load_suite().main(["--out", str(tmp_path)]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "latest.json").exists()


def test_suite_optimize_variant_measures_what_the_search_chose(tmp_path):
    """``tctune_optimize`` (dry run: the seed CNN on the CPU) runs the Tuner at the model's batch, then measures
    the best trial's configuration like every variant; the summary reports it beside the fastest variant.

    One searched trial besides the plain baselines, and time limits far above what the run needs (on a 2-core
    host under a load of 5, a search of this model's 4 candidates took 48 s, against the 80 s deadline a 20 s
    budget gives it): the search ends on its trial count, never on its budget, and a slow host does not turn
    the variant into "skipped" (model time limit) or "failed" (the search's deadline)."""
    suite = load_suite()
    out = tmp_path / "suite"
    assert suite.main(["--out", str(out), "--dry-run", "--models", "seed_cnn", "--variants",
                       "fp32_eager,tctune_optimize", "--optimize-trials", "1", "--optimize-budget", "300",
                       "--model-limit", "seed_cnn=900", "--budget", "1200"]) == 0
    m = json.loads((out / "latest.json").read_text())["models"]["seed_cnn"]
    row = m["variants"]["tctune_optimize"]
    assert row["status"] == "ok", row
    opt = row["optimize"]
    assert opt["params"]["batch_size"] == m["batch"] and opt["complete"] >= 1 and opt["search_s"] > 0
    assert row["precision"] == opt["params"]["precision"] and row["rel_l2_error"] <= 1e-2
    assert (m["tctune_name"], m["tctune"]) == ("tctune_optimize", row["throughput"])
    assert m["ratio"] == row["throughput"] / m["best_baseline"]
    assert (out / "optimize" / "seed_cnn" / "study.db").exists()


def test_suite_model_limit_takes_pairs(capsys):
    suite = load_suite()
    for bad in (["--optimize-trials", "0"], ["--optimize-budget", "-5"], ["--budget", "-1"]):
        with pytest.raises(SystemExit):
            suite.main(["--out", "x", *bad])
        assert f"{bad[0]} must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        suite.main(["--out", "x", "--model-limit", "gtp2=100"])
    assert "unknown model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        suite.main(["--out", "x", "--model-limit", "gpt2=fast"])
    assert "expected seconds" in capsys.readouterr().err


def test_benchmark_scripts_share_one_by_path_loader_found_beside_them(tmp_path):
    """benchmarks/ is a folder of scripts, not a package: they load each other and the recipes through
    benchmarks/benchload.py, which a script run by path finds in its own folder (sys.path[0])."""
    import subprocess

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    users = sorted(p.name for p in bench.glob("*.py") if "spec_from_file_location" in p.read_text())
    assert users == ["benchload.py", "zoo.py"]  # zoo.py: only in the model file it generates, which stands alone
    bad = tmp_path / "a.json"
    bad.write_text("{}")
    r = subprocess.run([sys.executable, str(bench / "merge_latest.py"), "--out", str(tmp_path / "m.json"), f"m={bad}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    # it got past `from benchload import ...` and loaded suite.py through it (merge() loads it first)
    assert r.returncode == 1 and f"merge_latest: {bad} is not a benchmarks/suite.py latest.json" in r.stderr, r.stderr


def test_merge_latest_takes_each_row_whole_and_recomputes_its_summary(tmp_path):
    merge = load_benchmark("merge_latest")
    ok = {"status": "ok", "nonfinite": 0, "rel_l2_error": 1e-3}
    run = {"device": "GPU", "torch": "2.11", "ceilings_tflops": {"fp16": 600.0}, "models": {"m": {
        "tctune_name": "stale", "ratio": 9.9,  # an old summary: recomputed
        "variants": {"fp16_eager": {"kind": "baseline", "precision": "fp16", "throughput": 100.0, **ok},
                     "tctune_optimize": {"kind": "tctune", "precision": "fp16", "throughput": 150.0, **ok}}}}}
    a = tmp_path / "a.json"
    a.write_text(json.dumps(run))
    out = merge.merge([("m", a)], "why")
    row = out["models"]["m"]
    assert (row["tctune_name"], row["ratio"]) == ("tctune_optimize", 1.5) and out["note"] == "why"
    assert row["source"] == str(a) and row["ceilings_tflops_that_call"] == {"fp16": 600.0}
    b = tmp_path / "b.json"
    b.write_text(json.dumps({**run, "torch": "2.12"}))
    with pytest.raises(SystemExit, match="not one table"):
        merge.merge([("m", a), ("m", b)], "")
    with pytest.raises(SystemExit, match="has no model"):
        merge.merge([("x", a)], "")
    c = tmp_path / "c.json"
    c.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="not a benchmarks/suite.py latest.json"):
        merge.merge([("m", c)], "")
    c.write_text(json.dumps({**run, "dry_run": True}))
    with pytest.raises(SystemExit, match="dry-run"):
        merge.merge([("m", c)], "")
