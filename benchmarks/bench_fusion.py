"""Measure what each fusion pass buys on BERT-base at fp16: the graph with and without it, against eager.

Usage::

    python benchmarks/bench_fusion.py --out FILE.json            # on a CUDA GPU (< 90 s on an H200)
    python benchmarks/bench_fusion.py --dry-run --out FILE.json  # tiny BERT on the CPU, to check the script

Without a CUDA GPU (and without ``--dry-run``) it prints a message and exits 0.

Model: ``transformers`` ``BertModel(BertConfig())`` (BERT-base: 12 layers, hidden 768, 12 heads; random
weights, no download), ``add_pooling_layer=False``, default SDPA attention; input ``input_ids`` (64, 128).
Candidates, all on the same inputs:

* eager FP32 (TF32 off): the reference every other output is compared with (relative L2 error);
* eager fp16 (``model.half()``) and eager autocast fp16;
* the captured graph (``tctune.capture.capture``: ``torch.export`` with a dynamic batch) after
  ``passes.run_pipeline`` with ``PassSpec(precision="fp16", alignment={"fp16": 8, ...})``:
  ``all passes`` (``passes.PIPELINE``), ``no fusions`` (PIPELINE without the four fusion passes), and
  ``without <pass>`` for each fusion pass, so each pass's "before" is ``without <pass>`` and its "after" is
  ``all passes``.

Protocol (``tctune.measure``'s): 3 warm-up calls, then 5 repeats of ``iters`` calls timed with
CUDA events (``time.perf_counter`` on the CPU), ``iters`` chosen so a repeat takes about 0.1 s; the
reported time is the median repeat, in ms per batch, and sequences/s.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from passes import PIPELINE, PassSpec, run_pipeline  # noqa: E402
from tctune.capture import capture  # noqa: E402
from tctune.measure import time_call  # noqa: E402

FUSIONS = ("fuse_attention", "simplify_attention_mask", "fuse_qkv", "fuse_epilogue")
ALIGNMENT = {"fp16": 8, "bf16": 8, "tf32": 4}
WARMUP, REPEATS, REPEAT_S = 3, 5, 0.1
#: BERT-base at batch 64, seq 128 (GPU) and a tiny BERT (``--dry-run`` on the CPU).
SHAPES = {
    "full": {"config": {}, "batch": 64, "seq": 128},
    "tiny": {
        "config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
                   "vocab_size": 1000, "max_position_embeddings": 64},
        "batch": 3, "seq": 16,
    },
}


class BertEncoder(torch.nn.Module):
    """``BertModel`` returning the last hidden state ``(batch, seq, hidden)`` as a plain tensor."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids).last_hidden_state


def arch_name(device: torch.device) -> str:
    """Architecture name for ``PassSpec.arch`` (``"Hopper"`` for sm_90); ``"cpu"`` for the dry run."""
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return {7: "Turing" if minor >= 5 else "Volta", 8: "Ada" if minor >= 9 else "Ampere", 9: "Hopper"}.get(
        major, "Blackwell" if major >= 10 else "unknown"
    )


def time_ms(fn: Callable[[], Any], device: torch.device) -> tuple[float, list[float], int]:
    """Median ms per call over ``REPEATS`` repeats after ``WARMUP`` calls (tctune's own protocol,
    ``tctune.measure.time_call``); returns (median, repeats, iters)."""
    t = time_call(fn, 1, device, warmup=WARMUP, repeats=REPEATS, target_repeat_s=REPEAT_S, single_calls=0)
    return t.latency_ms, t.repeats_ms, t.iterations


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def graph_candidates() -> list[tuple[str, tuple[str, ...]]]:
    """``(label, pass names)``: all passes, no fusions, and PIPELINE without each fusion pass."""
    cands = [("graph: all passes", tuple(PIPELINE)),
             ("graph: no fusions", tuple(n for n in PIPELINE if n not in FUSIONS))]
    cands += [(f"graph: without {f}", tuple(n for n in PIPELINE if n != f)) for f in FUSIONS]
    return cands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_fusion.json", help="JSON file to write (default %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="tiny BERT on the CPU, to check the script")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_fusion: no CUDA GPU here; nothing measured (use --dry-run to check the script on the CPU)")
        return 0
    from transformers import BertConfig, BertModel

    t0 = time.perf_counter()
    device = torch.device("cpu" if args.dry_run else "cuda")
    shape = SHAPES["tiny" if args.dry_run else "full"]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = BertEncoder(BertModel(BertConfig(**shape["config"]), add_pooling_layer=False)).eval().to(device)
    vocab = model.bert.config.vocab_size
    ids = torch.randint(0, vocab, (shape["batch"], shape["seq"]), device=device)
    spec = PassSpec(precision="fp16", alignment=ALIGNMENT, arch=arch_name(device))
    with torch.no_grad():
        ref = model(ids)

    rows: list[dict] = []

    def measure(name: str, fn: Callable[[], torch.Tensor], extra: dict | None = None) -> None:
        try:
            with torch.no_grad():
                out = fn()
            ms, reps, iters = time_ms(fn, device)
            row = {"candidate": name, "ms": round(ms, 4), "seq_per_s": round(shape["batch"] / ms * 1e3, 1),
                   "repeats_ms": [round(r, 4) for r in reps], "iters": iters, "rel_l2": rel_l2(out.float(), ref)}
        except Exception as exc:  # noqa: BLE001 - one failing candidate must not lose the others
            row = {"candidate": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        rows.append({**row, **(extra or {})})

    measure("eager fp32", lambda: model(ids))
    half = copy.deepcopy(model).half()
    measure("eager fp16 (model.half())", lambda: half(ids))
    del half

    def autocast_call() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.float16):
            return model(ids)

    measure("eager autocast fp16", autocast_call)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        captured = capture(model, (ids,))
    for label, names in graph_candidates():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gm = copy.deepcopy(captured)
            results = run_pipeline(gm, spec, names)
        except Exception as exc:  # noqa: BLE001
            rows.append({"candidate": label, "error": f"pass pipeline: {type(exc).__name__}: {exc}"[:400]})
            continue
        counts = {r.name: r.count for r in results}
        measure(label, lambda gm=gm: gm(ids), {"passes": list(names), "rewrites": counts})
        del gm
        if device.type == "cuda":
            torch.cuda.empty_cache()

    by_name = {r["candidate"]: r for r in rows}
    after = by_name.get("graph: all passes", {})
    fusion = {}
    for f in FUSIONS:
        before = by_name.get(f"graph: without {f}", {})
        if "ms" in before and "ms" in after:
            fusion[f] = {"before_ms": before["ms"], "after_ms": after["ms"],
                         "speedup": round(before["ms"] / after["ms"], 3),
                         "rewrites": after.get("rewrites", {}).get(f, 0)}
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "arch": spec.arch,
        "torch": torch.__version__,
        "date": _dt.date.today().isoformat(),
        "model": "BertModel(BertConfig(%s)), random weights, SDPA attention" % (
            "" if not args.dry_run else "tiny"),
        "batch": shape["batch"], "seq": shape["seq"],
        "spec": {"precision": spec.precision, "alignment": spec.alignment, "arch": spec.arch},
        "protocol": f"{WARMUP} warm-up calls, {REPEATS} repeats of ~{REPEAT_S} s, median ms/batch; "
        + ("CUDA events" if device.type == "cuda" else "time.perf_counter")
        + "; TF32 off; rel_l2 vs eager FP32 on the same input_ids",
        "results": rows,
        "fusion_before_after": fusion,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    base = by_name.get("eager fp16 (model.half())", {}).get("ms")
    print(f"{'candidate':38s} {'ms/batch':>9s} {'seq/s':>10s} {'x fp16 eager':>12s} {'rel L2':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['candidate']:38s} ERROR {r['error']}")
            continue
        speed = f"{base / r['ms']:.2f}" if base else "-"
        print(f"{r['candidate']:38s} {r['ms']:9.3f} {r['seq_per_s']:10.1f} {speed:>12s} {r['rel_l2']:9.2e}")
    for f, d in fusion.items():
        print(f"{f:24s} before {d['before_ms']:.3f} ms -> after {d['after_ms']:.3f} ms "
              f"({d['speedup']:.2f}x, {d['rewrites']} rewrites)")
    print(f"wrote {args.out} ({report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
