"""A/B of the cast pass's autocast policy: ops off autocast's lower-precision list in their inputs' dtype.

The tctune backend's default policy (``policy="autocast"``) is meant to compute what ``torch.autocast`` computes,
with weights stored low once. Before the rule measured here, every op other than the keep-list, residual adds,
lookups and explicit FP32 values computed low, so a model normalizing its FP32 input (PatchTST's scaler) or
scaling an FP32 lookup (Granite's ``embedding_multiplier``) ran those ops in bf16, and a weight read only by such
an op (an RMSNorm weight as a ``mul``, a layer scale, a position embedding) was stored bf16. The rule
(``passes.cast_precision``, module docstring): an op off ``_LOW_COMPUTE_OPS`` (autocast's lower-precision list:
GEMMs, convolutions, attention) that reads an FP32 value computes in FP32, and a weight no such op reads stays
FP32.

Variants per model (zoo models, random weights, the zoo's batch sizes; one process, ``tctune_before`` and
``tctune`` compiled from deep copies so each has its own Dynamo cache entry):

- ``autocast_inductor``: ``torch.compile(model)`` called under ``torch.autocast("cuda", torch.bfloat16)``: what a
  user of autocast picks by hand;
- ``tctune_before``: the backend with ``policy="autocast"``, the rule switched off inside this script (the two
  private predicates replaced by their earlier behaviour);
- ``tctune``: the backend with ``policy="autocast"`` as committed.

Method: CUDA events (``benchmarks/zoo.py``'s ``time_interleaved``: two warm-up calls, repeats interleaved,
alternating order, median of ``--repeats``); relative L2 error of the first output against FP32 eager, and
autocast eager's error beside it. Compile seconds are the first call.

Usage::

    python benchmarks/bench_autocast_policy.py --models BertForMaskedLM,resnet50 --out results/x
    python benchmarks/bench_autocast_policy.py --tiny --device cpu --models BertForMaskedLM --out /tmp/x
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchload import load_benchmark  # noqa: E402  (this script's folder is first on sys.path)

zoo = load_benchmark("zoo")  # the same module object the tests use

DEFAULT_MODELS = ("BertForMaskedLM,T5Small,GPT2ForSequenceClassification,resnet50,vit_b_16,convnext_tiny,"
                  "efficientnet_b0,swin_t")


def _rule(on: bool) -> None:
    """Switch the rule on (as committed) or off (the earlier behaviour) in ``passes.cast_precision``."""
    cp = sys.modules["passes.cast_precision"]
    if not hasattr(cp, "_committed"):
        cp._committed = (cp._reads_fp32_value, cp._feeds_low_compute)
    if on:
        cp._reads_fp32_value, cp._feeds_low_compute = cp._committed
        return

    def feeds_low_before(user) -> bool:  # before: only lookups and explicit up-casts kept a weight FP32
        lookup = (user.op == "call_function" and isinstance(user.target, torch._ops.OpOverload)
                  and cp.op_name(user) == "embedding")
        return not (lookup or cp._reads_up(user))

    cp._reads_fp32_value, cp._feeds_low_compute = (lambda node, new: False), feeds_low_before


def _first(out):
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    return _first(out[0])


def measure(name: str, args) -> dict:
    import tctune.backend as tb

    entry = zoo.all_entries()[name]
    built = zoo.build(entry, tiny=args.tiny, device=args.device)
    batch = zoo.scaled_batch(entry.batch_size, args.scale)
    inputs = built.make_inputs(batch, args.device, 0)
    model = built.model
    cuda = args.device.startswith("cuda")
    row: dict = {"name": name, "batch_size": batch, "variants": {}}
    with torch.no_grad():
        ref = _first(model(*inputs)).float()
        with torch.autocast(args.device.split(":")[0], torch.bfloat16):
            row["autocast_eager_rel_err"] = zoo.rel_err(_first(model(*inputs)), ref)["rel_err"]
        fns = {}
        makers = {
            "autocast_inductor": (None, lambda: torch.compile(copy.deepcopy(model))),
            # tctune.backend.backend() makes a new backend callable each time: its own Dynamo cache entry.
            "tctune_before": (False, lambda: torch.compile(copy.deepcopy(model), backend=tb.backend(
                precision="bf16", policy="autocast"))),
            "tctune": (True, lambda: torch.compile(copy.deepcopy(model), backend=tb.backend(
                precision="bf16", policy="autocast"))),
        }
        for variant, (rule, make) in makers.items():
            if rule is not None:
                _rule(rule)
            tb.reset()
            fn = make()
            ac = variant == "autocast_inductor"

            def call(*a, fn=fn, ac=ac):
                if ac:
                    with torch.autocast(args.device.split(":")[0], torch.bfloat16):
                        return fn(*a)
                return fn(*a)

            t = time.perf_counter()
            out = _first(call(*inputs))
            if cuda:
                torch.cuda.synchronize()
            v = {"compile_s": round(time.perf_counter() - t, 3), **zoo.rel_err(out, ref)}
            if rule is not None:
                v["fallbacks"] = sum(1 for r in tb.reports if r.fallback)
                v["casts"] = [r.summary()[:200] for r in tb.reports[:4]]
            row["variants"][variant] = v
            fns[variant] = (call, inputs)
        _rule(True)
        for variant, res in zoo.time_interleaved(fns, cuda, args.repeats, args.repeat_s).items():
            row["variants"][variant].update(res)
    base = row["variants"]["autocast_inductor"]["ms"]
    for v in row["variants"].values():
        v["speedup_vs_autocast_inductor"] = round(base / v["ms"], 4)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated zoo model names")
    p.add_argument("--out", type=Path, required=True, help="folder: one NAME.json per model and table.md")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny Hugging Face configs (a CPU check of the script)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the zoo's batch sizes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--repeat-s", type=float, default=0.05)
    p.add_argument("--budget-s", type=float, default=None, help="start no model after this many seconds")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    lines = ["| model | batch | tctune / autocast Inductor | before / autocast Inductor | rel. err tctune | before |"
             " autocast eager | compile s tctune / before / Inductor |", "|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
            print(f"[ab] {name}: not started (--budget-s)", flush=True)
            continue
        torch._dynamo.reset()
        try:
            row = measure(name, args)
        except Exception as exc:  # noqa: BLE001 - one model's failure is recorded, the others still run
            row = {"name": name, "error": zoo.one_line(exc)}
        (args.out / f"{name.replace('/', '--')}.json").write_text(json.dumps(row, indent=1))
        if "error" in row:
            print(f"[ab] {name}: {row['error']}", flush=True)
            continue
        v = row["variants"]
        lines.append(f"| {name} | {row['batch_size']} | {v['tctune']['speedup_vs_autocast_inductor']:.3f} | "
                     f"{v['tctune_before']['speedup_vs_autocast_inductor']:.3f} | {v['tctune']['rel_err']:.2e} | "
                     f"{v['tctune_before']['rel_err']:.2e} | {row['autocast_eager_rel_err']:.2e} | "
                     f"{v['tctune']['compile_s']:.1f} / {v['tctune_before']['compile_s']:.1f} / "
                     f"{v['autocast_inductor']['compile_s']:.1f} |")
        print(lines[-1], flush=True)
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
