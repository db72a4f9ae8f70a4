"""CPU-side logic of benchmarks/bench_fp8_accum.py: arguments, sizes, ratios and the table (the timing needs an
sm_89+ GPU)."""
from __future__ import annotations

import pytest

from zoo import load_benchmark


def _load():
    return load_benchmark("bench_fp8_accum")


def test_arguments_and_sizes():
    b = _load()
    args = b.parse_args(["--out", "x"])
    assert args.models == ["gpt2", "bert"] and args.fp8_keep == [] and args.policy == "pure"
    assert b.sizes(args, "gpt2") == (8, 1024) and b.sizes(args, "bert") == (32, 512)
    args = b.parse_args(["--out", "x", "--models", "bert", "--batch", "4", "--fp8-keep", " *.output.dense, cls ",
                         "--tiny"])
    assert args.models == ["bert"] and args.fp8_keep == ["*.output.dense", "cls"]
    assert b.sizes(args, "bert") == (4, 32)
    for bad in (["--models", "t5"], ["--batch", "0"], ["--models", ","]):
        with pytest.raises(SystemExit):
            b.parse_args(["--out", "x", *bad])


def _row(ms, err=1e-2, gemms=None, error=None, fallbacks=()):
    return {"ok": error is None, "error": error, "compile_s": 10.0, "ms": ms,
            "items_per_s": None if ms is None else 8 / (ms / 1e3), "repeats_ms": [], "rel_err": err,
            "nonfinite": 0, "fp8_gemms": gemms, "fallbacks": list(fallbacks)}


def test_ratios_and_table():
    b = _load()
    variants = {"inductor_bf16": _row(10.0), "tctune_fp8": _row(8.0, 3e-2, 48),
                "tctune_fp8_fast": _row(7.5, 3.2e-2, 48)}
    s = b.summarize(variants)
    assert s == {"fast_vs_full": pytest.approx(8.0 / 7.5, abs=1e-4), "fp8_vs_inductor_bf16": 1.25,
                 "fast_vs_inductor_bf16": pytest.approx(10 / 7.5, abs=1e-4)}
    failed = dict(variants, tctune_fp8_fast=_row(None, None, error="RuntimeError: boom"))
    assert b.summarize(failed)["fast_vs_full"] is None and b.summarize(failed)["fp8_vs_inductor_bf16"] == 1.25

    result = {"device": "NVIDIA H200", "torch": "2.11", "date": "d", "args": {"policy": "pure", "cudagraphs": False},
              "models": {"gpt2": {"batch": 8, "seq": 1024, "variants": failed, **b.summarize(failed)}}}
    md = b.table(result)
    assert "| gpt2 | 8 x 1024 | tctune_fp8 | 8.000 | 1,000 | 3.00e-02 | 48 | 1.250 |  |" in md
    assert "| gpt2 | 8 x 1024 | tctune_fp8_fast | – | – | – | – | – | RuntimeError: boom |" in md
    assert "| gpt2 | | fast / full accumulation | | | | | – | |" in md


def test_no_gpu_exits_zero_without_writing(tmp_path, capsys, monkeypatch):
    import torch

    b = _load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert b.main(["--out", str(tmp_path / "o")]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out and not (tmp_path / "o").exists()
