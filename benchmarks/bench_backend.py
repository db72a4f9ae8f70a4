"""Benchmark ``torch.compile(backend=tctune)`` against fp16 eager and fp16 ``torch.compile`` (Inductor).

Models: BERT-base (``transformers`` ``BertConfig()`` defaults, random weights, batch 64, seq 128; output the
last hidden state) and the seeds' SimpleCNN (``recipes/seed_cnn.py``, batch 1024). Variants per model:

- ``eager_fp16``: ``model.half()`` run eagerly;
- ``compile_fp16``: ``torch.compile(model.half())``, Inductor defaults;
- ``tctune_fp16``: ``torch.compile(fp32 model, backend=tctune.backend.backend(precision="fp16"))``.

Protocol (``tctune.measure``'s): compile time is the first call, timed separately; then
warm-up, then CUDA events around ``--iters`` calls, median of ``--repeats`` (5) repeats, reported as ms per
batch and items/s. Error: max-abs and relative L2 against FP32 eager on the same inputs.

Usage::

    python benchmarks/bench_backend.py --out results/backend_h200.json     # on a CUDA GPU
    python benchmarks/bench_backend.py --dry-run --out /tmp/b.json          # tiny CPU smoke run

Without a CUDA GPU (and without ``--dry-run``) it prints why and exits 0. Budget: under 4 minutes on an H200,
compile time included.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchload import load_module

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _load_recipe(name: str):
    return load_module(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")


def _models(dry_run: bool):
    """(name, fp32 eval model, inputs, items per batch) for each benchmarked model."""
    cnn = _load_recipe("seed_cnn")
    if dry_run:
        from transformers import BertConfig, BertModel

        bert_cls = _load_recipe("bert_base").BertEncoder
        torch.manual_seed(0)
        cfg = BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96,
                         vocab_size=1000, max_position_embeddings=64)
        bert = bert_cls(BertModel(cfg, add_pooling_layer=False))
        yield "bert_tiny", bert.eval(), (torch.randint(0, 1000, (2, 16)),), 2
        yield "seed_cnn", cnn.build_model().eval(), cnn.example_inputs(8), 8
        return
    bert_mod = _load_recipe("bert_base")
    yield "bert_base_b64_s128", bert_mod.build_model().eval(), bert_mod.example_inputs(64), 64
    yield "seed_cnn_b1024", cnn.build_model().eval(), cnn.example_inputs(1024), 1024


def _time(fn, inputs, device: str, warmup: int, iters: int, repeats: int) -> float:
    """Median milliseconds per call over ``repeats`` timed blocks of ``iters`` calls, after ``warmup``."""
    with torch.no_grad():
        for _ in range(warmup):
            fn(*inputs)
        samples = []
        for _ in range(repeats):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(iters):
                    fn(*inputs)
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / iters)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn(*inputs)
                samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples)


def _error(out: torch.Tensor, ref: torch.Tensor) -> dict:
    o, r = out.double(), ref.double()
    return {
        "max_abs": (o - r).abs().max().item(),
        "rel_l2": ((o - r).norm() / r.norm().clamp_min(1e-12)).item(),
        "nonfinite": int((~torch.isfinite(out)).sum().item()),
    }


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)


def run(dry_run: bool, repeats: int, iters: int, warmup: int) -> dict:
    import tctune.backend as tb

    device = "cpu" if dry_run else "cuda"
    low = torch.bfloat16 if dry_run else torch.float16  # CPU has no fast fp16 kernels
    precision = "bf16" if dry_run else "fp16"
    rows = []
    for name, model, inputs, items in _models(dry_run):
        model = model.to(device)
        inputs = tuple(x.to(device) for x in inputs)
        with torch.no_grad():
            ref = _first(model(*inputs)).float()
        half = copy.deepcopy(model).to(low)
        half_inputs = tuple(x.to(low) if x.is_floating_point() else x for x in inputs)
        variants = {
            f"eager_{precision}": lambda: half,
            f"compile_{precision}": lambda: torch.compile(half),
            f"tctune_{precision}": lambda: torch.compile(model, backend=tb.backend(precision=precision)),
        }
        for variant, make in variants.items():
            torch._dynamo.reset()
            tb.reset()
            fn = make()
            args = inputs if variant.startswith("tctune") else half_inputs  # tctune casts in the graph
            t0 = time.perf_counter()
            with torch.no_grad():
                out = _first(fn(*args))
            if device == "cuda":
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0 if not variant.startswith("eager") else 0.0
            ms = _time(fn, args, device, warmup, iters, repeats)
            row = {
                "model": name, "variant": variant, "batch": items, "ms_per_batch": ms,
                "items_per_s": items / (ms / 1e3), "compile_s": compile_s, **_error(out.float(), ref),
            }
            if variant.startswith("tctune"):
                row["tctune_fallbacks"] = [r.fallback for r in tb.reports if r.fallback]
                row["tctune_rewrites"] = {
                    r.name: sum(x.count for rep in tb.reports for x in rep.results if x.name == r.name)
                    for rep in tb.reports for r in rep.results
                }
            rows.append(row)
            print(f"  {name:<20} {variant:<14} {ms:9.3f} ms  compile {compile_s:6.1f} s  "
                  f"rel_l2 {row['rel_l2']:.2e}", flush=True)
        del half
    env = {
        "torch": torch.__version__, "python": platform.python_version(), "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "repeats": repeats, "iters": iters, "warmup": warmup, "dry_run": dry_run,
    }
    return {"env": env, "results": rows}


def _table(report: dict) -> str:
    head = f"{'model':<20} {'variant':<14} {'ms/batch':>9} {'items/s':>11} {'compile s':>9} {'rel L2':>9} {'max abs':>9}"
    lines = [head, "-" * len(head)]
    for r in report["results"]:
        lines.append(f"{r['model']:<20} {r['variant']:<14} {r['ms_per_batch']:9.3f} {r['items_per_s']:11,.0f} "
                     f"{r['compile_s']:9.1f} {r['rel_l2']:9.2e} {r['max_abs']:9.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file to write")
    p.add_argument("--dry-run", action="store_true", help="tiny models on the CPU (bf16), to check the script")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=None, help="calls per timed repeat (default 20; dry run 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10; dry run 1)")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_backend: no CUDA GPU available (torch.cuda.is_available() is False); nothing measured. "
              "Use --dry-run for a tiny CPU run.")
        return 0
    if not args.dry_run:
        torch.backends.cuda.matmul.allow_tf32 = False  # FP32 reference is true FP32
        torch.backends.cudnn.allow_tf32 = False
    iters = args.iters or (2 if args.dry_run else 20)
    warmup = args.warmup or (1 if args.dry_run else 10)
    t0 = time.perf_counter()
    report = run(args.dry_run, args.repeats, iters, warmup)
    report["env"]["wall_s"] = time.perf_counter() - t0
    print(_table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out} ({report['env']['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
