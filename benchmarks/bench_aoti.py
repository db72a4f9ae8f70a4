"""AOTInductor on the GPU: does a ``.pt2`` load, does it match PyTorch, and how fast is BERT-base's package?

Usage::

    python benchmarks/bench_aoti.py --out DIR            # on a CUDA GPU (BERT-base's package compile is most of it)
    python benchmarks/bench_aoti.py --out DIR --dry-run  # tiny models on the CPU, to check the script

Why: ``torch._inductor.aoti_load_package`` segfaulted on the H200 (torch 2.11) for BERT-base's package
(benchmarks/NOTES.md, the AOTI probes in "tctune's graph through Inductor"). Each step below runs in its own
child process (``python -X faulthandler``), so a crash is recorded with the Python frames faulthandler prints
instead of ending the run:

1. ``probe_compile`` / ``probe_load``: a 2-layer MLP (fp16, 256 wide) with ``Dim("batch")`` packaged in one child
   and loaded in another (what tctune does): does any CUDA package load on this machine?
2. ``bert_base``: ``recipes/bert_base.py`` captured by tctune, fp16 graph with the ``pure`` cast policy
   (``tctune.trial.apply_passes``), packaged by ``tctune.export.aoti.export_aoti`` (which validates it at
   batch 1 and 64 against the graph), then timed at batch 64 / seq 128 against the same graph run eagerly and
   replayed as a CUDA graph, in the same child (``tctune.measure.time_call``: CUDA events, warm-up, median of
   5 repeats). Relative L2 error of each against FP32 eager.

Writes ``DIR/bench_aoti.json`` (one entry per step: ``status`` ok / failed / crashed, ``reason``, ``stderr_tail``,
and the numbers) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = r'''
import sys, json, time, torch
sys.path.insert(0, {root!r})
mode, path, dev = sys.argv[1], sys.argv[2], sys.argv[3]
device = torch.device(dev)
dt = torch.float16 if device.type == "cuda" else torch.float32
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(device, dt).eval()
x = torch.randn(8, 256, device=device, dtype=dt)
out = {{}}
if mode in ("static", "dynamic", "compile"):
    dyn = ({{0: torch.export.Dim("batch", min=1, max=4096)}},) if mode != "static" else None
    ep = torch.export.export(m, (x,), dynamic_shapes=dyn, strict=False)
    t = time.perf_counter()
    torch._inductor.aoti_compile_and_package(ep, package_path=path)
    out["compile_s"] = round(time.perf_counter() - t, 2)
if mode in ("static", "dynamic", "load"):
    f = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        y, ref = f(x), m(x)
    out["max_abs_error"] = float((y.float() - ref.float()).abs().max())
print("RESULT " + json.dumps(out))
'''

_BERT = r'''
import sys, json, time, torch
sys.path.insert(0, {root!r})
from tctune.capture import capture
from tctune.export.aoti import export_aoti
from tctune.hardware import resolve
from tctune.measure import precision_mode, time_call
from tctune.modelfile import load_model_file
from tctune.runtime import wrap
from tctune.trial import apply_passes
path, dev, batch, tiny = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
device = torch.device(dev)
mf = load_model_file({root!r} + "/recipes/bert_base.py")
model = mf.model().to(device).eval()
if tiny:
    from transformers import BertConfig, BertModel
    sys.path.insert(0, {root!r} + "/benchmarks")
    from benchload import load_module
    mod = load_module("r", {root!r} + "/recipes/bert_base.py")
    cfg = BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96, vocab_size=1000)
    torch.manual_seed(0)
    model = mod.BertEncoder(BertModel(cfg, add_pooling_layer=False)).to(device).eval()
    make = lambda b: (torch.randint(0, 1000, (b, 16)),)
else:
    make = lambda b: tuple(mf.inputs(b, torch.device("cpu")))
hw = resolve() if device.type == "cuda" else resolve("h200")
prec = "fp16" if device.type == "cuda" else "fp32"
with precision_mode("fp32"):
    gm = capture(model, tuple(t.to(device) for t in make(2)))
g, _ = apply_passes(gm, hw, prec, policy="pure")
g = g.to(device)
out = {{"precision": prec, "policy": "pure", "batch": batch}}
t = time.perf_counter()
res = export_aoti(g, make, path, batch_sizes=(1, batch))
out.update({{k: v for k, v in res.items() if k != "aoti"}})
out["export_total_s"] = round(time.perf_counter() - t, 2)
pkg = torch._inductor.aoti_load_package(path)
torch.manual_seed(1234)
x = tuple(t.to(device) for t in make(batch))
flat = lambda o: torch.cat([t.float().reshape(-1) for t in torch.utils._pytree.tree_leaves(o)])
with torch.no_grad(), precision_mode("fp32"):
    ref = flat(model(*x)).double()
rows = {{}}
for name, fn in (("graph_eager", g), ("graph_cudagraphs", None), ("aoti", pkg)):
    if name == "graph_cudagraphs":
        if device.type != "cuda":
            continue
        fn, _ = wrap(g, "cudagraphs", x)
    with torch.no_grad():
        o = flat(fn(*x)).double()
    err = float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref))
    tm = time_call(lambda: fn(*x), batch, device, warmup=3, repeats=5, target_repeat_s=0.1, single_calls=0)
    rows[name] = {{"latency_ms": tm.latency_ms, "throughput": tm.throughput, "rel_l2_error": err}}
out["variants"] = rows
print("RESULT " + json.dumps(out))
'''


def run_child(code: str, args: list[str], timeout_s: float) -> dict:
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, *args], capture_output=True,
                           text=True, timeout=timeout_s, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"no answer after {timeout_s:.0f} s", "wall_s": timeout_s}
    entry: dict = {"wall_s": round(time.perf_counter() - t0, 1), "returncode": r.returncode}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode == 0 and lines:
        entry.update(status="ok", **json.loads(lines[-1][len("RESULT "):]))
    else:
        entry["status"] = "crashed" if r.returncode < 0 else "failed"
        entry["reason"] = (f"killed by signal {-r.returncode}" if r.returncode < 0 else
                           (r.stderr.strip().splitlines() or ["?"])[-1][:300])
        entry["stderr_tail"] = r.stderr[-4000:]
    return entry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (bench_aoti.json)")
    p.add_argument("--dry-run", action="store_true", help="tiny models on the CPU")
    p.add_argument("--batch", type=int, default=64, help="BERT-base batch (default %(default)s)")
    p.add_argument("--skip-bert", action="store_true", help="only the probe")
    p.add_argument("--bert-timeout", type=float, default=420.0, help="seconds for the BERT-base step")
    args = p.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("bench_aoti: no CUDA GPU here; nothing measured (use --dry-run on the CPU)")
        return 0
    dev = "cpu" if args.dry_run else "cuda:0"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = out_dir / "pt2"
    work.mkdir(exist_ok=True)
    probe = _PROBE.format(root=str(ROOT))
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if dev != "cpu" else "cpu",
                    "steps": {}}
    steps = report["steps"]

    def record(name: str, entry: dict) -> None:
        """Keep the step, rewrite the JSON and print its line at once (a killed run keeps what finished)."""
        steps[name] = entry
        (out_dir / "bench_aoti.json").write_text(json.dumps(report, indent=1))
        detail = entry.get("reason", "")
        if name == "bert_base" and entry["status"] == "ok":
            detail = "  ".join(f"{k} {v['latency_ms']:.3f} ms {v['throughput']:.0f}/s err {v['rel_l2_error']:.1e}"
                               for k, v in entry["variants"].items())
            detail += f"  (package compile {entry.get('aoti_compile_s')} s)"
        elif entry["status"] == "ok":
            detail = f"max_abs_error {entry.get('max_abs_error')} compile {entry.get('compile_s')} s"
        print(f"{name:<14} {entry['status']:<8} {entry['wall_s']:>7} s  {detail}", flush=True)

    print(f"{'step':<14} {'status':<8} {'wall':>9}  detail", flush=True)
    c = run_child(probe, ["compile", str(work / "split.pt2"), dev], 240)
    record("probe_compile", c)
    if c["status"] == "ok":
        record("probe_load", run_child(probe, ["load", str(work / "split.pt2"), dev], 120))
    if not args.skip_bert:
        batch = 2 if args.dry_run else args.batch
        record("bert_base", run_child(_BERT.format(root=str(ROOT)),
                                      [str(work / "bert_base.pt2"), dev, str(batch), "1" if args.dry_run else "0"],
                                      args.bert_timeout))
    for f in work.glob("*.pt2"):
        f.unlink()
    return 0

if __name__ == "__main__":
    sys.exit(main())
