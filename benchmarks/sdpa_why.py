"""Which attention kernel each ``scaled_dot_product_attention`` call of a zoo model gets, and why not a fused one.

    python benchmarks/sdpa_why.py --models MT5ForConditionalGeneration,T5ForConditionalGeneration --out DIR
    python benchmarks/sdpa_why.py --models BertForMaskedLM --tiny --device cpu --out DIR   # a dry run

Method: the model is built by ``zoo.py`` (random weights, the suite's batch size), cast with ``model.to(dtype)``
and run once in eval mode under a ``TorchFunctionMode`` that records every
``torch.nn.functional.scaled_dot_product_attention`` call: the shapes, strides, dtypes and storage offsets of
``query``, ``key``, ``value`` and ``attn_mask`` and the keyword arguments. Calls with the same signature are one
group (the first call's tensors are kept). For each group:

- ``choice``: the backend PyTorch's dispatcher picks (``torch._fused_sdp_choice``), as an ``SDPBackend`` name;
- ``backends``: each of flash, efficient, cuDNN and math forced alone (``torch.nn.attention.sdpa_kernel``):
  ``ok``, the first line of the error and every warning PyTorch gives for refusing it, and the median
  milliseconds over ``--iters`` calls (CUDA events) when it ran;
- ``variants``: the same call with one input changed the way a graph pass could change it — the mask cast to the
  query's dtype, the mask materialised contiguous at full ``(B, H, L, S)``, the mask dropped (timing only: the
  result differs), q / k / v made contiguous — each with its dispatcher choice and median milliseconds.

Writes ``DIR/sdpa_why.json`` (``{"env", "models": {NAME: {"batch_size", "dtype", "groups": [...]}}}``) and
``DIR/sdpa_why.md`` (one row per group: calls, shapes, mask, choice, ms, best forced backend, best variant).
Timings are of the single call, not of the model; the model's own share is ``calls × ms``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from benchload import load_benchmark

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

zoo = load_benchmark("zoo")


def describe(t) -> dict | None:
    """Shape, stride, dtype, storage offset of tensor ``t`` (``None`` for ``None``; other values by ``repr``)."""
    import torch

    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return {"value": repr(t)}
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).replace("torch.", ""),
            "offset": int(t.storage_offset())}


def record_calls(model, inputs: tuple) -> list[dict]:
    """Every SDPA call of one ``model(*inputs)`` under ``no_grad``, grouped by signature, in first-call order.

    Returns:
        ``[{"signature": str, "calls": int, "args": (q, k, v), "kwargs": dict}, ...]``; ``kwargs`` holds
        ``attn_mask`` (a tensor or ``None``) and the scalar options as passed.
    """
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    groups: dict[str, dict] = {}

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is F.scaled_dot_product_attention:
                names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
                bound = dict(zip(names, args))
                bound.update(kwargs)
                sig = json.dumps({k: (describe(v) if isinstance(v, torch.Tensor) or v is None else repr(v))
                                  for k, v in sorted(bound.items())}, sort_keys=True)
                g = groups.get(sig)
                if g is None:
                    opts = {k: v for k, v in bound.items() if k not in ("query", "key", "value")}
                    groups[sig] = {"signature": sig, "calls": 1,
                                   "args": (bound["query"], bound["key"], bound["value"]), "kwargs": opts}
                else:
                    g["calls"] += 1
            return func(*args, **kwargs)

    with torch.no_grad(), Recorder():
        model(*inputs)
    return list(groups.values())


def _choice(q, k, v, kw: dict) -> str:
    import torch
    from torch.nn.attention import SDPBackend

    try:
        idx = torch._fused_sdp_choice(q, k, v, kw.get("attn_mask"), kw.get("dropout_p", 0.0),
                                      bool(kw.get("is_causal", False)), scale=kw.get("scale"),
                                      **({"enable_gqa": kw["enable_gqa"]} if "enable_gqa" in kw else {}))
    except Exception as exc:  # noqa: BLE001 - recorded
        return f"error: {zoo.one_line(exc)}"
    for name, b in SDPBackend.__members__.items():
        if int(b) == int(idx):
            return name
    return str(idx)


def _median_ms(fn, iters: int, cuda: bool) -> float:
    import torch

    for _ in range(3):
        fn()
    ms = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t) * 1e3)
    ms.sort()
    return ms[len(ms) // 2]


def try_backends(q, k, v, kw: dict, iters: int, cuda: bool) -> dict:
    """Each fused backend and math forced alone: ``{NAME: {"ok", "error", "warnings", "ms"}}``."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
              SDPBackend.MATH):
        rec: dict = {"ok": False}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([b]), torch.no_grad():
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, **kw)  # noqa: E731
                    fn()
                    rec.update(ok=True, ms=_median_ms(fn, iters, cuda))
            except Exception as exc:  # noqa: BLE001 - recorded
                rec["error"] = zoo.one_line(exc)
        rec["warnings"] = sorted({str(w.message).strip()[:400] for w in caught})
        out[b.name] = rec
    return out


def variants(q, k, v, kw: dict) -> dict:
    """The call with one input changed as a graph pass could change it: ``{NAME: (q, k, v, kwargs)}``."""
    out = {}
    m = kw.get("attn_mask")
    if m is not None and m.dtype.is_floating_point and m.dtype != q.dtype:
        out["mask_in_query_dtype"] = (q, k, v, {**kw, "attn_mask": m.to(q.dtype)})
    if m is not None:
        full = (q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]) if q.dim() == 4 else None
        if full is not None:
            mm = m.to(q.dtype) if m.dtype.is_floating_point else m
            out["mask_full_contiguous"] = (q, k, v, {**kw, "attn_mask": mm.expand(full).contiguous()})
        out["no_mask(timing only)"] = (q, k, v, {kk: vv for kk, vv in kw.items() if kk != "attn_mask"})
    if not all(t.is_contiguous() for t in (q, k, v)):
        out["qkv_contiguous"] = (q.contiguous(), k.contiguous(), v.contiguous(), kw)
    return out


def analyse(name: str, args: argparse.Namespace) -> dict:
    import torch

    cuda = args.device.startswith("cuda")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    entry = zoo.select(models=name)[0]
    batch = zoo.scaled_batch(entry.batch_size, args.scale)
    torch.manual_seed(0)
    built = zoo.build(entry, args.tiny, args.seq, args.device)
    model = built.model.to(dt)
    inputs = tuple(x.to(dt) if x.is_floating_point() else x for x in built.make_inputs(batch, args.device, 1234))
    groups = record_calls(model, inputs)
    rows = []
    for g in groups:
        q, k, v = g["args"]
        kw = g["kwargs"]
        with torch.no_grad():
            default_ms = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw),
                                    args.iters, cuda)
        row = {"calls": g["calls"], "query": describe(q), "key": describe(k), "value": describe(v),
               "attn_mask": describe(kw.get("attn_mask")),
               "options": {kk: repr(vv) for kk, vv in kw.items() if kk != "attn_mask"},
               "choice": _choice(q, k, v, kw), "ms": default_ms,
               "backends": try_backends(q, k, v, kw, args.iters, cuda), "variants": {}}
        for vname, (q2, k2, v2, kw2) in variants(q, k, v, kw).items():
            with torch.no_grad():
                ms = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, **kw2),
                                args.iters, cuda)
            row["variants"][vname] = {"choice": _choice(q2, k2, v2, kw2), "ms": ms}
        rows.append(row)
    return {"batch_size": batch, "dtype": args.dtype, "inputs": built.desc, "groups": rows}


def _shape(d: dict | None) -> str:
    if d is None:
        return "–"
    if "shape" not in d:
        return d.get("value", "?")
    return f"{tuple(d['shape'])} {d['dtype']} stride {tuple(d['stride'])}"


def markdown(result: dict) -> str:
    lines = ["| model | calls | query | mask | choice | ms | fastest forced (ms) | refusals | best variant (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, m in result["models"].items():
        if "error" in m:
            lines.append(f"| {name} | – | – | – | error: {m['error']} | | | | |")
            continue
        for g in m["groups"]:
            ran = {b: r["ms"] for b, r in g["backends"].items() if r.get("ok")}
            fastest = min(ran, key=ran.get) if ran else "–"
            refusals = "; ".join(f"{b}: {(r.get('warnings') or [r.get('error', '')])[0][:160]}"
                                 for b, r in g["backends"].items() if not r.get("ok") and b != "MATH")
            best = min(g["variants"].items(), key=lambda kv: kv[1]["ms"]) if g["variants"] else None
            lines.append(
                f"| {name} | {g['calls']} | {_shape(g['query'])} | {_shape(g['attn_mask'])} | {g['choice']} | "
                f"{g['ms']:.3f} | {fastest} ({ran.get(fastest, float('nan')):.3f}) | {refusals} | "
                + (f"{best[0]} → {best[1]['choice']} ({best[1]['ms']:.3f})" if best else "–") + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", required=True, help="comma-separated zoo model names (zoo.py --list)")
    p.add_argument("--out", type=Path, required=True, help="output folder for sdpa_why.json / .md")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the suite's batch size")
    p.add_argument("--seq", type=int, default=512, help="sequence-length cap for text models (512)")
    p.add_argument("--tiny", action="store_true", help="tiny Hugging Face configs (a CPU dry run)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement; the median is kept")
    args = p.parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = {"env": zoo._env(), "models": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        try:
            result["models"][name] = analyse(name, args)
        except Exception as exc:  # noqa: BLE001 - recorded, the next model still runs
            result["models"][name] = {"error": zoo.one_line(exc)}
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        (args.out / "sdpa_why.json").write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    (args.out / "sdpa_why.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
