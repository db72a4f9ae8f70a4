"""FP8 through the tctune backend with and without ``torch._scaled_mm``'s fast accumulation, against Inductor bf16.

Models (``transformers``, built from their config classes with random weights, nothing downloaded):

- ``gpt2``: ``GPT2LMHeadModel(GPT2Config())`` (124 M parameters, ``use_cache=False``), batch 8, sequence 1024,
  output the LM logits;
- ``bert``: ``BertForMaskedLM(BertConfig())`` (BERT-base), batch 32 (the Hugging Face suite's default batch
  size of ``BertForMaskedLM`` in ``pytorch/pytorch`` ``benchmarks/dynamo``), sequence 512, output the MLM logits.

Variants per model, in one process:

- ``fp32_eager``: the reference outputs (not timed);
- ``inductor_bf16``: ``torch.compile(model.to(torch.bfloat16))``;
- ``tctune_fp8``: ``torch.compile(model, backend="tctune", options={"precision": "fp8", "policy": P,
  "fp8_keep": K, "fp8_fast_accum": False, "output_dtype": "compute"})``;
- ``tctune_fp8_fast``: the same with ``"fp8_fast_accum": True``.

Protocol: each variant is compiled by its first call (timed as ``compile_s``); then the timed variants run
interleaved (``benchmarks/zoo.py``'s ``time_interleaved``: two warm-up calls, one calibration call, then
``--repeats`` blocks of CUDA-event-timed calls, the order reversed every other repeat), median ms per batch.
With ``--cudagraphs`` every compiled variant is captured as one CUDA graph first (``zoo.cuda_graph``), both
sides alike. Error: relative L2 against FP32 eager on the same inputs (``zoo.rel_err``, float64), for each
variant. The backend's subgraph reports say whether FP8 ran (``cast_fp8_linears`` rewrites, and the
``use_fast_accum`` they were built with) or it fell back. Each ``torch.compile`` call is its own backend
callable, so Dynamo's BACKEND_MATCH guard keeps one compiled graph per variant (checked on the CPU, torch 2.13,
``TORCH_LOGS=recompiles``).

Writes ``OUT/fp8_accum.json`` (``{"device", "torch", "date", "args", "models": {name: {"batch", "seq",
"variants": {variant: {"ok", "error", "compile_s", "ms", "items_per_s", "repeats_ms", "rel_err", "nonfinite",
"fp8_gemms", "fast_accum_in_graph", "fallbacks"}}, "fast_vs_full", "fp8_vs_inductor_bf16",
"fast_vs_inductor_bf16"}}}``) and
``OUT/fp8_accum.md`` (one table row per model and variant).

Usage::

    python benchmarks/bench_fp8_accum.py --out benchmarks/results/fp8_accum_h200     # an sm_89+ GPU
    python benchmarks/bench_fp8_accum.py --tiny --device cpu --out /tmp/fa           # CPU smoke run

On the CPU (or a GPU older than sm_89) the backend runs its FP8 variants at bf16 with a warning, so the two
tctune rows measure the same graph; ``--tiny`` uses 2-layer, 64-wide configs. Budget on an H200 (torch 2.11):
about 4 minutes for both models (six Inductor compiles).
"""
from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import math
import sys
import time
from pathlib import Path

from benchload import load_benchmark

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

MODELS = ("gpt2", "bert")
VARIANTS = ("inductor_bf16", "tctune_fp8", "tctune_fp8_fast")
#: (batch, sequence) per model unless overridden: GPT-2 as the task asks, BERT at the HF suite's batch 32.
DEFAULT_SIZES = {"gpt2": (8, 1024), "bert": (32, 512)}
TINY_SIZES = {"gpt2": (2, 32), "bert": (2, 32)}
TINY_CONFIG = {"n_layer": 2, "n_embd": 64, "n_head": 4, "num_hidden_layers": 2, "hidden_size": 64,
               "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 1000}


def _zoo():
    """``benchmarks/zoo.py`` (its timing and error helpers), loaded once."""
    return load_benchmark("zoo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring).

    Raises:
        SystemExit: a bad flag (argparse's message), an unknown model, or a non-positive size.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for fp8_accum.json and fp8_accum.md")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--batch", type=int, default=None, help="batch size for every model (default per model)")
    p.add_argument("--seq", type=int, default=None, help="sequence length for every model (default per model)")
    p.add_argument("--policy", default="pure", choices=("pure", "autocast"), help="the backend's cast policy")
    p.add_argument("--fp8-keep", default="", help="comma list of fnmatch patterns whose linears stay bf16")
    p.add_argument("--repeats", type=int, default=15, help="timed blocks per variant (median taken)")
    p.add_argument("--repeat-s", type=float, default=0.2, help="seconds per timed block")
    p.add_argument("--cudagraphs", action="store_true", help="capture every compiled variant as a CUDA graph")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="2-layer, 64-wide configs (a smoke run)")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad or not args.models:
        p.error(f"--models: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(MODELS)}")
    for name in ("batch", "seq", "repeats"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name} must be positive, got {v}")
    args.fp8_keep = [k.strip() for k in args.fp8_keep.split(",") if k.strip()]
    return args


def sizes(args: argparse.Namespace, model: str) -> tuple[int, int]:
    """(batch, sequence) of ``model``: ``--batch`` / ``--seq`` when given, else its default (tiny with --tiny)."""
    batch, seq = (TINY_SIZES if args.tiny else DEFAULT_SIZES)[model]
    return args.batch or batch, args.seq or seq


def build(name: str, tiny: bool, device: str):
    """``(fp32 eval model returning the logits tensor, vocabulary size)`` for ``name``, random weights."""
    import torch
    import transformers

    if name == "gpt2":
        cfg_cls, model_cls = transformers.GPT2Config, transformers.GPT2LMHeadModel
    else:
        cfg_cls, model_cls = transformers.BertConfig, transformers.BertForMaskedLM
    defaults = cfg_cls().to_dict()
    kwargs = {k: v for k, v in TINY_CONFIG.items() if k in defaults} if tiny else {}
    if "use_cache" in defaults:
        kwargs["use_cache"] = False
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**kwargs)).eval().to(device)

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids).logits

    return Logits(hf).eval(), int(hf.config.vocab_size)


def summarize(variants: dict[str, dict]) -> dict:
    """The ratios of one model's timed variants (speedups: > 1 means the first is faster), None where a side
    did not run: ``fast_vs_full`` (tctune_fp8_fast over tctune_fp8), ``fp8_vs_inductor_bf16``,
    ``fast_vs_inductor_bf16``."""
    def ratio(a: str, b: str):
        ma, mb = (variants.get(a) or {}).get("ms"), (variants.get(b) or {}).get("ms")
        return round(mb / ma, 4) if ma and mb else None

    return {"fast_vs_full": ratio("tctune_fp8_fast", "tctune_fp8"),
            "fp8_vs_inductor_bf16": ratio("tctune_fp8", "inductor_bf16"),
            "fast_vs_inductor_bf16": ratio("tctune_fp8_fast", "inductor_bf16")}


def table(result: dict) -> str:
    """Markdown: one row per model and variant (ms per batch, items/s, error vs FP32, FP8 GEMMs, speedups)."""
    lines = [f"FP8 fast accumulation, {result.get('device')} (torch {result.get('torch')}, {result.get('date')}); "
             f"policy {result.get('args', {}).get('policy')}, CUDA graphs: {result.get('args', {}).get('cudagraphs')}",
             "", "| model | batch x seq | variant | ms / batch | items/s | rel. error vs FP32 | FP8 GEMMs | "
             "vs inductor_bf16 | note |", "|---|---|---|---|---|---|---|---|---|"]

    def fmt(v, spec):
        return "–" if v is None else format(v, spec)

    for name, m in result.get("models", {}).items():
        base = (m["variants"].get("inductor_bf16") or {}).get("ms")
        for v in VARIANTS:
            row = m["variants"].get(v) or {}
            speed = round(base / row["ms"], 3) if base and row.get("ms") else None
            note = row.get("error") or "; ".join(row.get("fallbacks") or []) or ""
            lines.append(f"| {name} | {m['batch']} x {m['seq']} | {v} | {fmt(row.get('ms'), '.3f')} | "
                         f"{fmt(row.get('items_per_s'), ',.0f')} | {fmt(row.get('rel_err'), '.2e')} | "
                         f"{fmt(row.get('fp8_gemms'), 'd')} | {fmt(speed, '.3f')} | {note[:120]} |")
        lines.append(f"| {name} | | fast / full accumulation | | | | | {fmt(m.get('fast_vs_full'), '.3f')} | |")
    return "\n".join(lines) + "\n"


def _variant_fn(name: str, model, args, policy: str, keep: list[str]):
    """The compiled callable of variant ``name`` (compiled lazily by its first call)."""
    import torch

    if name == "inductor_bf16":
        return torch.compile(copy.deepcopy(model).to(torch.bfloat16))
    opts = {"precision": "fp8", "policy": policy, "fp8_keep": keep, "output_dtype": "compute",
            "fp8_fast_accum": name == "tctune_fp8_fast"}
    import tctune.backend as tb

    # The registered name needs tctune installed (its entry point); the function works from a checkout too.
    backend = "tctune" if "tctune" in torch._dynamo.list_backends() else tb.tctune_backend
    return torch.compile(copy.deepcopy(model), backend=backend, options=opts)


def run_model(name: str, args: argparse.Namespace) -> dict:
    """Build, compile, check and time every variant of one model (one failing variant records its error)."""
    import torch

    import tctune.backend as tb

    zoo = _zoo()
    cuda = args.device == "cuda"
    batch, seq = sizes(args, name)
    model, vocab = build(name, args.tiny, args.device)
    gen = torch.Generator(device="cpu").manual_seed(1234 + batch)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(args.device)
    with torch.inference_mode():
        ref = model(ids).float()
    variants: dict[str, dict] = {}
    fns = {}
    for v in VARIANTS:
        row = {"ok": False, "error": None, "compile_s": None, "ms": None, "items_per_s": None, "repeats_ms": [],
               "rel_err": None, "nonfinite": None, "fp8_gemms": None, "fast_accum_in_graph": None,
               "fallbacks": []}
        variants[v] = row
        tb.reset()
        try:
            fn = _variant_fn(v, model, args, args.policy, args.fp8_keep)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = fn(ids)
                if cuda:
                    torch.cuda.synchronize()
                row["compile_s"] = round(time.perf_counter() - t0, 2)
                if args.cudagraphs and cuda:
                    fn = zoo.cuda_graph(fn, (ids,))
                    out = fn(ids)
            row.update(zoo.rel_err(out.float(), ref))
            if v != "inductor_bf16":
                row["fp8_gemms"] = sum(r.count("cast_fp8_linears") for r in tb.reports)
                flags = {res.notes.get("fast_accum") for r in tb.reports for res in r.results
                         if res.name == "cast_fp8_linears" and res.count}
                row["fast_accum_in_graph"] = flags.pop() if len(flags) == 1 else None  # what the GEMMs were built with
                row["fallbacks"] = sorted({r.fallback for r in tb.reports if r.fallback})
            fns[v] = (fn, (ids,))
            row["ok"] = True
        except Exception as exc:  # noqa: BLE001 - one variant failing leaves the others
            row["error"] = zoo.one_line(exc)
    if fns:
        with torch.inference_mode():
            timed = zoo.time_interleaved(fns, cuda, repeats=args.repeats, repeat_s=args.repeat_s)
        for v, t in timed.items():
            variants[v].update(ms=round(t["ms"], 4), repeats_ms=t["repeats_ms"],
                               items_per_s=round(batch / (t["ms"] / 1e3), 1))
    return {"batch": batch, "seq": seq, "variants": variants, **summarize(variants)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_fp8_accum: no CUDA GPU here; run on an sm_89+ GPU, or --device cpu --tiny for a smoke run")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    result = {"device": device, "torch": torch.__version__,
              "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "args": {k: v for k, v in vars(args).items()}, "models": {}}
    for name in args.models:
        result["models"][name] = run_model(name, args)
        (out / "fp8_accum.json").write_text(json.dumps(result, indent=1, default=str) + "\n")  # after each model
    (out / "fp8_accum.md").write_text(table(result))
    print(table(result))
    return 0 if all(math.isfinite(r.get("rel_err") or 0.0) for m in result["models"].values()
                    for r in m["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
