"""Tune a live model from Python, save it, load it in a fresh process, and time both (issue 17's check).

    python benchmarks/api_roundtrip.py --recipe recipes/bert_base.py --batch 64 --timeout 120 --out DIR

Steps, in one call: ``tctune.optimize(model, example_inputs, batch_sizes=[B], ...)`` on the recipe's model (the
same search as the CLI, plain baselines and side-by-side timing included), time the returned module at batch
``B`` (``tctune.measure.time_call``: CUDA events after warm-up, median of repeats), ``tctune.save`` it, then in a
new Python process that never imports the recipe ``tctune.load`` it and time it the same way (its first call
recompiles where Inductor won; that call is warm-up, not timed). Output: ``DIR/api_roundtrip.json`` with both
throughputs, their ratio, the winner and the report's headline (speedup against the fastest plain baseline).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchload import load_module

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOAD_AND_TIME = r"""
import json, sys, time, torch
import tctune
from tctune.measure import time_call
path, batch, shapes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
assert "recipe" not in sys.modules
t0 = time.perf_counter()
m = tctune.load(path)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
inputs = tuple(torch.randint(0, 1000, s, device=dev) if d.startswith("int") else torch.randn(s, device=dev)
               for s, d in shapes)
with torch.inference_mode():
    m(*inputs)
    first = time.perf_counter() - t0
    t = time_call(lambda: m(*inputs), batch, dev)
print(json.dumps({"throughput": t.throughput, "latency_p99_ms": t.latency_p99_ms, "load_and_first_call_s": first}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/bert_base.py")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--trials", type=int, default=4, help="searched trials besides the plain baselines")
    ap.add_argument("--timeout", type=float, default=120.0, help="stop starting trials after S seconds")
    ap.add_argument("--out", default="api_roundtrip_out")
    args = ap.parse_args(argv)
    import torch

    import tctune
    from tctune.measure import time_call

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = load_module("recipe", ROOT / args.recipe)
    model = recipe.build_model()
    t0 = time.perf_counter()
    tuned = tctune.optimize(model, recipe.example_inputs, batch_sizes=[args.batch], trials=args.trials,
                            timeout=args.timeout, no_export=True, quiet=True, out=str(out / "study"))
    search_s = time.perf_counter() - t0
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    inputs = tuple(t.to(dev) for t in recipe.example_inputs(args.batch))
    with torch.inference_mode():
        tuned(*inputs)
        t_tuned = time_call(lambda: tuned(*inputs), args.batch, dev)
    path = tctune.save(tuned, out / "tuned.pt2")
    shapes = [[list(t.shape), str(t.dtype).replace("torch.", "")] for t in inputs]
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_TIME, str(path), str(args.batch), json.dumps(shapes)],
                          capture_output=True, text=True, cwd=str(out))
    loaded = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}
    best = tuned.report.get("best") or {}
    row = {"recipe": args.recipe, "batch": args.batch, "device": torch.cuda.get_device_name() if dev.type == "cuda"
           else "cpu", "torch": torch.__version__, "search_s": round(search_s, 1),
           "winner": {k: best.get(k) for k in ("params", "baseline", "max_rel_error", "chosen_throughput",
                                               "chosen_on")},
           "speedup_vs_best_baseline": best.get("speedup_vs_best_baseline"),
           "speedup_ci95": best.get("speedup_ci95"), "best_baseline": best.get("best_baseline"),
           "speedup_vs_fp32_eager": best.get("speedup_vs_fp32_eager"),
           "tuned_throughput": t_tuned.throughput, "loaded": loaded,
           "loaded_over_tuned": (loaded.get("throughput") / t_tuned.throughput) if loaded.get("throughput") else None,
           "file_mib": round(Path(path).stat().st_size / 2**20, 1)}
    (out / "api_roundtrip.json").write_text(json.dumps(row, indent=2) + "\n")
    (out / "report.json").write_text(json.dumps(tuned.report, indent=2, default=str) + "\n")
    print(json.dumps({k: row[k] for k in ("winner", "speedup_vs_best_baseline", "speedup_ci95", "tuned_throughput",
                                          "loaded_over_tuned", "search_s")}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
