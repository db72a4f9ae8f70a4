"""CPU tests of benchmarks/zoo_ablate.py: the variant plan from the passes that fired, the profile comparison,
the best-removal rule, the table, and a tiny end-to-end run through the per-model subprocess (no GPU)."""
from __future__ import annotations

import json

import pytest

from zoo import load_benchmark





zoo = load_benchmark("zoo")
abl = load_benchmark("zoo_ablate")


class _R:
    def __init__(self, name, count):
        self.name, self.count = name, count


class _Rep:
    def __init__(self, *results):
        self.results = list(results)


def test_fired_passes_sums_over_subgraphs_and_drops_zero_counts():
    reps = [_Rep(_R("fuse_qkv", 2), _R("pad_linear_dims", 0), _R("cast_precision", 10)),
            _Rep(_R("fuse_qkv", 1), _R("fuse_epilogue", 4))]
    assert abl.fired_passes(reps) == {"fuse_qkv": 3, "cast_precision": 10, "fuse_epilogue": 4}


def test_variant_plan_leaves_out_fired_passes_most_rewrites_first_never_the_cast():
    from tctune.backend import BACKEND_PIPELINE as PIPELINE  # the backend's default: what ``full`` runs

    plan = abl.variant_plan({"fuse_qkv": 3, "fuse_epilogue": 7, "cast_precision": 50})
    assert list(plan) == ["cast_only", "minus_fuse_epilogue", "minus_fuse_qkv"]
    assert plan["cast_only"] == ("cast_precision",)
    assert plan["minus_fuse_qkv"] == tuple(p for p in PIPELINE if p != "fuse_qkv")
    assert "minus_cast_precision" not in plan
    assert list(abl.variant_plan({"fuse_qkv": 3, "fuse_epilogue": 7}, max_variants=1)) == [
        "cast_only", "minus_fuse_epilogue"]
    assert list(abl.variant_plan({})) == ["cast_only"]


def test_compare_profiles_diff_names_what_tctune_adds():
    ind = {"sm90_gemm_a": (4.0, 100.0), "triton_poi_fused_add_0": (2.0, 10.0)}
    tct = {"sm90_gemm_a": (4.0, 90.0), "triton_poi_fused_cat_1": (3.0, 30.0), "flash_fwd_kernel": (1.0, 5.0)}
    c = abl.compare_profiles(ind, tct)
    assert c["inductor"]["us_per_call"] == 110.0 and c["full"]["us_per_call"] == 125.0
    assert c["full"]["top"][0] == ["sm90_gemm_a", 4.0, 90.0]
    assert c["diff"][0] == ["triton_poi_fused_cat_1", 30.0, 3.0, 0.0]
    assert [d[0] for d in c["saves"]] == ["sm90_gemm_a", "triton_poi_fused_add_0"]
    assert c["categories"]["triton"] == {"inductor": 10.0, "full": 30.0, "delta": 20.0}
    assert c["categories"]["gemm"]["delta"] == -10.0 and c["categories"]["attention"]["delta"] == 5.0
    assert abl.category("void cutlass::Kernel<...>") == "gemm" and abl.category("Memcpy DtoD") == "copy"


def test_best_removal_only_when_it_beats_full():
    row = {"variants": {"full": {"ratio": 0.8}, "minus_a": {"ratio": 0.95}, "minus_b": {"ratio": 0.7},
                        "minus_c": {"ok": False, "skipped": "time"}}}
    assert abl.best_removal(row) == {"pass": "a", "ratio": 0.95, "gain_vs_full": round(0.95 / 0.8, 4)}
    row["variants"]["full"]["ratio"] = 1.0
    assert abl.best_removal(row) is None
    t = abl.table([dict(row, name="m", status="ok")])
    assert "| m | ok |" in t and "-a 0.95" in t and "-c - (time)" in t and t.rstrip().endswith("none |")


def test_backend_options_keep_the_inductor_baselines_output_contract():
    """Every tctune variant leaves its outputs in dt ("compute"), like its baseline torch.compile(model.to(dt))
    and like benchmarks/zoo.py's tctune variant; the backend accepts the options as given."""
    from tctune.backend import BackendConfig

    full = abl.backend_options("bf16")
    assert full == {"precision": "bf16", "policy": "pure", "output_dtype": "compute"}
    assert zoo.TCTUNE_OUTPUT_DTYPE == "compute"
    cast_only = abl.backend_options("fp16", ("cast_precision",))
    assert cast_only["output_dtype"] == "compute" and cast_only["passes"] == ("cast_precision",)
    assert BackendConfig(**cast_only).output_dtype == "compute"


def test_models_are_required_with_one_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        abl.main(["--out", str(tmp_path), "--device", "cpu"])
    assert "--models is required" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_distilbert_end_to_end_on_cpu(tmp_path, capsys):
    pytest.importorskip("transformers")
    assert abl.main(["--models", "DistilBertForMaskedLM", "--tiny", "--scale", "0.0625", "--device", "cpu",
                     "--repeats", "1", "--repeat-s", "0.001", "--profile-iters", "1", "--out", str(tmp_path)]) == 0
    row = json.loads(abl.out_path(tmp_path, "DistilBertForMaskedLM").read_text())
    assert row["status"] == "ok", row.get("reason")
    assert row["batch_size"] == 16 and row["fired"].get("cast_precision", 0) > 0
    assert row["output_dtype"] == "compute"  # recorded: the contract every variant ran under
    expected = ["cast_only"] + [f"minus_{p}" for p in sorted((p for p in row["fired"] if p != "cast_precision"),
                                                            key=lambda p: -row["fired"][p])]
    assert list(row["plan"]) == expected and len(expected) > 1  # a pass besides the cast fired: left out once
    assert set(row["variants"]) == {"inductor", "full", *expected}
    for name in ("full", *expected):
        v = row["variants"][name]
        assert v["ok"] is True and v["items_per_s"] > 0 and v["ratio"] > 0, (name, v)
    prof = row["profile"]
    assert prof["kind"] == "cpu_ops" and prof["inductor"]["top"] and prof["full"]["top"]
    assert len(prof["full"]["top"]) <= abl.TOP
    out = capsys.readouterr().out
    assert "| DistilBertForMaskedLM | ok |" in out.rstrip().splitlines()[-1]  # the table is printed last
