"""CPU tests of benchmarks/zoo_profile.py: the kernel categories on real-looking kernel names, the name
normalisation that matches Inductor's kernels across compiles, the per-category diff, the markdown, and a tiny
end-to-end run through the per-model subprocess (no GPU: CPU operators stand in for kernels)."""
from __future__ import annotations

import json

import pytest

from zoo import load_benchmark





zoo = load_benchmark("zoo")
prof = load_benchmark("zoo_profile")


@pytest.mark.parametrize("name, cat", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", "gemm"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>(...)", "gemm"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_execute_"
     "kernel__5x_cublas", "gemm"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_cudnn", "conv"),
    ("triton_poi_fused__to_copy_0", "triton_pointwise"),
    ("triton_red_fused_add_mean_pow_3", "triton_reduction"),
    ("triton_per_fused_native_layer_norm_1", "triton_persistent"),
    ("triton_tem_fused_mm_4", "triton_template"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>,"
     " false, true, false, false, false, true, false, false>(pytorch_flash::Flash_fwd_params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)", "attention"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const>(...)", "copy_cast"),
    ("Memcpy DtoD (Device -> Device)", "copy_cast"),
    ("Memset (Device)", "memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, ...>(int, ...)", "memset"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>",
     "other"),
    ("aten::addmm", "gemm"),
    ("aten::copy_", "copy_cast"),
])
def test_kernel_categories_on_real_looking_names(name, cat):
    assert prof.kernel_category(name) == cat
    assert cat in prof.CATEGORIES


def test_normalize_drops_only_the_triton_index():
    assert prof.normalize("triton_poi_fused__to_copy_add_17") == "triton_poi_fused__to_copy_add"
    assert prof.normalize("triton_per_fused_native_layer_norm_1") == "triton_per_fused_native_layer_norm"
    assert prof.normalize("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT") == "nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT"
    assert prof.normalize("sm90_gemm  tile 128") == "sm90_gemm tile 128"
    assert prof.normalize("## Call CompiledFxGraph fywcv7vkjav6zba4 ##") == "## Call CompiledFxGraph ##"
    assert prof.normalize("Torch-Compiled Region: 0/1") == "Torch-Compiled Region"


def test_diff_matches_renumbered_triton_kernels_and_sums_categories():
    iters = 2
    ind = {"nvjet_hsh_a": (8, 400.0), "triton_poi_fused__to_copy_0": (2, 20.0),
           "triton_per_fused_native_layer_norm_1": (4, 40.0)}
    tct = {"nvjet_hsh_a": (8, 380.0), "triton_poi_fused__to_copy_5": (2, 60.0),
           "triton_per_fused_native_layer_norm_2": (4, 40.0), "Memset (Device)": (2, 4.0)}
    d = prof.diff(ind, tct, iters, top=3)
    assert d["categories"]["gemm"] == {"inductor_us": 200.0, "tctune_us": 190.0, "delta_us": -10.0}
    assert d["categories"]["triton_pointwise"]["delta_us"] == 20.0
    assert d["categories"]["memset"] == {"inductor_us": 0.0, "tctune_us": 2.0, "delta_us": 2.0}
    assert list(d["categories"]) == [c for c in prof.CATEGORIES if c in d["categories"]]
    top = d["top_delta"]
    assert [r["name"] for r in top] == ["triton_poi_fused__to_copy", "nvjet_hsh_a", "Memset (Device)"]
    assert top[0] == {"name": "triton_poi_fused__to_copy", "category": "triton_pointwise", "inductor_calls": 1.0,
                      "inductor_us": 10.0, "tctune_calls": 1.0, "tctune_us": 30.0, "delta_us": 20.0}
    s = prof.side_summary(tct, iters)
    assert s["kernel_us_per_iter"] == 242.0 and s["launches_per_iter"] == 8.0
    assert s["kernels"][0]["name"] == "nvjet_hsh_a" and s["kernels"][0]["total_us"] == 380.0
    assert s["kernels"][0]["us_per_iter"] == 190.0 and abs(sum(k["share"] for k in s["kernels"]) - 1) < 1e-3


def test_markdown_of_a_failed_row_names_the_reason():
    md = prof.combined_markdown([{"name": "m", "status": "timeout", "reason": "killed after 150 s"}])
    assert "| m | timeout |" in md and "killed after 150 s" in md


def test_models_are_required_with_one_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        prof.main(["--out", str(tmp_path), "--device", "cpu"])
    assert "--models or --recipe is required" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_distilbert_end_to_end_on_cpu(tmp_path):
    pytest.importorskip("transformers")
    assert prof.main(["--models", "DistilBertForMaskedLM", "--tiny", "--scale", "0.0625", "--device", "cpu",
                      "--iters", "2", "--warmup", "1", "--out", str(tmp_path)]) == 0
    d = tmp_path / "DistilBertForMaskedLM"
    row = json.loads((d / "profile.json").read_text())
    assert row["status"] == "ok", row.get("reason")
    assert row["kind"] == "cpu_ops" and row["iters"] == 2 and row["batch_size"] == 16
    assert row["output_dtype"] == "compute"  # the contract of the Inductor side: logits left in dt
    for side in prof.SIDES:
        s = row["sides"][side]
        assert s["compile_s"] > 0 and s["wall_ms"] > 0 and s["kernel_us_per_iter"] > 0 and s["kernels"]
        k = s["kernels"][0]
        assert set(k) == {"name", "category", "calls", "total_us", "us_per_iter", "share"}
        assert k["category"] in prof.CATEGORIES and k["calls"] >= 1
        assert abs(sum(k["share"] for k in s["kernels"]) - 1) < 1e-2
    rep = row["tctune_report"]
    assert rep["subgraphs"] >= 1 and rep["fallbacks"] == [] and {"export", "passes", "inductor"} <= set(rep["stage_s"])
    assert rep["pass_s"].get("cast_precision", -1) >= 0 and row["warm_compile_s"] > 0
    assert row["categories"] and 0 < len(row["top_delta"]) <= prof.TOP
    for c in row["categories"].values():
        assert c["delta_us"] == pytest.approx(c["tctune_us"] - c["inductor_us"], abs=0.02)
    md = (d / "profile.md").read_text()
    assert md.startswith("## DistilBertForMaskedLM") and "| category | Inductor µs | tctune µs | delta µs |" in md
    combined = (tmp_path / "profile.md").read_text()
    assert "| DistilBertForMaskedLM | ok |" in combined and "## DistilBertForMaskedLM" in combined


def test_recipe_is_profiled_with_the_given_options(tmp_path):
    """``--recipe FILE``: a model file is built through ``build_model`` / ``example_inputs`` and both sides are
    compiled and profiled (CPU dry run), the backend options from ``--tctune-options`` recorded in the row."""
    recipe = tmp_path / "tiny_mlp.py"
    recipe.write_text("import torch\n"
                      "def build_model():\n"
                      "    torch.manual_seed(0)\n"
                      "    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))\n"
                      "def example_inputs(batch_size):\n"
                      "    return (torch.randn(batch_size, 16),)\n")
    out = tmp_path / "prof"
    rc = prof.main(["--recipe", str(recipe), "--batch", "4", "--device", "cpu", "--iters", "1", "--warmup", "0",
                  "--out", str(out), "--tctune-options", '{"pad": false}'])
    assert rc == 0
    row = json.loads((out / "recipe-tiny_mlp" / "profile.json").read_text())
    assert row["status"] == "ok", row.get("reason")
    assert row["batch_size"] == 4
    assert row["tctune_options"]["pad"] is False and row["tctune_options"]["precision"] == "bf16"
    assert row["sides"]["tctune"]["kernels"] and row["sides"]["inductor"]["kernels"]


def test_tctune_options_must_be_a_json_object(tmp_path, capsys):
    with pytest.raises(SystemExit):
        prof.main(["--recipe", "x.py", "--out", str(tmp_path), "--tctune-options", "[1]"])
    assert "--tctune-options must be a JSON object" in capsys.readouterr().err
